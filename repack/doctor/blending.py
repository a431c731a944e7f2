"""What ``BlendedDataset`` draws from each of its datasets: Megatron's greedy interleave, ported.

``BlendedDataset._build_indices`` fills its dataset index with ``helpers.cpp``'s
``build_blending_indices``: for every sample ``t`` of the blend it picks the dataset whose
error ``weights[i] * max(t, 1) - drawn[i]`` is largest (the first on a tie) and counts one
draw for it. It then refuses, with ``IndexError``, a dataset drawn more often than its length
(the over-draw of Megatron-LM issue #705). :func:`drawn_counts` is that loop with the same
double-precision expressions, so its counts are Megatron's to the sample; :func:`blend_weights`
the weights ``BlendedDataset`` hands it (normalized twice for a weighted blend: once by the
builder, once by ``BlendedDataset``; the datasets' lengths, normalized, without weights).

Pure Python and numpy; no imports of Megatron or torch. Only for a blend past
:data:`PORT_WORK` does it load megatron-core's compiled ``helpers_cpp`` (alone, not
the ``megatron.core`` package), where that is installed, to run Megatron's own loop.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from repack.doctor import arithmetic as mm

__all__ = [
    "EXACT_LIMIT",
    "EXACT_WORK",
    "MEGATRON_LIMIT",
    "MEGATRON_WORK",
    "PORT_WORK",
    "OverDraw",
    "blend_weights",
    "drawn_counts",
    "megatron_helpers",
    "over_draws",
    "surplus_for",
]

#: Work (samples x datasets, plus 300 per sample for Python's own cost) up to which
#: :func:`drawn_counts` runs its port of Megatron's loop first: about half a second.
PORT_WORK = 30_000_000
#: Samples, and samples x datasets, up to which it runs megatron-core's own compiled loop
#: where installed (10 bytes per sample for the indices ``BlendedDataset`` fills; some 3 s).
MEGATRON_LIMIT = 100_000_000
MEGATRON_WORK = 3_000_000_000
#: Samples, and samples x datasets, up to which the port runs where megatron-core is not
#: installed (some seconds); past them the counts are estimated.
EXACT_LIMIT = 1_000_000
EXACT_WORK = 50_000_000


def blend_weights(weights: Sequence[float] | None, lengths: Sequence[int]) -> list[float]:
    """The weights ``build_blending_indices`` receives for a blend with a size.

    Args:
        weights: The split's weights as the blend gives them (any scale), or ``None`` for an
            unweighted blend.
        lengths: The datasets' lengths (``len(GPTDataset)``), which weigh an unweighted blend.
    """
    if weights is None:
        return mm.normalize([float(n) for n in lengths])
    return mm.normalize(mm.normalize(list(weights)))


def drawn_counts(weights: Sequence[float], size: int) -> tuple[np.ndarray, bool]:
    """The samples ``build_blending_indices`` draws from each dataset over ``size`` samples.

    Megatron's loop, expression for expression (``weights[i] * max(t, 1.0) - drawn[i]`` in
    float64, the first largest wins), so the counts are exact: this port for a small blend
    (:data:`PORT_WORK`); megatron-core's own compiled loop for a larger one where it is
    installed (:data:`MEGATRON_LIMIT`, :data:`MEGATRON_WORK`); else the port again, up to
    :data:`EXACT_LIMIT` samples and :data:`EXACT_WORK`. Past that (a split of 50 million
    samples from 10,000 sources is 5 * 10**11 steps of the loop, minutes even in C++), the
    port runs over as many first samples as :data:`EXACT_WORK` allows and the rest is shared
    out by the largest remainders of ``weights * size``: not Megatron's to the sample (a few
    off), and flagged.

    Args:
        weights: The normalized weights (:func:`blend_weights`).
        size: The blend's size.

    Returns:
        The counts (int64, one per dataset) and whether they are exact.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    if n <= 1:
        return np.full(n, size, dtype=np.int64), True
    if size * (n + 300) > PORT_WORK and size <= MEGATRON_LIMIT and size * n <= MEGATRON_WORK:
        helpers = megatron_helpers()
        if helpers is not None:
            index = np.zeros(size, dtype=np.int16)
            helpers.build_blending_indices(index, np.zeros(size, dtype=np.int64), w, n, size, False)
            return np.bincount(index, minlength=n).astype(np.int64), True
    steps = min(size, EXACT_LIMIT, EXACT_WORK // n)
    counts = _port(w, steps)
    if steps == size:
        return counts, True
    ideal = w * size
    rest = size - int(counts.sum())
    want = np.maximum(np.floor(ideal).astype(np.int64) - counts, 0)
    if want.sum() > rest:  # cannot happen for a greedy this close; keep the total anyway
        want = np.zeros(n, dtype=np.int64)
    counts += want
    rest -= int(want.sum())
    order = np.argsort(-(ideal - counts), kind="stable")
    counts[order[:rest]] += 1
    return counts, False


def _port(w: np.ndarray, steps: int) -> np.ndarray:
    """``build_blending_indices`` over ``steps`` samples: the count drawn of each dataset."""
    n = len(w)
    if n <= 8:  # plain floats are faster than numpy for a handful of datasets
        counts = [0] * n
        wl = w.tolist()
        for t in range(steps):
            s = float(max(t, 1))
            best = 0
            top = wl[0] * s - counts[0]
            for i in range(1, n):
                error = wl[i] * s - counts[i]
                if error > top:
                    top, best = error, i
            counts[best] += 1
        return np.array(counts, dtype=np.int64)
    drawn = np.zeros(n, dtype=np.float64)  # C++ casts its int64 counts to double
    error = np.empty_like(w)
    multiply, subtract, argmax = np.multiply, np.subtract, error.argmax
    for t in range(steps):
        multiply(w, float(max(t, 1)), out=error)
        subtract(error, drawn, out=error)
        drawn[argmax()] += 1.0
    return drawn.astype(np.int64)


_HELPERS: list[Any] = []


def megatron_helpers() -> Any:
    """megatron-core's compiled ``helpers_cpp`` module, loaded from its file without importing
    the ``megatron.core`` package (which imports torch); ``None`` where it is not installed."""
    if not _HELPERS:
        _HELPERS.append(_load_helpers())
    return _HELPERS[0]


def _load_helpers() -> Any:
    name = "megatron.core.datasets.helpers_cpp"
    try:
        spec = importlib.util.find_spec("megatron")  # a namespace package: nothing runs
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "core", "datasets", "helpers_cpp" + suffix)
            if not os.path.isfile(path):
                continue
            loader = importlib.machinery.ExtensionFileLoader(name, path)
            found = importlib.util.spec_from_file_location(name, path, loader=loader)
            try:
                module = importlib.util.module_from_spec(found)
                loader.exec_module(module)
            except ImportError:
                return None
            if hasattr(module, "build_blending_indices"):
                return module
    return None


@dataclass(frozen=True)
class OverDraw:
    """A dataset the blend draws more often than its length: ``BlendedDataset`` raises.

    Attributes:
        position: The dataset's position in the split's blend.
        drawn: The samples the blend draws from it.
        available: Its length.
        number: What Megatron's message calls it: ``GPTDataset number {number}``, its rank
            among the datasets drawn from at all.
        first: Whether Megatron's ``IndexError`` names this one (the first in blend order).
    """

    position: int
    drawn: int
    available: int
    number: int
    first: bool


def over_draws(drawn: Sequence[int], lengths: Sequence[int]) -> list[OverDraw]:
    """The datasets drawn beyond their length, as ``BlendedDataset._build_indices`` checks
    them: over the datasets drawn from (``numpy.unique`` of the dataset index, in order)."""
    found = []
    number = 0
    for position, (count, length) in enumerate(zip(drawn, lengths)):
        if count <= 0:
            continue
        if length < count:
            found.append(OverDraw(position, int(count), int(length), number, not found))
        number += 1
    return found


def surplus_for(drawn: int, target: int, current: float) -> float:
    """The smallest surplus, in steps of 0.001, with which Megatron builds ``drawn`` samples
    of a dataset planned ``target`` (``ceil(target * (1 + surplus))``, as it computes it)."""
    step = 1000
    surplus = max(current, math.floor((drawn / max(target, 1) - 1) * step) / step)
    while int(math.ceil(target * (1 + surplus))) < drawn:  # noqa: RUF046
        surplus = round(surplus + 1 / step, 3)
    return surplus
