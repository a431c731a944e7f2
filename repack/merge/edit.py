"""One edit of a complete repack (``repack add``, ``remove``, ``fingerprint``), on any store.

Every edit runs the same steps; the commands supply only what they build:

1. **one writer**: the exclusive lock of a local folder, or the lease on object storage
   (:func:`~repack.merge.lease.one_writer`); the manifest's version is noted, then the repack
   opened;
2. **clean**: what an interrupted edit left (its work folder, temp files, files the manifest
   does not name) is removed (:func:`~repack.merge.workdir.remove_leftovers`);
3. **build**: new files under names the manifest does not use (new shards, ``index-N.rpx``,
   ``fingerprints-N.rpf``);
4. **commit**: the manifest replaced on condition that it is still the version noted
   (``If-Match``; a local folder checks the same under its lock): a reader sees the old repack
   or the new one, and a writer that finds it replaced commits nothing;
5. **delete** what only the old manifest named (removed bytes leave the folder or bucket),
   then the work folder.

A process that opened the old repack keeps reading it: locally through the descriptors and
mappings it holds, which stay valid after the unlink; on object storage from its node-local
copy of the index and its pinned reads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from repack import format as fmt
from repack.errors import ObjectChanged
from repack.manifest import Manifest, dump_manifest
from repack.merge.commit import named_files
from repack.merge.lease import LEASE_KEY, one_writer
from repack.merge.workdir import WORK_DIR, remove_leftovers
from repack.reader import Repack
from repack.store import Stat, Store, open_store

__all__ = ["Edit", "edit"]


@dataclass
class Edit:
    """An edit at work: the store, the repack as opened, and its manifest's version."""

    store: Store
    repack: Repack
    read: Stat

    @property
    def manifest(self) -> Manifest:
        return self.repack.manifest

    def clean(self) -> bool:
        """Remove what an interrupted edit left; whether anything was."""
        return remove_leftovers(self.store, named_files(self.manifest) | {LEASE_KEY})

    def commit(self, updated: Manifest, refused: str) -> None:
        """Replace the manifest by ``updated`` if it is still the version read, then delete
        the files only the old one named, then the work folder.

        Raises:
            ObjectChanged: another writer replaced the manifest meanwhile; ``refused`` (after
                "replaced by another writer ") says what did not happen.
        """
        store, old = self.store, self.manifest
        data = dump_manifest(updated.to_json(), updated.algorithm)
        self.repack.close()
        try:
            store.replace(fmt.MANIFEST_FILE, data, self.read.etag)
        except ObjectChanged:
            raise ObjectChanged(
                f"{store.url(fmt.MANIFEST_FILE)}: replaced by another writer {refused}",
                location=store.url(fmt.MANIFEST_FILE),
            ) from None
        for name in sorted(named_files(old) - named_files(updated)):
            store.delete(name)
        store.delete_prefix(WORK_DIR + "/", keep=frozenset({LEASE_KEY}))


@contextlib.contextmanager
def edit(out: str | os.PathLike | Store, *, backend: str | None = None) -> Iterator[Edit]:
    """Hold the one writer's place on the repack ``out`` and open it, for the ``with`` block.

    Raises:
        WriterBusy: another writer holds the lock or the lease.
        InputError: ``out`` is not a repack (a FormatError or a missing manifest says why).
    """
    store = open_store(out)
    if store.stat(fmt.MANIFEST_FILE) is None:
        Repack(store.location)  # says why this is not a repack
    with one_writer(store):
        read = store.stat(fmt.MANIFEST_FILE)
        if read is None:
            Repack(store.location)  # gone meanwhile: says so
        repack = Repack(store.location, **({"backend": backend} if backend else {}))
        try:
            yield Edit(store, repack, read)
        finally:
            repack.close()
