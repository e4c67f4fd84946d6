"""tools/convert_checkpoint.py run as a script from any directory, without PYTHONPATH: bad input
is one line with exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.checkpointing.test_convert_checkpoint import SCRIPT


@pytest.mark.e2e
def test_script_runs_from_any_directory(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--from", "hf", "--to", "megatron_h2", "--input",
         str(tmp_path / "nowhere"), "--output", str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr == f"error: input directory {tmp_path / 'nowhere'} does not exist\n"
