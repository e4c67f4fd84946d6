"""pretrain_gpt.py run as a script: bad flags end it with one line and exit status 2, no
traceback."""

import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT


@pytest.mark.e2e
def test_script_prints_one_line_without_traceback():
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--hidden-size", "100",
                           "--num-attention-heads", "8"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: --hidden-size 100 is not divisible by "
                                   "--num-attention-heads 8; choose a hidden size that is a "
                                   "multiple of the heads or set --kv-channels")
