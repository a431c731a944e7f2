"""Reading a repack from object storage: shards as ranged reads pinned to the version opened,
and the node-local cache of what every process of a node needs whole (the index).

* :class:`RemoteShard` reads exact byte ranges of one object with ``If-Match`` on the ETag
  seen when the repack was opened: a repack replaced on the server while a job reads it
  fails loudly (:class:`~repack.errors.ObjectChanged`), never mixes bytes of two versions.
  A large read is cut into ``PIECE`` ranges fetched at once by the process's pool of
  ``READERS`` threads (one connection pool per process: :func:`repack.store.s3.client`).
* :func:`cached_copy` fetches an object once per node into the cache folder
  (``REPACK_CACHE_DIR``, default ``$XDG_CACHE_HOME/repack`` or ``~/.cache/repack``), in a
  folder named after the manifest's checksum, under a file lock: the first process of a node
  downloads and checks it, every other one (ranks, DataLoader workers, later jobs) maps the
  local copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future

from repack import interrupt
from repack.checksum import digest_of, new_hasher
from repack.errors import ChecksumMismatch, FormatError, ObjectChanged, ObjectMissing, ShortRead
from repack.fileio import atomic_write, fsync_dir
from repack.store.base import Handle, Store
from repack.store.generations import why_gone
from repack.store.pool import ThreadsOfProcess

__all__ = [
    "CACHE_ENV",
    "PIECE",
    "READERS",
    "ObjectStore",
    "RemoteShard",
    "cache_root",
    "cached_copy",
]

#: Environment variable naming the node-local cache folder.
CACHE_ENV = "REPACK_CACHE_DIR"
#: Bytes per ranged GET of a large read.
PIECE = 8 * 1024 * 1024
#: Ranged GETs in flight at once per process.
READERS = 16

#: The process's threads for these requests.
_readers = ThreadsOfProcess(READERS, "repack-get").get


class RemoteShard(Handle):
    """Random access to one object of a store, pinned to version ``etag``."""

    def __init__(self, store: Store, key: str, size: int, etag: str | None) -> None:
        self.store = store
        self.key = key
        self.size = size
        self.etag = etag
        self.path = store.url(key)
        self._scan: Iterator[bytes] | None = None
        self._scan_at = -1
        self._scan_buffer = memoryview(b"")

    def read(self, offset: int, size: int) -> bytes:
        """Bytes ``[offset, offset + size)``: one GET, or ``PIECE`` ranges at once."""
        if size <= PIECE:
            return self._get(offset, size)
        starts = range(offset, offset + size, PIECE)
        pieces = _readers().map(
            lambda start: self._get(start, min(PIECE, offset + size - start)), starts
        )
        return b"".join(pieces)

    def _get(self, offset: int, size: int) -> bytes:
        """One ranged read. The object of a pinned read (a repack's shard) that is gone was
        deleted under this reader, by an edit that did not keep it (``remove --now``, ``gc``):
        that is ObjectChanged naming the edit, never "not found"."""
        try:
            return self.store.read(self.key, offset, size, self.etag)
        except (ObjectMissing, ObjectChanged) as err:
            replaced = isinstance(err, ObjectChanged) and self.store.stat(self.key) is not None
            if self.etag is None or replaced:
                raise
            raise ObjectChanged(
                f"{self.path}: {why_gone(self.store, self.key)}; reopen the repack",
                location=self.path,
            ) from None

    def stream(self, offset: int, size: int, window: int = READERS // 2) -> Iterator[bytes]:
        """Bytes ``[offset, offset + size)`` in order, ``PIECE`` at a time, with the next
        ``window`` pieces fetched meanwhile (read-ahead: the caller hashes one piece while
        the server sends the next ones). At most ``window`` pieces are held."""
        pool = _readers()
        end = offset + size
        starts = iter(range(offset, end, PIECE))
        pending: deque[Future] = deque()

        def submit() -> None:
            start = next(starts, None)
            if start is not None:
                n = min(PIECE, end - start)
                pending.append(pool.submit(self._get, start, n))

        for _ in range(max(1, window)):
            submit()
        try:
            while pending:
                data = interrupt.result_of(pending.popleft())
                submit()
                yield data
        finally:
            for future in pending:
                future.cancel()

    def scan(self, offset: int, size: int) -> Iterator[memoryview]:
        """Bytes ``[offset, offset + size)`` in pieces, for a reader going through the object
        in order (``repack verify``: padding, segment, segment...): one read-ahead
        :meth:`stream` to the end of the object serves consecutive calls, so that small
        segments do not each wait for a GET. A call elsewhere starts a new stream there.
        One thread at a time.

        Raises:
            ShortRead: the range ends past the end of the object.
        """
        if size <= 0:
            return
        if offset + size > self.size:
            raise ShortRead(
                f"{self.path}: {self.size} bytes, a read of {size} at offset {offset} needs "
                f"{offset + size}",
                location=self.path,
            )
        ahead = offset - self._scan_at
        if self._scan is not None and 0 < ahead <= PIECE * (READERS // 2):
            for _ in self._take(ahead):  # a gap (alignment padding): skip what was fetched
                pass
        elif offset != self._scan_at or self._scan is None:
            self._close_scan()
            self._scan = self.stream(offset, self.size - offset)
            self._scan_at = offset
        yield from self._take(size)

    def _take(self, size: int) -> Iterator[memoryview]:
        while size:
            if not self._scan_buffer:
                self._scan_buffer = memoryview(next(self._scan))
            piece = self._scan_buffer[:size]
            self._scan_buffer = self._scan_buffer[len(piece) :]
            self._scan_at += len(piece)
            size -= len(piece)
            yield piece

    def _close_scan(self) -> None:
        if self._scan is not None:
            self._scan.close()
        self._scan, self._scan_at, self._scan_buffer = None, -1, memoryview(b"")

    def pread(self, size: int, offset: int) -> bytes:
        """``os.pread``'s argument order, for :class:`~repack.format.codec.CompressedShard`."""
        return self.read(offset, min(size, max(0, self.size - offset)))

    def close(self) -> None:
        """Stop a :meth:`scan` (the connection pool is the process's)."""
        self._close_scan()


class ObjectStore(Store):
    """What object stores (S3, MSC) share: no rename and no lock (writers commit by
    conditional create and replace; one editor at a time holds the lease), and read handles
    that are ranged GETs pinned to a version, read ahead (:class:`RemoteShard`)."""

    caches_reads = True

    def manifest(self):
        from repack.format import spec as fmt
        from repack.format.manifest import parse_manifest

        url = self.url(fmt.MANIFEST_FILE)
        try:
            data, _ = self.get(fmt.MANIFEST_FILE, fmt.MAX_MANIFEST_SIZE)
        except ObjectMissing:
            raise FormatError(
                f"{url}: not found; {self.location} is not a complete repack (the manifest is "
                "written last)",
                location=url,
            ) from None
        return parse_manifest(data, url)

    def node_folder(self, version: str) -> str:
        return cache_folder(self.location, version)

    def local_copy(self, key: str, size: int, checksum: str, algorithm: str, version: str) -> str:
        return cached_copy(
            self, key, size, checksum, algorithm, cache_folder(self.location, version)
        )

    def open(self, key: str, size: int | None = None, etag: str | None = None) -> Handle:
        if size is None:
            found = self.stat(key)
            if found is None:
                raise ObjectMissing(f"{self.url(key)}: not found", location=self.url(key))
            size, etag = found.size, etag or found.etag
        return RemoteShard(self, key, size, etag)


def cache_root() -> str:
    """The node-local cache folder."""
    found = os.environ.get(CACHE_ENV)
    if found:
        return found
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "repack")


def cache_folder(location: str, manifest_checksum: str) -> str:
    """The cache folder of one version of the repack at ``location``."""
    name = hashlib.sha256(f"{location}\0{manifest_checksum}".encode()).hexdigest()[:32]
    return os.path.join(cache_root(), "objects", name)


def cached_copy(
    store: Store,
    key: str,
    size: int,
    checksum: str,
    algorithm: str,
    folder: str,
) -> str:
    """A local copy of object ``key`` (``size`` bytes, checksum ``checksum``) in ``folder``:
    downloaded and checked by the first process of the node, under a lock, then reused.

    Raises:
        ChecksumMismatch: what the server holds is not what the manifest says.
    """
    path = os.path.join(folder, key)
    if _complete(path, size):
        return path
    os.makedirs(folder, exist_ok=True)
    lock = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait for the first to download
        if _complete(path, size):
            return path
        hasher = new_hasher(algorithm)
        tmp = f"{path}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            remote = RemoteShard(store, key, size, None)
            step = PIECE * READERS
            for start in range(0, size, step):
                data = remote.read(start, min(step, size - start))
                hasher.update(data)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        computed = digest_of(hasher, algorithm)
        if computed != checksum:
            os.unlink(tmp)
            raise ChecksumMismatch(
                f"{store.url(key)}: stored checksum {checksum}, computed {computed}",
                location=store.url(key),
            )
        os.replace(tmp, path)
        fsync_dir(folder)
        atomic_write(path + ".ok", b"")  # a copy without its mark is never trusted
        return path
    finally:
        os.close(lock)


def _complete(path: str, size: int) -> bool:
    try:
        return os.path.exists(path + ".ok") and os.stat(path).st_size == size
    except FileNotFoundError:
        return False
