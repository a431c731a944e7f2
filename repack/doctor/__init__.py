"""``repack doctor``: what Megatron will do with a blend, before a training job finds out.

:func:`doctor` reads only index data (the prefixes' ``.idx`` files, or a repack's manifest and
index) and computes, as the megatron-core installed computes it (0.12 to 0.19; where releases
differ, :mod:`~repack.model.release`), the sequences of each prefix in
each split, the samples its ``BlendedDataset`` draws from it (Megatron's greedy interleave,
ported) and the epochs of it that means; it lists what would stop or hang training (over-draws
included), and the files stock Megatron would hold per process and per node.

Modules: :mod:`~repack.model.arithmetic` (Megatron's arithmetic, pure),
:mod:`~repack.model.splits` (the builder's branches, pure), :mod:`~repack.model.blend_draws`
(``BlendedDataset``'s draws, pure), :mod:`~repack.inputs.facts`
(reading), :mod:`~repack.doctor.resources`, :mod:`~repack.doctor.problems` (the problem levels
and :class:`Problem`, a leaf), :mod:`~repack.doctor.core` (the problems found, and the report),
:mod:`~repack.doctor.findings` (the duplicate ones), :mod:`~repack.doctor.orders` (the order
on x86-64 and aarch64 builds of Megatron, which round the blending error differently),
:mod:`~repack.doctor.render` (text) and :mod:`~repack.doctor.plot` (picture, needs matplotlib).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from repack.doctor.core import DEFAULT_MAX_EPOCHS, Problem, Report, examine
from repack.doctor.findings import DEFAULT_DUPLICATES, DuplicateOptions
from repack.doctor.problems import WARNING
from repack.doctor.resources import Limits, machine_limits
from repack.inputs.facts import load
from repack.model.splits import Settings

__all__ = [
    "DEFAULT_MAX_EPOCHS",
    "DuplicateOptions",
    "Limits",
    "Problem",
    "Report",
    "Settings",
    "doctor",
]


def doctor(
    target: str | os.PathLike[str],
    settings: Settings,
    *,
    blend: str | os.PathLike[str] | None = None,
    max_epochs: float = DEFAULT_MAX_EPOCHS,
    ranks_per_node: int = 8,
    workers: int = 2,
    mmap_bin_files: bool = True,
    mmap_limit: int | None = None,
    node_memory: int | None = None,
    limits: Limits | None = None,
    duplicates: DuplicateOptions | None = DEFAULT_DUPLICATES,
    progress: Callable[[str, int], Callable[[int], object]] | None = None,
    data_cache_path: str | os.PathLike[str] | None = None,
    seed: int = 1234,
) -> Report:
    """Examine a blend file or a repack folder for a training run with ``settings``.

    Args:
        target: A blend file (any form :func:`repack.inputs.blend_files.load_blend` reads) or a
            repack folder (its recorded blend, or ``blend``).
        settings: Sequence length, samples per split, split string...
        blend: With a repack folder: a blend file to look up in it instead.
        max_epochs: Warn about a source drawn for more epochs than this.
        ranks_per_node: Ranks per node that build datasets.
        workers: DataLoader workers per rank.
        mmap_bin_files: Megatron's ``mmap_bin_files``.
        mmap_limit: A file system's ceiling on mappings per process, if known.
        node_memory: A training node's memory in bytes (default: this machine's).
        limits: Override this machine's limits (tests).
        duplicates: How to look for duplicate data (:mod:`repack.doctor.findings`): by
            default from a repack's fingerprints only; ``read_tokens=True`` reads the tokens
            where there are none (``--duplicates``); None: not at all.
        progress: ``progress(description, total)`` returns a callback fed counts.
        data_cache_path: The job's ``--data-cache-path``: a ``prepared-cache`` warning when it
            (default: a repack folder's own cache) holds blending indices of this blend for
            another seed, sequence length or split and none for these
            (:func:`repack.trace.prepare.prepared_for_other_settings`).
        seed: The job's ``--seed``, for that check.

    Returns:
        The report; ``report.ok`` is False when a problem would stop or hang training.

    Raises:
        BlendError: The blend file is not a valid blend.
        RepackError: The repack folder is damaged, or ``blend`` names a prefix not in it.
        ValueError: ``settings.split`` cannot be parsed.
    """
    loaded = load(target, blend=blend, progress=progress)
    if limits is None:
        limits = machine_limits(mmap_limit, node_memory)
    report = examine(
        loaded,
        settings,
        target=os.fspath(target),
        max_epochs=max_epochs,
        ranks_per_node=ranks_per_node,
        workers=workers,
        mmap_bin_files=mmap_bin_files,
        limits=limits,
        duplicates=duplicates,
        progress=progress,
    )
    from repack.phases.environment import environment_note

    _prepared_cache(report, loaded, settings, data_cache_path, seed)
    note = environment_note()
    if note is not None:  # the loader's order, not the draws counted here
        report.problems.append(Problem(WARNING, "phases-environment", note, None, None))
    return report


def _prepared_cache(report: Report, loaded, settings: Settings, data_cache_path, seed: int) -> None:
    """The ``prepared-cache`` warning: a cache prepared (or written by a job) for other
    settings and none for these."""
    import glob

    from repack.cache.loadercache import CACHE_DIR
    from repack.trace.prepare import prepared_for_other_settings

    if data_cache_path is not None:
        folders = [os.fspath(data_cache_path)]
    elif loaded.repack is not None and os.path.isdir(loaded.repack):
        folders = sorted(glob.glob(os.path.join(glob.escape(loaded.repack), CACHE_DIR, "*", "")))
        folders = [f.rstrip(os.sep) for f in folders]
    else:
        return
    prefixes = {e.path for entries in loaded.blend.splits.values() for e in entries or ()}
    split = None if loaded.blend.per_split else settings.split
    said = prepared_for_other_settings(folders, prefixes, seed, settings.sequence_length, split)
    if said is not None:
        report.problems.append(Problem(WARNING, "prepared-cache", said, None, None))
