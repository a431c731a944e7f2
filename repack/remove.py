"""``repack remove``: take sources out of a repack, their bytes out of every file.

Each shard holding a segment of a removed source is written anew, under a new file number,
with only the segments it keeps (laid out again, 4096-aligned); shards that keep nothing are
dropped; other shards are not touched. A new index ``index-N.rpx`` holds the remaining
sources' entries. Then the manifest is replaced atomically, and only then are the replaced
shards and the previous index unlinked: a reader sees the old repack or the new one, and a
process that opened the old one keeps reading it through the descriptors and mappings it
holds. docs/format.md section 2.7 is the specification. The loader's cache in ``OUT/cache``
loses the removed sources' index arrays too (:mod:`repack.loadercache`): once before the
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

from repack import format as fmt
from repack.blend import Blend, load_blend
from repack.checksum import digest_of, new_hasher
from repack.codec import BLOCK_SIZE
from repack.errors import ChecksumMismatch, InputError, UnknownSource
from repack.fileio import BUFFER, CHUNK, HashFeeder, atomic_write, copy_range, fsync_dir, io_buffer
from repack.loadercache import CachePruned, prune
from repack.lock import writer_lock
from repack.manifest import Manifest, SegmentEntry, ShardEntry, SourceEntry, load_manifest
from repack.merge.commit import commit_manifest, named_files, next_generation, next_shard_number
from repack.merge.fingerprints import carry, with_member
from repack.merge.index import write_index_file
from repack.merge.shards import compress_shard
from repack.merge.workdir import read_work_json, remove_leftovers, temp_name, work_path
from repack.progress import Progress, no_progress
from repack.reader import Repack
from repack.store import open_store

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

    def to_json(self) -> dict:
        """The result as plain JSON-able data (what ``remove --json`` prints)."""
        return {
            "out": self.out,
            **self.plan.describe(),
            "cache_datasets_dropped": self.cache.datasets,
            "seconds": round(self.seconds, 3),
        }


def remove(
    out: str | os.PathLike,
    sources: Iterable[str] = (),
    *,
    blend: str | os.PathLike | None = None,
    dry_run: bool = False,
    progress: Progress = no_progress,
) -> RemoveResult:
    """Remove ``sources`` (prefixes as the blend writes them, or absolute paths), and every
    source of the blend file ``blend``, from the repack ``out``.

    Raises:
        UnknownSource: a source named is not in the repack (nor removed by an interrupted run).
        InputError: nothing to remove is named, or every source of the repack would go.
        WriterBusy: another writer is at work in ``out``.
    """
    started = time.monotonic()
    store = open_store(out)
    names = _names(sources, blend)
    if not store.local:
        from repack.merge.objects_edit import remove_from_store

        plan = remove_from_store(store, names, dry_run=dry_run, progress=progress)
        return RemoveResult(store.location, plan, time.monotonic() - started)
    out = os.fspath(out)
    if dry_run:
        plan = plan_removal(Repack(out).manifest, names, out=out)
        return RemoveResult(out, plan, time.monotonic() - started)
    if not os.path.isdir(out):
        Repack(out)  # says why this is not a repack
    with writer_lock(out):
        repack = Repack(out)
        manifest = repack.manifest
        interrupted = _interrupted(out, manifest)
        remove_leftovers(out, named_files(manifest))
        plan = plan_removal(manifest, names, interrupted, out)
        cache = CachePruned()
        if plan.removed:
            try:
                cache = _execute(out, repack, plan, progress)
            except BaseException:
                if load_manifest(out).checksum == manifest.checksum:
                    remove_leftovers(out, named_files(manifest))  # as it was
                raise
        repack.close()
        # again with the manifest as it is now: what readers of the old repack cached during
        # the remove, or what an interrupted remove (now finished) left. After a remove that
        # cleaned the cache before its commit, best effort: the sources are out already.
        try:
            cache += prune(out, load_manifest(out).sources)
        except InputError as err:
            if not plan.removed:
                raise
            logger.warning("repack remove: %s", err)
    return RemoveResult(out, plan, time.monotonic() - started, cache)


def _names(sources: Iterable[str], blend: str | os.PathLike | None) -> list[str | tuple[str, str]]:
    names: list[str | tuple[str, str]] = list(sources)
    if blend is not None:
        for entries in load_blend(blend).splits.values():
            names += [(entry.path, entry.prefix) for entry in entries or ()]
    if not names:
        raise InputError("name the sources to remove: SOURCE... or --blend FILE")
    return names


def _interrupted(out: str, manifest: Manifest) -> set[str]:
    """The paths an interrupted remove had taken out, if it replaced the manifest before
    being killed (its work folder is still there); else nothing."""
    path = work_path(out, REMOVE_FILE)
    if not os.path.exists(path):
        return set()
    record = read_work_json(path)
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
    next_number = next_shard_number(manifest)
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


def _execute(out: str, repack: Repack, plan: RemovePlan, progress: Progress) -> CachePruned:
    manifest = plan.manifest
    record = {
        "format": REMOVE_FORMAT,
        "version": 1,
        "manifest": manifest.checksum,
        "removed": [
            [manifest.sources[i].path, *manifest.sources[i].prefixes] for i in plan.removed
        ],
    }
    os.makedirs(work_path(out))
    atomic_write(work_path(out, REMOVE_FILE), json.dumps(record, sort_keys=True).encode())
    advance = progress("remove", sum(s.kept_bytes for s in plan.shards))
    new_shards: dict[int, ShardEntry | None] = {}
    for shard in plan.shards:
        entry = manifest.shards[shard.position]
        new_shards[shard.position] = (
            _rewrite_shard(out, repack, entry, shard, advance) if shard.new_file else None
        )
    kept = [s for s in manifest.sources if s.id not in set(plan.removed)]
    index = write_index_file(
        out,
        fmt.index_name(next_generation(manifest)),
        manifest.algorithm,
        carried=(repack, kept),
    )
    member = carry(out, manifest, [source.id for source in kept])
    repack.close()
    # before the manifest: a kill from here on leaves none of the removed sources' indices
    cache = prune(out, kept)
    updated = with_member(_updated(manifest, plan, new_shards, kept, index), member)
    commit_manifest(out, manifest, updated)
    return cache


def _rewrite_shard(
    out: str,
    repack: Repack,
    entry: ShardEntry,
    shard: RewrittenShard,
    advance: Callable[[int], object],
) -> ShardEntry:
    """Write the new file of ``shard``: its kept segments, each checked against its recorded
    checksum, at their new offsets; compressed like ``entry`` if that one is."""
    algorithm = repack.manifest.algorithm
    final = os.path.join(out, fmt.shard_name(fmt.shard_number(shard.new_file)))
    tmp = temp_name(final)
    old_path = os.path.join(out, entry.file)
    largest = max(seg.size for _, seg, _ in shard.kept)
    buffer = io_buffer(min(BUFFER, max(largest, 1)))
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        shard_hasher = new_hasher(algorithm)
        with HashFeeder() as feeder:
            position = 0
            for source, seg, offset in shard.kept:
                if offset > position:
                    feeder.update((shard_hasher,), bytes(offset - position))
                seg_hasher = new_hasher(algorithm)
                hashers = (shard_hasher, seg_hasher)
                if entry.codec is None:
                    src = os.open(old_path, os.O_RDONLY)
                    try:
                        copy_range(
                            src, fd, seg.offset, offset, seg.size, hashers, advance, buffer, feeder
                        )
                    finally:
                        os.close(src)
                else:
                    feeder.wait()
                    _copy_decompressed(repack, entry.number, seg, fd, offset, hashers, advance)
                feeder.wait()
                found = digest_of(seg_hasher, algorithm)
                if found != seg.checksum:
                    raise ChecksumMismatch(
                        f"{old_path}: the segment of {repack.manifest.sources[source].name!r} at "
                        f"offset {seg.offset} has checksum {found}, the manifest records "
                        f"{seg.checksum}; nothing was changed: run 'repack verify'"
                    )
                position = offset + seg.size
            os.ftruncate(fd, shard.size)
            os.fsync(fd)
    finally:
        os.close(fd)
    checksum = digest_of(shard_hasher, algorithm)
    stored = {}
    if entry.codec is None:
        os.replace(tmp, final)
    else:
        level = entry.level if entry.level is not None else 3
        final = os.path.join(out, shard.new_file)
        size, stored_checksum = compress_shard(tmp, final, level, algorithm)
        stored = {
            "stored_size": size,
            "stored_checksum": stored_checksum,
            "level": level,
            "block_size": BLOCK_SIZE,
        }
    fsync_dir(out)
    return dataclasses.replace(
        entry, file=shard.new_file, size=shard.size, checksum=checksum, **stored
    )


def _copy_decompressed(repack, number, seg, fd, offset, hashers, advance) -> None:
    for start in range(0, seg.size, CHUNK):
        n = min(CHUNK, seg.size - start)
        data = repack.read_bytes(number, seg.offset + start, n)
        for hasher in hashers:
            hasher.update(data)
        view = memoryview(data)
        written = 0
        while written < n:
            written += os.pwrite(fd, view[written:], offset + start + written)
        advance(n)


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
