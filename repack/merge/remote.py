"""The segments of one shard whose sources are on object storage, fetched ahead of the copy.

A shard of a blend of many small sources on S3 holds many segments; fetched one after the
other, each would wait a round trip (its ``.idx`` for the fingerprints, then its bytes).
:class:`RemoteSegments` queues every request of the shard's remote segments in order —
``.idx`` when fingerprints are computed, then the segment's bytes in ``PIECE`` ranges pinned
to the ETag seen at validation — and runs the next ones while the copy hashes and writes
the current one (:func:`repack.store.ahead.ordered`: a bounded number of requests and bytes
in flight, so memory does not grow with the shard).

The copy takes the shard's segments in order; for each remote one it takes its
:meth:`~RemoteSegments.documents` hasher (with fingerprints) then all its
:meth:`~RemoteSegments.pieces`, and the local segments in between are copied as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

from repack.plan import PlannedSegment
from repack.source_data import bin_jobs, is_remote
from repack.store.ahead import ordered

__all__ = ["RemoteSegments"]


class RemoteSegments:
    """The requests of the remote segments of ``segments`` (in order), run ahead.

    Args:
        prepared: The plan (its sources, validated).
        segments: The shard's segments, in the order the copy takes them.
        documents: ``documents(prepared, seg)`` makes the fingerprint hasher of a segment
            (it reads the source's ``.idx``), or None without fingerprints.
    """

    def __init__(
        self,
        prepared,
        segments: Sequence[PlannedSegment],
        documents: Callable | None = None,
    ) -> None:
        self.prepared = prepared
        remote = [s for s in segments if is_remote(prepared.sources[s.source].path)]
        self._remote = {(s.source, s.first_sequence) for s in remote}
        self._documents = documents
        self._results = ordered(self._jobs(remote)) if remote else iter(())

    def _jobs(self, remote: Sequence[PlannedSegment]):
        for seg in remote:
            if self._documents is not None:
                yield 0, functools.partial(self._documents, self.prepared, seg)
            info = self.prepared.sources[seg.source]
            yield from bin_jobs(info, seg.source_offset, seg.size)

    def __contains__(self, seg: PlannedSegment) -> bool:
        return (seg.source, seg.first_sequence) in self._remote

    def documents(self, seg: PlannedSegment):
        """The fingerprint hasher of the remote segment ``seg`` (the next one)."""
        return next(self._results)

    def pieces(self, seg: PlannedSegment) -> Iterator[bytes]:
        """The bytes of the remote segment ``seg`` (the next one), in order."""
        remaining = seg.size
        while remaining > 0:
            data = next(self._results)
            remaining -= len(data)
            yield data

    def close(self) -> None:
        """Stop fetching (the copy ended, or failed)."""
        close = getattr(self._results, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> RemoteSegments:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
