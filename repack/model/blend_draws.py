"""What ``BlendedDataset`` draws from each of its datasets: Megatron's greedy interleave.

``BlendedDataset._build_indices`` fills its dataset index with ``helpers.cpp``'s
``build_blending_indices``: for every sample ``t`` it picks the dataset whose error
``weights[i] * max(t, 1) - drawn[i]`` is largest (the first on a tie) and counts one draw for
it. It then refuses, with ``IndexError``, a dataset drawn more often than its length (the
over-draw of Megatron-LM issue #705). :func:`drawn_counts` gives those counts exactly, at any
scale, from :mod:`repack.model.blending` (Megatron's bytes without its samples x datasets
loop); :func:`blend_weights` the weights ``BlendedDataset`` hands it (normalized twice for a
weighted blend: once by the builder, once by ``BlendedDataset``; the datasets' lengths,
normalized, without weights).

Pure Python and numpy; no imports of Megatron or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from repack.model import arithmetic as mm
from repack.model import blending as model

__all__ = [
    "OverDraw",
    "blend_weights",
    "drawn_counts",
    "over_draws",
    "surplus_for",
]


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


def drawn_counts(weights: Sequence[float], size: int) -> np.ndarray:
    """The samples ``build_blending_indices`` draws from each dataset over ``size`` samples,
    to the sample (:func:`repack.model.blending.drawn_counts`).

    Args:
        weights: The normalized weights (:func:`blend_weights`).
        size: The blend's size.

    Returns:
        The counts, int64, one per dataset.
    """
    if len(weights) <= 1:
        return np.full(len(weights), size, dtype=np.int64)
    return model.drawn_counts(weights, size)


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
