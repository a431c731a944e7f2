"""Which samples an iteration consumes: Megatron-LM's batch-size schedule, as pure arithmetic.

Megatron-LM's training loop advances ``args.consumed_train_samples`` by the iteration's batch,
``data_parallel_size * micro_batch_size * num_microbatches``, where the number of micro-batches
comes from the num-microbatches calculator at the samples consumed so far
(``megatron/core/num_microbatches_calculator.py``):

* constant: ``global_batch_size``;
* ``--rampup-batch-size START INCREMENT SAMPLES`` (``RampupBatchsizeNumMicroBatchesCalculator``,
  megatron-core 0.17 and earlier; 0.18 and later ignore it): ``START + int(consumed /
  (SAMPLES / increments)) * INCREMENT`` while ``consumed <= SAMPLES``, then the full batch;
* ``--step-batch-size-schedule "THRESHOLD:BS ..."`` (``StepBatchsizeNumMicroBatchesCalculator``,
  0.18 and later): the batch of the last threshold reached, thresholds in tokens (divided by
  ``--seq-length``, as Megatron-LM passes it) with K, M, B, T suffixes.

An iteration named in ``--iterations-to-skip`` consumes its batch all the same (its
``dummy_train_step`` reads every micro-batch): it is reported, and marked skipped. Megatron-LM
0.16 and earlier test ``iteration in args.iterations_to_skip`` before counting the iteration
(so ``--iterations-to-skip 5`` skips the 6th, logged as iteration 6); 0.17 and later test
``iteration + 1`` (the 5th). Iterations here are always the numbers Megatron-LM logs, from 1.

The schedule is held as segments of iterations with one batch size, so that any iteration and
any sample position is answered without a loop over iterations. ``tests/test_trace.py``
compares it with Megatron's own calculator classes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

__all__ = ["Schedule", "parse_step_schedule"]


def _number(text: str) -> int:
    """``StepBatchsizeNumMicroBatchesCalculator._parse_numeric_value``."""
    text = text.strip().upper()
    multiplier = 1
    for suffix, factor in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if text.endswith(suffix):
            multiplier, text = factor, text[:-1]
            break
    return int(float(text) * multiplier)


def parse_step_schedule(text: str, seq_length: int | None) -> list[tuple[int, int]]:
    """``StepBatchsizeNumMicroBatchesCalculator._parse_schedule`` and its checks:
    ``[(threshold in samples, batch size)]``, sorted.

    Raises:
        ValueError: not ``THRESHOLD:BS`` pairs, no threshold 0, thresholds not increasing, or
            a batch size that is not positive (where Megatron fails an assertion).
    """
    schedule = []
    for entry in text.strip().replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(f'invalid schedule entry "{entry}"; expected THRESHOLD:BATCH_SIZE')
        threshold, batch = entry.split(":", 1)
        try:
            threshold_n, batch_n = _number(threshold), _number(batch)
        except ValueError:
            raise ValueError(f'invalid schedule entry "{entry}": not numbers') from None
        if seq_length is not None:
            threshold_n //= seq_length
        schedule.append((threshold_n, batch_n))
    schedule.sort(key=lambda pair: pair[0])
    if not schedule or schedule[0][0] != 0:
        raise ValueError("the first schedule entry must have threshold 0")
    for (a, _), (b, _) in itertools.pairwise(schedule):
        if b <= a:
            raise ValueError(f"schedule thresholds must be strictly increasing ({a}, then {b})")
    if any(batch <= 0 for _, batch in schedule):
        raise ValueError("schedule batch sizes must be positive")
    return schedule


@dataclass(frozen=True)
class Schedule:
    """The batch of every iteration of a run.

    Attributes:
        micro_batch_size: ``--micro-batch-size``.
        data_parallel_size: Data-parallel ranks.
        global_batch_size: ``--global-batch-size`` (the final batch under a ramp).
        rampup: ``(start, increment, samples)``, or ``None``.
        steps: ``[(threshold samples, batch)]`` of ``--step-batch-size-schedule``, or ``None``.
    """

    micro_batch_size: int
    data_parallel_size: int
    global_batch_size: int
    rampup: tuple[int, int, int] | None = None
    steps: tuple[tuple[int, int], ...] | None = None

    @property
    def micro_times_dp(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def check(self) -> None:
        """Megatron's checks of the batch sizes (``ValueError`` where it fails an assertion)."""
        unit = self.micro_times_dp
        if self.steps is None and self.global_batch_size % unit:
            raise ValueError(
                f"global batch size {self.global_batch_size} is not divisible by micro batch "
                f"size {self.micro_batch_size} times data-parallel size {self.data_parallel_size}"
            )
        if self.rampup is not None:
            start, increment, _ = self.rampup
            diff = self.global_batch_size - start
            if increment <= 0 or diff < 0 or diff % increment:
                raise ValueError(
                    f"--rampup-batch-size {start} {increment} ...: the global batch size "
                    f"{self.global_batch_size} must be START plus a multiple of INCREMENT"
                )

    def batch_at(self, consumed: int) -> int:
        """The global batch size of the iteration that starts at ``consumed`` samples (the
        calculator's ``update(consumed)``)."""
        if self.steps is not None:
            batch = self.steps[0][1]
            for threshold, size in self.steps:
                if consumed >= threshold:
                    batch = size
                else:
                    break
            return batch
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples = self.rampup
        if consumed > samples:
            return self.global_batch_size
        per_increment = samples / ((self.global_batch_size - start) // increment)
        return start + int(consumed / per_increment) * increment

    def _checked_batch(self, consumed: int) -> int:
        batch = self.batch_at(consumed)
        if batch % self.micro_times_dp:
            raise ValueError(
                f"the global batch size at {consumed:,} consumed samples, {batch}, is not "
                f"divisible by micro batch size {self.micro_batch_size} times data-parallel "
                f"size {self.data_parallel_size} (Megatron stops there)"
            )
        return batch

    def segments(self, iterations: int) -> np.ndarray:
        """Runs of iterations with one batch size, up to ``iterations``: rows of
        ``(first iteration, consumed before it, batch, iterations in the run)``."""
        rows = []
        iteration, consumed = 1, 0
        while iteration <= iterations:
            batch = self._checked_batch(consumed)
            lo, hi = 1, iterations - iteration + 1
            while lo < hi:  # the batch is constant over an interval of consumed samples
                mid = (lo + hi + 1) // 2
                if self.batch_at(consumed + (mid - 1) * batch) == batch:
                    lo = mid
                else:
                    hi = mid - 1
            rows.append((iteration, consumed, batch, lo))
            iteration += lo
            consumed += lo * batch
        return np.array(rows, dtype=np.int64).reshape(-1, 4)

    def iterations_for(self, train_samples: int, release: tuple[int, int]) -> int:
        """``update_train_iters`` of Megatron-LM ``release``: the iterations of a run given
        ``--train-samples``."""
        if self.steps is not None:  # 0.18 and later: while consumed < train_samples
            iterations, consumed = 0, 0
            while consumed < train_samples:
                batch = self.batch_at(consumed)
                lo, hi = 1, -(-(train_samples - consumed) // batch)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if self.batch_at(consumed + (mid - 1) * batch) == batch:
                        lo = mid
                    else:
                        hi = mid - 1
                iterations += lo
                consumed += lo * batch
            return iterations
        if self.rampup is None:
            return train_samples // self.global_batch_size
        # 0.17 and earlier: the ramp one iteration at a time, then whole batches
        iterations, consumed = 0, 0
        ramp = int(self.rampup[2])
        while consumed <= ramp and consumed <= train_samples:
            consumed += self.batch_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations


def locate(segments: np.ndarray, iterations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(consumed before, batch)`` of each iteration (numbers from 1)."""
    iterations = np.asarray(iterations, dtype=np.int64)
    row = np.searchsorted(segments[:, 0], iterations, side="right") - 1
    first, consumed, batch = segments[row, 0], segments[row, 1], segments[row, 2]
    return consumed + (iterations - first) * batch, batch


def iteration_of(segments: np.ndarray, consumed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The iteration that reads sample position ``consumed`` (of the train loader's stream),
    and the position within its batch; iteration 0 where the run never gets there."""
    consumed = np.asarray(consumed, dtype=np.int64)
    row = np.searchsorted(segments[:, 1], consumed, side="right") - 1
    first, start, batch, count = (segments[row, k] for k in range(4))
    step = (consumed - start) // batch
    inside = step < count
    iteration = np.where(inside, first + step, 0)
    return iteration, np.where(inside, consumed - start - step * batch, 0)
