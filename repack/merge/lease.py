"""One writer at a time on a repack in object storage, where there is no ``flock``: the
lease object ``KEY/.work/writer.json``, the object-storage form of ``OUT/.lock``
(:mod:`repack.store.lock`), taken by ``repack add`` and ``repack remove`` on a bucket.

It holds the same record as the lock file (pid, host, command line, start time), is made by
conditional create (``If-None-Match: *``: of two writers one gets it) and deleted when the
writer is done. A lease left by a process gone from this host is taken over by a conditional
replace (of two takers one wins); one from another host never is, since there is no telling
whether that process still runs: the message names the object to delete if it is gone.
A lease that holds this very writer's record is its own (a create applied whose reply was
lost, refused when retried).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from repack.errors import ObjectChanged, ObjectExists, ObjectMissing, WriterBusy
from repack.merge.workdir import WORK_DIR
from repack.store import Store
from repack.store.lock import Holder

__all__ = ["LEASE_KEY", "one_writer", "release_lease", "take_lease"]

logger = logging.getLogger(__name__)

#: The lease of the writer at work on a repack in object storage (``add``): created by
#: conditional create, removed when done; the object-storage form of ``OUT/.lock``.
LEASE_KEY = f"{WORK_DIR}/writer.json"


def take_lease(store: Store, command: str | None = None) -> Holder:
    """Become the one writer of the repack in ``store``, or raise WriterBusy naming the one at
    work. A lease left by a process gone from this host is taken over (by a conditional
    replace: of two takers, one wins); one of another host is never, as there is no telling
    whether it still runs: the message says which object to delete if it is gone."""
    me = Holder.me(command)
    try:
        store.create(LEASE_KEY, me.to_bytes())
        return me
    except ObjectExists:
        pass
    try:
        data, stat = store.get(LEASE_KEY, 64 * 1024)
    except ObjectMissing:  # released meanwhile: try once more
        try:
            store.create(LEASE_KEY, me.to_bytes())
            return me
        except ObjectExists:
            data, stat = store.get(LEASE_KEY, 64 * 1024)
    if data == me.to_bytes():
        # ours: the create was applied, its reply lost, and its retry refused by the lease it
        # had made (the store recognises that too, where it can tell the reply was lost)
        return me
    found = Holder.parse(data)
    if found is not None and found.alive() is False:
        try:
            store.replace(LEASE_KEY, me.to_bytes(), stat.etag)
        except ObjectChanged:
            pass  # another taker was faster
        else:
            logger.warning(
                "%s: taking over the lease of %s, which is no longer running",
                store.location,
                found.describe(),
            )
            return me
        found = Holder.parse(store.get(LEASE_KEY, 64 * 1024)[0])
    who = found.describe() if found is not None else "another repack process"
    raise WriterBusy(
        f"{store.location}: another repack command is writing here: {who}; wait for it to "
        f"finish, or stop it, then run this command again (if that process is gone, delete "
        f"{store.url(LEASE_KEY)})",
        (found,) if found is not None else (),
    )


def release_lease(store: Store) -> None:
    """Give the lease up (delete it)."""
    store.delete(LEASE_KEY)


@contextlib.contextmanager
def one_writer(store: Store) -> Iterator[None]:
    """Be the one writer of the repack in ``store`` for the ``with`` block: its exclusive
    lock where the store has one that keeps others out (a local folder's ``flock``), else
    the lease."""
    if store.exclusive_lock:
        with store.lock():
            yield
        return
    take_lease(store)
    try:
        yield
    finally:
        release_lease(store)
