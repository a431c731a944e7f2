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
5. **supersede** what only the old manifest named: in a folder only this machine mounts it is
   deleted at once; on object storage and on a folder other machines mount (NFS, Lustre,
   FUSE...: :meth:`~repack.store.Store.superseded_grace` decides, or ``keep`` given) it is
   kept, recorded as a superseded generation (:mod:`repack.store.generations`), and deleted
   by the first edit after the grace period (``keep``), by :func:`gc`, or at once with
   ``now``; then the work folder goes.

New files never take a name the manifest or a record holds (:attr:`Edit.taken`): on NFS a
rename over a name deletes the old file for every other client.

A process that opened the old repack keeps reading it: on a local folder through the
descriptors and mappings it holds, which stay valid after the unlink; on a shared folder
through the files kept; on object storage from its node-local copy of the index and its
pinned reads of the objects kept. Only ``now`` (a take-down) and :func:`gc` break it (on
object storage the reader's error then names the edit).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from repack.errors import ObjectChanged, ObjectMissing
from repack.format import spec as fmt
from repack.format.manifest import Manifest, dump_manifest, parse_manifest
from repack.merge.commit import named_files, named_sizes
from repack.merge.lease import LEASE_KEY, one_writer
from repack.merge.workdir import WORK_DIR, remove_leftovers
from repack.read.reader import Repack
from repack.store import Stat, Store, open_store
from repack.store.generations import KEEP_SUPERSEDED, Generation, generations

__all__ = ["Collected", "Edit", "edit", "gc"]

logger = logging.getLogger(__name__)


@dataclass
class Collected:
    """What an edit or :func:`gc` did with superseded objects."""

    #: The generation this edit superseded and kept for the readers of the old repack (None:
    #: nothing kept, a folder's edit or ``now``).
    kept: Generation | None = None
    #: Generations whose objects were deleted now.
    deleted: list[Generation] = field(default_factory=list)
    #: Generations still kept (this edit's included), and the seconds they are kept for.
    pending: list[Generation] = field(default_factory=list)
    keep: float = KEEP_SUPERSEDED
    #: Records that could not be read (left alone).
    damaged: list[str] = field(default_factory=list)

    @property
    def deleted_bytes(self) -> int:
        return sum(g.size for g in self.deleted)

    def to_json(self) -> dict:
        def listed(found: Iterable[Generation]) -> list[dict]:
            return [
                {"edit": g.edit, "at": g.at, "objects": sorted(g.objects), "bytes": g.size}
                for g in found
            ]

        return {
            "kept": listed([self.kept] if self.kept else []),
            "deleted": listed(self.deleted),
            "pending": listed(self.pending),
            "keep_seconds": self.keep,
            "damaged_records": self.damaged,
        }


@dataclass
class Edit:
    """An edit at work: the store, the repack as opened, and its manifest's version."""

    store: Store
    repack: Repack
    read: Stat
    #: ``--keep-superseded``: keep what this edit supersedes this many seconds (None: not
    #: given, the store decides, :meth:`~repack.store.Store.superseded_grace`); ``now``:
    #: delete it, and every generation kept before, at once.
    keep: float | None = None
    now: bool = False
    #: What :meth:`commit` did with superseded objects.
    collected: Collected | None = None

    @property
    def manifest(self) -> Manifest:
        return self.repack.manifest

    @functools.cached_property
    def taken(self) -> frozenset[str]:
        """The names a new file of this edit must not take: those the manifest names and
        those every superseded generation recorded (kept, or deleted: a reader holding one
        must never find another file under its name; on NFS a rename over a name deletes its
        file for every other client). Asked after :meth:`clean`."""
        recorded = {name for g in generations(self.store)[0] for name in g.objects}
        return frozenset(named_files(self.manifest) | recorded)

    def clean(self) -> bool:
        """Remove what an interrupted edit left; whether anything was."""
        return remove_leftovers(
            self.store, named_files(self.manifest) | {LEASE_KEY} | kept(self.store)
        )

    def commit(self, updated: Manifest, refused: str, command: str) -> Collected:
        """Replace the manifest by ``updated`` if it is still the version read; then deal
        with the files only the old one named (deleted in a folder, kept as a superseded
        generation on object storage, see the module), and delete the work folder.

        Raises:
            ObjectChanged: another writer replaced the manifest meanwhile; ``refused`` (after
                "replaced by another writer ") says what did not happen.
        """
        store, old = self.store, self.manifest
        data = dump_manifest(updated.to_json(), updated.algorithm)
        self.repack.close()
        gone = sorted(named_files(old) - named_files(updated))
        reused = sorted(named_files(updated) & self.taken - named_files(old))
        if reused:  # (a bug of the edit's naming, never a user's doing)
            raise RuntimeError(f"{store.location}: new files reuse superseded names {reused}")
        grace = store.superseded_grace(0.0 if self.now else self.keep)
        record = None
        if gone and grace is not None:
            # recorded before the commit: a kill between the two leaves a record of objects
            # the manifest still names, which no collection deletes (it never deletes those)
            sizes = named_sizes(old)
            record = Generation(
                command, time.time(), old.checksum, {name: sizes[name] for name in gone}
            ).write(store)
        try:
            store.replace(fmt.MANIFEST_FILE, data, self.read.etag)
        except ObjectChanged:
            if record is not None:
                store.delete(record.key)
            raise ObjectChanged(
                f"{store.url(fmt.MANIFEST_FILE)}: replaced by another writer {refused}",
                location=store.url(fmt.MANIFEST_FILE),
            ) from None
        current = parse_manifest(data, store.url(fmt.MANIFEST_FILE))  # its checksum
        by = command + " --now" * self.now
        if record is None:
            for name in gone:
                store.delete(name)
            # generations an earlier edit kept here (given --keep-superseded) go by their age
            keep = 0.0 if self.now else KEEP_SUPERSEDED if self.keep is None else self.keep
            self.collected = collect(store, current, keep, by)
        else:
            self.collected = collect(store, current, grace, by)
            self.collected.kept = None if self.now else record
        store.delete_prefix(WORK_DIR + "/", keep=frozenset({LEASE_KEY}))
        return self.collected


def kept(store: Store) -> set[str]:
    """The objects superseded generations keep (not deleted: not leftovers either)."""
    return {name for g in generations(store)[0] if g.kept for name in g.objects}


def collect(store: Store, current: Manifest, keep: float, by: str) -> Collected:
    """Delete the objects of the superseded generations older than ``keep`` seconds (never
    a file the ``current`` manifest names), each record then kept as a tombstone for as long
    again (a day at least); tombstones older than that go. ``by`` names the edit that
    collects, in the tombstones."""
    done = Collected(keep=keep)
    named = named_files(current)
    found, done.damaged = generations(store)
    now = time.time()
    for generation in found:
        if generation.manifest == current.checksum:
            # recorded by an edit killed before its commit: it superseded nothing
            store.delete(generation.key)
        elif generation.kept and (keep <= 0 or now - generation.at >= keep):
            # (0: every one, also one dated ahead of this host's clock: a take-down)
            for name in sorted(generation.objects):
                if name not in named:
                    with contextlib.suppress(ObjectMissing):
                        store.delete(name)
            generation.deleted(by, now).write(store)
            done.deleted.append(generation)
        elif generation.kept:
            done.pending.append(generation)
        elif now - (generation.deleted_at or 0) >= max(keep, KEEP_SUPERSEDED):
            with contextlib.suppress(ObjectMissing):
                store.delete(generation.key)
    for key in done.damaged:
        logger.warning(
            "%s: not a readable record of superseded objects; left alone", store.url(key)
        )
    return done


@contextlib.contextmanager
def edit(
    out: str | os.PathLike | Store,
    *,
    backend: str | None = None,
    keep: float | None = None,
    now: bool = False,
) -> Iterator[Edit]:
    """Hold the one writer's place on the repack ``out`` and open it, for the ``with`` block.
    ``keep`` and ``now``: what becomes of what the edit supersedes (:class:`Edit`).

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
            yield Edit(store, repack, read, keep, now)
        finally:
            repack.close()


def gc(out: str | os.PathLike | Store, older_than: float = KEEP_SUPERSEDED) -> Collected:
    """Delete the superseded generations of the repack ``out`` older than ``older_than``
    seconds (``0``: all of them; readers that opened the repack before the edits that
    superseded them then fail, naming the edit), and what interrupted edits left. Under the
    one writer's lock or lease, as an edit.

    Raises:
        WriterBusy: another writer holds the lock or the lease.
        InputError: ``out`` is not a repack.
    """
    store = open_store(out)
    if store.stat(fmt.MANIFEST_FILE) is None:
        Repack(store.location)  # says why this is not a repack
    with one_writer(store):
        data, _ = store.get(fmt.MANIFEST_FILE, fmt.MAX_MANIFEST_SIZE)
        manifest = parse_manifest(data, store.url(fmt.MANIFEST_FILE))
        done = collect(store, manifest, older_than, "gc")
        remove_leftovers(store, named_files(manifest) | {LEASE_KEY} | kept(store))
    return done
