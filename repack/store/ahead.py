"""Requests in flight ahead of the code that uses their results, which it gets in order.

Reading thousands of small objects one after the other waits a round trip each (sources of
a blend on object storage: their ``.idx`` files, their ``.bin`` segments). :func:`ordered`
runs the requests of an ordered list of jobs in the process's pool of ``READERS`` threads,
at most ``requests`` of them and about ``budget`` bytes at a time, and yields their results
in the jobs' order: memory stays bounded whatever the number of jobs, and the consumer
(hashing, writing) works while the next requests are on the wire.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from repack import interrupt
from repack.store.pool import ThreadsOfProcess

__all__ = ["BUDGET", "READERS", "REQUESTS", "ordered"]

T = TypeVar("T")

#: Threads of the process's pool (requests on the wire at once, all consumers together).
READERS = 16
#: Jobs of one consumer in flight at once, by default.
REQUESTS = 32
#: Bytes of one consumer in flight at once, by default (job sizes as the jobs declare them).
BUDGET = 64 * 1024 * 1024

#: The process's threads for these requests.
_readers = ThreadsOfProcess(READERS, "repack-ahead").get


def ordered(
    jobs: Iterable[tuple[int, Callable[[], T]]],
    *,
    requests: int = REQUESTS,
    budget: int = BUDGET,
) -> Ahead[T]:
    """The result of each job ``(size, function)``, in the order of ``jobs``, with the next
    jobs running meanwhile: at most ``requests`` of them, and no new one while ``budget``
    bytes (their declared ``size``) are in flight, except the next one when none is. The
    first jobs start at once, before the first result is asked for.

    A job that raises raises here, in its turn. Leaving early (``close``, an error) cancels
    the jobs not started; those running finish in the pool and are dropped. Jobs must not
    themselves wait for jobs of the pool (they are single requests).
    """
    return Ahead(jobs, requests, budget)


class Ahead(Iterator[T]):
    """The iterator :func:`ordered` returns."""

    def __init__(self, jobs, requests: int, budget: int) -> None:
        self._pool = _readers()
        self._source = iter(jobs)
        self._requests = max(1, requests)
        self._budget = budget
        self._pending: deque[tuple[int, Future]] = deque()
        self._in_flight = 0
        self._done = False
        self._fill()

    def _fill(self) -> None:
        pending = self._pending
        while (
            not self._done
            and len(pending) < self._requests
            and (not pending or self._in_flight < self._budget)
        ):
            job = next(self._source, None)
            if job is None:
                self._done = True
                return
            size, function = job
            pending.append((size, self._pool.submit(function)))
            self._in_flight += size

    def __next__(self) -> T:
        if not self._pending:
            raise StopIteration
        size, future = self._pending[0]  # counted as in flight until its result is in
        try:
            result = interrupt.result_of(future)
        except BaseException:
            self.close()
            raise
        self._pending.popleft()
        self._in_flight -= size
        self._fill()  # the next ones run while the caller uses this one
        return result

    def close(self) -> None:
        """Cancel the jobs not started; the iterator ends."""
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._done = True

    def __del__(self) -> None:
        self.close()
