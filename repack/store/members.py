"""A file of a repack on object storage that a reader needs whole as a local file (the
fingerprint file), fetched once per node into the node-local cache folder of the repack's
version, next to its index (:func:`repack.store.objects.cached_copy`: under a file lock,
checked against the checksum the manifest records)."""

from __future__ import annotations

from repack.store import open_store
from repack.store.objects import cache_folder, cached_copy

__all__ = ["cached_member"]


def cached_member(location: str, manifest, name: str, size: int, checksum: str) -> str:
    """The local folder holding a checked copy of the file ``name`` of the repack at
    ``location`` (a URL) whose manifest is ``manifest``.

    Raises:
        ChecksumMismatch: the object is not what the manifest says.
        StoreError: it cannot be fetched (ObjectMissing: it is not there).
    """
    store = open_store(location)
    folder = cache_folder(store.location, manifest.checksum)
    cached_copy(store, name, size, checksum, manifest.algorithm, folder)
    return folder
