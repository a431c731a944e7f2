"""The names an edit of a complete repack writes and keeps (:mod:`repack.merge.edit`): the
files a manifest names, and the numbers of the next index generation and the next shard,
which no file of the current manifest uses, nor one a superseded generation keeps."""

from __future__ import annotations

from collections.abc import Iterable

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


def _generation_of(name: str) -> int:
    """N of ``index-N.rpx`` or ``fingerprints-N.rpf`` (0 without a number)."""
    stem = name.rsplit(".", 1)[0]
    return int(stem.split("-", 1)[1]) if "-" in stem else 0


def next_generation(manifest: Manifest, taken: Iterable[str] = ()) -> int:
    """The generation N of the next index file, ``index-N.rpx``: one more than the current,
    and than any index or fingerprint file in ``taken`` (the files superseded generations
    keep: a new file never takes the name of one a reader may hold, :class:`~repack.merge.
    edit.Edit`'s ``taken``)."""
    numbers = [_generation_of(manifest.index_file)]
    numbers += [
        _generation_of(name)
        for name in taken
        if fmt.is_index_name(name) or fmt.is_fingerprint_name(name)
    ]
    return max(numbers) + 1


def next_shard_number(manifest: Manifest, taken: Iterable[str] = ()) -> int:
    """The first shard file number no shard of ``manifest`` uses, nor any shard file in
    ``taken`` (new shards are named from it, so they never replace a file the current
    manifest names, nor one a superseded generation keeps)."""
    numbers = [fmt.shard_number(shard.file) for shard in manifest.shards]
    numbers += [fmt.shard_number(name) for name in taken if fmt.is_shard_name(name)]
    return max(numbers, default=-1) + 1
