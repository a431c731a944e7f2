"""Writing a combined index (``index.rpx``, or ``index-N.rpx`` after an add or a remove):
the four arrays of every source, one source at a time, behind the header.

The index needs no shard, so a merge writes it in a thread while the tasks copy shards; a
source's arrays come from its original ``.idx`` (read again and checked against the checksum
it had when validated) or, for the sources a repack already holds, from its current index.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from repack.checksum import digest_of, new_hasher
from repack.errors import SourceError
from repack.fileio import hash_range
from repack.format import spec as fmt
from repack.format.manifest import SourceEntry
from repack.inputs.sources import SourceIndex, SourceInfo, read_source_index
from repack.merge.prepare import Prepared
from repack.store.prefixes import read_each

__all__ = ["IndexWritten", "Stopped", "write_index_file"]


class Stopped(Exception):
    """Raised in the index thread when the merge it works for has failed."""


@dataclass(frozen=True)
class IndexWritten:
    """An index file as written: the manifest's ``index`` member, and where each new source
    starts in it."""

    file: str
    size: int
    checksum: str
    sequence_count: int
    document_count: int
    #: [first sequence, first document] of each new source (those of ``prepared``).
    ranges: list[list[int]] = field(default_factory=list)

    def member(self) -> dict:
        """The ``index`` member of the manifest."""
        return {
            "file": self.file,
            "size": self.size,
            "checksum": self.checksum,
            "sequence_count": self.sequence_count,
            "document_count": self.document_count,
        }

    def manifest_fields(self) -> dict:
        """The :class:`~repack.format.manifest.Manifest` fields that name this index, for
        ``dataclasses.replace`` when ``add`` or ``remove`` writes a new one."""
        return {
            "index_file": self.file,
            "index_size": self.size,
            "index_checksum": self.checksum,
            "sequence_count": self.sequence_count,
            "document_count": self.document_count,
        }

    def to_json(self) -> dict:
        """As saved in ``.work/index.json``."""
        return {**self.member(), "ranges": self.ranges}

    @classmethod
    def from_json(cls, data: dict) -> IndexWritten:
        """Inverse of :meth:`to_json`."""
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


def write_index_file(
    path: str,
    name: str,
    algorithm: str,
    *,
    carried: tuple[object, Sequence[SourceEntry]] | None = None,
    prepared: Prepared | None = None,
    stop: threading.Event | None = None,
) -> IndexWritten:
    """Write the index ``name`` as the new file ``path`` (a store's staged file: see
    :meth:`~repack.store.Store.staged`), one source at a time: first the sources ``carried``
    over from an open :class:`~repack.read.reader.Repack` (its index arrays copied), then the new
    sources of ``prepared`` (read from their original ``.idx``); fsynced.

    Raises:
        SourceError: a new source's ``.idx`` or ``.bin`` changed since it was validated.
        Stopped: ``stop`` was set (checked between two new sources).
    """
    repack, old = carried if carried is not None else (None, ())
    new = prepared.sources if prepared is not None else ()
    n_seq = sum(s.sequence_count for s in old) + sum(s.sequence_count for s in new)
    n_doc = sum(s.document_count for s in old) + sum(s.document_count for s in new)
    layout = fmt.index_layout(n_seq, n_doc)
    ranges = []
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, layout.size)
        os.pwrite(fd, fmt.pack_index_header(n_seq, n_doc), 0)
        seq = doc = 0
        for source in old:
            _write_source_arrays(fd, layout, seq, doc, *repack.source_arrays(source))
            seq += source.sequence_count
            doc += source.document_count
        for info, index in zip(new, _reread_all(prepared, algorithm)):
            if stop is not None and stop.is_set():
                raise Stopped
            _write_source_arrays(
                fd, layout, seq, doc, index.lengths, index.pointers, index.documents, index.modes
            )
            ranges.append([seq, doc])
            seq += info.sequence_count
            doc += info.document_count
        os.fsync(fd)
        hasher = new_hasher(algorithm)
        hash_range(fd, 0, layout.size, [hasher])
    finally:
        os.close(fd)
    return IndexWritten(name, layout.size, digest_of(hasher, algorithm), n_seq, n_doc, ranges)


def _reread_all(prepared: Prepared | None, algorithm: str) -> Iterator[SourceIndex]:
    """The index of each new source, read again, in order (those on object storage fetched
    ahead: :func:`~repack.store.prefixes.read_each`)."""
    if prepared is None:
        return iter(())
    pairs = dict(zip((info.path for info in prepared.sources), prepared.sources))
    checksums = dict(zip(pairs, prepared.idx_checksums))

    def reread(path: str) -> SourceIndex:
        return _reread(pairs[path], checksums[path], algorithm)

    for found in read_each(reread, list(pairs)):
        if isinstance(found, SourceError):
            raise found
        yield found


def _reread(info: SourceInfo, checksum: str, algorithm: str) -> SourceIndex:
    hasher = new_hasher(algorithm)
    index = read_source_index(info.path, hasher=hasher, known=info)
    if digest_of(hasher, algorithm) != checksum:
        raise SourceError(f"{info.path}.idx: changed during the merge")
    return index


def _write_source_arrays(fd, layout, seq, doc, lengths, pointers, documents, modes) -> None:
    _pwrite_array(fd, lengths, layout.lengths + 4 * seq)
    _pwrite_array(fd, pointers, layout.pointers + 8 * seq)
    if modes is not None:
        _pwrite_array(fd, modes, layout.modes + seq)
    _pwrite_array(fd, documents, layout.documents + 8 * doc)


def _pwrite_array(fd: int, array: np.ndarray, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(array).view(np.uint8))
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
