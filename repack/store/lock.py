"""One writer at a time: the lock that ``merge``, ``add`` and ``remove`` take on their output.

The lock is ``flock(2)`` on the file ``OUT/.lock``, which also holds a small JSON record of
who holds it (pid, host, command line, start time) for the message a refused writer prints:

* ``add``, ``remove``, a plain ``merge`` and a merge's plan and finalize steps take it
  **exclusive**;
* the tasks of one merge (``merge OUT --task I --tasks N``, a SLURM array, ``--resume``'s
  copies) take it **shared**: they run at the same time by design and are one writer, and
  each records itself in ``OUT/.work/writers/``;
* a second writer is refused at once (:class:`~repack.errors.WriterBusy`), never queued;
* the copy workers of ``--workers K`` keep a duplicate of their parent's descriptor
  (:func:`held_descriptor`): the lock is held until the last of them is gone, even when the
  parent was killed first.

The system releases a ``flock`` when its process ends, however it ends (SIGKILL included), so
a lock left by a killed process is free: the next writer takes it over, and the record it
finds (that of a process that is gone) is logged as taken over (a ``note:`` line of the
command line, which ``--quiet`` silences). The exclusive holder removes
``.lock`` when it is done; every taker checks after locking that the file it locked is still
the one at ``OUT/.lock``, so removing it is safe.

Where ``flock`` is not supported (Lustre mounted ``noflock``, some FUSE file systems) the
record alone decides, best effort: a record of a live process on this host, or of any
process on another host, refuses; a record of a process gone from this host is taken over.
docs/operations.md says what holds on which shared file system.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from repack.errors import WriterBusy
from repack.fileio import atomic_write
from repack.units import plural

__all__ = ["LOCK_FILE", "Holder", "WriterLock", "held_descriptor", "writer_lock"]

#: The lock file in the output folder.
LOCK_FILE = ".lock"

#: Seconds a writer waits for the lock held by copy workers of a writer that was killed (they
#: end by themselves once started, a few seconds at most) before it says the folder is busy.
ORPHAN_WAIT = 15.0
#: Folder of ``OUT/.work`` where each task of a merge records itself while it runs.
WRITERS_DIR = "writers"
#: flock errors meaning "this file system does not do flock", not "someone holds it".
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
_MAX_RECORD = 64 * 1024

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) the lock."""

    pid: int
    host: str
    command: str
    #: Start time, seconds since the epoch.
    since: float

    @classmethod
    def me(cls, command: str | None = None) -> Holder:
        """This process, running ``command`` (default: this process's command line)."""
        if command is None:
            argv = [os.path.basename(sys.argv[0]) or "python", *sys.argv[1:]]
            command = shlex.join(argv)
        return cls(os.getpid(), socket.gethostname(), command, time.time())

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        """A record as written by :meth:`to_bytes`; None when empty or unreadable."""
        try:
            raw = json.loads(data)
            return cls(int(raw["pid"]), str(raw["host"]), str(raw["command"]), float(raw["since"]))
        except (ValueError, KeyError, TypeError, RecursionError):
            return None

    def to_bytes(self) -> bytes:
        """The record, as JSON."""
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()

    def alive(self) -> bool | None:
        """Whether the process still runs: True/False on this host, None for another host."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # exists, owned by another user
        return True

    def describe(self) -> str:
        """``pid 12 on host-a ('repack add out b.json', since 2026-12-01 10:40:03 UTC)``."""
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"pid {self.pid} on {self.host} ({self.command!r}, since {since})"


class WriterLock:
    """The lock of one writer on one output folder; use :func:`writer_lock`."""

    def __init__(self, out: str, shared: bool, holder: Holder) -> None:
        self.out = out
        self.path = os.path.join(out, LOCK_FILE)
        self.shared = shared
        self.holder = holder
        #: The record of a writer that was gone when this lock was taken, if any.
        self.previous: Holder | None = None
        #: False where the file system refused flock and the record alone is the lock.
        self.flock = True
        self._fd: int | None = None
        self._record: str | None = None

    # --- taking -------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lock, or raise :class:`~repack.errors.WriterBusy` naming the holder."""
        mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
        orphans_gone_by = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                found = Holder.parse(os.pread(fd, _MAX_RECORD, 0))
                os.close(fd)
                if found is not None and found.alive() is False:
                    # held by nobody alive on record: copy workers of a killed writer, which
                    # share its lock and end within a second or two (the kernel kills them
                    # with their parent once they have started); wait for them a while
                    now = time.monotonic()
                    if orphans_gone_by is None:
                        orphans_gone_by = now + ORPHAN_WAIT
                    if now < orphans_gone_by:
                        time.sleep(0.1)
                        continue
                raise self._busy(found) from None
            except OSError as err:
                if err.errno not in _UNSUPPORTED:
                    os.close(fd)
                    raise
                self.flock = False
                self._fd = fd
                self._acquire_by_record()
                return
            # the holder before us may have removed the file between our open and our flock
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        found = Holder.parse(os.pread(fd, _MAX_RECORD, 0))
        if not self.shared:
            self._note_taken_over(found)
            self._write_record()
        else:
            self._record_task()

    def _acquire_by_record(self) -> None:
        found = Holder.parse(os.pread(self._fd, _MAX_RECORD, 0))
        if found is not None and found.pid != os.getpid() and found.alive() is not False:
            os.close(self._fd)
            self._fd = None
            raise self._busy(found, flock=False)
        if self.shared:
            return  # tasks are coordinated by the plan and receipts; nothing to record
        self._note_taken_over(found)
        self._write_record()

    def _note_taken_over(self, found: Holder | None) -> None:
        if found is not None and found.pid != os.getpid():
            self.previous = found
            logger.warning(
                "%s: taking over the lock of %s, which is no longer running",
                self.out,
                found.describe(),
            )

    def _write_record(self) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, self.holder.to_bytes(), 0)

    def _record_task(self) -> None:
        work = os.path.join(self.out, ".work")
        if not os.path.isdir(work):
            return
        folder = os.path.join(work, WRITERS_DIR)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{self.holder.host}-{self.holder.pid}.json")
        atomic_write(path, self.holder.to_bytes())  # never seen half-written
        self._record = path

    def _busy(self, found: Holder | None, flock: bool = True) -> WriterBusy:
        holders = (found,) if found is not None and found.alive() is not False else ()
        if not holders:
            holders = tuple(self._running_tasks())
        if holders:
            who = holders[0].describe()
            if len(holders) > 1:
                who += f" and {plural(len(holders) - 1, 'more task')} of the same merge"
        elif found is not None and flock:
            # the lock is held, by nobody alive on record: the copy workers of a killed
            # merge, which share its lock (held_descriptor) and end within a second or two
            who = f"worker processes of {found.describe()}, which is no longer running"
        else:
            who = "another repack process (it left no record)"
        advice = "wait for it to finish, or stop it, then run this command again"
        if not flock:
            advice += (
                f"; this file system does not support flock: if that process is gone, "
                f"remove {self.path}"
            )
        message = f"{self.out}: another repack command is writing here: {who}; {advice}"
        return WriterBusy(message, holders)

    def _running_tasks(self) -> Iterator[Holder]:
        folder = os.path.join(self.out, ".work", WRITERS_DIR)
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            return
        for name in names:
            try:
                with open(os.path.join(folder, name), "rb") as stream:
                    found = Holder.parse(stream.read(_MAX_RECORD))
            except OSError:
                continue
            if found is not None and found.alive() is not False:
                yield found

    # --- releasing ----------------------------------------------------------------------

    def release(self) -> None:
        """Release the lock; the last holder removes the lock file."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._record is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._record)
            if self.flock and self.shared:
                try:  # still held by other tasks? then the file stays
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return
            if self.shared and not self.flock:
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        finally:
            os.close(fd)


_HELD: dict[str, list] = {}


def _forget_after_fork() -> None:
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def held_descriptor(out: str | os.PathLike) -> int | None:
    """The descriptor of the ``flock`` this process holds on ``out``, if it holds one.

    A process that writes in ``out`` on this one's behalf (a copy worker) keeps a duplicate
    of it: a ``flock`` belongs to the open file, so the lock then stays held until the last
    of them ends, and a writer that comes next (a rerun after a kill, its finalize removing
    temp files) cannot start while a worker of the killed run still writes.
    """
    held = _HELD.get(os.path.realpath(out))
    if held is None or not held[0].flock:
        return None
    return held[0]._fd


@contextlib.contextmanager
def writer_lock(
    out: str | os.PathLike, *, shared: bool = False, command: str | None = None
) -> Iterator[WriterLock]:
    """Hold the writer lock of the existing folder ``out`` for the ``with`` block.

    Re-entrant within a process: a step that runs inside another (a merge's tasks inside
    :func:`~repack.merge.merge`) shares its lock.

    Args:
        out: The output folder; it must exist.
        shared: Take it shared, as the tasks of one merge do; else exclusive.
        command: The command line recorded for others to see; default this process's.

    Raises:
        WriterBusy: another writer holds it.
    """
    key = os.path.realpath(out)
    held = _HELD.get(key)
    if held is not None:
        lock, count = held
        if lock.shared and not shared:
            raise RuntimeError(f"{out}: exclusive lock asked for inside a shared one")
        held[1] = count + 1
        try:
            yield lock
        finally:
            held[1] -= 1
        return
    lock = WriterLock(os.fspath(out), shared, Holder.me(command))
    lock.acquire()
    _HELD[key] = [lock, 1]
    try:
        yield lock
    finally:
        del _HELD[key]
        lock.release()
