"""``repack trace --phases FILE``: a run in blend phases, one launch per phase.

Megatron-LM's ``--phase-transition-iterations`` (megatron/training/training.py) ends a launch at
each transition; the launch resumed at ``args.iteration`` then

* sizes the train split to its phase (``get_train_valid_test_num_samples``: the next transition's
  samples minus the last one's, transitions ``[0] + [t x global batch] + [args.train_samples]``),
  the valid and test splits to the whole run's, and builds them from its own blend, with its
  seed;
* starts the train loader at ``(args.iteration - last transition) x global batch``
  (``build_train_valid_test_data_loaders``), the valid loader at ``args.consumed_valid_samples``
  (which carries on across phases);
* evaluates at every ``--eval-interval`` before its exit check, so an evaluation at a
  transition is the ending phase's; only the last phase reaches the evaluation after the loop.

So each phase is one :class:`~repack.trace.query.Tracer` over that phase's datasets, given the
phase's :class:`~repack.trace.query.Window`; this module builds them and merges their answers.
The run's global batch size is constant (consumed = iteration x global batch; Megatron-LM's
resume compares it): a ramp or a batch-size schedule is refused. The transitions are sized from
``args.train_samples``, which ``--train-iters`` leaves ``None`` (Megatron-LM's comparison with it
fails): phased runs give ``--train-samples``, and so does trace.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from repack.errors import InputError, PhaseError
from repack.phases.schedule import Schedule, load_schedule
from repack.trace.build import build_datasets, header
from repack.trace.query import Answer, Tracer, Window
from repack.trace.settings import TraceSettings, release_of

__all__ = ["check_environment", "phase_windows", "trace_phases"]


def check_environment(target: Any, *, continued: bool) -> None:
    """Refuse ``REPACK_PHASES`` / ``REPACK_PHASE`` in trace's own environment for a repack:
    the repacked class would read them and silently trace the continuation; trace takes the
    continuation only as ``--phases FILE --continued``, which sets the phase per launch."""
    from repack.phases.environment import PHASE_ENV_VAR, PHASES_ENV_VAR
    from repack.store import names_folder

    found = [name for name in (PHASES_ENV_VAR, PHASE_ENV_VAR) if os.environ.get(name)]
    if continued or not found or target is None or not names_folder(os.fspath(target)):
        return
    them = "them" if len(found) > 1 else "it"
    raise InputError(
        f"{' and '.join(found)} set in this environment: trace does not read {them} (the "
        f"repacked class would, and {target}'s datasets would silently change); for a run that "
        f"used the continuation give --phases FILE --continued, else unset {them}"
    )


def _transitions(saved: Any) -> list[int]:
    if isinstance(saved, str):  # as typed: "100,200"
        return sorted(int(x) for x in saved.split(",") if x.strip())
    return sorted(int(x) for x in saved)


def _settings(
    values: dict[str, Any],
    schedule: Schedule,
    release: tuple[int, int],
    typed: Any,
    saved_at: int | None = None,
) -> TraceSettings:
    """The whole run's settings, checked against the schedule; ``saved_at``: the iteration of
    the checkpoint they were read from."""
    values = dict(values)
    where = schedule.path
    saved = values.pop("phase_transition_iterations", None)
    starts = [p.start_iteration for p in schedule.phases]
    if saved:
        if _transitions(saved) != starts[1:]:
            raise PhaseError(
                f"{where}: the run's phase_transition_iterations {_transitions(saved)} (from its "
                f"checkpoint) differ from the schedule's start iterations {starts[1:]}",
                path=where,
            )
    for name, flag in (
        ("rampup_batch_size", "--rampup-batch-size"),
        ("step_batch_size_schedule", "--step-batch-size-schedule"),
    ):
        if values.get(name):
            raise PhaseError(
                f"{where}: {flag} with --phases: Megatron-LM's phases need a constant global "
                "batch size (a launch's first sample is (iteration - last transition) x global "
                "batch size, and the checkpoint's load compares it)",
                path=where,
            )
    batch = values.get("global_batch_size")
    if batch is None:
        values["global_batch_size"] = schedule.global_batch_size
    elif int(batch) != schedule.global_batch_size:
        raise PhaseError(
            f"{where}: the run's global batch size {batch} differs from the schedule's "
            f"global_batch_size {schedule.global_batch_size}",
            path=where,
        )
    if values.get("train_samples") is None:
        raise PhaseError(
            f"{where}: a run in phases gives --train-samples: Megatron-LM sizes each phase "
            "from args.train_samples, which --train-iters leaves None "
            "(get_train_valid_test_num_samples fails comparing it)",
            path=where,
        )
    values["train_iters"] = None
    if saved_at is not None and (typed is None or "seed" not in typed):
        launch = max(p.number for p in schedule.phases if p.start_iteration < max(saved_at, 1))
        own = schedule.phases[launch].seed
        if own is not None and schedule.seed is None and len(schedule.phases) > 1:
            raise PhaseError(
                f"{where}: the checkpoint was saved by phase {launch}'s launch, whose --seed is "
                f"the phase's own ({own}), not the run's that the other phases use: give --seed "
                'or the schedule\'s "seed"',
                path=where,
            )
    if schedule.seed is not None:
        seed = values.get("seed")
        if typed is not None and "seed" in typed and seed is not None and seed != schedule.seed:
            raise PhaseError(
                f"{where}: --seed {seed} differs from the schedule's seed {schedule.seed}",
                path=where,
            )
        values["seed"] = schedule.seed
    settings = TraceSettings.from_values(values, release)
    for phase in schedule.phases[1:]:
        if phase.start_iteration >= settings.train_iters:
            raise PhaseError(
                f"{where}: phases[{phase.number}] starts at iteration {phase.start_iteration:,}, "
                f"at or past the run's last ({settings.train_iters:,}): it never trains",
                path=where,
            )
    return settings


def phase_windows(schedule: Schedule, train_iters: int) -> list[Window]:
    """Each phase's iterations: from its start (exclusive) to the next one's, or the run's end."""
    starts = [p.start_iteration for p in schedule.phases]
    ends = [*starts[1:], train_iters]
    return [Window(k, start, end) for k, (start, end) in enumerate(zip(starts, ends))]


def trace_phases(
    target: str | os.PathLike[str] | None,
    values: dict[str, Any],
    phases: str | os.PathLike[str],
    *,
    release: str,
    builds: str = "megatron-core",
    typed: Any = None,
    iterations: tuple[int, int] | None = None,
    document: tuple[str, int] | None = None,
    source: str | None = None,
    tokens: bool = False,
    decode: Callable[[list[int]], str] | None = None,
    continued: bool = False,
    fma: bool = False,
    say: Callable[[str], object] = lambda line: None,
    saved_at: int | None = None,
) -> Answer:
    """:func:`repack.trace.run.trace` for a run in phases (its arguments; ``saved_at``: the
    iteration of the checkpoint ``values`` were read from, whose blend is not used: each
    phase's is the schedule's; ``builds``: what builds the datasets, for the progress
    lines)."""
    from repack.store import names_folder

    schedule = load_schedule(phases)
    is_repack = target is not None and names_folder(os.fspath(target))
    if target is not None and not is_repack:
        raise InputError(
            f"{target}: with --phases, BLEND_OR_REPACK is the repack holding the phases' "
            "sources (or left out, to read the blends' prefixes); this is not a repack folder"
        )
    if continued and not is_repack:
        raise InputError(
            "--continued traces repack's continuation, which reads a repack: give the repack "
            "holding the phases' sources"
        )
    check_environment(target, continued=continued)
    settings = _settings(values, schedule, release_of(release), typed, saved_at)
    v = settings.values
    windows = phase_windows(schedule, settings.train_iters)
    if iterations is not None:
        first, last = iterations
        if first < 1 or last > settings.train_iters or first > last:
            raise InputError(
                f"iterations {first}:{last}: the run has iterations 1 to {settings.train_iters:,}"
            )
        windows = [w for w in windows if w.start < last and w.end >= first]
    answer = Answer("samples" if document is None else "occurrences")
    answer.notes = []
    found_source = False
    has_valid = False
    for window in windows:
        k = window.phase
        phase = schedule.phases[k]
        samples = schedule.samples(k, int(v["train_samples"]))
        say(
            f"phase {k}: building its datasets with {builds}: "
            f"{samples:,} train samples, iterations {window.start + 1:,} to {window.end:,}"
        )
        draws = build_datasets(
            target if is_repack else phase.blend,
            settings,
            seed=schedule.seed_of(k, int(v["seed"])),
            train_samples=samples,
            blend_file=phase.blend if is_repack else None,
            continuation=(schedule.path, k) if continued else None,
            fma=fma,
            say=say,
            label=f"phase {k}: ",
        )
        tracer = Tracer(draws, settings, window)
        has_valid = has_valid or tracer.valid_sampler is not None
        if iterations is not None:
            part = tracer.iterations(
                max(iterations[0], window.start + 1),
                min(iterations[1], window.end),
                tokens=tokens,
                decode=decode,
            )
        else:
            name = document[0] if document is not None else source
            if not tracer.has_source(name):  # type: ignore[arg-type]
                continue
            found_source = True
            if document is not None:
                part = tracer.document(*document)
            else:
                part = tracer.source(source, tokens=tokens, decode=decode)  # type: ignore[arg-type]
        for record in (*part.train, *part.validation):
            record["phase"] = k
        answer.train += part.train
        answer.validation += part.validation
        answer.skipped += part.skipped
        answer.summary += [f"phase {k}: {line}" for line in part.summary]
        del draws, tracer
    if iterations is None and not found_source:
        name = document[0] if document is not None else source
        raise InputError(f"{schedule.path}: no phase's blend has a source {name!r}")
    answer.summary = answer.summary[:5]
    answer.skipped = sorted(set(answer.skipped))
    if continued:
        answer.notes.append(
            "traced with repack's continuation (--continued): each phase's train split as "
            f"repack.megatron.dataset_class(repack, phases={schedule.path}, phase=K) builds it"
        )
    answer.header = {
        **header(settings, has_valid, fma),
        "phases": [
            {
                "phase": w.phase,
                "start_iteration": w.start,
                "end_iteration": w.end,
                "samples": schedule.samples(w.phase, int(v["train_samples"])),
                "blend": schedule.phases[w.phase].blend,
            }
            for w in phase_windows(schedule, settings.train_iters)
        ],
    }
    return answer
