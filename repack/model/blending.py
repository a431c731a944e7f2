"""``BlendedDataset``'s blending index: Megatron's bytes, without its samples x datasets loop.

megatron-core's ``helpers.cpp`` fills a ``BlendedDataset``'s ``dataset_index`` (int16) and
``dataset_sample_index`` (int64) with ``build_blending_indices``: for every sample ``t`` it
values every dataset ``i`` at ``weights[i] * max(t, 1.0) - count[i]`` (float64, two
roundings) and draws the first of the largest. That costs samples x datasets: 9 s for 10**6
samples of 10,000 datasets, 21 minutes for 10**8, on the rank that builds while the job
waits. ``build_exhaustive_blending_indices`` (a blend with no size: every dataset drawn
exactly its length) does the same over the datasets not yet spent.

The functions here give the same bytes, for any weights and size:

* compiled (``repack/model/_blending.c``, built by ``pip install`` beside the document hashes), a
  tournament tree whose nodes are decided with Megatron's own expression and tie rule, and
  decided again only when a faster-growing loser can have caught up: O(log datasets) a sample;
* where it was not built, :func:`_python_blend`, in numpy: blocks of steps, each run with
  Megatron's loop over a candidate set proven to hold every dataset that can win in the block.
  The two paths differ because a tree walked in the interpreter costs more per sample than
  numpy's loop over a few hundred candidates; both take every decision with Megatron's
  expression, and the tests hold both to megatron-core's helper.

:func:`build_blending_indices` and :func:`build_exhaustive_blending_indices` have
``helpers.cpp``'s signatures, so they drop in where Megatron calls its own
(:func:`repack.megatron.fast_blending`); :func:`drawn_counts` gives the samples drawn from
each dataset without the indices (what the doctor needs, 8 bytes a dataset).

Megatron's error ``w * s - c`` is rounded twice by its x86-64 builds (the product, then the
difference) and once by its aarch64 builds (a fused multiply-subtract: ``fnmsub``), and the two
pick different datasets wherever two errors nearly tie (:mod:`repack.model.rounding`). Every
function here takes ``fma``: ``False`` for the x86-64 rounding, ``True`` for aarch64's. The
compiled path gives both; the numpy path gives the x86-64 rounding only, and refuses the other
(:class:`repack.errors.NotCompiled`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from repack.errors import NotCompiled
from repack.model import rounding

try:  # built from repack/model/_blending.c where the install had a C compiler (setup.py)
    from repack.model._blending import blend as _compiled_blend
except ImportError:  # pragma: no cover - exercised by tests that hide the module
    _compiled_blend = None

__all__ = [
    "COMPILED",
    "computes",
    "build_blending_indices",
    "build_exhaustive_blending_indices",
    "drawn_counts",
]

#: Whether the compiled path (``repack.model._blending``) is in use.
COMPILED = _compiled_blend is not None


def build_blending_indices(
    dataset_index: np.ndarray,
    dataset_sample_index: np.ndarray,
    weights: np.ndarray,
    num_datasets: int,
    size: int,
    verbose: bool,
    *,
    fma: bool = False,
) -> None:
    """``helpers.build_blending_indices``: fill the first ``size`` entries of both indices.

    Args:
        dataset_index: int16, C-contiguous, at least ``size`` long: the dataset of each sample.
        dataset_sample_index: int64, likewise: the sample's index within its dataset.
        weights: float64, at least ``num_datasets`` of them (Megatron's normalized weights).
        num_datasets: How many datasets (the first ``num_datasets`` weights).
        size: Samples to draw.
        verbose: Print what Megatron's helper prints.
        fma: Round the error once, as aarch64 builds of Megatron do (else twice, as x86-64
            builds do).

    A negative size draws nothing, as in Megatron's helper (its loop never runs), and
    ``verbose`` then prints what it prints: ratios of ``-0``, or of NaN for a size of 0 (``-nan``
    from x86-64 builds, whose default NaN is negative; ``nan`` from aarch64 builds).

    Raises:
        ValueError: an index of another dtype or too short, fewer weights than datasets (where
            Megatron's helper would write or read out of bounds).
        NotCompiled: ``fma`` where ``repack.model._blending`` was not built.
    """
    w = _weights(weights, num_datasets)
    size = int(size)
    _check_index(dataset_index, np.int16, size, "dataset_index")
    _check_index(dataset_sample_index, np.int64, size, "dataset_sample_index")
    if verbose:
        print("> building indices for blended datasets ...", flush=True)
    counts = _blend(w, None, max(size, 0), dataset_index, dataset_sample_index, fma)
    if verbose:
        print(" > sample ratios:")
        for i, weight in enumerate(w.tolist()):
            ratio = f"{counts[i] / size:.6g}" if size else "nan" if fma else "-nan"
            print(f"   dataset {i}, input: {weight:.6g}, achieved: {ratio}", flush=True)


def build_exhaustive_blending_indices(
    dataset_index: np.ndarray,
    dataset_sample_index: np.ndarray,
    sizes: np.ndarray,
    num_datasets: int,
    *,
    fma: bool = False,
) -> None:
    """``helpers.build_exhaustive_blending_indices``: draw every dataset exactly ``sizes[i]``
    times, in proportion to the sizes, filling the first ``sum(sizes)`` entries.

    Raises:
        ValueError: as :func:`build_blending_indices`; also a size below 1, which Megatron's
            helper never finishes (it keeps drawing that dataset past the index's end).
    """
    n = int(num_datasets)
    counts = np.ascontiguousarray(sizes, dtype=np.int64)
    if counts.ndim != 1 or len(counts) < n:
        raise ValueError(f"sizes: {len(counts)} of them for {n} datasets")
    counts = counts[:n]
    short = np.flatnonzero(counts <= 0)
    if len(short):
        raise ValueError(
            f"sizes: dataset {int(short[0])} has size {int(counts[short[0]])}; Megatron's "
            "build_exhaustive_blending_indices never finishes with a size below 1"
        )
    total = int(counts.sum())
    _check_index(dataset_index, np.int16, total, "dataset_index")
    _check_index(dataset_sample_index, np.int64, total, "dataset_sample_index")
    weights = counts.astype(np.float64) / np.float64(total)  # sizes[i] / double(total)
    _blend(weights, counts, total, dataset_index, dataset_sample_index, fma)


def computes(fma: bool) -> bool:
    """Whether this install gives the rounding ``fma`` asks: two roundings always; the fused one
    compiled, or by the installed megatron-core's own helper where that rounds once."""
    return not fma or COMPILED or rounding.installed_fma() is True


def drawn_counts(
    weights: Sequence[float] | np.ndarray, size: int, *, fma: bool = False
) -> np.ndarray:
    """The samples ``build_blending_indices`` draws from each dataset over ``size`` samples
    (``np.bincount`` of its dataset index), without building the indices."""
    w = _weights(np.asarray(weights, dtype=np.float64), len(weights))
    return _blend(w, None, int(size), None, None, fma)


def _weights(weights: np.ndarray, num_datasets: int) -> np.ndarray:
    n = int(num_datasets)
    w = np.ascontiguousarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) < n:
        raise ValueError(f"weights: {len(w)} of them for {n} datasets")
    if n < 1:
        raise ValueError("num_datasets: 0; Megatron's helper reads weights[0]")
    return w[:n]


def _check_index(array: np.ndarray, dtype: type, size: int, name: str) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != dtype:
        found = getattr(array, "dtype", type(array).__name__)
        raise ValueError(f"{name}: {found}, expected a numpy array of {np.dtype(dtype)}")
    if array.ndim != 1 or not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError(f"{name}: expected a writable one-dimensional C-contiguous array")
    if len(array) < size:
        raise ValueError(f"{name}: {len(array)} entries for {size} samples")


def _blend(
    w: np.ndarray,
    sizes: np.ndarray | None,
    size: int,
    index: np.ndarray | None,
    sample: np.ndarray | None,
    fma: bool,
) -> np.ndarray:
    """The one blending loop: fill ``index`` and ``sample`` (or neither), return the counts."""
    counts = np.zeros(len(w), dtype=np.int64)
    if _compiled_blend is not None:
        _compiled_blend(w, sizes, size, index, sample, counts, bool(fma))
    elif fma and rounding.installed_fma() is True:
        # an aarch64 node whose install built nothing: its own Megatron helper rounds once
        _helper_blend(rounding.installed_helper(), w, sizes, size, index, sample, counts)
    elif fma:
        # numpy has no fused multiply-add, and an exact one in numpy (an error-free product,
        # then one rounding of a sum of three) would cost more than the loop it serves
        raise NotCompiled(
            "the fused rounding of Megatron's blending error (aarch64 builds) needs "
            "repack.model._blending, which this install did not build: reinstall repack where "
            "a C compiler and Python's headers are at hand"
        )
    else:
        _python_blend(w, sizes, size, index, sample, counts)
    return counts


def _helper_blend(
    helper: object,
    w: np.ndarray,
    sizes: np.ndarray | None,
    size: int,
    index: np.ndarray | None,
    sample: np.ndarray | None,
    counts: np.ndarray,
) -> None:
    """The blending loop by Megatron's own compiled helper (its samples x datasets loop)."""
    if index is None:  # counts only: the helper fills indices
        index, sample = np.zeros(size, dtype=np.int16), np.zeros(size, dtype=np.int64)
    if sizes is None:
        helper.build_blending_indices(index, sample, w, len(w), size, False)
    else:
        helper.build_exhaustive_blending_indices(index, sample, sizes, len(w))
    counts[:] = np.bincount(index[:size].view(np.uint16), minlength=len(w))[: len(w)]


#: Block length of the Python path, as a multiple of sqrt(datasets): each block costs a pass
#: over every dataset, each step a pass over about two block lengths of candidates.
_BLOCK_FACTOR = 2.0
#: Up to this many candidates a step runs on Python floats rather than numpy.
_FLOATS = 8


def _python_blend(
    w: np.ndarray,
    sizes: np.ndarray | None,
    size: int,
    index: np.ndarray | None,
    sample: np.ndarray | None,
    counts: np.ndarray,
) -> None:
    """Megatron's loop, a block of steps at a time, each over its candidates only.

    Over a block of ``b`` steps from ``t0`` at most ``b`` datasets are drawn, so one of the
    ``b + 1`` datasets with the largest floors (the least its error can fall to while it
    waits ``b`` steps: its error at ``t0``, plus ``b`` times its weight where that is
    negative) is never drawn in it, and the largest error of every step of the block stays at
    or above the ``(b+1)``-th largest floor, less the rounding. A dataset whose error cannot
    reach that within ``b`` steps, even undrawn, cannot win a step of the block, nor tie: it
    is left out, and the block runs Megatron's loop, expression and tie rule, over the rest in
    index order. Every computed error is within ``margin`` of the exact line, and the
    candidates are chosen with four times that to spare. Weights that are not finite first
    go through :func:`_python_blend_finite_of`.
    """
    if sizes is None and not np.isfinite(w).all():  # (exhaustive weights are sizes / total)
        _python_blend_finite_of(w, size, index, sample, counts)
        return
    n = len(w)
    alive = np.ones(n, dtype=bool)  # not spent (exhaustive)
    margin = math.ldexp((float(np.abs(w).max()) + 1.0) * (max(size, 1) + 1.0), -50)
    block = max(16, int(_BLOCK_FACTOR * math.sqrt(n)))
    falls, rises = np.minimum(w, 0.0), np.maximum(w, 0.0)
    t = 0
    while t < size:
        b = min(block, size - t)
        s0 = float(max(t, 1))
        live = np.flatnonzero(alive)
        if b + 1 >= len(live):
            chosen = live
        else:
            errors = w[live] * s0 - counts[live].astype(np.float64)
            floors = errors + falls[live] * b
            floor = np.partition(floors, len(live) - (b + 1))[len(live) - (b + 1)]
            chosen = live[errors + rises[live] * b >= floor - 6.0 * margin]
        t = _run(w, sizes, chosen, t, t + b, index, sample, counts, alive)


def _python_blend_finite_of(
    w: np.ndarray,
    size: int,
    index: np.ndarray | None,
    sample: np.ndarray | None,
    counts: np.ndarray,
) -> None:
    """Megatron's loop where a weight is NaN or infinite. Its strict ``>`` from dataset 0 on
    settles those: NaN at dataset 0 wins every step (nothing compares above it), elsewhere
    never; the first infinite weight above every finite one wins every step; -inf never
    (unless no weight is finite: dataset 0 then). The rest is the blend of the finite
    weights alone, in their order."""
    finite = np.flatnonzero(np.isfinite(w))
    infinite = np.flatnonzero(np.isposinf(w))
    if math.isnan(w[0]) or not len(finite) or len(infinite):
        winner = 0 if math.isnan(w[0]) or not len(finite) else int(infinite[0])
        if index is not None:
            index[:size] = winner
            sample[:size] = np.arange(size, dtype=np.int64)
        counts[winner] = size
        return
    mine = np.zeros(len(finite), dtype=np.int64)
    _python_blend(np.ascontiguousarray(w[finite]), None, size, index, sample, mine)
    counts[finite] = mine
    if index is not None:  # positions among the finite ones, back to datasets
        index[:size] = finite[index[:size]].astype(np.int16)


def _run(
    w: np.ndarray,
    sizes: np.ndarray | None,
    chosen: np.ndarray,
    t: int,
    end: int,
    index: np.ndarray | None,
    sample: np.ndarray | None,
    counts: np.ndarray,
    alive: np.ndarray,
) -> int:
    """Megatron's loop over the datasets ``chosen`` (in index order), steps ``t`` to ``end``:
    on Python floats for a few datasets (every weight finite: ``argmax`` would take a NaN for
    the largest, where Megatron's ``>`` never does)."""
    wc = w[chosen]
    cc = counts[chosen].astype(np.float64)  # Megatron casts its int64 counts to double
    if sizes is not None:
        limit = sizes[chosen].astype(np.float64)
    small = len(chosen) <= _FLOATS
    if small:
        wl, cl = wc.tolist(), cc.tolist()
    errors = np.empty_like(wc)
    while t < end:
        s = float(max(t, 1))
        if small:
            best, top = -1, 0.0
            for j in range(len(wl)):
                if cl[j] == math.inf:
                    continue
                error = wl[j] * s - cl[j]
                if best < 0 or error > top:
                    best, top = j, error
        else:
            np.multiply(wc, s, out=errors)
            np.subtract(errors, cc, out=errors)
            best = int(errors.argmax())  # the first of the largest, as Megatron's strict >
        i = int(chosen[best])
        if index is not None:
            index[t] = i
            sample[t] = counts[i]
        counts[i] += 1
        drawn = float(counts[i])
        if small:
            cl[best] = drawn
        cc[best] = drawn
        if sizes is not None and limit[best] - drawn == 0:  # spent: never drawn again
            alive[i] = False
            wc[best] = 0.0
            cc[best] = math.inf
            if small:
                wl[best], cl[best] = 0.0, math.inf
        t += 1
    return t
