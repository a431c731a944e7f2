"""A repacked blend holds a constant number of mmaps and file descriptors, whatever its size.

Each measurement is a fresh process (``loader_child.py``) that builds the train, valid and test
splits of a 100-source or a 2000-source blend, reads every sample of every split (so that every
dataset's indices are attached), then counts the lines of ``/proc/self/maps`` and the entries
of ``/proc/self/fd`` that point into the data, repack and cache folders. A second run over the
same cache (a cache hit) is measured too. Stock Megatron over the 100 sources is the contrast:
it holds files per source.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from megatron_support import Child, run_children, weights_for, write_flat_blend, write_sources

from repack.format.manifest import load_manifest
from repack.merge import merge

pytestmark = pytest.mark.slow

SPLITS = 3
#: Megatron's BlendedDataset maps its two cached index arrays per split when it hits the cache
BLENDED_MAPS = 2 * SPLITS


@dataclass(frozen=True)
class Blend:
    root: Path
    prefixes: list[str]
    weights: list[float]
    out: Path
    shards: int


def tiny_blend(root: Path, count: int) -> Blend:
    """``count`` sources of 20 to 24 sequences of 2 to 10 tokens: each split of each source
    (``"90,5,5"``) holds tokens, and the whole build stays fast."""
    prefixes = write_sources(root, count, seed=count, sequences=(20, 24), tokens=(2, 10))
    weights = weights_for(prefixes, seed=count)
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes, weights), out)
    return Blend(root, prefixes, weights, out, len(load_manifest(out).shards))


def job(blend: Blend, cache: str, *, repack: bool = True, mmap: bool = True) -> dict:
    return {
        "prefixes": blend.prefixes,
        "weights": blend.weights,
        "sizes": [2000, 100, 100],
        "cache": str(blend.root / cache),
        "mmap": mmap,
        "repack": str(blend.out) if repack else None,
        "watch": {
            "data": str(blend.root / "data"),
            "repack": str(blend.out),
            "cache": str(blend.root / cache),
        },
    }


@dataclass(frozen=True)
class Runs:
    blends: dict[int, Blend]
    #: (sources, run) -> the child's report; run is cold, warm, pread, stock-cold or stock-warm
    results: dict[tuple[int, str], dict]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("resources")
    blends = {n: tiny_blend(root / f"b{n}", n) for n in (100, 2000)}
    # the longest first: two run at a time
    cold = {
        (2000, "cold"): job(blends[2000], "cache"),
        (100, "cold"): job(blends[100], "cache"),
        (100, "stock-cold"): job(blends[100], "stock-cache", repack=False),
    }
    warm = {  # the same caches again: every index is a cache hit
        (2000, "warm"): job(blends[2000], "cache"),
        (2000, "pread"): job(blends[2000], "cache", mmap=False),
        (100, "warm"): job(blends[100], "cache"),
        (100, "pread"): job(blends[100], "cache", mmap=False),
        (100, "stock-warm"): job(blends[100], "stock-cache", repack=False),
    }
    results = {}
    for wave in (cold, warm):
        children: list[Child] = run_children(list(wave.values()), root / "jobs")
        results.update({key: child.result for key, child in zip(wave, children)})
    return Runs(blends, results)


def test_repack_holds_the_same_files_for_100_and_2000_sources(runs: Runs) -> None:
    r = runs.results
    assert runs.blends[100].shards == runs.blends[2000].shards == 2  # uint16 and int32
    for run in ("cold", "warm", "pread"):
        assert r[(100, run)]["open"] == r[(2000, run)]["open"], run


def test_repack_holds_one_mapping_per_shard_and_cache_pack(runs: Runs) -> None:
    for sources, blend in runs.blends.items():
        for run in ("cold", "warm"):
            maps, fds = runs.results[(sources, run)]["open"].values()
            assert maps["data"] == fds["data"] == 0, (sources, run)  # originals never opened
            assert maps["repack"] == blend.shards + 1, (sources, run)  # shards and the index
            assert fds["repack"] <= blend.shards + 1, (sources, run)
            assert runs.results[(sources, run)]["shard_maps"] == blend.shards
            # one pack of every dataset's indices, plus the blended datasets' own cache
            assert 1 <= maps["cache"] <= 1 + BLENDED_MAPS, (sources, run)
            assert fds["cache"] <= 1 + BLENDED_MAPS, (sources, run)


def test_pread_backend_maps_no_shard(runs: Runs) -> None:
    for sources, blend in runs.blends.items():
        report = runs.results[(sources, "pread")]
        maps, fds = report["open"].values()
        assert report["shard_maps"] == 0
        assert maps["data"] == fds["data"] == 0
        # index.rpx only, mapped once by the pread repack and once by dataset_class() checks
        assert maps["repack"] <= 2
        assert fds["repack"] <= blend.shards + 2


def test_stock_holds_files_per_source(runs: Runs) -> None:
    r = runs.results
    for run in ("stock-cold", "stock-warm"):
        maps, fds = r[(100, run)]["open"].values()
        assert maps["data"] >= 2 * 100 and fds["data"] >= 100  # .idx and .bin of every source
        for repacked in ("cold", "warm", "pread"):
            for n in (100, 2000):
                assert sum(maps.values()) > sum(r[(n, repacked)]["open"]["maps"].values())
                assert sum(fds.values()) > sum(r[(n, repacked)]["open"]["fds"].values())
    # on a cache hit, three mapped .npy per dataset: 100 sources x 3 splits
    assert r[(100, "stock-warm")]["open"]["maps"]["cache"] >= 3 * 100 * SPLITS


def test_every_run_reads_the_stock_samples(runs: Runs) -> None:
    r = runs.results
    stock = r[(100, "stock-cold")]
    assert stock["digest"] == r[(100, "stock-warm")]["digest"]
    for run in ("cold", "warm", "pread"):
        assert r[(100, run)]["digest"] == stock["digest"], run
        assert r[(2000, run)]["digest"] == r[(2000, "cold")]["digest"], run
    assert r[(2000, "cold")]["lengths"][0] >= 2000
