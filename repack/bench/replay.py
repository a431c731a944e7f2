"""A plan's reads, made by ``ranks x workers`` processes paced as the run's DataLoaders are.

Each data-parallel rank is a thread of this process standing for the training loop, and
``workers`` forked processes standing for its DataLoader's workers, wired as torch wires them:

* the loop hands batch ``k`` to worker ``k % W`` and keeps ``W x prefetch_factor`` batches
  asked for; each batch it takes lets it ask for one more (``_MultiProcessingDataLoaderIter``);
* it takes batch ``k`` when the step before it is done: the run's step time spread evenly over
  the iteration's micro-batches, so that a batch not read by then is a wait (a stall);
* at the end of each iteration the ranks wait for each other, as their gradients' all-reduce
  makes them (the ranks of this node; other nodes' ranks are replayed by their own command).

A worker reads each micro-batch's pieces with the loader's own call: ``Repack.read`` on the
process's open repack, inherited as a DataLoader worker inherits it (page by page, as a forked
worker reads; on object storage, the same range cache and read-ahead, asked for the samples the
worker reads next), or for the original layout stock's own ``IndexedDataset`` reader of each
prefix's ``.bin``, built before the fork and inherited, as a DataLoader worker inherits it.
``--flat-out`` is a step time of 0: every batch is asked for as soon as there is room.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from queue import Empty

import numpy as np

from repack.bench.pagecache import fetched_bytes
from repack.bench.plan import Plan
from repack.errors import RepackError

__all__ = ["Measured", "replay"]

#: A wait shorter than this is the queues' own latency, not a stall.
STALL_SECONDS = 0.001


@dataclass
class Measured:
    """What a replay measured, per micro-batch row of the plan and per worker process."""

    seconds: float
    step_time: float | None
    prefetch_factor: int
    batch_start: np.ndarray  # when the worker began reading it (seconds from the start)
    batch_end: np.ndarray
    batch_wait: np.ndarray  # how long the loop waited for it
    batch_done: np.ndarray  # bool: replayed (a --seconds replay stops early)
    workers: list[dict] = field(default_factory=list)


def _reader(plan: Plan, backend: str) -> tuple[Callable[[int, int, int], int], Callable[[], dict]]:
    """In a worker: ``read(file, offset, size) -> requests`` and ``stats()``."""
    if plan.layout == "repack":
        from repack.read.reader import open_repack

        # the process's open repack, as a DataLoader worker uses the one its parent opened (its
        # mappings inherited, reading page by page since the fork; the read-ahead emptied)
        repack = open_repack(plan.location, backend)
        repack.read_page_by_page()  # opened here (the parent had not): as a worker reads
        ahead = repack.read_ahead
        extra = {"bytes": 0, "requests": 0}

        def read(shard: int, offset: int, size: int) -> int:
            misses = ahead.stats.misses if ahead is not None else 0
            data = repack.read(shard, offset, size, np.uint8)
            np.add.reduce(data)  # the loader copies every byte into the sample
            if ahead is not None and ahead.stats.misses != misses:
                extra["bytes"] += size
                extra["requests"] += 1
            return 1

        def stats() -> dict:
            if ahead is None:
                return {}
            return {
                "requests": ahead.stats.requests + extra["requests"],
                "bytes": ahead.stats.bytes + extra["bytes"],
            }

        read.repack = repack  # type: ignore[attr-defined]
        return read, stats

    readers = plan.readers or []

    def read_prefix(file: int, offset: int, size: int) -> int:
        # stock's own reader of the prefix's .bin, built by the parent and inherited at fork as
        # a DataLoader worker inherits it: its mapping, or a file read (mmap_bin_files)
        np.add.reduce(readers[file].bin_reader.read(dtype=np.uint8, count=size, offset=offset))
        return 1

    return read_prefix, dict


class _Ahead:
    """The loader's read-ahead on object storage, in a worker that reads ``samples`` in turn
    (each a list of ``(shard, offset, size)``): before a sample is read, its ranges are
    fetched unless they were asked for ahead, and so are those of the next ``ahead.ahead``
    samples, as ``RepackedGPT._repack_read_ahead`` asks once its order is learnt (a worker's
    samples come in a pattern it learns exactly: every W-th batch)."""

    def __init__(self, ahead, samples: list[list[tuple[int, int, int]]]) -> None:
        self.ahead = ahead
        self.samples = samples
        self.asked = 0  # samples fetched so far, in order

    def before(self, position: int) -> None:
        if position >= self.asked:
            self.ahead.fetch(self.samples[position])
            self.asked = position + 1
        upto = min(len(self.samples), position + 1 + self.ahead.ahead)
        for following in range(self.asked, upto):
            self.ahead.fetch(self.samples[following], ahead=True)
        self.asked = max(self.asked, upto)


def _remote_ranges(repack, reads: tuple) -> list[list[tuple[int, int, int]]]:
    """Per sample of a micro-batch, the ranges the loader's read-ahead fetches
    (``RepackedGPT._repack_ranges``: raw shards on object storage, pieces with bytes)."""
    samples, files, offsets, sizes = reads
    out: list[list[tuple[int, int, int]]] = []
    for s in np.unique(samples):
        pick = samples == s
        out.append(
            [
                (int(f), int(o), int(n))
                for f, o, n in zip(files[pick], offsets[pick], sizes[pick])
                if n > 0 and repack.remote_raw(int(f))
            ]
        )
    return out


def _worker(plan: Plan, backend: str, rows: list[int], tasks, results, origin: float) -> None:
    """One DataLoader worker: read each batch asked for, say when it began and ended."""
    try:
        read, stats = _reader(plan, backend)
        planned = {row: plan.reads_of(row) for row in rows}
        repack = getattr(read, "repack", None)
        ahead = None
        if repack is not None and repack.read_ahead is not None:
            ahead = _Ahead(
                repack.read_ahead, [r for row in rows for r in _remote_ranges(repack, planned[row])]
            )
        position = 0  # samples read so far
        done_bytes = 0  # bytes read, batches prefetched past a --seconds stop included
        before = fetched_bytes()
        results.put(("ready", os.getpid()))
        while True:
            row = tasks.get()
            if row is None:
                break
            began = time.perf_counter() - origin
            samples, files, offsets, sizes = planned[row]
            requests = 0
            done_bytes += int(sizes.sum())
            for s in np.unique(samples):
                if ahead is not None:
                    ahead.before(position)
                pick = samples == s
                for f, o, n in zip(files[pick], offsets[pick], sizes[pick]):
                    requests += read(int(f), int(o), int(n))
                position += 1
            results.put(("batch", row, began, time.perf_counter() - origin, requests))
        after = fetched_bytes()
        results.put(
            (
                "done",
                {
                    "pid": os.getpid(),
                    "fetched_bytes": None if before is None else after - before,
                    "read_bytes": done_bytes,
                    "open_files": len(os.listdir("/proc/self/fd")),
                    "data_mappings": _data_mappings(plan),
                    **{f"store_{k}": v for k, v in stats().items()},
                },
            )
        )
    except BaseException as err:  # reported to the parent, which says it in one line
        results.put(("error", f"{type(err).__name__}: {err}"))


def _data_mappings(plan: Plan) -> int:
    """This process's mappings of the layout's data files (the repack's shards, the prefixes'
    ``.bin``): what ``mmap_bin_files`` maps, and what a file system's mmap ceiling counts."""
    files = {os.path.realpath(f) for f in plan.data_files}
    count = 0
    try:
        with open("/proc/self/maps") as stream:
            for line in stream:
                fields = line.rstrip("\n").split(None, 5)
                if len(fields) == 6 and fields[5] in files:
                    count += 1
    except OSError:
        return 0
    return count


def replay(
    plan: Plan,
    *,
    backend: str = "mmap",
    step_time: float | None = None,
    prefetch_factor: int = 2,
    seconds: float | None = None,
    progress: Callable[[str, int], Callable[[int], object]] | None = None,
) -> Measured:
    """Make ``plan``'s reads (see the module's docstring).

    Args:
        plan: What to read.
        backend: ``"mmap"`` or ``"pread"`` (Megatron's ``mmap_bin_files``).
        step_time: Seconds per iteration the run spends training; None reads flat out.
        prefetch_factor: The DataLoader's ``prefetch_factor``.
        seconds: Stop after this long, at an iteration's end.
        progress: ``progress(description, total)`` returns ``update(n)``; micro-batches.

    Raises:
        RepackError: a worker failed to read (its error, in one line).
    """
    context = multiprocessing.get_context("fork")
    n = len(plan.batch_rank)
    ranks = list(plan.ranks)
    rows_of = {r: np.flatnonzero(plan.batch_rank == r) for r in ranks}  # loader order
    origin = time.perf_counter()
    start = np.zeros(n)
    end = np.zeros(n)
    wait = np.zeros(n)
    done = np.zeros(n, dtype=bool)
    procs = []
    procs_of: dict[int, list] = {r: [] for r in ranks}
    tasks: dict[tuple[int, int], object] = {}
    results = {r: context.Queue() for r in ranks}
    for r in ranks:
        for w in range(plan.workers):
            mine = [int(k) for k in rows_of[r] if int(plan.batch_number[k]) % plan.workers == w]
            queue = context.SimpleQueue()
            tasks[(r, w)] = queue
            proc = context.Process(
                target=_worker,
                args=(plan, backend, mine, queue, results[r], origin),
                daemon=True,
            )
            with warnings.catch_warnings():
                # 3.12 warns of fork() in a threaded process; DataLoader workers fork alike
                warnings.simplefilter("ignore", DeprecationWarning)
                proc.start()
            procs.append(proc)
            procs_of[r].append(proc)
    try:
        for r in ranks:  # every worker opened its files: the clock starts now
            for _ in range(plan.workers):
                _expect(_next(results[r], procs_of[r]), "ready")
    except RepackError:
        for proc in procs:
            proc.kill()
            proc.join()
        raise
    origin_started = time.perf_counter() - origin
    update = progress("replay", n) if progress is not None else (lambda k: None)
    ends: dict[int, dict[int, float]] = {}
    deadline = None if seconds is None else time.perf_counter() + seconds
    stop = threading.Event()

    def at_iteration_end() -> None:
        if deadline is not None and time.perf_counter() > deadline:
            stop.set()

    barrier = threading.Barrier(len(ranks), action=at_iteration_end)
    worker_stats: list[dict] = []
    errors: list[str] = []

    def loop(r: int) -> None:
        rows = rows_of[r]
        iterations = plan.batch_iteration[rows]
        per_iteration = {int(i): int(c) for i, c in zip(*np.unique(iterations, return_counts=True))}
        ahead = plan.workers * prefetch_factor
        queue = results[r]
        arrived: dict[int, tuple[float, float]] = {}
        for k in range(min(ahead, len(rows))):
            tasks[(r, int(plan.batch_number[rows[k]]) % plan.workers)].put(int(rows[k]))
        asked = min(ahead, len(rows))
        need = time.perf_counter() - origin
        try:
            for k, row in enumerate(rows):
                row = int(row)
                while row not in arrived:
                    message = _next(queue, procs_of[r])
                    if message[0] == "error":
                        raise RepackError(message[1])
                    if message[0] == "batch":
                        arrived[message[1]] = (message[2], message[3])
                        update(1)
                began, ready = arrived.pop(row)
                start[row], end[row], done[row] = began, ready, True
                wait[row] = max(0.0, ready - need)
                now = time.perf_counter() - origin
                if now < need:
                    time.sleep(need - now)
                taken = max(ready, need)
                if asked < len(rows):
                    nxt = int(rows[asked])
                    tasks[(r, int(plan.batch_number[nxt]) % plan.workers)].put(nxt)
                    asked += 1
                iteration = int(iterations[k])
                share = 0.0 if step_time is None else step_time / per_iteration[iteration]
                need = taken + share
                if k + 1 == len(rows) or int(iterations[k + 1]) != iteration:
                    ends.setdefault(iteration, {})[r] = need
                    barrier.wait()  # its action decided, once for all ranks, whether to stop
                    need = max(ends[iteration].values())
                    if stop.is_set():
                        break
        except threading.BrokenBarrierError:
            pass
        except BaseException as err:
            errors.append(str(err))
            barrier.abort()

    threads = [threading.Thread(target=loop, args=(r,), daemon=True) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for queue in tasks.values():
        queue.put(None)
    for r in ranks:  # what each worker counted, after the batches still in flight
        got = 0
        while got < plan.workers and not errors:
            message = _next(results[r], procs_of[r])
            if message[0] == "done":
                worker_stats.append({"rank": r, **message[1]})
                got += 1
            elif message[0] == "error":
                errors.append(message[1])
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()
    for queue in tasks.values():  # the pipes closed now, not by a collection some time later
        queue.close()
    for queue in results.values():
        queue.close()
        queue.join_thread()
    if errors:
        raise RepackError(f"replay: a worker failed: {errors[0]}")
    finished = time.perf_counter() - origin
    return Measured(
        seconds=finished - origin_started,
        step_time=step_time,
        prefetch_factor=prefetch_factor,
        batch_start=start - origin_started,
        batch_end=end - origin_started,
        batch_wait=wait,
        batch_done=done,
        workers=worker_stats,
    )


def _next(queue, procs: list) -> tuple:
    """The next message of a rank's workers; an error message if one of them died without
    saying why (a signal: SIGBUS of a mapping whose file went away, the OOM killer)."""
    while True:
        try:
            return queue.get(timeout=1.0)
        except Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                code = dead[0].exitcode
                why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
                return ("error", f"a worker process died ({why})")


def _expect(message: tuple, kind: str) -> None:
    if message[0] == "error":
        raise RepackError(f"replay: a worker failed: {message[1]}")
    if message[0] != kind:
        raise RepackError(f"replay: a worker said {message[0]!r} before {kind!r}")
