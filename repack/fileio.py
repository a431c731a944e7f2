"""Low-level file I/O: zero-copy range copies, hashing reads and atomic replacement."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable

from repack.checksum import Hasher

__all__ = [
    "BUFFER",
    "CHUNK",
    "OFFLOADING_FILE_SYSTEMS",
    "atomic_write",
    "copy_offloads",
    "copy_range",
    "fsync_dir",
    "hash_range",
    "read_range",
]

#: Bytes per ``copy_file_range`` call and per progress report: large, so that file systems
#: that share extents (XFS, Btrfs) reflink big ones and progress bars are not called too often.
CHUNK = 64 * 1024 * 1024
#: Bytes per read when hashing: small enough that what ``pread`` put in the buffer is still in
#: the CPU cache when the hasher reads it. A 64 MiB buffer leaves the cache between the two and
#: made hashing reads about 3x slower (see docs/benchmarks.md).
BUFFER = 1024 * 1024
#: Bytes per pwrite where ``copy_file_range`` is refused: writes of 256 KiB and more into the
#: page cache cost up to twice the CPU time of 128 KiB ones here (see docs/benchmarks.md).
WRITE_PIECE = 128 * 1024

_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}
_copy_file_range_works = hasattr(os, "copy_file_range")
#: File systems (``/proc/self/mountinfo`` names) where ``copy_file_range`` can avoid moving
#: the data: extents shared (reflinks: Btrfs, XFS, bcachefs, OCFS2, ZFS block cloning) or a
#: server-side copy (NFS 4.2, SMB, Ceph). Elsewhere (ext4, Lustre, GPFS, tmpfs...) the kernel
#: copies through the page cache, and a copy that hashes anyway does better to read once and
#: write (see docs/benchmarks.md).
OFFLOADING_FILE_SYSTEMS = frozenset(
    {"btrfs", "xfs", "bcachefs", "ocfs2", "zfs", "nfs", "nfs4", "cifs", "smb3", "ceph", "overlay"}
)
_offloading: dict[int, bool] = {}  # st_dev -> copy_file_range offloads there


def read_range(fd: int, offset: int, size: int, buffer: bytearray | None = None) -> memoryview:
    """Read exactly ``size`` bytes at ``offset``; EOFError if the file is shorter."""
    view = memoryview(buffer if buffer is not None and len(buffer) >= size else bytearray(size))
    view = view[:size]
    done = 0
    while done < size:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"file ends {size - done} bytes before offset {offset + size}")
        done += n
    return view


def _scratch(buffer: bytearray | None, size: int) -> bytearray | memoryview:
    """At most ``BUFFER`` bytes of ``buffer`` (a new buffer if None) to read ``size`` bytes."""
    if buffer is None:
        return bytearray(max(1, min(size, BUFFER)))
    return memoryview(buffer)[:BUFFER] if len(buffer) > BUFFER else buffer


def hash_range(
    fd: int,
    offset: int,
    size: int,
    hashers: Iterable[Hasher],
    progress: Callable[[int], object] | None = None,
    buffer: bytearray | None = None,
) -> None:
    """Feed bytes ``[offset, offset + size)`` of ``fd`` to every hasher.

    Reads at most ``BUFFER`` bytes at a time (of ``buffer`` if given), so that the hashers read
    from the CPU cache; reports progress every ``CHUNK`` bytes and at the end.
    """
    hashers = tuple(hashers)
    scratch = _scratch(buffer, size)
    end = offset + size
    unreported = 0
    while offset < end:
        n = min(len(scratch), end - offset)
        view = read_range(fd, offset, n, scratch)
        for hasher in hashers:
            hasher.update(view)
        offset += n
        unreported += n
        if progress and (unreported >= CHUNK or offset == end):
            progress(unreported)
            unreported = 0


def _copy_file_range(src: int, dst: int, src_offset: int, dst_offset: int, size: int) -> int:
    """Copy with ``os.copy_file_range``; the bytes copied, 0 if the kernel refuses at once."""
    global _copy_file_range_works
    copied = 0
    try:
        while copied < size:
            step = os.copy_file_range(
                src, dst, size - copied, src_offset + copied, dst_offset + copied
            )
            if step == 0:
                raise EOFError(f"source ends before offset {src_offset + size}")
            copied += step
    except OSError as err:
        if err.errno not in _NO_COPY_FILE_RANGE or copied:
            raise
        _copy_file_range_works = False
    return copied


def _file_system(fd: int) -> str | None:
    """Type of the file system holding ``fd`` (``ext4``, ``nfs4``...), None if unknown."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as stream:
            mount = next(line.split()[1] for line in stream if line.startswith("mnt_id:"))
        with open("/proc/self/mountinfo") as stream:
            for line in stream:
                if line.split(" ", 1)[0] == mount:
                    return line.split(" - ", 1)[1].split()[0]
    except (OSError, StopIteration, IndexError):
        pass
    return None


def copy_offloads(fd: int) -> bool:
    """Whether ``copy_file_range`` into ``fd`` may avoid moving the data (a reflink or a
    server-side copy): its file system is in ``OFFLOADING_FILE_SYSTEMS``, or unknown."""
    device = os.fstat(fd).st_dev
    if device not in _offloading:
        kind = _file_system(fd)
        _offloading[device] = kind is None or kind in OFFLOADING_FILE_SYSTEMS
    return _offloading[device]


def copy_range(
    src: int,
    dst: int,
    src_offset: int,
    dst_offset: int,
    size: int,
    hashers: Iterable[Hasher] = (),
    progress: Callable[[int], object] | None = None,
    buffer: bytearray | None = None,
) -> None:
    """Copy ``size`` bytes between file descriptors, feeding them to ``hashers``.

    The data moves with ``os.copy_file_range`` (in-kernel, zero-copy, reflinked or copied
    server-side where the file system can), ``CHUNK`` bytes per call, and the hashers are fed
    from the source right after each chunk is copied, while its pages are hot in the page
    cache. Where the kernel or file system refuses it, and where there are hashers but the
    file system of ``dst`` would only copy through the page cache (not in
    ``OFFLOADING_FILE_SYSTEMS``), the data is read once into ``buffer``, hashed and written,
    ``WRITE_PIECE`` bytes at a time. Hashers read at most ``BUFFER`` bytes of ``buffer`` at a
    time, so that they read from the CPU cache.
    """
    hashers = tuple(hashers)
    scratch = _scratch(buffer, size)
    kernel = _copy_file_range_works and (not hashers or copy_offloads(dst))
    done = 0
    while done < size:
        n = min(CHUNK, size - done)
        here, there = src_offset + done, dst_offset + done
        if kernel and _copy_file_range_works and _copy_file_range(src, dst, here, there, n):
            if hashers:
                hash_range(src, here, n, hashers, None, scratch)
        else:
            end = here + n
            while here < end:
                step = min(len(scratch), WRITE_PIECE, end - here)
                view = read_range(src, here, step, scratch)
                for hasher in hashers:
                    hasher.update(view)
                written = 0
                while written < step:
                    written += os.pwrite(dst, view[written:], there + written)
                here, there = here + step, there + step
        done += n
        if progress:
            progress(n)


def fsync_dir(path: str) -> None:
    """Make a rename or creation in folder ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: sibling temp file, fsync, rename, fsync dir."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as err:
        os.unlink(tmp)  # a full disk must not leave a temp file behind
        if isinstance(err, OSError) and err.filename is None:
            raise OSError(err.errno, err.strerror, path) from None
        raise
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
