"""The interface every store implements, and what each operation guarantees."""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from repack.checksum import digest_of, new_hasher
from repack.fileio import BUFFER, HashFeeder, io_buffer, read_range
from repack.format.codec import FrameWriter
from repack.store.ahead import ordered
from repack.store.generations import KEEP_SUPERSEDED

__all__ = [
    "PART_SIZE",
    "CompressingWriter",
    "Handle",
    "Stat",
    "Store",
    "Writer",
    "download",
    "upload",
]

#: Bytes per part of a streaming upload (S3 allows 5 MiB to 5 GiB, at most 10,000 parts:
#: a shard up to 80 GiB at this size; :class:`~repack.store.s3.S3Writer` grows parts beyond).
PART_SIZE = 8 * 1024 * 1024


@dataclass(frozen=True)
class Stat:
    """What a store knows of one object: its size and a version tag.

    ``etag`` changes whenever the object is replaced: S3's ETag; for a local file, its
    inode, size and modification time (``LocalStore``).
    """

    size: int
    etag: str


class Writer(abc.ABC):
    """A streaming write of one object: ``write`` pieces in order, then ``commit`` (or
    ``abort``). Nothing is visible under the key before ``commit``.

    It computes nothing: a caller that wants checksums hashes each piece as it passes it on.
    Memory is bounded by the store (one or a few parts), whatever the object's size.
    """

    @abc.abstractmethod
    def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` to the object."""

    @abc.abstractmethod
    def commit(self) -> Stat:
        """Make the object visible under its key, atomically; its :class:`Stat`."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop what was written; the key keeps what it held before."""

    def pad(self, size: int) -> None:
        """Append ``size`` zero bytes (alignment padding; a local file leaves a hole)."""
        zeros = bytes(min(size, BUFFER))
        while size > 0:
            self.write(zeros[: min(size, len(zeros))])
            size -= len(zeros)

    def copy_from(
        self,
        source: Handle,
        offset: int,
        size: int,
        hashers: tuple = (),
        advance: Callable[[int], object] = lambda n: None,
        feeder: HashFeeder | None = None,
        buffer: memoryview | None = None,
    ) -> None:
        """Append bytes ``[offset, offset + size)`` of ``source``, feeding them to
        ``hashers`` (after what ``feeder`` has queued for them) and ``advance``.

        Here: the source scanned piece by piece, each written and hashed, in ``feeder``'s
        thread when there is one (a copy of the piece, whose buffer the next one reuses:
        hashed in line, a shard of thousands of small segments waited for the feeder at
        every one). A local file from a local file moves by ``copy_file_range`` instead
        (:class:`~repack.store.local.LocalStore`).
        """
        for view in source.scan(offset, size):
            if feeder is None:
                for hasher in hashers:
                    hasher.update(view)
            else:
                feeder.update(hashers, view if isinstance(view, bytes) else bytes(view))
            self.write(view)
            advance(len(view))

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None:
            self.abort()


class CompressingWriter(Writer):
    """A compressed shard written as its logical bytes pass (:class:`~repack.format.codec.
    FrameWriter`: the frames, table and trailer :func:`~repack.format.codec.compress_file` writes,
    byte for byte) into a streaming writer, the stored bytes hashed on the way. After
    :meth:`commit`, ``stored_size`` and ``stored_checksum`` tell what was stored."""

    def __init__(self, writer: Writer, level: int, algorithm: str) -> None:
        self._writer = writer
        self._algorithm = algorithm
        self._hasher = new_hasher(algorithm)
        self._frames = FrameWriter(self._out, level)
        self.stored_size: int | None = None
        self.stored_checksum: str | None = None

    def _out(self, data: bytes) -> None:
        self._hasher.update(data)
        self._writer.write(data)

    def write(self, data: bytes | memoryview) -> None:
        self._frames.write(data)

    def commit(self) -> Stat:
        self.stored_size = self._frames.finish()
        self.stored_checksum = digest_of(self._hasher, self._algorithm)
        return self._writer.commit()

    def abort(self) -> None:
        self._writer.abort()


class Handle(abc.ABC):
    """Random access to one stored file: ``read`` a range, ``scan`` ranges in order (read
    ahead where the store is remote), ``pread`` in ``os.pread``'s argument order (for
    :class:`~repack.format.codec.CompressedShard`). A local file's handle also has ``fileno()``,
    for the code paths that need a descriptor (``copy_file_range``, ``mmap``)."""

    #: The object's size.
    size: int
    #: Its location, for messages.
    path: str

    @abc.abstractmethod
    def read(self, offset: int, size: int) -> bytes:
        """Bytes ``[offset, offset + size)``, exactly (ShortRead if the file ends first)."""

    @abc.abstractmethod
    def scan(self, offset: int, size: int) -> Iterator[memoryview]:
        """Bytes ``[offset, offset + size)`` in pieces, each valid until the next."""

    def pread(self, size: int, offset: int) -> bytes:
        """``os.pread``'s argument order: at most ``size`` bytes at ``offset``."""
        return self.read(offset, min(size, max(0, self.size - offset)))

    def fileno(self) -> int | None:
        """The descriptor of a local file; None where there is none."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the handle holds."""

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Store(abc.ABC):
    """Where the files of one repack (or any folder-like prefix) live.

    Keys are relative names inside the store's root, ``/``-separated (``manifest.json``,
    ``.work/plan.json``). Every store guarantees:

    * ``put`` and a committed ``writer`` replace an object atomically: a reader sees the old
      bytes or the new ones, never a mix;
    * ``create`` succeeds for exactly one of several writers racing for the same key;
    * ``replace`` succeeds only if the object is still the version ``etag`` names;
    * ``read`` with ``etag`` fails (:class:`~repack.errors.ObjectChanged`) rather than return
      bytes of another version.
    """

    #: The root, as given: a folder path or a URL such as ``s3://bucket/x.repack``.
    location: str
    #: Whether this is a folder of the local file system. Only this package asks: the
    #: commands and the reader use the operations below, which each store does its way.
    local: bool = False
    #: Whether :meth:`lock` keeps other writers out (a local folder's ``flock``). Where it
    #: does not, a writer commits by conditional create or replace, and one editor at a time
    #: holds the lease (:mod:`repack.merge.lease`).
    exclusive_lock: bool = False

    #: Whether a reader keeps a range cache and reads ahead (:mod:`repack.read.readahead`):
    #: where every read is a request (object storage), not a page of a local file.
    caches_reads: bool = False

    #: Whether every reader that opened an object keeps reading it after it is deleted, as an
    #: open descriptor or a mapping keeps an unlinked file on a file system only this machine
    #: mounts: an edit may then delete what it superseded at once. Where not (object storage,
    #: a folder on NFS, Lustre, a FUSE file system...: :class:`~repack.store.local.LocalStore`
    #: asks the mount table), an edit keeps those objects for a grace period
    #: (:mod:`repack.store.generations`, :meth:`superseded_grace`).
    deleted_stays_readable: bool = False

    def superseded_grace(self, keep: float | None) -> float | None:
        """How long an edit keeps what it supersedes, given ``--keep-superseded`` (``keep``,
        None where not given): the one place that decides.

        None: deleted at once and not recorded, where :attr:`deleted_stays_readable` (a
        folder only this machine mounts) and nothing else was asked, or ``keep`` is 0 there.
        Else seconds (:data:`~repack.store.generations.KEEP_SUPERSEDED` by default; an explicit
        ``keep`` on any store, a local folder included); 0 records the generation and deletes
        it at once, leaving its tombstone for the readers that find it gone.
        """
        if keep is None:
            return None if self.deleted_stays_readable else KEEP_SUPERSEDED
        if keep <= 0 and self.deleted_stays_readable:
            return None
        return max(0.0, keep)

    def url(self, key: str) -> str:
        """The location of ``key``, for messages."""
        return f"{self.location.rstrip('/')}/{key}" if key else self.location

    @property
    def identity(self) -> str:
        """What names this root however it was spelled (the process shares one open repack
        per root)."""
        return self.location

    def check_inside(self, key: str) -> None:
        """Refuse a file of the root that leads out of it (a local folder's symbolic link);
        an object is always inside its prefix.

        Raises:
            UnsafePath: it does.
        """
        return None

    @abc.abstractmethod
    def manifest(self):
        """The :class:`~repack.format.manifest.Manifest` of the repack at the root, read, checked
        against its own checksum and validated.

        Raises:
            FormatError: it is not there (the root is no complete repack), or not valid.
            ChecksumMismatch: its bytes do not match its own checksum.
        """

    @abc.abstractmethod
    def node_folder(self, version: str) -> str:
        """A local folder for what a reader of this root at ``version`` (a manifest's
        checksum) writes beside it: the folder itself, or a node-local cache folder."""

    @abc.abstractmethod
    def local_copy(self, key: str, size: int, checksum: str, algorithm: str, version: str) -> str:
        """The path of a local file holding ``key`` whole (``size`` bytes, ``checksum``), to
        map it: the file itself, or a copy in the node cache fetched once per node and
        checked.

        Raises:
            StoreError: it cannot be fetched; ChecksumMismatch: the copy is not the file.
        """

    @abc.abstractmethod
    def read(self, key: str, offset: int, size: int, etag: str | None = None) -> bytes:
        """Bytes ``[offset, offset + size)`` of ``key``, exactly (one ranged GET).

        Raises:
            ObjectMissing: no such object.
            ObjectChanged: ``etag`` given and the object is another version.
            ShortRead: the object ends before ``offset + size``.
        """

    @abc.abstractmethod
    def open(self, key: str, size: int | None = None, etag: str | None = None) -> Handle:
        """A read :class:`Handle` of ``key`` (``size``: its size, when known; ``etag``: the
        version every read is pinned to).

        Raises:
            ObjectMissing: no such object (a local file; object stores tell at the first read).
        """

    @abc.abstractmethod
    def get(self, key: str, limit: int) -> tuple[bytes, Stat]:
        """The whole of a small object and its :class:`Stat`.

        Raises:
            ObjectMissing: no such object.
            StoreError: larger than ``limit`` bytes.
        """

    @abc.abstractmethod
    def stat(self, key: str) -> Stat | None:
        """Size and version of ``key``; None when there is no such object."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> Stat:
        """Write ``data`` (bytes-like) as ``key``, atomically replacing what was there."""

    @abc.abstractmethod
    def create(self, key: str, data: bytes) -> Stat:
        """Write ``data`` as ``key`` only if there is no such object (S3 ``If-None-Match: *``).

        Raises:
            ObjectExists: the key exists (another writer committed first).
        """

    @abc.abstractmethod
    def replace(self, key: str, data: bytes, etag: str) -> Stat:
        """Replace ``key`` by ``data`` only if it is still the version ``etag`` (S3
        ``If-Match``).

        Raises:
            ObjectChanged: the object is another version, or gone.
        """

    @abc.abstractmethod
    def writer(self, key: str, *, size_hint: int = 0) -> Writer:
        """A streaming :class:`Writer` of ``key`` (S3: a multipart upload); ``size_hint``,
        the size expected, lets a store choose its part size (S3 allows 10,000 parts)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[tuple[str, Stat]]:
        """Every object whose key starts with ``prefix``, in key order, with its Stat."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; no error if it is not there."""

    def compressing_writer(
        self, key: str, *, size_hint: int, level: int, algorithm: str
    ) -> CompressingWriter:
        """A writer of the compressed shard ``key``, fed its logical bytes (``size_hint`` of
        them). Here: compressed as they pass into a streaming write. A local folder writes
        the raw shard and compresses it at commit, on every core (:class:`~repack.store.
        local.LocalStore`)."""
        return CompressingWriter(self.writer(key, size_hint=size_hint), level, algorithm)

    def delete_prefix(self, prefix: str, keep: frozenset[str] = frozenset()) -> bool:
        """Remove every object under ``prefix`` but those named in ``keep``; whether any
        was removed."""
        names = [name for name, _ in self.list(prefix) if name not in keep]
        for name in names:
            self.delete(name)
        return bool(names)

    def abort_uploads(self, prefix: str = "") -> int:
        """Abort the unfinished streaming writes killed writers left under ``prefix`` (S3
        keeps, and bills, a multipart upload until it is aborted); how many. A store whose
        unfinished writes are temp files counts them among its leftovers instead."""
        return 0

    def prepare(self) -> None:
        """Make the root exist, where that means something (a local folder, which holds
        the lock file)."""
        return None

    def lock(self, *, shared: bool = False) -> contextlib.AbstractContextManager:
        """The writer lock of the root for a ``with`` block: shared for the tasks of one
        merge, else exclusive. Only where :attr:`exclusive_lock` is true does it keep other
        writers out; elsewhere it is no lock at all."""
        return contextlib.nullcontext()

    def holds(self, path: str) -> bool:
        """Whether the file ``path`` (a source's prefix) lies inside the root: a merge must
        not write where its sources are read from. Only a local folder can."""
        return False

    @contextlib.contextmanager
    def fetched(self, keys: list[str]) -> Iterator[str]:
        """A local folder holding those of ``keys`` that exist, under their names, for the
        ``with`` block (what is read as local files: the fingerprint parts the tasks saved).

        Here: each downloaded into a temp folder. A local folder is its own.
        """
        folder = tempfile.mkdtemp(prefix="repack-fetched-")
        try:
            wanted = set(keys)
            common = os.path.commonprefix(keys)  # noqa: RUF071 (of keys, by character)
            listed = self.list(common) if keys else ()
            found = {name: stat for name, stat in listed if name in wanted}
            for key, stat in found.items():
                path = os.path.join(folder, *key.split("/"))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                download(self, key, path, stat.size, stat.etag)
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @contextlib.contextmanager
    def staged(self, key: str) -> Iterator[str]:
        """A local file to write ``key`` into at random offsets (the index, a fingerprint
        file), published as ``key`` when the ``with`` block ends without error and dropped
        when it fails. The caller creates the file, writes and fsyncs it.

        Here: a file in a temp folder, then one streaming write. A local folder publishes
        its own temp file by rename instead (:class:`~repack.store.local.LocalStore`).
        """
        folder = tempfile.mkdtemp(prefix="repack-staged-")
        try:
            path = os.path.join(folder, key.rsplit("/", 1)[-1])
            yield path
            upload(self, key, path)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def upload(store: Store, name: str, path: str) -> Stat:
    """Send the local file ``path`` as the object ``name``, in a streaming write."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with store.writer(name, size_hint=size) as writer:
            buffer = io_buffer(min(BUFFER, max(1, size)))
            done = 0
            while done < size:
                n = min(len(buffer), size - done)
                writer.write(read_range(fd, done, n, buffer))
                done += n
            return writer.commit()
    finally:
        os.close(fd)


#: Bytes per ranged GET of a download.
PIECE = 8 * 1024 * 1024


def download(store: Store, name: str, path: str, size: int, etag: str | None = None) -> None:
    """Write the object ``name`` (``size`` bytes; pinned to ``etag`` if given) to the local
    file ``path``, in ranged GETs fetched ahead."""
    jobs = (
        (min(PIECE, size - start), lambda s=start: store.read(name, s, min(PIECE, size - s), etag))
        for start in range(0, size, PIECE)
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        for data in ordered(jobs, requests=8):
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
    finally:
        os.close(fd)
