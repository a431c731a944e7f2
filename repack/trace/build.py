"""One launch's datasets, as ``repack trace`` builds them for a run (:mod:`repack.trace.run`) or
for each phase of a run in phases (:mod:`repack.trace.phases`), and the answer's fields that
describe the run."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from repack.model import rounding
from repack.trace.settings import TraceSettings

__all__ = ["build_datasets", "header", "rounding_mismatch"]


def build_datasets(
    target: Any,
    settings: TraceSettings,
    *,
    seed: int,
    train_samples: int,
    blend_file: Any = None,
    continuation: tuple[str, int] | None = None,
    fma: bool | None = None,
    say: Callable[[str], object],
    label: str,
) -> Any:
    """One launch's datasets (:func:`repack.trace.draws.build_draws`), with Megatron's per-dataset
    log lines held back and the time taken said (``label`` starts the line).

    Args:
        target, blend_file, continuation: As :func:`repack.trace.draws.build_draws` takes them.
        settings: The run's settings.
        seed: The launch's ``--seed`` (a phase may have its own).
        train_samples: The train split's samples (a phase's launch asks for its phase's).
        fma: The rounding of the blending error in the run's Megatron build (``None``: the
            installed helper's), as :class:`repack.trace.draws.DrawSettings` takes it.
    """
    import time

    from repack.trace.draws import DrawSettings, build_draws

    v = settings.values
    draw_settings = DrawSettings(
        seq_length=int(v["seq_length"]),
        seed=seed,
        split=v["split"],
        sizes=(train_samples, *settings.sizes[1:]),
        surplus=float(v["mid_level_dataset_surplus"]),
        data_cache_path=v["data_cache_path"],
        fma=fma,
        mmap_bin_files=bool(v["mmap_bin_files"]),
    )
    started = time.perf_counter()
    quiet = logging.getLogger("megatron.core")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # Megatron's build logs at INFO and WARNING, per dataset
    try:
        draws = build_draws(target, draw_settings, blend_file=blend_file, continuation=continuation)
    finally:
        quiet.setLevel(level)
    sources = sum(len(split.datasets) for split in draws.splits.values() if split is not None)
    say(f"{label}built {sources:,} datasets in {time.perf_counter() - started:.1f} s")
    return draws


def header(settings: TraceSettings, validation: bool, fma: bool) -> dict[str, Any]:
    """The JSON answer's fields that describe the run (``validation``: whether its
    evaluations read a validation split; ``fma``: the rounding of the blending error its
    datasets were built with)."""
    return {
        "train_iters": settings.train_iters,
        "split_samples": list(settings.sizes),
        "megatron_release": f"{settings.release[0]}.{settings.release[1]}",
        "evaluations": settings.eval_points() if validation else [],
        "blending_arithmetic": {"fma": bool(fma), "description": rounding.describe(fma)},
    }


def rounding_mismatch(fma: bool) -> str | None:
    """What to say when ``fma`` is not the rounding of the installed megatron-core's helper
    (:func:`repack.model.rounding.installed_fma`): the order traced is the other kind of
    machine's; None when they agree, or the helper's is not known."""
    installed = rounding.installed_fma()
    if installed is None or installed == bool(fma):
        return None
    return (
        f"blending arithmetic {rounding.describe(fma)} differs from this machine's "
        f"megatron-core ({rounding.describe(installed)}): the order shown is the other "
        "machine's (built without a cache folder, whose blending index would hold one "
        "machine's order)"
    )
