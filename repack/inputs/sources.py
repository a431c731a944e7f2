"""Read and validate Megatron ``IndexedDataset`` prefixes (``X.bin`` + ``X.idx``).

Every check raises a named :mod:`repack.errors` error whose message names the file, the value
found and the value expected. Unlike Megatron-Core, which checks with ``assert``, nothing
here vanishes under ``python -O``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from repack.checksum import Hasher
from repack.errors import (
    BadMagic,
    CorruptIndex,
    SizeMismatch,
    TruncatedFile,
    UnknownDType,
    UnsupportedVersion,
)
from repack.format import spec as fmt
from repack.store.prefixes import read_index

__all__ = [
    "SourceIndex",
    "SourceInfo",
    "inspect_source",
    "read_source_index",
    "validated_arrays",
]


@dataclass(frozen=True)
class SourceInfo:
    """What the planner needs to know of one validated source, without its arrays."""

    path: str
    dtype_code: int
    sequence_count: int
    document_count: int
    multimodal: bool
    bin_size: int
    idx_size: int
    token_count: int
    #: For a source on object storage, the ETag of its ``.bin`` when it was validated: every
    #: later read of it is pinned to it. None for a local file.
    bin_etag: str | None = None

    @property
    def dtype(self) -> np.dtype:
        """Numpy dtype of the tokens."""
        return fmt.dtype_from_code(self.dtype_code)


@dataclass(frozen=True)
class SourceIndex:
    """The arrays of a Megatron ``.idx`` file, validated."""

    info: SourceInfo
    lengths: np.ndarray
    pointers: np.ndarray
    documents: np.ndarray
    modes: np.ndarray | None


def read_source_index(
    prefix: str, *, hasher: Hasher | None = None, known: SourceInfo | None = None
) -> SourceIndex:
    """Read and fully validate the source at ``prefix``.

    Args:
        prefix: Path prefix of the source, without ``.bin``/``.idx``; or a URL
            (``s3://bucket/data/web-00001``, ``msc://...``), whose ``.idx`` is then fetched
            with one GET and its ``.bin`` sized with one HEAD (:mod:`repack.store.prefixes`).
        hasher: If given, it is fed the exact bytes of the ``.idx`` file.
        known: For a source on object storage read again, its facts as validated: the
            ``.bin`` is not asked again (its size and ETag are these; every read of it is
            pinned to that ETag). Ignored for a local source.

    Returns:
        The validated arrays and facts of the source.

    Raises:
        SourceError: a subclass naming the file and the cause.
        StoreError: a source on object storage, and the server refused or failed.
    """
    data, found = read_index(prefix, known)
    if hasher is not None:
        hasher.update(data)
    if found is None:
        return _parse_idx(prefix, data, known.bin_size, known.bin_etag)
    return _parse_idx(prefix, data, found.size, found.etag)


def validated_arrays(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The pointers and document indices in ``data``, the bytes of an ``.idx`` that
    :func:`read_source_index` validated before: the caller has made sure they are the same
    bytes (by their checksum), so no check is made again (a merge re-reads each source's
    ``.idx`` for its document fingerprints: the checks cost a third of that)."""
    _, _, _, n_seq, n_doc = fmt.unpack_megatron_idx_header(data[: fmt.MEGATRON_HEADER_SIZE])
    offset = fmt.MEGATRON_HEADER_SIZE + 4 * n_seq
    pointers = np.frombuffer(data, dtype="<i8", count=n_seq, offset=offset)
    documents = np.frombuffer(data, dtype="<i8", count=n_doc, offset=offset + 8 * n_seq)
    return pointers, documents


def inspect_source(prefix: str) -> SourceInfo:
    """Validate ``prefix`` like :func:`read_source_index` and return its facts only."""
    return read_source_index(prefix).info


def _parse_idx(prefix: str, data: bytes, bin_size: int, bin_etag: str | None = None) -> SourceIndex:
    idx_path = prefix + ".idx"
    size = len(data)
    if size < fmt.MEGATRON_HEADER_SIZE:
        if not fmt.MEGATRON_MAGIC.startswith(data[: len(fmt.MEGATRON_MAGIC)]):
            raise BadMagic(
                f"{idx_path}: bad magic {data[:9]!r}, expected {fmt.MEGATRON_MAGIC!r} "
                "(not a Megatron MMIDIDX index)",
                path=idx_path,
            )
        raise TruncatedFile(
            f"{idx_path}: {size} bytes, shorter than the {fmt.MEGATRON_HEADER_SIZE}-byte header",
            path=idx_path,
        )
    magic, version, code, n_seq, n_doc = fmt.unpack_megatron_idx_header(
        data[: fmt.MEGATRON_HEADER_SIZE]
    )
    if magic != fmt.MEGATRON_MAGIC:
        raise BadMagic(
            f"{idx_path}: bad magic {magic!r}, expected {fmt.MEGATRON_MAGIC!r} "
            "(not a Megatron MMIDIDX index)",
            path=idx_path,
        )
    if version != fmt.MEGATRON_VERSION:
        raise UnsupportedVersion(
            f"{idx_path}: MMIDIDX version {version}, only version {fmt.MEGATRON_VERSION} "
            "is supported",
            path=idx_path,
        )
    if code not in fmt.DTYPES:
        raise UnknownDType(
            f"{idx_path}: unknown dtype code {code}, expected one of "
            f"{sorted(fmt.DTYPES)} (Megatron DType)",
            path=idx_path,
        )
    plain = fmt.megatron_idx_size(n_seq, n_doc, multimodal=False)
    multimodal = fmt.megatron_idx_size(n_seq, n_doc, multimodal=True)
    if size < plain:
        raise TruncatedFile(
            f"{idx_path}: header counts {n_seq} sequences and {n_doc} document indices, "
            f"which need {plain} bytes, but the file has {size}",
            path=idx_path,
        )
    if size == plain:
        is_multimodal = False
    elif size == multimodal:
        is_multimodal = True
    else:
        raise CorruptIndex(
            f"{idx_path}: {size} bytes, expected {plain} (plain) or {multimodal} (multimodal) "
            f"for {n_seq} sequences and {n_doc} document indices",
            path=idx_path,
        )
    dtype = fmt.dtype_from_code(code)
    offset = fmt.MEGATRON_HEADER_SIZE
    lengths = np.frombuffer(data, dtype="<i4", count=n_seq, offset=offset)
    offset += 4 * n_seq
    pointers = np.frombuffer(data, dtype="<i8", count=n_seq, offset=offset)
    offset += 8 * n_seq
    documents = np.frombuffer(data, dtype="<i8", count=n_doc, offset=offset)
    offset += 8 * n_doc
    modes = (
        np.frombuffer(data, dtype=np.int8, count=n_seq, offset=offset) if is_multimodal else None
    )
    _check_arrays(idx_path, dtype, lengths, pointers, documents)
    token_count = int(lengths.sum(dtype=np.int64))
    expected_bin = token_count * dtype.itemsize
    if bin_size != expected_bin:
        raise SizeMismatch(
            f"{prefix}.bin: {bin_size} bytes, expected {expected_bin} "
            f"({token_count} tokens x {dtype.itemsize} bytes of {dtype.name}, per {idx_path})",
            path=prefix + ".bin",
        )
    info = SourceInfo(
        path=prefix,
        dtype_code=code,
        sequence_count=n_seq,
        document_count=n_doc,
        multimodal=is_multimodal,
        bin_size=bin_size,
        idx_size=size,
        token_count=token_count,
        bin_etag=bin_etag,
    )
    return SourceIndex(info, lengths, pointers, documents, modes)


def _check_arrays(
    idx_path: str,
    dtype: np.dtype,
    lengths: np.ndarray,
    pointers: np.ndarray,
    documents: np.ndarray,
) -> None:
    """Check the invariants Megatron relies on; vectorized."""
    n_seq = len(lengths)
    if n_seq and lengths.min() < 0:
        at = int(np.argmin(lengths))
        raise CorruptIndex(
            f"{idx_path}: sequence {at} has negative length {int(lengths[at])}", path=idx_path
        )
    expected = np.zeros(n_seq, dtype=np.int64)
    if n_seq > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
        expected *= dtype.itemsize
    bad = np.flatnonzero(pointers != expected)
    if bad.size:
        at = int(bad[0])
        raise CorruptIndex(
            f"{idx_path}: pointer of sequence {at} is {int(pointers[at])}, expected "
            f"{int(expected[at])} (sum of the preceding lengths x {dtype.itemsize} bytes)",
            path=idx_path,
        )
    if len(documents) == 0:
        raise CorruptIndex(f"{idx_path}: no document indices, expected at least [0]", path=idx_path)
    if documents[0] != 0:
        raise CorruptIndex(
            f"{idx_path}: document indices start at {int(documents[0])}, expected 0", path=idx_path
        )
    steps = np.diff(documents)
    if steps.size and steps.min() < 0:
        at = int(np.argmin(steps)) + 1
        raise CorruptIndex(
            f"{idx_path}: document index {at} is {int(documents[at])}, smaller than the "
            f"previous {int(documents[at - 1])} (document indices must not decrease)",
            path=idx_path,
        )
    if documents[-1] != n_seq:
        raise CorruptIndex(
            f"{idx_path}: document indices end at {int(documents[-1])}, expected the "
            f"sequence count {n_seq}",
            path=idx_path,
        )
