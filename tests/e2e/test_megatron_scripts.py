"""Megatron-LM's own command lines train unchanged: each script's flags
(tests/unit/training/test_megatron_scripts.py), shrunk only in sizes, with local data and
tokenizer files, train 3 iterations on CPU under torchrun (FP8 / Transformer Engine flags
dropped; TP 2 / PP 2 where the script has them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.dist_utils import torchrun
from tests.helpers.paths import ROOT
from tests.helpers.tokenizer_files import gpt2_files, texts
from tests.unit.training.test_megatron_scripts import DATA, MERGES, RUN, SCRIPTS, VOCAB, _fill


@pytest.fixture(scope="module")
def gpt2_corpus(tmp_path_factory) -> dict[str, str]:
    """A corpus preprocessed with a GPT-2 BPE tokenizer by tools/preprocess_data.py, as
    Megatron's scripts expect (--vocab-file / --merge-file)."""
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("gpt2_corpus")
    vocab, merges = gpt2_files(folder / "tok")
    with open(folder / "docs.jsonl", "w") as fh:
        for text in texts(400, seed=1):
            fh.write(json.dumps({"text": text}) + "\n")
    subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input",
                    str(folder / "docs.jsonl"), "--output-prefix", str(folder / "corpus"),
                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                    "--merge-file", merges, "--append-eod", "--workers", "1"],
                   check=True, capture_output=True)
    return {DATA: str(folder / "corpus_text_document"), VOCAB: vocab, MERGES: merges}


def _train(name: str, flags: list[str], corpus: dict[str, str], tmp_path: Path) -> None:
    """Three iterations under torchrun, logged and checkpointed at iteration 3."""
    argv = _fill(flags, {**corpus, RUN: str(tmp_path)})
    log = tmp_path / "log.jsonl"
    proc = torchrun(SCRIPTS[name][0], [*argv, "--log-jsonl", str(log)], timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


GPU_KERNELS = {("--attention-backend", "fused")}
"""Flag values that pick kernels only GPUs have (cuDNN / memory-efficient fused attention): on
this CPU they are refused at start-up in one line
(tests/unit/devices/test_attention_backends.py), so the CPU runs drop them, as they drop the
FP8 / Transformer Engine flags."""

def _on_cpu(flags: list[str]) -> list[str]:
    out: list[str] = []
    for token in flags:
        if out and (out[-1], token) in GPU_KERNELS:
            out.pop()
        else:
            out.append(token)
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_trains_three_iterations(name, gpt2_corpus, tmp_path):
    _train(name, _on_cpu(SCRIPTS[name][1]), gpt2_corpus, tmp_path)
