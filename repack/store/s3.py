"""``s3://bucket/prefix`` as a :class:`~repack.store.Store`, through boto3 (the ``s3`` extra).

Endpoint, region and credentials come the way every boto3 user sets them: ``AWS_ENDPOINT_URL``
(or ``AWS_ENDPOINT_URL_S3``), ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the shared config and
credentials files. repack adds none of its own for them.

One client, with one connection pool, per process (:func:`client`): every store, shard and
thread of the process shares it, and a forked child (a DataLoader worker) makes its own on
first use, since a connection pool must not be shared across ``fork``. Every request is
retried by :mod:`repack.store.retry` (``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``, the config
file, and ``REPACK_S3_STALL_TIMEOUT`` for a server that does not answer); botocore makes one
attempt per call.

What the server must do, and every S3 implementation repack was tested with does (AWS S3
since 2024, SeaweedFS): ranged GET with ``If-Match``, ``PutObject`` and
``CompleteMultipartUpload`` with ``If-None-Match: *`` (conditional create) and ``If-Match``
(conditional replace).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from repack import interrupt
from repack.errors import (
    BucketMissing,
    InputError,
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
from repack.store.retry import STALL_ENV, Policy, Retry
from repack.store.retry import policy as retry_policy

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
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
    STALL_ENV,
)
INSTALL_HINT = "pip install 'megatron-repack[s3]'"

_clients: dict[tuple, tuple[object, Policy]] = {}
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
    return _client_and_policy()[0]


def _client_and_policy():
    """This process's client and the retry :class:`~repack.store.retry.Policy` it was made
    with: each attempt waits at most ``policy.timeout`` to connect and for each byte, and
    botocore makes one attempt per call (the retries are :mod:`repack.store.retry`'s)."""
    key = tuple(os.environ.get(name) for name in _ENV)
    found = _clients.get(key)
    if found is not None:
        return found
    boto3, _ = _boto3()
    import botocore.exceptions
    import botocore.session
    from botocore.config import Config

    with _clients_lock:
        found = _clients.get(key)
        if found is None:
            core = botocore.session.get_session()
            try:
                scoped = core.get_scoped_config()
            except botocore.exceptions.BotoCoreError:
                scoped = {}  # (a missing profile: the client's creation says so)
            settings = retry_policy(scoped)
            config = Config(
                max_pool_connections=MAX_POOL,
                connect_timeout=settings.timeout,
                read_timeout=settings.timeout,
                retries=settings.botocore_retries(),
            )
            session = boto3.session.Session(botocore_session=core)
            try:
                made = session.client("s3", config=config)
            except ValueError as err:  # botocore's "Invalid endpoint: ..."
                raise InputError(
                    f"cannot use the S3 endpoint: {err} (check AWS_ENDPOINT_URL, "
                    "AWS_ENDPOINT_URL_S3 or endpoint_url in the AWS config file)"
                ) from None
            settings = dataclasses.replace(settings, endpoint=made.meta.endpoint_url)
            found = _clients[key] = (made, settings)
        return found


class _PreconditionFailed(StoreError):
    """A conditional request refused (412); each caller says what that means for it.
    ``uncertain``: an earlier attempt of the same request may have been applied (its reply
    was lost), so that the refusal may be its own effect."""

    uncertain = False


#: What a request may raise: botocore's errors, and urllib3's when botocore reads the body of
#: an error reply as is (its ``content``) and the connection breaks.
_FAILURES: tuple[type, ...] = ()


def _failures() -> tuple[type, ...]:
    global _FAILURES
    if not _FAILURES:
        _, botocore = _boto3()
        import urllib3.exceptions

        _FAILURES = (
            botocore.exceptions.ClientError,
            botocore.exceptions.BotoCoreError,
            urllib3.exceptions.HTTPError,
        )
    return _FAILURES


def _code(err) -> tuple[str, int]:
    response = getattr(err, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


#: Bytes asked of a reply's body at a time: what a reply cut mid-way keeps.
CHUNK = 1024 * 1024
#: A ranged GET answered with the whole object (``200``: a gateway or a cache that ignored
#: the range) is used when at most this many bytes come before the range (read and dropped a
#: chunk at a time); further in, every read would cost the object up to it, and is refused.
WHOLE_REPLY_SKIP = 64 * 1024 * 1024
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def _cut() -> None:
    """A reply's body ended before its length: a cut, retried as one."""
    import urllib3.exceptions

    raise urllib3.exceptions.ProtocolError("the reply ended before its length")


def _span(
    response: dict,
    where: str,
    asked: str | None,
    start: int,
    end: int | None,
    offset: int,
    size: int | None,
) -> tuple[int, int]:
    """``(bytes to drop, bytes to keep)`` of the reply to a GET of bytes ``[start, end)``
    (``end`` None: to the end of the object; ``asked`` its ``Range``, None: the whole
    object), once checked to hold them: a ``206`` with the ``Content-Range`` asked, or a
    ``200`` with the whole object (the range then taken from it).

    Raises:
        ShortRead: the object ends before ``end``.
        StoreError: any other reply (never other bytes than those asked).
    """
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    length = int(response["ContentLength"])
    if status == 206 and asked is not None:
        found = _CONTENT_RANGE.fullmatch(str(response.get("ContentRange", "")).strip())
        first, last, whole = found.groups() if found else (-1, -1, "*")
        first, last = int(first), int(last)
        size_of = None if whole == "*" else int(whole)
        if end is not None and size_of is not None and size_of < end and first == start:
            raise _short(where, size_of, offset, size)
        wanted_last = (end if end is not None else size_of or 0) - 1
        if first != start or last != wanted_last or length != last - first + 1:
            raise StoreError(
                f"{where}: asked for {asked}, the server answered "
                f"{response.get('ContentRange') or 'no Content-Range'} with {length} bytes "
                "(a ranged reply must hold the range asked)",
                location=where,
            )
        return 0, length
    if status == 200:
        if asked is None:
            return 0, length
        # the range ignored: the whole object came
        if end is not None and length < end:
            raise _short(where, length, offset, size)
        if start > WHOLE_REPLY_SKIP:
            raise StoreError(
                f"{where}: the server ignored the range {asked} and sent the whole object "
                f"({length} bytes): reading {start} bytes before the range on every read is "
                f"refused (more than {WHOLE_REPLY_SKIP}); does a proxy or cache drop Range?",
                location=where,
            )
        return start, (length if end is None else end) - start
    raise StoreError(
        f"{where}: asked for {asked or 'the object'}, the server answered status {status}",
        location=where,
    )


def _short(where: str, found: int, offset: int, size: int | None) -> ShortRead:
    return ShortRead(
        f"{where}: {found} bytes, a read of {size} at offset {offset} needs {offset + (size or 0)}",
        location=where,
    )


class S3Store(ObjectStore):
    """The objects under ``s3://bucket/prefix/``.

    Every request runs in a :class:`~repack.store.retry.Retry` (what is retried, how often,
    how long a silent server is waited for). A read whose reply is cut mid-way asks for the
    bytes still missing, pinned to the ETag of the first reply; a conditional write refused
    after an attempt whose reply was lost reads the object back, and is a success if it holds
    the bytes written (:meth:`create`, :meth:`replace`).
    """

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

    def _error(self, err: Exception, name: str, doing: str, retry: Retry | None = None):
        """A RepackError for a boto3 error met ``doing`` something to ``name`` (after the
        attempts of ``retry``)."""
        _, botocore = _boto3()
        where = self.url(name)
        spent = retry.spent() if retry is not None else ""
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
            if code == "PreconditionFailed" or status == 412:
                found = _PreconditionFailed(f"{where}: precondition failed", location=where)
                found.uncertain = retry is not None and retry.uncertain
                return found
            if code == "InvalidRange" or status == 416:
                return ShortRead(f"{where}: range past the end of the object", location=where)
            message = err.response.get("Error", {}).get("Message") or code
            return StoreError(f"{where}: cannot {doing}: {code} ({message}){spent}", location=where)
        if isinstance(err, botocore.exceptions.NoCredentialsError):
            return StoreError(
                f"{where}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "or AWS_PROFILE)",
                location=where,
            )
        if isinstance(err, _failures()):  # botocore's others, urllib3's
            return StoreError(f"{where}: cannot {doing}: {err}{spent}", location=where)
        return err

    def _retry(self, name: str) -> Retry:
        return Retry(self.url(name), _client_and_policy()[1])

    def _call(self, name: str, doing: str, method: str, **kwargs):
        """``client.method(Bucket=..., **kwargs)``, retried (:mod:`repack.store.retry`)."""
        retry = self._retry(name)
        try:
            return retry.run(lambda: getattr(self.client, method)(Bucket=self.bucket, **kwargs))
        except _failures() as err:
            raise self._error(err, name, doing, retry) from None

    @staticmethod
    def _precondition(err: Exception) -> bool:
        return isinstance(err, _PreconditionFailed)

    # --- reads -------------------------------------------------------------------------

    def _fetch(
        self, key: str, offset: int, size: int | None, etag: str | None, limit: int = 0
    ) -> tuple[bytes, str]:
        """Bytes ``[offset, offset + size)`` of ``key`` (``size`` None: to the end, at most
        ``limit`` bytes), pinned to ``etag`` if given, and the object's ETag.

        A reply cut mid-way keeps what came: the next attempt asks for the rest only, pinned
        to the ETag of the first reply (an object replaced between the two is read again
        whole, when no ``etag`` was given). Every reply is checked for the range asked
        (:func:`_span`): never other bytes.

        Raises:
            ObjectChanged: the object is no longer version ``etag`` (or was replaced at
                every one of its reads).
        """
        where = self.url(key)
        retry = self._retry(key)
        chunks: list[bytes] = []
        got = 0
        pin = etag
        total = size  # bytes wanted in all, once known
        restarts = 0
        while True:
            retry.begin()
            start = offset + got  # the first byte still wanted
            end = None if total is None else offset + total  # past the last one (None: the end)
            asked = f"bytes={start}-{'' if end is None else end - 1}" if end or start else None
            try:
                extra = {"IfMatch": pin} if pin is not None else {}
                if asked is not None:
                    extra["Range"] = asked
                response = self.client.get_object(Bucket=self.bucket, Key=self.key(key), **extra)
                retry.answered()
                body = response["Body"]
                replaced = pin is not None and response.get("ETag") != pin  # If-Match ignored
                if not replaced:
                    try:
                        skip, length = _span(response, where, asked, start, end, offset, size)
                    except StoreError:
                        body.close()
                        raise
                    if total is None:
                        total = length
                        if total > limit:
                            body.close()
                            raise StoreError(
                                f"{where}: {total} bytes, larger than the {limit}-byte limit",
                                location=where,
                            )
                    pin = pin or response["ETag"]
                    after = int(response["ContentLength"]) - skip - length
                    while skip:  # a whole object for a range: the bytes before it dropped
                        dropped = len(body.read(min(CHUNK, skip)))
                        if not dropped:
                            _cut()
                        skip -= dropped
                        retry.answered()
                    wanted = got + length
                    while got < wanted:
                        chunk = body.read(min(CHUNK, wanted - got))
                        if not chunk:
                            break
                        chunks.append(chunk)
                        got += len(chunk)
                        retry.answered()  # bytes came: a cut after them is no failure in a row
                    if after > 0:
                        body.close()  # the rest of a whole object: not wanted
                    else:
                        body.read()  # the end of the reply (botocore checks its length)
                    data = b"".join(chunks)
                    if size is not None and len(data) != size:
                        raise ShortRead(
                            f"{where}: {len(data)} bytes at offset {offset}, expected {size}",
                            location=where,
                        )
                    return data, pin
                body.close()
            except _failures() as err:
                code, status = _code(err)
                replaced = status == 412 or code == "PreconditionFailed"
                if not replaced:
                    try:
                        retry.failed(err)
                    except _failures():
                        raise self._error(err, key, "read", retry) from None
                    continue
            # the object is no longer the version pinned
            if etag is not None:
                raise ObjectChanged(
                    f"{where}: replaced on the server since it was opened (ETag is no longer "
                    f"{etag}); the repack changed under this reader",
                    location=where,
                )
            if restarts >= retry.policy.attempts:
                raise ObjectChanged(
                    f"{where}: replaced on the server at each of {restarts + 1} reads",
                    location=where,
                )
            # replaced since the first reply, whose bytes (if any came) are of another
            # version: read the new one whole
            chunks, got, pin, total = [], 0, None, size
            restarts += 1

    def read(self, key: str, offset: int, size: int, etag: str | None = None) -> bytes:
        if size == 0:
            return b""
        return self._fetch(key, offset, size, etag)[0]

    def get(self, key: str, limit: int) -> tuple[bytes, Stat]:
        data, etag = self._fetch(key, 0, None, None, limit)
        return data, Stat(len(data), etag)

    def stat(self, key: str) -> Stat | None:
        try:
            response = self._call(key, "stat", "head_object", Key=self.key(key))
        except ObjectMissing:
            return None
        return Stat(int(response["ContentLength"]), response["ETag"])

    def list(self, prefix: str = "") -> Iterator[tuple[str, Stat]]:
        root = self.key("")
        start = f"{root}/" if root else ""
        token: dict = {}
        while True:
            page = self._call(prefix, "list", "list_objects_v2", Prefix=start + prefix, **token)
            for item in page.get("Contents", ()):
                yield item["Key"][len(start) :], Stat(int(item["Size"]), item["ETag"])
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    # --- writes ------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> Stat:
        data = bytes(data)  # a bytes-like (the fingerprint parts' array) as the body
        response = self._call(key, "write", "put_object", Key=self.key(key), Body=data)
        return Stat(len(data), response["ETag"])

    def _written_by_us(self, err: StoreError, key: str, data: bytes) -> Stat | None:
        """After a conditional write of ``data`` refused (``err``): the object's Stat if it
        holds ``data`` and an earlier attempt of that write may have been applied (its reply
        lost, the retry refused by its own effect), else None."""
        if not getattr(err, "uncertain", False):
            return None
        try:
            found, stat = self.get(key, len(data))
        except (ObjectMissing, StoreError):
            return None
        return stat if found == data else None

    def create(self, key: str, data: bytes) -> Stat:
        data = bytes(data)
        try:
            response = self._call(
                key, "write", "put_object", Key=self.key(key), Body=data, IfNoneMatch="*"
            )
        except StoreError as err:
            if self._precondition(err):
                ours = self._written_by_us(err, key, data)
                if ours is not None:
                    return ours
                raise ObjectExists(
                    f"{self.url(key)}: exists already (another writer committed first)",
                    location=self.url(key),
                ) from None
            raise
        return Stat(len(data), response["ETag"])

    def replace(self, key: str, data: bytes, etag: str) -> Stat:
        data = bytes(data)
        try:
            response = self._call(
                key, "write", "put_object", Key=self.key(key), Body=data, IfMatch=etag
            )
        except (StoreError, ObjectMissing) as err:
            if isinstance(err, ObjectMissing) or self._precondition(err):
                ours = self._written_by_us(err, key, data)
                if ours is not None:
                    return ours
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


def multipart_etag(parts: list[dict]) -> str:
    """The ETag S3 gives the object a multipart upload of ``parts`` (each with the ETag of
    its part, the MD5 of its bytes) makes: the MD5 of those MD5s, then ``-`` and their
    count."""
    digests = b"".join(bytes.fromhex(part["ETag"].strip('"')) for part in parts)
    return f"{hashlib.md5(digests).hexdigest()}-{len(parts)}"


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
            try:
                response = store._call(
                    self.name,
                    "write",
                    "complete_multipart_upload",
                    Key=store.key(self.name),
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                    **condition,
                )
            except ObjectMissing:
                # no such upload: completed by an attempt whose reply was lost? Then the
                # object is there, with the ETag of these very parts
                found = store.stat(self.name)
                if found is None or found.etag.strip('"') != multipart_etag(parts):
                    raise
                response = {"ETag": found.etag}
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
