"""``repack trace`` as one call: settings -> datasets -> the answer asked."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from repack.errors import InputError, MissingExtra
from repack.model import rounding
from repack.releases import installed_release
from repack.trace.build import build_datasets, header, rounding_mismatch
from repack.trace.query import Answer, Tracer
from repack.trace.settings import TraceSettings, release_of

__all__ = [
    "OpenRun",
    "installed_release",
    "load_tokenizer",
    "open_run",
    "release_mismatch",
    "trace",
]


def release_mismatch(release: str | None, installed: str) -> str | None:
    """What to say when ``--megatron-release`` is not the megatron-core installed: the
    arithmetic of the run (iterations, batch schedule, samplers) follows the release given,
    but the datasets are built by the installed one's code; None when they agree."""
    if not release or release_of(release) == release_of(installed):
        return None
    return (
        f"--megatron-release {release} is not the installed megatron-core "
        f"{installed or '(none found)'}: the run's iterations, batch schedule and samplers "
        f"follow {release}, but its datasets are built by the installed release's code; where "
        "the two build differently, install the run's release to trace it"
    )


def load_tokenizer(folder: str | os.PathLike[str]) -> Callable[[list[int]], str]:
    """A local Hugging Face tokenizer's ``decode`` (nothing is downloaded).

    Raises:
        MissingExtra: transformers is not installed.
        InputError: the folder holds no tokenizer.
    """
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise MissingExtra(
            f"{folder}: --tokenizer needs the transformers package (pip install transformers)"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(folder), local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, ... for a bad folder
        raise InputError(f"{folder}: not a Hugging Face tokenizer folder ({err})") from None
    return lambda ids: tokenizer.decode(ids)


def trace(
    target: str | os.PathLike[str] | None,
    values: dict[str, Any],
    *,
    typed: set[str] | frozenset[str] | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    release: str | None = None,
    blend_file: str | os.PathLike[str] | None = None,
    iterations: tuple[int, int] | None = None,
    document: tuple[str, int] | None = None,
    source: str | None = None,
    tokens: bool = False,
    tokenizer: str | os.PathLike[str] | None = None,
    say: Callable[[str], object] | None = None,
    phases: str | os.PathLike[str] | None = None,
    continued: bool = False,
    fma: bool | None = None,
) -> Answer:
    """Answer one question about a run.

    Args:
        target: The blend file or repack the run trained on; with ``checkpoint``, None for
            the blend the checkpoint names.
        values: The run's arguments, by Megatron-LM's names (``seq_length``, ...).
        typed: With ``checkpoint``: the names in ``values`` given on the command line, which
            replace the checkpoint's (the others only fill what it does not hold); default all.
        checkpoint: A Megatron-LM or Megatron-Bridge checkpoint folder (or one iteration's):
            the run's arguments are read from it (:func:`repack.trace.checkpoints.read_checkpoint`).
            With a repack as ``target`` and no ``blend_file``, its blend is the one looked up.
        release: The Megatron-LM release of the run; default the megatron-core installed.
        blend_file: With a repack: the blend the run named.
        iterations: ``(first, last)``: the samples of these iterations (both included).
        document: ``(source, document)``: every read of that document.
        source: Every sample read from that source.
        tokens: Add each sample's token ids.
        tokenizer: A local Hugging Face tokenizer folder: add each sample's text.
        say: Called with a line of progress before and after the datasets' build (and with
            the checkpoint's notes, which the table then leaves out).
        phases: A phase schedule file (:mod:`repack.phases.schedule`): the run is in blend
            phases (Megatron-LM's ``--phase-transition-iterations``); each phase's datasets
            are built as its launch built them (:mod:`repack.trace.phases`). ``target`` is
            then the repack holding the phases' sources, or None for the blends' prefixes.
        continued: With ``phases`` and a repack: the run used repack's continuation
            (``REPACK_PHASES`` / ``REPACK_PHASE``): each phase's train split is built by
            ``dataset_class(repack, phases=..., phase=k)``.
        fma: The rounding of ``BlendedDataset``'s error in the run's Megatron build: ``True``
            once (aarch64 builds: GH200, GB200), ``False`` twice (x86-64 builds); default the
            installed megatron-core's helper's, else this machine's
            (:func:`repack.model.rounding.default_fma`). The answer says which
            (``blending_arithmetic``), and a note where it is not the installed helper's.
    """
    asked = sum(x is not None for x in (iterations, document, source))
    if asked != 1:
        raise InputError("ask one thing: --iteration(s), --document or --source")
    if checkpoint is None and target is None and phases is None:
        raise InputError("give the blend or repack the run trained on, or --checkpoint")
    if continued and phases is None:
        raise InputError("--continued goes with --phases FILE (and the repack the run read)")
    if phases is not None and blend_file is not None:
        raise InputError("--blend with --phases: each phase's blend is the schedule's")
    said = say is not None
    say = say or (lambda line: None)
    if phases is not None:
        from repack.trace.phases import trace_phases

        run, values, notes, version, builds, fma = _settle(
            values, typed, checkpoint, release, fma, say
        )
        answer = trace_phases(
            target,
            values,
            phases,
            release=version,
            builds=builds,
            typed=typed,
            iterations=iterations,
            document=document,
            source=source,
            tokens=tokens,
            decode=load_tokenizer(tokenizer) if tokenizer is not None else None,
            continued=continued,
            fma=fma,
            say=say,
            saved_at=None if run is None else (run.iteration or 0),
        )
        answer.notes[:0] = notes
        answer.said = len(notes) if said else 0
        return answer
    opened = open_run(
        target,
        values,
        typed=typed,
        checkpoint=checkpoint,
        release=release,
        blend_file=blend_file,
        fma=fma,
        say=say,
    )
    tracer, settings, notes = opened.tracer, opened.settings, opened.notes
    decode = load_tokenizer(tokenizer) if tokenizer is not None else None
    if iterations is not None:
        answer = tracer.iterations(*iterations, tokens=tokens, decode=decode)
    elif document is not None:
        answer = tracer.document(*document)
    else:
        answer = tracer.source(source, tokens=tokens, decode=decode)  # type: ignore[arg-type]
    answer.header = header(settings, tracer.valid_sampler is not None, opened.fma)
    answer.notes[:0] = notes
    answer.said = len(notes) if said else 0
    if settings.release < (0, 17) and settings.values["iterations_to_skip"]:
        answer.notes.append(
            "--iterations-to-skip counts from 0 before Megatron-LM 0.17 "
            "(`iteration in args.iterations_to_skip`): iteration k skips the iteration logged "
            "as k + 1, as reported here"
        )
    return answer


@dataclass
class OpenRun:
    """A run's datasets, built as it built them, and its loaders' arithmetic.

    Attributes:
        tracer: Asks which data went where (:class:`repack.trace.query.Tracer`).
        settings: The run's settings.
        notes: What the checkpoint and the release and rounding checks had to say.
        fma: The rounding of the blending error the datasets were built with.
        target: The blend or repack the datasets read (from the checkpoint, when not given).
    """

    tracer: Tracer
    settings: TraceSettings
    notes: list[str]
    fma: bool
    target: Any


def open_run(
    target: str | os.PathLike[str] | None,
    values: dict[str, Any],
    *,
    typed: set[str] | frozenset[str] | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    release: str | None = None,
    blend_file: str | os.PathLike[str] | None = None,
    fma: bool | None = None,
    say: Callable[[str], object] | None = None,
) -> OpenRun:
    """Build a run's datasets and loaders' arithmetic (a run not in phases), as ``trace`` and
    ``bench`` ask them; the arguments are :func:`trace`'s."""
    say = say or (lambda line: None)
    if checkpoint is None and target is None:
        raise InputError("give the blend or repack the run trained on, or --checkpoint")
    run, values, notes, version, builds, fma = _settle(values, typed, checkpoint, release, fma, say)
    settings = TraceSettings.from_values(values, release_of(version))  # refusals first
    if run is not None:
        target, blend_file = _checkpoint_target(run, target, blend_file)
    from repack.trace.phases import check_environment

    check_environment(target, continued=False)
    v = settings.values
    say(
        f"building the run's datasets with {builds}: "
        f"{settings.sizes[0]:,} train samples, {settings.train_iters:,} iterations"
    )
    draws = build_datasets(
        target,
        settings,
        seed=int(v["seed"]),
        train_samples=settings.sizes[0],
        blend_file=blend_file,
        fma=fma,
        say=say,
        label="",
    )
    return OpenRun(Tracer(draws, settings), settings, notes, fma, target)


def _settle(
    values: dict[str, Any],
    typed: set[str] | frozenset[str] | None,
    checkpoint: str | os.PathLike[str] | None,
    release: str | None,
    fma: bool | None,
    say: Callable[[str], object],
) -> tuple[Any, dict[str, Any], list[str], str, str, bool]:
    """The run's checkpoint (or None) and values, its notes, the release its arithmetic
    follows, what builds its datasets, and the rounding; the warnings said."""
    notes: list[str] = []
    run = None
    if checkpoint is not None:
        run, values = _read_checkpoint(checkpoint, values, typed, say)
        notes = list(run.notes)
    installed = installed_release()
    version = release or installed
    builds = f"the installed megatron-core {installed}" if installed else "megatron-core"
    mismatch = release_mismatch(release, installed)
    if mismatch is not None:
        say(f"warning: {mismatch}")
        notes.append(mismatch)
    fma = rounding.default_fma() if fma is None else bool(fma)
    other = rounding_mismatch(fma)
    if other is not None:
        say(f"warning: {other}")
        notes.append(other)
    return run, values, notes, version, builds, fma


def _read_checkpoint(
    checkpoint: str | os.PathLike[str],
    flags: dict[str, Any],
    typed: set[str] | frozenset[str] | None,
    say: Callable[[str], object],
) -> tuple[Any, dict[str, Any]]:
    """A run's checkpoint and its values, the flags typed over them; its notes said."""
    from repack.trace.checkpoints import read_checkpoint
    from repack.trace.settings import with_checkpoint

    run = read_checkpoint(checkpoint)
    at = "release" if run.iteration is None else f"iteration {run.iteration:,}"
    say(f"read the run's settings from {run.path} ({run.source}, {at})")
    for note in run.notes:
        say(f"note: {note}")
    return run, with_checkpoint(run.values, flags, set(flags) if typed is None else typed)


def _checkpoint_target(run: Any, target: Any, blend_file: Any) -> tuple[Any, Any]:
    """What to trace with a checkpoint: the target given, else the blend it names; with a
    repack and no ``--blend``, its blend is the one looked up."""
    from repack.store import names_folder
    from repack.trace.settings import checkpoint_blend

    if target is None:
        target = checkpoint_blend(run)
        if target is None:
            raise InputError(
                f"{run.path}: the checkpoint names no blend (no data_path, per-split paths or "
                "data-args file): give the blend or repack the run trained on"
            )
    elif blend_file is None and names_folder(os.fspath(target)):
        blend_file = checkpoint_blend(run)  # the blend the run named, looked up in the repack
    return target, blend_file
