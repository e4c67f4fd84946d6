"""The repository passes ``ruff check`` with the configuration in pyproject.toml."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers.paths import ROOT


def test_ruff_check_is_clean() -> None:
    ruff = pytest.importorskip("ruff.__main__", reason="ruff is not installed")
    result = subprocess.run(
        [ruff.find_ruff_bin(), "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"ruff check found problems:\n{result.stdout}{result.stderr}"
