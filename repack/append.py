"""``repack add``: append the sources of another blend to an existing repack.

New sources go to new shards; existing shards are never rewritten. A new index file (the old
sources' entries carried over, then the new ones) is written under a new name, then the
manifest is replaced atomically, then the old index is removed: a reader sees either the old
repack or the new one, and a process that opened the old one keeps reading it.
"""

from __future__ import annotations

import json
import os
import shutil
import time

from repack import format as fmt
from repack.blend import load_blend
from repack.checksum import digest_of, new_hasher
from repack.errors import IncompatibleSources, InputError
from repack.fileio import atomic_write, fsync_dir
from repack.manifest import Manifest, dump_manifest
from repack.merge import (
    PLAN_FILE,
    WORK_DIR,
    MergeResult,
    Prepared,
    Progress,
    _check_not_inside_sources,
    _copy_shards,
    _index_member,
    _new_entries,
    _no_progress,
    _receipt_path,
    _spellings,
    _validate,
    _write_index,
)
from repack.plan import plan_repack
from repack.reader import Repack
from repack.sources import read_source_index

__all__ = ["add"]


def add(
    out: str | os.PathLike,
    blend_path: str | os.PathLike,
    *,
    workers: int = 1,
    progress: Progress = _no_progress,
) -> MergeResult:
    """Add the sources of ``blend_path`` that ``out`` does not hold yet.

    Raises:
        IncompatibleSources: a source of the blend is already in the repack with other content.
        InputError: every source of the blend is already in the repack.
    """
    started = time.monotonic()
    out = os.fspath(out)
    repack = Repack(out)
    manifest = repack.manifest
    _remove_leftovers(out, manifest)
    algorithm = manifest.algorithm
    blend = load_blend(blend_path)
    spellings = _spellings(blend)
    held = {source.path: source for source in manifest.sources}
    new_paths = []
    for path in spellings:
        source = held.get(path)
        if source is None:
            new_paths.append(path)
            continue
        hasher = new_hasher(algorithm)
        info = read_source_index(path, hasher=hasher).info
        if digest_of(hasher, algorithm) != source.idx_checksum or info.bin_size != source.bin_size:
            raise IncompatibleSources(
                f"{path}: already in {out} with other content (index checksum "
                f"{source.idx_checksum}, now {digest_of(hasher, algorithm)}); merge anew"
            )
    if not new_paths:
        raise InputError(f"{blend_path}: every source of this blend is already in {out}")
    infos, checksums = _validate(new_paths, algorithm, progress)
    _check_not_inside_sources(out, infos)
    plan = plan_repack(
        infos,
        manifest.raw["shard_size"],
        lambda i: read_source_index(new_paths[i]).lengths,
        first_shard=len(manifest.shards),
    )
    prepared = Prepared(
        blend,
        tuple(infos),
        tuple(tuple(spellings[p]) for p in new_paths),
        tuple(checksums),
        plan,
        algorithm,
        _codec_of(manifest),
    )
    work = os.path.join(out, WORK_DIR)
    os.makedirs(work)
    atomic_write(os.path.join(work, PLAN_FILE), json.dumps(prepared.to_json()).encode())
    _copy_shards(out, prepared, plan.shards, workers, progress("add", plan.total_bytes))
    generation = _generation(manifest.index_file) + 1
    index_entry = _write_index(prepared, out, previous=repack, name=fmt.index_name(generation))
    receipts = {}
    for shard in plan.shards:
        with open(_receipt_path(out, shard.number), "rb") as stream:
            receipts[shard.number] = json.loads(stream.read())
    shards, sources = _new_entries(out, prepared, receipts, index_entry, len(manifest.sources))
    body = {key: value for key, value in manifest.raw.items() if key != "checksum"}
    body["index"] = _index_member(index_entry)
    body["shards"] = list(body["shards"]) + shards
    body["sources"] = list(body["sources"]) + sources
    body["appended"] = [*body.get("appended", []), blend.to_json()]
    atomic_write(os.path.join(out, fmt.MANIFEST_FILE), dump_manifest(body, algorithm))
    old_index = os.path.join(out, manifest.index_file)
    repack.close()
    os.unlink(old_index)
    shutil.rmtree(work)
    fsync_dir(out)
    return MergeResult(
        out, len(plan.shards), len(infos), plan.total_bytes, time.monotonic() - started
    )


def _remove_leftovers(out: str, manifest: Manifest) -> None:
    """Remove what an interrupted ``add`` left in ``out``: its work folder, its temp files, and
    the shards and indexes that the manifest does not name (new ones never committed, or the
    previous index when the add was killed between the manifest's replacement and the index's
    removal). Nothing the manifest names is touched."""
    named = {manifest.index_file, *(shard.file for shard in manifest.shards)}
    removed = False
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name == WORK_DIR:
            shutil.rmtree(path)
            removed = True
            continue
        base, tmp, _ = name.partition(".tmp")
        if tmp:
            stale = base == fmt.MANIFEST_FILE or fmt.is_shard_name(base) or fmt.is_index_name(base)
        else:
            stale = (fmt.is_shard_name(name) or fmt.is_index_name(name)) and name not in named
        if stale and os.path.isfile(path) and not os.path.islink(path):
            os.unlink(path)
            removed = True
    if removed:
        fsync_dir(out)


def _generation(index_file: str) -> int:
    stem = index_file[: -len(".rpx")]
    return int(stem.split("-", 1)[1]) if "-" in stem else 0


def _codec_of(manifest) -> tuple[str, int] | None:
    """New shards are stored like the repack's last shard (raw, or compressed alike)."""
    last = manifest.shards[-1] if manifest.shards else None
    if last is None or last.codec is None:
        return None
    return last.codec, manifest.raw["shards"][-1].get("level", 3)
