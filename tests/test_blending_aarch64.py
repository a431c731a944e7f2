"""The loader on an aarch64 node, and on a GCC 12 source build: repack's blending index follows
the helper Megatron calls, or leaves the index to it.

An aarch64 build of megatron-core rounds the blending error once (a fused multiply-subtract)
where the x86-64 wheels round it twice, and with hand-written weights the two orders part
early (issue 43). Here a child process does what such a node has: before repack is imported,
``megatron.core.datasets.helpers.build_blending_indices`` (and
``build_exhaustive_blending_indices``) is the release's own ``helpers.cpp`` built here
(``tests/fused_helper.py``): fused throughout, as aarch64 builds, or as GCC 12 builds it from
source, dataset 0's error rounded twice and the others' once (a third order, which repack's
index does not take: the loader leaves the index to that helper). In each, a stock
``GPTDataset`` blend and a ``RepackedGPTDataset`` one over the same sources, weights and seed
give the same samples; and those differ from what the other helpers give, so the tests prove
that the loader followed the helper, not that the blend happens not to tie.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from fused_helper import NotHybridError, hybrid_helper
from megatron_support import (
    GPTDataset,
    build,
    collect,
    digest,
    gpt_config,
    init_process_group,
    write_flat_blend,
    write_sources,
)

from repack.merge import merge
from repack.samples import GPTSamples

pytestmark = pytest.mark.megatron

TESTS = Path(__file__).parent
#: Hand-written weights, as blends have them: two decimals, several equal. The x86-64 helper,
#: the fused one and GCC 12's hybrid draw three orders for them in every split (first apart at
#: samples 34 and 38).
WEIGHTS = [0.3, 0.3, 0.4, 0.15, 0.35, 0.5, 0.25, 0.25, 0.1, 0.2, 0.3, 0.3]
SIZES = [3000, 150, 150]

#: Run with ``{helper}``, a function of tests/fused_helper.py that builds Megatron's helpers.
CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from megatron.core.datasets import helpers
    import fused_helper

    # as the node has it: Megatron's helpers are that build of helpers.cpp
    module = fused_helper.{helper}()
    helpers.build_blending_indices = module.build_blending_indices
    helpers.build_exhaustive_blending_indices = module.build_exhaustive_blending_indices
    from megatron_support import GPTDataset, build, collect, digest, gpt_config, init_process_group
    import repack.megatron
    from repack.megatron import blendhook, dataset_class

    init_process_group({work!r})
    prefixes, weights, sizes = json.loads(sys.argv[1])
    config = lambda cache: gpt_config(prefixes, weights, seed=4, cache=cache)
    stock = collect(build(GPTDataset, config({work!r} + "/stock"), sizes))
    ours = collect(build(dataset_class({out!r}), config({work!r} + "/repack"), sizes))
    tokens = lambda splits: digest([[dict(tokens=s["tokens"]) for s in split] for split in splits])
    print(json.dumps(dict(stock=digest(stock), ours=digest(ours), tokens=tokens(stock),
                          fma=blendhook.helper_fma(),
                          exhaustive_fma=blendhook.helper_fma("build_exhaustive_blending_indices"))))
    """
)


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    init_process_group()
    root = tmp_path_factory.mktemp("aarch64")
    prefixes = write_sources(root, len(WEIGHTS), seed=43)
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes, WEIGHTS), out)
    return prefixes, out


@pytest.fixture(scope="module")
def child(blend, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """``child(helper)``: what a child process with that build of Megatron's helpers installed
    found (``CHILD``), once per module."""
    prefixes, out = blend
    found: dict[str, dict] = {}

    def run(helper: str) -> dict:
        if helper not in found:
            work = tmp_path_factory.mktemp(helper)
            script = CHILD.format(tests=str(TESTS), work=str(work), out=str(out), helper=helper)
            done = subprocess.run(
                [sys.executable, "-c", script, json.dumps([prefixes, WEIGHTS, SIZES])],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                timeout=600,
                check=False,
            )
            assert done.returncode == 0, done.stderr[-3000:]
            found[helper] = json.loads(done.stdout.strip().splitlines()[-1])
        return found[helper]

    return run


@pytest.fixture(scope="module")
def x86(blend, tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list]:
    """The stock blend here, with megatron-core's own helper (x86-64: two roundings): its
    samples' digests and its tokens' (:func:`tokens`)."""
    prefixes, _ = blend
    cache = tmp_path_factory.mktemp("x86")
    samples = collect(build(GPTDataset, gpt_config(prefixes, WEIGHTS, seed=4, cache=cache), SIZES))
    return digest(samples), tokens(samples)


@pytest.fixture(scope="module")
def hybrid() -> ModuleType:
    """GCC 12's build (built here first: the child finds it in the cache)."""
    try:
        return hybrid_helper()
    except NotHybridError as err:
        pytest.skip(str(err))


def test_the_loader_follows_an_aarch64_helper(blend, child, x86) -> None:
    _, out = blend
    found = child("fused_helper")
    assert found["fma"] is True  # the probe saw one rounding
    x86, x86_tokens = x86
    assert found["stock"][0] != x86[0], "the blend does not tell the roundings apart"
    assert found["ours"] == found["stock"]
    # GPTSamples answers for that node with fma=True, and for this one by default
    for fma, expected in ((True, found["tokens"]), (None, x86_tokens)):
        splits = []
        for which in ("train", "valid", "test"):
            samples = GPTSamples(
                out,
                sizes=SIZES,
                which=which,
                random_seed=4,
                sequence_length=64,
                eod=0,
                split="90,5,5",
                fma=fma,
            )
            splits.append([samples[i] for i in range(len(samples))])
        assert tokens(splits) == expected, fma


def test_the_loader_leaves_the_index_to_a_gcc12_helper(child, x86, hybrid) -> None:
    """A source build with GCC 12 rounds dataset 0's error twice and the others' once: the
    probe tells neither rounding, and the repacked blend gets that helper's own index (its
    exhaustive twin is fused throughout, and the probe says so)."""
    found = child("hybrid_helper")
    assert found["fma"] is None  # neither order: repack's index does not take it
    assert found["exhaustive_fma"] is True
    fused = child("fused_helper")
    x86, _ = x86
    for split, (mine, twice, once) in enumerate(zip(found["stock"], x86, fused["stock"])):
        assert mine != twice, f"split {split}: the hybrid draws the x86-64 helper's samples"
        assert mine != once, f"split {split}: the hybrid draws the fused helper's samples"
    assert found["ours"] == found["stock"]


def tokens(splits: list) -> list:
    """A digest of every split's tokens, sample by sample (``tokens``: the order of draws)."""
    return digest([[{"tokens": sample["tokens"]} for sample in split] for split in splits])
