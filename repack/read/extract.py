"""Write one source of a repack back out as a Megatron prefix, byte-identical to the original."""

from __future__ import annotations

import os

from repack.checksum import digest_of, new_hasher
from repack.errors import ChecksumMismatch, FormatError, OutputExists, UnknownSource
from repack.fileio import CHUNK, copy_range, fsync_dir
from repack.format.manifest import SourceEntry
from repack.progress import Progress, no_progress
from repack.read.reader import Repack
from repack.store import local_folder

__all__ = ["destination", "extract"]


def destination(dest_prefix: str | os.PathLike, source_name: str) -> str:
    """The prefix :func:`extract` writes for ``dest_prefix``: itself, or when it is a folder
    (one that exists, or any path ending in ``/``) the source's base name inside it.

    ``repack extract OUT data/web/cc-00017 restored/`` writes ``restored/cc-00017.bin`` and
    ``.idx``, not the hidden ``restored/.bin`` and ``restored/.idx``.
    """
    dest = os.fspath(dest_prefix)
    if dest.endswith(os.sep) or (os.altsep and dest.endswith(os.altsep)) or os.path.isdir(dest):
        return os.path.join(dest, os.path.basename(os.path.normpath(source_name)))
    return dest


def extract(
    path: str | os.PathLike,
    source: str,
    dest_prefix: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: Progress = no_progress,
) -> SourceEntry:
    """Write ``DEST_PREFIX.bin`` and ``DEST_PREFIX.idx`` for ``source`` of the repack at ``path``.

    Both files are written as temp files, checked against the checksums of the originals
    recorded at merge time, fsynced and renamed into place.

    Args:
        path: The repack folder.
        source: The prefix exactly as written in the blend, or its absolute path.
        dest_prefix: Where to write; ``.bin`` and ``.idx`` are appended. A folder (one that
            exists, or a path ending in ``/``) means the source's base name in it
            (:func:`destination`).
        overwrite: Replace existing destination files.
        progress: Progress reporter factory.

    Raises:
        UnknownSource: ``source`` is not in the repack.
        OutputExists: a destination file exists and ``overwrite`` is false.
        ChecksumMismatch: the repack's data no longer matches the original's checksum.
    """
    dest = local_folder(dest_prefix, "DEST_PREFIX")
    repack = Repack(os.fspath(path), backend="pread")
    manifest = repack.manifest
    entry = manifest.find_source(source)
    if entry is None:
        known = ", ".join(s.name for s in manifest.sources[:3])
        raise UnknownSource(
            f"{repack.path}: no source {source!r} in this repack "
            f"({len(manifest.sources)} sources, e.g. {known}; see 'repack inspect')"
        )
    dest = destination(dest_prefix, entry.name)
    targets = {ext: dest + ext for ext in (".bin", ".idx")}
    for target in targets.values():
        if os.path.lexists(target) and not overwrite:
            raise OutputExists(f"{target}: exists; pass --force to replace it", path=target)
    folder = os.path.dirname(os.path.abspath(dest))
    os.makedirs(folder, exist_ok=True)
    advance = progress("extract", entry.bin_size)
    tmp = {ext: f"{target}.tmp-{os.getpid()}" for ext, target in targets.items()}
    try:
        _write_bin(repack, entry, tmp[".bin"], advance)
        _write_idx(repack, entry, tmp[".idx"])
        for ext in (".bin", ".idx"):
            os.replace(tmp[ext], targets[ext])
        fsync_dir(folder)
    finally:
        for name in tmp.values():
            if os.path.exists(name):
                os.unlink(name)
        repack.close()
    return entry


def _write_bin(repack: Repack, entry: SourceEntry, target: str, advance) -> None:
    algorithm = repack.manifest.algorithm
    hasher = new_hasher(algorithm)
    buffer = bytearray(min(CHUNK, max(entry.bin_size, 1)))
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for seg in entry.segments:
            # a raw local shard moves by copy_file_range; one on object storage comes in
            # ranged reads, a compressed one through its frames
            with repack.shard_handle(seg.shard) as shard:
                try:
                    if shard.fileno() is not None:
                        copy_range(
                            shard.fileno(),
                            fd,
                            seg.offset,
                            seg.source_offset,
                            seg.size,
                            [hasher],
                            advance,
                            buffer,
                        )
                        continue
                    done = seg.source_offset
                    for view in shard.scan(seg.offset, seg.size):
                        hasher.update(view)
                        _pwrite_all(fd, view, done)
                        done += len(view)
                        advance(len(view))
                except FormatError as err:
                    # a frame that no longer decodes (zstd checks each frame's content): the
                    # data is damaged, as when a raw shard's bytes fail their checksum
                    raise ChecksumMismatch(
                        f"{repack.path}: data of {entry.name!r} cannot be read ({err}); the "
                        "repack is damaged (run 'repack verify')"
                    ) from None
        os.ftruncate(fd, entry.bin_size)
        os.fsync(fd)
    finally:
        os.close(fd)
    computed = digest_of(hasher, algorithm)
    if computed != entry.bin_checksum:
        raise ChecksumMismatch(
            f"{repack.path}: data of {entry.name!r} has checksum {computed}, the original "
            f"had {entry.bin_checksum}; the repack is damaged (run 'repack verify')"
        )


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_idx(repack: Repack, entry: SourceEntry, target: str) -> None:
    algorithm = repack.manifest.algorithm
    hasher = new_hasher(algorithm)
    with open(target, "wb") as stream:
        for chunk in repack.source_idx_chunks(entry):
            hasher.update(chunk)
            stream.write(chunk)
        stream.flush()
        os.fsync(stream.fileno())
    computed = digest_of(hasher, algorithm)
    if computed != entry.idx_checksum:
        raise ChecksumMismatch(
            f"{repack.path}: index of {entry.name!r} has checksum {computed}, the original "
            f"had {entry.idx_checksum}; the repack is damaged (run 'repack verify')"
        )
