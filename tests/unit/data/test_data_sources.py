"""Megatron's data sources and data flags: --mock-data, --train/valid/test-data-path,
--no-mmap-bin-files, --split as Megatron parses it, the GPT-2 tokenizer as pretrain_gpt.py's
default, and a start-up line for tokenizer flags that do nothing."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from megatron_h2.data import (
    IndexedDataset,
    build_gpt_datasets,
    build_mock_gpt_datasets,
    build_per_split_datasets,
)
from megatron_h2.data.mock_dataset import MockLowLevelDataset
from megatron_h2.training.main import main

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr", "3e-3", "--seed", "11", "--log-interval", "1", "--eval-iters", "1",
         "--eval-interval", "3", "--train-iters", "3"]
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_mock_documents_are_megatrons():
    """Lengths drawn once with NumPy's generator (seed 0) in [1, 4096); document = 1..n-1
    (modulo the vocabulary) then eod."""
    mock = MockLowLevelDataset(vocab_size=100, eod=99)
    lengths = np.random.default_rng(seed=0).integers(low=1, high=4096, size=100000,
                                                     dtype=np.int32)
    assert len(mock) == 100000 and (mock.sequence_lengths == lengths).all()
    n = int(lengths[7])
    assert mock[7].tolist() == [(i + 1) % 100 for i in range(n - 1)] + [99]
    assert mock.get(7, 3, 4).tolist() == mock[7][3:7].tolist()
    train, valid, test = build_mock_gpt_datasets(100, 99, 16, 5, (20, 4, 0))
    assert test is None and len(train) == 20 and len(valid) == 4
    assert train.document_range == (0, 33333) and valid.document_range == (33333, 66667)
    sample = train[0]
    assert sample.shape == (17,) and sample.max() <= 99
    steps = np.diff(sample)  # consecutive tokens count up, except across eod / wrap-around
    assert ((steps == 1) | (sample[1:] == 99) | (sample[:-1] == 99) | (sample[1:] == 0)).all()


def test_mock_data_run_needs_no_files(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "log.jsonl"
    assert main([*MODEL, "--mock-data", *NULL, "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
                 "--no-create-attention-mask-in-dataloader", "--log-jsonl", str(log)]) == 0
    out = capsys.readouterr().out
    assert "data: mock data (Megatron's MockGPTDataset) | split 1,1,1" in out
    assert ("no effect: --tiktoken-pattern (only TikTokenizer); --split (mock data is split "
            "1,1,1, as in Megatron)") in out
    assert "vocab 256 (padded 256)" in out  # NullTokenizer(256): ids 0..255, eod 255
    assert [r["iteration"] for r in rows(log) if "lm_loss" in r] == [1, 2, 3]
    assert "val_loss" in rows(log)[-1]
    assert sorted(os.listdir(tmp_path)) == ["log.jsonl"]  # no index cache written anywhere


def _mapped(path: str) -> bool:
    return os.path.abspath(path) in Path("/proc/self/maps").read_text()


def test_no_mmap_bin_files_reads_the_same_tokens_without_mapping(corpus, tmp_path):
    import gc
    import shutil

    copy = str(tmp_path / "copy_text_document")  # a path no other test maps
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus + suffix, copy + suffix)
    read = IndexedDataset(copy, mmap=False)
    assert not _mapped(copy + ".bin")
    mapped = IndexedDataset(copy)
    assert _mapped(copy + ".bin")
    for i in (0, 5, len(read) - 1):
        assert read[i].tolist() == mapped[i].tolist()
        assert read.get(i, 2, 3).tolist() == mapped.get(i, 2, 3).tolist()
    del mapped
    gc.collect()
    assert not _mapped(copy + ".bin") and read[3].tolist() == IndexedDataset(corpus)[3].tolist()
    kwargs = dict(split="90,10,0", seq_length=16, seed=1, num_samples=(30, 0, 0),
                  cache_dir=str(tmp_path / "cache"))
    train, _, _ = build_gpt_datasets([copy], **kwargs)
    plain, _, _ = build_gpt_datasets([copy], mmap_bin_files=False, **kwargs)
    assert not plain.indexed_dataset.mmap
    assert all((train[i] == plain[i]).all() for i in range(30))


def test_no_mmap_run_and_quoted_split(corpus, tmp_path):
    common = [*MODEL, *NULL, "--data-path", corpus, "--data-cache-path", str(tmp_path)]
    assert main([*common, "--split", "'90,10,0'", "--log-jsonl", str(tmp_path / "a")]) == 0
    assert main([*common, "--split", "90, 10, 0", "--no-mmap-bin-files",
                 "--log-jsonl", str(tmp_path / "b")]) == 0
    losses = [[(r["lm_loss"], r.get("val_loss")) for r in rows(tmp_path / name)]
              for name in "ab"]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_per_split_paths_use_whole_datasets(corpus, tmp_path):
    train, valid, test = build_per_split_datasets(([corpus], [], [corpus]), 16, 1, (40, 0, 8),
                                                  cache_dir=str(tmp_path))
    whole = (0, len(IndexedDataset(corpus)))
    assert valid is None and train.document_range == whole == test.document_range
    assert train.split_name == "train" and test.split_name == "test"
    log = tmp_path / "log.jsonl"
    assert main([*MODEL, *NULL, "--train-data-path", corpus, "--valid-data-path", "1", corpus,
                 "--data-cache-path", str(tmp_path), "--log-jsonl", str(log)]) == 0
    assert "val_loss" in rows(log)[-1]


def test_gpt2_tokenizer_is_the_default(corpus, tmp_path, capsys):
    """pretrain_gpt.py's default tokenizer is GPT2BPETokenizer, which needs its files."""
    from tests.helpers.tokenizer_files import gpt2_files

    assert main([*MODEL, "--data-path", corpus]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: GPT2BPETokenizer (the default --tokenizer-type) needs --vocab-file"
    vocab, merges = gpt2_files(tmp_path / "gpt2")
    assert main([*MODEL, "--data-path", corpus, "--vocab-file", vocab, "--merge-file", merges,
                 "--split", "90,10,0", "--data-cache-path", str(tmp_path)]) == 0
    assert f"vocab {len(json.load(open(vocab)))} (padded 384)" in capsys.readouterr().out


@pytest.mark.parametrize("flags, fragment", [
    (["--mock-data", "--tokenizer-type", "NullTokenizer"], "NullTokenizer needs --vocab-size"),
    (["--train-data-path", "/nowhere/x_text_document", *NULL], "x_text_document.bin not found"),
    (["--mock-data", *NULL, "--null-tokenizer-eod-id", "256"], "outside the vocabulary"),
])
def test_bad_data_flags_are_one_line(flags, fragment, capsys):
    assert main([*MODEL, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and fragment in err and "\n" not in err
