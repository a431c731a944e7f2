"""The files of a source prefix, a local path or an object: ``/data/web-00001`` or
``s3://bucket/data/web-00001`` / ``msc://profile/data/web-00001`` in a blend, as Megatron-LM's
main branch accepts them. What differs between the two lives here, so that validation, the
merge's tasks, its index and its fingerprints read sources one way:

* :func:`read_index` — the ``.idx`` bytes and the ``.bin``'s size (and ETag): a local file is
  opened without blocking (a FIFO named like a source fails, never waits) and must be a
  regular file; an object is one GET, its ``.bin`` one HEAD;
* :func:`open_bin` — a read handle of a validated source's ``.bin``: a local file's
  descriptor, checked to still have its validated size (what ``copy_file_range`` copies
  from); an object's ranged GETs, each pinned to the ETag seen at validation
  (``If-Match``), so that a source replaced on the server during a merge fails loudly rather
  than mixing two versions;
* :func:`index_bytes` — the ``.idx`` bytes again, for a caller that checks them against the
  checksum validated;
* :class:`SegmentReader` and :func:`read_each` — many sources in order, with the reads of
  those on object storage run ahead (a blend of thousands of small sources does not wait a
  round trip per source); local files are read in line, where the kernel reads ahead.

The stores are the process's (:func:`repack.store.open_object`: one per folder of sources).
Errors read alike: a missing file or object is a :class:`~repack.errors.SourceMissing`
naming it; a changed one a :class:`~repack.errors.SourceError`; what a server refuses
(credentials, a network failure) is the store's :class:`~repack.errors.StoreError`.
"""

from __future__ import annotations

import functools
import os
import stat as stat_module
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from repack.errors import (
    ObjectChanged,
    ObjectMissing,
    ShortRead,
    SourceError,
    SourceMissing,
    UnsupportedLocation,
)
from repack.store import Stat, Store, is_url, open_object
from repack.store.ahead import READERS, ordered
from repack.store.base import Handle
from repack.store.local import LocalFile

T = TypeVar("T")

__all__ = [
    "PIECE",
    "SegmentReader",
    "bin_jobs",
    "fetch_index",
    "file_identity",
    "index_bytes",
    "open_bin",
    "open_idx",
    "read_bin",
    "read_each",
    "read_index",
]

#: Bytes per ranged GET of a source ``.bin``.
PIECE = 8 * 1024 * 1024
#: No limit on the size of an ``.idx`` read whole (a local one is read whole too).
_NO_LIMIT = 1 << 62
#: Bytes of ``.idx`` files a process keeps once read, for reading them again
#: (:func:`fetch_index`); one larger than an eighth of this is not kept.
KEEP_BYTES = 256 * 1024 * 1024

_kept: OrderedDict[str, bytes] = OrderedDict()
_kept_bytes = 0
_kept_lock = threading.Lock()


def _open_local(path: str, what: str):
    # O_NONBLOCK: opening a FIFO named like a source must fail here, not wait for a writer
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SourceMissing(f"{path}: {what} file not found", path=path) from None
    except IsADirectoryError:
        raise SourceMissing(
            f"{path}: is a directory, expected the {what} file", path=path
        ) from None
    except OSError as err:
        raise SourceMissing(f"{path}: cannot read {what} file: {err.strerror}", path=path) from None
    mode = os.fstat(fd).st_mode
    if not stat_module.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat_module.S_ISDIR(mode) else "not a regular file"
        raise SourceMissing(f"{path}: is {kind}, expected the {what} file", path=path)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_index(prefix: str, known=None) -> tuple[bytes, Stat | None]:
    """The bytes of the source's ``.idx`` and the size (and, on object storage, the ETag) of
    its ``.bin``; None for the latter when ``known`` (the source's facts as validated) is
    given and the source is on object storage: the ``.bin`` is not asked again, its reads
    being pinned to that ETag (:func:`fetch_index`, which may also answer from the bytes
    this process kept). A local ``.bin`` is looked at again: with ``known``, checked to
    still have its validated size (a SourceError says it changed).

    Raises:
        SourceMissing: either file is not there or not a regular file.
        StoreError: a source on object storage, and the server refused or failed.
    """
    if is_url(prefix):
        return fetch_index(prefix, stat=known is None)
    if known is not None:
        open_bin(known).close()  # names a .bin changed since it was validated as such
    with _open_local(prefix + ".idx", ".idx") as stream:
        data = stream.read()
    if known is not None:
        return data, Stat(known.bin_size, None)
    with _open_local(prefix + ".bin", ".bin") as stream:
        return data, Stat(os.fstat(stream.fileno()).st_size, None)


def index_bytes(info) -> bytes:
    """The bytes of the validated source's ``.idx``, read again (the caller checks them
    against the checksum validated).

    Raises:
        SourceError: the file is gone or cannot be read.
    """
    if is_url(info.path):
        return fetch_index(info.path, stat=False)[0]
    try:
        with open(info.path + ".idx", "rb") as stream:
            return stream.read()
    except OSError as err:
        raise SourceError(f"{info.path}.idx: cannot read: {err.strerror}") from None


def open_idx(info) -> Handle:
    """A read handle of the validated source's ``.idx`` (``info``: its facts), for a part
    of it (a local file's size is its own, an object's the one validated).

    Raises:
        SourceError: a local file that cannot be read; an object's reads raise StoreError.
    """
    if is_url(info.path):
        store, name = _object(info.path)
        return store.open(name + ".idx", info.idx_size)
    path = info.path + ".idx"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise SourceError(f"{path}: cannot read: {err.strerror}") from None
    return LocalFile(fd, path, os.fstat(fd).st_size)


def open_bin(info, changed: str = "during the merge") -> Handle:
    """A read handle of the validated source's ``.bin`` (``info``: its facts; ``changed``:
    when, for the message that says it changed).

    Raises:
        SourceError: a local file that is gone or has changed size; an object's reads raise
            it when the object changed or vanished.
    """
    if is_url(info.path):
        store, name = _object(info.path)
        etag = getattr(info, "bin_etag", None)  # (a manifest's source records none)
        return _PinnedBin(store.open(name + ".bin", info.bin_size, etag), info)
    path = info.path + ".bin"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise SourceError(f"{path}: cannot read .bin file: {err.strerror}") from None
    size = os.fstat(fd).st_size
    if size != info.bin_size:
        os.close(fd)
        raise SourceError(
            f"{path}: changed {changed}: {size} bytes, validated with {info.bin_size}"
        )
    return LocalFile(fd, path, size)


class _PinnedBin(Handle):
    """An object's read handle whose failures name the source: changed, gone or shorter
    since it was validated."""

    def __init__(self, handle: Handle, info) -> None:
        self._handle, self._info = handle, info
        self.size, self.path = handle.size, handle.path

    def _failed(self, err: Exception) -> SourceError:
        url = self.path
        if isinstance(err, ObjectChanged):
            why = "changed during the merge (replaced on the server since it was validated)"
        elif isinstance(err, ObjectMissing):
            why = "gone since it was validated"
        else:
            why = f"shorter than the {self._info.bin_size} bytes it had when validated"
        return SourceError(f"{url}: {why}", location=url)

    def read(self, offset: int, size: int) -> bytes:
        try:
            return self._handle.read(offset, size)
        except (ObjectChanged, ObjectMissing, ShortRead) as err:
            raise self._failed(err) from None

    def scan(self, offset: int, size: int) -> Iterator[memoryview]:
        try:
            yield from self._handle.scan(offset, size)
        except (ObjectChanged, ObjectMissing, ShortRead) as err:
            raise self._failed(err) from None

    def close(self) -> None:
        self._handle.close()


def file_identity(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the local file ``path``, which names it however it is spelled;
    None for an object (named by its URL) or a file that cannot be looked at."""
    if is_url(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _object(prefix: str) -> tuple[Store, str]:
    try:
        return open_object(prefix)
    except UnsupportedLocation as err:
        # a bad source among others: reported with them
        raise SourceMissing(str(err), location=prefix) from None


def _missing(url: str, what: str, err: ObjectMissing) -> SourceMissing:
    cause = err.cause
    extra = "" if cause == "not found" else f" ({cause})"
    return SourceMissing(f"{url}: {what} file not found{extra}", location=url)


def _remember(prefix: str, data: bytes) -> None:
    global _kept_bytes
    with _kept_lock:
        old = _kept.pop(prefix, None)  # a fresh read replaces what was kept
        _kept_bytes -= len(old) if old is not None else 0
        if len(data) > KEEP_BYTES // 8:
            return
        _kept[prefix] = data
        _kept_bytes += len(data)
        while _kept_bytes > KEEP_BYTES:
            _, dropped = _kept.popitem(last=False)
            _kept_bytes -= len(dropped)


def _recall(prefix: str) -> bytes | None:
    with _kept_lock:
        return _kept.get(prefix)


def _forget_after_fork() -> None:
    global _kept_lock, _kept_bytes
    _kept.clear()
    _kept_bytes = 0
    _kept_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def fetch_index(prefix: str, *, stat: bool = True) -> tuple[bytes, Stat | None]:
    """The bytes of the source's ``.idx`` (one GET) and the size and ETag of its ``.bin``
    (one HEAD; with ``stat=False`` none, and None).

    With ``stat=False`` (a source read again, its facts known) the bytes this process read
    of it before are used if it still keeps them (the last ``KEEP_BYTES`` of ``.idx`` bytes
    read): a merge then reads a small source's ``.idx`` once, not for its validation, its
    index entries and its fingerprints each. The caller checks them against the checksum
    validated, and the ``.bin`` reads are pinned to the ETag validated, so what is written
    is the version validated.

    Raises:
        SourceMissing: either object is not there (or the URL names no object).
        StoreError: the server refused or could not be reached.
    """
    if not stat:
        kept = _recall(prefix)
        if kept is not None:
            return kept, None
    store, name = _object(prefix)
    idx = store.url(name + ".idx")
    try:
        data, _ = store.get(name + ".idx", _NO_LIMIT)
    except ObjectMissing as err:
        raise _missing(idx, ".idx", err) from None
    _remember(prefix, data)
    if not stat:
        return data, None
    found = store.stat(name + ".bin")
    if found is None:
        url = store.url(name + ".bin")
        raise SourceMissing(f"{url}: .bin file not found", location=url)
    return data, found


def read_bin(info, offset: int, size: int) -> bytes:
    """Bytes ``[offset, offset + size)`` of the source's ``.bin``: one ranged GET, pinned to
    the ETag seen when it was validated.

    Raises:
        SourceError: the object changed or vanished since.
    """
    store, name = _object(info.path)
    url = store.url(name + ".bin")
    try:
        return store.read(name + ".bin", offset, size, getattr(info, "bin_etag", None))
    except ObjectChanged:
        raise SourceError(
            f"{url}: changed during the merge (replaced on the server since it was validated)",
            location=url,
        ) from None
    except ObjectMissing:
        raise SourceError(f"{url}: gone since it was validated", location=url) from None
    except ShortRead:
        raise SourceError(
            f"{url}: shorter than the {info.bin_size} bytes it had when validated",
            location=url,
        ) from None


def bin_jobs(info, offset: int, size: int, piece: int | None = None):
    """The ranged reads of bytes ``[offset, offset + size)`` of the source's ``.bin``, as
    :func:`~repack.store.ahead.ordered` takes them: ``(bytes, function)`` per piece of
    ``piece`` bytes (default ``PIECE``)."""
    piece = piece or PIECE
    for start in range(offset, offset + size, piece):
        n = min(piece, offset + size - start)
        yield n, functools.partial(read_bin, info, start, n)


def _or_error(function: Callable[[str], T], path: str) -> T | SourceError:
    try:
        return function(path)
    except SourceError as err:
        return err


def read_each(function: Callable[[str], T], paths: Sequence[str]) -> Iterator[T | SourceError]:
    """``function(path)`` of each source prefix of ``paths`` (reading it, such as
    :func:`~repack.inputs.sources.read_source_index`), or the SourceError it raised, in order.
    Local sources are read one after the other; while some are on object storage, the next
    ones are read meanwhile by the process's pool of threads (a blend of thousands of small
    sources does not wait a round trip per source).

    Raises:
        StoreError: the server of a source refused (credentials) or could not be reached.
    """
    if not any(is_url(path) for path in paths):
        return (_or_error(function, path) for path in paths)
    jobs = ((0, functools.partial(_or_error, function, path)) for path in paths)
    return ordered(jobs, requests=READERS)


class SegmentReader:
    """The sources of a shard's segments, in the order a copy takes them, each as a read
    handle (:meth:`handle`) and, with fingerprints, its document hasher (:meth:`documents`).

    A local segment is read when its turn comes (its descriptor; the kernel reads ahead).
    The requests of the segments on object storage are queued in order — the hasher's
    ``.idx`` when fingerprints are computed, then the segment's bytes in ``PIECE`` ranges
    pinned to the ETag seen at validation — and the next ones run while the copy hashes and
    writes the current one (:func:`repack.store.ahead.ordered`: a bounded number of requests
    and bytes in flight, so memory does not grow with the shard). Fetched one after the
    other, the many small segments of a shard of small sources on S3 would each wait a round
    trip.

    Args:
        sources: The facts of every source (``prepared.sources``), by number.
        segments: The shard's segments, in the order the copy takes them.
        documents: ``documents(seg)`` makes the fingerprint hasher of a segment (it reads the
            source's ``.idx``), or None without fingerprints.
        deferred: ``deferred(seg)`` makes it for a local segment, where it is made later
            (in the hashing thread: :class:`~repack.merge.shards.DeferredDocuments`).
    """

    def __init__(
        self,
        sources: Sequence,
        segments: Sequence,
        documents: Callable | None = None,
        deferred: Callable | None = None,
    ) -> None:
        self._sources = sources
        remote = [s for s in segments if is_url(sources[s.source].path)]
        self._remote = {(s.source, s.first_sequence) for s in remote}
        self._documents = documents
        self._deferred = deferred or documents
        self._results = ordered(self._jobs(remote)) if remote else iter(())

    def _jobs(self, remote: Sequence):
        for seg in remote:
            if self._documents is not None:
                yield 0, functools.partial(self._documents, seg)
            yield from bin_jobs(self._sources[seg.source], seg.source_offset, seg.size)

    def documents(self, seg):
        """The fingerprint hasher of ``seg`` (the next segment)."""
        if (seg.source, seg.first_sequence) in self._remote:
            return next(self._results)
        return self._deferred(seg)

    def handle(self, seg) -> Handle:
        """A read handle of the source of ``seg`` (the next segment) that serves its bytes;
        the caller closes it."""
        if (seg.source, seg.first_sequence) in self._remote:
            return _Fetched(self._results, seg, self._sources[seg.source])
        return open_bin(self._sources[seg.source])

    def close(self) -> None:
        """Stop fetching (the copy ended, or failed)."""
        close = getattr(self._results, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Fetched(Handle):
    """The bytes of one segment on object storage, as a :class:`SegmentReader` fetched them
    ahead: one scan of the segment, in order."""

    def __init__(self, results: Iterator, seg, info) -> None:
        self._results, self._seg = results, seg
        self.size, self.path = info.bin_size, info.path + ".bin"

    def read(self, offset: int, size: int) -> bytes:
        return b"".join(bytes(view) for view in self.scan(offset, size))

    def scan(self, offset: int, size: int) -> Iterator[memoryview]:
        seg = self._seg
        if (offset, size) != (seg.source_offset, seg.size):
            raise ValueError(f"{self.path}: read ahead as [{seg.source_offset}, +{seg.size})")
        remaining = size
        while remaining > 0:
            data = next(self._results)  # (bytes, which stay valid)
            remaining -= len(data)
            yield data

    def close(self) -> None:
        return None
