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


def _train(name: str, flags: list[str], corpus: dict[str, str], tmp_path: Path) -> str:
    """Three iterations under torchrun, logged and checkpointed at iteration 3; returns what
    the run printed."""
    argv = _fill(flags, {**corpus, RUN: str(tmp_path)})
    log = tmp_path / "log.jsonl"
    proc = torchrun(SCRIPTS[name][0], [*argv, "--log-jsonl", str(log)], timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses)
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    return proc.stdout


def _check_expert_parallel(stdout: str, ckpt: Path, stages: int, experts: int, ep: int) -> None:
    """The run held each MoE layer's experts split over EP ranks: the layout says so, and the
    checkpoint's part ``stage + 1000 x r`` holds EP rank ``r``'s experts of the stage's layer
    (one layer per stage) and no other expert."""
    from safetensors import safe_open

    for stage in range(stages):
        assert f"stage {stage}: chip" in stdout and f"| EP {ep} (expert TP 1)" in stdout
        for ep_rank in range(ep):
            part = ckpt / f"model_{stage + 1000 * ep_rank:05d}.safetensors"
            with safe_open(str(part), "pt") as fh:
                held = {int(k.split("local_experts.")[1].split(".")[0])
                        for k in fh.keys() if "local_experts." in k}
                layers = {int(k.split("layers.")[1].split(".")[0])
                          for k in fh.keys() if "local_experts." in k}
            per = experts // ep
            assert held == set(range(ep_rank * per, (ep_rank + 1) * per)), (part, held)
            assert layers == {stage}, (part, layers)


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
    stdout = _train(name, _on_cpu(SCRIPTS[name][1]), gpt2_corpus, tmp_path)
    if name == "mixtral_8x7b":  # PP 4 x DP 2 on 8 processes, EP 2 of the 4 experts
        _check_expert_parallel(stdout, tmp_path / "ckpt" / "iter_0000003", stages=4,
                               experts=4, ep=2)
