"""``repack doctor`` predicts what ``BlendedDataset`` draws, as real megatron-core draws it.

The drawn counts are compared with megatron-core's C++ function; then
hundreds of generated blends (random weights over four orders of magnitude, tiny and large
sources, flat with a split string and per split, weighted and unweighted, splits asked no
sample, a prefix named twice with two weights, several surpluses) are built with
``BlendedMegatronDatasetBuilder`` and stock ``GPTDataset``: every source's drawn count (the
``np.bincount`` of the built ``BlendedDataset``'s dataset index) is the doctor's, and where the
doctor predicts an over-draw, stock stops with the ``IndexError`` the doctor quotes. Then the
cases of the report: Megatron's own over-draw, a split asked 0 samples, a prefix twice.

On every megatron-core of the parity matrix (marker ``megatron``), each with its own behaviour:
0.12 has no ``mid_level_dataset_surplus`` (its builder builds 0.5 % more, always) and words
the over-draw otherwise. The tests of repack's own counting run once (marker ``once``).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from megatron_support import (
    GPTDataset,
    GPTDatasetConfig,
    build,
    gpt_config,
    init_process_group,
    write_sources,
)

from repack.cli import main
from repack.doctor import Limits, Settings, doctor
from repack.model import blend_draws as blending
from repack.model.splits import SPLIT_NAMES
from repack.synth import write_prefix

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers_cpp as helpers  # Megatron's own, not repack's

pytestmark = pytest.mark.megatron

NO_LIMITS = Limits(None, None, None)
#: Whether the release's config has mid_level_dataset_surplus (0.13 and later); 0.12 builds
#: 0.005 more, always (blended_megatron_dataset_builder.py: margin=0.5)
SURPLUS = "mid_level_dataset_surplus" in GPTDatasetConfig.__dataclass_fields__


def megatron_draws(weights: list[float], size: int) -> np.ndarray:
    """megatron-core's own ``build_blending_indices``, counted per dataset."""
    index = np.zeros(size, dtype=np.int16)
    sample = np.zeros(size, dtype=np.int64)
    helpers.build_blending_indices(
        index, sample, np.array(weights, dtype=np.float64), len(weights), size, False
    )
    return np.bincount(index, minlength=len(weights))


def test_the_drawn_counts_are_build_blending_indices() -> None:
    rng = np.random.default_rng(17)
    for trial in range(400):
        n = int(rng.integers(1, 40))
        raw = (10 ** rng.uniform(-4, 0, n)).tolist()
        if trial % 5 == 0:  # equal weights: ties, where the first dataset must win
            raw = [1.0] * n
        weights = blending.blend_weights(raw, [])
        size = int(rng.integers(0, 4000))
        drawn = blending.drawn_counts(weights, size)
        assert drawn.tolist() == megatron_draws(weights, size).tolist(), (trial, n, size)


@pytest.mark.once
def test_a_large_blend_is_exact_without_megatron() -> None:
    """3,000 sources and 10**6 samples (3 * 10**9 steps of Megatron's loop): the counts are
    Megatron's to the sample, computed in a process that imports neither torch nor Megatron
    (the doctor's, without megatron-core installed)."""
    weights = blending.blend_weights(10 ** np.random.default_rng(3).uniform(-3, 0, 3000), [])
    child = subprocess.run(
        [sys.executable, "-c", "import json, sys\n"
         "sys.modules['torch'] = sys.modules['megatron'] = None  # importing either fails\n"
         "from repack.model import blend_draws as blending\n"
         "weights = json.loads(sys.stdin.read())\n"
         "print(json.dumps(blending.drawn_counts(weights, 1_000_000).tolist()))\n"
         "assert not [m for m, v in sys.modules.items() if v and m.startswith(('torch', 'meg'))]"],
        input=json.dumps(weights), capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(child.stdout) == megatron_draws(weights, 1_000_000).tolist()


# --- generated blends, built by megatron-core ----------------------------------------------------


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Sources of 2 to 6 sequences (tiny), 40 to 80, and 600 to 1,200 (large)."""
    init_process_group()
    root = tmp_path_factory.mktemp("blending-pool")
    return (
        write_sources(root, 4, seed=1, sequences=(2, 6), tokens=(3, 40), folder="tiny")
        + write_sources(root, 8, seed=2, folder="medium")
        + write_sources(root, 3, seed=3, sequences=(600, 1200), tokens=(5, 60), folder="large")
    )


def _generate(rng: np.random.Generator, pool: list[str]) -> dict:
    """One random blend and its training settings."""
    n = int(rng.integers(1, 11))
    chosen = [pool[i] for i in rng.choice(len(pool), n, replace=False)]
    weighted = rng.random() < 0.8
    weights = [float(f"{w:.4g}") for w in 10 ** rng.uniform(-3, 1, n)] if weighted else None
    if weighted and n > 1 and rng.random() < 0.1:  # a prefix twice, with another weight
        chosen.append(chosen[0])
        weights.append(float(f"{weights[0] * rng.uniform(0.2, 5):.4g}"))
    sizes = [int(rng.integers(1, 4000)), int(rng.integers(0, 400)), int(rng.integers(0, 80))]
    for i in range(1, 3):
        if rng.random() < 0.25:
            sizes[i] = 0
    per_split = rng.random() < 0.3
    case = {
        "sequence_length": int(rng.choice([8, 16, 32, 64])),
        "sizes": sizes,
        "surplus": float(rng.choice([0.005, 0.005, 0.0, 0.02])),
        "seed": int(rng.integers(1, 10_000)),
    }
    if not SURPLUS:  # drawn all the same: the same blends on every release
        case["surplus"] = 0.005
    if per_split:
        splits = []
        for i in range(3):
            if i and rng.random() < 0.2:
                splits.append(None)
                continue
            k = int(rng.integers(1, len(chosen) + 1))
            picked = sorted(rng.choice(len(chosen), k, replace=False).tolist())
            splits.append(
                [
                    [chosen[j] for j in picked],
                    None if weights is None else [weights[j] for j in picked],
                ]
            )
        case["blend_per_split"] = splits
    else:
        case["prefixes"], case["weights"] = chosen, weights
        case["split"] = str(rng.choice(["98,2,0", "969,30,1", "90,5,5", "80,20,0", "100,0,0"]))
    return case


def _blend_file(case: dict, path: Path) -> Path:
    if "blend_per_split" in case:
        path.write_text(json.dumps({"blend_per_split": case["blend_per_split"]}))
    elif case["weights"] is None:
        path.write_text(json.dumps(case["prefixes"]))
    else:
        items: list = []
        for weight, prefix in zip(case["weights"], case["prefixes"]):
            items += [weight, prefix]
        path.write_text(json.dumps(items))
    return path


def _config(case: dict):
    if "blend_per_split" in case:
        config = gpt_config(blend_per_split=case["blend_per_split"], seed=case["seed"])
    else:
        config = gpt_config(
            case["prefixes"], case["weights"], seed=case["seed"], split=case["split"]
        )
    config.sequence_length = case["sequence_length"]
    if SURPLUS:
        config.mid_level_dataset_surplus = case["surplus"]
    return config


def _check(case: dict, tmp_path: Path) -> str:
    """Build ``case`` with the doctor and with megatron-core; assert they agree. Returns what
    happened: ``built``, ``over-draw``, ``assert`` (an unweighted blend with a dataset of
    length 0) or ``hang`` (not built: stock would never return)."""
    settings = Settings(
        sequence_length=case["sequence_length"],
        sizes=tuple(case["sizes"]),
        split=case.get("split"),
        surplus=case["surplus"],
    )
    report = doctor(_blend_file(case, tmp_path / "blend.json"), settings, limits=NO_LIMITS)
    errors = [p for p in report.problems if p.level == "error"]
    assert {p.code for p in errors} <= {"empty-split", "over-draw"}, errors
    if any(p.code == "empty-split" and "hangs forever" in p.message for p in errors):
        return "hang"
    overs = [p for p in errors if p.code == "over-draw"]
    if any(p.code == "empty-split" for p in errors):  # unweighted: weights are the lengths
        first_split = min(SPLIT_NAMES.index(p.split) for p in errors)
        if not overs or SPLIT_NAMES.index(overs[0].split) > first_split:
            with pytest.raises(AssertionError):
                build(GPTDataset, _config(case), case["sizes"])
            return "assert"
    if overs:
        with pytest.raises(IndexError) as caught:
            build(GPTDataset, _config(case), case["sizes"])
        quoted = re.search(r"IndexError in [\w.]+: '([^']+)'", overs[0].message)
        assert quoted is not None and quoted[1] in str(caught.value)
        return "over-draw"
    assert report.ok, errors
    built = build(GPTDataset, _config(case), case["sizes"])
    plans = {plan.name: plan for plan in report.plans}
    for i, name in enumerate(SPLIT_NAMES):
        split = built[i]
        assert (split is not None) == (name in plans), name
        if split is None:
            continue
        plan = plans[name]
        assert plan.blended == hasattr(split, "datasets"), name
        if not plan.blended:
            assert len(split) == plan.datasets[0].built and plan.datasets[0].drawn is None
            continue
        assert split.size == plan.size and len(split) == plan.size, name
        drawn = np.bincount(split.dataset_index, minlength=len(plan.datasets))
        assert drawn.tolist() == [d.drawn for d in plan.datasets], name
        assert [len(g) for g in split.datasets] == [d.built for d in plan.datasets], name
        assert [g.num_samples for g in split.datasets] == [d.num_samples for d in plan.datasets]
    return "built"


def test_generated_blends_draw_what_megatron_draws(pool: list[str], tmp_path: Path) -> None:
    seen: dict[str, int] = {}
    compared = 0
    for seed in range(1000):
        case = _generate(np.random.default_rng(seed), pool)
        try:
            outcome = _check(case, tmp_path)
        except AssertionError as error:
            raise AssertionError(f"blend of seed {seed}: {json.dumps(case)}") from error
        seen[outcome] = seen.get(outcome, 0) + 1
        if outcome != "hang":
            compared += 1
            for kind, present in _kinds(case).items():
                seen[kind] = seen.get(kind, 0) + present
        if compared >= 300:
            break
    print(f"generated blends: {seen}")
    assert compared >= 300, seen
    # the premise: every kind of blend and outcome occurred, most blends built and compared
    assert seen["built"] >= 200 and seen["over-draw"] >= 5 and seen["assert"] >= 5, seen
    assert min(seen[kind] for kind in _kinds(case)) >= 10, seen


def _kinds(case: dict) -> dict[str, bool]:
    blends = case.get("blend_per_split") or [[case["prefixes"], case["weights"]]]
    blends = [b for b in blends if b is not None]
    return {
        "per-split": "blend_per_split" in case,
        "unweighted": all(b[1] is None for b in blends),
        "twice": any(len(set(b[0])) < len(b[0]) for b in blends),
        "split-asked-0": 0 in case["sizes"],
        **({"surplus-0": case["surplus"] == 0} if SURPLUS else {}),
    }


# --- the cases of the report ---------------------------------------------------------------------

DOCTOR_ARGS = [
    "--split", "98,2,0", "--seq-length", "1024", "--train-iters", "200",
    "--global-batch-size", "64", "--eval-iters", "5", "--eval-interval", "50",
]  # fmt: skip


def test_megatrons_own_over_draw_is_an_error(tmp_path: Path) -> None:
    """50 sources, one at weight 0.9 and 49 at 0.00204: the valid blend's 1,600 samples round
    up to 1,637 (every small source's 3.26 becomes 4), of which the big source, built for
    ceil(1,441 x 1.005) = 1,449, is drawn 1,473 times. Stock stops with IndexError."""
    init_process_group()
    rng = np.random.default_rng(0)
    # 2,500 sequences of 1,024 tokens: the 2 % valid slice is 50 of them, repeated 29 times
    # for the 1,449 samples asked of it: exactly 1,449 samples
    write_prefix(tmp_path / "big", [rng.integers(1, 60000, 1024) for _ in range(2500)])
    prefixes, weights = [str(tmp_path / "big")], [0.9]
    for i in range(49):
        prefixes.append(str(tmp_path / f"small-{i:02d}"))
        write_prefix(prefixes[-1], [rng.integers(1, 60000, 300) for _ in range(200)])
        weights.append(0.00204)
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps([x for pair in zip(weights, prefixes) for x in pair]))
    result = CliRunner().invoke(main, ["doctor", "-q", str(blend), *DOCTOR_ARGS])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and errors[0].startswith(f"ERROR [over-draw] {prefixes[0]}: the valid")
    assert "draws 1,473 samples from it, but its GPTDataset holds 1,449" in errors[0]
    if SURPLUS:
        assert "--mid-level-dataset-surplus to 0.022" in errors[0]
        said = "requests 1473 samples from GPTDataset number 0 in excess of its size 1449"
    else:  # 0.12: no surplus to raise, and its builder's own words
        assert "megatron-core 0.13 or later with --mid-level-dataset-surplus 0.022" in errors[0]
        said = "requests 1473 samples from GPTDataset 0 with size 1449"
    config = gpt_config(prefixes, weights, split="98,2,0", sequence_length=1024)
    with pytest.raises(IndexError) as caught:
        build(GPTDataset, config, [12800, 1600, 320])
    assert said in str(caught.value) and said in errors[0]
    fixed = ["--mid-level-dataset-surplus", "0.022"]
    result = CliRunner().invoke(main, ["doctor", "-q", str(blend), *DOCTOR_ARGS, *fixed])
    if not SURPLUS:  # a setting the release does not have
        assert result.exit_code == 3, result.output
        assert "has no such setting (--mid-level-dataset-surplus came in 0.13)" in result.output
        return
    # the fix the doctor gives works, in the doctor and in Megatron
    assert result.exit_code == 0, result.output
    config.mid_level_dataset_surplus = 0.022
    valid = build(GPTDataset, config, [12800, 1600, 320])[1]
    assert np.bincount(valid.dataset_index)[0] == 1473


@pytest.mark.parametrize("sizes", ["2000,500,0", "2000,0,0"])
def test_a_split_asked_no_sample_is_fine(pool: list[str], tmp_path: Path, sizes: str) -> None:
    """--split 969,30,1 --samples 2000,500,0 on a healthy blend: the test slices (0.1 % of
    600 to 1,200 sequences: one or two) hold tokens but no whole sample, and none is drawn;
    stock builds. (Where a test slice holds no sequence at all, stock hangs even for 0 samples:
    ``_get_num_epochs`` wants one token, the extra one.)"""
    prefixes = pool[12:15]
    weights = [round(0.2 + i / 5, 2) for i in range(len(prefixes))]
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps([x for pair in zip(weights, prefixes) for x in pair]))
    args = ["doctor", "-q", str(blend), "--seq-length", "64", "--split", "969,30,1"]
    result = CliRunner().invoke(main, [*args, "--samples", sizes, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and not [p for p in report["problems"] if p["level"] == "error"]
    asked = [int(x) for x in sizes.split(",")]
    built = build(GPTDataset, gpt_config(prefixes, weights, split="969,30,1"), asked)
    test = built[2]
    assert len(test) == 0 and any(len(g) == 0 for g in test.datasets)  # premise
    assert _check(
        {"prefixes": prefixes, "weights": weights, "split": "969,30,1", "sizes": asked,
         "sequence_length": 64, "surplus": 0.005, "seed": 1234},
        tmp_path,
    ) == "built"  # fmt: skip


def test_a_prefix_twice_with_two_weights_is_built_twice(pool: list[str], tmp_path: Path) -> None:
    """Stock builds a prefix named twice with two weights as two datasets; the doctor accepts
    the blend, warns, and gives each its own numbers."""
    prefixes = [*pool[4:8], pool[4]]
    weights = [1.0, 0.5, 0.8, 1.2, 0.3]
    case = {"prefixes": prefixes, "weights": weights, "split": "90,5,5", "sizes": [900, 90, 30],
            "sequence_length": 32, "surplus": 0.005, "seed": 7}  # fmt: skip
    assert _check(case, tmp_path) == "built"
    result = CliRunner().invoke(
        main,
        ["doctor", "-q", str(tmp_path / "blend.json"), "--seq-length", "32", "--split", "90,5,5",
         "--samples", "900,90,30", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    duplicate = [p for p in report["problems"] if p["code"] == "duplicate"]
    assert len(duplicate) == 1 and duplicate[0]["level"] == "warning"
    assert "once per weight (1 and 0.3" in duplicate[0]["message"]
    row = next(r for r in report["sources"] if r["path"] == pool[4])
    assert row["splits"]["train"]["datasets"] == 2
    assert math.isclose(row["splits"]["train"]["share"], 1.3 / 3.8)


@pytest.mark.once
def test_a_huge_blend_is_exact_at_once() -> None:
    """5 million samples from 10,000 sources: 5 * 10**10 steps of Megatron's loop (a minute in
    C++), counted exactly in seconds; the counts are Megatron's greedy's: within a sample or
    two of every source's share."""
    weights = blending.blend_weights((10 ** np.random.default_rng(3).uniform(-3, 0, 10_000)), [])
    drawn = blending.drawn_counts(weights, 5_120_000)
    assert drawn.sum() == 5_120_000
    assert np.abs(drawn - np.array(weights) * 5_120_000).max() < 2


# --- the order on aarch64 nodes: Megatron's helper rounding once ---------------------------


@pytest.fixture(scope="module")
def fused():
    """Megatron's ``helpers.cpp`` of this release built with fused multiply-subtract, as its
    aarch64 wheels compute it (tests/fused_helper.py)."""
    from fused_helper import fused_helper

    return fused_helper()


def _built_orders(case: dict, fused, monkeypatch) -> dict[bool, list]:
    """``case`` built by megatron-core twice: with its own (x86-64) helper, and with the fused
    one in its place, as on an aarch64 node. Each split's dataset index, or None."""
    from megatron.core.datasets import helpers as megatron_helpers

    found = {}
    for fma in (False, True):
        with monkeypatch.context() as patch:
            if fma:
                patch.setattr(
                    megatron_helpers, "build_blending_indices", fused.build_blending_indices
                )
            built = build(GPTDataset, _config(case), case["sizes"])
        found[fma] = [
            None if split is None or not hasattr(split, "dataset_index")
            else np.asarray(split.dataset_index).copy()
            for split in built
        ]  # fmt: skip
    return found


#: Weights as blends are written by hand: a few round values, often repeated.
HAND_WRITTEN = [0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.75, 1.0, 1.5, 2.0]


def test_the_doctor_answers_for_aarch64_nodes(pool, fused, tmp_path: Path, monkeypatch) -> None:
    """Generated blends of hand-written weights, each built by megatron-core with its own
    helper and with the fused one: the doctor's draws with ``--fma`` are the fused build's,
    without it the x86-64 wheel's, and its ``arch-dependent-order`` names the first sample
    where the two builds part, and how many samples differ (none where it is silent)."""
    rng = np.random.default_rng(43)
    warned = parted = silent = 0
    for _ in range(40):
        n = int(rng.integers(3, 12))
        case = {
            "prefixes": [pool[4 + i] for i in rng.choice(11, n, replace=False)],
            "weights": [float(w) for w in rng.choice(HAND_WRITTEN, n)],
            "split": str(rng.choice(["100,0,0", "90,5,5", "98,2,0"])),
            "sizes": [int(rng.integers(500, 6000)), int(rng.integers(0, 400)), 0],
            "sequence_length": int(rng.choice([8, 16])),
            "surplus": 0.005,
            "seed": int(rng.integers(1, 10_000)),
        }
        blend = _blend_file(case, tmp_path / "blend.json")
        reports = {}
        for fma in (False, True):
            settings = Settings(
                sequence_length=case["sequence_length"],
                sizes=tuple(case["sizes"]),
                split=case["split"],
                surplus=case["surplus"],
                fma=fma,
            )
            reports[fma] = doctor(blend, settings, limits=NO_LIMITS)
        if not reports[False].ok or not reports[True].ok:
            continue  # an over-draw or a hang: compared in the tests above
        orders = _built_orders(case, fused, monkeypatch)
        problems = {
            p.split: p.message for p in reports[False].problems if p.code == "arch-dependent-order"
        }
        assert problems == {
            p.split: p.message for p in reports[True].problems if p.code == "arch-dependent-order"
        }  # the same warning, whichever rounding the draws follow
        for i, name in enumerate(SPLIT_NAMES):
            plans = {fma: {p.name: p for p in reports[fma].plans}.get(name) for fma in orders}
            if orders[False][i] is None:
                assert plans[False] is None or not plans[False].blended
                continue
            for fma in (False, True):
                drawn = np.bincount(orders[fma][i], minlength=len(plans[fma].datasets))
                assert drawn.tolist() == [d.drawn for d in plans[fma].datasets], (name, fma)
            differ = np.flatnonzero(orders[False][i] != orders[True][i])
            if not len(differ):
                assert name not in problems
                silent += 1
                continue
            parted += 1
            message = problems[name]
            assert f"from sample {differ[0]:,} on: {len(differ):,} of its " in message
            warned += 1
    assert warned >= 10 and silent >= 1 and parted == warned, (warned, silent)


def test_the_doctor_is_silent_on_exact_binary_fractions(pool, fused, tmp_path, monkeypatch):
    """Weights that are multiples of 1/1024 summing to 1: both of megatron-core's builds draw
    one order, and the doctor says nothing; 1 2 3, the orders part at sample 6."""
    for weights, first in (
        ([0.125, 0.25, 0.0625, 0.3125, 0.1875, 0.0625], None),
        ([1.0, 2.0, 3.0], 6),
    ):
        prefixes = pool[4 : 4 + len(weights)]
        case = {"prefixes": prefixes, "weights": weights, "split": "100,0,0", "seed": 3,
                "sizes": [3000, 0, 0], "sequence_length": 16, "surplus": 0.005}  # fmt: skip
        orders = _built_orders(case, fused, monkeypatch)
        differ = np.flatnonzero(orders[False][0] != orders[True][0])
        report = doctor(
            _blend_file(case, tmp_path / "blend.json"),
            Settings(16, (3000, 0, 0), "100,0,0"),
            limits=NO_LIMITS,
        )
        found = [p for p in report.problems if p.code == "arch-dependent-order"]
        if first is None:
            assert not len(differ) and not found
        else:
            assert differ[0] == first and len(found) == 1
            assert f"from sample {first} on: {len(differ):,} of its 3,0" in found[0].message
