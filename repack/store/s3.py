"""``s3://bucket/prefix`` as a :class:`~repack.store.Store`, through boto3 (the ``s3`` extra).

Endpoint, region and credentials come the way every boto3 user sets them: ``AWS_ENDPOINT_URL``
(or ``AWS_ENDPOINT_URL_S3``), ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the shared config and
credentials files. repack adds no setting of its own.

One client, with one connection pool, per process (:func:`client`): every store, shard and
thread of the process shares it, and a forked child (a DataLoader worker) makes its own on
first use, since a connection pool must not be shared across ``fork``.

What the server must do, and every S3 implementation repack was tested with does (AWS S3
since 2024, SeaweedFS): ranged GET with ``If-Match``, ``PutObject`` and
``CompleteMultipartUpload`` with ``If-None-Match: *`` (conditional create) and ``If-Match``
(conditional replace).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from repack import interrupt
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

__all__ = ["MAX_POOL", "S3Store", "S3Writer", "client"]

#: Connections kept by the process's client: enough for verify's and the loader's parallel
#: ranged reads.
MAX_POOL = 64
#: Parts of one upload in flight while the next is filled: memory per writer is at most
#: (this + 1) parts.
UPLOADS_IN_FLIGHT = 2
_MAX_PARTS = 10_000
#: What a boto3 client is made from: a change (a test switching credentials) makes a new one.
_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)
INSTALL_HINT = "pip install 'megatron-repack[s3]'"

_clients: dict[tuple, object] = {}
_clients_lock = threading.Lock()


def _forget_after_fork() -> None:
    global _clients_lock
    _clients.clear()  # the parent's connections are not ours to use
    _clients_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def _boto3():
    try:
        import boto3
        import botocore
    except ImportError:
        raise MissingExtra(
            f"s3:// locations need boto3, which is not installed: {INSTALL_HINT}"
        ) from None
    return boto3, botocore


def client():
    """This process's S3 client (made on first use, and anew after fork or when the
    ``AWS_*`` environment changes)."""
    key = tuple(os.environ.get(name) for name in _ENV)
    found = _clients.get(key)
    if found is not None:
        return found
    boto3, _ = _boto3()
    from botocore.config import Config

    with _clients_lock:
        found = _clients.get(key)
        if found is None:
            session = boto3.session.Session()
            config = Config(max_pool_connections=MAX_POOL, retries={"mode": "standard"})
            found = _clients[key] = session.client("s3", config=config)
        return found


class _PreconditionFailed(StoreError):
    """A conditional request refused (412); each caller says what that means for it."""


def _code(err) -> tuple[str, int]:
    response = getattr(err, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


class S3Store(ObjectStore):
    """The objects under ``s3://bucket/prefix/``."""

    def __init__(self, location: str) -> None:
        rest = location[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise UnsupportedLocation(f"{location}: no bucket; expected s3://BUCKET/KEY")
        self.location = location.rstrip("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        _boto3()  # a clear error now if boto3 is missing, not at the first request

    @property
    def client(self):
        """The process's client (see :func:`client`)."""
        return client()

    def key(self, name: str) -> str:
        """The S3 key of ``name``."""
        return f"{self.prefix}/{name}" if self.prefix and name else (self.prefix or name)

    def _error(self, err: Exception, name: str, doing: str) -> Exception:
        """A RepackError for a boto3 error met ``doing`` something to ``name``."""
        _, botocore = _boto3()
        where = self.url(name)
        if isinstance(err, botocore.exceptions.ClientError):
            code, status = _code(err)
            if code == "NoSuchBucket":
                return BucketMissing(
                    f"{where}: bucket {self.bucket!r} does not exist", location=where
                )
            if code in ("NoSuchKey", "NotFound") or status == 404:
                return ObjectMissing(f"{where}: not found", location=where)
            if code in ("AccessDenied", "Forbidden") or status == 403:
                return StoreError(
                    f"{where}: access denied while trying to {doing} (check the credentials: "
                    "AWS_ACCESS_KEY_ID / AWS_PROFILE)",
                    location=where,
                )
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                return _PreconditionFailed(f"{where}: precondition failed", location=where)
            if code == "InvalidRange" or status == 416:
                return ShortRead(f"{where}: range past the end of the object", location=where)
            message = err.response.get("Error", {}).get("Message") or code
            return StoreError(f"{where}: cannot {doing}: {code} ({message})", location=where)
        if isinstance(err, botocore.exceptions.NoCredentialsError):
            return StoreError(
                f"{where}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "or AWS_PROFILE)",
                location=where,
            )
        if isinstance(err, botocore.exceptions.BotoCoreError):
            return StoreError(f"{where}: cannot {doing}: {err}", location=where)
        return err

    def _call(self, name: str, doing: str, method: str, **kwargs):
        _, botocore = _boto3()
        try:
            return getattr(self.client, method)(Bucket=self.bucket, **kwargs)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as err:
            raise self._error(err, name, doing) from None

    @staticmethod
    def _precondition(err: Exception) -> bool:
        return isinstance(err, _PreconditionFailed)

    # --- reads -------------------------------------------------------------------------

    def read(self, key: str, offset: int, size: int, etag: str | None = None) -> bytes:
        if size == 0:
            return b""
        extra = {"IfMatch": etag} if etag is not None else {}
        try:
            response = self._call(
                key,
                "read",
                "get_object",
                Key=self.key(key),
                Range=f"bytes={offset}-{offset + size - 1}",
                **extra,
            )
        except StoreError as err:
            if etag is not None and self._precondition(err):
                raise ObjectChanged(
                    f"{self.url(key)}: replaced on the server since it was opened (ETag is no "
                    f"longer {etag}); the repack changed under this reader",
                    location=self.url(key),
                ) from None
            raise
        data = self._body(response, key)
        if len(data) != size:
            raise ShortRead(
                f"{self.url(key)}: {len(data)} bytes at offset {offset}, expected {size}",
                location=self.url(key),
            )
        return data

    def _body(self, response, key: str) -> bytes:
        _, botocore = _boto3()
        try:
            return response["Body"].read()
        except botocore.exceptions.BotoCoreError as err:
            raise self._error(err, key, "read") from None

    def get(self, key: str, limit: int) -> tuple[bytes, Stat]:
        response = self._call(key, "read", "get_object", Key=self.key(key))
        if response["ContentLength"] > limit:
            response["Body"].close()
            raise StoreError(
                f"{self.url(key)}: {response['ContentLength']} bytes, larger than the "
                f"{limit}-byte limit",
                location=self.url(key),
            )
        data = self._body(response, key)
        return data, Stat(len(data), response["ETag"])

    def stat(self, key: str) -> Stat | None:
        try:
            response = self._call(key, "stat", "head_object", Key=self.key(key))
        except ObjectMissing:
            return None
        return Stat(int(response["ContentLength"]), response["ETag"])

    def list(self, prefix: str = "") -> Iterator[tuple[str, Stat]]:
        root = self.key("")
        start = f"{root}/" if root else ""
        paginator = self.client.get_paginator("list_objects_v2")
        _, botocore = _boto3()
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=start + prefix):
                for item in page.get("Contents", ()):
                    yield item["Key"][len(start) :], Stat(int(item["Size"]), item["ETag"])
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as err:
            raise self._error(err, prefix, "list") from None

    # --- writes ------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> Stat:
        data = bytes(data)  # a bytes-like (the fingerprint parts' array) as the body
        response = self._call(key, "write", "put_object", Key=self.key(key), Body=data)
        return Stat(len(data), response["ETag"])

    def create(self, key: str, data: bytes) -> Stat:
        try:
            response = self._call(
                key, "write", "put_object", Key=self.key(key), Body=data, IfNoneMatch="*"
            )
        except StoreError as err:
            if self._precondition(err):
                raise ObjectExists(
                    f"{self.url(key)}: exists already (another writer committed first)",
                    location=self.url(key),
                ) from None
            raise
        return Stat(len(data), response["ETag"])

    def replace(self, key: str, data: bytes, etag: str) -> Stat:
        try:
            response = self._call(
                key, "write", "put_object", Key=self.key(key), Body=data, IfMatch=etag
            )
        except (StoreError, ObjectMissing) as err:
            if isinstance(err, ObjectMissing) or self._precondition(err):
                raise ObjectChanged(
                    f"{self.url(key)}: replaced by another writer since it was read",
                    location=self.url(key),
                ) from None
            raise
        return Stat(len(data), response["ETag"])

    def writer(self, key: str, *, size_hint: int = 0, create: bool = False) -> S3Writer:
        return S3Writer(self, key, size_hint=size_hint, create=create)

    def delete(self, key: str) -> None:
        self._call(key, "delete", "delete_object", Key=self.key(key))

    def abort_uploads(self, prefix: str = "") -> int:
        """Abort the unfinished multipart uploads under ``prefix`` (those of killed writers,
        which the server keeps, and bills, until aborted). Returns how many."""
        root = self.key("")
        start = (f"{root}/" if root else "") + prefix
        count = 0
        markers: dict = {}
        while True:
            found = self._call(
                prefix, "list uploads", "list_multipart_uploads", Prefix=start, **markers
            )
            for upload in found.get("Uploads", ()):
                self._call(
                    prefix,
                    "abort an upload",
                    "abort_multipart_upload",
                    Key=upload["Key"],
                    UploadId=upload["UploadId"],
                )
                count += 1
            if not found.get("IsTruncated"):
                return count
            markers = {
                "KeyMarker": found.get("NextKeyMarker", ""),
                "UploadIdMarker": found.get("NextUploadIdMarker", ""),
            }


class S3Writer(Writer):
    """A multipart upload fed piece by piece; at most ``UPLOADS_IN_FLIGHT + 1`` parts in
    memory. An object smaller than one part is sent with one ``PutObject`` at commit."""

    def __init__(self, store: S3Store, key: str, *, size_hint: int = 0, create: bool = False):
        self.store = store
        self.name = key
        self.create = create
        # at most 10,000 parts: larger parts for an object known to be larger than 80 GiB
        self.part_size = max(PART_SIZE, -(-size_hint // (_MAX_PARTS - 1)))
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._pool: ThreadPoolExecutor | None = None
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        self._buffer += data
        self.size += len(data)
        while len(self._buffer) >= self.part_size:
            part = bytes(self._buffer[: self.part_size])
            del self._buffer[: self.part_size]
            self._send(part)

    def _send(self, part: bytes) -> None:
        store = self.store
        if self._upload_id is None:
            response = store._call(
                self.name, "write", "create_multipart_upload", Key=store.key(self.name)
            )
            self._upload_id = response["UploadId"]
            self._pool = ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="repack-put")
        while sum(not f.done() for f in self._parts) >= UPLOADS_IN_FLIGHT:
            interrupt.result_of(next(f for f in self._parts if not f.done()))
        number = len(self._parts) + 1
        self._parts.append(self._pool.submit(self._upload_part, number, part))

    def _upload_part(self, number: int, part: bytes) -> dict:
        store = self.store
        response = store._call(
            self.name,
            "write",
            "upload_part",
            Key=store.key(self.name),
            UploadId=self._upload_id,
            PartNumber=number,
            Body=part,
        )
        return {"PartNumber": number, "ETag": response["ETag"]}

    def commit(self) -> Stat:
        store = self.store
        condition = {"IfNoneMatch": "*"} if self.create else {}
        try:
            if self._upload_id is None:
                response = store._call(
                    self.name,
                    "write",
                    "put_object",
                    Key=store.key(self.name),
                    Body=bytes(self._buffer),
                    **condition,
                )
                return Stat(self.size, response["ETag"])
            if self._buffer:
                self._send(bytes(self._buffer))
                self._buffer = bytearray()
            parts = [interrupt.result_of(future) for future in self._parts]
            response = store._call(
                self.name,
                "write",
                "complete_multipart_upload",
                Key=store.key(self.name),
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
                **condition,
            )
            self._upload_id = None
            return Stat(self.size, response["ETag"])
        except StoreError as err:
            if self.create and store._precondition(err):
                self.abort()
                raise ObjectExists(
                    f"{store.url(self.name)}: exists already (another writer committed first)",
                    location=store.url(self.name),
                ) from None
            self.abort()
            raise
        finally:
            self._close_pool()

    def abort(self) -> None:
        upload, self._upload_id = self._upload_id, None
        self._buffer = bytearray()
        for future in self._parts:
            future.cancel()
        self._close_pool()
        if upload is not None:
            try:
                self.store._call(
                    self.name,
                    "abort an upload",
                    "abort_multipart_upload",
                    Key=self.store.key(self.name),
                    UploadId=upload,
                )
            except StoreError:
                pass  # the upload stays on the server; abort_uploads() removes it later

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
