"""A folder of the local (or a shared POSIX) file system as a :class:`~repack.store.Store`.

The same guarantees as the classic write path: a sibling temp file, fsync, ``os.replace``
and fsync of the folder for ``put`` and a committed writer; ``create`` publishes the fsynced
temp file with ``link(2)``, which fails if the name exists (atomic and exclusive, like
``O_EXCL``); ``replace`` holds ``flock`` on the current file while it checks its version and
renames over it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator

from repack.errors import ObjectChanged, ObjectExists, ObjectMissing, ShortRead, StoreError
from repack.fileio import atomic_write, fsync_dir
from repack.store.base import Stat, Store, Writer

__all__ = ["LocalStore"]


def _stat_of(st: os.stat_result) -> Stat:
    return Stat(st.st_size, f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}")


class LocalStore(Store):
    """The folder ``root``; keys are paths relative to it."""

    local = True

    def __init__(self, root: str | os.PathLike) -> None:
        self.location = os.fspath(root)

    def path(self, key: str) -> str:
        """The file of ``key``."""
        return os.path.join(self.location, *key.split("/")) if key else self.location

    def url(self, key: str) -> str:
        return self.path(key)

    def _open(self, key: str) -> int:
        try:
            return os.open(self.path(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ObjectMissing(f"{self.path(key)}: not found", location=self.path(key)) from None

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
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # threads race here too
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if the name exists, whoever made it
        except FileExistsError:
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

    def writer(self, key: str) -> Writer:
        return _LocalWriter(self.path(key))

    def list(self, prefix: str = "") -> Iterator[tuple[str, Stat]]:
        found = []
        for folder, _dirs, files in os.walk(self.location):
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


class _LocalWriter(Writer):
    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.tmp = f"{path}.tmp-{os.getpid()}"
        self.fd: int | None = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def commit(self) -> Stat:
        fd, self.fd = self.fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self.tmp, self.path)
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        return _stat_of(os.stat(self.path))

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)
