"""Which samples an iteration read, and where a document or a source was read: the answers.

Each answer joins three steps, each vectorised over numpy arrays:

1. the schedule (:mod:`repack.trace.batches`): iteration <-> the samples consumed before it;
2. the sampler (:mod:`repack.samples.samplers`): consumed samples, rank and row <-> the split's
   index;
3. the datasets Megatron builds (:mod:`repack.trace.draws`): the split's index <-> the source, the
   sample of its dataset and the documents with their token ranges.

Validation: the evaluation after iteration ``N`` (every ``--eval-interval`` iterations, and
once after the last) reads ``--eval-iters`` batches of the eval global batch size from the
validation loader, which continues where the previous evaluation stopped
(``args.consumed_valid_samples``, Megatron-LM's ``evaluate``).

A run in blend phases (Megatron-LM's ``--phase-transition-iterations``) is one :class:`Tracer`
per phase, each over the datasets that phase's launch built, given the phase's :class:`Window`:
its loaders start at the phase's first sample (``(iteration - last transition) x global batch``)
while the iterations and evaluations it answers with are the run's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from repack.errors import InputError
from repack.samples.samplers import Sampler
from repack.trace.batches import iteration_of, locate
from repack.trace.draws import Draws, SplitDraws
from repack.trace.settings import TraceSettings, UnsupportedRun

__all__ = ["Answer", "Tracer", "Window"]


@dataclass(frozen=True)
class Window:
    """The iterations one launch of a run in phases trains: ``start + 1`` to ``end``.

    Attributes:
        phase: The phase's number (0 for the first).
        start: The iteration it starts at (the previous transition; 0 for the first).
        end: Its last iteration (the next transition, or the run's last).
    """

    phase: int
    start: int
    end: int


@dataclass
class Rows:
    """Loader positions of split indices: parallel arrays, one entry per read."""

    iteration: np.ndarray
    rank: np.ndarray
    microbatch: np.ndarray
    row: np.ndarray
    index: np.ndarray
    evaluation: np.ndarray | None = None

    def order(self) -> np.ndarray:
        keys = [self.row, self.microbatch, self.rank, self.iteration]
        if self.evaluation is not None:
            keys.insert(3, self.evaluation)
        return np.lexsort(keys)

    def take(self, order: np.ndarray) -> Rows:
        return Rows(
            *(getattr(self, k)[order] for k in ("iteration", "rank", "microbatch", "row", "index")),
            evaluation=None if self.evaluation is None else self.evaluation[order],
        )


@dataclass
class Answer:
    """What ``repack trace`` prints: samples (forward, ``--source``) or occurrences
    (``--document``), for training and for the evaluations."""

    kind: str  # "samples" or "occurrences"
    train: list[dict[str, Any]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    header: dict[str, Any] = field(default_factory=dict)
    #: Lines the table starts with (not in the JSON, whose header says the same).
    summary: list[str] = field(default_factory=list)
    #: How many of the first notes were already shown on stderr (the table leaves them out).
    said: int = 0

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {self.kind: self.train, "validation": self.validation}
        data["skipped_iterations"] = self.skipped
        data["notes"] = self.notes
        data.update(self.header)
        return data


class Tracer:
    """A run's datasets and loaders, asked which data went where.

    Args:
        draws: The run's datasets (:func:`repack.trace.draws.build_draws`); with ``window``, those
            of that phase's launch.
        settings: The run's settings.
        window: One phase of a run in phases (its batch size constant): the train loader
            starts at the phase's first sample, iterations and evaluations are the run's.
    """

    def __init__(self, draws: Draws, settings: TraceSettings, window: Window | None = None) -> None:
        self.draws = draws
        self.settings = settings
        v = settings.values
        self.window = window or Window(0, 0, settings.train_iters)
        self.start = self.window.start  # iterations before the first this launch trains
        #: One launch of a run in phases (not the whole run).
        self.phased = self.start > 0 or self.window.end < settings.train_iters
        self.schedule = settings.schedule
        self.segments = self.schedule.segments(self.window.end - self.start)
        if len(self.segments):
            last = self.segments[-1]
            self.consumed_total = int(last[1] + last[2] * last[3])
        else:
            self.consumed_total = 0
        self.dp = int(v["data_parallel_size"])
        self.mbs = int(v["micro_batch_size"])
        train = draws.split("train")
        self.train_sampler = Sampler(
            v["dataloader_type"], train.size, self.mbs, self.dp, bool(v["data_sharding"])
        )
        self._check_sampler(self.train_sampler, "train")
        self.emb = int(v["eval_micro_batch_size"])
        self.egbs = int(v["eval_global_batch_size"])
        self.points = settings.eval_points()
        #: The evaluations this launch runs (indices of ``points``): one at a transition
        #: belongs to the phase ending there (Megatron-LM evaluates before it exits).
        self.evaluations = [
            k for k, point in enumerate(self.points) if self.start < point <= self.window.end
        ]
        valid = draws.splits.get("valid")
        self.valid_sampler = None
        if valid is not None and self.points:
            self.valid_sampler = Sampler(
                v["dataloader_type"], valid.size, self.emb, self.dp, bool(v["data_sharding"])
            )
            self._check_sampler(self.valid_sampler, "valid")

    def _check_sampler(self, sampler: Sampler, split: str) -> None:
        if sampler.uneven():
            raise UnsupportedRun(
                f"--dataloader-type cyclic with --no-data-sharding: the {split} split's "
                f"{sampler.total:,} samples give Megatron's ranks different numbers of "
                "micro-batches per epoch, and its ranks then read out of step; not reproduced"
            )

    # --- loader positions -----------------------------------------------------------------

    def train_rows(self, iterations: np.ndarray) -> Rows:
        consumed, batch = locate(self.segments, iterations - self.start)
        steps = batch // self.schedule.micro_times_dp
        unit = self.schedule.micro_times_dp
        it = np.repeat(iterations, steps * unit)
        base = np.repeat(consumed, steps * unit)
        starts = np.concatenate([[0], np.cumsum(steps * unit)[:-1]])
        k = np.arange(int((steps * unit).sum())) - np.repeat(starts, steps * unit)
        microbatch, rest = k // unit, k % unit
        rank, row = rest // self.mbs, rest % self.mbs
        self._check_left(self.train_sampler, base + microbatch * unit, it, "train")
        index = self.train_sampler.indices(base + microbatch * unit, rank, row)
        return Rows(it, rank, microbatch, row, index)

    def _check_left(self, sampler: Sampler, consumed: np.ndarray, when: np.ndarray, split: str):
        """A single loader stops when fewer than a micro-batch step of samples are left (its
        last partial step is dropped): the run stops there, with StopIteration."""
        if sampler.kind != "single" or not len(consumed):
            return
        beyond = np.flatnonzero(consumed + sampler.unit > sampler.total)
        if len(beyond):
            raise InputError(
                f"{self.draws.target}: Megatron's {split} loader has no samples left at iteration "
                f"{int(when[beyond[0]]):,} ({sampler.total:,} samples, {sampler.unit} a "
                "micro-batch step): the run stops there"
            )

    def _valid_rows(self, evaluations: np.ndarray) -> Rows:
        assert self.valid_sampler is not None
        unit = self.emb * self.dp
        per = int(self.settings.values["eval_iters"]) * self.egbs  # samples per evaluation
        k = np.arange(per)
        evaluation = np.repeat(evaluations, per)
        k = np.tile(k, len(evaluations))
        microbatch, rest = k // unit, k % unit
        rank, row = rest // self.emb, rest % self.emb
        iteration = np.asarray(self.points, dtype=np.int64)[evaluation]
        consumed = evaluation * per + microbatch * unit
        self._check_left(self.valid_sampler, consumed, iteration, "validation")
        index = self.valid_sampler.indices(consumed, rank, row)
        return Rows(iteration, rank, microbatch, row, index, evaluation)

    def check_iterations(self, first: int, last: int) -> None:
        if first <= self.start or last > self.window.end or first > last:
            whose = f"phase {self.window.phase}" if self.phased else "the run"
            raise InputError(
                f"iterations {first}:{last}: {whose} has iterations {self.start + 1:,} to "
                f"{self.window.end:,}"
            )

    # --- answers -----------------------------------------------------------------------------

    def iterations(self, first: int, last: int, *, tokens: bool = False, decode=None) -> Answer:
        """The samples of iterations ``first`` to ``last`` (both included), and of the
        evaluations run after them."""
        self.check_iterations(first, last)
        answer = Answer("samples")
        rows = self.train_rows(np.arange(first, last + 1, dtype=np.int64))
        answer.train = self._samples(self.draws.split("train"), rows, tokens, decode)
        answer.skipped = sorted(i for i in self.settings.skipped if first <= i <= last)
        shown = np.arange(first, min(last, first + 4) + 1, dtype=np.int64)
        for iteration, consumed, batch in zip(shown, *locate(self.segments, shown - self.start)):
            steps = int(batch) // self.schedule.micro_times_dp
            skipped = ", skipped" if int(iteration) in self.settings.skipped else ""
            answer.summary.append(
                f"iteration {int(iteration):,}: {int(batch):,} samples ({self.dp} ranks x "
                f"{steps} micro-batches x {self.mbs} rows), {int(consumed):,} consumed before "
                f"it{' in its phase' if self.phased else ''}{skipped}"
            )
        evaluations = [k for k, point in enumerate(self.points) if first <= point <= last]
        if evaluations and self.valid_sampler is not None:
            rows = self._valid_rows(np.asarray(evaluations, dtype=np.int64))
            answer.validation = self._samples(self.draws.split("valid"), rows, tokens, decode)
        return answer

    def _samples(self, split: SplitDraws, rows: Rows, tokens: bool, decode) -> list[dict]:
        dataset, sample = split.locate(rows.index)
        out: list[dict[str, Any]] = [{} for _ in range(len(rows.index))]
        for position in np.unique(dataset):
            members = np.flatnonzero(dataset == position)
            source = split.datasets[int(position)]
            owner, documents, start, end = source.ranges(sample[members])
            bounds = np.searchsorted(owner, np.arange(len(members) + 1))
            for n, member in enumerate(members.tolist()):
                lo, hi = bounds[n], bounds[n + 1]
                record: dict[str, Any] = {
                    "iteration": int(rows.iteration[member]),
                    "rank": int(rows.rank[member]),
                    "microbatch": int(rows.microbatch[member]),
                    "row": int(rows.row[member]),
                    "index": int(rows.index[member]),
                    "source": source.source,
                    "sample": int(sample[member]),
                    "documents": [
                        {"document": int(d), "start": int(s), "end": int(e)}
                        for d, s, e in zip(documents[lo:hi], start[lo:hi], end[lo:hi])
                    ],
                }
                if rows.evaluation is not None:
                    record["evaluation"] = int(rows.evaluation[member])
                if tokens or decode is not None:
                    ids = np.concatenate(
                        [np.zeros(0, dtype=np.int64)]
                        + [
                            source.tokens(d, s, e).astype(np.int64)
                            for d, s, e in zip(documents[lo:hi], start[lo:hi], end[lo:hi])
                        ]
                    )
                    if tokens:
                        record["tokens"] = ids.tolist()
                    if decode is not None:
                        record["text"] = decode(ids.tolist())
                out[member] = record
        order = rows.order()
        return [out[i] for i in order.tolist()]

    def _find(self, split: SplitDraws, source: str) -> list[int]:
        absolute = os.path.abspath(source) if "://" not in source else source
        return [d.position for d in split.datasets if d.source == source or d.path == absolute]

    def has_source(self, source: str) -> bool:
        """Whether one of the run's splits reads ``source``."""
        return any(
            split is not None and bool(self._find(split, source))
            for split in self.draws.splits.values()
        )

    def _check_source(self, source: str) -> None:
        if self.has_source(source):
            return
        names = sorted({d.source for s in self.draws.splits.values() if s for d in s.datasets})
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise InputError(f"{self.draws.target}: no source {source!r} in the run's blend ({shown})")

    def _train_positions(self, index: np.ndarray) -> Rows:
        which, consumed, rank, row = self.train_sampler.positions(index, self.consumed_total)
        iteration, within = iteration_of(self.segments, consumed)
        keep = iteration > 0
        unit = self.schedule.micro_times_dp
        return Rows(
            iteration[keep] + self.start,
            rank[keep],
            within[keep] // unit,
            row[keep],
            index[which[keep]],
        ), which[keep]

    def _valid_positions(self, index: np.ndarray):
        assert self.valid_sampler is not None
        per = int(self.settings.values["eval_iters"]) * self.egbs
        last = per * (self.evaluations[-1] + 1) if self.evaluations else 0
        which, consumed, rank, row = self.valid_sampler.positions(index, last)
        if self.evaluations:  # the earlier phases ran the evaluations before
            keep = consumed >= per * self.evaluations[0]
            which, consumed, rank, row = which[keep], consumed[keep], rank[keep], row[keep]
        evaluation = consumed // per
        iteration = np.asarray(self.points, dtype=np.int64)[evaluation]
        microbatch = (consumed % per) // (self.emb * self.dp)
        return Rows(iteration, rank, microbatch, row, index[which], evaluation), which

    def _read_splits(self):
        """``(split, its loader positions of split indices)`` of the splits the run reads:
        train, and valid where it evaluates."""
        splits = [("train", self._train_positions)]
        if self.valid_sampler is not None:
            splits.append(("valid", self._valid_positions))
        return splits

    def document(self, source: str, document: int) -> Answer:
        """Every read of sequence ``document`` of ``source``: training iterations, and
        evaluations."""
        self._check_source(source)
        answer = Answer("occurrences")
        keys = ("iteration", "rank", "microbatch", "row", "index", "start", "end")
        for name, positions in self._read_splits():
            split = self.draws.split(name)
            columns: list[list[np.ndarray]] = []
            for position in self._find(split, source):
                draws = split.datasets[position]
                if not 0 <= document < len(draws.dataset.dataset.sequence_lengths):
                    raise InputError(
                        f"{source}: no document {document}: the source has "
                        f"{len(draws.dataset.dataset.sequence_lengths):,} (sequences of its .idx)"
                    )
                sample, start, end = draws.holding(document)
                index, which = split.positions(position, sample)
                rows, read = positions(index)
                pick = which[read]
                found = [rows.iteration, rows.rank, rows.microbatch, rows.row, rows.index]
                found += [start[pick], end[pick]]
                if rows.evaluation is not None:
                    found.append(rows.evaluation)
                columns.append(found)
            records: list[dict[str, Any]] = []
            if columns:
                merged = [np.concatenate(column) for column in zip(*columns)]
                # by iteration, evaluation, rank, micro-batch, row, start
                sort_by = [merged[5], merged[3], merged[2], merged[1]]
                if len(merged) > len(keys):
                    sort_by.append(merged[len(keys)])
                order = np.lexsort([*sort_by, merged[0]])
                lists = [column[order].tolist() for column in merged]
                names = keys + ("evaluation",) * (len(merged) > len(keys))
                records = [dict(zip(names, values)) for values in zip(*lists)]
            setattr(answer, "train" if name == "train" else "validation", records)
        answer.skipped = sorted({r["iteration"] for r in answer.train} & self.settings.skipped)
        return answer

    def source(self, source: str, *, tokens: bool = False, decode=None) -> Answer:
        """Every sample read from ``source``, in training and in evaluations."""
        self._check_source(source)
        answer = Answer("samples")
        for name, positions in self._read_splits():
            split = self.draws.split(name)
            found: list[dict[str, Any]] = []
            for position in self._find(split, source):
                if split.blended:
                    index = np.flatnonzero(np.asarray(split.top.dataset_index) == position)
                else:
                    index = np.arange(split.size, dtype=np.int64)
                rows, _ = positions(index)
                found += self._samples(split, rows, tokens, decode)
            key = ("iteration", "evaluation", "rank", "microbatch", "row")
            found.sort(key=lambda r: tuple(r.get(k, 0) for k in key))
            setattr(answer, "train" if name == "train" else "validation", found)
        answer.skipped = sorted({r["iteration"] for r in answer.train} & self.settings.skipped)
        return answer
