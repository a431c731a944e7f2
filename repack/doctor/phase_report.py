"""``repack doctor --phases``: what each phase of a run trains on that an earlier phase trained on.

For every phase, and every source of its training split: the samples its ``BlendedDataset``
draws, the documents they train on, how many of those (and their tokens) an earlier phase
trained on, the share expected had the phase drawn regardless of the earlier phases (the share
of the source's slice already trained on), and the same with repack's continuation. Stock
Megatron shuffles a source exactly as before whenever its epochs in the phase are those of the
earlier phase (same seed, same per-source shuffles), so a new phase starts again at the
documents the earlier one began with: a ``phase-retrain`` warning says so past a threshold.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from repack.doctor.orders import arithmetic, arithmetic_line, require_rounding
from repack.doctor.problems import WARNING, Problem
from repack.errors import PhaseError
from repack.inputs.facts import Loaded, load
from repack.model.splits import Settings
from repack.phases.replay import PhaseDraws, SourceDraws, replay
from repack.phases.schedule import Schedule, load_schedule

__all__ = ["DEFAULT_MAX_RETRAIN", "PhasesReport", "examine_phases", "render_phases"]

#: Warn when a phase's share of documents trained before exceeds the expected share by this.
DEFAULT_MAX_RETRAIN = 0.10


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


@dataclass(frozen=True)
class PhasesReport:
    """The phases, stock and continued, and the warnings.

    Attributes:
        schedule: The schedule.
        target: The repack the sources were read from, or ``None`` (their ``.idx`` files).
        settings: The run's settings (``sizes`` unused).
        seed: The run's ``--seed``.
        stock: Each phase as stock Megatron draws it.
        continued: Each phase with repack's continuation.
        problems: ``phase-retrain`` and ``phase-exhausted`` warnings.
    """

    schedule: Schedule
    target: str | None
    settings: Settings
    seed: int
    stock: tuple[PhaseDraws, ...]
    continued: tuple[PhaseDraws, ...]
    problems: tuple[Problem, ...]

    def to_json(self) -> dict[str, Any]:
        """As a JSON-able dict: ``{"phases": [...], "problems": [...], ...}``."""
        phases = []
        for stock, continued in zip(self.stock, self.continued):
            entry = {
                "phase": stock.phase,
                "start_iteration": stock.start_iteration,
                "samples": stock.samples,
                "seed": stock.seed,
                "blend": self.schedule.phases[stock.phase].blend,
                **_totals(stock.sources),
                "continued": {
                    **_totals(continued.sources),
                    "exhausted": [s.name for s in continued.sources if s.exhausted],
                },
                "sources": [
                    {**_source(s), "continued": {**_source(c, short=True)}}
                    for s, c in zip(stock.sources, continued.sources)
                ],
            }
            phases.append(entry)
        return {
            "schedule": self.schedule.path,
            "target": self.target,
            "global_batch_size": self.schedule.global_batch_size,
            "seq_length": self.settings.sequence_length,
            "split": self.settings.split,
            "seed": self.seed,
            "blending_arithmetic": arithmetic(self.settings.fma),
            "phases": phases,
            "problems": [p.to_json() for p in self.problems],
            "ok": True,
        }


def _totals(sources: tuple[SourceDraws, ...]) -> dict[str, Any]:
    documents = sum(s.documents for s in sources)
    before = sum(s.before for s in sources)
    samples = sum(s.samples for s in sources)
    samples_before = sum(s.samples_before for s in sources)
    expected = sum(s.documents * s.expected for s in sources)
    return {
        "samples_drawn": samples,
        "documents_trained": documents,
        "documents_trained_before": before,
        "tokens_trained_before": sum(s.before_tokens for s in sources),
        "samples_trained_before": samples_before,
        "share_before": _share(before, documents),
        "share_expected": expected / documents if documents else 0.0,
        "share_samples_before": _share(samples_before, samples),
    }


def _source(s: SourceDraws, short: bool = False) -> dict[str, Any]:
    found = {
        "documents_trained": s.documents,
        "documents_trained_before": s.before,
        "tokens_trained_before": s.before_tokens,
        "samples_trained_before": s.samples_before,
        "share_before": _share(s.before, s.documents),
    }
    if short:
        return {**found, "exhausted": s.exhausted, "unseen_samples": s.unseen_samples}
    return {
        "source": s.name,
        "key": s.key,
        "samples": s.samples,
        "epochs": s.epochs,
        **found,
        "slice_documents": s.slice_documents,
        "share_expected": s.expected,
    }


def _loader(target: str | None, schedule: Schedule, progress) -> Callable[[int], Loaded]:
    loaded: dict[int, Loaded] = {}

    def get(number: int) -> Loaded:
        if number not in loaded:
            blend = schedule.phases[number].blend
            if target is None:
                found = load(blend, progress=progress)
            else:
                found = load(target, blend=blend, progress=progress)
            for source in found.sources.values():
                if source.error is not None:
                    raise PhaseError(f"{blend} (phase {number}): {source.error}", path=source.key)
            for entries in found.blend.splits.values():
                for entry in entries or ():
                    w = entry.weight
                    if w is not None and not (w > 0 and w < float("inf")):
                        raise PhaseError(
                            f"{blend} (phase {number}): {entry.prefix}: weight {w} is not a "
                            "finite number > 0 (repack doctor on that blend says more)",
                            path=blend,
                        )
            loaded[number] = found
        return loaded[number]

    return get


def examine_phases(
    target: str | os.PathLike[str] | None,
    phases: str | os.PathLike[str],
    settings: Settings,
    *,
    train_samples: int | None,
    train_iters: int | None = None,
    seed: int | None = None,
    max_retrain: float = DEFAULT_MAX_RETRAIN,
    progress=None,
) -> PhasesReport:
    """Replay a run's phases, stock and continued.

    Args:
        target: The repack holding the phases' sources, or ``None`` to read each blend's
            prefixes from their ``.idx`` files.
        phases: The phase schedule file.
        settings: Sequence length, split, surplus (``sizes`` unused).
        train_samples: The run's training samples (the last phase ends there).
        train_iters: Instead of ``train_samples``: the run's ``--train-iters`` (x the global
            batch size), with a ``phase-train-iters`` warning: Megatron-LM's phased launch
            fails on it.
        seed: The run's ``--seed`` (default: the schedule's ``seed``, else Megatron's 1234);
            a phase's own seed wins.
        max_retrain: Warn when a phase's share of documents trained before passes its
            expected share by more than this.
        progress: As :func:`repack.doctor.doctor`'s.

    Raises:
        PhaseError: the schedule, or a phase's blend, is not usable.
        RepackError: a blend's prefix is not in the repack, or cannot be read.
        NotCompiled: ``settings.fma`` where ``repack.model._blending`` was not built.
    """
    require_rounding(settings.fma)
    schedule = load_schedule(phases)
    if seed is not None and schedule.seed is not None and schedule.seed != seed:
        raise PhaseError(
            f"{schedule.path}: seed is {schedule.seed}, but --seed is {seed}", path=schedule.path
        )
    seed = seed if seed is not None else schedule.seed if schedule.seed is not None else 1234
    problems = []
    if train_samples is None and train_iters is not None:
        train_samples = train_iters * schedule.global_batch_size
        problems.append(
            Problem(
                WARNING,
                "phase-train-iters",
                f"--train-iters {train_iters:,} with phases: Megatron-LM sizes each phase from "
                "args.train_samples, which --train-iters leaves None, and its "
                "get_train_valid_test_num_samples fails comparing it (TypeError) when the "
                f"first launch builds its datasets: give --train-samples {train_samples:,} "
                "(the same run)",
            )
        )
    target = None if target is None else os.fspath(target)
    rows = [
        (
            p.number,
            p.start_iteration,
            schedule.samples(p.number, train_samples),
            schedule.seed_of(p.number, seed),
        )
        for p in schedule.phases
    ]
    loads = _loader(target, schedule, progress)
    stock, _ = replay(rows, loads, settings, continued=False)
    continued, _ = replay(rows, loads, settings, continued=True)
    for phase, other in zip(stock[1:], continued[1:]):
        totals, with_it = _totals(phase.sources), _totals(other.sources)
        blend = os.path.basename(schedule.phases[phase.phase].blend)
        if totals["share_before"] > totals["share_expected"] + max_retrain:
            problems.append(
                Problem(
                    WARNING,
                    "phase-retrain",
                    f"phase {phase.phase} ({blend}): {100 * totals['share_before']:.1f}% of the "
                    f"{totals['documents_trained']:,} documents it trains on were trained on in "
                    f"an earlier phase ({100 * totals['share_samples_before']:.1f}% of its "
                    f"samples), against {100 * totals['share_expected']:.1f}% expected of a "
                    "draw regardless of them: with the same seed, a source drawn for as many "
                    "epochs as before is shuffled as before, so the phase starts again at the "
                    "documents the earlier one began with. Ways out: repack's continuation "
                    f"(REPACK_PHASES, REPACK_PHASE={phase.phase}: "
                    f"{100 * with_it['share_before']:.1f}%), or another --seed for the phase "
                    "(about the expected share)",
                )
            )
        exhausted = [s.name for s in other.sources if s.exhausted]
        if exhausted:
            names = ", ".join(exhausted[:5]) + (
                f" and {len(exhausted) - 5:,} more" if len(exhausted) > 5 else ""
            )
            problems.append(
                Problem(
                    WARNING,
                    "phase-exhausted",
                    f"phase {phase.phase} ({blend}): with the continuation, "
                    f"{len(exhausted):,} source{'s' if len(exhausted) != 1 else ''} run out of "
                    "documents no earlier phase trained on and start a new epoch of those "
                    f"trained least: {names}",
                    exhausted[0],
                )
            )
    return PhasesReport(
        schedule, target, settings, seed, tuple(stock), tuple(continued), tuple(problems)
    )


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def render_phases(report: PhasesReport, *, top: int = 20) -> str:
    """The report as lines of text: one row per phase, then per phase its sources most
    re-trained first (``top`` of them; 0: all), then the warnings."""
    s = report.settings
    schedule = report.schedule
    where = f"repack {report.target}" if report.target else "the prefixes' .idx files"
    out = [
        f"{schedule.path}: {len(schedule.phases)} phases, global batch size "
        f"{schedule.global_batch_size:,}, sources from {where}",
        f"Megatron: --seq-length {s.sequence_length}"
        + (f", --split {s.split}" if s.split else "")
        + f", --seed {report.seed}; training split only",
        arithmetic_line(s.fma),
        "",
    ]
    rows = [
        [
            "phase",
            "start",
            "samples",
            "documents",
            "trained before",
            "expected",
            "continued: before",
            "exhausted",
        ]
    ]
    for phase, other in zip(report.stock, report.continued):
        t, c = _totals(phase.sources), _totals(other.sources)
        first = phase.phase == 0
        rows.append(
            [
                f"{phase.phase} {os.path.basename(schedule.phases[phase.phase].blend)}",
                f"{phase.start_iteration:,}",
                f"{phase.samples:,}",
                f"{t['documents_trained']:,}",
                "-" if first else f"{t['documents_trained_before']:,} ({_pct(t['share_before'])})",
                "-" if first else _pct(t["share_expected"]),
                "-" if first else f"{c['documents_trained_before']:,} ({_pct(c['share_before'])})",
                "-" if first else f"{sum(x.exhausted for x in other.sources):,}",
            ]
        )
    out += _table(rows)
    for phase, other in zip(report.stock[1:], report.continued[1:]):
        pairs = sorted(zip(phase.sources, other.sources), key=lambda p: (-p[0].before, p[0].name))
        shown = pairs if top <= 0 else pairs[:top]
        more = (
            "" if len(shown) == len(pairs) else f" ({len(shown)} of {len(pairs):,}; --top 0: all)"
        )
        out += ["", f"Phase {phase.phase}, sources most re-trained first{more}:"]
        rows = [
            [
                "source",
                "samples",
                "documents",
                "trained before",
                "tokens before",
                "expected",
                "continued: before",
            ]
        ]
        for a, b in shown:
            rows.append(
                [
                    a.name,
                    f"{a.samples:,}",
                    f"{a.documents:,}",
                    f"{a.before:,} ({_pct(_share(a.before, a.documents))})",
                    f"{a.before_tokens:,}",
                    _pct(a.expected),
                    f"{b.before:,}" + (" (new epoch)" if b.exhausted else ""),
                ]
            )
        out += _table(rows)
    out.append("")
    if report.problems:
        out.append(f"Warnings ({len(report.problems)}):")
        out += [f"WARNING [{p.code}] {p.message}" for p in report.problems]
    else:
        out.append("No phase re-trains more than expected.")
    return "\n".join(out)
