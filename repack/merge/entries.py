"""The manifest entries of newly written shards and sources, built from the plan, the shard
receipts and the index as written; shared by a merge's finalize step and ``repack add``."""

from __future__ import annotations

from collections.abc import Mapping

from repack import __version__
from repack.checksum import digest_of, new_hasher
from repack.fileio import CHUNK
from repack.format import spec as fmt
from repack.format.codec import BLOCK_SIZE, CompressedShard
from repack.format.manifest import SegmentEntry, ShardEntry, SourceEntry
from repack.merge.index import IndexWritten
from repack.merge.prepare import Prepared
from repack.merge.workdir import Receipt
from repack.store import Store

__all__ = ["manifest_body", "new_entries"]


def new_entries(
    store: Store,
    prepared: Prepared,
    receipts: Mapping[int, Receipt],
    index: IndexWritten,
    first_id: int = 0,
    first_position: int = 0,
) -> tuple[list[ShardEntry], list[SourceEntry]]:
    """Manifest entries of the shards and sources of ``prepared``: the sources numbered from
    ``first_id``, the shards placed from position ``first_position`` (their file numbers are
    the plan's). A source cut across shards is read back from ``store`` to checksum it
    whole."""
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
            bin_checksum = _spanning_checksum(store, prepared, receipts, i)
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


def _spanning_checksum(store: Store, prepared: Prepared, receipts, source: int) -> str:
    """Checksum of a source cut across shards: its segments, read back in order (through the
    frames of a compressed shard, whose stored size its receipt gives)."""
    hasher = new_hasher(prepared.algorithm)
    codec = prepared.codec_name
    sizes = {shard.number: shard.size for shard in prepared.plan.shards}
    for seg in prepared.plan.segments_by_source[source]:
        name = fmt.shard_name(seg.shard, codec)
        stored = receipts[seg.shard].stored_size if codec is not None else sizes[seg.shard]
        with store.open(name, stored) as handle:
            if codec is None:
                for view in handle.scan(seg.offset, seg.size):
                    hasher.update(view)
                continue
            compressed = CompressedShard(store.url(name), sizes[seg.shard], handle)
            try:
                for start in range(seg.offset, seg.offset + seg.size, CHUNK):
                    n = min(CHUNK, seg.offset + seg.size - start)
                    hasher.update(compressed.read(start, n))
            finally:
                compressed.close()
    return digest_of(hasher, prepared.algorithm)


def manifest_body(
    store: Store,
    prepared: Prepared,
    receipts: Mapping[int, Receipt],
    index: IndexWritten,
) -> dict:
    """The manifest of a merge of ``prepared`` into ``store``, as
    :func:`~repack.format.manifest.dump_manifest` takes it."""
    shards, sources = new_entries(store, prepared, receipts, index)
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
