"""The files of a source prefix on object storage: ``s3://bucket/data/web-00001`` or
``msc://profile/data/web-00001`` in a blend, as Megatron-LM's main branch accepts them.

The prefix's ``.idx`` is one GET (validation, and again where a merge re-reads it, checked
against the checksum it had when validated) and its ``.bin`` one HEAD: its size, and its
ETag, which every later ranged read of it is pinned to (``If-Match``), so that a source
replaced on the server during a merge fails loudly rather than mixing two versions. The
stores are the process's (:func:`repack.store.open_object`: one per folder of sources).

Errors read like those of local sources: a missing object is a
:class:`~repack.errors.SourceMissing` naming its URL; what the server refuses (credentials,
a network failure) is the store's :class:`~repack.errors.StoreError`, raised at once.
"""

from __future__ import annotations

import functools
import os
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

T = TypeVar("T")

__all__ = [
    "PIECE",
    "bin_chunks",
    "bin_jobs",
    "check_bin",
    "fetch_index",
    "is_remote",
    "read_bin",
    "read_each",
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


def is_remote(path: str) -> bool:
    """Whether the source prefix ``path`` is on object storage (a URL)."""
    return is_url(path)


def _object(prefix: str) -> tuple[Store, str]:
    try:
        return open_object(prefix)
    except UnsupportedLocation as err:
        # a bad source among others: reported with them
        raise SourceMissing(str(err), location=prefix) from None


def _missing(url: str, what: str, err: ObjectMissing) -> SourceMissing:
    cause = str(err).split(": ", 1)[-1]
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


def check_bin(info) -> None:
    """Check that the ``.bin`` of the validated source ``info`` is still the one validated
    (its size, and its ETag when one was recorded).

    Raises:
        SourceError: it changed or vanished.
    """
    store, name = _object(info.path)
    url = store.url(name + ".bin")
    found = store.stat(name + ".bin")
    if found is None:
        raise SourceError(f"{url}: gone since it was validated", location=url)
    if found.size != info.bin_size:
        raise SourceError(
            f"{url}: changed during the merge: {found.size} bytes, validated with {info.bin_size}",
            location=url,
        )
    if info.bin_etag is not None and found.etag != info.bin_etag:
        raise SourceError(
            f"{url}: changed during the merge (replaced on the server since it was validated)",
            location=url,
        )


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


def bin_chunks(info, offset: int, size: int) -> Iterator[bytes]:
    """Bytes ``[offset, offset + size)`` of the source's ``.bin`` in order, ``PIECE`` at a
    time, the next pieces fetched meanwhile."""
    return ordered(bin_jobs(info, offset, size), requests=8)


def _or_error(function: Callable[[str], T], path: str) -> T | SourceError:
    try:
        return function(path)
    except SourceError as err:
        return err


def read_each(function: Callable[[str], T], paths: Sequence[str]) -> Iterator[T | SourceError]:
    """``function(path)`` of each source prefix of ``paths`` (reading it, such as
    :func:`~repack.sources.read_source_index`), or the SourceError it raised, in order.
    Local sources are read one after the other; while some are on object storage, the next
    ones are read meanwhile by the process's pool of threads (a blend of thousands of small
    sources does not wait a round trip per source).

    Raises:
        StoreError: the server of a source refused (credentials) or could not be reached.
    """
    if not any(is_remote(path) for path in paths):
        return (_or_error(function, path) for path in paths)
    jobs = ((0, functools.partial(_or_error, function, path)) for path in paths)
    return ordered(jobs, requests=READERS)
