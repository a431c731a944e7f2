"""The reads of a run's loaders, planned: which bytes each rank's DataLoader workers read, for
which micro-batch of which iteration.

Three steps, each a piece ``repack trace`` already has:

1. the iterations' samples per data-parallel rank, row by row (:class:`repack.trace.query.Tracer`:
   Megatron-LM's batch-size schedule and samplers);
2. each sample's documents and token ranges (:class:`repack.trace.draws.SourceDraws.ranges`:
   the datasets Megatron's own builder built);
3. each piece's bytes: in a repack, :meth:`repack.read.views.SourceDataset.byte_ranges`
   (the shard, the offset, the size the loader passes to ``Repack.read``); in the blend's
   prefixes, ``IndexedDataset``'s arithmetic (``sequence_pointers[doc] + start * itemsize`` of
   the prefix's ``.bin``).

Which worker reads a micro-batch is torch's: a ``DataLoader`` with ``num_workers = W`` hands
the batches of its batch sampler to its workers in turn, batch ``k`` (counted from the
loader's start) to worker ``k % W``. The loader is taken to start at the first iteration
replayed, as a job resumed there starts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from repack.errors import InputError
from repack.trace.batches import locate
from repack.trace.query import Tracer

__all__ = ["Plan", "plan_reads"]


@dataclass
class Plan:
    """The planned reads of ``ranks`` x ``workers`` loaders over some iterations.

    Micro-batches are rows of the ``batch_*`` arrays, in each rank's loader order; reads are
    rows of the ``read_*`` arrays, grouped by micro-batch (``read_batch``) and by sample
    (``read_sample``), in the order the loader reads them.

    Attributes:
        layout: ``"repack"`` or ``"prefixes"``.
        location: The repack (folder or URL), or the blend file.
        files: Path or URL of each file the reads name (``read_file`` indexes it).
        opened: Files a stock loader process holds open (each prefix's ``.bin`` and ``.idx``
            of every dataset the splits build); for a repack, its shards and index.
        first, last: The iterations replayed, both included.
        ranks: The data-parallel ranks replayed.
        workers: DataLoader workers per rank.
        data_files: Every data file a loader process holds (the shards; every ``.bin`` of
            the datasets the splits build), whose mappings a worker counts.
        readers: For the prefixes: each file's ``IndexedDataset``, built in this process,
            whose own ``bin_reader`` a forked worker reads with (stock's mapping or file
            reads, as ``mmap_bin_files`` says); None for a repack.
    """

    layout: str
    location: str
    files: list[str]
    opened: int
    first: int
    last: int
    ranks: tuple[int, ...]
    workers: int
    micro_batch_size: int
    seq_length: int
    batch_rank: np.ndarray
    batch_number: np.ndarray  # the loader's batch count from its start
    batch_iteration: np.ndarray
    batch_samples: np.ndarray
    read_batch: np.ndarray
    read_sample: np.ndarray
    read_file: np.ndarray
    read_offset: np.ndarray
    read_size: np.ndarray
    readers: list | None = None
    data_files: list[str] = field(default_factory=list)

    @property
    def batch_worker(self) -> np.ndarray:
        return self.batch_number % self.workers

    def reads_of(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(sample, file, offset, size)`` of micro-batch row ``batch``."""
        lo, hi = np.searchsorted(self.read_batch, [batch, batch + 1])
        return (
            self.read_sample[lo:hi],
            self.read_file[lo:hi],
            self.read_offset[lo:hi],
            self.read_size[lo:hi],
        )

    @property
    def bytes(self) -> int:
        return int(self.read_size.sum())

    def reads(self) -> list[tuple[int, int, str, int, int]]:
        """Every read as ``(rank, worker, file, offset, size)``, in order (for comparisons)."""
        rank = self.batch_rank[self.read_batch]
        worker = self.batch_worker[self.read_batch]
        return [
            (int(r), int(w), self.files[int(f)], int(o), int(s))
            for r, w, f, o, s in zip(rank, worker, self.read_file, self.read_offset, self.read_size)
        ]


def _repack_pieces(source, documents, start, end):
    return source.dataset.dataset.byte_ranges(documents, start, end - start)


def _prefix_pieces(source, documents, start, end):
    """``IndexedDataset.get``'s arithmetic: ``pointer + offset * itemsize`` of the ``.bin``."""
    index = source.dataset.dataset.index  # megatron-core's _IndexReader
    itemsize = np.dtype(index.dtype).itemsize
    pointers = np.asarray(index.sequence_pointers, dtype=np.int64)[documents]
    return None, pointers + start * itemsize, (end - start) * itemsize


def plan_reads(
    tracer: Tracer,
    first: int,
    last: int,
    ranks: tuple[int, ...],
    workers: int,
    layout: str,
    location: str,
) -> Plan:
    """The reads of ``ranks``' train loaders, ``workers`` each, for iterations ``first`` to
    ``last`` of the run ``tracer`` answers for.

    Raises:
        InputError: an iteration or a rank the run does not have.
    """
    tracer.check_iterations(first, last)
    dp = tracer.dp
    bad = [r for r in ranks if not 0 <= r < dp]
    if bad:
        raise InputError(f"--ranks: the run has data-parallel ranks 0 to {dp - 1}, not {bad[0]}")
    iterations = np.arange(first, last + 1, dtype=np.int64)
    rows = tracer.train_rows(iterations)
    keep = np.isin(rows.rank, np.asarray(ranks, dtype=np.int64))
    rows = rows.take(np.flatnonzero(keep))
    rows = rows.take(np.lexsort([rows.row, rows.microbatch, rows.iteration, rows.rank]))
    unit = tracer.schedule.micro_times_dp
    before, _ = locate(tracer.segments, rows.iteration - tracer.start)
    start_consumed = locate(tracer.segments, np.array([first - tracer.start]))[0][0]
    number = (before - start_consumed) // unit + rows.microbatch  # the loader's batch count

    # micro-batches: one per (rank, loader batch number), rows in order within it
    key = rows.rank * (int(number.max()) + 1 if len(number) else 1) + number
    boundaries = np.flatnonzero(np.diff(key)) + 1
    starts = np.concatenate([[0], boundaries]).astype(np.int64) if len(key) else key
    batch_of_row = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(key))))

    split = tracer.draws.split("train")
    dataset, sample = split.locate(rows.index)
    pieces = _repack_pieces if layout == "repack" else _prefix_pieces
    files: list[str] = []
    file_of: dict[str, int] = {}
    readers: list = []
    parts = []  # (row, piece order, file, offset, size)
    for position in np.unique(dataset):
        members = np.flatnonzero(dataset == position)
        source = split.datasets[int(position)]
        owner, documents, lo, hi = source.ranges(sample[members])
        shard, offsets, sizes = pieces(source, documents, lo, hi)
        if shard is None:  # a prefix: one file per dataset
            path = source.path + ".bin"
            fid = file_of.setdefault(path, len(file_of))
            if fid == len(readers):
                readers.append(source.dataset.dataset)
            file_ids = np.full(len(offsets), fid, dtype=np.int64)
        else:
            file_ids = shard
        order = np.arange(len(owner), dtype=np.int64)
        parts.append((members[owner], order, file_ids, offsets, sizes))
    if layout == "repack":
        repack = split.datasets[0].dataset.dataset.repack if split.datasets else None
        files = [repack.shard_path(k) for k in range(len(repack.manifest.shards))] if repack else []
        opened = len(files) + 1
        data_files = list(files)
    else:
        files = list(file_of)
        built = [d for s in tracer.draws.splits.values() if s is not None for d in s.datasets]
        opened = 2 * len(built)
        data_files = sorted({d.path + ".bin" for d in built})
    if parts:
        row, order, file_ids, offsets, sizes = (np.concatenate(x) for x in zip(*parts))
    else:
        row = order = file_ids = offsets = sizes = np.zeros(0, dtype=np.int64)
    sort = np.lexsort([order, row])
    row = row[sort]
    return Plan(
        layout=layout,
        location=location,
        files=files,
        opened=opened,
        first=first,
        last=last,
        ranks=tuple(ranks),
        workers=workers,
        micro_batch_size=tracer.mbs,
        seq_length=int(tracer.settings.values["seq_length"]),
        batch_rank=rows.rank[starts],
        batch_number=number[starts],
        batch_iteration=rows.iteration[starts],
        batch_samples=np.diff(np.append(starts, len(key))),
        read_batch=batch_of_row[row],
        read_sample=row,
        read_file=file_ids[sort],
        read_offset=offsets[sort],
        read_size=sizes[sort],
        readers=None if layout == "repack" else readers,
        data_files=data_files,
    )
