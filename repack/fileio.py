"""Low-level file I/O: zero-copy range copies, hashing reads and atomic replacement."""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterable

from repack import interrupt
from repack.checksum import Hasher
from repack.errors import ShortRead

__all__ = [
    "BUFFER",
    "CHUNK",
    "HashFeeder",
    "atomic_write",
    "copy_range",
    "describe_fd",
    "fsync_dir",
    "hash_range",
    "io_buffer",
    "read_range",
    "start_writeback",
]

#: Bytes per ``copy_file_range`` call and per progress report: large, so that file systems
#: that share extents (XFS, Btrfs) reflink big ones and progress bars are not called too often.
CHUNK = 64 * 1024 * 1024
#: Bytes per read when hashing: small enough that what ``pread`` put in the buffer is still in
#: the CPU cache when the hasher reads it; reads of 64 MiB made hashing 1.8x slower here
#: (``scripts/bench_io.py``, docs/benchmarks.md).
BUFFER = 1024 * 1024
#: Bytes per pread/pwrite when copying without ``copy_file_range``: pieces of 1 MiB took twice
#: as long as pieces of 128 KiB here (``scripts/bench_io.py``, docs/benchmarks.md).
WRITE_PIECE = 128 * 1024

_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}
_copy_file_range_works = hasattr(os, "copy_file_range")

_sync_file_range = None  # libc's sync_file_range, once looked up; False where there is none
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, size: int) -> None:
    """Have the kernel start writing bytes ``[offset, offset + size)`` of ``fd`` to disk now,
    without waiting for them (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``); a no-op
    where it is missing or refused.

    Written data otherwise waits in the page cache until a tenth of RAM is dirty, and the
    final ``fsync`` then waits for most of it: started as the copy goes, the disk writes
    while we copy, and a durable 1 GiB copy took a quarter less time here
    (``scripts/bench_io.py``, docs/benchmarks.md). Durability still comes from ``fsync``.
    """
    global _sync_file_range
    if _sync_file_range is None:
        try:
            import ctypes

            function = ctypes.CDLL(None, use_errno=True).sync_file_range
            function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sync_file_range = function
        except (OSError, AttributeError):
            _sync_file_range = False
    if _sync_file_range:
        _sync_file_range(fd, offset, size, _SYNC_FILE_RANGE_WRITE)  # errors change nothing


#: Where ``io_buffer`` buffers start, in bytes after a page boundary.
BUFFER_OFFSET = 64


def io_buffer(size: int) -> memoryview:
    """A zeroed, writable buffer of ``size`` bytes (at least 1) for ``pread``/``pwrite``.

    It starts ``BUFFER_OFFSET`` bytes after a page boundary. Where a buffer starts matters:
    ``pread`` into a buffer 16 bytes past a page boundary, where glibc puts a large
    ``bytearray`` it maps fresh, ran at a fifth of the speed of ``pread`` into a page-aligned
    one or into this one (``scripts/bench_io.py``; the CPU's copy then sees false
    dependencies between its loads and stores, "4K aliasing").
    """
    size = max(1, size)
    region = mmap.mmap(-1, BUFFER_OFFSET + size, flags=mmap.MAP_PRIVATE)
    return memoryview(region)[BUFFER_OFFSET : BUFFER_OFFSET + size]


def read_range(
    fd: int, offset: int, size: int, buffer: bytearray | memoryview | None = None
) -> memoryview:
    """Read exactly ``size`` bytes at ``offset`` into ``buffer`` (a new ``io_buffer`` if None
    or too small).

    Raises:
        ShortRead: the file ends before ``offset + size``.
    """
    view = memoryview(buffer if buffer is not None and len(buffer) >= size else io_buffer(size))
    view = view[:size]
    done = 0
    while done < size:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ShortRead(
                f"{describe_fd(fd)}: ends {size - done} bytes before offset {offset + size}"
            )
        done += n
    return view


def describe_fd(fd: int) -> str:
    """The path of the file open as ``fd`` (from ``/proc/self/fd``), for error messages; the
    descriptor's number where the system does not tell."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"file descriptor {fd}"


def _scratch(buffer: memoryview | None, size: int) -> memoryview:
    """Space to read ``size`` bytes through, at most ``BUFFER`` at a time: the start of
    ``buffer`` if it is an ``io_buffer``, else a new ``io_buffer``."""
    if not isinstance(getattr(buffer, "obj", None), mmap.mmap):
        return io_buffer(min(size, BUFFER))
    return buffer[:BUFFER]


def hash_range(
    fd: int,
    offset: int,
    size: int,
    hashers: Iterable[Hasher],
    progress: Callable[[int], object] | None = None,
    buffer: memoryview | None = None,
) -> None:
    """Feed bytes ``[offset, offset + size)`` of ``fd`` to every hasher.

    Reads at most ``BUFFER`` bytes at a time, so that the hashers read from the CPU cache,
    into ``buffer`` if it is an ``io_buffer`` (else into a new one); reports progress every
    ``CHUNK`` bytes and at the end.
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
                raise ShortRead(f"{describe_fd(src)}: ends before offset {src_offset + size}")
            copied += step
    except OSError as err:
        if err.errno not in _NO_COPY_FILE_RANGE or copied:
            raise
        _copy_file_range_works = False
    return copied


class HashFeeder:
    """Feeds hashers from a thread of its own, in the order given, so that hashing what was
    just copied overlaps the copy of what comes next.

    ``copy_file_range`` moves the data without showing it to us, so the copy is hashed by
    reading its source back while its pages are hot in the page cache. Done in line, that
    read-back made a copy take 1.22x as long as no hashing; in a thread (``pread`` and
    xxhash release the GIL), on another core while the kernel copies, 1.06x
    (``scripts/bench_io.py``, docs/benchmarks.md).

    Use it as a context manager. ``wait()`` (and leaving the block) waits for everything
    queued and re-raises in the caller any error the thread met. At most ``depth`` items
    wait in the queue; the thread reads through one ``io_buffer`` of up to ``BUFFER`` bytes.

    The caller's side may be cut anywhere by :class:`~repack.interrupt.Interrupted` (a signal
    handler raises it in the main thread), so it shares no Python-level lock with the thread:
    a ``queue.Queue`` or ``threading.Condition`` cut between its lock and its notify left the
    thread waiting for an item it had been given (a ``merge`` or ``add`` that did not end
    after ^C, about once in 500 interrupted runs; ``tests/test_io_paths.py`` cuts it 2,000
    times). Items, free places and replies go through
    ``queue.SimpleQueue``, whose ``put`` and ``get`` are single C calls.
    """

    def __init__(self, depth: int = 4) -> None:
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._room: queue.SimpleQueue = queue.SimpleQueue()  # a token per free place
        for _ in range(depth):
            self._room.put(True)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="repack-hash", daemon=True)
        self._thread.start()

    def update(self, hashers: Iterable[Hasher], data: bytes) -> None:
        """Feed ``data`` to every hasher, after everything queued before."""
        self._put((tuple(hashers), data, None, 0, 0))

    def update_range(self, hashers: Iterable[Hasher], fd: int, offset: int, size: int) -> None:
        """Feed bytes ``[offset, offset + size)`` of ``fd`` to every hasher, after everything
        queued before. ``fd`` may be closed once this returns (the thread reads a duplicate)."""
        copy = os.dup(fd)
        self._put((tuple(hashers), None, copy, offset, size), copy)

    def wait(self) -> None:
        """Return once everything queued is hashed; re-raise the first error of the thread."""
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self._items.put(reply)  # answered once everything before it is done
        reply.get()
        self._raise_error()

    def _put(self, item: tuple, fd: int | None = None) -> None:
        """Queue ``item`` once there is room; the thread owns ``fd`` (closes it) once the
        item is queued, the caller before."""
        try:
            self._raise_error()
            self._room.get()
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        self._items.put(item)

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        interrupt.block_in_thread()  # SIGINT and SIGTERM go to the thread that stops us
        scratch = None
        while True:
            item = self._items.get()
            if item is None:
                return
            if isinstance(item, queue.SimpleQueue):  # wait(): everything before is done
                item.put(True)
                continue
            hashers, data, fd, offset, size = item
            try:
                if self._error is not None:
                    continue  # after an error, only drain the queue and close descriptors
                if fd is None:
                    for hasher in hashers:
                        hasher.update(data)
                else:
                    scratch = io_buffer(BUFFER) if scratch is None else scratch
                    hash_range(fd, offset, size, hashers, None, scratch)
            except BaseException as err:  # handed to the caller by _put or wait
                self._error = err
            finally:
                if fd is not None:
                    os.close(fd)
                self._room.put(True)

    def _stop(self) -> None:
        self._items.put(None)
        self._thread.join()

    def __enter__(self) -> HashFeeder:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None:  # skip what is still queued: its hashes will not be read
            self._error = self._error or error
            self._stop()
            return
        try:
            self.wait()
        finally:
            self._stop()


def copy_range(
    src: int,
    dst: int,
    src_offset: int,
    dst_offset: int,
    size: int,
    hashers: Iterable[Hasher] = (),
    progress: Callable[[int], object] | None = None,
    buffer: memoryview | None = None,
    feeder: HashFeeder | None = None,
) -> None:
    """Copy ``size`` bytes between file descriptors, feeding them to ``hashers``.

    The data moves with ``os.copy_file_range`` (in-kernel, zero-copy, reflinked or copied
    server-side where the file system can), ``CHUNK`` bytes per call; where the kernel or
    file system refuses, with pread/pwrite, ``WRITE_PIECE`` bytes at a time. The disk starts
    writing each chunk at once (``start_writeback``). After each ``copy_file_range`` chunk
    the hashers are fed from the source, while its pages are hot in the page cache: by
    ``feeder`` if given (in its thread: wait for it before reading the hashers), else here,
    through at most ``BUFFER`` bytes at a time (so that they read from the CPU cache) of
    ``buffer`` if it is an ``io_buffer``, else of a new one.
    """
    hashers = tuple(hashers)
    scratch = _scratch(buffer, size)
    done = 0
    while done < size:
        n = min(CHUNK, size - done)
        here, there = src_offset + done, dst_offset + done
        if _copy_file_range_works and _copy_file_range(src, dst, here, there, n):
            if hashers and feeder is not None:
                feeder.update_range(hashers, src, here, n)
            elif hashers:
                hash_range(src, here, n, hashers, None, scratch)
        else:
            if feeder is not None:
                feeder.wait()  # the hashers see the bytes in order
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
        start_writeback(dst, dst_offset + done, n)
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
