"""repack's blending index in both roundings of Megatron's helper (issue 43).

megatron-core's ``helpers.cpp`` values every dataset at ``weights[i] * max(t, 1.0) -
current_samples[i]``: its x86-64 wheels round the product and the difference apart, its
aarch64 wheels (GH200, GB200) fuse them (one ``fnmsub``, one rounding), and draw another order.
``fma=False`` of :mod:`repack.model.blending` must give the bytes of the release's own helper
(``helpers_cpp``), ``fma=True`` those of the same ``helpers.cpp`` compiled with fused
multiply-subtract (tests/fused_helper.py: built here with ``-mfma``, checked with ``objdump``),
on the weight families of scripts/bench_blending.py and the kinds of tests/test_blending.py,
1 to 3,000 datasets, and on the exhaustive index of blends with no size. A third build, GCC 12's
from source (dataset 0's error rounded twice, the others' once), is neither: the probe says so.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from blending_support import (
    FAMILIES,
    GROUP,
    assert_same,
    build_indices,
    count,
    family_weights,
    generated,
    normalized,
)
from fused_helper import (
    FusedHelperError,
    NotHybridError,
    check_fused,
    check_hybrid,
    fused_helper,
    hybrid_helper,
    two_roundings,
)

from repack.errors import NotCompiled
from repack.model import blending, rounding

pytestmark = pytest.mark.megatron

#: Every family of the benchmark, test_blending's kinds that are not among them, the exhaustive
#: index.
KINDS = (*FAMILIES, "dirichlet", "ulps", "orders", "exhaustive")

#: Weights 1, 2, 3 (``np.array([1, 2, 3.]) / 6``), 20 samples: the datasets each helper draws.
ONE_TWO_THREE = {
    "fused": [2, 1, 0, 2, 1, 2, 2, 1, 0, 2, 1, 2, 2, 1, 0, 2, 1, 2, 2, 1],
    "two roundings": [2, 1, 0, 2, 1, 2, 0, 2, 1, 2, 1, 2, 0, 2, 1, 2, 1, 2, 0, 2],
}


@pytest.fixture(scope="module")
def fused() -> ModuleType:
    return fused_helper()


@pytest.fixture(scope="module")
def unfused() -> ModuleType:
    return two_roundings()


@pytest.fixture(scope="module")
def hybrid() -> ModuleType:
    try:
        return hybrid_helper()
    except NotHybridError as err:
        pytest.skip(str(err))


def test_the_fused_helper_is_fused_and_megatrons_rounds_twice(fused, unfused) -> None:
    """The premise, from the machine code: every error of the built helper is one fused
    multiply-subtract; the installed x86-64 wheel's are a multiply, then a subtract."""
    check_fused(fused.__file__)
    with pytest.raises(FusedHelperError, match=r"0 fused multiply-subtract .* 2 multiplies"):
        check_fused(unfused.__file__)


def test_the_probe_tells_the_three_builds_apart(fused, unfused, hybrid) -> None:
    """x86-64's wheel rounds twice, the fused build once, GCC 12's neither in
    ``build_blending_indices`` (dataset 0 twice, the others once) and once in the exhaustive
    index; the machine code says the same."""
    check_hybrid(hybrid.__file__)
    with pytest.raises(FusedHelperError, match=r"is not GCC 12's hybrid: 0 fused"):
        check_hybrid(unfused.__file__)
    with pytest.raises(FusedHelperError, match=r"is not GCC 12's hybrid: \d+ fused .* 0 mult"):
        check_hybrid(fused.__file__)
    found = {
        name: (
            rounding.probe(module.build_blending_indices),
            rounding.probe(module.build_exhaustive_blending_indices, exhaustive=True),
        )
        for name, module in (("x86-64", unfused), ("fused", fused), ("GCC 12", hybrid))
    }
    assert found == {"x86-64": (False, False), "fused": (True, True), "GCC 12": (None, True)}


def test_weights_1_2_3_draw_another_order_fused(fused, unfused) -> None:
    """At sample 6 (counts 1, 2, 3) all three errors are 0.0 rounded twice, and dataset 0 wins
    the tie; fused, 1/6 and 1/3 rounded below give errors just under 0, and dataset 2 wins."""
    w = np.array([1, 2, 3.0]) / 6
    index = {}
    for name, module in (("fused", fused), ("two roundings", unfused)):
        index[name], sample = build_indices(module, "weights", w, 20)
        assert index[name].tolist() == ONE_TWO_THREE[name]
        counts = np.zeros(3, dtype=np.int64)  # the sample index counts each dataset's draws
        for t, i in enumerate(index[name]):
            assert sample[t] == counts[i]
            counts[i] += 1
    first = int(np.flatnonzero(index["fused"] != index["two roundings"])[0])
    assert first == 6 < 10


@pytest.mark.parametrize("fma", [True, False], ids=["fused", "two-roundings"])
def test_weights_1_2_3_in_repack(fma: bool) -> None:
    w = np.array([1, 2, 3.0]) / 6
    index, _ = build_indices(blending, "weights", w, 20, fma=fma)
    assert index.tolist() == ONE_TWO_THREE["fused" if fma else "two roundings"]
    assert blending.drawn_counts(w, 20, fma=fma).tolist() == np.bincount(index).tolist()


def test_the_compiled_index_is_each_helpers(fused, unfused) -> None:
    """``fma=True`` is the fused helper's bytes and ``fma=False`` the release's own, on every
    case; the cases where the two helpers differ are counted (what ``fma`` is for)."""
    assert blending.COMPILED, "repack.model._blending was not built (a C compiler is at hand here)"
    seen: dict[str, int] = {}
    differ: dict[str, int] = {}
    cases = generated(1140, seed=43, work=2e7, largest=3000, kinds=KINDS, group=GROUP)
    for case, (kind, w, size) in enumerate(cases):
        name = f"case {case}"
        theirs = build_indices(fused, kind, w, size)
        ours = build_indices(blending, kind, w, size, fma=True)
        assert_same(ours, theirs, name, kind, w, "the fused helper's")
        stock = build_indices(unfused, kind, w, size)
        ours = build_indices(blending, kind, w, size, fma=False)
        assert_same(ours, stock, name, kind, w, "Megatron's")
        count(seen, kind, w, size)
        if not np.array_equal(theirs[0], stock[0]):
            differ[kind] = differ.get(kind, 0) + 1
    print("cases:", seen)
    print("the two helpers' orders differ:", differ)
    # the premise: every kind, thousands of datasets, 10**5 samples and more
    assert min(seen[kind] for kind in KINDS) >= 60, seen
    assert seen["datasets>=1000"] >= 20 and seen["samples>=100000"] >= 50, seen
    # and the two helpers apart in many cases, of several kinds (hand-written weights among them)
    assert sum(differ.values()) >= 50 and len(differ) >= 4 and differ.get("two-decimal"), differ


def test_counts_are_each_helpers_index_counted(fused, unfused) -> None:
    rng = np.random.default_rng(43)
    for family in ("dirichlet0.1", "near-equal-1e-12", "two-decimal", "shard-tokens"):
        w = normalized(family_weights(family, 700, rng))
        for fma, module in ((True, fused), (False, unfused)):
            index, _ = build_indices(module, "weights", w, 100_000)
            counts = blending.drawn_counts(w, 100_000, fma=fma)
            assert counts.tolist() == np.bincount(index, minlength=700).tolist(), (family, fma)


@pytest.mark.once
def test_without_the_compiled_index_an_aarch64_node_uses_its_own_helper(
    fused, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where repack's C piece was not built, the fused rounding comes from the installed
    megatron-core's own helper when that rounds once (an aarch64 node), and is refused in one
    line (NotCompiled) when it does not."""
    w = np.array([0.3, 0.3, 0.4, 0.15, 0.35, 0.5])
    w = w / w.sum()
    expected = build_indices(fused, "weights", w, 5000)
    monkeypatch.setattr(blending, "_compiled_blend", None)
    with pytest.raises(NotCompiled, match=r"repack\.model\._blending"):
        blending.drawn_counts(w, 5000, fma=True)  # this node's helper rounds twice
    monkeypatch.setattr(rounding, "installed_helper", lambda: fused)
    monkeypatch.setattr(rounding, "installed_fma", lambda: True)
    found = build_indices(blending, "weights", w, 5000, fma=True)
    assert found[0].tolist() == expected[0].tolist()
    assert found[1].tolist() == expected[1].tolist()
    counts = blending.drawn_counts(w, 5000, fma=True)
    assert counts.tolist() == np.bincount(expected[0], minlength=6).tolist()
