"""The repository passes ``ruff check`` with the configuration in pyproject.toml."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_ruff_check_is_clean() -> None:
    ruff = pytest.importorskip("ruff.__main__", reason="ruff is not installed")
    result = subprocess.run(
        [ruff.find_ruff_bin(), "check", "--no-cache", "--output-format", "concise", "."],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"ruff check found problems:\n{result.stdout}{result.stderr}"
