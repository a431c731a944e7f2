"""``repack remove``: take sources out of a repack, their bytes out of every file.

Each shard holding a segment of a removed source is written anew, under a new file number,
with only the segments it keeps (laid out again, 4096-aligned); shards that keep nothing are
dropped; other shards are not touched. A new index ``index-N.rpx`` holds the remaining
sources' entries. Then the manifest is replaced atomically, and only then are the replaced
shards and the previous index unlinked (in a folder) or recorded as superseded, to be deleted
after a grace period or with ``now`` at once (on object storage, :mod:`repack.store.generations`):
a reader sees the old repack or the new one, and a process that opened the old one keeps
reading it. docs/format.md section 2.7 is the specification. The loader's cache in ``OUT/cache``
loses the removed sources' index arrays too (:mod:`repack.cache.loadercache`): once before the
manifest is replaced (so that a kill leaves nothing of them there either), and once after (for
what a process reading the old repack cached meanwhile).

A remove killed at any point leaves a complete repack, old or new. Run again, it removes
what the interrupted run left and starts over, or, if the manifest had been replaced, finishes
the clean-up and reports the sources as removed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from repack.cache.loadercache import CachePruned, prune
from repack.checksum import digest_of, new_hasher
from repack.errors import ChecksumMismatch, InputError, ObjectMissing, UnknownSource
from repack.fileio import BUFFER, CHUNK, HashFeeder, io_buffer
from repack.format import spec as fmt
from repack.format.blend import Blend
from repack.format.codec import BLOCK_SIZE
from repack.format.manifest import Manifest, SegmentEntry, ShardEntry, SourceEntry, parse_manifest
from repack.inputs.blend_files import load_blend
from repack.merge.commit import named_files, next_generation, next_shard_number
from repack.merge.edit import Collected, Edit, collect, edit, kept
from repack.merge.fingerprint_file import carry, with_member
from repack.merge.index import write_index_file
from repack.merge.workdir import read_work_json, remove_leftovers, work_key
from repack.progress import Progress, no_progress
from repack.read.reader import Repack
from repack.store import Store, open_store
from repack.store.generations import generations

__all__ = ["RemovePlan", "RemoveResult", "RewrittenShard", "plan_removal", "remove"]

logger = logging.getLogger(__name__)

REMOVE_FILE = "remove.json"
REMOVE_FORMAT = "repack-remove"


@dataclass(frozen=True)
class RewrittenShard:
    """A shard that held a removed source: what it keeps, and the file it becomes."""

    #: Position of the shard in the manifest now.
    position: int
    #: Its file now.
    file: str
    #: Its new file, or None when it keeps nothing and is dropped.
    new_file: str | None
    #: (source id, segment) kept, with the offset each gets in the new file.
    kept: tuple[tuple[int, SegmentEntry, int], ...]
    #: Bytes of removed sources it holds.
    removed_bytes: int

    @property
    def size(self) -> int:
        """Size of the new file (logical, uncompressed)."""
        return max((offset + seg.size for _, seg, offset in self.kept), default=0)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the remaining sources copied into the new file."""
        return sum(seg.size for _, seg, _ in self.kept)


@dataclass(frozen=True)
class RemovePlan:
    """What a remove will do; :func:`plan_removal` makes it, without writing anything."""

    manifest: Manifest
    #: Ids of the sources removed.
    removed: tuple[int, ...]
    #: Names the user gave for sources an interrupted remove had already taken out.
    already_removed: tuple[str, ...]
    shards: tuple[RewrittenShard, ...]

    @property
    def removed_bytes(self) -> int:
        """Bytes of the removed sources' original ``.bin`` files."""
        return sum(self.manifest.sources[i].bin_size for i in self.removed)

    def describe(self) -> dict:
        """The plan as plain JSON-able data (what ``remove --dry-run`` prints)."""
        sources = self.manifest.sources
        return {
            "removed": [sources[i].name for i in self.removed],
            "already_removed": list(self.already_removed),
            "removed_bytes": self.removed_bytes,
            "remaining_sources": len(sources) - len(self.removed),
            "rewritten": [
                {
                    "file": s.file,
                    "new_file": s.new_file,
                    "kept_bytes": s.kept_bytes,
                    "removed_bytes": s.removed_bytes,
                }
                for s in self.shards
            ],
            "bytes_to_write": sum(s.kept_bytes for s in self.shards),
            "untouched_shards": len(self.manifest.shards) - len(self.shards),
        }


@dataclass(frozen=True)
class RemoveResult:
    """What a remove did."""

    out: str
    plan: RemovePlan
    seconds: float
    #: What left the loader's cache in ``OUT/cache``.
    cache: CachePruned = dataclasses.field(default_factory=CachePruned)
    #: What became of the replaced files (kept for readers, or deleted: object storage).
    superseded: Collected = dataclasses.field(default_factory=Collected)

    def to_json(self) -> dict:
        """The result as plain JSON-able data (what ``remove --json`` prints)."""
        return {
            "out": self.out,
            **self.plan.describe(),
            "cache_datasets_dropped": self.cache.datasets,
            "superseded": self.superseded.to_json(),
            "seconds": round(self.seconds, 3),
        }


def remove(
    out: str | os.PathLike,
    sources: Iterable[str] = (),
    *,
    blend: str | os.PathLike | None = None,
    dry_run: bool = False,
    keep_superseded: float | None = None,
    now: bool = False,
    progress: Progress = no_progress,
) -> RemoveResult:
    """Remove ``sources`` (prefixes as the blend writes them, or absolute paths), and every
    source of the blend file ``blend``, from the repack ``out``. On object storage the
    replaced shards are kept ``keep_superseded`` seconds for the readers of the old repack;
    ``now`` deletes them, and every generation kept before, at once (a take-down).

    Raises:
        UnknownSource: a source named is not in the repack (nor removed by an interrupted run).
        InputError: nothing to remove is named, or every source of the repack would go.
        WriterBusy: another writer is at work in ``out``.
    """
    started = time.monotonic()
    names = _names(sources, blend)
    if dry_run:
        store = open_store(out)
        recorded = [name for g in generations(store)[0] for name in g.objects]  # (Edit.taken)
        plan = plan_removal(Repack(out).manifest, names, out=os.fspath(out), taken=recorded)
        return RemoveResult(store.location, plan, time.monotonic() - started)
    with edit(out, backend="pread", keep=keep_superseded, now=now) as change:
        store, manifest = change.store, change.manifest
        location = store.location
        interrupted = _interrupted(store, manifest)
        change.clean()
        plan = plan_removal(manifest, names, interrupted, location, change.taken)
        cache = CachePruned()
        if plan.removed:
            try:
                cache = _execute(change, plan, progress)
            except BaseException:
                if _current(store).checksum == manifest.checksum:
                    remove_leftovers(store, named_files(manifest) | kept(store))  # as it was
                raise
        elif now:  # a take-down run again: the bytes must be gone now
            change.collected = collect(store, manifest, 0.0, "remove --now")
        # again with the manifest as it is now: what readers of the old repack cached during
        # the remove, or what an interrupted remove (now finished) left. After a remove that
        # cleaned the cache before its commit, best effort: the sources are out already.
        try:
            cache += prune(location, _current(store).sources)
        except InputError as err:
            if not plan.removed:
                raise
            logger.warning("repack remove: %s", err)
    return RemoveResult(
        location, plan, time.monotonic() - started, cache, change.collected or Collected()
    )


def _current(store: Store) -> Manifest:
    """The manifest of the repack in ``store`` as it is now."""
    data, _ = store.get(fmt.MANIFEST_FILE, fmt.MAX_MANIFEST_SIZE)
    return parse_manifest(data, store.url(fmt.MANIFEST_FILE))


def _names(sources: Iterable[str], blend: str | os.PathLike | None) -> list[str | tuple[str, str]]:
    names: list[str | tuple[str, str]] = list(sources)
    if blend is not None:
        for entries in load_blend(blend).splits.values():
            names += [(entry.path, entry.prefix) for entry in entries or ()]
    if not names:
        raise InputError("name the sources to remove: SOURCE... or --blend FILE")
    return names


def _interrupted(store: Store, manifest: Manifest) -> set[str]:
    """The paths an interrupted remove had taken out, if it replaced the manifest before
    being killed (its work folder is still there); else nothing."""
    try:
        record = read_work_json(store, work_key(REMOVE_FILE))
    except ObjectMissing:
        return set()
    if not isinstance(record, dict) or record.get("format") != REMOVE_FORMAT:
        return set()
    if record.get("manifest") == manifest.checksum:
        return set()  # killed before the manifest was replaced: it starts over
    return {name for names in record.get("removed", ()) for name in names}


def plan_removal(
    manifest: Manifest,
    names: Sequence[str | tuple[str, ...]],
    already: Iterable[str] = (),
    out: str = "OUT",
    taken: Iterable[str] = (),
) -> RemovePlan:
    """Which sources go and what becomes of each shard. Pure: reads and writes nothing.

    Args:
        manifest: The repack's manifest.
        names: The sources to remove, as the blend writes them or by absolute path; a tuple
            gives several spellings of one source, tried in order (a blend entry's absolute
            path, then its prefix as written).
        already: Paths an interrupted remove took out already (named without error).
        out: The folder, for messages.

    Raises:
        UnknownSource: a name is neither a source nor in ``already``.
        InputError: every source would go.
    """
    already = set(already)
    removed: dict[int, None] = {}
    gone, unknown = [], []
    for spellings in names:
        spellings = (spellings,) if isinstance(spellings, str) else tuple(spellings)
        found = [manifest.find_source(name) for name in spellings]
        source = next((s for s in found if s is not None), None)
        name = spellings[-1]
        if source is not None:
            removed.setdefault(source.id, None)
        elif any(n in already or os.path.normpath(n) in already for n in spellings):
            gone.append(name)
        else:
            unknown.append(name)
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise UnknownSource(
            f"{out}: {', '.join(map(repr, unknown[:3]))}{more}: not a source of this repack "
            f"(already removed, or never in it); 'repack inspect {out}' lists its sources"
        )
    if len(removed) == len(manifest.sources):
        raise InputError(
            f"{out}: that is every source of the repack ({len(removed)}); a repack holds at "
            "least one: delete the folder instead"
        )
    ids = tuple(sorted(removed))
    next_number = next_shard_number(manifest, taken)
    by_shard: dict[int, list[tuple[int, SegmentEntry]]] = {}
    for source in manifest.sources:
        for seg in source.segments:
            by_shard.setdefault(seg.shard, []).append((source.id, seg))
    rewritten = []
    for shard in manifest.shards:
        held = sorted(by_shard.get(shard.number, ()), key=lambda item: item[1].offset)
        if not any(source in removed for source, _ in held):
            continue
        kept, end = [], 0
        for source, seg in held:
            if source not in removed:
                offset = fmt.align_up(end, fmt.ALIGNMENT)
                kept.append((source, seg, offset))
                end = offset + seg.size
        new_file = None
        if kept:
            new_file = fmt.shard_name(next_number, shard.codec)
            next_number += 1
        removed_bytes = sum(seg.size for source, seg in held if source in removed)
        rewritten.append(
            RewrittenShard(shard.number, shard.file, new_file, tuple(kept), removed_bytes)
        )
    return RemovePlan(manifest, ids, tuple(gone), tuple(rewritten))


# --- doing it ---------------------------------------------------------------------------------


def _execute(change: Edit, plan: RemovePlan, progress: Progress) -> CachePruned:
    store, repack, manifest = change.store, change.repack, change.manifest
    record = {
        "format": REMOVE_FORMAT,
        "version": 1,
        "manifest": manifest.checksum,
        "removed": [
            [manifest.sources[i].path, *manifest.sources[i].prefixes] for i in plan.removed
        ],
    }
    store.put(work_key(REMOVE_FILE), json.dumps(record, sort_keys=True).encode())
    advance = progress("remove", sum(s.kept_bytes for s in plan.shards))
    new_shards: dict[int, ShardEntry | None] = {}
    for shard in plan.shards:
        entry = manifest.shards[shard.position]
        new_shards[shard.position] = (
            _rewrite_shard(store, repack, entry, shard, advance) if shard.new_file else None
        )
    kept = [s for s in manifest.sources if s.id not in set(plan.removed)]
    name = fmt.index_name(next_generation(manifest, change.taken))
    with store.staged(name) as path:
        index = write_index_file(path, name, manifest.algorithm, carried=(repack, kept))
    member = carry(store, manifest, [source.id for source in kept], taken=change.taken)
    # before the manifest: a kill from here on leaves none of the removed sources' indices
    cache = prune(store.location, kept)
    updated = with_member(_updated(manifest, plan, new_shards, kept, index), member)
    change.commit(
        updated, "during this remove; this remove did not commit (run it again)", "remove"
    )
    return cache


def _rewrite_shard(
    store: Store,
    repack: Repack,
    entry: ShardEntry,
    shard: RewrittenShard,
    advance: Callable[[int], object],
) -> ShardEntry:
    """Write the new file of ``shard``: its kept segments, each checked against its recorded
    checksum as it passes, at their new offsets; compressed like ``entry`` if that one is."""
    algorithm = repack.manifest.algorithm
    level = entry.level if entry.level is not None else 3
    if entry.codec is None:
        writer = store.writer(shard.new_file, size_hint=shard.size)
    else:
        writer = store.compressing_writer(
            shard.new_file, size_hint=shard.size, level=level, algorithm=algorithm
        )
    largest = max(seg.size for _, seg, _ in shard.kept)
    buffer = io_buffer(min(BUFFER, max(largest, 1)))
    shard_hasher = new_hasher(algorithm)
    # a raw shard is copied as it is stored (copy_file_range into a local folder); a
    # compressed one is read through the repack, which decompresses it
    old = store.open(entry.file, entry.size) if entry.codec is None else None
    try:
        with writer, HashFeeder() as feeder:
            position = 0
            for source, seg, offset in shard.kept:
                if offset > position:
                    feeder.update((shard_hasher,), bytes(offset - position))
                    writer.pad(offset - position)
                seg_hasher = new_hasher(algorithm)
                hashers = (shard_hasher, seg_hasher)
                if old is not None:
                    writer.copy_from(old, seg.offset, seg.size, hashers, advance, feeder, buffer)
                else:
                    feeder.wait()
                    for start in range(0, seg.size, CHUNK):
                        data = repack.read_bytes(
                            entry.number, seg.offset + start, min(CHUNK, seg.size - start)
                        )
                        for hasher in hashers:
                            hasher.update(data)
                        writer.write(data)
                        advance(len(data))
                feeder.wait()
                found = digest_of(seg_hasher, algorithm)
                if found != seg.checksum:
                    raise ChecksumMismatch(
                        f"{store.url(entry.file)}: the segment of "
                        f"{repack.manifest.sources[source].name!r} at offset {seg.offset} has "
                        f"checksum {found}, the manifest records {seg.checksum}; nothing was "
                        "changed: run 'repack verify'",
                        location=store.url(entry.file),
                    )
                position = offset + seg.size
            if shard.size > position:
                feeder.update((shard_hasher,), bytes(shard.size - position))
                writer.pad(shard.size - position)
            feeder.wait()
            writer.commit()
    finally:
        if old is not None:
            old.close()
    stored = {}
    if entry.codec is not None:
        stored = {
            "stored_size": writer.stored_size,
            "stored_checksum": writer.stored_checksum,
            "level": level,
            "block_size": BLOCK_SIZE,
        }
    return dataclasses.replace(
        entry,
        file=shard.new_file,
        size=shard.size,
        checksum=digest_of(shard_hasher, algorithm),
        **stored,
    )


def _updated(
    manifest: Manifest,
    plan: RemovePlan,
    new_shards: dict[int, ShardEntry | None],
    kept: Sequence[SourceEntry],
    index,
) -> Manifest:
    """The manifest after the remove (docs/format.md 2.7)."""
    shards, position = [], {}
    for entry in manifest.shards:
        replaced = new_shards.get(entry.number, entry)
        if replaced is None:
            continue  # emptied: dropped
        position[entry.number] = len(shards)
        shards.append(dataclasses.replace(replaced, number=len(shards)))
    offsets = {
        (source, seg.first): offset for shard in plan.shards for source, seg, offset in shard.kept
    }
    sources, seq, doc = [], 0, 0
    for source in kept:
        segments = tuple(
            dataclasses.replace(
                seg,
                shard=position[seg.shard],
                offset=offsets.get((source.id, seg.first), seg.offset),
            )
            for seg in source.segments
        )
        sources.append(
            dataclasses.replace(
                source,
                id=len(sources),
                sequence_start=seq,
                document_start=doc,
                segments=segments,
            )
        )
        seq += source.sequence_count
        doc += source.document_count
    gone = {manifest.sources[i].path for i in plan.removed}
    appended = tuple(b for b in (_without(b, gone) for b in manifest.appended) if _names_any(b))
    return dataclasses.replace(
        manifest,
        **index.manifest_fields(),
        shards=tuple(shards),
        sources=tuple(sources),
        blend=_without(manifest.blend, gone),
        appended=appended,
    )


def _without(blend: Blend, paths: set[str]) -> Blend:
    """``blend`` without its entries of ``paths``; a split left empty becomes None."""
    splits = {}
    for name, entries in blend.splits.items():
        left = tuple(e for e in entries or () if e.path not in paths)
        splits[name] = left or None
    return dataclasses.replace(blend, splits=splits)


def _names_any(blend: Blend) -> bool:
    return any(entries for entries in blend.splits.values())
