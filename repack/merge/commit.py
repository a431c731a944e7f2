"""Replacing the manifest of a complete repack: the last step of ``repack add`` and
``repack remove``.

Both write their new files under names the current manifest does not use (new shards, a new
index ``index-N.rpx``), then :func:`commit_manifest` replaces the manifest atomically — the
instant the repack changes — and only then removes the files the new manifest no longer
names. A reader sees the old repack or the new one; a process that opened the old one keeps
its descriptors and mappings of the old files, which stay valid after the unlink.
"""

from __future__ import annotations

import os
import shutil

from repack import format as fmt
from repack.fileio import atomic_write, fsync_dir
from repack.manifest import Manifest, dump_manifest
from repack.merge.workdir import work_path

__all__ = ["commit_manifest", "named_files", "next_generation", "next_shard_number"]


def named_files(manifest: Manifest) -> set[str]:
    """The files of the folder that ``manifest`` names: its index, its shards and its
    fingerprint file if it has one."""
    names = {manifest.index_file, *(shard.file for shard in manifest.shards)}
    member = manifest.raw.get(fmt.FINGERPRINT_MEMBER)
    if isinstance(member, dict) and fmt.is_fingerprint_name(str(member.get("file"))):
        names.add(member["file"])
    return names


def next_generation(manifest: Manifest) -> int:
    """The generation N of the next index file, ``index-N.rpx``: one more than the current."""
    stem = manifest.index_file[: -len(".rpx")]
    return (int(stem.split("-", 1)[1]) if "-" in stem else 0) + 1


def next_shard_number(manifest: Manifest) -> int:
    """The first shard file number no shard of ``manifest`` uses (new shards are named from
    it, so they never replace a file the current manifest names)."""
    numbers = [fmt.shard_number(shard.file) for shard in manifest.shards]
    return max(numbers, default=-1) + 1


def commit_manifest(out: str, old: Manifest, new: Manifest) -> None:
    """Replace the manifest ``old`` of ``out`` by ``new`` atomically, then remove the files
    only ``old`` names and the work folder."""
    data = dump_manifest(new.to_json(), new.algorithm)
    atomic_write(os.path.join(out, fmt.MANIFEST_FILE), data)
    for name in sorted(named_files(old) - named_files(new)):
        os.unlink(os.path.join(out, name))
    if os.path.isdir(work_path(out)):
        shutil.rmtree(work_path(out))
    fsync_dir(out)
