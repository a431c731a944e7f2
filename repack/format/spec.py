"""The repack on-disk format as code: constants, layouts and pure helpers, no I/O.

``docs/format.md`` is the normative description; this module mirrors it. Everything here is
little-endian. Two formats are described:

* Megatron-Core's ``MMIDIDX`` version 1 ``.idx`` files, which repack reads and writes back
  (``megatron/core/datasets/indexed_dataset.py``).
* The repack folder, format ``repack`` version 1: ``manifest.json``, ``index.rpx`` and
  ``shard-NNNNN.bin`` files.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import numpy as np

__all__ = [
    "ALIGNMENT",
    "ARRAY_ALIGNMENT",
    "DTYPES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "INDEX_HEADER_SIZE",
    "INDEX_MAGIC",
    "MANIFEST_FILE",
    "MAX_MANIFEST_SIZE",
    "MEGATRON_HEADER_SIZE",
    "MEGATRON_MAGIC",
    "MEGATRON_VERSION",
    "IndexLayout",
    "align_up",
    "dtype_code",
    "dtype_from_code",
    "index_layout",
    "megatron_idx_header",
    "megatron_idx_size",
    "pack_index_header",
    "shard_name",
    "unpack_index_header",
]

# --- Megatron-Core MMIDIDX v1 (.idx) -------------------------------------------------------

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_VERSION = 1
#: magic (9) + version u64 (8) + dtype code u8 (1) + sequence count u64 (8) + document count
#: u64 (8).
MEGATRON_HEADER_SIZE = 34
_MEGATRON_HEADER = struct.Struct("<9sQBQQ")

#: Megatron's ``DType`` table: code -> numpy dtype. Codes outside it are refused.
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}


def dtype_from_code(code: int) -> np.dtype:
    """Return the numpy dtype of a Megatron dtype code; KeyError when unknown."""
    return DTYPES[code]


def dtype_code(dtype: np.dtype | type | str) -> int:
    """Return the Megatron dtype code of a numpy dtype; KeyError when it has none."""
    return _CODES[np.dtype(dtype)]


def megatron_idx_size(sequence_count: int, document_count: int, multimodal: bool) -> int:
    """Exact size in bytes of a Megatron ``.idx`` file with these counts."""
    size = MEGATRON_HEADER_SIZE + sequence_count * (4 + 8) + document_count * 8
    return size + (sequence_count if multimodal else 0)


def megatron_idx_header(code: int, sequence_count: int, document_count: int) -> bytes:
    """The 34 header bytes of a Megatron ``.idx`` file."""
    return _MEGATRON_HEADER.pack(
        MEGATRON_MAGIC, MEGATRON_VERSION, code, sequence_count, document_count
    )


def unpack_megatron_idx_header(header: bytes) -> tuple[bytes, int, int, int, int]:
    """Split 34 header bytes into (magic, version, dtype code, sequences, documents)."""
    return _MEGATRON_HEADER.unpack(header)


__all__.append("unpack_megatron_idx_header")

# --- the repack folder ----------------------------------------------------------------------

FORMAT_NAME = "repack"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.rpx"
#: Folder of a repack folder holding the plan and receipts of an unfinished merge, add or
#: remove; never part of a finished repack.
WORK_DIR = ".work"
#: Files that file managers drop into any folder they show (macOS Finder, Windows Explorer):
#: a folder holding only these counts as empty for ``merge OUT``, and they are left alone.
OS_LITTER = frozenset({".DS_Store", "Thumbs.db", "desktop.ini", ".localized"})
#: Every segment of source data starts at a multiple of this many bytes within its shard,
#: so that file systems able to share extents (reflinks) can do so and reads stay page
#: aligned. Gaps are zero bytes.
ALIGNMENT = 4096
#: Every array of the index file starts at a multiple of this many bytes.
ARRAY_ALIGNMENT = 64
#: A manifest larger than this is refused before it is read.
MAX_MANIFEST_SIZE = 256 * 1024 * 1024

INDEX_MAGIC = b"RPKINDX\x00"
INDEX_HEADER_SIZE = 64
_INDEX_HEADER = struct.Struct("<8sIIQQ32x")
_SHARD_NAME = re.compile(r"^shard-(\d{5})\.bin(\.zst)?$")
_INDEX_NAME = re.compile(r"^index(-\d{1,9})?\.rpx$")


def align_up(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment``."""
    return -(-value // alignment) * alignment


def shard_name(number: int, codec: str | None = None) -> str:
    """File name of shard ``number``: ``shard-00000.bin``, or ``shard-00000.bin.zst`` when it
    is stored compressed with ``codec`` (see :mod:`repack.format.codec`)."""
    return f"shard-{number:05d}.bin" + (f".{CODEC_SUFFIXES[codec]}" if codec else "")


#: File-name suffix of a shard stored with each codec.
CODEC_SUFFIXES = {"zstd": "zst"}


def shard_number(name: str) -> int:
    """The number in the shard file name ``name``; ValueError if it is not one."""
    match = _SHARD_NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a shard file name")
    return int(match.group(1))


def is_shard_name(name: str) -> bool:
    """Whether ``name`` is the file name of a shard."""
    return _SHARD_NAME.match(name) is not None


def is_index_name(name: str) -> bool:
    """Whether ``name`` is the file name of an index: ``index.rpx``, or ``index-N.rpx`` after
    ``repack add`` (each append writes a new index, so the old one stays valid until the new
    manifest replaces the old)."""
    return _INDEX_NAME.match(name) is not None


def index_name(generation: int) -> str:
    """File name of the index written by the ``generation``-th append (0: the merge)."""
    return INDEX_FILE if generation == 0 else f"index-{generation}.rpx"


__all__ += ["index_name", "is_index_name", "is_litter", "is_shard_name", "shard_number"]


def is_litter(name: str) -> bool:
    """Whether ``name`` is one of :data:`OS_LITTER` or a macOS ``._*`` resource-fork file."""
    return name in OS_LITTER or name.startswith("._")


@dataclass(frozen=True)
class IndexLayout:
    """Byte offsets of the arrays of an ``index.rpx`` file."""

    sequence_count: int
    document_count: int
    lengths: int
    pointers: int
    modes: int
    documents: int
    size: int


def index_layout(sequence_count: int, document_count: int) -> IndexLayout:
    """Where each array of an index with these counts starts, and the file size."""
    lengths = INDEX_HEADER_SIZE
    pointers = align_up(lengths + 4 * sequence_count, ARRAY_ALIGNMENT)
    modes = align_up(pointers + 8 * sequence_count, ARRAY_ALIGNMENT)
    documents = align_up(modes + sequence_count, ARRAY_ALIGNMENT)
    size = documents + 8 * document_count
    return IndexLayout(sequence_count, document_count, lengths, pointers, modes, documents, size)


def pack_index_header(sequence_count: int, document_count: int) -> bytes:
    """The 64 header bytes of an ``index.rpx`` file."""
    return _INDEX_HEADER.pack(INDEX_MAGIC, FORMAT_VERSION, 0, sequence_count, document_count)


def unpack_index_header(header: bytes) -> tuple[bytes, int, int, int, int]:
    """Split 64 header bytes into (magic, version, flags, sequences, documents)."""
    return _INDEX_HEADER.unpack(header)


# --- document fingerprints (docs/format.md section 2.11) ------------------------------------

#: First 8 bytes of a fingerprint file (``RPKFPRT\0``).
FINGERPRINT_MAGIC = b"RPKFPRT\x00"
#: Version field of a fingerprint file's header.
FINGERPRINT_VERSION = 1
#: Bytes of a fingerprint file's header.
FINGERPRINT_HEADER_SIZE = 64
#: The hash of every document: XXH3, 64 bits, seed 0, of the document's token bytes.
FINGERPRINT_HASH = "xxh3-64"
#: ``fingerprints`` member of the manifest.
FINGERPRINT_MEMBER = "fingerprints"
_FINGERPRINT_HEADER = struct.Struct("<8sIIQQ32x")
_FINGERPRINT_NAME = re.compile(r"^fingerprints(-\d{1,9})?\.rpf$")


def fingerprint_name(generation: int) -> str:
    """File name of the fingerprints written with index generation ``generation``."""
    return "fingerprints.rpf" if generation == 0 else f"fingerprints-{generation}.rpf"


def is_fingerprint_name(name: str) -> bool:
    """Whether ``name`` is the file name of a fingerprint file."""
    return _FINGERPRINT_NAME.match(name) is not None


def fingerprint_file_size(document_count: int) -> int:
    """Exact size of a fingerprint file holding ``document_count`` hashes."""
    return FINGERPRINT_HEADER_SIZE + 8 * document_count


def pack_fingerprint_header(source_count: int, document_count: int) -> bytes:
    """The 64 header bytes of a fingerprint file."""
    return _FINGERPRINT_HEADER.pack(
        FINGERPRINT_MAGIC, FINGERPRINT_VERSION, 0, source_count, document_count
    )


def unpack_fingerprint_header(header: bytes) -> tuple[bytes, int, int, int, int]:
    """Split 64 header bytes into (magic, version, flags, sources, documents)."""
    return _FINGERPRINT_HEADER.unpack(header)


__all__ += [
    "FINGERPRINT_HASH",
    "FINGERPRINT_HEADER_SIZE",
    "FINGERPRINT_MAGIC",
    "FINGERPRINT_MEMBER",
    "FINGERPRINT_VERSION",
    "fingerprint_file_size",
    "fingerprint_name",
    "is_fingerprint_name",
    "pack_fingerprint_header",
    "unpack_fingerprint_header",
]
