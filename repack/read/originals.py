"""``repack verify --sources``: every source of a repack compared, byte for byte, with its
original prefix where it still exists (its ``.idx`` whole, its ``.bin`` segment by segment, a
compressed shard read through its frames).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from repack.errors import FormatError, RepackError, ShortRead, SourceMissing, raise_if_unreadable
from repack.format.manifest import SourceEntry
from repack.read.reader import Repack
from repack.store.prefixes import open_bin, read_each, read_index

__all__ = ["compare_originals"]


def compare_originals(repack: Repack, advance) -> Iterator[tuple[SourceEntry, str | None]]:
    """Compare every source with its original, where it exists, byte for byte: each source
    with ``None`` if its original is not there, else why the repack's copy is not the original
    (``""``: it is). The heads of the originals (``.idx`` and the ``.bin``'s size) are read in
    order, those on object storage fetched ahead (:func:`~repack.store.prefixes.read_each`).

    Raises:
        StoreError: The store of the originals cannot be read at all
            (:func:`~repack.errors.raise_if_unreadable`).
    """
    sources = repack.manifest.sources
    heads = read_each(_original_head, [source.path for source in sources])
    for source, head in zip(sources, heads):
        if isinstance(head, SourceMissing):
            advance(source.bin_size)
            yield source, None
        elif isinstance(head, (RepackError, OSError)):
            raise_if_unreadable(head)  # the store of the originals cannot be read
            advance(source.bin_size)
            yield source, f"cannot read the original: {_reason(head)}"
        else:
            yield source, _compare_source(repack, source, *head, advance)


def _original_head(path: str):
    """The original ``.idx`` bytes and ``.bin`` size of the source prefix ``path``, or the
    error that says why they cannot be read (SourceMissing: it is not there)."""
    try:
        return read_index(path)
    except (RepackError, OSError) as err:
        return err


def _reason(err: Exception) -> str:
    return err.strerror if isinstance(err, OSError) and err.strerror else str(err)


def _compare_source(
    repack: Repack, source: SourceEntry, original_idx: bytes, found, advance
) -> str:
    """Why the repack's copy of ``source`` is not its original (``original_idx``: the
    original ``.idx`` bytes; ``found``: the size of its ``.bin``), or ``""``."""
    stored_idx = b"".join(bytes(chunk) for chunk in repack.source_idx_chunks(source))
    if original_idx != stored_idx:
        advance(source.bin_size)
        at = _first_difference(original_idx, stored_idx)
        return f"original .idx differs from the repack at byte {at}"
    if found.size != source.bin_size:
        advance(source.bin_size)
        return f"original .bin has {found.size} bytes, the repack {source.bin_size}"
    done = 0
    try:
        with open_bin(source, "since it was merged") as theirs:
            for seg in source.segments:
                # offsets are logical: a compressed shard is read through its frames, one
                # on object storage in ranged reads (read ahead), the original alike
                with repack.shard_handle(seg.shard) as ours:
                    at = _first_difference_of(
                        iter(ours.scan(seg.offset, seg.size)),
                        _advancing(theirs.scan(seg.source_offset, seg.size), advance),
                    )
                done += seg.size
                if at is not None:
                    advance(source.bin_size - done)
                    return f"original .bin differs from the repack at byte {seg.source_offset + at}"
    except (ShortRead, FormatError) as err:
        # a shard (or the original) shorter than the manifest says, a frame that does not
        # decompress: damage, which the shard checks above name too
        advance(source.bin_size - done)
        return f"cannot compare: {err}"
    except (RepackError, OSError) as err:
        raise_if_unreadable(err)
        advance(source.bin_size - done)
        return f"cannot read the original: {_reason(err)}"
    return ""


def _advancing(pieces, advance):
    """``pieces``, each reported to ``advance`` as it is taken."""
    for piece in pieces:
        advance(len(piece))
        yield piece


def _first_difference_of(ours, theirs) -> int | None:
    """Where two streams of pieces of the same bytes first differ (or one ends before the
    other), or None if they hold the same bytes."""
    a = b = memoryview(b"")
    done = 0
    while True:
        if not a:
            a = memoryview(next(ours, b"")).cast("B")
        if not b:
            b = memoryview(next(theirs, b"")).cast("B")
        if not a or not b:
            return None if not a and not b else done
        n = min(len(a), len(b))
        if not np.array_equal(np.frombuffer(a[:n], np.uint8), np.frombuffer(b[:n], np.uint8)):
            return done + _first_difference(a[:n], b[:n])
        a, b, done = a[n:], b[n:], done + n


def _first_difference(a: bytes | memoryview, b: bytes | memoryview) -> int:
    """Offset of the first differing byte (or the shorter length)."""
    n = min(len(a), len(b))
    left = np.frombuffer(a, np.uint8, n)
    right = np.frombuffer(b, np.uint8, n)
    diff = np.flatnonzero(left != right)
    return int(diff[0]) if diff.size else n
