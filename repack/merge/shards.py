"""Step 2 of a merge, the tasks: copy the segments of each shard from the source ``.bin``
files, compress the shard if asked, rename it into place, then save its receipt.

:func:`copy_shards` is what ``merge`` tasks and ``repack add`` run; shards go to worker
processes with ``workers > 1``.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from repack import format as fmt
from repack.checksum import digest_of, new_hasher
from repack.codec import compress_file
from repack.errors import SourceError
from repack.fileio import BUFFER, HashFeeder, copy_range, fsync_dir, hash_range, io_buffer
from repack.fingerprints import DocumentHasher, document_bounds, save_parts
from repack.merge.prepare import Prepared
from repack.merge.workdir import Receipt, load_plan, temp_name, work_path
from repack.plan import PlannedShard
from repack.sources import SourceInfo, read_source_index

__all__ = ["compress_shard", "copy_shards", "open_source_bin", "stored_checksum"]

_shared_counter = None


def _init_worker(counter) -> None:
    global _shared_counter
    _shared_counter = counter
    _die_with_parent()


def _die_with_parent() -> None:
    """Have the kernel kill this worker when the merge that started it dies (even by
    SIGKILL), so no orphan keeps writing shards while the merge is run again."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the worker ends with its last shard
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _count(n: int) -> None:
    with _shared_counter.get_lock():
        _shared_counter.value += n


def _worker_copy(out: str, number: int) -> int:
    prepared = load_plan(out)
    shard = next(s for s in prepared.plan.shards if s.number == number)
    _copy_shard(out, prepared, shard, _count, _buffer_for([shard]))
    return number


def _buffer_for(shards: Iterable[PlannedShard]) -> memoryview:
    # for copy_range where copy_file_range is refused (it reads and writes through this
    # buffer; see io_buffer); no larger than needed
    largest = max((seg.size for shard in shards for seg in shard.segments), default=0)
    return io_buffer(min(BUFFER, largest))


def copy_shards(
    out: str,
    prepared: Prepared,
    shards: Sequence[PlannedShard],
    workers: int,
    advance: Callable[[int], object],
) -> None:
    """Write ``shards`` of the plan ``prepared`` (saved in ``out``'s work folder) into ``out``,
    each renamed into place then receipted; ``workers > 1`` copies that many at once, in
    worker processes that read the saved plan.

    Raises:
        SourceError: a source ``.bin`` changed or vanished since it was validated.
    """
    if workers <= 1 or len(shards) <= 1:
        buffer = _buffer_for(shards)
        for shard in shards:
            _copy_shard(out, prepared, shard, advance, buffer)
        return
    context = multiprocessing.get_context("spawn")
    counter = context.Value("q", 0)
    reported = 0
    with ProcessPoolExecutor(
        min(workers, len(shards)),
        mp_context=context,
        initializer=_init_worker,
        initargs=(counter,),
    ) as pool:
        pending = {pool.submit(_worker_copy, out, s.number) for s in shards}
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()
            value = counter.value
            advance(value - reported)
            reported = value


def open_source_bin(info: SourceInfo) -> int:
    """A descriptor of the source's ``.bin``, checked to still have its validated size."""
    path = info.path + ".bin"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise SourceError(f"{path}: cannot read .bin file: {err.strerror}") from None
    size = os.fstat(fd).st_size
    if size != info.bin_size:
        os.close(fd)
        raise SourceError(
            f"{path}: changed during the merge: {size} bytes, validated with {info.bin_size}"
        )
    return fd


def _copy_shard(
    out: str,
    prepared: Prepared,
    shard: PlannedShard,
    advance: Callable[[int], object],
    buffer: memoryview,
) -> None:
    """Copy the segments of one shard, rename it into place, then save its receipt."""
    algorithm = prepared.algorithm
    final = os.path.join(out, shard.name)
    tmp = temp_name(final)
    segment_sums = {}
    documents: list[tuple[int, DocumentHasher]] = []
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        shard_hasher = new_hasher(algorithm)
        with HashFeeder() as feeder:
            position = 0
            for seg in shard.segments:
                if seg.offset > position:
                    feeder.update((shard_hasher,), bytes(seg.offset - position))
                seg_hasher = new_hasher(algorithm)
                info = prepared.sources[seg.source]
                hashers = (shard_hasher, seg_hasher)
                src = open_source_bin(info)
                try:
                    if prepared.fingerprints:
                        documents.append((seg.source, segment_documents(prepared, seg)))
                        hashers += (documents[-1][1],)
                    copy_range(
                        src,
                        fd,
                        seg.source_offset,
                        seg.offset,
                        seg.size,
                        hashers,
                        advance,
                        buffer,
                        feeder,
                    )
                finally:
                    os.close(src)
                segment_sums[Receipt.key(seg.source, seg.first_sequence)] = seg_hasher
                position = seg.offset + seg.size
            os.ftruncate(fd, shard.size)
            os.fsync(fd)  # while the feeder hashes the last chunks
    finally:
        os.close(fd)
    if prepared.fingerprints:
        save_parts(work_path(out), shard.number, finish_documents(prepared, documents))
    segments = {key: digest_of(h, algorithm) for key, h in segment_sums.items()}
    receipt = Receipt(digest_of(shard_hasher, algorithm), segments)
    if prepared.codec is None:
        os.replace(tmp, final)
    else:
        final = os.path.join(out, fmt.shard_name(shard.number, prepared.codec[0]))
        size, checksum = compress_shard(tmp, final, prepared.codec[1], algorithm)
        receipt = Receipt(receipt.checksum, segments, size, checksum)
    fsync_dir(out)
    receipt.save(out, shard.number)


def segment_documents(prepared: Prepared, seg) -> DocumentHasher:
    """The fingerprint hasher of the documents that the planned segment ``seg`` owns (see
    :class:`~repack.fingerprints.DocumentHasher`), from its source's ``.idx``, checked to be
    the one validated.

    Raises:
        SourceError: the ``.idx`` changed since it was validated.
    """
    info = prepared.sources[seg.source]
    hasher = new_hasher(prepared.algorithm)
    try:
        index = read_source_index(info.path, hasher=hasher)
    except SourceError:
        index = None
    if index is None or digest_of(hasher, prepared.algorithm) != prepared.idx_checksums[seg.source]:
        raise SourceError(f"{info.path}.idx: changed during the merge")
    bounds = document_bounds(index.pointers, index.documents, info.bin_size)
    end = seg.source_offset + seg.size
    return DocumentHasher(bounds, seg.source_offset, end, end == info.bin_size)


def finish_documents(
    prepared: Prepared, documents: Sequence[tuple[int, DocumentHasher]]
) -> list[tuple[int, int, object]]:
    """``(source, first document, fingerprints)`` of each segment hashed; a document that
    goes on past its segment is finished from its source (its own bytes only)."""
    parts = []
    for source, hasher in documents:
        src = open_source_bin(prepared.sources[source]) if hasher.needs_rest else None
        try:
            first, hashes = hasher.finish(src)
        finally:
            if src is not None:
                os.close(src)
        parts.append((source, first, hashes))
    return parts


def compress_shard(raw: str, final: str, level: int, algorithm: str) -> tuple[int, str]:
    """Compress the finished raw shard file ``raw`` into place as ``final`` (through a temp
    file), then remove ``raw``.

    Returns:
        The stored size and the checksum of the compressed file.
    """
    tmp = temp_name(final)
    stored_size = compress_file(raw, tmp, level)
    checksum = stored_checksum(tmp, stored_size, algorithm)
    os.replace(tmp, final)
    os.unlink(raw)
    return stored_size, checksum


def stored_checksum(path: str, size: int, algorithm: str) -> str:
    """Checksum of the first ``size`` bytes of the file ``path``."""
    hasher = new_hasher(algorithm)
    fd = os.open(path, os.O_RDONLY)
    try:
        hash_range(fd, 0, size, [hasher])
    finally:
        os.close(fd)
    return digest_of(hasher, algorithm)
