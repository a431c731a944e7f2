"""Low-level file I/O: zero-copy range copies, hashing reads and atomic replacement."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable

from repack.checksum import Hasher

__all__ = ["CHUNK", "atomic_write", "copy_range", "fsync_dir", "hash_range", "read_range"]

#: Bytes moved per system call: large enough to amortize calls, small enough for progress.
CHUNK = 64 * 1024 * 1024

_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}
_copy_file_range_works = hasattr(os, "copy_file_range")


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


def hash_range(
    fd: int,
    offset: int,
    size: int,
    hashers: Iterable[Hasher],
    progress: Callable[[int], object] | None = None,
    buffer: bytearray | None = None,
) -> None:
    """Feed bytes ``[offset, offset + size)`` of ``fd`` to every hasher."""
    hashers = tuple(hashers)
    buffer = buffer if buffer is not None else bytearray(min(size, CHUNK))
    end = offset + size
    while offset < end:
        n = min(len(buffer), end - offset)
        view = read_range(fd, offset, n, buffer)
        for hasher in hashers:
            hasher.update(view)
        offset += n
        if progress:
            progress(n)


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

    The data moves with ``os.copy_file_range`` (in-kernel, zero-copy, reflinked on file
    systems that support it); where the kernel or file system refuses, with pread/pwrite.
    The hashers are fed from the source, chunk by chunk, right after the copy, while the
    pages are hot in the page cache.
    """
    global _copy_file_range_works
    hashers = tuple(hashers)
    buffer = buffer if buffer is not None else bytearray(min(max(size, 1), CHUNK))
    done = 0
    while done < size:
        n = min(len(buffer), size - done)
        copied = 0
        if _copy_file_range_works:
            try:
                while copied < n:
                    step = os.copy_file_range(
                        src,
                        dst,
                        n - copied,
                        src_offset + done + copied,
                        dst_offset + done + copied,
                    )
                    if step == 0:
                        raise EOFError(f"source ends before offset {src_offset + size}")
                    copied += step
            except OSError as err:
                if err.errno not in _NO_COPY_FILE_RANGE or copied:
                    raise
                _copy_file_range_works = False
        if copied:
            if hashers:
                view = read_range(src, src_offset + done, n, buffer)
                for hasher in hashers:
                    hasher.update(view)
        else:
            view = read_range(src, src_offset + done, n, buffer)
            for hasher in hashers:
                hasher.update(view)
            written = 0
            while written < n:
                written += os.pwrite(dst, view[written:], dst_offset + done + written)
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
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
