"""What ``repack inspect`` shows: per-source facts and totals, as plain data."""

from __future__ import annotations

from repack.format.manifest import Manifest
from repack.format.spec import dtype_from_code

__all__ = ["summarize", "superseded_summary"]


def summarize(manifest: Manifest) -> dict:
    """Sources with their splits, weights, counts and shards, plus totals. JSON-able."""
    usage: dict[str, list[dict]] = {}
    by_path = {source.path: source for source in manifest.sources}
    for blend in manifest.blends:
        for split, entries in blend.splits.items():
            for entry in entries or ():
                uses = usage.setdefault(entry.path, [])
                use = {"split": split, "weight": entry.weight}
                # a blend added later names again the sources it shares with the first:
                # the same split and weight once, another weight as well
                if use not in uses:
                    uses.append(use)
    sources = [
        {
            "id": source.id,
            "prefix": source.name,
            "path": source.path,
            "splits": usage.get(source.path, []),
            "dtype": source.dtype.name,
            "multimodal": source.multimodal,
            "tokens": source.token_count,
            "sequences": source.sequence_count,
            "documents": source.document_count - 1,
            "bytes": source.bin_size,
            "shards": sorted({seg.shard for seg in source.segments}),
        }
        for source in by_path.values()
    ]
    return {
        "format": "repack",
        "created_by": manifest.created_by,
        "checksum_algorithm": manifest.algorithm,
        "blend": {"source": manifest.blend.source, "form": manifest.blend.form},
        "appended": [{"source": b.source, "form": b.form} for b in manifest.appended],
        "shards": [
            {"file": s.file, "dtype": dtype_from_code(s.dtype_code).name, "size": s.size}
            for s in manifest.shards
        ],
        "sources": sources,
        "totals": {
            "sources": len(sources),
            "shards": len(manifest.shards),
            "tokens": sum(s["tokens"] for s in sources),
            "sequences": manifest.sequence_count,
            "documents": sum(s["documents"] for s in sources),
            "bytes": sum(s.size for s in manifest.shards),
        },
    }


def superseded_summary(out) -> list[dict]:
    """The superseded generations of the repack ``out``: what earlier edits replaced, kept
    for the readers of older versions, and the tombstones of those deleted (object storage,
    a folder other machines mount, or one edited with ``--keep-superseded``; none where the
    edits deleted at once). JSON-able, oldest first."""
    from repack.store import open_store
    from repack.store.generations import generations, utc

    store = open_store(out)
    return [
        {
            "edit": g.edit,
            "at": g.at,
            "at_utc": utc(g.at),
            "objects": sorted(g.objects),
            "bytes": g.size,
            "deleted_at": g.deleted_at,
            "deleted_by": g.deleted_by,
        }
        for g in generations(store)[0]
    ]
