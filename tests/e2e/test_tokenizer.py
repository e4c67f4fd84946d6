"""tools/train_tokenizer.py run as a script trains a SentencePiece model from local text."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT
from tests.unit.data.test_tokenizer import _texts


@pytest.mark.e2e
def test_train_tokenizer_script_runs_standalone(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(_texts(100)))
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input", str(data),
         "--vocab-size", "300", "--model-prefix", str(tmp_path / "t")],
        capture_output=True, text=True, cwd=str(tmp_path), timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert os.path.isfile(tmp_path / "t.model")
