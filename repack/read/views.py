"""Megatron ``IndexedDataset``-shaped views of the sources of a repack. numpy only.

A :class:`SourceDataset` answers everything Megatron's datasets ask of an ``IndexedDataset``
(``len``, ``[int]``, ``[slice]``, ``get``, ``sequence_lengths``, ``sequence_pointers``,
``document_indices``, ``sequence_modes``, ``path_prefix``, ``exists``) from the shared, once-per-
process :class:`~repack.read.reader.Repack`: a thousand views hold no more mmaps or file descriptors
than one. Views pickle by reference and re-attach to the repack of the process that unpickles
them (DataLoader workers, fork or spawn).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from repack.errors import FormatError, IncompatibleSources, UnknownSource
from repack.format.manifest import SourceEntry
from repack.format.spec import DTYPES
from repack.read.reader import Repack, open_repack

#: Token size by Megatron dtype code.
_ITEMSIZES = {code: dtype.itemsize for code, dtype in DTYPES.items()}

__all__ = ["BlendIds", "SourceDataset", "resolve_source"]


def resolve_source(repack: Repack, prefix: str) -> SourceEntry:
    """The source of ``repack`` that the blend prefix ``prefix`` names.

    A prefix matches a source when it is written exactly as in the blend the repack was made
    from, or when it names the same absolute path (relative prefixes resolve against the
    current directory, as Megatron does). The original files are never looked at, so this works
    after they are moved or deleted.

    Raises:
        UnknownSource: no source matches.
    """
    return repack.manifest.sources[_resolve_id(repack, prefix)]


def _resolve_id(repack: Repack, prefix: str) -> int:
    """The id of :func:`resolve_source`'s source."""
    found = repack.manifest.find_source_id(prefix)
    if found is None and not os.path.isabs(prefix):
        found = repack.manifest.find_source_id(os.path.abspath(prefix))
    if found is None:
        raise UnknownSource(
            f"{prefix}: not in the repack {repack.path} ({len(repack.manifest.sources)} sources; "
            "see 'repack inspect'); merge a blend that contains it"
        )
    return found


class BlendIds:
    """The sources of a blend's prefixes in a repack, found at once
    (:meth:`~repack.format.sources.SourceTable.find_all`) for a builder that asks for them one
    by one, in order: :meth:`take` gives the next prefix's id where it is the prefix asked for.
    A tuple of the prefixes as they were (the blend's own strings) and an ``int64`` array of
    their ids, 8 bytes a prefix each, made in one go and let go when the last prefix is taken:
    no object per prefix."""

    __slots__ = ("_found", "_next", "repack")

    def __init__(self, repack: Repack, prefixes: Sequence[str]) -> None:
        self.repack = repack
        prefixes = tuple(prefixes)  # as found: the list may change later
        ids = repack.manifest.source_table.find_all(prefixes)[1]
        self._found: tuple[tuple[str, ...], Any] | None = (prefixes, memoryview(ids))
        self._next = 0

    @property
    def done(self) -> bool:
        """Whether every prefix was taken (the arrays let go)."""
        return self._found is None

    def take(self, prefix: str) -> int | None:
        """The id :func:`_resolve_id` gives ``prefix`` where it is the blend's next prefix and
        was found as written, else ``None`` (ask :func:`_resolve_id`); moves past the next
        prefix where it is ``prefix``. Threads may take at once: whatever the order, an id is
        given for the prefix it was found for."""
        found = self._found  # one read: another thread may let them go
        if found is None:
            return None
        prefixes, ids = found
        k = self._next
        if k >= len(prefixes) or prefixes[k] != prefix:  # the builder's own string: `is`
            return None  # not the next prefix (asked out of order): not moved
        self._next = k + 1
        if k + 1 == len(prefixes):
            self._found = None
        found_id = ids[k]
        return found_id if found_id >= 0 else None


class SourceDataset:
    """One source of a repack, read like Megatron-Core's ``IndexedDataset``.

    A view holds the shared repack, its source's number and how it was asked for: its arrays
    are views of the repack's index made when read, and its segments are read from the
    manifest's columns (:class:`~repack.format.sources.SourceTable`), so that a process with
    tens of thousands of views holds no array, entry or dict per source.

    Args:
        repack_dir: The repack folder.
        path_prefix: The source's prefix as the training config writes it.
        multimodal: Return ``(tokens, mode)`` pairs, as ``IndexedDataset(multimodal=True)``.
        mmap: ``True`` reads shards through one shared mmap each, ``False`` with ``pread`` on
            one shared descriptor each (no data mmaps at all).
    """

    __slots__ = ("_documents", "_id", "mmap", "multimodal", "path_prefix", "repack", "repack_dir")

    def __init__(
        self, repack_dir: str, path_prefix: str, multimodal: bool = False, mmap: bool = True
    ) -> None:
        self._attach(repack_dir, path_prefix, multimodal, mmap)

    @classmethod
    def found(
        cls,
        repack_dir: str,
        path_prefix: str,
        found: tuple[Repack, int],
        multimodal: bool = False,
        mmap: bool = True,
    ) -> SourceDataset:
        """``SourceDataset(repack_dir, path_prefix, multimodal, mmap)``, where ``found`` is
        ``(repack, id)``: the source ``path_prefix`` resolves to in ``repack``
        (:class:`BlendIds`), taken where ``repack`` is the one the view opens."""
        view = cls.__new__(cls)
        view._attach(repack_dir, path_prefix, multimodal, mmap, found)
        return view

    def _attach(
        self,
        repack_dir: str,
        path_prefix: str,
        multimodal: bool,
        mmap: bool,
        found: tuple[Repack, int] | None = None,
    ) -> None:
        self.repack = open_repack(repack_dir, "mmap" if mmap else "pread")
        if found is not None and found[0] is self.repack:
            self._id = found[1]
        else:
            self._id = _resolve_id(self.repack, path_prefix)
        if multimodal and not self._table.multimodal[self._id]:
            raise IncompatibleSources(
                f"{path_prefix}: asked for as multimodal, but the source has no sequence modes"
            )
        self.repack_dir = repack_dir
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self._documents = None  # set_document_indices's, else the repack's

    @property
    def _table(self):
        return self.repack.manifest.source_table

    @property
    def source(self) -> SourceEntry:
        """The source's manifest entry (made when asked for)."""
        return self.repack.manifest.sources[self._id]

    @property
    def source_path(self) -> str:
        """The source's absolute path (its entry's ``path``, without making the entry)."""
        return self._table.path[self._id]

    def _sequences(self) -> slice:
        table, i = self.repack.manifest.source_table, self._id
        start = table.sequence_starts[i]
        return slice(start, start + table.sequence_counts[i])

    # --- pickling by reference ---------------------------------------------------------------

    def __getstate__(self) -> tuple[str, str, bool, bool]:
        return (self.repack_dir, self.path_prefix, self.multimodal, self.mmap)

    def __setstate__(self, state: tuple[str, str, bool, bool]) -> None:
        self._attach(*state)

    def __repr__(self) -> str:
        return (
            f"SourceDataset({self.path_prefix!r}, repack={self.repack_dir!r}, "
            f"backend={self.repack.backend!r})"
        )

    # --- IndexedDataset interface -----------------------------------------------------------

    def __len__(self) -> int:
        return self.repack.manifest.source_table.sequence_counts[self._id]

    def byte_range(self, idx: int, offset: int, count: int) -> tuple[int, int, int]:
        """Where ``count`` tokens from token ``offset`` of sequence ``idx`` are:
        ``(shard, byte offset in the shard, bytes)``.

        Raises:
            FormatError: the range is outside the source's segment (a damaged index).
        """
        table = self.repack.manifest.source_table
        return self._locate(table, table.reading(self._id), idx, offset, count)

    def _locate(
        self, table, row: tuple[int, int, int, int, int], idx: int, offset: int, count: int
    ) -> tuple[int, int, int]:
        """:meth:`byte_range`, with the source's row of the table (``SourceTable.reading``).
        Python integers throughout: every sample read pays for this."""
        code, seq_start, _, seg, seg_end = row
        if seg_end - seg > 1:
            seg = table.segment_at(seg, seg_end, idx)
        shard, seg_offset, size, source_offset = table.segment(seg)
        itemsize = _ITEMSIZES[code]
        start = int(self.repack.pointer_values[seq_start + idx]) - source_offset
        start += offset * itemsize
        end = start + count * itemsize
        if start < 0 or end > size:
            # a damaged pointer must not serve another source's bytes: refuse, cheaply
            raise FormatError(
                f"{self.repack.path}: sequence {idx} of {self.source.name!r} would read bytes "
                f"{start}..{end} of a {size}-byte segment; the index is damaged or the "
                "request is out of range (run 'repack verify')"
            )
        return shard, seg_offset + start, end - start

    def byte_ranges(
        self, idx: np.ndarray, offset: np.ndarray, count: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`byte_range` of many pieces at once (arrays broadcast together): what
        ``repack bench`` plans. The checks and the arithmetic are :meth:`byte_range`'s, per
        array; that one stays scalar because every sample read pays for it.

        Raises:
            FormatError: a range is outside its source's segment.
        """
        idx, offset, count = (
            np.asarray(x, dtype=np.int64) for x in np.broadcast_arrays(idx, offset, count)
        )
        table = self._table
        plan = table.plan(self._id)
        code, seq_start, seg, seg_end = plan[0], plan[2], plan[9], plan[10]
        which = seg + np.searchsorted(table.segment_first[seg:seg_end], idx, side="right") - 1
        rows = np.asarray(table.segment_rows[which], dtype=np.int64)
        shards, seg_offset, size, source_offset = rows[:, 0], rows[:, 3], rows[:, 4], rows[:, 5]
        itemsize = _ITEMSIZES[code]
        pointers = np.asarray(self.repack.pointers[seq_start + idx], dtype=np.int64)
        start = pointers - source_offset + offset * itemsize
        end = start + count * itemsize
        bad = np.flatnonzero((start < 0) | (end > size))
        if len(bad):
            self.byte_range(int(idx[bad[0]]), int(offset[bad[0]]), int(count[bad[0]]))  # raises
        return shards, seg_offset + start, end - start

    def _read(self, idx: int, offset: int, count: int) -> np.ndarray:
        """``count`` tokens from token ``offset`` of sequence ``idx``."""
        table = self.repack.manifest.source_table
        row = table.reading(self._id)
        shard, start, _ = self._locate(table, row, idx, offset, count)
        return self.repack.read(shard, start, count, DTYPES[row[0]])

    def _index(self, idx: int | np.integer, n: int | None = None) -> int:
        n = len(self) if n is None else n
        i = int(idx)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {int(idx)} is out of range for {n} sequences")
        return i

    def __getitem__(self, idx):
        """A sequence (``int``), or a list of consecutive sequences (``slice``, step 1); with
        ``multimodal`` also its mode(s)."""
        if isinstance(idx, (int, np.integer)):
            table = self.repack.manifest.source_table
            i = self._index(idx, table.sequence_counts[self._id])
            start = table.sequence_starts[self._id]
            sequence = self._read(i, 0, int(self.repack.length_values[start + i]))
            return (sequence, self.sequence_modes[i]) if self.multimodal else sequence
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("Slices into indexed_dataset must be contiguous")
            lengths = self.sequence_lengths[idx]
            if stop <= start:
                sequences = []
            elif len(self._table.segments_of(self._id)) == 1:
                flat = self._read(start, 0, int(lengths.sum(dtype=np.int64)))
                sequences = np.split(flat, np.cumsum(lengths)[:-1])
            else:
                sequences = [self._read(i, 0, int(n)) for i, n in zip(range(start, stop), lengths)]
            return (sequences, self.sequence_modes[idx]) if self.multimodal else sequences
        raise TypeError(f"Unexpected type received for idx: {type(idx)}")

    def get(self, idx: int, offset: int = 0, length: int | None = None):
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end by default)."""
        table = self.repack.manifest.source_table
        n = table.sequence_counts[self._id]
        i = int(idx)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {int(idx)} is out of range for {n} sequences")
        offset = int(offset)
        if length is None:
            length = int(self.repack.length_values[table.sequence_starts[self._id] + i]) - offset
        sequence = self._read(i, offset, int(length))
        return (sequence, self.sequence_modes[i]) if self.multimodal else sequence

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 token count of every sequence."""
        return self.repack.lengths[self._sequences()]

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of every sequence in the original ``.bin``."""
        return self.repack.pointers[self._sequences()]

    @property
    def document_indices(self) -> np.ndarray:
        """int64 sequence index ending each document, with a leading 0."""
        if self._documents is not None:
            return self._documents
        table, i = self._table, self._id
        start = int(table.document_start[i])
        return self.repack.documents[start : start + int(table.document_count[i])]

    def get_document_indices(self) -> np.ndarray:
        """The document indices (Megatron's older accessor)."""
        return self.document_indices

    def set_document_indices(self, document_indices: np.ndarray) -> None:
        """Replace the document indices of this view (the repack is not changed)."""
        self._documents = np.asarray(document_indices)

    @property
    def sequence_modes(self) -> np.ndarray:
        """int8 mode of every sequence of a multimodal source."""
        if not self._table.multimodal[self._id]:
            raise AttributeError(f"{self.path_prefix}: not a multimodal source")
        return self.repack.modes[self._sequences()]

    @property
    def dtype(self) -> np.dtype:
        """The token dtype."""
        return self._table.dtype(self._id)

    def exists(self, path_prefix: str | None = None) -> bool:
        """Whether ``path_prefix`` (default: this view's) is a source of the repack."""
        prefix = self.path_prefix if path_prefix is None else path_prefix
        try:
            resolve_source(self.repack, prefix)
        except UnknownSource:
            return False
        return True
