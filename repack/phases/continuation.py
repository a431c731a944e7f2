"""The continuation's inputs for the loader: which phase a build is, and what the phases before
it trained on.

Off unless asked: ``REPACK_PHASES=FILE`` and ``REPACK_PHASE=K`` (or the ``phases`` and
``phase`` arguments of :func:`repack.megatron.repacked` and
:func:`~repack.megatron.dataset_class`). Then the training split's ``GPTDataset`` s of phase
``K > 0`` order every source's documents by how many earlier phases trained on them
(:func:`repack.model.gpt_indices.continued_indices`), those counts computed exactly by replaying
phases ``0 .. K-1`` (each continued from its own earlier phases) on the repack's index
(:func:`repack.phases.replay.replay`): the same on every rank and at every resume, with no
state carried between launches. Phase 0, and a source no earlier phase drew from, are stock's.
No Megatron imports.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading

import numpy as np

from repack.errors import PhaseError
from repack.model.splits import Settings
from repack.phases.environment import PHASE_ENV_VAR, PHASES_ENV_VAR
from repack.phases.replay import replay
from repack.phases.schedule import Schedule, load_schedule

__all__ = [
    "PHASE_ENV_VAR",
    "PHASES_ENV_VAR",
    "announce",
    "check_launch",
    "earlier_counts",
    "selected",
]

logger = logging.getLogger(__name__)


_LOCK = threading.Lock()
_COUNTS: dict[tuple, dict] = {}
_PLANS: dict[tuple, dict] = {}
_SCHEDULES: dict[tuple, Schedule] = {}
_ANNOUNCED: set[tuple] = set()


def _schedule(path: str) -> Schedule:
    """The schedule at ``path``, read once per process while the file is unchanged (a build
    asks for it once per dataset)."""
    try:
        stat = os.stat(path)
        key = (os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
    except OSError:
        return load_schedule(path)  # says why it cannot be read
    with _LOCK:
        found = _SCHEDULES.get(key)
    if found is None:
        found = load_schedule(path)
        with _LOCK:
            _SCHEDULES[key] = found
    return found


def announce(schedule: Schedule, phase: int, *, given: bool) -> None:
    """Say, once per process and phase, that a build follows the schedule: a leftover
    ``export REPACK_PHASES=...`` must not change a run's data unseen. Logged as a warning
    (Python's logging shows warnings unconfigured, as Megatron's builder logs its builds);
    ``given``: from the class's arguments rather than the environment."""
    key = (schedule.path, phase)
    with _LOCK:
        if key in _ANNOUNCED:
            return
        _ANNOUNCED.add(key)
    try:
        with open(schedule.path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        digest = "unreadable now"
    source = "phases= and phase=" if given else f"{PHASES_ENV_VAR} and {PHASE_ENV_VAR}"
    order = (
        "stock Megatron's order (the first phase)"
        if phase == 0
        else "the continuation: in every source, the documents no earlier phase trained on "
        "come first (not stock Megatron's order)"
    )
    logger.warning(
        "repack: the training split is phase %d of %d of the schedule %s (sha256 %s, from %s): %s",
        phase,
        len(schedule.phases),
        schedule.path,
        digest,
        source,
        order,
    )


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
    schedule = _schedule(path)
    try:
        number = int(raw)
    except ValueError:
        number = -1
    if not 0 <= number < len(schedule.phases):
        raise PhaseError(
            f"{schedule.path}: phase {raw} ({PHASE_ENV_VAR} or phase=) is not a phase of this "
            "schedule "
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
            from repack.inputs.facts import load

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


def check_launch(
    schedule: Schedule,
    number: int,
    repack_dir: str,
    settings: Settings,
    seed: int,
    key: object,
    num_samples: int | None,
    prefix: str,
) -> None:
    """Refuse a launch that is not the schedule's phase ``number``: a source of its training
    split that the phase's blend does not name, or builds for another number of samples (a
    phase before the last: its samples are the schedule's). The earlier phases' draws are
    computed from the schedule, so a schedule that does not describe the run would continue
    from draws that never happened.

    Raises:
        PhaseError: the source is not in the phase's blend, or asked other samples.
    """
    if number + 1 >= len(schedule.phases):
        return  # the last phase's samples depend on the run's --train-samples / --train-iters
    from repack.inputs.facts import load
    from repack.phases.replay import train_plan

    plan_key = (schedule.path, schedule.digest(), number, repack_dir, settings)
    with _LOCK:
        plans = _PLANS.get(plan_key)
        if plans is None:
            loaded = load(repack_dir, blend=schedule.phases[number].blend)
            sized = Settings(
                sequence_length=settings.sequence_length,
                sizes=(schedule.samples(number), 0, 0),
                split=settings.split,
                surplus=settings.surplus,
                add_extra_token=settings.add_extra_token,
                release=settings.release,
                fma=settings.fma,
            )
            plans = {}
            for plan in train_plan(loaded, sized):
                plans.setdefault(loaded.sources[plan.key].identity, []).append(plan.num_samples)
            _PLANS[plan_key] = plans
    blend = schedule.phases[number].blend
    if key not in plans:
        raise PhaseError(
            f"{schedule.path}: phase {number}'s blend {blend} does not name {prefix}, which this "
            "launch trains on: the schedule does not describe this run "
            f"(is {PHASE_ENV_VAR} right?)",
            path=schedule.path,
        )
    if num_samples not in plans[key]:
        raise PhaseError(
            f"{schedule.path}: phase {number} builds {prefix} for {plans[key][0]} samples "
            f"({schedule.samples(number):,} for the phase), this launch for {num_samples}: the "
            "schedule does not describe this run (global_batch_size, start_iteration, weights?)",
            path=schedule.path,
        )
