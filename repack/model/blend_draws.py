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

Megatron's x86-64 builds round the error twice, its aarch64 builds once (``fma``,
:mod:`repack.model.rounding`), and the two draw different orders for most weights:
:func:`order_difference` says where they part, and :func:`exact_errors` when they cannot
(weights that are exact binary fractions, every error computed exactly by both).

Pure Python and numpy; no imports of Megatron or torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from repack.model import arithmetic as mm
from repack.model import blending as model

__all__ = [
    "OrderDifference",
    "OverDraw",
    "blend_weights",
    "drawn_counts",
    "exact_errors",
    "order_difference",
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


def drawn_counts(weights: Sequence[float], size: int, *, fma: bool = False) -> np.ndarray:
    """The samples ``build_blending_indices`` draws from each dataset over ``size`` samples,
    to the sample (:func:`repack.model.blending.drawn_counts`).

    Args:
        weights: The normalized weights (:func:`blend_weights`).
        size: The blend's size.
        fma: Megatron's error rounded once, as its aarch64 builds (else twice, as x86-64's).

    Returns:
        The counts, int64, one per dataset.

    Raises:
        NotCompiled: ``fma`` where ``repack.model._blending`` was not built.
    """
    if len(weights) <= 1:
        return np.full(len(weights), size, dtype=np.int64)
    return model.drawn_counts(weights, size, fma=fma)


def exact_errors(weights: Sequence[float], size: int) -> bool:
    """Whether Megatron computes every error ``weights[i] * max(t, 1) - count[i]`` of a blend
    of ``size`` samples exactly, in both roundings, so that both draw the same order.

    So it is when every weight is a whole multiple of ``2**-m`` with ``2**m * (size + 1) <=
    2**53``: the product, a multiple of ``2**-m`` below ``size + 1``, and the difference, one
    of magnitude at most ``size + 1`` (the counts never pass the step), both fit in a double's
    53 bits. Weights given as whole multiples of 1/1024 (or whole numbers) whose sum is a
    power of two are such after Megatron's normalization (``m`` = 10 for 1/1024 summing to 1:
    up to 8.8e12 samples); other weights are seldom (1/3, 0.1, lengths that do not sum to a
    power of two).

    Args:
        weights: The weights ``build_blending_indices`` gets (:func:`blend_weights`).
        size: The blend's size (for an exhaustive blend, the sum of its sizes).
    """
    limit = Fraction(2**53, max(int(size), 0) + 1)
    for weight in weights:
        weight = float(weight)
        if not math.isfinite(weight) or weight < 0:
            return False
        if Fraction(weight).denominator > limit:
            return False
    return True


@dataclass(frozen=True)
class OrderDifference:
    """Where a blend's two orders part: Megatron's x86-64 builds' and its aarch64 builds'.

    Attributes:
        first: The first sample whose dataset differs.
        differing: Of the samples compared, those whose dataset differs.
        compared: The samples compared: the blend's first ``compared`` (all of them when the
            blend is within the ``limit`` of :func:`order_difference`).
        size: The blend's size.
    """

    first: int
    differing: int
    compared: int
    size: int

    @property
    def share(self) -> float:
        """The share of the samples compared whose dataset differs."""
        return self.differing / self.compared if self.compared else 0.0

    @property
    def whole(self) -> bool:
        """Whether every sample of the blend was compared."""
        return self.compared >= self.size


def order_difference(
    weights: Sequence[float],
    size: int | None = None,
    *,
    sizes: Sequence[int] | None = None,
    limit: int | None = None,
) -> OrderDifference | None:
    """Where ``BlendedDataset``'s order differs between Megatron's two roundings of its
    error (x86-64 builds: twice; aarch64 builds: once), or ``None`` where it does not.

    Both blending indices are built (:mod:`repack.model.blending`, about 0.15 µs a sample
    each at 10,000 datasets) over the first ``limit`` samples at most (a blend of ``size``
    samples, or with ``sizes`` the exhaustive one of a blend with no size, which is compared
    whole or not at all); nothing is built where :func:`exact_errors` proves them equal.

    Args:
        weights: The weights ``build_blending_indices`` gets (:func:`blend_weights`);
            ignored with ``sizes``.
        size: The blend's size.
        sizes: Instead of ``weights`` and ``size``: the datasets' sizes of a blend with no
            size (``build_exhaustive_blending_indices``).
        limit: Compare at most this many samples (``None``: all).

    Returns:
        Where they part, or ``None`` where they do not (or, with ``sizes``, where the blend
        is past ``limit`` and was not compared).

    Raises:
        NotCompiled: ``repack.model._blending`` was not built (the fused rounding needs it).
    """
    if sizes is not None:
        counts = np.ascontiguousarray(sizes, dtype=np.int64)
        total = int(counts.sum())
        if len(counts) <= 1 or (limit is not None and total > limit):
            return None
        if exact_errors((counts / np.float64(total)).tolist(), total):
            return None
        orders = []
        sample = np.empty(total, dtype=np.int64)
        for fma in (False, True):
            index = np.empty(total, dtype=np.int16)
            model.build_exhaustive_blending_indices(index, sample, counts, len(counts), fma=fma)
            orders.append(index)
        return _parted(orders, total, total)
    if size is None:
        raise ValueError("give size (a blend with a size) or sizes (one without)")
    size = int(size)
    compared = size if limit is None else min(size, int(limit))
    if len(weights) <= 1 or compared <= 0 or exact_errors(weights, size):
        return None
    w = np.ascontiguousarray(weights, dtype=np.float64)
    orders = []
    sample = np.empty(compared, dtype=np.int64)
    for fma in (False, True):
        index = np.empty(compared, dtype=np.int16)
        model.build_blending_indices(index, sample, w, len(w), compared, False, fma=fma)
        orders.append(index)
    return _parted(orders, compared, size)


def _parted(orders: list[np.ndarray], compared: int, size: int) -> OrderDifference | None:
    differ = orders[0] != orders[1]
    first = int(np.argmax(differ))
    if not differ[first]:
        return None
    return OrderDifference(first, int(np.count_nonzero(differ)), compared, size)


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
