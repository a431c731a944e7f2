"""The index cache's records and packs (:mod:`repack.cache.indexcache`): a catalog entry
(``"pack-….rpc 0:<i4:12 64:<i4:9x2 192:<i4:8"``: the pack, then each array's
``offset:dtype:shape``) parsed and checked, the catalog's records in columns, its ``sources``
member, a stock ``.npy`` file's header, and the writer that lays arrays out in a pack.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from repack.errors import FormatError
from repack.fileio import copy_range
from repack.format.sources import TextIndex, Texts, ints_of
from repack.format.spec import ARRAY_ALIGNMENT, align_up

__all__ = [
    "ARRAYS",
    "Array",
    "Arrays",
    "Entry",
    "PackWriter",
    "Records",
    "describe",
    "npy_header",
    "parse_entry",
    "record_pack_samples",
    "record_samples",
    "recordable",
    "sources_of",
]

#: A dataset's index arrays, in the order a record lists them.
ARRAYS = ("document_index", "sample_index", "shuffle_index")
#: Bytes gathered in memory before a write when a pack is written from in-memory arrays:
#: tens of thousands of small arrays become a few large writes.
WRITE_BUFFER = 8 * 1024 * 1024

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]


class Array(NamedTuple):
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def to_record(self) -> str:
        """``offset:dtype:shape``, the shape's dimensions joined by ``x`` (``0:<i4:17x2``)."""
        return f"{self.offset}:{self.dtype}:{'x'.join(map(str, self.shape))}"


class Entry(NamedTuple):
    """Where one dataset's three arrays are: a pack (``pack`` set), else not yet packed (in
    memory, or Megatron's ``.npy`` files)."""

    name: str
    pack: str | None
    arrays: tuple[Array, Array, Array]

    @property
    def sample_count(self) -> int:
        """Number of samples: rows of the sample index minus one."""
        return self.arrays[1].shape[0] - 1

    def to_record(self) -> str:
        """The catalog's record of a packed entry: one string (``pack a0 a1 a2``), which JSON
        decodes without a list or a dict per array: a catalog of tens of thousands of entries
        adds no objects for the garbage collector to walk."""
        return " ".join([self.pack or "", *(a.to_record() for a in self.arrays)])


_INDEX_DTYPES: dict[str, str] = {}  # dtype text of a catalog -> numpy's canonical text


def _index_dtype(text: Any) -> str:
    """The canonical form of an index array's dtype; only integers are index arrays."""
    found = _INDEX_DTYPES.get(text)
    if found is None:
        if not isinstance(text, str):
            raise ValueError(f"dtype is {text!r}, expected a string")
        dtype = np.dtype(text)
        if dtype.kind not in "iu":
            raise ValueError(f"dtype is {text!r}, expected an integer dtype")
        found = _INDEX_DTYPES[text] = dtype.str
    return found


def _check_pack(pack: Any) -> str:
    if not isinstance(pack, str) or "/" in pack or pack in ("", ".", ".."):
        raise ValueError(f"pack {pack!r} is not a plain file name")
    return pack


def _check_array(array_name: str, offset: Any, dtype: Any, shape: Any) -> Array:
    if type(offset) is not int or offset < 0:
        raise ValueError(f"{array_name}.offset is {offset!r}")
    if not isinstance(shape, (list, tuple)) or not 1 <= len(shape) <= 2:
        raise ValueError(f"{array_name}.shape is {shape!r}")
    if any(type(n) is not int or n < 0 for n in shape):
        raise ValueError(f"{array_name}.shape is {shape!r}")
    return Array(offset, _index_dtype(dtype), tuple(shape))


def parse_entry(name: str, item: Any) -> Entry:
    """One catalog record, validated (raises ``KeyError``, ``TypeError``, ``ValueError``): a
    string (catalog version 2) or an object (version 1)."""
    if not isinstance(item, str):
        pack = _check_pack(item["pack"])
        return Entry(
            name,
            pack,
            tuple(
                _check_array(n, item[n]["offset"], item[n]["dtype"], item[n]["shape"])
                for n in ARRAYS
            ),
        )
    pack, *texts = item.split(" ")
    if len(texts) != len(ARRAYS):
        raise ValueError(f"record {item!r} does not hold a pack and {len(ARRAYS)} arrays")
    arrays = []
    for array_name, text in zip(ARRAYS, texts):
        try:
            offset, dtype, shape = text.split(":")
            offset, dims = int(offset), tuple(map(int, shape.split("x")))
        except ValueError:
            raise ValueError(f"{array_name} is {text!r}, expected offset:dtype:shape") from None
        if offset < 0:
            raise ValueError(f"{array_name}.offset is {offset!r}")
        if len(dims) > 2 or min(dims) < 0:
            raise ValueError(f"{array_name}.shape is {shape!r}")
        arrays.append(Array(offset, _index_dtype(dtype), dims))
    return Entry(name, _check_pack(pack), tuple(arrays))


_ARRAY = r"\d+:[<>|=]?[iu][1248]:"
#: A version-2 record that parse_entry accepts, its pack and its sample index's rows captured
#: (ASCII digits, as to_record writes them, a tenth faster: another digit int() reads is left
#: to parse_entry).
_RECORD = re.compile(
    rf"((?!\.\.? )[^ /]+) {_ARRAY}\d+(?:x\d+)? {_ARRAY}(\d+)(?:x\d+)? {_ARRAY}\d+(?:x\d+)?",
    re.ASCII,
)


def record_samples(item: Any) -> int | None:
    """``parse_entry(name, item).sample_count`` where ``item`` is a well-formed record (one
    regular expression, not a parse: a warm build asks it of every dataset), else ``None``
    (:func:`parse_entry` says what is wrong with it)."""
    if type(item) is not str:
        return None
    match = _RECORD.fullmatch(item)
    return None if match is None else int(match.group(2)) - 1


def record_pack_samples(item: Any) -> tuple[int, str] | None:
    """``(record_samples(item), its pack)``, or ``None`` where that is ``None``."""
    count = record_samples(item)
    return None if count is None else (count, item[: item.index(" ")])


def sources_of(text: str) -> dict[str, str]:
    """The catalog's ``sources`` text, ``NAME<tab>SOURCE`` lines, as a dict."""
    found = {}
    for line in text.split("\n"):
        name, tab, source = line.partition("\t")
        if tab and source:
            found[name] = source
    return found


def recordable(source: str | None) -> str | None:
    """``source`` if a ``sources`` line can hold it (no tab, no line break), else ``None``:
    unknown, which ``repack remove`` treats as a source that is gone."""
    if source is None or "\t" in source or "\n" in source or "\r" in source:
        return None
    return source


def npy_header(path: str) -> tuple[Array, int]:
    """Read the header of a ``.npy`` file: its array description and file size."""
    with open(path, "rb") as stream:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        if fortran or dtype.hasobject:
            raise FormatError(f"{path}: not a plain C-order numeric array")
        offset = stream.tell()
        size = os.fstat(stream.fileno()).st_size
    if offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != size:
        raise FormatError(f"{path}: {size} bytes, not what its header describes")
    return Array(offset, dtype.str, tuple(int(n) for n in shape)), size


def describe(arrays: Arrays) -> tuple[Array, Array, Array]:
    return tuple(Array(0, a.dtype.str, tuple(int(n) for n in a.shape)) for a in arrays)


class PackWriter:
    """Appends 64-byte aligned arrays to a new pack file; small ones gathered in memory."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.position = 0  # end of the pack, buffered bytes included
        self._buffer = bytearray()
        self._buffer_start = 0

    def _pad(self) -> int:
        start = align_up(self.position, ARRAY_ALIGNMENT)
        self._buffer += bytes(start - self.position)
        self.position = start
        return start

    def add(self, array: np.ndarray) -> int:
        """Append ``array``'s bytes; return their offset."""
        start = self._pad()
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        self._buffer += data
        self.position += len(data)
        if len(self._buffer) >= WRITE_BUFFER:
            self.drain()
        return start

    def copy(self, src: int, src_offset: int, size: int) -> int:
        """Append ``size`` bytes of file ``src`` from ``src_offset``; return their offset."""
        start = self._pad()
        self.drain()
        copy_range(src, self.fd, src_offset, start, size)
        self.position = self._buffer_start = start + size
        return start

    def drain(self) -> None:
        view = memoryview(self._buffer)
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], self._buffer_start + done)
        self._buffer_start += len(view)
        view.release()
        self._buffer = bytearray()


class Records:
    """The catalog's records by dataset name, in columns: every name in one text and every
    record in another (:class:`~repack.format.sources.Texts`), found by a sorted column of the
    names' hashes, and the records set since in a dict. A warm build of tens of thousands of
    datasets looks each up once; as a dict of strings they were two string objects and a slot
    each, about 350 bytes a dataset in every process, here about 180."""

    def __init__(self, records: dict[str, Any]) -> None:
        self._names = Texts(records)
        self._records = Texts(records.values())
        # the names as JSON decoded them hashed (str keeps its hash): no name made again
        hashes = np.fromiter(map(hash, records), np.int64, len(records))
        self._index = TextIndex(self._names, hashes)
        self._record_text, self._record_ends = self._records.text, ints_of(self._records.ends)
        self._added: dict[str, Any] = {}

    @classmethod
    def of(cls, records: dict[str, Any]) -> Records | dict[str, Any]:
        """``records`` in columns; as they are where one is not a string (catalog version 1)."""
        if all(type(item) is str for item in records.values()):
            return cls(records)
        return records

    def get(self, name: str, default: Any = None) -> Any:
        found = self._added.get(name)
        if found is not None:
            return found
        row = self._index.find(name)
        return default if row is None else self._records[row]

    def pack_samples(self, name: str) -> tuple[int, str] | None:
        """``record_pack_samples(self.get(name))``, read in place in the text of records
        (no record made: a warm build asks it of every dataset)."""
        found = self._added.get(name)
        if found is not None:
            return record_pack_samples(found)
        row = self._index.find(name)
        if row is None:
            return None
        ends = self._record_ends
        match = _RECORD.fullmatch(self._record_text, ends[row - 1] if row else 0, ends[row])
        if match is None:
            return None
        pack, rows = match.groups()
        return int(rows) - 1, pack

    def __setitem__(self, name: str, item: Any) -> None:
        self._added[name] = item

    def items(self) -> Iterator[tuple[str, Any]]:
        """Every name and record, a name set since with its new record."""
        for row in range(len(self._names)):
            name = self._names[row]
            if name not in self._added:
                yield name, self._records[row]
        yield from self._added.items()
