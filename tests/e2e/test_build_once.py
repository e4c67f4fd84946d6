"""Shared caches are built once when several processes ask at the same time
(megatron_h2.data.build_lock): the embedded corpus and the dataset index cache, with real
processes started together, and a builder killed while holding the lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.e2e  # every test here starts processes

SMALL = dict(vocab_size=400, max_bytes=150_000)

# Waits for a common start time, builds (or reuses) the corpus, prints the paths and the
# SHA-256 of every file it got as one JSON line.
CORPUS_CHILD = """
import hashlib, json, os, sys, time
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.005)
from megatron_h2.data.default_corpus import ensure_default_corpus
prefix, model = ensure_default_corpus(sys.argv[1], vocab_size=400, max_bytes=150_000)
files = [prefix + ".bin", prefix + ".idx", model]
digest = {f: hashlib.sha256(open(f, "rb").read()).hexdigest() for f in files}
print(json.dumps({"prefix": prefix, "model": model, "sha256": digest}), flush=True)
"""

# Takes the corpus lock, says so, and hangs in the build until it is killed.
HANGING_BUILDER = """
import sys, time
from megatron_h2.data import default_corpus

def hang(staging, vocab_size, max_bytes):
    print("holding the lock", flush=True)
    time.sleep(600)

default_corpus._build = hang
default_corpus.ensure_default_corpus(sys.argv[1], vocab_size=400, max_bytes=150_000)
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _start(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    return out


def test_four_processes_starting_at_once_build_the_corpus_once(tmp_path):
    start = f"{time.time() + 5.0:.3f}"  # after every interpreter has started
    procs = [_start(CORPUS_CHILD, str(tmp_path), start) for _ in range(4)]
    outputs = [_finish(proc) for proc in procs]
    text = "".join(outputs)
    assert text.count("building default corpus:") == 1, text
    assert text.count("tokenizer in") == 1 and text.count("default corpus ready:") == 1
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert all(r == results[0] for r in results)  # the same paths and the same bytes
    assert os.path.isfile(os.path.join(os.path.dirname(results[0]["prefix"]), "DONE.json"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".staging")]


def test_a_killed_builder_does_not_block_the_others(tmp_path):
    builder = _start(HANGING_BUILDER, str(tmp_path))
    try:
        assert builder.stdout.readline().strip() == "holding the lock"
        waiter = _start(CORPUS_CHILD, str(tmp_path), "0")
        time.sleep(2.0)
        assert waiter.poll() is None  # waits while the builder holds the lock
    finally:
        builder.send_signal(signal.SIGKILL)
        builder.communicate()
    out = _finish(waiter)  # takes over once the builder is gone and builds it itself
    assert out.count("building default corpus:") == 1
    result = json.loads(out.strip().splitlines()[-1])
    folder = os.path.dirname(result["prefix"])
    assert sorted(os.listdir(folder)) == ["DONE.json", "stdlib_text_document.bin",
                                          "stdlib_text_document.idx", "tokenizer.model",
                                          "tokenizer.vocab"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".staging")]  # crash leftovers


# Builds train / valid datasets on a shared index cache folder, as each job's rank 0 does.
INDEX_CHILD = """
import json, sys, time
start = float(sys.argv[3])
while time.time() < start:
    time.sleep(0.005)
from megatron_h2.data import gpt_dataset
from megatron_h2.data.gpt_dataset import build_gpt_datasets
built = []
original = gpt_dataset.GPTDataset._build_indices
def counting(self):
    built.append(self.split_name)
    return original(self)
gpt_dataset.GPTDataset._build_indices = counting
train, valid, _ = build_gpt_datasets([sys.argv[1]], "90,10,0", 16, 1234, (400, 40, 0),
                                     cache_dir=sys.argv[2])
print(json.dumps({"built": built, "train": [int(x) for x in train.shuffle_index[:50]],
                  "sample": [int(x) for x in train[7]]}), flush=True)
"""


def test_two_jobs_sharing_an_index_cache_build_it_once(corpus, tmp_path):
    cache = tmp_path / "index_cache"
    start = f"{time.time() + 5.0:.3f}"
    procs = [_start(INDEX_CHILD, corpus, str(cache), start) for _ in range(3)]
    results = [json.loads(_finish(proc).strip().splitlines()[-1]) for proc in procs]
    built = sorted(split for r in results for split in r["built"])
    assert built == ["train", "valid"]  # each split's indices built by exactly one process
    assert all(r["train"] == results[0]["train"] for r in results)
    assert all(r["sample"] == results[0]["sample"] for r in results)
    arrays = [np.load(cache / name) for name in sorted(os.listdir(cache)) if name.endswith(".npy")]
    assert len(arrays) == 6 and all(a.size > 0 for a in arrays)
