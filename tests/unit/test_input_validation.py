"""Input checked where it is opened: token ids against the vocabulary (a cached scan), dataset
index caches that cannot be right, binary plan / cluster files."""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from megatron_h2.data import check_token_ids
from megatron_h2.data.gpt_dataset import GPTDataset
from megatron_h2.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import HeteroPlan
from megatron_h2.planner.cluster import Cluster
from megatron_h2.training.main import main
from tests.helpers.tiny_runs import flags


def _write(prefix: Path, docs: list[list[int]], dtype=np.int32) -> str:
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype)
    for doc in docs:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def test_token_ids_beyond_the_vocabulary_are_one_line_before_training(corpus, tmp_path,
                                                                      capsys):
    """The corpus holds ids up to 255; a tokenizer of 100 ids cannot have made it (unchecked,
    TP 1 would fail with an IndexError traceback and TP 2 train silently on wrong inputs)."""
    argv = flags(corpus, tmp_path, "--train-iters", "2", "--lr-warmup-iters", "1")
    argv[argv.index("--vocab-size") + 1] = "100"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: dataset {corpus} holds token id 255 but the tokenizer "
                   "(NullTokenizer) has 100 ids (0..99); preprocess the data with this "
                   "tokenizer, or pass the tokenizer (--tokenizer-model / --vocab-size) it was "
                   "made with")


def test_the_token_scan_runs_once_per_corpus(tmp_path, monkeypatch):
    prefix = _write(tmp_path / "c", [[1, 2, 3], [4, 5, 60]])
    calls = []
    real = IndexedDataset.token_range
    monkeypatch.setattr(IndexedDataset, "token_range",
                        lambda self, *a: calls.append(1) or real(self, *a))
    check_token_ids(prefix, 61)
    check_token_ids(prefix, 61)
    assert len(calls) == 1 and glob.glob(str(tmp_path / "cache" / "*-token_range.json"))
    with pytest.raises(ConfigError, match="holds token id 60 but the tokenizer has 60 ids"):
        check_token_ids(prefix, 60)
    assert len(calls) == 1  # the cached figure answers a different vocabulary too
    _write(tmp_path / "c", [[1, 2, 3], [4, 5, 70]])  # rewritten data: scanned again
    os.utime(prefix + ".bin", ns=(1, 1))
    with pytest.raises(ConfigError, match="token id 70"):
        check_token_ids(prefix, 61)
    assert len(calls) == 2


def test_negative_token_ids_are_refused(tmp_path):
    prefix = _write(tmp_path / "n", [[1, -4, 3]])
    with pytest.raises(ConfigError, match="negative token id -4"):
        check_token_ids(prefix, 10)


def test_an_out_of_range_index_cache_is_rebuilt_not_served(tmp_path, caplog):
    prefix = _write(tmp_path / "d", [list(range(d * 10, d * 10 + 7)) for d in range(20)])
    indexed = IndexedDataset(prefix)
    first = GPTDataset(indexed, (0, 20), 5, 3, 12)
    expected = [first[i].tolist() for i in range(12)]
    (shuffle,) = glob.glob(str(tmp_path / "cache" / "*-shuffle_index.npy"))
    np.save(shuffle, np.full(12, 10**9, dtype=np.int64))  # a readable file with wrong values
    with caplog.at_level(logging.WARNING):
        again = GPTDataset(indexed, (0, 20), 5, 3, 12)
    assert not again.built_from_cache
    assert "rebuilding unreadable index cache" in caplog.text and "shuffle_index" in caplog.text
    assert [again[i].tolist() for i in range(12)] == expected
    assert GPTDataset(indexed, (0, 20), 5, 3, 12).built_from_cache


@pytest.mark.parametrize("loader, what", [(HeteroPlan.from_yaml, "plan"),
                                          (Cluster.from_yaml, "cluster")])
def test_binary_yaml_is_one_line(tmp_path, loader, what):
    path = tmp_path / "file.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")
    with pytest.raises(ConfigError) as err:
        loader(path)
    assert f"{what} file '{path}'" in str(err.value) and "\n" not in str(err.value)
