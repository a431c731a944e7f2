"""The thread pool of a process for object-storage requests, made on first use."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from repack import interrupt

__all__ = ["ThreadsOfProcess"]


class ThreadsOfProcess:
    """A ``ThreadPoolExecutor`` of ``workers`` threads made on first use, one per process: a
    forked child (a DataLoader worker) makes its own, the parent's threads do not exist in
    it. Its threads leave SIGINT and SIGTERM to the main thread (:mod:`repack.interrupt`)."""

    def __init__(self, workers: int, prefix: str) -> None:
        self.workers = workers
        self.prefix = prefix
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        """The pool, made now if this process has none yet."""
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        self.workers,
                        thread_name_prefix=self.prefix,
                        initializer=interrupt.block_in_thread,
                    )
        return self._pool
