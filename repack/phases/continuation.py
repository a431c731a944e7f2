"""The continuation's inputs for the loader: which phase a build is, and what the phases before
it trained on.

Off unless asked: ``REPACK_PHASES=FILE`` and ``REPACK_PHASE=K`` (or the ``phases`` and
``phase`` arguments of :func:`repack.megatron.repacked` and
:func:`~repack.megatron.dataset_class`). Then the training split's ``GPTDataset`` s of phase
``K > 0`` order every source's documents by how many earlier phases trained on them
(:func:`repack.phases.draws.continued_indices`), those counts computed exactly by replaying
phases ``0 .. K-1`` (each continued from its own earlier phases) on the repack's index
(:func:`repack.phases.replay.replay`): the same on every rank and at every resume, with no
state carried between launches. Phase 0, and a source no earlier phase drew from, are stock's.
No Megatron imports.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from repack.doctor.splits import Settings
from repack.errors import PhaseError
from repack.phases.replay import replay
from repack.phases.schedule import Schedule, load_schedule

__all__ = ["PHASE_ENV_VAR", "PHASES_ENV_VAR", "earlier_counts", "selected"]

#: The phase schedule file, for the continuation (off when unset).
PHASES_ENV_VAR = "REPACK_PHASES"
#: The phase this launch trains (0 for the first).
PHASE_ENV_VAR = "REPACK_PHASE"

_LOCK = threading.Lock()
_COUNTS: dict[tuple, dict] = {}


def selected(phases: str | None, phase: int | None) -> tuple[Schedule, int] | None:
    """The schedule and phase a build continues, from the arguments given to the class, else
    ``REPACK_PHASES`` and ``REPACK_PHASE``; ``None`` when the continuation is off.

    Raises:
        PhaseError: one of the two without the other, a phase that is not a number of the
            schedule, or a schedule that cannot be read.
    """
    path = phases if phases is not None else os.environ.get(PHASES_ENV_VAR) or None
    raw = phase if phase is not None else os.environ.get(PHASE_ENV_VAR) or None
    if path is None and raw is None:
        return None
    if path is None or raw is None:
        raise PhaseError(
            f"the continuation needs both {PHASES_ENV_VAR} (the phase schedule) and "
            f"{PHASE_ENV_VAR} (this launch's phase); only "
            f"{PHASES_ENV_VAR if path is not None else PHASE_ENV_VAR} is set"
        )
    schedule = load_schedule(path)
    try:
        number = int(raw)
    except ValueError:
        number = -1
    if not 0 <= number < len(schedule.phases):
        raise PhaseError(
            f"{schedule.path}: {PHASE_ENV_VAR}={raw} is not a phase of this schedule "
            f"(0 to {len(schedule.phases) - 1})",
            path=schedule.path,
        )
    return schedule, number


def earlier_counts(
    schedule: Schedule, number: int, repack_dir: str, settings: Settings, seed: int
) -> dict[object, np.ndarray]:
    """Per source of the repack (``(-1, source id)``), the phases before ``number`` that trained
    on each of its sequences, each phase continued from those before it. Computed once per
    process for a schedule, phase, repack and settings.

    Args:
        schedule: The phase schedule.
        number: The phase being built.
        repack_dir: The repack holding the phases' sources.
        settings: The run's sequence length, split, surplus and extra token (``sizes`` unused).
        seed: The run's seed (a phase's own seed, if the schedule gives one, wins).

    Raises:
        PhaseError: the phase's own seed (or the schedule's) differs from this launch's, or
            the phase has a seed of its own and the schedule no run seed for the others.
        RepackError: a phase's blend cannot be read, or names a prefix not in the repack.
    """
    own = schedule.phases[number].seed
    expected = schedule.seed_of(number, seed)
    if expected != seed:
        field = f"phases[{number}].seed" if own is not None else "seed"
        raise PhaseError(
            f"{schedule.path}: {field} is {expected}, but this launch's seed is {seed}: "
            "the schedule does not describe this run",
            path=schedule.path,
        )
    if own is not None:
        if schedule.seed is None and any(p.seed is None for p in schedule.phases[:number]):
            raise PhaseError(
                f"{schedule.path}: phases[{number}] has a seed of its own, and an earlier phase "
                "has none: give the run's --seed as the schedule's top-level seed",
                path=schedule.path,
            )
        seed = schedule.seed if schedule.seed is not None else seed
    key = (schedule.path, schedule.digest(), number, repack_dir, settings, seed)
    with _LOCK:
        found = _COUNTS.get(key)
        if found is None:
            from repack.doctor.inputs import load

            phases = [
                (j, p.start_iteration, schedule.samples(j), schedule.seed_of(j, seed))
                for j, p in enumerate(schedule.phases[:number])
            ]
            _, found = replay(
                phases,
                lambda j: load(repack_dir, blend=schedule.phases[j].blend),
                settings,
                continued=True,
            )
            _COUNTS[key] = found
        return found
