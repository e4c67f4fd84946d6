"""GPT samples, splits, caching and blending (megatron_h2.data.gpt_dataset)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from megatron_h2.data import blended_dataset, gpt_dataset
from megatron_h2.data.blended_dataset import BlendedDataset, build_blending_indices, component_sizes
from megatron_h2.data.gpt_dataset import (
    GPTDataset,
    build_gpt_datasets,
    parse_data_path,
    parse_split,
    split_document_ranges,
)
from megatron_h2.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_h2.errors import ConfigError


def _make_data(prefix: str, num_docs: int = 40, seed: int = 0, base: int = 0) -> list[np.ndarray]:
    """Documents of random length whose tokens encode (document, position)."""
    rng = np.random.RandomState(seed)
    docs = []
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    for d in range(num_docs):
        length = int(rng.randint(1, 30))
        tokens = base + d * 100 + np.arange(length)
        builder.add_item(tokens)
        builder.end_document()
        docs.append(tokens)
    builder.finalize(prefix + ".idx")
    return docs


@pytest.fixture()
def data(tmp_path):
    prefix = str(tmp_path / "data" / "corpus_text_document")
    os.makedirs(os.path.dirname(prefix))
    return prefix, _make_data(prefix)


def _stream(dataset: GPTDataset, docs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([docs[d] for d in dataset.document_index])


@pytest.mark.parametrize("seq_length, num_samples", [(8, 50), (1, 30), (64, 40), (200, 3)])
def test_samples_equal_the_document_stream(data, seq_length, num_samples):
    prefix, docs = data
    dataset = GPTDataset(IndexedDataset(prefix), (5, 35), seq_length, 1234, num_samples)
    assert len(dataset) == num_samples
    stream = _stream(dataset, docs)
    for i in range(num_samples):
        sample = dataset[i]
        assert sample.dtype == np.int64 and sample.shape == (seq_length + 1,)
        start = int(dataset.shuffle_index[i]) * seq_length
        np.testing.assert_array_equal(sample, stream[start : start + seq_length + 1])
    with pytest.raises(IndexError):
        dataset[num_samples]


def test_epochs_are_permutations_and_samples_cover_them(data):
    prefix, docs = data
    dataset = GPTDataset(IndexedDataset(prefix), (0, 40), 16, 7, 200)
    epochs = dataset.num_epochs
    tokens_per_epoch = sum(len(d) for d in docs)
    assert epochs == -(-(200 * 16 + 1) // tokens_per_epoch) and epochs > 1
    chunks = np.asarray(dataset.document_index).reshape(epochs, 40)
    for chunk in chunks:
        assert sorted(chunk.tolist()) == list(range(40))
    assert not all((chunks[0] == c).all() for c in chunks[1:])  # epochs shuffled independently
    # every sample of the first epochs is used before any sample of the last epoch
    first_block = ((epochs - 1) * tokens_per_epoch - 1) // 16
    first_samples = np.asarray(dataset.shuffle_index[:first_block]).tolist()
    assert sorted(first_samples) == list(range(first_block))


def test_deterministic_and_seed_sensitive(data, tmp_path):
    prefix, _ = data
    indexed = IndexedDataset(prefix)
    a = GPTDataset(indexed, (0, 40), 8, 3, 60, cache_dir=str(tmp_path / "c1"))
    b = GPTDataset(indexed, (0, 40), 8, 3, 60, cache_dir=str(tmp_path / "c2"))
    c = GPTDataset(indexed, (0, 40), 8, 4, 60, cache_dir=str(tmp_path / "c3"))
    assert not a.built_from_cache and not b.built_from_cache
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert all((a[i] == b[i]).all() for i in range(60))
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)


def test_cache_is_written_beside_data_and_reused(data, monkeypatch):
    prefix, _ = data
    indexed = IndexedDataset(prefix)
    first = GPTDataset(indexed, (0, 30), 8, 1, 25, split_name="valid")
    cache = os.path.join(os.path.dirname(prefix), "cache")
    files = sorted(f for f in os.listdir(cache) if not f.endswith(".lock"))  # the build's lock
    assert len(files) == 4 and all("GPTDataset-valid" in f for f in files)
    assert not [f for f in files if f.startswith(".tmp")]
    mtimes = {f: os.path.getmtime(os.path.join(cache, f)) for f in files}

    def fail(self):
        raise AssertionError("indices rebuilt instead of loaded from the cache")

    monkeypatch.setattr(GPTDataset, "_build_indices", fail)
    second = GPTDataset(indexed, (0, 30), 8, 1, 25, split_name="valid")
    assert second.built_from_cache
    assert all((first[i] == second[i]).all() for i in range(25))
    assert mtimes == {f: os.path.getmtime(os.path.join(cache, f)) for f in files}
    with pytest.raises(AssertionError, match="rebuilt"):  # other parameters -> other cache entry
        GPTDataset(indexed, (0, 30), 8, 1, 26, split_name="valid")


def test_missing_description_marker_means_no_cache(data):
    prefix, _ = data
    indexed = IndexedDataset(prefix)
    GPTDataset(indexed, (0, 30), 8, 1, 10)
    cache = os.path.join(os.path.dirname(prefix), "cache")
    for name in os.listdir(cache):
        if name.endswith("description.json"):
            os.unlink(os.path.join(cache, name))
    assert not GPTDataset(indexed, (0, 30), 8, 1, 10).built_from_cache


def test_unwritable_cache_dir(data, tmp_path):
    prefix, _ = data
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot write the dataset index cache"):
        GPTDataset(IndexedDataset(prefix), (0, 30), 8, 1, 10, cache_dir=str(blocker / "sub"))


def test_pickles_for_dataloader_workers(data):
    prefix, _ = data
    dataset = GPTDataset(IndexedDataset(prefix), (0, 40), 8, 1, 10)
    clone = pickle.loads(pickle.dumps(dataset))
    assert all((clone[i] == dataset[i]).all() for i in range(10))


def test_parse_split():
    assert parse_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_split(" 99, 1 ") == pytest.approx([0.99, 0.01, 0.0])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert parse_split("0.8,0.2,0") == pytest.approx([0.8, 0.2, 0.0])
    # as Megatron's parser only the numbers count: quotes that reached the program (from
    # "--split '99,1,0'" inside a shell string), spaces, Megatron's legacy default
    assert parse_split("'99,1,0'") == parse_split('"99, 1, 0"') == pytest.approx([0.99, 0.01, 0])
    assert parse_split("969, 30, 1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("949 50 1") == parse_split("949/50/1") == parse_split("949,50,1")


@pytest.mark.parametrize(
    "bad", ["", "a,b", "1,2,3,4", "-1,2", "0,0,0", "nan,1", "1..2", "9x,1"]
)
def test_bad_split_strings(bad):
    with pytest.raises(ConfigError, match="--split") as info:
        parse_split(bad)
    assert "\n" not in str(info.value)


def test_split_boundaries_follow_megatron_rounding():
    assert split_document_ranges(parse_split("949,50,1"), 1000) == [
        (0, 949), (949, 999), (999, 1000)
    ]
    assert split_document_ranges(parse_split("1,1,1"), 10) == [(0, 3), (3, 7), (7, 10)]
    assert split_document_ranges(parse_split("80,20"), 7) == [(0, 6), (6, 7), None]


def test_parse_data_path():
    assert parse_data_path(["a"]) == [(1.0, "a")]
    assert parse_data_path(["a", "b"]) == [(0.5, "a"), (0.5, "b")]
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == [
        (pytest.approx(0.3), "a"), (pytest.approx(0.7), "b")
    ]
    assert parse_data_path(["30", "a", "10", "b"]) == [(0.75, "a"), (0.25, "b")]


@pytest.mark.parametrize(
    "bad", [[], "prefix", ["0.5"], ["0.5", "a", "b"], ["a", "0.5"], ["0", "a"],
            ["-1", "a", "2", "b"], ["a", ""], ["1", "a", "b", "2"], ["inf", "a"]],
)
def test_bad_data_path_lists(bad):
    with pytest.raises(ConfigError, match="--data-path") as info:
        parse_data_path(bad)
    assert "\n" not in str(info.value)


def test_build_gpt_datasets_splits(data):
    prefix, docs = data
    train, valid, test = build_gpt_datasets([prefix], "80,20,0", 8, 5, (30, 10, 10))
    assert test is None and len(train) == 30 and len(valid) == 10
    assert train.document_range == (0, 32) and valid.document_range == (32, 40)
    assert set(np.asarray(valid.document_index).tolist()) == set(range(32, 40))
    train2, valid2, test2 = build_gpt_datasets([prefix], "80,20,0", 8, 5, (30, 0, 10))
    assert train2.built_from_cache and valid2 is None and test2 is None
    assert all((train[i] == train2[i]).all() for i in range(30))


def test_build_gpt_datasets_validation(data, tmp_path):
    prefix, _ = data
    with pytest.raises(ConfigError, match="not found"):
        build_gpt_datasets([str(tmp_path / "missing")], "1", 8, 1, (1, 0, 0))
    with pytest.raises(ConfigError, match="seq_length"):
        build_gpt_datasets([prefix], "1", 0, 1, (1, 0, 0))
    with pytest.raises(ConfigError, match="seed"):
        build_gpt_datasets([prefix], "1", 8, -1, (1, 0, 0))
    with pytest.raises(ConfigError, match="num_samples"):
        build_gpt_datasets([prefix], "1", 8, 1, (1, 0))
    with pytest.raises(ConfigError, match="valid num_samples"):
        build_gpt_datasets([prefix], "1", 8, 1, (1, -2, 0))
    with pytest.raises(ConfigError, match="leaves the test split .* 0 of its 40 documents"):
        build_gpt_datasets([prefix], "949,50,1", 8, 1, (1, 1, 1))
    assert not os.path.exists(os.path.join(os.path.dirname(prefix), "cache"))  # nothing built


def test_blending_indices_follow_greedy_rule():
    dataset_index, sample_index = build_blending_indices([0.3, 0.7], 1000)
    counts = np.zeros(2)
    for i, k in enumerate(dataset_index):
        assert sample_index[i] == counts[k]
        counts[k] += 1
        assert np.all(np.abs(counts - np.array([0.3, 0.7]) * (i + 1)) <= 1.0)
    assert dataset_index[:10].tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert component_sizes([0.3, 0.7], 1000) == [302, 704]


def test_blended_datasets(tmp_path):
    prefixes = []
    for name, base in (("a", 0), ("b", 50_000)):
        prefix = str(tmp_path / f"{name}_text_document")
        _make_data(prefix, num_docs=30, seed=len(prefixes), base=base)
        prefixes.append(prefix)
    cache = str(tmp_path / "idx_cache")
    data_path = ["0.25", prefixes[0], "0.75", prefixes[1]]
    train, valid, test = build_gpt_datasets(data_path, "90,10,0", 8, 9, (400, 40, 0),
                                            cache_dir=cache)
    assert isinstance(train, BlendedDataset) and test is None
    assert len(train) == 400 and len(valid) == 40
    from_b = sum(int(train[i][0] >= 50_000) for i in range(400))
    assert from_b == 300
    assert [len(d) for d in train.datasets] == component_sizes([0.25, 0.75], 400)
    for i in (0, 17, 399):
        component = train.datasets[int(train.dataset_index[i])]
        assert (train[i] == component[int(train.dataset_sample_index[i])]).all()
    again = build_gpt_datasets(data_path, "90,10,0", 8, 9, (400, 40, 0), cache_dir=cache)[0]
    assert again.built_from_cache and all(d.built_from_cache for d in again.datasets)
    assert all((again[i] == train[i]).all() for i in range(400))
    assert all(name.startswith(".") is False for name in os.listdir(cache))
    assert not os.path.exists(tmp_path / "cache")  # cache_dir overrides the default location
    # prefixes without weights blend by size, as Megatron: one epoch's samples of each split
    sizes = [(int(IndexedDataset(p).sequence_lengths.sum()) - 1) // 8 for p in prefixes]
    by_size = build_gpt_datasets(prefixes, "1", 8, 9, (100, 0, 0), cache_dir=cache)[0]
    assert by_size.weights == pytest.approx([n / sum(sizes) for n in sizes])
    want = int((build_blending_indices(by_size.weights, 100)[0] == 1).sum())
    assert sum(int(by_size[i][0] >= 50_000) for i in range(100)) == want
    assert sizes[0] != sizes[1] and abs(want - 100 * sizes[1] / sum(sizes)) <= 1


def test_blended_dataset_rejects_short_components(data):
    prefix, _ = data
    component = GPTDataset(IndexedDataset(prefix), (0, 40), 8, 1, 10)
    with pytest.raises(RuntimeError, match="needs"):
        BlendedDataset([component, component], [0.9, 0.1], 30)
    with pytest.raises(ConfigError, match="positive"):
        BlendedDataset([component, component], [1.0, 0.0], 5)
    assert blended_dataset.MID_LEVEL_SURPLUS == 0.005 and gpt_dataset.SPLIT_NAMES[0] == "train"
