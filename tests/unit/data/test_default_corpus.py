"""The embedded stdlib corpus (megatron_h2.data.default_corpus), built small to stay fast."""

from __future__ import annotations

import json
import os
import sysconfig

import numpy as np
import pytest

from megatron_h2.data import default_corpus
from megatron_h2.data.default_corpus import (
    DONE_MARKER,
    TOKENIZER_TYPE,
    ensure_default_corpus,
    select_sources,
    split_documents,
    stdlib_source_files,
)
from megatron_h2.data.gpt_dataset import build_gpt_datasets
from megatron_h2.data.indexed_dataset import IndexedDataset
from megatron_h2.data.tokenizer import build_tokenizer
from megatron_h2.errors import ConfigError

SMALL = dict(vocab_size=400, max_bytes=150_000)


def test_builds_once_and_reuses(tmp_path, capsys, monkeypatch):
    prefix, model = ensure_default_corpus(str(tmp_path), **SMALL)
    out = capsys.readouterr().out
    assert "building default corpus:" in out and "MB" in out and "tokenizer in" in out
    assert prefix.endswith("stdlib_text_document") and model.endswith(".model")
    folder = os.path.dirname(prefix)
    info = json.load(open(os.path.join(folder, DONE_MARKER)))
    assert 0 < info["bytes"] <= SMALL["max_bytes"] and info["documents"] > info["files"] > 0
    tokenizer = build_tokenizer(TOKENIZER_TYPE, model)
    dataset = IndexedDataset(prefix)
    assert tokenizer.vocab_size == 400 and dataset.dtype == np.uint16
    assert len(dataset) == info["documents"]
    ends = [int(dataset[i][-1]) for i in range(len(dataset))]
    assert ends == [tokenizer.eod] * len(dataset)
    text = "".join(tokenizer.detokenize(dataset[i][:-1]) for i in range(len(dataset)))
    assert "def " in text and "import " in text
    left = sorted(os.listdir(os.path.dirname(folder)))  # no staging left, only the build's lock
    assert left == [os.path.basename(folder), os.path.basename(folder) + ".lock"]

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt a finished corpus")

    monkeypatch.setattr(default_corpus, "_build", fail)
    assert ensure_default_corpus(str(tmp_path), **SMALL) == (prefix, model)
    assert "building" not in capsys.readouterr().out
    datasets = build_gpt_datasets([prefix], "949,50,1", 32, 0, (10, 2, 0))
    assert datasets[0][0].shape == (33,)


def test_crash_leaves_no_finished_looking_cache(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while tokenizing")

    monkeypatch.setattr(default_corpus, "preprocess_jsonl", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ensure_default_corpus(str(tmp_path), **SMALL)
    assert [n for n in os.listdir(tmp_path) if not n.endswith(".lock")] == []
    monkeypatch.undo()
    final = tmp_path / os.path.basename(default_corpus._corpus_dir(str(tmp_path), **SMALL))
    final.mkdir()
    (final / "stdlib_text_document.bin").write_bytes(b"partial")  # an old half-written folder
    prefix, _ = ensure_default_corpus(str(tmp_path), **SMALL)
    assert len(IndexedDataset(prefix)) > 0 and (final / DONE_MARKER).is_file()


def test_source_selection_is_deterministic_and_bounded():
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_source_files(root)
    assert files == sorted(files) and len(files) > 100
    parts = [set(f.split(os.sep)) for f in files]
    assert not any(p & {"site-packages", "test", "tests", "__pycache__"} for p in parts)
    first = select_sources(root, files, 100_000)
    assert first == select_sources(root, list(reversed(files)), 100_000)
    assert 0 < sum(len(t.encode()) for _, t in first) <= 100_000


def test_split_documents_cuts_at_top_level():
    text = "".join(f"def f{i}():\n    return {i}\n\n" for i in range(200))
    documents = list(split_documents(text, target_bytes=100))
    assert "".join(documents) == text and len(documents) > 10
    assert all(d.startswith("def ") for d in documents)


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=100), "vocab_size"),
    (dict(vocab_size="4096"), "vocab_size"),
    (dict(max_bytes=10), "max_bytes"),
])
def test_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ensure_default_corpus(str(tmp_path), **kwargs)
    assert not os.listdir(tmp_path)
