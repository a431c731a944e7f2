"""Which rounding of Megatron's blending error a build of Megatron makes, and so which order
its blends train.

megatron-core's ``helpers.cpp`` computes every dataset's error as ``weights[i] *
std::max(static_cast<double>(sample_idx), 1.0) - static_cast<double>(current_samples[i])``.
Its x86-64 wheels round the product and the difference apart (two roundings); its aarch64
wheels (GH200, GB200) and aarch64 builds from source contract the line into a fused
multiply-subtract, ``fnmsub``, and round once (docs/megatron.md, "The same order on x86-64 and
aarch64"). Wherever two errors nearly tie the two pick different datasets: with weights
``1 2 3`` the orders part at sample 6. A third kind exists: built from source with GCC 12
(Debian 12's), ``build_blending_indices`` rounds dataset 0's error twice (the compiler splits
its product at ``std::max(t, 1.0)`` and does not fuse it) and the others' once; its exhaustive
twin fuses all of them.

* :func:`probe` tells a helper's rounding from what it draws for weights ``0.3 0.3 0.4``, which
  part all three kinds within 12 samples (the third is told "neither": repack's loader then
  leaves the index to that helper);
* :func:`installed_fma` probes the helper of the megatron-core installed, without importing
  megatron-core (its ``helpers_cpp`` extension is loaded from its file: no torch);
* :func:`default_fma` is what an analysis run on this machine assumes: the installed helper's
  rounding, else this machine's architecture's;
* :func:`describe` names a rounding in reports.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = [
    "ARCH_FUSED",
    "default_fma",
    "describe",
    "installed_fma",
    "installed_helper",
    "machine_fma",
    "probe",
]

#: The processors whose builds of Megatron round the error once (``uname -m``).
ARCH_FUSED = ("aarch64", "arm64")

#: What ``build_blending_indices`` draws for weights 0.3, 0.3, 0.4 over 12 samples, rounding
#: twice and once (dataset 0 twice and the others once, GCC 12's source builds, draws
#: ``... 2, 2, 1``); ``build_exhaustive_blending_indices`` draws the same first 12 for sizes
#: 30, 30, 40 (weights size / total).
_TWICE = (2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 2)
_ONCE = (2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 2, 0)


def describe(fma: bool) -> str:
    """``"one rounding (aarch64 builds)"`` or ``"two roundings (x86-64 builds)"``."""
    return "one rounding (aarch64 builds)" if fma else "two roundings (x86-64 builds)"


def probe(build: Callable[..., object], exhaustive: bool = False) -> bool | None:
    """The rounding of a Megatron blending helper: ``True`` once (fused), ``False`` twice,
    ``None`` neither (not Megatron's loop, or it failed).

    Args:
        build: ``build_blending_indices`` (or, with ``exhaustive``,
            ``build_exhaustive_blending_indices``), with ``helpers.cpp``'s signature.
        exhaustive: Whether ``build`` is the exhaustive one.
    """
    size = 100 if exhaustive else 12
    index = np.zeros(size, dtype=np.int16)
    sample = np.zeros(size, dtype=np.int64)
    try:
        if exhaustive:
            build(index, sample, np.array([30, 30, 40], dtype=np.int64), 3)
        else:
            build(index, sample, np.array([3.0, 3.0, 4.0]) / 10.0, 3, size, False)
    except Exception:  # whatever a foreign helper raises means "not known"
        return None
    drawn = tuple(index[:12].tolist())
    return True if drawn == _ONCE else False if drawn == _TWICE else None


def machine_fma(machine: str | None = None) -> bool:
    """Whether builds of Megatron on this machine (or on ``machine``, ``uname -m``) round
    the error once."""
    return (machine or platform.machine()).lower() in ARCH_FUSED


@functools.cache
def installed_helper() -> object | None:
    """The installed megatron-core's compiled helper module (``helpers_cpp``), or ``None``."""
    return sys.modules.get("megatron.core.datasets.helpers_cpp") or _load_helpers_cpp()


@functools.cache
def installed_fma() -> bool | None:
    """The rounding of the installed megatron-core's compiled helper (:func:`probe`), or
    ``None`` where there is none (or it is neither)."""
    module = installed_helper()
    if module is None:
        return None
    return probe(module.build_blending_indices)


def default_fma() -> bool:
    """The rounding an analysis assumes when not told: the installed megatron-core's, else this
    machine's architecture's."""
    found = installed_fma()
    return machine_fma() if found is None else found


def _load_helpers_cpp() -> object | None:
    """megatron-core's ``helpers_cpp`` extension, loaded from its file: importing it as
    ``megatron.core.datasets.helpers_cpp`` would import megatron-core, and torch with it."""
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):  # an import hook that refuses it: no megatron here
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        folder = Path(root) / "core" / "datasets"
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = folder / f"helpers_cpp{suffix}"
            if path.is_file():
                name = "megatron.core.datasets.helpers_cpp"
                loader = importlib.machinery.ExtensionFileLoader(name, str(path))
                found = importlib.util.spec_from_file_location(name, path, loader=loader)
                try:
                    module = importlib.util.module_from_spec(found)
                    loader.exec_module(module)
                except (ImportError, OSError):
                    return None
                return module
    return None
