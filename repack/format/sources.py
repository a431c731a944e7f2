"""The manifest's sources and blend as columns: one numpy array per field, a source's
:class:`SourceEntry` (a blend's ``BlendEntry``) made when asked for.

A loader reads a repack of tens of thousands of sources in every DataLoader worker. Parsed into
one entry per source (a ``SourceEntry``, its ``SegmentEntry`` and their strings and tuples), the
manifest held about 700 bytes and 3 objects for the garbage collector per source, in every
process. Here the integers are ``int64`` columns, the strings one text each (every value joined,
with an ``int64`` column of where each ends), and a prefix is found by a sorted column of its
hash: no object per source, and nothing the collector walks. :class:`SourceTable` is a read-only
sequence of entries, made one by one when indexed or iterated, so that every caller of
``manifest.sources`` reads it as before.
"""

from __future__ import annotations

import binascii
import bisect
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from repack.format import spec as fmt
from repack.format.blend import BlendEntry

__all__ = [
    "READ_FIELDS",
    "SEGMENT_FIELDS",
    "SEGMENT_READ_FIELDS",
    "SOURCE_FIELDS",
    "EntryTable",
    "SegmentEntry",
    "SourceEntry",
    "SourceTable",
    "TextIndex",
    "Texts",
    "ints_of",
]

#: The integer fields of a source, in a column each (``multimodal`` as 0 or 1).
SOURCE_FIELDS = (
    "dtype_code",
    "multimodal",
    "sequence_start",
    "sequence_count",
    "document_start",
    "document_count",
    "token_count",
    "bin_size",
    "idx_size",
)
#: The integer fields of a segment, in a column each.
SEGMENT_FIELDS = ("shard", "first", "count", "offset", "size", "source_offset")
_SEGMENT_COLUMNS = (*(f"segment_{name}" for name in SEGMENT_FIELDS), "segment_checksum")
#: The string fields, in a :class:`Texts` each (``prefixes``: every source's, in order).
_TEXT_FIELDS = ("path", "bin_checksum", "idx_checksum", "prefixes", "segment_checksum")


@dataclass(frozen=True, slots=True)
class SegmentEntry:
    """Sequences ``[first, first + count)`` of a source (source-local numbering), stored at
    ``offset`` in shard ``shard``; they are bytes ``[source_offset, source_offset + size)`` of
    the original ``.bin``."""

    shard: int
    first: int
    count: int
    offset: int
    size: int
    source_offset: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        """The manifest member this entry is parsed from (``sources[k].segments[j]``)."""
        return {
            "shard": self.shard,
            "first": self.first,
            "count": self.count,
            "offset": self.offset,
            "size": self.size,
            "source_offset": self.source_offset,
            "checksum": self.checksum,
        }


@dataclass(frozen=True, slots=True)
class SourceEntry:
    """One source prefix of the blend, stored once however often the blend names it."""

    id: int
    path: str
    prefixes: tuple[str, ...]
    dtype_code: int
    multimodal: bool
    sequence_start: int
    sequence_count: int
    document_start: int
    document_count: int
    token_count: int
    bin_size: int
    idx_size: int
    bin_checksum: str
    idx_checksum: str
    segments: tuple[SegmentEntry, ...]

    @property
    def dtype(self) -> np.dtype:
        """Numpy dtype of the tokens."""
        return fmt.dtype_from_code(self.dtype_code)

    @property
    def name(self) -> str:
        """How the blend first wrote this source."""
        return self.prefixes[0]

    def to_json(self) -> dict[str, Any]:
        """The manifest member this entry is parsed from (``sources[k]``)."""
        return {
            "id": self.id,
            "path": self.path,
            "prefixes": list(self.prefixes),
            "dtype": self.dtype.name,
            "dtype_code": self.dtype_code,
            "multimodal": self.multimodal,
            "sequences": [self.sequence_start, self.sequence_count],
            "documents": [self.document_start, self.document_count],
            "tokens": self.token_count,
            "bin_size": self.bin_size,
            "idx_size": self.idx_size,
            "bin_checksum": self.bin_checksum,
            "idx_checksum": self.idx_checksum,
            "segments": [segment.to_json() for segment in self.segments],
        }


class Texts:
    """Strings in one text, the ``i``-th made when asked for (``texts[i]``)."""

    __slots__ = ("_ends", "_text")

    def __init__(self, values: Iterable[str]) -> None:
        values = list(values)
        self._text = "".join(values)
        self._ends = np.fromiter(map(len, values), np.int64, len(values)).cumsum()

    @classmethod
    def sharing(cls, values: Iterable[str], *others: Any) -> Texts:
        """The :class:`Texts` of ``values``: the first of ``others`` that holds the same
        strings, else a new one (a manifest's source paths, their prefixes and its blend's
        prefixes and paths are most often the same strings: held once, not up to four times)."""
        made = cls(values)
        for other in others:
            if (
                type(other) is cls
                and other._text == made._text
                and np.array_equal(other._ends, made._ends)
            ):
                return other
        return made

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int) -> str:
        end = int(self._ends[i])
        return self._text[int(self._ends[i - 1]) if i else 0 : end]

    @property
    def text(self) -> str:
        """Every string, joined."""
        return self._text

    @property
    def ends(self) -> np.ndarray:
        """Where each string ends in :attr:`text` (``int64``)."""
        return self._ends

    def hashes(self) -> np.ndarray:
        """``hash`` of every string, in order, as ``int64`` (each string made in turn)."""
        text, ends = self._text, ints_of(self._ends)

        def each() -> Iterator[int]:
            start = 0
            for end in ends:
                yield hash(text[start:end])
                start = end

        return np.fromiter(each(), np.int64, len(ends))


class Digests:
    """Checksums (``algorithm:hex``) of one algorithm and one length, the ``i``-th made when
    asked for (``digests[i]``), held as their bytes: 16 bytes a row for ``xxh3-128``, not the
    41 characters and the 8-byte end of a :class:`Texts` row."""

    __slots__ = ("_digests", "_prefix", "_size")

    def __init__(self, prefix: str, digests: bytes, size: int) -> None:
        self._prefix = prefix
        self._digests = digests
        self._size = size

    @classmethod
    def of(cls, values: list[str]) -> Digests | None:
        """The digests of ``values``, or ``None`` where they are not all ``prefix:hex`` of
        one prefix and one length, in lowercase hex (what ``[i]`` gives back)."""
        if not values:
            return None
        prefix, colon, first = values[0].rpartition(":")
        if not colon or not first or len(first) % 2:
            return None
        prefix += ":"
        start, width = len(prefix), len(prefix) + len(first)
        if set(map(len, values)) != {width}:
            return None
        # the column as one row of ASCII bytes per value, checked and cut with numpy (a slice
        # and a startswith per value took 8 ms a column at 30,000 sources)
        text = "".join(values)
        if not text.isascii():
            return None
        rows = np.frombuffer(text.encode("ascii"), np.uint8).reshape(len(values), width)
        if not (rows[:, :start] == rows[0, :start]).all():  # each starts with the prefix
            return None
        hexes = rows[:, start:].tobytes()
        try:
            digests = binascii.unhexlify(hexes)
        except binascii.Error:
            return None
        if binascii.hexlify(digests) != hexes:  # uppercase: not as written
            return None
        return cls(prefix, digests, len(first) // 2)

    def __len__(self) -> int:
        return len(self._digests) // self._size

    def __getitem__(self, i: int) -> str:
        n = len(self)
        k = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= k < n:
            raise IndexError(f"index {i} is out of range for {n} checksums")
        return self._prefix + self._digests[k * self._size : (k + 1) * self._size].hex()


def _checksums(values: list[str], *others: Any) -> Digests | Texts:
    """A column of checksums: :class:`Digests` where they allow it (the first of ``others``
    holding the same), else :class:`Texts`."""
    made = Digests.of(values)
    if made is None:
        return Texts.sharing(values, *others)
    for other in others:
        if (
            type(other) is Digests
            and other._prefix == made._prefix
            and other._digests == made._digests
        ):
            return other
    return made


def _column(values: list[int]) -> np.ndarray:
    column = np.array(values, dtype=np.int64)
    column.flags.writeable = False
    return column


class _Columns(Sequence):
    """A read-only sequence of entries made from columns when asked for (``_entry(i)``), equal
    to the tuple of them."""

    def _entry(self, i: int) -> Any:
        raise NotImplementedError

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{type(self).__name__}: row {index} of {n}")
        return self._entry(i)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self._entry(i)

    def __add__(self, other: Any) -> tuple:
        return (*self, *other)

    def __radd__(self, other: Any) -> tuple:
        return (*other, *self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} rows)"


class SourceTable(_Columns):
    """The sources of a manifest, in columns; ``table[i]`` is source ``i``'s ``SourceEntry``.

    Built by :meth:`builder` (the manifest's parser) or :meth:`of` (entries made elsewhere). Per
    source: the :data:`SOURCE_FIELDS` columns, ``path``, ``bin_checksum``, ``idx_checksum``
    (:class:`Texts`), its prefixes (``prefix_ends``: where its prefixes end in ``prefixes``) and
    its segments (``segment_ends``: where they end in the :data:`SEGMENT_FIELDS` columns and
    ``segment_checksum``).
    """

    def __init__(self, columns: dict[str, Any]) -> None:
        self.columns = columns
        for name, value in columns.items():
            setattr(self, name, value)
        self._lookup: tuple[TextIndex, TextIndex] | None = None
        self._readers()

    def _readers(self) -> None:
        """What :meth:`reading` and :meth:`segment` read with: a ``struct`` of the fields a
        read takes, unpacked from the row arrays' own bytes (Python integers in one call, no
        numpy scalar, nothing more held per source), and the segments' ``first`` column as a
        memoryview (what :func:`bisect.bisect_right` searches, a few hundred ns less than
        ``np.searchsorted``)."""
        self._source_bytes = _bytes_of(self.source_rows)
        self._segment_bytes = _bytes_of(self.segment_rows)
        self._segment_firsts = ints_of(self.segment_first)
        #: ``sequence_start`` and ``sequence_count`` indexed as Python integers (views of the
        #: same bytes): what a read checks its sequence number against.
        self.sequence_starts = ints_of(self.sequence_start)
        self.sequence_counts = ints_of(self.sequence_count)

    # memoryviews do not pickle: made again from the columns
    def __getstate__(self) -> dict[str, Any]:
        return {"columns": self.columns, "_lookup": self._lookup}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["columns"])
        self._lookup = state["_lookup"]

    @classmethod
    def builder(cls) -> _Builder:
        """A builder that takes each source as the parser validates it."""
        return _Builder()

    @classmethod
    def of(cls, entries: Iterable[Any]) -> SourceTable:
        """The table of ``entries`` (``SourceEntry`` objects, ids ``0..n-1`` in order)."""
        build = _Builder()
        for entry in entries:
            build.add(entry, entry.segments)
        return build.table()

    # --- the sequence of entries ---------------------------------------------------------

    def __len__(self) -> int:
        return len(self.sequence_start)

    def _entry(self, i: int) -> Any:
        first = int(self.prefix_ends[i - 1]) if i else 0
        begin = int(self.segment_ends[i - 1]) if i else 0
        segments = tuple(
            SegmentEntry(
                *(int(self.columns[f"segment_{name}"][k]) for name in SEGMENT_FIELDS),
                self.segment_checksum[k],
            )
            for k in range(begin, int(self.segment_ends[i]))
        )
        fields = {name: int(self.columns[name][i]) for name in SOURCE_FIELDS}
        fields["multimodal"] = bool(fields["multimodal"])
        return SourceEntry(
            id=i,
            path=self.path[i],
            prefixes=tuple(self.prefixes[k] for k in range(first, int(self.prefix_ends[i]))),
            bin_checksum=self.bin_checksum[i],
            idx_checksum=self.idx_checksum[i],
            segments=segments,
            **fields,
        )

    # --- what the loader asks per source, without an entry ---------------------------------

    def segments_of(self, i: int) -> range:
        """The rows of source ``i``'s segments in the ``segment_*`` columns."""
        return range(int(self.segment_starts[i]), int(self.segment_ends[i]))

    def plan(self, i: int) -> list[int]:
        """Source ``i``'s :data:`SOURCE_FIELDS`, then where its segments start and end in the
        ``segment_*`` columns, as Python integers, in one call (what a read needs)."""
        return self.source_rows[i].tolist()

    def reading(self, i: int) -> tuple[int, int, int, int, int]:
        """Source ``i``'s :data:`READ_FIELDS` (``dtype_code, sequence_start, sequence_count,
        segment_starts, segment_ends``) as Python integers: what every sample read asks, in
        one ``struct`` unpack of its row (a third of :meth:`plan`'s cost)."""
        return _READ_ROW.unpack_from(self._source_bytes, i * _SOURCE_ROW_BYTES)

    def segment(self, k: int) -> tuple[int, int, int, int]:
        """Row ``k`` of the ``segment_*`` columns' :data:`SEGMENT_READ_FIELDS` (``shard,
        offset, size, source_offset``) as Python integers, in one unpack."""
        return _SEGMENT_ROW.unpack_from(self._segment_bytes, k * _SEGMENT_ROW_BYTES)

    def segment_at(self, seg: int, seg_end: int, idx: int) -> int:
        """The row among ``[seg, seg_end)`` (a source's segments) that holds its sequence
        ``idx``: the last whose ``first`` is at most ``idx``."""
        return bisect.bisect_right(self._segment_firsts, idx, seg, seg_end) - 1

    def dtype(self, i: int) -> np.dtype:
        """Source ``i``'s token dtype."""
        return fmt.dtype_from_code(int(self.dtype_code[i]))

    def find(self, prefix: str) -> int | None:
        """The id of the source written as ``prefix`` in the blend, else of the source whose
        absolute path it normalizes to, else ``None`` (the first source that claims a name
        wins, as a scan in source order would find it). Sorted columns of hashes
        (:class:`TextIndex`), built on first use: no dict of tens of thousands of strings."""
        by_prefix, by_path = self._indexes()
        found = by_prefix.find(prefix)
        if found is not None:
            return int(self.prefix_ends.searchsorted(found, side="right"))
        return by_path.find(os.path.normpath(prefix))

    def _indexes(self) -> tuple[TextIndex, TextIndex]:
        if self._lookup is None:
            by_prefix = TextIndex(self.prefixes)
            # paths that are their prefixes (Texts.sharing): one index for both
            same = self.path is self.prefixes
            self._lookup = (by_prefix, by_prefix if same else TextIndex(self.path))
        return self._lookup

    def find_all(self, prefixes: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`find` of each of ``prefixes`` (strings) where it finds the prefix as the
        blend wrote it, at once (a blend's tens of thousands): two ``int64`` arrays, the row of
        each in ``prefixes`` and its source's id, ``-1`` in both where :meth:`find` must be
        asked (a path, or not a source). :meth:`holds_prefix` checks a row later."""
        rows = self._indexes()[0].find_all(prefixes)
        ids = np.full(len(rows), -1, np.int64)
        found = rows >= 0
        ids[found] = self.prefix_ends.searchsorted(rows[found], side="right")
        return rows, ids

    @property
    def holds_prefix(self) -> Any:
        """``holds_prefix(row, prefix)``: whether row ``row`` of ``prefixes`` is ``prefix``."""
        return self._indexes()[0].holds


_HALF = 1 << 63  # a hash plus this: its rank as unsigned, what TextIndex's buckets divide


class TextIndex:
    """Finds a string's row in :class:`Texts` by a sorted column of the strings' hashes (about
    13 bytes a row: the hash, the row as ``int32``, where its bucket starts; nothing for the
    garbage collector); the first of equal rows wins.

    A lookup reads the columns through memoryviews (Python integers, no numpy scalar) and
    compares the string in place in the texts' one text (no string made per lookup): a warm
    build looks up every dataset's name and prefix. The hashes are ``str``'s own, which differ
    from process to process: a pickled index hashes its texts again where it is unpickled."""

    __slots__ = ("_ends", "_hashes", "_order", "_rows", "_shift", "_sorted", "_starts", "_texts")

    def __init__(self, texts: Texts, hashes: np.ndarray | None = None) -> None:
        """``hashes``: the hash of every text, in order, where the caller has them (a
        catalog's names, hashed when JSON decoded them), else made here."""
        if hashes is None:
            hashes = texts.hashes()
        order = np.argsort(hashes, kind="stable")
        self._hashes = hashes[order]
        self._order = order.astype(np.int32) if len(order) < 2**31 else order
        # buckets of the hashes' top bits (a hash is uniform), about 4 rows each: where each
        # starts in the sorted column (a lookup searches its bucket, a few rows in a cache
        # line or two, not the whole column; 1 byte a row, the int32 order saves 4)
        bits = max(1, (len(hashes) // 4).bit_length())
        self._shift = 64 - bits
        top = (self._hashes.view(np.uint64) ^ np.uint64(1 << 63)) >> np.uint64(self._shift)
        starts = top.searchsorted(np.arange((1 << bits) + 1, dtype=np.uint64))
        self._starts = memoryview(starts.astype(np.int32) if len(order) < 2**31 else starts)
        self._texts = texts
        self._sorted = ints_of(self._hashes)
        self._rows = memoryview(self._order)
        self._ends = ints_of(self._texts._ends)

    def __getstate__(self) -> tuple[Texts]:
        return (self._texts,)

    def __setstate__(self, state: tuple[Texts]) -> None:
        self.__init__(state[0])

    def holds(self, row: int, text: str) -> bool:
        """Whether row ``row`` of the texts is ``text`` (compared in place)."""
        ends = self._ends
        start = ends[row - 1] if row else 0
        return ends[row] - start == len(text) and self._texts._text.startswith(text, start)

    def find(self, text: str) -> int | None:
        """The smallest row equal to ``text``, else ``None``."""
        key = hash(text)
        hashes = self._sorted
        bucket = (key + _HALF) >> self._shift
        end = self._starts[bucket + 1]
        at = bisect.bisect_left(hashes, key, self._starts[bucket], end)
        while at < end and hashes[at] == key:
            row = self._rows[at]
            ends = self._ends  # holds(row, text), inline: every lookup pays for it
            start = ends[row - 1] if row else 0
            if ends[row] - start == len(text) and self._texts._text.startswith(text, start):
                return row
            at += 1
        return None

    def find_all(self, texts: Sequence[str]) -> np.ndarray:
        """:meth:`find` of each of ``texts`` (strings), at once: an ``int64`` array of their
        rows, ``-1`` where :meth:`find` must be asked (not found, or a row of the same hash
        that is another string)."""
        n = len(texts)
        if not len(self._hashes) or not n:
            return np.full(n, -1, np.int64)
        keys = np.fromiter(map(hash, texts), np.int64, n)
        at = self._hashes.searchsorted(keys)
        inside = np.minimum(at, len(self._hashes) - 1)
        rows = self._order[inside].astype(np.int64)
        # the first row of a hash, as find tries first: the smallest of its equal rows
        ok = (at < len(self._hashes)) & (self._hashes[inside] == keys)
        ends = self._texts._ends
        starts = np.where(rows > 0, ends[rows - 1], 0).astype(np.int64)
        ok &= ends[rows] - starts == np.fromiter(map(len, texts), np.int64, n)
        ok &= np.fromiter(map(self._texts._text.startswith, texts, ints_of(starts)), bool, n)
        return np.where(ok, rows, -1)


class _Builder:
    """Gathers sources as plain lists; :meth:`table` makes the columns."""

    def __init__(self) -> None:
        self.values: dict[str, list[Any]] = {name: [] for name in SOURCE_FIELDS}
        for name in SEGMENT_FIELDS:
            self.values[f"segment_{name}"] = []
        for name in _TEXT_FIELDS:
            self.values[name] = []
        self.prefix_ends: list[int] = []
        self.segment_ends: list[int] = []

    def add_row(
        self,
        fields: tuple[int, ...],
        texts: tuple[str, str, str],
        prefixes: list[str],
        segments: list[tuple],
    ) -> None:
        """A source as the parser checked it: its :data:`SOURCE_FIELDS` in order, its path,
        bin and idx checksums, prefixes, and segments (:data:`SEGMENT_FIELDS` and checksum)."""
        values = self.values
        for name, value in zip(SOURCE_FIELDS, fields):
            values[name].append(value)
        for name, value in zip(("path", "bin_checksum", "idx_checksum"), texts):
            values[name].append(value)
        values["prefixes"].extend(prefixes)
        self.prefix_ends.append(len(values["prefixes"]))
        for segment in segments:
            for name, value in zip(_SEGMENT_COLUMNS, segment):
                values[name].append(value)
        self.segment_ends.append(len(values["segment_checksum"]))

    def add_columns(
        self, values: dict[str, list[Any]], prefix_ends: list[int], segment_ends: list[int]
    ) -> None:
        """Every source at once, on an empty builder (the parser's bulk path): per column, the
        values :meth:`add_row` would have appended (integers in a list or an array, strings in
        a list), and where each source's prefixes and segments end."""
        if self.prefix_ends or values.keys() != self.values.keys():
            raise ValueError("add_columns takes every column, on an empty builder")
        self.values = values
        self.prefix_ends = prefix_ends
        self.segment_ends = segment_ends

    def add(self, source: Any, segments: Sequence[Any]) -> None:
        """Source ``source`` (anything with a ``SourceEntry``'s fields) and its segments."""
        self.add_row(
            tuple(int(getattr(source, name)) for name in SOURCE_FIELDS),
            (source.path, source.bin_checksum, source.idx_checksum),
            list(source.prefixes),
            [(*(getattr(s, name) for name in SEGMENT_FIELDS), s.checksum) for s in segments],
        )

    def table(self) -> SourceTable:
        values = self.values
        columns: dict[str, Any] = {}
        for name in _TEXT_FIELDS:
            make = _checksums if name.endswith("checksum") else Texts.sharing
            columns[name] = make(values[name], *columns.values())
        columns["prefix_ends"] = _column(self.prefix_ends)
        starts = [0, *self.segment_ends[:-1]]
        # one row per source (a reader takes a row in one call, Source_table.plan), each
        # field a column view of it
        names = _SOURCE_ROW
        rows = _rows([*(values[name] for name in SOURCE_FIELDS), starts, self.segment_ends])
        columns["source_rows"] = rows
        columns.update((name, rows[:, k]) for k, name in enumerate(names))
        rows = _rows([values[name] for name in _SEGMENT_COLUMNS[:-1]])
        columns["segment_rows"] = rows
        columns.update((name, rows[:, k]) for k, name in enumerate(_SEGMENT_COLUMNS[:-1]))
        return SourceTable(columns)


#: The columns of ``source_rows``, in order (every source field, then its segment rows).
_SOURCE_ROW = (*SOURCE_FIELDS, "segment_starts", "segment_ends")
#: What a read takes of a source's row (:meth:`SourceTable.reading`), in row order.
READ_FIELDS = ("dtype_code", "sequence_start", "sequence_count", "segment_starts", "segment_ends")
#: What a read takes of a segment's row (:meth:`SourceTable.segment`), in row order.
SEGMENT_READ_FIELDS = ("shard", "offset", "size", "source_offset")


def _row_struct(names: tuple[str, ...], wanted: tuple[str, ...]) -> struct.Struct:
    """A ``struct`` of a native ``int64`` row of ``names`` that unpacks the ``wanted`` ones
    (skipping the others)."""
    return struct.Struct("=" + "".join("q" if name in wanted else "8x" for name in names))


_READ_ROW = _row_struct(_SOURCE_ROW, READ_FIELDS)
_SOURCE_ROW_BYTES = 8 * len(_SOURCE_ROW)
_SEGMENT_ROW = _row_struct(SEGMENT_FIELDS, SEGMENT_READ_FIELDS)
_SEGMENT_ROW_BYTES = 8 * len(SEGMENT_FIELDS)


def _bytes_of(rows: np.ndarray) -> memoryview:
    """The bytes of a row array as native ``int64`` rows (its own, as :func:`_rows` makes
    them)."""
    return memoryview(np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)).cast("B")


def ints_of(column: np.ndarray) -> memoryview | np.ndarray:
    """``column`` indexed as Python integers (a memoryview), where its format allows; else
    the array itself (numpy scalars, compared as well)."""
    view = memoryview(column)
    return view if view.format in ("l", "q") else column


def _rows(columns: list[Any]) -> np.ndarray:
    """The columns as the columns of one read-only ``int64`` array."""
    rows = (
        np.array(columns, dtype=np.int64).T.copy()
        if len(columns[0])
        else np.empty((0, len(columns)), np.int64)
    )
    rows.flags.writeable = False
    return rows


class EntryTable(_Columns):
    """A split of the manifest's blend in columns: ``table[i]`` is its ``i``-th
    :class:`~repack.format.blend.BlendEntry`, made when asked for (the blend a manifest
    records names every source once or more: an entry, two strings and a float per source
    in every process that opens the repack, none here)."""

    def __init__(self, entries: Iterable[Any], like: Iterable[Texts] = ()) -> None:
        entries = list(entries)
        self._fill(
            [e.prefix for e in entries],
            [e.weight for e in entries],
            [e.path for e in entries],
            like,
        )

    @classmethod
    def of_columns(
        cls,
        prefixes: list[str],
        weights: list[float | None],
        paths: list[str],
        like: Iterable[Texts] = (),
    ) -> EntryTable:
        """The split of these columns (:data:`~repack.format.blend.EntryColumns`, what the
        manifest's parser reads): no entry made."""
        table = cls.__new__(cls)
        table._fill(prefixes, weights, paths, like)
        return table

    def _fill(
        self,
        prefixes: list[str],
        weights: list[float | None],
        paths: list[str],
        like: Iterable[Texts],
    ) -> None:
        like = tuple(like)  # texts held already (the sources' paths and prefixes): shared
        self.prefix = Texts.sharing(prefixes, *like)
        self.path = Texts.sharing(paths, self.prefix, *like)
        # NaN for no weight (None, which numpy's float conversion makes NaN): a blend's weights
        # are finite and positive
        self.weights = np.array(weights, np.float64)

    def __len__(self) -> int:
        return len(self.weights)

    def _entry(self, i: int) -> BlendEntry:
        weight = float(self.weights[i])
        weight = None if np.isnan(weight) else weight
        return BlendEntry(self.prefix[i], weight, self.path[i])
