"""Megatron-compatible indexed dataset: token ``.bin`` files with an ``.idx`` index.

The on-disk format is byte-compatible in both directions with Megatron-Core's
``megatron/core/datasets/indexed_dataset.py`` (non-multimodal variant):

``.idx`` (all little-endian)::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    <Q        version, always 1
    <B        dtype code of the tokens in the .bin (see ``DTYPE_CODES``)
    <Q        sequence count  S
    <Q        document count  D   (length of the document index, i.e. documents + 1)
    S x int32 sequence lengths in tokens
    S x int64 sequence byte pointers into the .bin
    D x int64 document index: 0 followed by the end sequence index of each document

``.bin`` is the raw concatenation of all sequences in the ``.idx`` dtype.
A multimodal Megatron index may append S int8 sequence modes; such files are read
(modes are ignored) but never written.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import numpy as np

from megatron_h2.errors import ConfigError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count

DTYPE_CODES: Mapping[int, type[np.number]] = MappingProxyType({
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
})
"""Megatron's ``DType`` enum: code -> numpy type."""


def dtype_code(dtype: type[np.number] | np.dtype) -> int:
    """Return Megatron's dtype code for a numpy dtype; ConfigError if it has none."""
    wanted = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == wanted:
            return code
    names = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
    raise ConfigError(
        f"dtype {wanted.name} cannot be stored in a Megatron index; use one of {names}"
    )


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """Token dtype Megatron picks for a vocabulary: uint16 below 65500 ids, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def get_bin_path(path_prefix: str) -> str:
    """Path of the token data file for a dataset prefix."""
    return path_prefix + ".bin"


def get_idx_path(path_prefix: str) -> str:
    """Path of the index file for a dataset prefix."""
    return path_prefix + ".idx"


def _check_fits(array: np.ndarray, dtype: np.dtype) -> None:
    """Raise ConfigError when integer token ids would not fit in ``dtype``."""
    if array.size == 0 or not np.issubdtype(dtype, np.integer):
        return
    info = np.iinfo(dtype)
    low, high = int(array.min()), int(array.max())
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        raise ConfigError(
            f"token id {bad} does not fit in {dtype.name}; build the dataset with a wider dtype "
            f"(e.g. int32) or check the tokenizer's vocab size"
        )


class IndexedDatasetBuilder:
    """Write a Megatron ``.bin`` file item by item, then its ``.idx`` with :meth:`finalize`.

    Args:
        bin_path: path of the ``.bin`` file to create (truncated if it exists).
        dtype: numpy token dtype; must be one of Megatron's dtype codes.
    """

    def __init__(self, bin_path: str, dtype: type[np.number] | np.dtype = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.bin_path = bin_path
        self._data_file = open(bin_path, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def _as_array(self, tokens: Iterable[int] | np.ndarray) -> np.ndarray:
        array = np.asarray(tokens)
        if array.ndim != 1:
            array = array.reshape(-1)
        if array.dtype != self.dtype:
            if array.size and np.issubdtype(array.dtype, np.integer):
                _check_fits(array, self.dtype)
            array = array.astype(self.dtype)
        return array

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence (a list, numpy array or CPU tensor of token ids)."""
        array = self._as_array(tokens)
        self._data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))

    def add_document(self, tokens: Iterable[int] | np.ndarray, lengths: list[int]) -> None:
        """Append a whole document made of sequences of the given lengths."""
        array = self._as_array(tokens)
        if sum(lengths) != array.size:
            raise ConfigError(
                f"add_document got {array.size} tokens but lengths sum to {sum(lengths)}; "
                f"pass one length per sequence"
            )
        self._data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.end_document()

    def end_document(self) -> None:
        """Mark the sequences added since the last document end as one document."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append a whole existing dataset (``.bin`` and ``.idx``) with the same dtype."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ConfigError(
                f"cannot merge {path_prefix} ({other.dtype.name}) into a {self.dtype.name} "
                f"dataset; rebuild both parts with the same tokenizer"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((other.document_indices[1:] + offset).tolist())
        other.close()
        with open(get_bin_path(path_prefix), "rb") as source:
            shutil.copyfileobj(source, self._data_file)

    def close(self) -> None:
        """Close the ``.bin`` file without writing an index (e.g. after an error)."""
        self._data_file.close()

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` file and write the ``.idx`` file."""
        self._data_file.close()
        write_index(idx_path, self.dtype, self.sequence_lengths, self.document_indices)


def write_index(
    idx_path: str,
    dtype: type[np.number] | np.dtype,
    sequence_lengths: list[int] | np.ndarray,
    document_indices: list[int] | np.ndarray,
) -> None:
    """Write a Megatron ``.idx`` file; pointers are derived from lengths and dtype size."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    documents = np.asarray(document_indices, dtype=np.int64)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    with open(idx_path, "wb") as stream:
        stream.write(INDEX_MAGIC)
        stream.write(struct.pack("<Q", INDEX_VERSION))
        stream.write(struct.pack("<B", dtype_code(dtype)))
        stream.write(struct.pack("<Q", len(lengths)))
        stream.write(struct.pack("<Q", len(documents)))
        stream.write(lengths.tobytes(order="C"))
        stream.write(pointers.tobytes(order="C"))
        stream.write(documents.tobytes(order="C"))


def _read_header(idx_path: str, idx_size: int) -> tuple[np.dtype, int, int]:
    """Validate the fixed ``.idx`` header; return (dtype, sequence count, document count)."""
    if idx_size < HEADER_SIZE:
        raise ConfigError(
            f"index {idx_path} is truncated ({idx_size} bytes, header needs {HEADER_SIZE}); "
            f"regenerate it with tools/preprocess_data.py"
        )
    with open(idx_path, "rb") as stream:
        header = stream.read(HEADER_SIZE)
    magic = header[:9]
    if magic != INDEX_MAGIC:
        raise ConfigError(
            f"{idx_path} is not a Megatron index (magic {magic!r}, expected {INDEX_MAGIC!r}); "
            f"regenerate it with tools/preprocess_data.py"
        )
    (version,) = struct.unpack("<Q", header[9:17])
    if version != INDEX_VERSION:
        raise ConfigError(
            f"{idx_path} has index version {version}, only version {INDEX_VERSION} is supported; "
            f"regenerate it with tools/preprocess_data.py"
        )
    code = header[17]
    if code not in DTYPE_CODES:
        raise ConfigError(
            f"{idx_path} has unknown dtype code {code} (valid: {sorted(DTYPE_CODES)}); "
            f"the file is corrupt, regenerate it with tools/preprocess_data.py"
        )
    dtype = np.dtype(DTYPE_CODES[code])
    if not np.issubdtype(dtype, np.integer):
        raise ConfigError(
            f"{idx_path} declares {dtype.name} tokens (dtype code {code}) but token ids are "
            f"integers; the file is corrupt, regenerate it with tools/preprocess_data.py"
        )
    sequence_count, document_count = struct.unpack("<QQ", header[18:34])
    return dtype, sequence_count, document_count


class IndexedDataset:
    """Memory-mapped reader of a Megatron ``.bin``/``.idx`` pair.

    ``dataset[i]`` returns sequence ``i`` as a numpy array in the file's dtype (a read-only
    view into the memory map). All structural checks run in the constructor and raise a
    one-line :class:`ConfigError`.

    Args:
        path_prefix: the path without ``.bin``/``.idx``, e.g. ``data/corpus_text_document``.
        mmap: memory-map the ``.bin`` (default); False reads each sequence with a file read
            instead (Megatron's ``--no-mmap-bin-files``). The ``.idx`` is always mapped.
    """

    def __init__(self, path_prefix: str, mmap: bool = True) -> None:
        self.path_prefix = path_prefix
        self.mmap = mmap
        self._open()

    def _open(self) -> None:
        bin_path, idx_path = get_bin_path(self.path_prefix), get_idx_path(self.path_prefix)
        check_files_exist(self.path_prefix)
        idx_size = os.path.getsize(idx_path)
        self.dtype, count, documents = _read_header(idx_path, idx_size)
        self._check_index_size(idx_path, idx_size, count, documents)
        self._idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx_map, np.int32, count, offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(self._idx_map, np.int64, count, offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(self._idx_map, np.int64, documents, offset)
        bin_size = os.path.getsize(bin_path)
        self._check_consistency(bin_path, bin_size)
        if not self.mmap:
            self._bin_map = None
        elif bin_size:
            self._bin_map = np.memmap(bin_path, mode="r", dtype=np.uint8)
        else:  # numpy cannot map an empty file
            self._bin_map = np.zeros(0, dtype=np.uint8)

    @staticmethod
    def _check_index_size(idx_path: str, idx_size: int, count: int, documents: int) -> None:
        expected = HEADER_SIZE + 12 * count + 8 * documents
        if idx_size not in (expected, expected + count):  # + count: Megatron multimodal modes
            raise ConfigError(
                f"index {idx_path} has {idx_size} bytes but its header (sequences={count}, "
                f"documents={documents}) implies {expected}; the file is truncated or corrupt, "
                f"regenerate it with tools/preprocess_data.py"
            )

    def _check_consistency(self, bin_path: str, bin_size: int) -> None:
        lengths, pointers = self.sequence_lengths, self.sequence_pointers
        docs = self.document_indices
        where = f"index {get_idx_path(self.path_prefix)}"
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) < 0):
            raise ConfigError(
                f"{where} has an invalid document index (must start at 0, never decrease and end "
                f"at the sequence count {len(lengths)}); "
                "regenerate it with tools/preprocess_data.py"
            )
        if len(lengths) and int(lengths.min()) < 0:
            raise ConfigError(f"{where} has negative sequence lengths; regenerate it")
        item = self.dtype.itemsize
        if len(pointers) and (pointers[0] != 0 or not np.array_equal(
                np.diff(pointers), lengths[:-1].astype(np.int64) * item)):
            raise ConfigError(
                f"{where} has sequence pointers that are not the running sum of the sequence "
                f"lengths ({self.dtype.name} tokens); the file is corrupt, regenerate it with "
                f"tools/preprocess_data.py"
            )
        ends = pointers + lengths.astype(np.int64) * item
        total = int(lengths.sum(dtype=np.int64)) * item
        out_of_file = len(ends) > 0 and (int(pointers.min()) < 0 or int(ends.max()) > bin_size)
        if total != bin_size or out_of_file:
            raise ConfigError(
                f"{bin_path} has {bin_size} bytes but {where} describes {total} bytes of "
                f"{self.dtype.name} tokens; the pair is truncated or mismatched, regenerate both "
                f"with tools/preprocess_data.py"
            )

    def __getstate__(self) -> tuple[str, bool]:
        return self.path_prefix, self.mmap

    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.path_prefix, self.mmap = state
        self._open()

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        """Tokens of sequence ``idx``."""
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end if no length)."""
        size = len(self.sequence_lengths)
        if not -size <= idx < size:
            raise IndexError(f"sequence {idx} out of range for {size} sequences")
        seq_length = int(self.sequence_lengths[idx])
        if length is None:
            length = seq_length - offset
        if offset < 0 or length < 0 or offset + length > seq_length:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                f"of length {seq_length}"
            )
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        if self._bin_map is None:  # --no-mmap-bin-files: read just these tokens
            tokens = np.empty(length, dtype=self.dtype)
            with open(get_bin_path(self.path_prefix), "rb", buffering=0) as stream:
                stream.seek(start)
                stream.readinto(memoryview(tokens).cast("B"))
            return tokens
        return np.frombuffer(self._bin_map, self.dtype, length, start)

    def token_range(self, block: int = 1 << 20) -> tuple[int, int] | None:
        """(min(0, smallest), largest) token id in the ``.bin`` (None if it is empty), read
        through the memory map in cache-sized blocks (a vectorised scan, no copy)."""
        tokens = np.frombuffer(self._bin_map, self.dtype)
        if tokens.size == 0:
            return None
        signed = np.issubdtype(self.dtype, np.signedinteger)
        low, high = 0, 0
        for start in range(0, tokens.size, block):
            chunk = tokens[start:start + block]
            high = max(high, int(chunk.max()))
            if signed:
                low = min(low, int(chunk.min()))
        return low, high

    @property
    def num_documents(self) -> int:
        """Number of documents (entries of the document index minus one)."""
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        """Total number of tokens in the ``.bin``."""
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def close(self) -> None:
        """Drop the memory maps (the object must not be used afterwards)."""
        for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
            setattr(self, name, np.zeros(0, dtype=getattr(self, name).dtype))
        self._idx_map = self._bin_map = None

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both ``.bin`` and ``.idx`` exist for the prefix."""
        paths = (get_bin_path(path_prefix), get_idx_path(path_prefix))
        return all(os.path.isfile(path) for path in paths)


def check_files_exist(path_prefix: str) -> None:
    """Raise ConfigError naming the first missing file of a dataset prefix."""
    for suffix in (".bin", ".idx"):
        if path_prefix.endswith(suffix):
            raise ConfigError(
                f"data prefix {path_prefix!r} ends with {suffix}; pass the prefix without the "
                f".bin/.idx extension"
            )
    for path in (get_bin_path(path_prefix), get_idx_path(path_prefix)):
        if not os.path.isfile(path):
            raise ConfigError(
                f"dataset file {path} not found; create {path_prefix}.bin/.idx with "
                f"tools/preprocess_data.py (output is <output-prefix>_text_document)"
            )


def check_data_prefix(path_prefix: str) -> None:
    """Validate a dataset prefix (files present, header and sizes consistent) without loading it.

    Cheap enough to call before building a model; raises a one-line :class:`ConfigError`.
    """
    if not isinstance(path_prefix, str) or not path_prefix.strip():
        raise ConfigError(
            f"data prefix {path_prefix!r} is empty; pass a path prefix like data/x_text_document"
        )
    IndexedDataset(path_prefix).close()
