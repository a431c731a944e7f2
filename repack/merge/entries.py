"""The manifest entries of newly written shards and sources, built from the plan, the shard
receipts and the index as written; shared by a merge's finalize step and ``repack add``."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from repack import __version__
from repack import format as fmt
from repack.checksum import digest_of, new_hasher
from repack.codec import BLOCK_SIZE, CompressedShard
from repack.fileio import CHUNK, hash_range
from repack.manifest import SegmentEntry, ShardEntry, SourceEntry
from repack.merge.index import IndexWritten
from repack.merge.prepare import Prepared
from repack.merge.workdir import Receipt

__all__ = ["manifest_body", "new_entries"]


def new_entries(
    out: str,
    prepared: Prepared,
    receipts: Mapping[int, Receipt],
    index: IndexWritten,
    first_id: int = 0,
    first_position: int = 0,
    spanning: Callable[[Prepared, int], str] | None = None,
) -> tuple[list[ShardEntry], list[SourceEntry]]:
    """Manifest entries of the shards and sources of ``prepared``: the sources numbered from
    ``first_id``, the shards placed from position ``first_position`` (their file numbers are
    the plan's). A source cut across shards is read back to checksum it whole: from the
    folder ``out``, or by ``spanning(prepared, source)`` (a merge to object storage)."""
    plan = prepared.plan
    codec, level = prepared.codec if prepared.codec else (None, None)
    position = {shard.number: first_position + k for k, shard in enumerate(plan.shards)}
    shards = []
    for shard in plan.shards:
        receipt = receipts[shard.number]
        shards.append(
            ShardEntry(
                position[shard.number],
                fmt.shard_name(shard.number, codec),
                shard.dtype_code,
                shard.size,
                receipt.checksum,
                codec,
                receipt.stored_size if codec else None,
                receipt.stored_checksum if codec else None,
                level,
                BLOCK_SIZE if codec else None,
            )
        )
    sources = []
    for i, info in enumerate(prepared.sources):
        segments = tuple(
            SegmentEntry(
                position[seg.shard],
                seg.first_sequence,
                seg.sequence_count,
                seg.offset,
                seg.size,
                seg.source_offset,
                receipts[seg.shard].segment(i, seg.first_sequence),
            )
            for seg in plan.segments_by_source[i]
        )
        if len(segments) == 1:
            bin_checksum = segments[0].checksum
        else:
            bin_checksum = (spanning or _local_spanning(out))(prepared, i)
        seq, doc = index.ranges[i]
        sources.append(
            SourceEntry(
                id=first_id + i,
                path=info.path,
                prefixes=tuple(prepared.prefixes[i]),
                dtype_code=info.dtype_code,
                multimodal=info.multimodal,
                sequence_start=seq,
                sequence_count=info.sequence_count,
                document_start=doc,
                document_count=info.document_count,
                token_count=info.token_count,
                bin_size=info.bin_size,
                idx_size=info.idx_size,
                bin_checksum=bin_checksum,
                idx_checksum=prepared.idx_checksums[i],
                segments=segments,
            )
        )
    return shards, sources


def _local_spanning(out: str) -> Callable[[Prepared, int], str]:
    return lambda prepared, source: _spanning_checksum(out, prepared, source)


def _spanning_checksum(out: str, prepared: Prepared, source: int) -> str:
    """Checksum of a source cut across shards: its segments, read back in order."""
    hasher = new_hasher(prepared.algorithm)
    codec = prepared.codec_name
    for seg in prepared.plan.segments_by_source[source]:
        path = os.path.join(out, fmt.shard_name(seg.shard, codec))
        if codec is not None:
            shard = next(s for s in prepared.plan.shards if s.number == seg.shard)
            compressed = CompressedShard(path, shard.size)
            try:
                for start in range(seg.offset, seg.offset + seg.size, CHUNK):
                    n = min(CHUNK, seg.offset + seg.size - start)
                    hasher.update(compressed.read(start, n))
            finally:
                compressed.close()
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            hash_range(fd, seg.offset, seg.size, [hasher])
        finally:
            os.close(fd)
    return digest_of(hasher, prepared.algorithm)


def manifest_body(
    out: str,
    prepared: Prepared,
    receipts: Mapping[int, Receipt],
    index: IndexWritten,
    spanning: Callable[[Prepared, int], str] | None = None,
) -> dict:
    """The manifest of a merge of ``prepared``, as :func:`~repack.manifest.dump_manifest`
    takes it (``spanning``: see :func:`new_entries`)."""
    shards, sources = new_entries(out, prepared, receipts, index, spanning=spanning)
    return {
        "format": fmt.FORMAT_NAME,
        "version": fmt.FORMAT_VERSION,
        "created_by": f"repack {__version__}",
        "checksum_algorithm": prepared.algorithm,
        "alignment": fmt.ALIGNMENT,
        "shard_size": prepared.plan.shard_size,
        "index": index.member(),
        "shards": [shard.to_json() for shard in shards],
        "sources": [source.to_json() for source in sources],
        "blend": prepared.blend.to_json(),
    }
