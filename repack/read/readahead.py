"""The loader's reads of a repack on object storage: a bounded cache of byte ranges, filled
ahead of the samples that come next.

Training reads samples in an order fixed in advance by Megatron's indices (the blend's
``dataset_index`` / ``dataset_sample_index``, each ``GPTDataset``'s shuffle, sample and
document indices): when a sample is asked for, the byte ranges of the next ones are known.
:class:`ReadAhead` (one per open repack on object storage, per process) uses that:

* **One sample, few requests.** The pieces of a sample (one per document it spans) are
  grouped by shard, and pieces of one shard less than :data:`MERGE_GAP` bytes apart are
  fetched by one exact ranged GET: never more GETs than pieces, often one per source.
* **Read-ahead.** The next :data:`AHEAD_ENV` samples (default 16) are fetched meanwhile by a
  pool of :data:`THREADS` threads, through the process's one S3 client and connection pool,
  so that a sample's latency is hidden behind the ones before it. Which samples come next is
  learnt from the indices asked for in this process (:class:`SampleOrder`): in training
  order, or every N-th batch in a DataLoader worker, it is exact; for indices that follow no
  pattern (a random sampler) nothing is fetched ahead and each sample costs its own GETs.
* **Bounded memory.** Everything held — fetched or in flight — is at most
  :data:`CACHE_ENV` (default ``64MiB``) per open repack per process: to make room, ranges
  read for every piece they were fetched for go first, then the least recently used; a
  read-ahead that finds no room is skipped, a sample larger than the bound is read piece by
  piece as without cache. ``REPACK_READ_CACHE=0`` turns all of this off (one GET per piece,
  in the calling thread).

Every fetch is a ranged GET pinned to the ETag seen when the repack was opened
(:class:`~repack.store.objects.RemoteShard`), retried as every request is
(:mod:`repack.store.retry`); a fetch that fails anyway raises its error for the read it was
for, which does not make the request (and wait for a silent server) once more. Raw shards only:
the frames of a compressed shard are read as before. After ``fork`` (a DataLoader worker)
the child starts with an empty cache and threads of its own.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from repack.errors import InputError, RepackError
from repack.units import parse_size

__all__ = [
    "AHEAD_ENV",
    "CACHE_ENV",
    "MERGE_GAP",
    "THREADS",
    "ReadAhead",
    "ReadStats",
    "SampleOrder",
    "settings",
]

#: Environment variable: bytes held at most per open repack per process (``64MiB``,
#: ``500MB``, ``1048576``; 0: no cache and no read-ahead).
CACHE_ENV = "REPACK_READ_CACHE"
#: Environment variable: samples fetched ahead (0: only the sample asked for).
AHEAD_ENV = "REPACK_READ_AHEAD"
DEFAULT_CACHE = 64 * 1024 * 1024
DEFAULT_AHEAD = 16
#: Pieces of one sample in one shard at most this many bytes apart are fetched by one GET.
MERGE_GAP = 256 * 1024
#: Threads fetching ahead, per process.
THREADS = 8
#: The longest period of the index pattern looked for (a batch of up to this many samples).
MAX_PERIOD = 32

#: A byte range of a shard: (shard number, offset, size).
Range = tuple[int, int, int]


def settings() -> tuple[int, int]:
    """``(bytes held at most, samples fetched ahead)``, from the environment.

    Raises:
        InputError: a variable is not a size (:data:`CACHE_ENV`) or a whole number of 0 or
            more (:data:`AHEAD_ENV`).
    """
    text = os.environ.get(CACHE_ENV, "").strip()
    try:
        limit = parse_size(text) if text else DEFAULT_CACHE
    except ValueError:
        raise InputError(
            f"{CACHE_ENV}={text!r}: expected a size such as 64MiB, 500MB or 1048576 (0: off)"
        ) from None
    text = os.environ.get(AHEAD_ENV, "").strip()
    ahead = int(text) if text.isdigit() else DEFAULT_AHEAD if not text else -1
    if ahead < 0:
        raise InputError(f"{AHEAD_ENV}={text!r}: expected a number of samples, 0 or more")
    return limit, ahead


@dataclass
class ReadStats:
    """What a :class:`ReadAhead` did, in this process."""

    #: Reads served from a fetched (or in-flight) range.
    hits: int = 0
    #: Of those, from a range fetched ahead of its sample.
    ahead_hits: int = 0
    #: Reads that found nothing and were made in the caller's thread.
    misses: int = 0
    #: Ranged GETs sent by the cache, and their bytes.
    requests: int = 0
    bytes: int = 0
    #: Samples whose ranges were asked ahead of them.
    ahead_samples: int = 0
    #: Ranges dropped, to make room, before a read used them.
    evicted_unused: int = 0
    #: Ranges not fetched for lack of room.
    skipped: int = 0
    #: The most bytes held at once.
    peak_bytes: int = 0


class _Entry:
    __slots__ = ("ahead", "end", "future", "pieces", "shard", "start")

    def __init__(self, shard: int, start: int, end: int, pieces: int, ahead: bool) -> None:
        self.shard, self.start, self.end = shard, start, end
        self.pieces = pieces
        self.ahead = ahead
        self.future: Future | None = None

    @property
    def size(self) -> int:
        return self.end - self.start


def merge_ranges(ranges: Sequence[Range], gap: int = MERGE_GAP) -> list[tuple[int, int, int, int]]:
    """``ranges`` as ``(shard, start, end, pieces)`` requests: per shard, in order, ranges at
    most ``gap`` bytes apart joined (``pieces``: how many ranges each request covers)."""
    merged: list[list[int]] = []
    for shard, offset, size in sorted(r for r in ranges if r[2] > 0):
        last = merged[-1] if merged else None
        if last is not None and last[0] == shard and offset - last[2] <= gap:
            last[2] = max(last[2], offset + size)
            last[3] += 1
        else:
            merged.append([shard, offset, offset + size, 1])
    return [tuple(m) for m in merged]


class SampleOrder:
    """Which indices come next, learnt from those asked for so far.

    The gaps between consecutive indices are kept; when the last ``2p`` gaps repeat with a
    period ``p`` (``p`` up to :data:`MAX_PERIOD`), the next indices continue that pattern:
    ``0, 1, 2, ...`` in the main process; ``w, w+N, w+2N, ...`` in DataLoader worker ``w``
    of ``N`` reading one sample per batch; runs of ``B`` consecutive indices with jumps
    between them for batches of ``B``. Without such a pattern, no guess.
    """

    def __init__(self) -> None:
        self.last: int | None = None
        self.gaps: deque[int] = deque(maxlen=2 * MAX_PERIOD)
        self.asked: OrderedDict[int, None] = OrderedDict()
        self._period: int | None = None

    def see(self, index: int) -> bool:
        """Record that ``index`` is being read; whether :meth:`fresh` returned it (it was
        fetched ahead)."""
        if self.last is not None:
            self.gaps.append(index - self.last)
        self.last = index
        return self.asked.pop(index, False) is None

    def period(self) -> list[int] | None:
        """The repeating gaps, or None: the shortest period ``p`` that every gap kept
        follows (at least two periods seen). Every gap, not the last few: in a batch of 4
        read by worker 0 of 2 (gaps 1, 1, 1, 5, 1, 1, 1, 5...), the last two gaps are often
        1 and 1, yet the period is 4."""
        gaps = self.gaps
        cached = self._period
        if cached is not None and len(gaps) > cached and gaps[-1] == gaps[-1 - cached]:
            return list(gaps)[-cached:]  # the new gap follows it still
        self._period = None
        for p in range(1, min(MAX_PERIOD, len(gaps) // 2) + 1):
            if all(gaps[i] == gaps[i - p] for i in range(p, len(gaps))):
                self._period = p
                return list(gaps)[-p:]
        return None

    def fresh(self, count: int, limit: int) -> list[int]:
        """The indices of :meth:`following` not returned by an earlier call (those were
        fetched ahead already)."""
        found = [i for i in self.following(count, limit) if i not in self.asked]
        for index in found:
            self.asked[index] = None
        while len(self.asked) > 4 * count + 8:
            self.asked.popitem(last=False)
        return found

    def following(self, count: int, limit: int) -> list[int]:
        """Up to ``count`` indices expected after the last one seen, each below ``limit``."""
        pattern = self.period()
        if not pattern or self.last is None or not any(pattern):
            return []
        found, index = [], self.last
        for i in range(count):
            index += pattern[i % len(pattern)]
            if not 0 <= index < limit:
                break
            found.append(index)
        return found


_INSTANCES: weakref.WeakSet[ReadAhead] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for ahead in list(_INSTANCES):
        ahead._reset()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ReadAhead:
    """The bounded range cache and read-ahead of one open repack (see the module's docstring).

    Args:
        reader: What reads an exact range of a shard: ``reader(shard, offset, size)``.
        limit: Bytes held at most (fetched and in flight).
        ahead: Samples fetched ahead.
        gap: Pieces of a shard at most this many bytes apart are fetched by one GET
            (default :data:`MERGE_GAP`).
        threads: Fetching threads (default :data:`THREADS`).
    """

    def __init__(
        self,
        reader,
        limit: int,
        ahead: int = DEFAULT_AHEAD,
        *,
        gap: int | None = None,
        threads: int | None = None,
    ) -> None:
        self._reader = reader
        self.limit = limit
        self.ahead = ahead
        self.gap = MERGE_GAP if gap is None else gap
        self.threads = THREADS if threads is None else threads
        self._reset()
        _INSTANCES.add(self)

    def _reset(self) -> None:
        """Empty, with no threads: at creation, and in a forked child (the parent's threads
        and the requests they had in flight do not exist there)."""
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._starts: dict[int, list[int]] = {}
        self._entries: dict[int, list[_Entry]] = {}
        self._longest: dict[int, int] = {}  # per shard, the longest range held (or once held)
        self._order: OrderedDict[_Entry, None] = OrderedDict()  # least recently used first
        self._held = 0
        self._orders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.stats = ReadStats()

    @property
    def held(self) -> int:
        """Bytes held now (fetched and in flight)."""
        return self._held

    def clear(self) -> None:
        """Drop everything held (after waiting for what is in flight), what was learnt of the
        order of the samples, and the counts."""
        with self._lock:
            pending = [e.future for e in self._order if e.future is not None]
        for future in pending:
            future.exception()  # waits; an error is for no one now
        with self._lock:
            self._starts.clear()
            self._entries.clear()
            self._longest.clear()
            self._order.clear()
            self._held = 0
            self._orders = weakref.WeakKeyDictionary()
            self.stats = ReadStats()

    # --- what the loader calls --------------------------------------------------------------

    def order(self, outer: object) -> SampleOrder:
        """The :class:`SampleOrder` of the indices asked of ``outer`` (a dataset) here."""
        with self._lock:
            found = self._orders.get(outer)
            if found is None:
                found = self._orders[outer] = SampleOrder()
            return found

    def fetch(self, ranges: Sequence[Range], *, ahead: bool = False) -> None:
        """Start fetching the ranges of one sample (those not held already), merged per shard;
        ``ahead``: for a sample that comes later."""
        if ahead:
            self.stats.ahead_samples += 1
        wanted = [r for r in ranges if r[2] > 0]
        for shard, start, end, pieces in merge_ranges(wanted, self.gap):
            with self._lock:
                held = self._find(shard, start, end)
                if held is not None:  # it serves these pieces too: keep it until they are read
                    held.pieces += pieces
                    continue
                if not self._make_room(end - start):
                    self.stats.skipped += 1
                    continue
                entry = _Entry(shard, start, end, pieces, ahead)
                self._insert(entry)
                self.stats.requests += 1
                self.stats.bytes += entry.size
            entry.future = self._threads().submit(self._reader, shard, start, end - start)

    def get(self, shard: int, offset: int, size: int) -> bytes | None:
        """Bytes ``[offset, offset + size)`` of ``shard`` if a fetched (or in-flight) range
        holds them (waiting for it), else None: the caller reads them itself.

        Raises:
            RepackError: the fetch of that range failed, after its retries.
        """
        with self._lock:
            entry = self._find(shard, offset, offset + size)
            if entry is None or entry.future is None:
                self.stats.misses += 1
                return None
            self._order.move_to_end(entry)
        try:
            data = entry.future.result()
        except RepackError:
            # the fetch was retried already (repack.store.retry): its error is the read's,
            # which does not wait for a silent server once more
            with self._lock:
                self._remove(entry)
            raise
        except Exception:  # anything else: the caller's own read says what went wrong
            with self._lock:
                self._remove(entry)
                self.stats.misses += 1
            return None
        with self._lock:
            self.stats.hits += 1
            if entry.ahead:
                self.stats.ahead_hits += 1
            entry.pieces -= 1
            if entry.pieces <= 0:  # read for every piece it was fetched for: first to go
                self._order.move_to_end(entry, last=False)
        start = offset - entry.start
        return bytes(memoryview(data)[start : start + size])

    # --- inside, under the lock -------------------------------------------------------------

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="repack-ahead")
        return self._pool

    def _find(self, shard: int, start: int, end: int) -> _Entry | None:
        starts = self._starts.get(shard)
        if not starts:
            return None
        entries = self._entries[shard]
        reach = end - self._longest.get(shard, 0)  # no entry starting before this holds `end`
        for j in range(bisect.bisect_right(starts, start) - 1, -1, -1):
            entry = entries[j]
            if entry.start < reach:
                break
            if end <= entry.end:
                return entry
        return None

    def _insert(self, entry: _Entry) -> None:
        starts = self._starts.setdefault(entry.shard, [])
        i = bisect.bisect_right(starts, entry.start)
        starts.insert(i, entry.start)
        self._entries.setdefault(entry.shard, []).insert(i, entry)
        self._order[entry] = None
        self._longest[entry.shard] = max(self._longest.get(entry.shard, 0), entry.size)
        self._held += entry.size
        self.stats.peak_bytes = max(self.stats.peak_bytes, self._held)

    def _remove(self, entry: _Entry) -> None:
        if entry not in self._order:
            return
        del self._order[entry]
        starts, entries = self._starts[entry.shard], self._entries[entry.shard]
        i = bisect.bisect_left(starts, entry.start)
        while entries[i] is not entry:
            i += 1
        del starts[i], entries[i]
        self._held -= entry.size

    def _make_room(self, size: int) -> bool:
        """Drop fetched ranges, least recently used first, until ``size`` more bytes fit;
        False when they cannot (the rest is in flight)."""
        if size > self.limit:
            return False
        for entry in list(self._order):
            if self._held + size <= self.limit:
                break
            if entry.future is not None and entry.future.done():
                self._remove(entry)
                if entry.pieces > 0:
                    self.stats.evicted_unused += 1
        return self._held + size <= self.limit
