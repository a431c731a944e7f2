"""The names an edit of a complete repack writes and keeps (:mod:`repack.merge.edit`): the
files a manifest names, and the numbers of the next index generation and the next shard,
which no file of the current manifest uses."""

from __future__ import annotations

from repack.format import spec as fmt
from repack.format.manifest import Manifest

__all__ = ["named_files", "named_sizes", "next_generation", "next_shard_number"]


def named_files(manifest: Manifest) -> set[str]:
    """The files of the folder that ``manifest`` names: its index, its shards and its
    fingerprint file if it has one."""
    return set(named_sizes(manifest))


def named_sizes(manifest: Manifest) -> dict[str, int]:
    """The files ``manifest`` names (:func:`named_files`), with the sizes it records."""
    sizes = {manifest.index_file: manifest.index_size}
    sizes.update((shard.file, shard.file_size) for shard in manifest.shards)
    member = manifest.raw.get(fmt.FINGERPRINT_MEMBER)
    if isinstance(member, dict) and fmt.is_fingerprint_name(str(member.get("file"))):
        size = member.get("size")
        sizes[member["file"]] = size if isinstance(size, int) else 0
    return sizes


def next_generation(manifest: Manifest) -> int:
    """The generation N of the next index file, ``index-N.rpx``: one more than the current."""
    stem = manifest.index_file[: -len(".rpx")]
    return (int(stem.split("-", 1)[1]) if "-" in stem else 0) + 1


def next_shard_number(manifest: Manifest) -> int:
    """The first shard file number no shard of ``manifest`` uses (new shards are named from
    it, so they never replace a file the current manifest names)."""
    numbers = [fmt.shard_number(shard.file) for shard in manifest.shards]
    return max(numbers, default=-1) + 1
