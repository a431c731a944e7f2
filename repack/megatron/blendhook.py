"""Megatron's own ``BlendedDataset`` builds its index with repack's: the same bytes, sooner.

``BlendedDataset._build_indices`` calls ``megatron.core.datasets.helpers``'
``build_blending_indices`` (and ``build_exhaustive_blending_indices`` for a blend with no
size), which costs samples x datasets: 21 minutes for 10**8 samples of 10,000 datasets, on
the rank that builds, while the job waits. :func:`install` puts a dispatcher in their place in
that module, once per process (``import repack.megatron`` does it):

* a ``BlendedDataset`` over repacked datasets (any class of :func:`repack.megatron.repacked`)
  gets :mod:`repack.model.blending`'s index, always;
* any other (stock ``GPTDataset`` over prefixes) gets Megatron's own helper, unless
  :func:`fast_blending` is on: off by default, so that installing repack changes nothing of a
  stock run.

Both give the same bytes (``tests/test_blending.py`` holds them equal on every release), so the
cached ``.npy`` files of a stock build and a repacked one stay interchangeable both ways: repack's
index follows the rounding of the helper it stands in for, learned once per process by a probe
of that helper (:func:`repack.model.rounding.probe`): x86-64 builds of Megatron round the error
twice, aarch64 builds once, and the orders differ. Where repack cannot give that rounding (the
fused one without ``repack.model._blending``) or the probe does not recognize the helper,
Megatron's own helper builds the index.

:func:`build_blending_indices` and :func:`build_exhaustive_blending_indices` are repack's index
with Megatron's signature, for a call of one's own: ``fma=None`` follows the installed helper.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from repack.model import blending, rounding

__all__ = [
    "build_blending_indices",
    "build_exhaustive_blending_indices",
    "fast_blending",
    "helper_fma",
    "index_fma",
    "install",
    "register_repacked",
]

_LOCK = threading.Lock()
_ORIGINAL: dict[str, Any] = {}
#: The rounding of each of Megatron's helpers (rounding.probe), once probed.
_ROUNDING: dict[str, bool | None] = {}
_REPACKED: list[type] = []
#: Whether stock blends get the fast index too (:func:`fast_blending`).
_EVERYWHERE = [False]
#: The rounding asked of fast_blending(fma=...), or None: the helper's.
_FORCED: list[bool | None] = [None]


class fast_blending:
    """Build every ``BlendedDataset``'s index with repack's, stock blends too.

    Call it once in a training script, before the datasets are built::

        import repack.megatron
        repack.megatron.fast_blending()          # every BlendedDataset of this process

    or for a block only (the previous setting comes back after it)::

        with repack.megatron.fast_blending():
            datasets = BlendedMegatronDatasetBuilder(GPTDataset, sizes, ..., config).build()

    ``fast_blending(False)`` turns it off for stock blends (a repack's blends keep it).

    Args:
        enabled: Whether stock blends use it.
        fma: The rounding of every index repack builds meanwhile: ``None`` (the default) the
            installed helper's; ``True`` once, as aarch64 builds of Megatron; ``False`` twice,
            as x86-64 builds (what ``repack trace --fma`` asks, to answer for a run on the
            other kind of machine).
    """

    def __init__(self, enabled: bool = True, *, fma: bool | None = None) -> None:
        install()
        self._previous = _EVERYWHERE[0], _FORCED[0]
        _EVERYWHERE[0] = bool(enabled)
        _FORCED[0] = fma

    def __enter__(self) -> fast_blending:
        return self

    def __exit__(self, *exc: object) -> None:
        _EVERYWHERE[0], _FORCED[0] = self._previous


def register_repacked(cls: type) -> None:
    """Datasets of ``cls`` (and its subclasses) are a repack's: their blends always get the
    fast index."""
    if cls not in _REPACKED:
        _REPACKED.append(cls)


def install() -> None:
    """Put the dispatchers in ``megatron.core.datasets.helpers``, once (idempotent)."""
    with _LOCK:
        if _ORIGINAL:
            return
        from megatron.core.datasets import helpers

        _ORIGINAL["build_blending_indices"] = helpers.build_blending_indices
        _ORIGINAL["build_exhaustive_blending_indices"] = helpers.build_exhaustive_blending_indices
        helpers.build_blending_indices = _build_blending_indices
        helpers.build_exhaustive_blending_indices = _build_exhaustive_blending_indices


def _fast(frame: Any) -> bool:
    """Whether the ``BlendedDataset`` calling (``frame``: its ``_build_indices``) is to get the
    fast index: everywhere when asked, else where it blends repacked datasets."""
    if _EVERYWHERE[0]:
        return True
    owner = frame.f_locals.get("self") if frame is not None else None
    datasets = getattr(owner, "datasets", None) or ()
    return any(isinstance(d, tuple(_REPACKED)) for d in datasets)


def helper_fma(name: str = "build_blending_indices") -> bool | None:
    """The rounding of Megatron's helper ``name`` that ``BlendedDataset`` calls (the one in
    ``megatron.core.datasets.helpers`` when repack was imported): ``True`` once (aarch64
    builds), ``False`` twice (x86-64), ``None`` not recognized. Probed once per process."""
    install()
    with _LOCK:
        if name not in _ROUNDING:
            _ROUNDING[name] = rounding.probe(
                _ORIGINAL[name], exhaustive=name == "build_exhaustive_blending_indices"
            )
        return _ROUNDING[name]


def index_fma() -> bool:
    """The rounding of the blending indices built in this process now: the one
    :func:`fast_blending` forces, else the installed helper's, else this machine's builds'
    (what the phases' continuation counts the earlier phases' draws in)."""
    return _helper_or_machine() if _FORCED[0] is None else _FORCED[0]


def _helper_or_machine(name: str = "build_blending_indices") -> bool:
    """The rounding of Megatron's helper ``name``, else (not recognized) this machine's."""
    found = helper_fma(name)
    return rounding.machine_fma() if found is None else found


def _repacks(name: str) -> bool | None:
    """The rounding repack's index takes in place of helper ``name``, or ``None`` where
    Megatron's own helper must build it (a rounding not recognized, or the fused one without
    the compiled index)."""
    fma = helper_fma(name) if _FORCED[0] is None else _FORCED[0]
    return None if fma is None or (fma and not blending.COMPILED) else fma


def build_blending_indices(
    dataset_index: Any,
    dataset_sample_index: Any,
    weights: Any,
    num_datasets: int,
    size: int,
    verbose: bool,
    *,
    fma: bool | None = None,
) -> None:
    """Megatron's ``helpers.build_blending_indices``, its signature and bytes
    (:func:`repack.model.blending.build_blending_indices`).

    Args:
        fma: ``True``: the error rounded once, as aarch64 builds of Megatron; ``False``:
            twice, as x86-64 builds; ``None``: as the installed helper (:func:`helper_fma`),
            else as this machine's builds.
    """
    if fma is None:
        fma = _helper_or_machine()
    blending.build_blending_indices(
        dataset_index, dataset_sample_index, weights, num_datasets, size, verbose, fma=fma
    )


def build_exhaustive_blending_indices(
    dataset_index: Any,
    dataset_sample_index: Any,
    sizes: Any,
    num_datasets: int,
    *,
    fma: bool | None = None,
) -> None:
    """Megatron's ``helpers.build_exhaustive_blending_indices``, its signature and bytes;
    ``fma`` as :func:`build_blending_indices`."""
    if fma is None:
        fma = _helper_or_machine("build_exhaustive_blending_indices")
    blending.build_exhaustive_blending_indices(
        dataset_index, dataset_sample_index, sizes, num_datasets, fma=fma
    )


def _build_blending_indices(*args: Any, **kwargs: Any) -> None:
    name = "build_blending_indices"
    if _fast(sys._getframe(1)) and (fma := _repacks(name)) is not None:
        return blending.build_blending_indices(*args, **kwargs, fma=fma)
    return _ORIGINAL[name](*args, **kwargs)


def _build_exhaustive_blending_indices(*args: Any, **kwargs: Any) -> None:
    name = "build_exhaustive_blending_indices"
    if _fast(sys._getframe(1)) and (fma := _repacks(name)) is not None:
        return blending.build_exhaustive_blending_indices(*args, **kwargs, fma=fma)
    return _ORIGINAL[name](*args, **kwargs)
