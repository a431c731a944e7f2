"""Plan a repack: which bytes of which source go where. Pure: no I/O.

Sources are grouped by token dtype (a shard holds one dtype, so token values are never
converted) in order of first appearance, then packed in blend order into shards of at most
``shard_size`` bytes. A source that does not fit into the current shard starts a new one; a
source larger than a whole shard is cut at sequence boundaries, so a sequence is never split.
A single sequence larger than ``shard_size`` gets a shard of its own, which then exceeds the
limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from repack.format import spec as fmt
from repack.inputs.sources import SourceInfo

__all__ = ["Plan", "PlannedSegment", "PlannedShard", "plan_repack"]


@dataclass(frozen=True)
class PlannedSegment:
    """A run of consecutive sequences of one source, stored contiguously in one shard."""

    source: int
    shard: int
    first_sequence: int
    sequence_count: int
    offset: int
    size: int
    source_offset: int


@dataclass
class PlannedShard:
    """One shard file: its dtype and the segments it holds, in file order."""

    number: int
    dtype_code: int
    segments: list[PlannedSegment] = field(default_factory=list)

    @property
    def size(self) -> int:
        """File size: the end of the last segment."""
        last = self.segments[-1] if self.segments else None
        return last.offset + last.size if last else 0

    @property
    def name(self) -> str:
        """File name of the shard."""
        return fmt.shard_name(self.number)


@dataclass(frozen=True)
class Plan:
    """Shards in file-number order; each source's segments in sequence order."""

    shard_size: int
    shards: tuple[PlannedShard, ...]
    segments_by_source: tuple[tuple[PlannedSegment, ...], ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of source data to copy."""
        return sum(seg.size for segs in self.segments_by_source for seg in segs)


def plan_repack(
    sources: Sequence[SourceInfo],
    shard_size: int,
    lengths_of: Callable[[int], np.ndarray],
    *,
    first_shard: int = 0,
) -> Plan:
    """Assign every byte of every source to a shard.

    Args:
        sources: Validated sources, in blend order.
        shard_size: Largest shard size in bytes (exceeded only by a lone huge sequence).
        lengths_of: Returns the sequence lengths of source ``i``; called only for sources
            that must be cut because they are larger than ``shard_size``.
        first_shard: Number of the first shard (``repack add`` continues the numbering).

    Returns:
        The plan.
    """
    if shard_size < fmt.ALIGNMENT:
        raise ValueError(f"shard size {shard_size} is smaller than {fmt.ALIGNMENT} bytes")
    groups: dict[int, list[int]] = {}
    for i, source in enumerate(sources):
        groups.setdefault(source.dtype_code, []).append(i)

    shards: list[PlannedShard] = []
    by_source: list[list[PlannedSegment]] = [[] for _ in sources]
    for code, members in groups.items():
        shard = PlannedShard(first_shard + len(shards), code)
        shards.append(shard)
        for i in members:
            source = sources[i]
            start = fmt.align_up(shard.size, fmt.ALIGNMENT)
            if shard.segments and start + source.bin_size > shard_size:
                shard = PlannedShard(first_shard + len(shards), code)
                shards.append(shard)
                start = 0
            if start + source.bin_size <= shard_size:
                pieces = [(0, source.sequence_count, 0, source.bin_size)]
            else:
                pieces = _cut(lengths_of(i), source.dtype.itemsize, shard_size)
            for n, (first, count, src_offset, size) in enumerate(pieces):
                if n:
                    shard = PlannedShard(first_shard + len(shards), code)
                    shards.append(shard)
                offset = fmt.align_up(shard.size, fmt.ALIGNMENT)
                segment = PlannedSegment(i, shard.number, first, count, offset, size, src_offset)
                shard.segments.append(segment)
                by_source[i].append(segment)
    return Plan(shard_size, tuple(shards), tuple(tuple(segs) for segs in by_source))


def _cut(lengths: np.ndarray, itemsize: int, shard_size: int) -> list[tuple[int, int, int, int]]:
    """Cut a source into pieces of at most ``shard_size`` bytes at sequence boundaries.

    Returns (first sequence, sequence count, byte offset, byte size) per piece.
    """
    ends = np.cumsum(lengths, dtype=np.int64) * itemsize
    pieces = []
    first, offset = 0, 0
    n = len(lengths)
    while first < n:
        # last sequence whose end still fits, but at least one sequence per piece
        stop = int(np.searchsorted(ends, offset + shard_size, side="right"))
        stop = max(stop, first + 1)
        end = int(ends[stop - 1])
        pieces.append((first, stop - first, offset, end - offset))
        first, offset = stop, end
    return pieces
