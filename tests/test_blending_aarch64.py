"""The loader on an aarch64 node: repack's blending index follows the helper Megatron calls.

An aarch64 build of megatron-core rounds the blending error once (a fused multiply-subtract)
where the x86-64 wheels round it twice, and with hand-written weights the two orders part
early (issue 43). Here a child process does what an aarch64 node has: before repack is
imported, ``megatron.core.datasets.helpers.build_blending_indices`` is the release's own
``helpers.cpp`` built with fused multiply-subtract (``tests/fused_helper.py``). In it, a stock
``GPTDataset`` blend and a ``RepackedGPTDataset`` one over the same sources, weights and seed
give the same samples; and those differ from what the x86-64 helper gives here, so the test
proves that the loader followed the helper, not that the blend happens not to tie.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
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
#: Hand-written weights, as blends have them: two decimals, several equal.
WEIGHTS = [0.3, 0.3, 0.4, 0.15, 0.35, 0.5, 0.25, 0.25, 0.1, 0.2, 0.3, 0.3]
SIZES = [3000, 150, 150]

CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from megatron.core.datasets import helpers
    from fused_helper import fused_helper

    # as an aarch64 node has it: Megatron's helper rounds the error once
    helpers.build_blending_indices = fused_helper().build_blending_indices
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
                          fma=blendhook.helper_fma())))
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


def test_the_loader_follows_an_aarch64_helper(blend, tmp_path: Path) -> None:
    prefixes, out = blend
    work = tmp_path / "child"
    work.mkdir()
    script = CHILD.format(tests=str(TESTS), work=str(work), out=str(out))
    child = subprocess.run(
        [sys.executable, "-c", script, json.dumps([prefixes, WEIGHTS, SIZES])],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=600,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    found = json.loads(child.stdout.strip().splitlines()[-1])
    assert found["fma"] is True  # the probe saw one rounding
    x86 = digest(
        collect(
            build(GPTDataset, gpt_config(prefixes, WEIGHTS, seed=4, cache=tmp_path / "x86"), SIZES)
        )
    )
    assert found["stock"][0] != x86[0], "the blend does not tell the roundings apart"
    assert found["ours"] == found["stock"]
    # GPTSamples answers for that node with fma=True, and for this one by default
    x86_tokens = tokens(
        collect(
            build(GPTDataset, gpt_config(prefixes, WEIGHTS, seed=4, cache=tmp_path / "x86"), SIZES)
        )
    )
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


def tokens(splits: list) -> list:
    """A digest of every split's tokens, sample by sample (``tokens``: the order of draws)."""
    return digest([[{"tokens": sample["tokens"]} for sample in split] for split in splits])
