"""Megatron .bin/.idx compatibility of megatron_h2.data.indexed_dataset."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest

from megatron_h2.data.indexed_dataset import (
    DTYPE_CODES,
    INDEX_MAGIC,
    IndexedDataset,
    IndexedDatasetBuilder,
    check_data_prefix,
    dtype_code,
    optimal_dtype,
)
from megatron_h2.errors import ConfigError

DOCS = [[[5, 6, 7], [8]], [[9, 10, 11, 12]], [[1], [2, 3], [4, 4, 4, 4, 4]]]  # docs of sequences


def _write_with_builder(prefix: str, dtype=np.uint16, docs=DOCS) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for document in docs:
        for sequence in document:
            builder.add_item(np.array(sequence))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _write_like_megatron(
    prefix: str, sequences: list[list[int]], doc_ends: list[int], dtype
) -> None:
    """Write a pair by hand exactly as Megatron-Core's _IndexWriter and builder do."""
    itemsize = np.dtype(dtype).itemsize
    with open(prefix + ".bin", "wb") as stream:
        for sequence in sequences:
            stream.write(np.array(sequence, dtype=dtype).tobytes(order="C"))
    lengths = [len(s) for s in sequences]
    pointers, current = [], 0
    for length in lengths:
        pointers.append(current)
        current += length * itemsize
    document_indices = [0] + doc_ends
    code = {np.uint16: 8, np.int32: 4, np.int64: 5, np.uint8: 1}[dtype]
    with open(prefix + ".idx", "wb") as stream:
        stream.write(b"MMIDIDX\x00\x00")
        stream.write(struct.pack("<Q", 1))
        stream.write(struct.pack("<B", code))
        stream.write(struct.pack("<Q", len(lengths)))
        stream.write(struct.pack("<Q", len(document_indices)))
        stream.write(np.array(lengths, dtype=np.int32).tobytes(order="C"))
        stream.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
        stream.write(np.array(document_indices, dtype=np.int64).tobytes(order="C"))


def _parse_idx_with_struct(path: str) -> dict:
    """Independent parser: only struct, no numpy."""
    data = open(path, "rb").read()
    magic = data[:9]
    version, code, count, documents = struct.unpack_from("<QBQQ", data, 9)
    offset = 34
    lengths = list(struct.unpack_from(f"<{count}i", data, offset))
    offset += 4 * count
    pointers = list(struct.unpack_from(f"<{count}q", data, offset))
    offset += 8 * count
    document_indices = list(struct.unpack_from(f"<{documents}q", data, offset))
    offset += 8 * documents
    return dict(magic=magic, version=version, code=code, count=count, documents=documents,
                lengths=lengths, pointers=pointers, document_indices=document_indices,
                size=len(data), end=offset)


def test_write_then_read_back(tmp_path):
    prefix = str(tmp_path / "data")
    _write_with_builder(prefix)
    dataset = IndexedDataset(prefix)
    sequences = [s for d in DOCS for s in d]
    assert len(dataset) == len(sequences) and dataset.dtype == np.uint16
    for i, sequence in enumerate(sequences):
        assert dataset[i].tolist() == sequence
        assert dataset[i].dtype == np.uint16
    assert dataset.sequence_lengths.tolist() == [len(s) for s in sequences]
    assert dataset.document_indices.tolist() == [0, 2, 3, 6]
    assert dataset.num_documents == 3 and dataset.num_tokens == sum(map(len, sequences))
    assert dataset.get(5, offset=1, length=3).tolist() == [4, 4, 4]
    assert dataset.get(2, offset=2).tolist() == [11, 12]
    with pytest.raises(IndexError):
        dataset.get(0, offset=2, length=5)
    with pytest.raises(IndexError):
        dataset[len(sequences)]


def test_header_and_arrays_byte_by_byte(tmp_path):
    prefix = str(tmp_path / "data")
    _write_with_builder(prefix, dtype=np.int32)
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert struct.unpack("<B", raw[17:18]) == (4,)  # int32
    assert struct.unpack("<Q", raw[18:26]) == (6,)  # sequences
    assert struct.unpack("<Q", raw[26:34]) == (4,)  # document index entries (docs + 1)
    parsed = _parse_idx_with_struct(prefix + ".idx")
    assert parsed["lengths"] == [3, 1, 4, 1, 2, 5]
    assert parsed["pointers"] == [0, 12, 16, 32, 36, 44]  # byte offsets, 4-byte tokens
    assert parsed["document_indices"] == [0, 2, 3, 6]
    assert parsed["end"] == parsed["size"]  # nothing trailing
    assert os.path.getsize(prefix + ".bin") == 16 * 4
    tokens = struct.unpack("<16i", open(prefix + ".bin", "rb").read())
    assert list(tokens) == [t for d in DOCS for s in d for t in s]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_reads_file_written_like_megatron(tmp_path, dtype):
    prefix = str(tmp_path / "megatron")
    sequences = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], []]
    _write_like_megatron(prefix, sequences, [2, 3, 5], dtype)
    dataset = IndexedDataset(prefix)
    assert dataset.dtype == np.dtype(dtype)
    assert [dataset[i].tolist() for i in range(len(dataset))] == sequences
    assert dataset.document_indices.tolist() == [0, 2, 3, 5]
    # and our writer reproduces Megatron's bytes exactly
    ours = str(tmp_path / "ours")
    _write_with_builder(ours, dtype, [[[1, 2, 3], [4, 5]], [[6]], [[7, 8, 9, 10], []]])
    for suffix in (".bin", ".idx"):
        assert open(prefix + suffix, "rb").read() == open(ours + suffix, "rb").read()


def test_reads_multimodal_index_with_trailing_modes(tmp_path):
    prefix = str(tmp_path / "mm")
    _write_like_megatron(prefix, [[1, 2], [3]], [2], np.int32)
    with open(prefix + ".idx", "ab") as stream:
        stream.write(np.zeros(2, dtype=np.int8).tobytes())
    assert IndexedDataset(prefix)[1].tolist() == [3]


def test_add_index_merge_equals_single_write(tmp_path):
    whole, a, b = (str(tmp_path / n) for n in ("whole", "a", "b"))
    _write_with_builder(whole)
    _write_with_builder(a, docs=DOCS[:1])
    _write_with_builder(b, docs=DOCS[1:])
    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(merged + ".bin", np.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(merged + ".idx")
    for suffix in (".bin", ".idx"):
        assert open(whole + suffix, "rb").read() == open(merged + suffix, "rb").read()
    other = str(tmp_path / "other")
    _write_with_builder(other, dtype=np.int32)
    with pytest.raises(ConfigError, match="same tokenizer"):
        IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16).add_index(other)


def test_add_document_and_empty_dataset(tmp_path):
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    builder.add_document([1, 2, 3], [2, 1])
    builder.finalize(prefix + ".idx")
    dataset = IndexedDataset(prefix)
    assert [dataset[i].tolist() for i in range(2)] == [[1, 2], [3]]
    assert dataset.document_indices.tolist() == [0, 2]
    empty = str(tmp_path / "empty")
    IndexedDatasetBuilder(empty + ".bin", np.uint16).finalize(empty + ".idx")
    assert len(IndexedDataset(empty)) == 0


def test_dtype_helpers_and_overflow(tmp_path):
    assert optimal_dtype(32000) == np.uint16 and optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32
    assert {dtype_code(t) for t in DTYPE_CODES.values()} == set(DTYPE_CODES)
    with pytest.raises(ConfigError, match="bool"):
        dtype_code(np.bool_)
    builder = IndexedDatasetBuilder(str(tmp_path / "o.bin"), np.uint16)
    with pytest.raises(ConfigError, match="does not fit in uint16"):
        builder.add_item([1, 70000])


def test_pickle_reopens(tmp_path):
    prefix = str(tmp_path / "data")
    _write_with_builder(prefix)
    clone = pickle.loads(pickle.dumps(IndexedDataset(prefix)))
    assert clone[2].tolist() == [9, 10, 11, 12]


def _corrupt(prefix: str, case: str) -> None:
    idx, binary = prefix + ".idx", prefix + ".bin"
    data = bytearray(open(idx, "rb").read())
    if case == "missing_bin":
        os.unlink(binary)
    elif case == "missing_idx":
        os.unlink(idx)
    elif case == "magic":
        data[:9] = b"NOTANIDX\x00"
    elif case == "version":
        data[9:17] = struct.pack("<Q", 2)
    elif case == "dtype":
        data[17] = 9
    elif case == "short_header":
        data = data[:20]
    elif case == "truncated_idx":
        data = data[:-8]
    elif case == "truncated_bin":
        open(binary, "r+b").truncate(os.path.getsize(binary) - 2)
    elif case == "longer_bin":
        open(binary, "ab").write(b"\x00\x00")
    elif case == "bad_pointer":
        data[34 + 4 * 6 + 8 : 34 + 4 * 6 + 16] = struct.pack("<q", 10**6)
    elif case == "bad_documents":
        data[-8:] = struct.pack("<q", 5)
    elif case == "float_dtype":  # same size and pointers as int32 tokens, but not integers
        data[17] = 7
    elif case == "zeroed_pointers":  # every size still adds up
        count = struct.unpack("<Q", data[18:26])[0]
        data[34 + 4 * count : 34 + 12 * count] = bytes(8 * count)
    elif case == "decreasing_documents":
        count, docs = struct.unpack("<QQ", data[18:34])
        start = 34 + 12 * count
        values = list(struct.unpack(f"<{docs}q", data[start:start + 8 * docs]))
        values[1], values[2] = values[2], values[1]
        data[start:start + 8 * docs] = struct.pack(f"<{docs}q", *values)
    if case not in ("missing_bin", "missing_idx", "truncated_bin", "longer_bin"):
        open(idx, "wb").write(bytes(data))


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_bin", r"data\.bin not found.*preprocess_data\.py"),
        ("missing_idx", r"data\.idx not found.*preprocess_data\.py"),
        ("magic", "not a Megatron index"),
        ("version", "version 2"),
        ("dtype", "unknown dtype code 9"),
        ("short_header", "truncated"),
        ("truncated_idx", "truncated or corrupt"),
        ("truncated_bin", "truncated or mismatched"),
        ("longer_bin", "truncated or mismatched"),
        ("bad_pointer", "not the running sum of the sequence lengths"),
        ("bad_documents", "invalid document index"),
        ("float_dtype", "declares float32 tokens"),
        ("zeroed_pointers", "not the running sum of the sequence lengths"),
        ("decreasing_documents", "invalid document index"),
    ],
)
def test_bad_files_raise_one_line_config_error(tmp_path, case, message):
    prefix = str(tmp_path / "data")
    # int32 tokens: float32 has the same size, so only the dtype check can catch it
    _write_with_builder(prefix, np.int32 if case == "float_dtype" else np.uint16)
    _corrupt(prefix, case)
    with pytest.raises(ConfigError, match=message) as info:
        IndexedDataset(prefix)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError):
        check_data_prefix(prefix)


def test_check_data_prefix(tmp_path):
    prefix = str(tmp_path / "data")
    _write_with_builder(prefix)
    check_data_prefix(prefix)
    with pytest.raises(ConfigError, match="without the .bin/.idx extension"):
        check_data_prefix(prefix + ".bin")
    with pytest.raises(ConfigError, match="empty"):
        check_data_prefix("")
    assert INDEX_MAGIC == b"MMIDIDX\x00\x00"
