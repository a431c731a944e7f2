"""``msc://profile/path`` as a :class:`~repack.store.Store`, through NVIDIA's
multi-storage-client (the ``msc`` extra), what Megatron-LM and NeMo use for object storage.

The profile, its endpoint and its credentials come from MSC's own configuration
(``MSC_CONFIG``, ``~/.msc_config.yaml``...); repack adds nothing. MSC makes its clients per
profile and forgets them after ``fork``, but a client already held is the parent's, with its
connection pool: a store resolves its client again in each process (forked DataLoader workers
reading at once through the parent's client read each other's responses).

Reads, ``put``, ``list``, ``delete`` and ``stat`` are MSC's public API. A read pinned to an
ETag is a GET then a HEAD: MSC's ``read`` (and its providers' ``get_object``, in
multi-storage-client 1.3.1 as on its main branch) takes no ``If-Match`` or version and returns
the bytes only, without the ETag they were read at, so the version cannot be part of the
GET; checked after it, the HEAD sees a replace made before or during the GET. Conditional writes
(``create``, ``replace``) go to the profile's storage provider's ``put_object`` with
``if_none_match`` / ``if_match``, which MSC's public ``write`` does not expose. A streaming
write is spooled in memory up to one part, then to a temp file, and sent with MSC's
``upload_file`` (multipart) at commit: MSC has no public part-by-part upload.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

from repack.errors import (
    BucketMissing,
    MissingExtra,
    ObjectChanged,
    ObjectExists,
    ObjectMissing,
    ShortRead,
    StoreError,
    UnsupportedLocation,
)
from repack.store.base import PART_SIZE, Stat, Writer
from repack.store.objects import ObjectStore

__all__ = ["MSCStore"]

INSTALL_HINT = "pip install 'megatron-repack[msc]'"


def _no_bucket(err: BaseException) -> bool:
    """Whether MSC's "not found" came from a missing bucket (the S3 error it was raised
    from, MSC keeping it as the context, says ``NoSuchBucket``)."""
    seen = 0
    while err is not None and seen < 8:
        response = getattr(err, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") == "NoSuchBucket":
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _msc():
    try:
        import multistorageclient
    except ImportError:
        raise MissingExtra(
            f"msc:// locations need multi-storage-client, which is not installed: {INSTALL_HINT}"
        ) from None
    return multistorageclient


class MSCStore(ObjectStore):
    """The objects under ``msc://profile/path/``."""

    def __init__(self, location: str) -> None:
        _msc()
        self.location = location.rstrip("/")
        rest = self.location[len("msc://") :]
        if not rest.partition("/")[0]:
            raise UnsupportedLocation(f"{location}: no profile; expected msc://PROFILE/PATH")
        self._pid = -1
        self.root = self._resolve()[1].strip("/")

    def _resolve(self):
        """MSC's client of the location and its path, as this process resolves them."""
        try:
            found = _msc().resolve_storage_client(self.location)
        except (ValueError, KeyError, OSError) as err:
            raise StoreError(f"{self.location}: MSC cannot resolve it: {err}") from None
        self._held, self._pid = found[0], os.getpid()
        return found

    @property
    def _client(self):
        """This process's MSC client (resolved anew in a forked child)."""
        if self._pid != os.getpid():
            self._resolve()
        return self._held

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root and key else (self.root or key)

    def _wrap(self, err: Exception, key: str, doing: str) -> Exception:
        types = _msc().types
        where = self.url(key)
        if isinstance(err, FileNotFoundError):
            if _no_bucket(err):
                return BucketMissing(
                    f"{where}: the bucket of MSC profile {self.location.split('/')[2]!r} does "
                    "not exist (its base_path)",
                    location=where,
                )
            return ObjectMissing(f"{where}: not found", location=where)
        if isinstance(err, types.PreconditionFailedError):
            return ObjectChanged(f"{where}: precondition failed", location=where)
        return StoreError(f"{where}: cannot {doing}: {err}", location=where)

    def _do(self, key: str, doing: str, function, *args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (FileNotFoundError, RuntimeError, OSError, ValueError) as err:
            raise self._wrap(err, key, doing) from None
        except Exception as err:
            if type(err).__module__.startswith(("multistorageclient", "botocore", "boto3")):
                raise self._wrap(err, key, doing) from None
            raise

    def read(self, key: str, offset: int, size: int, etag: str | None = None) -> bytes:
        if size == 0:
            return b""
        byte_range = _msc().types.Range(offset=offset, size=size)
        try:
            data = self._do(key, "read", self._client.read, self._path(key), byte_range=byte_range)
        except ObjectMissing:
            if etag is None:
                raise
            data = None
        if etag is not None:
            # MSC's read takes no If-Match and returns no ETag: the version is checked by a
            # HEAD after the GET, which sees a replace made before or during it
            found = self.stat(key)
            if data is None or found is None or found.etag != etag:
                raise ObjectChanged(
                    f"{self.url(key)}: replaced on the server since it was opened",
                    location=self.url(key),
                )
        if len(data) != size:
            raise ShortRead(
                f"{self.url(key)}: {len(data)} bytes at offset {offset}, expected {size}",
                location=self.url(key),
            )
        return bytes(data)

    def get(self, key: str, limit: int) -> tuple[bytes, Stat]:
        found = self.stat(key)
        if found is None:
            raise ObjectMissing(f"{self.url(key)}: not found", location=self.url(key))
        if found.size > limit:
            raise StoreError(
                f"{self.url(key)}: {found.size} bytes, larger than the {limit}-byte limit",
                location=self.url(key),
            )
        data = bytes(self._do(key, "read", self._client.read, self._path(key)))
        return data, found

    def stat(self, key: str) -> Stat | None:
        try:
            info = self._do(key, "stat", self._client.info, self._path(key))
        except ObjectMissing:
            return None
        return Stat(int(info.content_length), str(info.etag))

    def put(self, key: str, data: bytes) -> Stat:
        data = bytes(data)  # a bytes-like (the fingerprint parts' array) as the body
        self._do(key, "write", self._client.write, self._path(key), data)
        return self.stat(key)

    def _provider(self):
        provider = getattr(self._client, "_storage_provider", None)
        if provider is None:
            raise StoreError(f"{self.location}: this MSC profile has no single storage provider")
        return provider

    def _holds(self, key: str, data: bytes) -> Stat | None:
        """After a conditional write of ``data`` was refused: the object's Stat if it holds
        ``data`` (MSC retries a request whose reply was lost, whose retry is then refused by
        its own effect; MSC does not say whether it retried), else None."""
        try:
            found, stat = self.get(key, len(data))
        except StoreError:
            return None
        return stat if found == data else None

    def create(self, key: str, data: bytes) -> Stat:
        data = bytes(data)
        try:
            self._do(
                key, "write", self._provider().put_object, self._path(key), data, if_none_match="*"
            )
        except ObjectChanged:
            ours = self._holds(key, data)
            if ours is not None:
                return ours
            raise ObjectExists(
                f"{self.url(key)}: exists already (another writer committed first)",
                location=self.url(key),
            ) from None
        return self.stat(key)

    def replace(self, key: str, data: bytes, etag: str) -> Stat:
        data = bytes(data)
        try:
            self._do(
                key, "write", self._provider().put_object, self._path(key), data, if_match=etag
            )
        except (ObjectChanged, ObjectMissing):
            ours = self._holds(key, data)
            if ours is not None:
                return ours
            raise ObjectChanged(
                f"{self.url(key)}: replaced by another writer since it was read",
                location=self.url(key),
            ) from None
        return self.stat(key)

    def writer(self, key: str, *, size_hint: int = 0) -> Writer:
        return _MSCWriter(self, key)

    def list(self, prefix: str = "") -> Iterator[tuple[str, Stat]]:
        start = f"{self.root}/" if self.root else ""
        found = self._do(prefix, "list", lambda: list(self._client.list(start + prefix)))
        for info in sorted(found, key=lambda i: i.key):
            name = info.key[len(start) :] if info.key.startswith(start) else info.key
            yield name, Stat(int(info.content_length), str(info.etag))

    def delete(self, key: str) -> None:
        try:
            self._do(key, "delete", self._client.delete, self._path(key))
        except ObjectMissing:
            pass


class _MSCWriter(Writer):
    def __init__(self, store: MSCStore, key: str) -> None:
        self.store, self.key = store, key
        self._spool = tempfile.SpooledTemporaryFile(max_size=PART_SIZE)

    def write(self, data: bytes | memoryview) -> None:
        self._spool.write(data)

    def commit(self) -> Stat:
        store = self.store
        try:
            self._spool.seek(0)
            store._do(
                self.key, "write", store._client.upload_file, store._path(self.key), self._spool
            )
        finally:
            self._spool.close()
        return store.stat(self.key)

    def abort(self) -> None:
        self._spool.close()
