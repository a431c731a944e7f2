"""A file of a repack that a reader needs whole as a local file (the fingerprint file): in
a local folder, the file itself; on object storage, fetched once per node into the
node-local cache folder of the repack's version, next to its index
(:func:`repack.store.objects.cached_copy`: under a file lock, checked against the checksum
the manifest records)."""

from __future__ import annotations

from repack.store import is_url, open_store
from repack.store.objects import cache_folder, cached_copy

__all__ = ["cached_member", "member_folder"]


def member_folder(location: str, manifest, member: dict) -> str:
    """The local folder holding the file the manifest ``member`` names (``file``, ``size``,
    ``checksum``) of the repack at ``location``: the folder itself, or on object storage
    its checked copy in the node cache (:func:`cached_member`).

    Raises:
        ChecksumMismatch, StoreError: see :func:`cached_member`.
    """
    if not is_url(location):
        return location
    name, size, checksum = member["file"], int(member["size"]), str(member.get("checksum"))
    return cached_member(location, manifest, name, size, checksum)


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
