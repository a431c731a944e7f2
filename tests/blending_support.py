"""Weights the blending index is tested and benchmarked on, and the byte comparison.

Families of weights (:data:`FAMILIES`, :func:`family_weights`) that real blends have or that
the tie rule and the rounding can trip on; :func:`generated` draws test cases from them (and
from the kinds of :data:`KINDS`), :func:`compare` holds one index to another byte for byte.
Used by tests/test_blending.py, tests/test_blending_fused.py and scripts/bench_blending.py.

numpy and repack only: neither Megatron nor torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType

import numpy as np

from repack.model.blend_draws import blend_weights

__all__ = [
    "FAMILIES",
    "GROUP",
    "KINDS",
    "assert_same",
    "build_indices",
    "compare",
    "count",
    "family_weights",
    "generated",
    "normalized",
]

#: The families of weights of scripts/bench_blending.py, raw (before Megatron normalizes them).
FAMILIES = (
    "uniform",  # uniform in [0, 1)
    "zipf",  # 1/rank, ranks shuffled
    "lognormal",  # lognormal, sigma 2
    "dirichlet1",
    "dirichlet0.1",
    "dirichlet0.05",  # many weights far below 1e-9, some exactly 0
    "near-equal-1e-3",  # 1 + 1e-3 * uniform(-1, 1)
    "near-equal-1e-6",
    "near-equal-1e-9",
    "near-equal-1e-12",  # a few thousand ulps apart
    "equal",  # ties everywhere
    "groups",  # equal in runs of 100 (of GROUP), random between runs
    "few-large",  # 10 large, the rest tiny and near-equal (1e-3, within 1e-6)
    "shard-tokens",  # token counts of equal-size shards: 2**29 minus 0..2000
    "two-decimal",  # hand-written: random multiples of 0.01 in [0.01, 1]
)

#: The kinds of tests/test_blending.py's cases (``exhaustive``: a blend with no size).
KINDS = ("random", "dirichlet", "equal", "groups", "ulps", "orders", "exhaustive")

#: The run length of ``groups`` in :func:`family_weights`.
GROUP = 100


def family_weights(family: str, n: int, rng: np.random.Generator, group: int = GROUP) -> np.ndarray:
    """``n`` raw weights of ``family`` (:data:`FAMILIES`, or a kind of :data:`KINDS` but
    ``exhaustive``), float64; ``group`` is the run length of ``groups``."""
    if family in ("uniform", "random"):
        return rng.random(n)
    if family == "zipf":
        return 1.0 / (1.0 + rng.permutation(n))
    if family == "lognormal":
        return rng.lognormal(0.0, 2.0, n)
    if family.startswith("dirichlet") and family != "dirichlet":
        return rng.dirichlet(np.full(n, float(family.removeprefix("dirichlet"))))
    if family.startswith("near-equal-"):
        spread = float(family.removeprefix("near-equal-"))
        return 1.0 + spread * rng.uniform(-1.0, 1.0, n)
    if family == "equal":
        return np.ones(n)
    if family == "groups":
        return np.repeat(rng.random(max(1, n // group) + 1), group)[:n]
    if family == "few-large":
        w = 1e-3 * (1.0 + 1e-6 * rng.uniform(-1.0, 1.0, n))
        w[rng.permutation(n)[:10]] = 1.0 + rng.random(min(10, n))
        return w
    if family == "shard-tokens":
        return (2**29 - rng.integers(0, 2001, n)).astype(np.float64)
    if family == "two-decimal":
        return rng.integers(1, 101, n) / 100.0
    # tests/test_blending.py's kinds
    if family == "dirichlet":
        return np.maximum(rng.dirichlet(np.full(n, float(rng.choice([0.02, 0.2, 1.0])))), 1e-9)
    if family == "ulps":  # 1/3 and its neighbours: equal products, or a rounding apart
        return np.full(n, 1 / 3) * (1 + rng.integers(-3, 4, n) * 2.0**-52)
    if family == "orders":
        return 10 ** rng.uniform(-6, 0, n)
    raise ValueError(f"family: {family!r}, expected one of {', '.join(FAMILIES)}")


def normalized(weights: Iterable[float]) -> np.ndarray:
    """The weights ``build_blending_indices`` receives: normalized by the builder, then by
    ``BlendedDataset`` (:func:`repack.model.blend_draws.blend_weights`)."""
    return np.array(blend_weights(list(weights), []), dtype=np.float64)


def generated(
    count: int,
    seed: int,
    work: float,
    largest: int,
    kinds: tuple[str, ...] = KINDS,
    group: int = 5,
) -> Iterator[tuple]:
    """``count`` cases ``(kind, weights, size)``, the kinds in turn: up to ``largest`` datasets
    and 10**6 samples, samples x datasets at most ``work`` (Megatron's helper: about 1 ns
    each). For ``exhaustive`` the weights are the sizes (int64) and the size their sum;
    ``group`` is the run length of ``groups`` (5 for test_blending's few datasets)."""
    rng = np.random.default_rng(seed)
    for case in range(count):
        kind = kinds[case % len(kinds)]
        n = int(math.exp(rng.uniform(0, math.log(largest))))
        if kind == "exhaustive":
            sizes = rng.integers(1, int(rng.choice([3, 50, 2000])), n)
            while sizes.sum() * n > work and sizes.max() > 1:
                sizes = np.maximum(sizes // 2, 1)
            yield kind, sizes.astype(np.int64), int(sizes.sum())
            continue
        w = normalized(family_weights(kind, n, rng, group))
        size = 0 if case % 97 == 0 else int(math.exp(rng.uniform(0, math.log(10**6))))
        yield kind, w, min(size, int(work // n))


def build_indices(module: ModuleType, kind: str, w: np.ndarray, size: int, **keywords) -> tuple:
    """``module``'s ``build_exhaustive_blending_indices`` (``kind`` ``exhaustive``: ``w`` are
    the sizes) or ``build_blending_indices`` into new arrays: ``(dataset_index,
    dataset_sample_index)``. ``keywords`` go to the call (repack's ``fma``)."""
    index = np.full(size, -7, dtype=np.int16)
    sample = np.full(size, -7, dtype=np.int64)
    if kind == "exhaustive":
        module.build_exhaustive_blending_indices(index, sample, w, len(w), **keywords)
    else:
        module.build_blending_indices(index, sample, w, len(w), size, False, **keywords)
    return index, sample


Builder = Callable[[str, np.ndarray, int], tuple]


def compare(
    cases: Iterable[tuple], ours: Builder, theirs: Builder, name: str = "Megatron's"
) -> dict[str, int]:
    """Hold ``ours(kind, w, size)`` to ``theirs(...)`` byte for byte on every case (the first
    difference fails, naming the case); count the cases seen per kind, with thousands of
    datasets and with 10**5 samples or more."""
    seen: dict[str, int] = {}
    for case, (kind, w, size) in enumerate(cases):
        assert_same(ours(kind, w, size), theirs(kind, w, size), f"case {case}", kind, w, name)
        count(seen, kind, w, size)
    return seen


def assert_same(
    mine: tuple, reference: tuple, case: str, kind: str, w: np.ndarray, name: str
) -> None:
    """Fail at the first sample where the two ``(dataset_index, dataset_sample_index)``
    differ, naming the case, the array, the sample and both values."""
    for a, b, array in zip(mine, reference, ("dataset_index", "dataset_sample_index")):
        if not np.array_equal(a, b):
            first = int(np.flatnonzero(a != b)[0])
            raise AssertionError(
                f"{case} ({kind}, {len(w)} datasets, {len(b)} samples): {array} differs "
                f"first at sample {first}: {a[first]} against {name} {b[first]}"
            )


def count(seen: dict[str, int], kind: str, w: np.ndarray, size: int) -> None:
    """Count a case in ``seen``: by kind, with 1,000 datasets or more, 10**5 samples or more."""
    seen[kind] = seen.get(kind, 0) + 1
    seen["datasets>=1000"] = seen.get("datasets>=1000", 0) + (len(w) >= 1000)
    seen["samples>=100000"] = seen.get("samples>=100000", 0) + (size >= 100_000)
