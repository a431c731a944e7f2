"""A folder of the local (or a shared POSIX) file system as a :class:`~repack.store.Store`.

What a local merge has always guaranteed, and its speed: ``put`` and a committed writer go
through a sibling temp file, fsync, ``os.replace`` and fsync of the folder; ``create``
publishes the fsynced temp file with ``link(2)``, which fails if the name exists (atomic and
exclusive, like ``O_EXCL``); ``replace`` holds ``flock`` on the current file while it checks
its version and renames over it; the writer lock is ``flock`` of ``.lock``
(:mod:`repack.store.lock`: shared for the tasks of one merge, its descriptor inherited by their
workers). A writer writes at offsets: padding is a hole, and a local source moves by
``copy_file_range`` hashed in the :class:`~repack.fileio.HashFeeder`'s thread; a compressed
shard is written raw, then compressed on every core. Temp names are ``NAME.tmp-PID`` (and
``NAME.tmp-PID-XXXXXXXX`` where threads of one process race), the names the clean-up of a
killed writer's leftovers recognises (:func:`temp_base`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator

from repack.checksum import digest_of, new_hasher
from repack.errors import (
    ObjectChanged,
    ObjectExists,
    ObjectMissing,
    OutputExists,
    ShortRead,
    StoreError,
    UnsafePath,
    UnsupportedLocation,
)
from repack.fileio import (
    BUFFER,
    HashFeeder,
    atomic_write,
    copy_range,
    fsync_dir,
    hash_range,
    io_buffer,
    read_range,
)
from repack.format.codec import compress_file
from repack.store import filesystems
from repack.store.base import CompressingWriter, Handle, Stat, Store, Writer
from repack.store.filesystems import Mount, is_shared, lock_is_local
from repack.store.lock import writer_lock
from repack.store.urls import scheme_of

__all__ = ["LocalFile", "LocalStore", "temp_base", "temp_name"]

#: Reads of the manifest that met ``ESTALE`` (an edit renamed a new one over it) before one
#: gives up.
_STALE_ATTEMPTS = 5

#: A temp file of a writer: ``NAME.tmp-PID``, or ``NAME.tmp-PID-XXXXXXXX`` where threads of
#: one process race for the same name (``create``). The clean-up of leftovers recognises
#: exactly these (:func:`temp_base`).
_TEMP = re.compile(r"^(?P<base>.+)\.tmp-(?P<pid>\d+)(?:-[0-9a-f]{8})?$")


def temp_name(path: str, unique: bool = False) -> str:
    """This process's temp name for ``path``: two runs of one task never share a file; with
    ``unique``, nor two threads."""
    suffix = f"-{uuid.uuid4().hex[:8]}" if unique else ""
    return f"{path}.tmp-{os.getpid()}{suffix}"


def temp_base(name: str) -> tuple[str, int] | None:
    """The name a temp file ``name`` (of :func:`temp_name`) stands for and the pid of its
    writer, or None if it is not one."""
    match = _TEMP.match(name)
    return (match.group("base"), int(match.group("pid"))) if match else None


def _stat_of(st: os.stat_result) -> Stat:
    return Stat(st.st_size, f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}")


class LocalStore(Store):
    """The folder ``root``; keys are paths relative to it."""

    local = True
    exclusive_lock = True

    def __init__(self, root: str | os.PathLike, fs_type: str | None = None) -> None:
        self.location = os.fspath(root)
        #: The file system's type as the mount table names it, looked up once (tests give it)
        self._fs_type = fs_type

    @property
    def mount(self) -> Mount:
        """The mount holding the folder (:func:`~repack.store.filesystems.mount_of`)."""
        found = getattr(self, "_mount", None)
        if found is None:
            found = filesystems.mount_of(self.location)  # (replaced by tests)
            if self._fs_type is not None:
                found = Mount(self._fs_type, found.point, found.options)
            self._mount = found
        return found

    @property
    def deleted_stays_readable(self) -> bool:
        """True where only this machine mounts the folder's file system (ext4, xfs, tmpfs...):
        an unlinked file stays readable to the processes that hold it. On a file system other
        machines mount (NFS, Lustre, GPFS, CephFS, SMB, FUSE...) a deleted file is gone for the
        readers on the others: edits keep what they supersede (:func:`~repack.store.
        filesystems.is_shared`)."""
        return not is_shared(self.mount.type)

    @property
    def identity(self) -> str:
        return os.path.realpath(self.location)

    def _real_location(self) -> str:
        # asked once per source of a blend (holds): looked up once
        real = getattr(self, "_real", None)
        if real is None:
            real = self._real = os.path.realpath(self.location)
        return real

    def check_inside(self, key: str) -> None:
        """A repack is data: the names in its manifest are plain names (checked when it is
        parsed), and this keeps a link planted in the folder from making a reader serve
        another file of the machine."""
        path = self.path(key)
        if not os.path.islink(path):
            return
        target, real = os.path.realpath(path), os.path.realpath(self.location)
        if not target.startswith(real + os.sep):
            raise UnsafePath(
                f"{path}: is a symbolic link to {target}, outside the repack folder "
                f"{real}; the files of a repack must be inside its folder"
            )

    def manifest(self):
        """The manifest, read whole at once (no reader keeps it open). On NFS an edit's
        rename over ``manifest.json`` between this open and its read makes the read fail
        with ``ESTALE``: then it is opened again, the new manifest read (a few times at most).
        """
        from repack.errors import FormatError
        from repack.format.manifest import load_manifest

        for attempt in range(_STALE_ATTEMPTS):
            try:
                return load_manifest(self.location)  # (a FIFO refused, parsed once per file)
            except FormatError as err:
                cause = err.__context__
                stale = isinstance(cause, OSError) and cause.errno == errno.ESTALE
                if not stale or attempt == _STALE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def node_folder(self, version: str) -> str:
        return self.location

    def local_copy(self, key: str, size: int, checksum: str, algorithm: str, version: str) -> str:
        return self.path(key)

    def path(self, key: str) -> str:
        """The file of ``key``."""
        return os.path.join(self.location, *key.split("/")) if key else self.location

    def url(self, key: str) -> str:
        return self.path(key)

    def _open(self, key: str) -> int:
        path = self.path(key)
        try:
            # O_NONBLOCK: a FIFO named like a file of the store is refused, not waited on
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise ObjectMissing(f"{path}: not found", location=path) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StoreError(f"{path}: not a regular file", location=path)
        os.set_blocking(fd, True)
        return fd

    def open(self, key: str, size: int | None = None, etag: str | None = None) -> Handle:
        fd = self._open(key)
        try:
            st = os.fstat(fd)
            if etag is not None and _stat_of(st).etag != etag:
                raise ObjectChanged(
                    f"{self.path(key)}: replaced since it was opened", location=self.path(key)
                )
        except BaseException:
            os.close(fd)
            raise
        return LocalFile(fd, self.path(key), st.st_size if size is None else size)

    def read(self, key: str, offset: int, size: int, etag: str | None = None) -> bytes:
        fd = self._open(key)
        try:
            if etag is not None and _stat_of(os.fstat(fd)).etag != etag:
                raise ObjectChanged(
                    f"{self.path(key)}: replaced since it was opened", location=self.path(key)
                )
            data = os.pread(fd, size, offset)
            while len(data) < size:
                more = os.pread(fd, size - len(data), offset + len(data))
                if not more:
                    raise ShortRead(
                        f"{self.path(key)}: ends {size - len(data)} bytes before offset "
                        f"{offset + size}",
                        location=self.path(key),
                    )
                data += more
            return data
        finally:
            os.close(fd)

    def get(self, key: str, limit: int) -> tuple[bytes, Stat]:
        fd = self._open(key)
        try:
            st = os.fstat(fd)
            if st.st_size > limit:
                raise StoreError(
                    f"{self.path(key)}: {st.st_size} bytes, larger than the {limit}-byte limit",
                    location=self.path(key),
                )
            with os.fdopen(os.dup(fd), "rb") as stream:
                data = stream.read(limit + 1)
            return data, _stat_of(st)
        finally:
            os.close(fd)

    def stat(self, key: str) -> Stat | None:
        try:
            return _stat_of(os.stat(self.path(key)))
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> Stat:
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, data)
        return _stat_of(os.stat(path))

    def create(self, key: str, data: bytes) -> Stat:
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = temp_name(path, unique=True)  # threads race here too
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:  # (a full disk): no temp file left behind
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        try:
            os.link(tmp, path)  # fails if the name exists, whoever made it
        except FileExistsError:
            # NFSv3's LINK is not idempotent: a reply lost and the call resent answers EEXIST
            # for a link that was made. The temp file's count of links tells (open(2), O_EXCL
            # on NFS; the same test as liblockfile's)
            if os.stat(tmp).st_nlink != 2:
                raise ObjectExists(
                    f"{path}: exists already (another writer committed first)", location=path
                ) from None
        finally:
            os.unlink(tmp)
        fsync_dir(os.path.dirname(path))
        return _stat_of(os.stat(path))

    def replace(self, key: str, data: bytes, etag: str) -> Stat:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ObjectChanged(f"{path}: gone since it was read", location=path) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # replacers of the same version take turns
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            # the file we locked must still be the one at ``path``: a writer before us may
            # have renamed a new one over it while we waited
            same = st is not None and os.path.samestat(os.fstat(fd), st)
            current = _stat_of(st) if same else None
            if current is None or current.etag != etag:
                raise ObjectChanged(
                    f"{path}: replaced by another writer since it was read", location=path
                )
            atomic_write(path, data)
            return _stat_of(os.stat(path))
        finally:
            os.close(fd)

    def writer(self, key: str, *, size_hint: int = 0) -> Writer:
        return _LocalWriter(self.path(key))

    def compressing_writer(
        self, key: str, *, size_hint: int, level: int, algorithm: str
    ) -> CompressingWriter:
        return _LocalCompressingWriter(self.path(key), level, algorithm)

    def list(self, prefix: str = "") -> Iterator[tuple[str, Stat]]:
        found = []
        # only the folder the prefix names is walked (``.work/`` is not the whole repack,
        # whose ``cache/`` may hold many files)
        for folder, _dirs, files in os.walk(self.path(prefix.rpartition("/")[0])):
            rel = os.path.relpath(folder, self.location)
            rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in files:
                key = rel + name
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        found.append((key, _stat_of(os.stat(os.path.join(folder, name)))))
        yield from sorted(found)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def delete_prefix(self, prefix: str, keep: frozenset[str] = frozenset()) -> bool:
        """As on every store; a prefix that is a folder (``.work/``) goes with its files, and
        the root is fsynced once after."""
        removed = super().delete_prefix(prefix, keep)
        folder = self.path(prefix.rstrip("/"))
        if prefix.endswith("/") and os.path.isdir(folder):
            if not any(files for _, _, files in os.walk(folder)):  # (nothing kept there)
                shutil.rmtree(folder)
                removed = True
        if removed:
            fsync_dir(self.location)
        return removed

    def prepare(self) -> None:
        if os.path.exists(self.location) and not os.path.isdir(self.location):
            raise OutputExists(f"{self.location}: exists and is not a folder")
        os.makedirs(self.location, exist_ok=True)

    def lock(self, *, shared: bool = False) -> contextlib.AbstractContextManager:
        """``flock`` of ``.lock`` (:mod:`repack.store.lock`), refused at once where the mount
        keeps ``flock`` on this machine (NFS with ``local_lock=``, ``nolock``): a writer on
        another machine would not be kept out (:func:`~repack.store.filesystems.lock_is_local`).

        Raises:
            UnsupportedLocation: the mount's locks are local only.
        """
        why = lock_is_local(self.mount)
        if why is not None:
            raise UnsupportedLocation(
                f"{self.location}: cannot take the one-writer lock: {why}, so a writer on "
                "another machine would not be kept out; remount without that option, or "
                "write the repack elsewhere"
            )
        return writer_lock(self.location, shared=shared)

    def holds(self, path: str) -> bool:
        if scheme_of(path) is not None:  # an object, in no local folder
            return False
        target = self._real_location()
        folder = os.path.dirname(os.path.realpath(path))
        return folder == target or folder.startswith(target + os.sep)

    @contextlib.contextmanager
    def fetched(self, keys: list[str]) -> Iterator[str]:
        yield self.location  # the files are here

    @contextlib.contextmanager
    def staged(self, key: str) -> Iterator[str]:
        """A temp file beside ``key``'s, renamed over it and the folder fsynced when the block
        ends (the caller fsyncs the file): nothing is copied."""
        final = self.path(key)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = temp_name(final)
        try:
            yield tmp
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        os.replace(tmp, final)
        fsync_dir(os.path.dirname(final))


class LocalFile(Handle):
    """A read handle of a local file: its descriptor, read with ``pread``."""

    def __init__(self, fd: int, path: str, size: int) -> None:
        self.fd: int | None = fd
        self.path = path
        self.size = size
        self._buffer: memoryview | None = None

    def read(self, offset: int, size: int) -> bytes:
        return bytes(read_range(self.fd, offset, size))

    def scan(self, offset: int, size: int) -> Iterator[memoryview]:
        # one buffer of up to BUFFER bytes, so that what reads the pieces reads them from
        # the CPU cache; grown, never beyond, when a later scan is larger
        wanted = min(BUFFER, max(1, size))
        if self._buffer is None or len(self._buffer) < wanted:
            self._buffer = io_buffer(wanted)
        end = offset + size
        while offset < end:
            n = min(len(self._buffer), end - offset)
            yield read_range(self.fd, offset, n, self._buffer)
            offset += n

    def pread(self, size: int, offset: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def fileno(self) -> int | None:
        return self.fd

    def detach(self) -> int:
        """The descriptor, which the caller now owns (closing the handle leaves it open)."""
        fd, self.fd = self.fd, None
        return fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _LocalWriter(Writer):
    """A new file written through this process's temp file beside it, at positions: padding
    is a hole, a local source moves by ``copy_file_range`` and each chunk is written back at
    once. Commit: ftruncate to the end, fsync, rename, fsync of the folder."""

    def __init__(self, path: str, temp: str | None = None) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.tmp = temp or temp_name(path)
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.position = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, self.position)
            view, self.position = view[n:], self.position + n

    def pad(self, size: int) -> None:
        self.position += size  # a hole, made a size by the ftruncate at commit

    def copy_from(
        self,
        source: Handle,
        offset: int,
        size: int,
        hashers: tuple = (),
        advance=lambda n: None,
        feeder: HashFeeder | None = None,
        buffer: memoryview | None = None,
    ) -> None:
        fd = source.fileno()
        if fd is None:
            super().copy_from(source, offset, size, hashers, advance, feeder, buffer)
            return
        copy_range(fd, self.fd, offset, self.position, size, hashers, advance, buffer, feeder)
        self.position += size

    def finish(self) -> None:
        """Size, and fsync the temp file (then it is ready to be renamed)."""
        os.ftruncate(self.fd, self.position)
        os.fsync(self.fd)

    def commit(self) -> Stat:
        self.finish()
        self._close()
        os.replace(self.tmp, self.path)
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        return _stat_of(os.stat(self.path))

    def _close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def abort(self) -> None:
        self._close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


class _LocalCompressingWriter(CompressingWriter):
    """A compressed shard in a local folder: the raw shard written in place first (holes,
    ``copy_file_range``), then compressed at commit on every core by
    :func:`~repack.format.codec.compress_file`, whose frames are those a
    :class:`~repack.store.base.CompressingWriter` streams, byte for byte. A file that can be
    read back compresses in parallel; a stream can only compress as it passes."""

    def __init__(self, path: str, level: int, algorithm: str) -> None:
        # the raw shard's temp name is one the clean-up knows (and no other writer's)
        self._raw = _LocalWriter(path, temp_name(path, unique=True))
        self._path, self._level, self._algorithm = path, level, algorithm
        self.stored_size: int | None = None
        self.stored_checksum: str | None = None

    def write(self, data: bytes | memoryview) -> None:
        self._raw.write(data)

    def pad(self, size: int) -> None:
        self._raw.pad(size)

    def copy_from(self, *args, **kwargs) -> None:
        self._raw.copy_from(*args, **kwargs)

    def commit(self) -> Stat:
        raw = self._raw
        os.ftruncate(raw.fd, raw.position)
        raw._close()
        tmp = temp_name(self._path)
        try:
            self.stored_size = compress_file(raw.tmp, tmp, self._level)
            hasher = new_hasher(self._algorithm)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                hash_range(fd, 0, self.stored_size, [hasher])
            finally:
                os.close(fd)
            self.stored_checksum = digest_of(hasher, self._algorithm)
            os.replace(tmp, self._path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            raw.abort()  # the raw shard goes
        fsync_dir(os.path.dirname(os.path.abspath(self._path)))
        return _stat_of(os.stat(self._path))

    def abort(self) -> None:
        self._raw.abort()
