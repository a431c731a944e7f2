"""repack's blending index is megatron-core's, byte for byte, and the loader uses it.

``repack.model.blending`` (compiled, ``repack/model/_blending.c``, and its numpy path) against the
compiled helper of the megatron-core release installed (``helpers_cpp``, loaded as itself: not
the dispatcher ``repack.megatron`` puts in ``helpers``), on generated weights of every kind the
tie rule and the rounding can trip on: random, Dirichlet-skewed down to 1e-9, all equal (ties
everywhere), equal in groups, a few ulps apart (products that round to the same double), over
six orders of magnitude; 1 to 3,000 datasets, 0 to 10**6 samples; and the exhaustive index of
blends with no size. Then the loader: a repack's ``BlendedDataset`` is built with repack's
index, a stock one with Megatron's unless ``fast_blending()`` is on, and their cached ``.npy``
files hold the same bytes.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from blending_support import KINDS, build_indices, generated
from blending_support import compare as compare_builds
from megatron_support import (
    GPTDataset,
    assert_same_samples,
    build,
    collect,
    gpt_config,
    init_process_group,
    weights_for,
    write_flat_blend,
    write_sources,
)

from repack.megatron import dataset_class, fast_blending
from repack.merge import merge
from repack.model import blending

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers_cpp

pytestmark = pytest.mark.megatron


def compare(cases: Iterator[tuple]) -> dict[str, int]:
    """repack's index (as ``blending`` is at each call: compiled, or its numpy path) against
    megatron-core's helper, byte for byte."""
    return compare_builds(
        cases,
        lambda *case: build_indices(blending, *case),
        lambda *case: build_indices(helpers_cpp, *case),
    )


def test_the_compiled_index_is_megatrons() -> None:
    assert blending.COMPILED, "repack.model._blending was not built (a C compiler is at hand here)"
    seen = compare(generated(1050, seed=34, work=2e7, largest=3000))
    print(seen)
    # the premise: every kind, thousands of datasets, 10**5 samples and more
    assert min(seen[kind] for kind in KINDS) >= 140, seen
    assert seen["datasets>=1000"] >= 20 and seen["samples>=100000"] >= 50, seen


@pytest.mark.once
def test_the_python_index_is_megatrons(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path for an install without a C compiler: the same bytes."""
    monkeypatch.setattr(blending, "_compiled_blend", None)
    seen = compare(generated(300, seed=35, work=3e6, largest=2000))
    assert min(seen[kind] for kind in KINDS) >= 40, seen


def test_counts_are_the_index_counted() -> None:
    w = np.random.default_rng(3).dirichlet(np.full(700, 0.3))
    w /= w.sum()
    index, _ = build_indices(helpers_cpp, "weights", w, 300_000)
    assert blending.drawn_counts(w, 300_000).tolist() == np.bincount(index, minlength=700).tolist()


def test_what_megatrons_helper_cannot_take_is_refused() -> None:
    w = np.array([0.5, 0.5])
    index, sample = np.zeros(10, np.int16), np.zeros(10, np.int64)
    with pytest.raises(ValueError, match="dataset_index: int32"):
        blending.build_blending_indices(index.astype(np.int32), sample, w, 2, 10, False)
    with pytest.raises(ValueError, match="dataset_index: 10 entries for 11 samples"):
        blending.build_blending_indices(index, sample, w, 2, 11, False)
    with pytest.raises(ValueError, match="weights: 2 of them for 3 datasets"):
        blending.build_blending_indices(index, sample, w, 3, 10, False)
    with pytest.raises(ValueError, match=r"dataset 1 has size 0; .* never finishes"):
        blending.build_exhaustive_blending_indices(index, sample, np.array([4, 0]), 2)


# --- the loader ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[float], Path]:
    init_process_group()
    root = tmp_path_factory.mktemp("blending")
    prefixes = write_sources(root, 40, seed=8)
    weights = weights_for(prefixes, seed=8)
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes, weights), out)
    return prefixes, weights, out


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The calls that reach repack's index (the dispatcher looks it up at each call)."""
    seen: list[str] = []
    for name in ("build_blending_indices", "build_exhaustive_blending_indices"):
        real = getattr(blending, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(blending, name, counted)
    return seen


@pytest.mark.parametrize("weighted", [True, False], ids=["weights", "exhaustive"])
def test_a_repacks_blend_gets_repacks_index_and_caches_stocks_bytes(
    blend, tmp_path: Path, calls: list[str], weighted: bool
) -> None:
    prefixes, weights, out = blend
    kwargs = dict(prefixes=prefixes, weights=weights if weighted else None, seed=4)
    sizes = [3000, 150, 150] if weighted else [None, None, None]
    if not weighted:
        kwargs["split"] = "80,10,10"
    stock = build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "stock"), sizes)
    assert calls == []  # stock's blend: Megatron's own helper
    ours = build(dataset_class(out), gpt_config(**kwargs, cache=tmp_path / "repack"), sizes)
    name = "build_blending_indices" if weighted else "build_exhaustive_blending_indices"
    assert calls == [name] * 3
    assert_same_samples(collect(stock), collect(ours))
    files = sorted(p.name for p in (tmp_path / "stock").glob("*-BlendedDataset-*.npy"))
    assert len(files) == 6
    for file in files:
        assert (tmp_path / "stock" / file).read_bytes() == (tmp_path / "repack" / file).read_bytes()


def test_fast_blending_turns_it_on_for_stock_blends(
    blend, tmp_path: Path, calls: list[str]
) -> None:
    prefixes, weights, _ = blend
    config = gpt_config(prefixes, weights, seed=5)
    reference = collect(build(GPTDataset, config, [2000, 100, 100]))
    assert calls == []
    with fast_blending():
        with fast_blending(False):  # nested: restored on the way out
            build(GPTDataset, config, [2000, 100, 100])
            assert calls == []
        fast = collect(build(GPTDataset, config, [2000, 100, 100]))
    assert calls == ["build_blending_indices"] * 3
    assert_same_samples(reference, fast)
    build(GPTDataset, config, [2000, 100, 100])
    assert len(calls) == 3  # off again after the block


def test_products_past_2_53_keep_megatrons_order() -> None:
    """Unnormalized weights whose products pass 2**53: fl(p - c) can tie where p - c does not,
    and the tree took a loser of the winner's weight for one that never overtakes (issue 43:
    at sample 11 Megatron drew dataset 29 and the compiled index 115)."""
    rng = np.random.default_rng(0)
    n = int(rng.integers(161, 260))
    w = 1e15 * rng.choice([1, 1 + 2**-52, 1 + 2**-51], n)
    assert len(w) > 160  # the tree, not the loop kept for a few datasets
    ours = build_indices(blending, "weights", w, 40)
    stock = build_indices(helpers_cpp, "weights", w, 40)
    assert stock[0][11] == 29
    assert ours[0].tolist() == stock[0].tolist() and ours[1].tolist() == stock[1].tolist()


@pytest.mark.parametrize("size", [5, 0, -3])
def test_verbose_and_a_negative_size_as_megatrons_helper(
    capfd: pytest.CaptureFixture[str], size: int
) -> None:
    """What Megatron's helper prints, and what it does with a size below 1: nothing drawn."""
    w = np.array([1 / 3, 2 / 3])
    printed = []
    for module in (helpers_cpp, blending):
        index, sample = np.full(8, -7, np.int16), np.full(8, -7, np.int64)
        module.build_blending_indices(index, sample, w, 2, size, True)
        printed.append((capfd.readouterr().out, index.tolist(), sample.tolist()))
    assert printed[1] == printed[0]
    assert "achieved" in printed[0][0]


@pytest.mark.once
def test_the_python_index_takes_any_weights_at_numpy_speed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NaN, infinite and negative weights: Megatron's bytes from the numpy path, which ran them
    in pure Python at about 1.4 ms a sample (issue 43): here 3,000 samples of 2,000 datasets
    each, 30 cases; Megatron's strict ``>`` from dataset 0 decides what NaN and infinities do."""
    monkeypatch.setattr(blending, "_compiled_blend", None)
    rng = np.random.default_rng(43)
    for case in range(30):
        n = 2000 if case % 3 == 0 else int(rng.integers(1, 300))
        w = rng.random(n) - rng.choice([0.0, 0.1, 0.5, 1.0])
        kind = case % 6
        if kind == 1:
            w[rng.integers(0, n)] = np.nan
        elif kind == 2:
            w[0] = np.nan
        elif kind == 3:
            w[rng.integers(0, n)] = np.inf
        elif kind == 4:
            w[rng.integers(0, n, 3)] = -np.inf
        elif kind == 5:
            w[:] = -np.inf
            w[rng.integers(0, n)] = np.nan
        ours = build_indices(blending, "weights", w, 3000)
        stock = build_indices(helpers_cpp, "weights", w, 3000)
        assert ours[0].tolist() == stock[0].tolist(), (case, kind)
        assert ours[1].tolist() == stock[1].tolist(), (case, kind)


def test_repack_megatron_build_follows_the_installed_helper() -> None:
    """``repack.megatron.build_blending_indices`` (and the exhaustive one) with ``fma=None``:
    the installed helper's rounding, the same bytes as that helper."""
    import repack.megatron

    w = np.array([0.3, 0.3, 0.4, 0.15, 0.35, 0.5])
    w = w / w.sum()
    ours = build_indices(repack.megatron, "weights", w, 3000)
    stock = build_indices(helpers_cpp, "weights", w, 3000)
    assert ours[0].tolist() == stock[0].tolist() and ours[1].tolist() == stock[1].tolist()
    sizes = np.array([300, 300, 400, 150, 350, 500], dtype=np.int64)
    ours = build_indices(repack.megatron, "exhaustive", sizes, int(sizes.sum()))
    stock = build_indices(helpers_cpp, "exhaustive", sizes, int(sizes.sum()))
    assert ours[0].tolist() == stock[0].tolist() and ours[1].tolist() == stock[1].tolist()
    # and the other rounding when asked: these weights part the two
    fused = build_indices(repack.megatron, "weights", w, 3000, fma=True)
    assert fused[0].tolist() != stock[0].tolist()
