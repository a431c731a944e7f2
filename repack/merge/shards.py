"""Step 2 of a merge, the tasks: copy the segments of each shard from the source ``.bin``
files, compress the shard if asked, rename it into place, then save its receipt.

:func:`copy_shards` is what ``merge`` tasks and ``repack add`` run; shards go to worker
processes with ``workers > 1``.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.reduction
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from repack import interrupt
from repack.checksum import digest_of, new_hasher
from repack.errors import SourceError
from repack.fileio import BUFFER, HashFeeder, io_buffer
from repack.format import spec as fmt
from repack.inputs.plan import PlannedShard
from repack.inputs.sources import validated_arrays
from repack.merge.prepare import Prepared
from repack.merge.workdir import Receipt, load_plan
from repack.read.fingerprints import DocumentHasher, document_bounds, save_parts
from repack.store import Store, open_store
from repack.store.lock import held_descriptor
from repack.store.prefixes import SegmentReader, index_bytes, open_bin

__all__ = [
    "copy_shards",
    "write_shard",
]

#: How long stopped workers get to end on their own (they check between two chunks of a
#: copy) before they are killed: stopping takes less than a second, whatever ``workers`` is.
STOP_GRACE = 0.5

# set in each worker process by _init_worker
_shared_counter = None
_stop_flag = None
_busy = None
_slot = 0
_lock_fd = None


class _Stopped(Exception):
    """Raised in a worker told to stop: the merge it works for was interrupted or failed."""


class _InheritedFd:
    """A descriptor handed to a spawned worker (the writer lock), kept open there."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        # pickled while the worker is being spawned: DupFd has it passed to the child
        return _rebuild_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _rebuild_fd(dup) -> int:
    return dup.detach()


def _init_worker(counter, stop, slots, busy, parent: int, lock_fd) -> None:
    global _shared_counter, _stop_flag, _busy, _slot, _lock_fd
    interrupt.ignore_in_worker()
    _shared_counter, _stop_flag, _busy, _lock_fd = counter, stop, busy, lock_fd
    # a ^C to the whole process group (a terminal's, srun's) stops each worker at its next
    # chunk by itself: on a loaded machine the merge's own handler, which sets the same flag,
    # ran late enough for workers to finish two more 256 KiB shards each (test_signals.py)
    signal.signal(signal.SIGINT, _stop_at_interrupt)
    with slots.get_lock():
        _slot = slots.value
        slots.value += 1
    _die_with_parent(parent)


def _stop_at_interrupt(signum, frame) -> None:
    """A worker's SIGINT handler: set the stop flag (no lock: a ``RawValue``) and go on; the
    copy raises :class:`_Stopped` at its next check, as when the merge sets it."""
    _stop_flag.value = 1


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this worker when the merge that started it dies (even by
    SIGKILL), so no orphan keeps writing shards while the merge is run again."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the worker ends with its last shard
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _count(n: int) -> None:
    if _stop_flag.value:
        raise _Stopped
    with _shared_counter.get_lock():
        _shared_counter.value += n


def _worker_copy(location: str, number: int) -> int:
    _busy[_slot] = os.getpid()
    try:
        if _stop_flag.value:
            return number  # queued before the merge stopped: not started
        store = open_store(location)
        prepared = load_plan(store)
        shard = next(s for s in prepared.plan.shards if s.number == number)
        write_shard(store, prepared, shard, _count, _buffer_for([shard]))
    finally:
        _busy[_slot] = 0
    return number


def _buffer_for(shards: Iterable[PlannedShard]) -> memoryview:
    # for copy_range where copy_file_range is refused (it reads and writes through this
    # buffer; see io_buffer); no larger than needed
    largest = max((seg.size for shard in shards for seg in shard.segments), default=0)
    return io_buffer(min(BUFFER, largest))


def copy_shards(
    store: Store,
    prepared: Prepared,
    shards: Sequence[PlannedShard],
    workers: int,
    advance: Callable[[int], object],
) -> None:
    """Write ``shards`` of the plan ``prepared`` (saved in the work folder of ``store``),
    each committed then receipted; ``workers > 1`` writes that many at once, in worker
    processes that read the saved plan.

    Raises:
        SourceError: a source ``.bin`` changed or vanished since it was validated.
    """
    if workers <= 1 or len(shards) <= 1:
        buffer = _buffer_for(shards)
        for shard in shards:
            write_shard(store, prepared, shard, advance, buffer)
        return
    _copy_in_workers(store.location, shards, min(workers, len(shards)), advance)


def _copy_in_workers(
    out: str, shards: Sequence[PlannedShard], workers: int, advance: Callable[[int], object]
) -> None:
    """Copy ``shards`` in ``workers`` spawned processes that read the saved plan from the
    store at ``out``.

    Whatever ends the copy early (a failed shard, SIGINT or SIGTERM turned into an exception
    in this process) stops every worker before it is raised again (:func:`_stop_workers`).
    The workers start with SIGINT and SIGTERM blocked, ignore SIGINT (this process stops
    them) and end quietly on SIGTERM; each keeps a duplicate of the writer lock's descriptor,
    so that the lock is held until the last of them is gone
    (:func:`repack.store.lock.held_descriptor`).
    """
    context = multiprocessing.get_context("spawn")
    counter = context.Value("q", 0)  # bytes copied, for the progress bar
    stop = context.RawValue("b", 0)  # set: stop at the next chunk, start no shard
    slots = context.Value("i", 0)  # each worker takes the next slot of busy
    busy = context.RawArray("i", workers)  # by slot: the worker's pid while inside a shard
    lock_fd = held_descriptor(out)
    inherited = _InheritedFd(lock_fd) if lock_fd is not None else None
    before = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(
        workers,
        mp_context=context,
        initializer=_init_worker,
        initargs=(counter, stop, slots, busy, os.getpid(), inherited),
    )
    started: list = []
    try:
        # the workers hear of a signal at once, even while this thread defers it
        with interrupt.at_signal(functools.partial(setattr, stop, "value", 1)):
            with interrupt.deferred():  # a signal now would leave a worker half started
                pending = {pool.submit(_worker_copy, out, s.number) for s in shards}
                started = [p for p in multiprocessing.active_children() if p not in before]
            reported = 0
            while pending:
                # the futures' locks are taken here: a signal waits for the end of the block
                # (interrupt.result_of says why)
                with interrupt.deferred(mask=False):
                    done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()
                value = counter.get_obj().value  # without its lock: a killed worker may hold it
                advance(value - reported)
                reported = value
            with interrupt.deferred(mask=False):
                pool.shutdown()
    except BaseException:
        _stop_workers(pool, started, stop, busy)
        raise


def _stop_workers(pool: ProcessPoolExecutor, processes: list, stop, busy) -> None:
    """End the workers of a copy that ends early, within about ``STOP_GRACE``.

    Told to stop, each worker removes the temp file of the shard it was writing at its next
    chunk and starts no other. Once none is inside a shard (or after ``STOP_GRACE``) they are
    killed: outside a shard a worker holds nothing worth finishing (one still starting up
    has SIGINT and SIGTERM blocked). A worker killed inside a shard, after the grace, leaves a
    temp file, which the next run removes.
    """
    stop.value = 1
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + STOP_GRACE
    while time.monotonic() < deadline:
        alive = {process.pid for process in processes if process.is_alive()}
        if not alive.intersection(busy):  # SIGTERM may have ended some inside a shard
            break
        time.sleep(0.005)
    for process in processes:
        process.kill()
    for process in processes:
        process.join(STOP_GRACE)


def write_shard(
    store: Store,
    prepared: Prepared,
    shard: PlannedShard,
    advance: Callable[[int], object],
    buffer: memoryview | None = None,
) -> Receipt:
    """Write one shard into ``store`` from its sources, hashing on the way (the shard, each
    segment, with fingerprints each document), compressed if the plan says so; commit it,
    save its fingerprint parts, then its receipt.

    Sources are read through read handles (:class:`~repack.store.prefixes.SegmentReader`):
    a local one's descriptor (``copy_file_range`` into a local folder), ranged GETs fetched
    ahead for one on object storage.
    """
    algorithm = prepared.algorithm
    name = fmt.shard_name(shard.number, prepared.codec_name)
    if prepared.codec is None:
        writer = store.writer(name, size_hint=shard.size)
    else:
        writer = store.compressing_writer(
            name, size_hint=shard.size, level=prepared.codec[1], algorithm=algorithm
        )
    shard_hasher = new_hasher(algorithm)
    segment_sums = {}
    documents: list[tuple[int, DocumentHasher]] = []
    fingerprints = segment_documents if prepared.fingerprints else None
    documents_of = functools.partial(segment_documents, prepared)
    deferred = functools.partial(DeferredDocuments, prepared)
    with (
        writer,
        HashFeeder() as feeder,
        SegmentReader(
            prepared.sources, shard.segments, documents_of if fingerprints else None, deferred
        ) as segments,
    ):
        position = 0
        for seg in shard.segments:
            if seg.offset > position:
                feeder.update((shard_hasher,), bytes(seg.offset - position))
                writer.pad(seg.offset - position)
            seg_hasher = segment_sums[Receipt.key(seg.source, seg.first_sequence)] = new_hasher(
                algorithm
            )
            hashers = (shard_hasher, seg_hasher)
            if fingerprints is not None:
                documents.append((seg.source, segments.documents(seg)))
                hashers += (documents[-1][1],)
            # a local source moves by copy_file_range into a local folder; one on object
            # storage comes as the ranged GETs the reader ran ahead
            with segments.handle(seg) as source:
                writer.copy_from(
                    source, seg.source_offset, seg.size, hashers, advance, feeder, buffer
                )
            position = seg.offset + seg.size
        if shard.size > position:
            feeder.update((shard_hasher,), bytes(shard.size - position))
            writer.pad(shard.size - position)
        advance(0)  # a worker told to stop stops here rather than after the fsync
        feeder.wait()
        writer.commit()
    if fingerprints is not None:  # before the receipt: a receipt means they are there
        save_parts(store, shard.number, finish_documents(prepared, documents))
    stored = (None, None)
    if prepared.codec is not None:
        stored = (writer.stored_size, writer.stored_checksum)
    segments = {key: digest_of(h, algorithm) for key, h in segment_sums.items()}
    receipt = Receipt(digest_of(shard_hasher, algorithm), segments, *stored)
    receipt.save(store, shard.number)
    return receipt


def segment_documents(prepared: Prepared, seg) -> DocumentHasher:
    """The fingerprint hasher of the documents that the planned segment ``seg`` owns (see
    :class:`~repack.read.fingerprints.DocumentHasher`), from its source's ``.idx``, checked to be
    the one validated.

    Raises:
        SourceError: the ``.idx`` changed since it was validated.
    """
    info = prepared.sources[seg.source]
    pointers, documents = _validated_index(prepared, seg.source)
    bounds = document_bounds(pointers, documents, info.bin_size)
    end = seg.source_offset + seg.size
    return DocumentHasher(bounds, seg.source_offset, end, end == info.bin_size)


def _validated_index(prepared: Prepared, source: int) -> tuple:
    """The pointers and document indices of source ``source``'s ``.idx``, read again and
    checked to be the bytes validated (their checksum), so not checked again
    (:func:`~repack.inputs.sources.validated_arrays`).

    Raises:
        SourceError: the ``.idx`` changed since it was validated.
    """
    info = prepared.sources[source]
    changed = SourceError(f"{info.path}.idx: changed during the merge")
    try:
        data = index_bytes(info)
    except (SourceError, OSError):
        raise changed from None
    hasher = new_hasher(prepared.algorithm)
    hasher.update(data)
    if digest_of(hasher, prepared.algorithm) != prepared.idx_checksums[source]:
        raise changed
    return validated_arrays(data)


class DeferredDocuments:
    """The document hasher of the planned segment ``seg`` (:func:`segment_documents`), made
    when it is first fed: in the :class:`~repack.fileio.HashFeeder`'s thread, so that reading
    and checking the source's ``.idx`` again overlaps the copy. Made in the copy's own thread,
    it held the copy up by 0.44 s of a 3 s merge of 480 sources (docs/benchmarks.md). An
    error it raises there reaches the caller as any hashing error does."""

    def __init__(self, prepared: Prepared, seg) -> None:
        self._make = functools.partial(segment_documents, prepared, seg)
        self._hasher: DocumentHasher | None = None

    @property
    def hasher(self) -> DocumentHasher:
        if self._hasher is None:
            self._hasher = self._make()
        return self._hasher

    def update(self, data: bytes | memoryview) -> None:
        self.hasher.update(data)

    def hexdigest(self) -> str:  # the Hasher protocol; never stored
        return ""

    @property
    def needs_rest(self) -> bool:
        return self.hasher.needs_rest

    def finish(self, source=None):
        return self.hasher.finish(source)


def finish_documents(
    prepared: Prepared, documents: Sequence[tuple[int, DocumentHasher]]
) -> list[tuple[int, int, object]]:
    """``(source, first document, fingerprints)`` of each segment hashed; a document that
    goes on past its segment is finished from its source (its own bytes only)."""
    parts = []
    for source, hasher in documents:
        if not hasher.needs_rest:
            parts.append((source, *hasher.finish()))
            continue
        with open_bin(prepared.sources[source]) as rest:
            parts.append((source, *hasher.finish(rest)))
    return parts
