"""The phase schedule file: which blend each phase of a run trains on, from which iteration.

A small JSON file, paths relative to it::

    {"global_batch_size": 512, "seed": 1234,
     "phases": [{"blend": "pretrain.json", "start_iteration": 0},
                {"blend": "anneal.json", "start_iteration": 90000, "seed": 1234}]}

It mirrors Megatron-LM's ``--phase-transition-iterations`` (the ``start_iteration`` of every
phase but the first): each launch trains one phase, on a ``BlendedDataset`` of that phase's
blend sized to the phase (``(next start - start) x global_batch_size`` samples; the last phase
up to ``--train-samples`` or ``--train-iters``), with the run's seed unless the phase sets its
own. ``seed`` (optional) is the run's ``--seed``: a loader building a phase with a seed of its
own needs it for the earlier phases that have none. No I/O but reading the file; the blends are
read by whoever uses the schedule.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass

from repack.errors import PhaseError

__all__ = ["Phase", "Schedule", "load_schedule"]

#: Refuse a schedule file larger than this (it names a few blends).
MAX_BYTES = 1 << 20
_TOP_KEYS = {"global_batch_size", "phases", "seed"}
_PHASE_KEYS = {"blend", "start_iteration", "seed"}


@dataclass(frozen=True)
class Phase:
    """One phase.

    Attributes:
        number: Its position in the schedule, from 0.
        blend: The blend file's path (absolute, or as written when it is a URL).
        start_iteration: The iteration it starts at (0 for the first).
        seed: Its own ``--seed``, or ``None`` for the run's.
    """

    number: int
    blend: str
    start_iteration: int
    seed: int | None = None


@dataclass(frozen=True)
class Schedule:
    """A run's phases, in order.

    Attributes:
        path: The schedule file.
        global_batch_size: ``--global-batch-size`` (constant: Megatron-LM checks it at every
            phase's resume).
        phases: The phases, the first starting at iteration 0.
        seed: The run's ``--seed``, if the schedule gives it.
    """

    path: str
    global_batch_size: int
    phases: tuple[Phase, ...]
    seed: int | None = None

    def samples(self, number: int, train_samples: int | None = None) -> int:
        """The training samples of phase ``number`` (what Megatron-LM's
        ``get_train_valid_test_num_samples`` asks the builder for in that launch).

        Args:
            number: The phase.
            train_samples: The run's training samples (``--train-samples``, or
                ``--train-iters`` x the global batch size), needed for the last phase only.

        Raises:
            PhaseError: the last phase without ``train_samples``, or one ending before it starts.
        """
        phase = self.phases[number]
        start = phase.start_iteration * self.global_batch_size
        if number + 1 < len(self.phases):
            return self.phases[number + 1].start_iteration * self.global_batch_size - start
        if train_samples is None:
            raise PhaseError(
                f"{self.path}: the last phase's samples need the run's --train-samples or "
                "--train-iters",
                path=self.path,
            )
        if train_samples <= start:
            raise PhaseError(
                f"{self.path}: phases[{number}].start_iteration {phase.start_iteration} x "
                f"global_batch_size {self.global_batch_size} = {start} samples, at or past the "
                f"run's {train_samples} training samples: the phase has none",
                path=self.path,
            )
        return train_samples - start

    def seed_of(self, number: int, default: int) -> int:
        """Phase ``number``'s seed: its own, else the schedule's, else ``default``."""
        own = self.phases[number].seed
        if own is not None:
            return own
        return default if self.seed is None else self.seed

    @functools.cached_property
    def _digest(self) -> str:
        digest = hashlib.sha256(f"{self.global_batch_size}\0{self.seed}".encode())
        for phase in self.phases:
            digest.update(f"\0{phase.start_iteration}\0{phase.seed}\0".encode())
            try:
                with open(phase.blend, "rb") as file:
                    digest.update(file.read())
            except OSError:
                digest.update(phase.blend.encode())
        return digest.hexdigest()[:16]

    def digest(self) -> str:
        """A short hash of the schedule's content and of every blend file's bytes (read once):
        what names the cached indices of a continued phase (:mod:`repack.phases.continuation`)."""
        return self._digest


def _fail(path: str, message: str) -> PhaseError:
    return PhaseError(f"{path}: {message}", path=path)


def _integer(path: str, where: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, f"{where} is {json.dumps(value)}; expected an integer >= {minimum}")
    return value


def load_schedule(path: str | os.PathLike[str]) -> Schedule:
    """Read and check a phase schedule file.

    Raises:
        PhaseError: the file cannot be read, is not JSON, or a field is missing, of the wrong
            type or out of order; the message names the file and the field.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_BYTES + 1)
    except OSError as err:
        raise _fail(path, f"cannot read the phase schedule ({err.strerror or err})") from None
    if len(raw) > MAX_BYTES:
        raise _fail(path, f"larger than {MAX_BYTES} bytes; a phase schedule names a few blends")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _fail(path, f"not JSON ({err})") from None
    if not isinstance(data, dict):
        raise _fail(path, 'expected an object {"global_batch_size": G, "phases": [...]}')
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise _fail(path, f"unknown field {unknown[0]!r}; expected global_batch_size, phases, seed")
    if "global_batch_size" not in data:
        raise _fail(path, "global_batch_size is missing")
    batch = _integer(path, "global_batch_size", data["global_batch_size"], 1)
    run_seed = data.get("seed")
    if run_seed is not None:
        run_seed = _integer(path, "seed", run_seed, 0)
    items = data.get("phases")
    if not isinstance(items, list) or not items:
        raise _fail(path, "phases is missing or not a non-empty list")
    folder = os.path.dirname(os.path.abspath(path))
    phases = []
    for number, item in enumerate(items):
        where = f"phases[{number}]"
        if not isinstance(item, dict):
            raise _fail(path, f"{where} is {json.dumps(item)}; expected an object")
        unknown = sorted(set(item) - _PHASE_KEYS)
        if unknown:
            expected = "expected blend, start_iteration, seed"
            raise _fail(path, f"{where}: unknown field {unknown[0]!r}; {expected}")
        blend = item.get("blend")
        if not isinstance(blend, str) or not blend:
            raise _fail(path, f"{where}.blend is {json.dumps(blend)}; expected a blend file's path")
        if "://" not in blend:
            blend = os.path.normpath(os.path.join(folder, blend))
        if "start_iteration" not in item:
            raise _fail(path, f"{where}.start_iteration is missing")
        start = _integer(path, f"{where}.start_iteration", item["start_iteration"], 0)
        if number == 0 and start != 0:
            raise _fail(path, f"{where}.start_iteration is {start}; the first phase starts at 0")
        if number > 0 and start <= phases[-1].start_iteration:
            raise _fail(
                path,
                f"{where}.start_iteration {start} is not after the previous phase's "
                f"{phases[-1].start_iteration}",
            )
        seed = item.get("seed")
        if seed is not None:
            seed = _integer(path, f"{where}.seed", seed, 0)
        phases.append(Phase(number, blend, start, seed))
    return Schedule(path, batch, tuple(phases), run_seed)
