"""The order of a blend on x86-64 and on aarch64 nodes: the doctor's ``arch-dependent-order``.

Megatron's ``BlendedDataset`` draws sample ``t`` from the dataset whose error ``weights[i] *
t - drawn[i]`` is largest. Its x86-64 builds round that error twice, its aarch64 builds (GH200,
GB200) once, a fused multiply-subtract (:mod:`repack.model.rounding`), and wherever two errors
nearly tie the two draw another dataset: weights ``1 2 3`` part at sample 6, and most
hand-written weights within some thousands of samples. For every split that blends,
:func:`order_problems` builds both orders (:func:`repack.model.blend_draws.order_difference`,
over the first :data:`ORDER_SAMPLES` samples at most) and warns where they part; where the
fused rounding cannot be computed here (no compiled ``repack.model._blending``) it says so in
one line. :func:`arithmetic` is the report's ``blending_arithmetic``; :func:`require_rounding`
refuses a rounding this install cannot compute.
"""

from __future__ import annotations

from typing import Any

from repack.doctor.problems import WARNING, Problem
from repack.errors import NotCompiled
from repack.model import blend_draws, blending, rounding
from repack.model.arithmetic import INT16_DATASETS
from repack.model.splits import SplitPlan

__all__ = [
    "ORDER_SAMPLES",
    "WAY_OUT",
    "arithmetic",
    "arithmetic_line",
    "order_problems",
    "require_rounding",
]

#: Samples of a split the doctor compares at most (both orders: about 0.15 µs a sample each at
#: 10,000 datasets, 10 bytes a sample; a longer split is compared on this prefix).
ORDER_SAMPLES = 10_000_000

#: What keeps one order on both: weights whose every error Megatron computes exactly
#: (:func:`repack.model.blend_draws.exact_errors`).
WAY_OUT = (
    "weights that are exact binary fractions of their sum, whole multiples of 1/1024 summing "
    "to 1 (or whole numbers summing to a power of two, such as 1 1 2): Megatron's normalized "
    "weights are then multiples of 2**-k, every error it computes is exact (up to 2**(53 - k) "
    "samples: 8.8e12 for 1/1024), and both roundings draw the same order"
)


def arithmetic(fma: bool) -> dict[str, Any]:
    """The report's ``blending_arithmetic``: the rounding its draws follow."""
    return {"fma": bool(fma), "description": rounding.describe(fma)}


def arithmetic_line(fma: bool) -> str:
    """The report's line saying which rounding its draws follow."""
    return f"blending arithmetic: {rounding.describe(fma)}"


def require_rounding(fma: bool) -> None:
    """Refuse the fused rounding where this install cannot compute it.

    Raises:
        NotCompiled: ``fma`` without ``repack.model._blending``.
    """
    if not blending.computes(fma):
        raise NotCompiled(
            f"blending arithmetic {rounding.describe(True)} (--fma, the default where the "
            "installed megatron-core or this machine rounds once) needs repack.model._blending, "
            "which this install did not build: reinstall repack where a C compiler and "
            f"Python's headers are at hand, or give --no-fma for the draws of "
            f"{rounding.describe(False)}"
        )


def order_problems(plans: list[SplitPlan], *, limit: int = ORDER_SAMPLES) -> list[Problem]:
    """An ``arch-dependent-order`` warning for every split whose ``BlendedDataset`` draws
    another order on x86-64 and aarch64 builds of Megatron; one ``arch-order-unchecked``
    warning, and nothing else, where this install cannot compute the fused rounding.

    Args:
        plans: The run's splits (:func:`repack.model.splits.plan_splits`).
        limit: Compare at most this many samples of a split (its first).
    """
    problems = []
    for plan in plans:
        if plan.weights is None or plan.size is None or len(plan.datasets) >= INT16_DATASETS:
            continue  # no BlendedDataset, or Megatron stops before drawing
        try:
            found = blend_draws.order_difference(plan.weights, plan.size, limit=limit)
        except NotCompiled as err:
            return [
                Problem(
                    WARNING,
                    "arch-order-unchecked",
                    "the orders of Megatron's x86-64 builds (two roundings of the blending "
                    "error) and aarch64 builds (one rounding) could not be compared: "
                    f"{err}",
                )
            ]
        if found is not None:
            problems.append(_problem(plan, found))
    return problems


def _problem(plan: SplitPlan, found: blend_draws.OrderDifference) -> Problem:
    share = f"{100 * found.share:.3g}%"
    if found.whole:
        of = f"{found.differing:,} of its {found.size:,} samples ({share})"
    else:
        of = (
            f"{found.differing:,} of its first {found.compared:,} samples ({share}; the other "
            f"{found.size - found.compared:,} were not compared)"
        )
    return Problem(
        WARNING,
        "arch-dependent-order",
        f"split {plan.name}: Megatron's x86-64 builds (the blending error rounded twice) and "
        f"aarch64 builds (rounded once) draw another order from sample {found.first:,} on: "
        f"{of} come from another dataset. The "
        "same job trains another order on x86-64 and aarch64 nodes; an index cache built on "
        "one kind of machine and used on the other keeps the first machine's order. Way out: "
        + WAY_OUT,
        None,
        plan.name,
    )
