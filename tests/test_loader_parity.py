"""Megatron-Core reads a repack exactly as it reads the original prefixes.

For one ``GPTDatasetConfig``, ``BlendedMegatronDatasetBuilder`` over ``RepackedGPTDataset`` (or
``dataset_class(OUT)``) must give the samples that stock ``GPTDataset`` gives over the original
``.bin``/``.idx`` prefixes: every index of every split, every key (tokens, labels, loss_mask,
position_ids, attention_mask, dataset_id), bit for bit. Both sides build their indices on their
own (separate caches) unless a test is about sharing a cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from megatron_support import (
    GPTDataset,
    GPTDatasetConfig,
    assert_same_samples,
    build,
    collect,
    gpt_config,
    init_process_group,
    weights_for,
    write_flat_blend,
    write_sources,
)

import repack.cache.indexcache
from repack.cache.indexcache import CATALOG_FILE
from repack.errors import FormatError, RepackError, UnknownSource
from repack.format.manifest import load_manifest
from repack.megatron import (
    CACHE_SUBDIR,
    ENV_VAR,
    MEGATRON_VERSION,
    NPY_ENV_VAR,
    RepackedGPTDataset,
    dataset_class,
)
from repack.merge import merge

pytestmark = pytest.mark.megatron

SIZES = [2000, 100, 100]


@dataclass(frozen=True)
class Data:
    root: Path
    prefixes: list[str]
    weights: list[float]
    #: the flat blend merged into 8 KiB shards: every source is cut across shards
    out: Path
    #: a per-split blend (train 0-23, valid 24-29, test 30-35) of the same sources, merged
    out_per_split: Path


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> None:
    init_process_group()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    root = tmp_path_factory.mktemp("loader-parity")
    prefixes = write_sources(root, 36, seed=5)
    weights = weights_for(prefixes, seed=5)
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes, weights), out, shard_size=8192)
    manifest = load_manifest(out)
    assert all(len(s.segments) > 1 for s in manifest.sources)  # premise: cut sources
    assert {s.dtype.name for s in manifest.sources} == {"uint16", "int32"}

    def pairs(lo: int, hi: int) -> list[object]:
        return [x for i in range(lo, hi) for x in (weights[i], prefixes[i])]

    per_split = root / "per-split.json"
    per_split.write_text(
        json.dumps({"train": pairs(0, 24), "valid": pairs(24, 30), "test": pairs(30, 36)})
    )
    out_per_split = root / "out-per-split"
    merge(per_split, out_per_split)
    return Data(root, prefixes, weights, out, out_per_split)


def files_under(folder: Path) -> dict[str, tuple[int, int]]:
    """``{relative path: (mtime_ns, size)}`` of every file under ``folder``."""
    found = {}
    for path in folder.rglob("*"):
        if path.is_file():
            stat = path.stat()
            found[str(path.relative_to(folder))] = (stat.st_mtime_ns, stat.st_size)
    return found


def forbid_index_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any build (or load) of per-dataset indices by stock Megatron code fail."""

    def refuse(self):
        raise AssertionError(f"{self.unique_description_hash}: indices rebuilt, not a cache hit")

    monkeypatch.setattr(GPTDataset, "_build_document_sample_shuffle_indices", refuse)


def forget_open_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Have the next build read the index cache catalogs from disk, as a new process would."""
    monkeypatch.setattr(repack.cache.indexcache, "_CACHES", {})


# --- the same config, stock and repacked -------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "sequence_length", "mmap", "with_cache", "relative"),
    [
        (1234, 64, True, True, False),
        (7, 200, False, True, False),
        (99, 33, True, False, False),
        (5, 128, False, False, True),
    ],
    ids=[
        "seed1234-L64-mmap-cache",
        "seed7-L200-pread-cache",
        "seed99-L33-mmap",
        "seed5-L128-pread-rel",
    ],
)
def test_flat_blend_gives_the_stock_samples(
    data: Data,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    sequence_length: int,
    mmap: bool,
    with_cache: bool,
    relative: bool,
) -> None:
    prefixes = data.prefixes
    if relative:  # as written on a command line run from the data's folder
        monkeypatch.chdir(data.root)
        prefixes = [os.path.relpath(p, data.root) for p in prefixes]
    kwargs = dict(prefixes=prefixes, weights=data.weights, seed=seed, mmap=mmap)
    kwargs["sequence_length"] = sequence_length
    stock_cache = tmp_path / "stock-cache" if with_cache else None
    ours_cache = tmp_path / "ours-cache" if with_cache else None
    stock = collect(build(GPTDataset, gpt_config(**kwargs, cache=stock_cache), SIZES))

    before = files_under(data.root / "data")
    ours = collect(build(dataset_class(data.out), gpt_config(**kwargs, cache=ours_cache), SIZES))
    assert_same_samples(stock, ours)
    assert [len(s) for s in ours] == [len(s) for s in stock]
    assert len(ours[0]) >= SIZES[0]
    keys = {"dataset_id", "tokens", "labels", "attention_mask", "loss_mask", "position_ids"}
    assert set(ours[0][0]) == keys
    # the repacked run wrote nothing next to the original prefixes, with or without a cache
    assert files_under(data.root / "data") == before
    if not with_cache:
        # stock Megatron caches under every prefix; the repacked run caches in OUT
        assert (Path(data.prefixes[0]) / "cache" / "GPTDataset_indices").is_dir()
        assert (data.out / CACHE_SUBDIR / CATALOG_FILE).is_file()


def test_per_split_blend_gives_the_stock_samples(data: Data, tmp_path: Path) -> None:
    """``blend_per_split``, one split without weights (sampled in proportion to size)."""
    p, w = data.prefixes, data.weights
    blend_per_split = [(p[:20], w[:20]), (p[20:28], w[20:28]), (p[28:], None)]
    kwargs = dict(blend_per_split=blend_per_split, sequence_length=96)
    stock = collect(build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "a"), [1500, 80, 80]))
    ours = collect(
        build(dataset_class(data.out), gpt_config(**kwargs, cache=tmp_path / "b"), [1500, 80, 80])
    )
    assert_same_samples(stock, ours)
    assert all(len(split) > 0 for split in ours)


@pytest.mark.parametrize("sizes", [[None, None, None], [1000, 60, 60]], ids=["no-sizes", "sizes"])
def test_omitted_weights_give_the_stock_samples(
    data: Data, tmp_path: Path, sizes: list[int | None]
) -> None:
    """Without weights Megatron samples every source in proportion to its size (with neither
    weights nor sizes each source must give a sample in each split, hence the wider split)."""
    kwargs = dict(
        prefixes=data.prefixes, weights=None, seed=3, split="80,10,10", sequence_length=32
    )
    stock = collect(build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "a"), sizes))
    ours = collect(
        build(dataset_class(data.out), gpt_config(**kwargs, cache=tmp_path / "b"), sizes)
    )
    assert_same_samples(stock, ours)
    if sizes[0] is not None:
        assert len(ours[0]) == sizes[0]


def test_several_epochs_give_the_stock_samples(data: Data, tmp_path: Path) -> None:
    """Far more samples than one pass over the sources: indices span several epochs."""
    kwargs = dict(prefixes=data.prefixes[:8], weights=[1.0] * 8, sequence_length=128, seed=11)
    sizes = [2500, 300, 300]
    stock_datasets = build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "a"), sizes)
    for blended in stock_datasets:  # premise: every dataset of every split needs > 1 epoch
        for dataset in blended.datasets:
            assert len(dataset) * 128 > 2 * dataset._get_num_tokens_per_epoch()
    stock = collect(stock_datasets)
    ours = collect(
        build(dataset_class(data.out), gpt_config(**kwargs, cache=tmp_path / "b"), sizes)
    )
    assert_same_samples(stock, ours)


def test_repack_dir_variable_reads_like_dataset_class(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kwargs = dict(prefixes=data.prefixes, weights=data.weights, sequence_length=50)
    monkeypatch.setenv(ENV_VAR, str(data.out))
    via_env = collect(build(RepackedGPTDataset, gpt_config(**kwargs, cache=tmp_path / "e"), SIZES))
    monkeypatch.delenv(ENV_VAR)
    via_class = collect(
        build(dataset_class(data.out), gpt_config(**kwargs, cache=tmp_path / "c"), SIZES)
    )
    stock = collect(build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "s"), SIZES))
    assert_same_samples(stock, via_env)
    assert_same_samples(stock, via_class)


def test_no_repack_folder_is_a_clear_error(data: Data, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(RepackError, match=ENV_VAR):
        build(RepackedGPTDataset, gpt_config(data.prefixes[:2], None), SIZES)


def test_dataset_class_of_a_folder_that_is_no_repack_fails_at_once(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match=re.escape(str(tmp_path))):
        dataset_class(tmp_path)


def test_prefix_not_in_the_repack_is_named(data: Data, tmp_path: Path) -> None:
    (stranger,) = write_sources(tmp_path, 1, seed=9, folder="elsewhere")
    config = gpt_config([*data.prefixes[:3], stranger], [1.0] * 4, cache=tmp_path / "c")
    with pytest.raises(UnknownSource, match=re.escape(stranger)):
        build(dataset_class(data.out), config, SIZES)


# --- the index cache ---------------------------------------------------------------------------


def test_warm_cache_run_is_identical_and_builds_nothing(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = dataset_class(data.out)
    kwargs = dict(prefixes=data.prefixes, weights=data.weights, seed=21, cache=tmp_path / "c")
    first = collect(build(cls, gpt_config(**kwargs), SIZES))
    written = files_under(tmp_path / "c")
    assert CATALOG_FILE in written
    assert len([f for f in written if f.endswith(".rpc")]) == 1  # one pack for the build

    forget_open_caches(monkeypatch)
    forbid_index_builds(monkeypatch)
    second = collect(build(cls, gpt_config(**kwargs), SIZES))
    assert_same_samples(first, second)
    assert files_under(tmp_path / "c") == written  # nothing written, nothing touched


def test_stock_cache_is_a_hit_for_the_repacked_run(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    kwargs = dict(prefixes=data.prefixes, weights=data.weights, seed=31, cache=cache)
    stock_datasets = build(GPTDataset, gpt_config(**kwargs), SIZES)
    stock = collect(stock_datasets)
    stock_files = files_under(cache)
    stock_names = {
        f.removesuffix("-description.txt")
        for f in stock_files
        if "-GPTDataset-" in f and f.endswith("-description.txt")
    }
    assert len(stock_names) == 3 * len(data.prefixes)

    forbid_index_builds(monkeypatch)
    ours_datasets = build(dataset_class(data.out), gpt_config(**kwargs), SIZES)
    ours = collect(ours_datasets)
    assert_same_samples(stock, ours)
    # same descriptions, hence the same hashes and file names
    for stock_split, ours_split in zip(stock_datasets, ours_datasets):
        assert stock_split.unique_description_hash == ours_split.unique_description_hash
        assert [d.unique_description_hash for d in stock_split.datasets] == [
            d.unique_description_hash for d in ours_split.datasets
        ]
    after = files_under(cache)
    assert {f: after[f] for f in stock_files} == stock_files  # untouched
    new = set(after) - set(stock_files)
    assert not any(f.endswith((".npy", ".txt")) for f in new), sorted(new)
    assert len([f for f in new if f.endswith(".rpc")]) == 1
    catalog = json.loads((cache / CATALOG_FILE).read_text())
    assert set(catalog["entries"]) == stock_names


def test_repacked_cache_holds_no_file_per_dataset(data: Data, tmp_path: Path) -> None:
    """A cold build has Megatron compute the indices in memory: the cache folder gets the
    lock, the catalog and one pack, and only ``BlendedDataset`` writes files of its own."""
    cache = tmp_path / "cache"
    kwargs = dict(prefixes=data.prefixes, weights=data.weights, seed=42, cache=cache)
    collect(build(dataset_class(data.out), gpt_config(**kwargs), SIZES))
    written = sorted(files_under(cache))
    assert not [f for f in written if "-GPTDataset-" in f], written
    ours = [f for f in written if "-BlendedDataset-" not in f]
    assert len(ours) == 3 and CATALOG_FILE in ours, ours  # lock, catalog, one pack
    assert len(written) - len(ours) == 3 * 3  # description + 2 arrays per split


def test_repacked_cache_is_a_hit_for_stock_megatron_with_npy_files(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The way back to stock Megatron: with ``REPACK_NPY_CACHE=1`` Megatron's own cache files
    are written too, and stock ``GPTDataset`` finds them."""
    cache = tmp_path / "cache"
    kwargs = dict(prefixes=data.prefixes, weights=data.weights, seed=41, cache=cache)
    monkeypatch.setenv(NPY_ENV_VAR, "1")
    ours = collect(build(dataset_class(data.out), gpt_config(**kwargs), SIZES))
    written = files_under(cache)
    assert len([f for f in written if f.endswith("-GPTDataset-train-description.txt")]) == 36

    def refuse(*args, **kwargs):
        raise AssertionError("stock Megatron rebuilt a sample index")

    from megatron.core.datasets import helpers

    monkeypatch.setattr(helpers, "build_sample_idx", refuse)
    stock = collect(build(GPTDataset, gpt_config(**kwargs), SIZES))
    assert_same_samples(stock, ours)
    assert files_under(cache) == written


@pytest.mark.parametrize(
    "knob", ["defer_npy_index_mmap", "fast_cache_load", "inter_document_masking"]
)
def test_newer_config_knobs_keep_the_stock_samples(data: Data, tmp_path: Path, knob: str) -> None:
    """Fields of newer releases' ``GPTDatasetConfig``, each turned on for both sides:
    ``defer_npy_index_mmap`` (indices attached on first use) and ``fast_cache_load`` (no cache
    checks), both reading a cache built before; ``inter_document_masking`` (``cu_seqlens``)."""
    if knob not in GPTDatasetConfig.__dataclass_fields__:
        pytest.skip(f"megatron-core {MEGATRON_VERSION} has no GPTDatasetConfig.{knob}")
    kwargs = dict(prefixes=data.prefixes, weights=data.weights, seed=71)
    stock_cache, our_cache = tmp_path / "stock", tmp_path / "ours"
    if knob != "inter_document_masking":  # both read caches built before
        build(GPTDataset, gpt_config(**kwargs, cache=stock_cache), SIZES)
        build(dataset_class(data.out), gpt_config(**kwargs, cache=our_cache), SIZES)
    stock_config = gpt_config(**kwargs, cache=stock_cache)
    our_config = gpt_config(**kwargs, cache=our_cache)
    setattr(stock_config, knob, True)
    setattr(our_config, knob, True)
    stock = collect(build(GPTDataset, stock_config, SIZES))
    if knob == "inter_document_masking":
        assert "cu_seqlens" in stock[0][0]  # premise: the knob took effect
    assert_same_samples(stock, collect(build(dataset_class(data.out), our_config, SIZES)))


def test_packed_indices_need_no_npy_files(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once packed, Megatron's per-dataset ``.npy`` files may be deleted to save space."""
    cls = dataset_class(data.out)
    cache = tmp_path / "c"
    kwargs = dict(prefixes=data.prefixes, weights=data.weights, seed=51, cache=cache)
    first = collect(build(GPTDataset, gpt_config(**kwargs), SIZES))  # a stock cache
    assert_same_samples(first, collect(build(cls, gpt_config(**kwargs), SIZES)))  # packed
    deleted = list(cache.glob("*-GPTDataset-*"))
    assert len(deleted) == 4 * 3 * len(data.prefixes)
    for path in deleted:
        path.unlink()
    forget_open_caches(monkeypatch)
    forbid_index_builds(monkeypatch)
    assert_same_samples(first, collect(build(cls, gpt_config(**kwargs), SIZES)))


def test_catalog_whose_pack_is_gone_is_repaired(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catalog entry naming a deleted pack is a cache miss, not an error: the indices are
    packed again (here from Megatron's ``.npy`` files, still there)."""
    cls = dataset_class(data.out)
    cache = tmp_path / "c"
    kwargs = dict(prefixes=data.prefixes, weights=data.weights, seed=61, cache=cache)
    first = collect(build(cls, gpt_config(**kwargs), SIZES))
    (pack,) = cache.glob("*.rpc")
    pack.unlink()
    forget_open_caches(monkeypatch)
    second = collect(build(cls, gpt_config(**kwargs), SIZES))
    assert_same_samples(first, second)
    assert len(list(cache.glob("*.rpc"))) == 1


# --- training configs other than the merged blend ------------------------------------------


@pytest.mark.parametrize(
    "variant", ["other-weights", "subset", "repeated", "single-source", "other-splits", "threads"]
)
def test_training_blend_may_differ_from_the_merged_one(
    data: Data, tmp_path: Path, variant: str
) -> None:
    """The repack is a store of sources: any blend of them reads as stock Megatron reads it."""
    p = data.prefixes
    out, sizes = data.out, SIZES
    if variant == "other-weights":
        kwargs = dict(prefixes=p, weights=weights_for(p, seed=99)[::-1])
    elif variant == "subset":
        kwargs = dict(prefixes=p[::3], weights=data.weights[::3], sequence_length=40)
    elif variant == "repeated":  # a source twice, as blends sometimes do to upweight it
        kwargs = dict(prefixes=p[:6] + p[2:4], weights=[1.0] * 6 + [0.5, 2.0])
    elif variant == "threads":  # the builder's thread pool builds datasets concurrently
        kwargs = dict(prefixes=p, weights=data.weights, threads=4)
    elif variant == "single-source":  # one prefix, no weights: no BlendedDataset at all
        kwargs = dict(prefixes=p[7:8], weights=None)
        sizes = [300, 20, 20]
    else:  # merged as train 0-23, valid 24-29, test 30-35; trained with sources moved around
        out = data.out_per_split
        kwargs = dict(
            blend_per_split=[
                (p[24:36] + p[:6], None),
                (p[6:12], [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]),
                (p[12:14] + p[26:28], None),
            ]
        )
        sizes = [1200, 80, 80]
    stock = collect(build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "a"), sizes))
    ours = collect(build(dataset_class(out), gpt_config(**kwargs, cache=tmp_path / "b"), sizes))
    assert_same_samples(stock, ours)
    if variant == "single-source":
        assert "dataset_id" not in ours[0][0]


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_originals_may_go_after_the_merge(tmp_path: Path, how: str) -> None:
    source_root = tmp_path / "sources"
    prefixes = write_sources(source_root, 12, seed=13)
    weights = weights_for(prefixes, seed=13)
    out = tmp_path / "out"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes, weights), out)
    config = dict(prefixes=prefixes, weights=weights, sequence_length=80)
    # no path_to_cache: stock Megatron caches under the prefixes, which go with them
    expected = collect(build(GPTDataset, gpt_config(**config), SIZES))

    if how == "deleted":
        shutil.rmtree(source_root)
    else:
        shutil.move(source_root, tmp_path / "archive")
    assert not any(os.path.exists(p + ".bin") or os.path.exists(p + ".idx") for p in prefixes)

    found = collect(build(dataset_class(out), gpt_config(**config), SIZES))
    assert_same_samples(expected, found)


def test_the_comparison_sees_a_difference(data: Data, tmp_path: Path) -> None:
    """The comparison is not vacuous: another seed gives other samples."""
    kwargs = dict(prefixes=data.prefixes[:6], weights=data.weights[:6], cache=tmp_path / "c")
    ours = collect(build(dataset_class(data.out), gpt_config(**kwargs), [200, 20, 20]))
    other = collect(build(GPTDataset, gpt_config(**kwargs, seed=4321), [200, 20, 20]))
    with pytest.raises(AssertionError, match="differs"):
        assert_same_samples(other, ours)
    assert not np.array_equal(other[0][0]["tokens"], ours[0][0]["tokens"])


def test_a_blend_naming_a_source_twice_with_two_weights_merges_and_reads_as_stock(
    data: Data, tmp_path: Path
) -> None:
    """Stock Megatron builds a prefix named twice with two weights as two datasets: the merge
    takes that blend (storing the source once, the blend as written) and reads it as stock."""
    p = data.prefixes
    prefixes, weights = p[:4] + p[1:2], [1.0, 1.0, 1.0, 1.0, 3.0]
    out = tmp_path / "out"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes, weights), out)
    manifest = load_manifest(out)
    assert len(manifest.sources) == 4
    (entries,) = manifest.blend.splits.values()
    assert [(e.path, e.weight) for e in entries] == [
        (os.path.abspath(q), w) for q, w in zip(prefixes, weights)
    ]
    kwargs = dict(prefixes=prefixes, weights=weights, sequence_length=64)
    stock = collect(build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "a"), SIZES))
    ours = collect(build(dataset_class(out), gpt_config(**kwargs, cache=tmp_path / "b"), SIZES))
    assert_same_samples(stock, ours)
    assert {int(sample["dataset_id"]) for sample in ours[0]} == set(range(5))
