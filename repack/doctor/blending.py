"""What ``BlendedDataset`` draws from each of its datasets: Megatron's greedy interleave, ported.

``BlendedDataset._build_indices`` fills its dataset index with ``helpers.cpp``'s
``build_blending_indices``: for every sample ``t`` of the blend it picks the dataset whose
error ``weights[i] * max(t, 1) - drawn[i]`` is largest (the first on a tie) and counts one
draw for it. It then refuses, with ``IndexError``, a dataset drawn more often than its length
(the over-draw of Megatron-LM issue #705). :func:`drawn_counts` is that loop with the same
double-precision expressions, so its counts are Megatron's to the sample; :func:`blend_weights`
the weights ``BlendedDataset`` hands it (normalized twice for a weighted blend: once by the
builder, once by ``BlendedDataset``; the datasets' lengths, normalized, without weights).

No I/O, no imports of Megatron or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from repack.doctor import arithmetic as mm

__all__ = ["EXACT_LIMIT", "OverDraw", "blend_weights", "drawn_counts", "over_draws"]

#: Samples of a blend up to which :func:`drawn_counts` runs Megatron's loop (one step per
#: sample, a few microseconds each); past it the counts are estimated (see ``drawn_counts``).
EXACT_LIMIT = 1_000_000


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

    Up to :data:`EXACT_LIMIT` samples this is Megatron's loop, expression for expression
    (``weights[i] * max(t, 1.0) - drawn[i]`` in float64, the first largest wins), so the counts
    are exact. Past it, where a Python loop would take minutes, the loop runs over the first
    :data:`EXACT_LIMIT` samples and the rest is shared out by the largest remainders of
    ``weights * size``: not Megatron's to the sample (the greedy keeps every count within a
    few samples of ``weights * size``), and flagged as such.

    Args:
        weights: The normalized weights (:func:`blend_weights`).
        size: The blend's size.

    Returns:
        The counts (int64, one per dataset) and whether they are exact.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    steps = min(size, EXACT_LIMIT)
    drawn = np.zeros(n, dtype=np.float64)  # C++ casts its int64 counts to double
    if n == 1:
        drawn[0] = steps
    elif n:
        counts = [0] * n
        wl = w.tolist()
        if n <= 8:  # plain floats are faster than numpy for a handful of datasets
            for t in range(steps):
                s = float(max(t, 1))
                best = 0
                top = wl[0] * s - counts[0]
                for i in range(1, n):
                    error = wl[i] * s - counts[i]
                    if error > top:
                        top, best = error, i
                counts[best] += 1
            drawn[:] = counts
        else:
            error = np.empty_like(w)
            multiply, subtract, argmax = np.multiply, np.subtract, error.argmax
            for t in range(steps):
                multiply(w, float(max(t, 1)), out=error)
                subtract(error, drawn, out=error)
                drawn[argmax()] += 1.0
    counts = drawn.astype(np.int64)
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
