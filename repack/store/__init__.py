"""Where the bytes of a repack live: a local folder, ``s3://bucket/key`` or
``msc://profile/path``, behind one small interface.

Every command and the reader turn the location they are given into a :class:`Store` in one
place, :func:`open_store` (the "StoreLike" rule of zarr-python, docs/objstore.md):

* a path without a scheme is a local folder (:class:`LocalStore`);
* ``s3://bucket/key`` is :class:`~repack.store.s3.S3Store` (boto3, the ``s3`` extra);
* ``msc://profile/path`` is :class:`~repack.store.msc.MSCStore` (NVIDIA's
  multi-storage-client, the ``msc`` extra, configured from its own config file);
* any other ``scheme://`` is refused (:class:`~repack.errors.UnsupportedLocation`), never
  taken as a folder name.

A :class:`Store` is what every command is written against, once (docs/objstore.md): small
objects written atomically (``put``) or conditionally (``create`` = ``If-None-Match: *``,
``replace`` = ``If-Match``), streaming writers (``writer``, ``compressing_writer``: bounded
memory, computing nothing themselves, so that the caller hashes the bytes as they pass), read
handles (``open``), files staged locally and published whole (``staged``), listing and
deleting, and the writer lock. Each implementation says in its docstring what it guarantees
and where, and why, it does a step its own way: a local folder writes in place with
``copy_file_range``, renames and ``flock``; object storage streams uploads, commits
conditionally and has no lock.

Whether an edit may delete what it supersedes at once is the store's answer too
(:meth:`Store.superseded_grace`): yes on a folder only this machine mounts, no on object
storage and on a folder other machines mount, which :mod:`repack.store.filesystems` tells from
the mount table (NFS, Lustre, GPFS, CephFS, SMB, FUSE...), unless ``--keep-superseded`` says.
"""

from __future__ import annotations

import os
import threading

from repack.errors import UnsupportedLocation
from repack.store.base import PART_SIZE, Stat, Store, Writer
from repack.store.local import LocalStore, temp_base, temp_name
from repack.store.urls import SCHEMES, is_url, scheme_of

__all__ = [
    "PART_SIZE",
    "LocalStore",
    "Stat",
    "Store",
    "Writer",
    "is_url",
    "local_folder",
    "names_folder",
    "normalize",
    "open_object",
    "open_store",
    "scheme_of",
    "temp_base",
    "temp_name",
]


def open_store(location: str | os.PathLike | Store) -> Store:
    """The :class:`Store` of ``location`` (a Store is returned as is).

    Raises:
        UnsupportedLocation: an unknown scheme (``gs://``, ``file://``, ...).
        MissingExtra: ``s3://`` without boto3, ``msc://`` without multi-storage-client.
    """
    if isinstance(location, Store):
        return location
    scheme = scheme_of(location)
    if scheme is None:
        return LocalStore(location)
    if scheme == "s3":
        from repack.store.s3 import S3Store

        return S3Store(location)
    if scheme == "msc":
        from repack.store.msc import MSCStore

        return MSCStore(location)
    raise UnsupportedLocation(
        f"{location}: unknown scheme {scheme + '://'!r}; repack reads and writes local "
        "folders, s3://BUCKET/KEY and msc://PROFILE/PATH"
    )


def normalize(location: str | os.PathLike) -> str:
    """``location`` as one repack is known by in a process: a URL without a trailing
    ``/``, a path made absolute."""
    if is_url(location):
        return str(location).rstrip("/")
    return os.path.abspath(os.fspath(location))


def names_folder(location: str | os.PathLike) -> bool:
    """Whether ``location`` names a folder-like root (a local directory, or any prefix on
    object storage) rather than a file."""
    return is_url(location) or os.path.isdir(location)


def local_folder(location: str | os.PathLike, what: str) -> str:
    """``location`` as a local path, for what must be one (``what``: how messages name it).

    Raises:
        UnsupportedLocation: ``location`` is a URL (an unknown scheme, or object storage).
        MissingExtra: the URL's client library is missing.
    """
    store = open_store(location)
    if not store.local:
        raise UnsupportedLocation(
            f"{location}: {what} must be a local path (object storage is not supported there)",
            location=store.location,
        )
    return os.fspath(location)


_folders: dict[str, Store] = {}
_folders_lock = threading.Lock()


def _forget_after_fork() -> None:
    global _folders_lock
    _folders.clear()  # an MSC store holds its client, which is made anew in a child
    _folders_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def open_object(url: str) -> tuple[Store, str]:
    """The store of the "folder" of the object (or prefix) ``url`` and its name in it:
    ``s3://bucket/data/web-00001`` is ``(S3Store("s3://bucket/data"), "web-00001")``. The
    stores of the process are shared, one per folder (a blend of thousands of sources in a
    few folders makes a few).

    Raises:
        UnsupportedLocation: an unknown scheme, or no key after the bucket or profile.
        MissingExtra: the URL's client library is missing.
    """
    folder, _, name = url.rpartition("/")
    scheme = scheme_of(url)
    if scheme not in SCHEMES:
        open_store(url)  # says why: a path is no object, an unknown scheme
    if scheme is None or not name or folder.endswith(":/") or folder == f"{scheme}:":
        open_store(url)  # an unknown scheme or a missing extra says so first
        raise UnsupportedLocation(
            f"{url}: not an object; expected {scheme or 's3'}://BUCKET/KEY", location=url
        )
    found = _folders.get(folder)
    if found is None:
        with _folders_lock:
            found = _folders.get(folder)
            if found is None:
                found = _folders[folder] = open_store(folder)
    return found, name
