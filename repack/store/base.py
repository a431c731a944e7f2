"""The interface every store implements, and what each operation guarantees."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["PART_SIZE", "Stat", "Store", "Writer"]

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

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None:
            self.abort()


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
    #: Whether this is a folder of the local file system (what the classic, fd-based code
    #: paths need: rename, flock, mmap).
    local: bool = False

    def url(self, key: str) -> str:
        """The location of ``key``, for messages."""
        return f"{self.location.rstrip('/')}/{key}" if key else self.location

    @abc.abstractmethod
    def read(self, key: str, offset: int, size: int, etag: str | None = None) -> bytes:
        """Bytes ``[offset, offset + size)`` of ``key``, exactly (one ranged GET).

        Raises:
            ObjectMissing: no such object.
            ObjectChanged: ``etag`` given and the object is another version.
            ShortRead: the object ends before ``offset + size``.
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
        """Write ``data`` as ``key``, atomically replacing what was there."""

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
    def writer(self, key: str) -> Writer:
        """A streaming :class:`Writer` of ``key`` (S3: a multipart upload)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[tuple[str, Stat]]:
        """Every object whose key starts with ``prefix``, in key order, with its Stat."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; no error if it is not there."""
