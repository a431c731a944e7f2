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
cached ``.npy`` files of a stock build and a repacked one stay interchangeable both ways.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from repack.model import blending

__all__ = ["fast_blending", "install", "register_repacked"]

_LOCK = threading.Lock()
_ORIGINAL: dict[str, Any] = {}
_REPACKED: list[type] = []
#: Whether stock blends get the fast index too (:func:`fast_blending`).
_EVERYWHERE = [False]


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
    """

    def __init__(self, enabled: bool = True) -> None:
        install()
        self._previous = _EVERYWHERE[0]
        _EVERYWHERE[0] = bool(enabled)

    def __enter__(self) -> fast_blending:
        return self

    def __exit__(self, *exc: object) -> None:
        _EVERYWHERE[0] = self._previous


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


def _build_blending_indices(*args: Any, **kwargs: Any) -> None:
    if _fast(sys._getframe(1)):
        return blending.build_blending_indices(*args, **kwargs)
    return _ORIGINAL["build_blending_indices"](*args, **kwargs)


def _build_exhaustive_blending_indices(*args: Any, **kwargs: Any) -> None:
    if _fast(sys._getframe(1)):
        return blending.build_exhaustive_blending_indices(*args, **kwargs)
    return _ORIGINAL["build_exhaustive_blending_indices"](*args, **kwargs)
