"""``repack doctor`` against real megatron-core: its numbers are those of the datasets built.

For several blends (flat with weights, flat without, one prefix, per-split with a lone prefix
and an unweighted split; several seeds, splits and sequence lengths; sources drawn for several
epochs) the doctor's per-dataset sequences, tokens, samples, lengths, epochs and index dtypes
equal those of the ``GPTDataset`` s ``BlendedMegatronDatasetBuilder`` builds, and its blend
sizes those of the ``BlendedDataset`` s. Then the files a stock process and its forked
DataLoader workers hold equal the doctor's formula, and the masks the repacked classes hold its
memory figure.

On every megatron-core of the parity matrix (marker ``megatron``): the doctor computes as the
release installed does (``repack.model.release``), which these tests take from Megatron's own
``package_info``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core import package_info
from megatron_support import (
    GPTDataset,
    Probe,
    build,
    gpt_config,
    init_process_group,
    open_files,
    weights_for,
    write_flat_blend,
    write_sources,
)

from repack.doctor import Limits, Settings, doctor
from repack.megatron import dataset_class
from repack.megatron.masks import SHARED
from repack.merge import merge
from repack.model.splits import SPLIT_NAMES, installed
from repack.releases import release_of

# not `slow`: .ci/run runs the slow megatron tests on the newest release only, and these compare
# the doctor with each (a few hundred small datasets: about 10 s a release)
pytestmark = pytest.mark.megatron

NO_LIMITS = Limits(None, None, None)
#: The release installed, as Megatron says
RELEASE = release_of(package_info.__version__)
#: Descriptors an IndexedDataset holds with mmap_bin_files: its .idx map's, its .bin map's and,
#: from 0.13, the .bin opened for the map (indexed_dataset.py, _MMapBinReader.__init__)
INDEXED_FDS = 3 if RELEASE >= (0, 13) else 2


def test_the_doctor_follows_the_release_installed() -> None:
    assert installed() == RELEASE
    assert Settings(64, (1, 1, 1)).release == RELEASE


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    init_process_group()
    root = tmp_path_factory.mktemp("doctor-megatron")
    return write_sources(root, 14, seed=5)


def _flat(path: Path, prefixes, weights) -> Path:
    items: list = []
    if weights is None:
        items = list(prefixes)
    else:
        for weight, prefix in zip(weights, prefixes, strict=True):
            items += [weight, prefix]
    path.write_text(json.dumps(items))
    return path


def _gpt_datasets(split) -> list:
    """The GPTDatasets of a built split, in blend order."""
    return list(split.datasets) if hasattr(split, "datasets") else [split]


def _compare(report, built, sizes) -> int:
    """Assert the report's numbers are Megatron's; return the datasets compared."""
    compared = 0
    names = [plan.name for plan in report.plans]
    for i, name in enumerate(SPLIT_NAMES):
        assert (built[i] is not None) == (name in names), name
    for plan in report.plans:
        split = built[SPLIT_NAMES.index(plan.name)]
        datasets = _gpt_datasets(split)
        assert plan.blended == hasattr(split, "datasets"), plan.name
        assert len(datasets) == len(plan.datasets)
        if plan.blended:
            assert split.size == (plan.size if plan.weighted else min(plan.asked, plan.size))
            assert len(split) == plan.size, plan.name
            drawn = np.bincount(split.dataset_index, minlength=len(datasets))
            assert drawn.tolist() == [d.drawn for d in plan.datasets], plan.name
        for g, d in zip(datasets, plan.datasets):
            where = f"{plan.name} {d.key}"
            assert g.num_samples == d.num_samples, where
            assert len(g.indices) == d.sequences, where
            if d.sequences:
                assert int(g.indices[0]) == d.begin and int(g.indices[-1]) == d.end - 1, where
            assert g._get_num_tokens_per_epoch() == d.tokens, where
            assert len(g.document_index) == d.epochs * d.sequences, where
            assert len(g) == d.built, where
            assert str(g.sample_index.dtype) == d.index_dtype, where
            compared += 1
    return compared


CASES = {
    # name: (per_split, split, seed, sequence_length, sizes)
    "flat-weighted": ("flat", "90,5,5", 1234, 64, [2000, 200, 50]),
    "flat-weighted-many-epochs": ("flat", "80,15,5", 7, 32, [9000, 600, 120]),
    "flat-unweighted": ("bare", "85,10,5", 99, 64, [300, 40, 10]),
    "flat-one-prefix": ("one", "90,10,0", 3, 128, [700, 70, 0]),
    "per-split": ("per-split", None, 42, 64, [3000, 120, 60]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_doctor_equals_what_megatron_builds(case: str, sources: list[str], tmp_path: Path) -> None:
    kind, split, seed, sequence_length, sizes = CASES[case]
    weights = weights_for(sources, seed=seed)
    if kind == "per-split":
        train, valid, test = sources[:8], sources[8:9], sources[9:12]
        blend_per_split = [[train, weights[:8]], [valid, None], [test, None]]
        blend = tmp_path / "blend.json"
        blend.write_text(json.dumps({"blend_per_split": blend_per_split}))
        config = gpt_config(
            blend_per_split=blend_per_split,
            seed=seed,
            sequence_length=sequence_length,
            cache=tmp_path / "cache",
        )
    else:
        prefixes = sources[:1] if kind == "one" else sources
        w = None if kind in ("bare", "one") else weights
        blend = _flat(tmp_path / "blend.json", prefixes, w)
        config = gpt_config(
            prefixes,
            w,
            seed=seed,
            sequence_length=sequence_length,
            split=split,
            cache=tmp_path / "cache",
        )
    settings = Settings(sequence_length=sequence_length, sizes=tuple(sizes), split=split or "1")
    report = doctor(blend, settings, limits=NO_LIMITS)
    assert report.ok, report.problems
    built = build(GPTDataset, config, sizes)
    assert _compare(report, built, sizes) >= 2
    if case == "flat-weighted-many-epochs":  # the premise: sources repeated several times
        assert max(d.epochs for plan in report.plans for d in plan.datasets) >= 3


def test_unweighted_empty_slice_stops_megatron_as_the_doctor_says(
    sources: list[str], tmp_path: Path
) -> None:
    # without weights Megatron builds one epoch of each prefix: an empty test slice (0.1 % of
    # 40 to 80 sequences) gives a dataset of length 0, which BlendedDataset refuses
    blend = _flat(tmp_path / "blend.json", sources, None)
    report = doctor(blend, Settings(64, (300, 40, 10), "949,50,1"), limits=NO_LIMITS)
    assert not report.ok
    found = {(p.code, p.split) for p in report.problems if p.level == "error"}
    assert found == {("empty-split", "test")}
    assert all("BlendedDataset asserts" in p.message for p in report.problems if p.level == "error")
    config = gpt_config(sources, None, split="949,50,1", cache=tmp_path / "cache")
    with pytest.raises(AssertionError):
        build(GPTDataset, config, [300, 40, 10])


def test_files_held_per_process_and_per_worker_are_the_formula(
    sources: list[str], tmp_path: Path
) -> None:
    weights = weights_for(sources)
    blend = _flat(tmp_path / "blend.json", sources, weights)
    sizes = [600, 60, 30]
    config = gpt_config(sources, weights, cache=tmp_path / "cache")
    report = doctor(
        blend,
        Settings(64, tuple(sizes), "90,5,5"),
        limits=NO_LIMITS,
        ranks_per_node=4,
        workers=2,
    )
    build(GPTDataset, config, sizes)  # cold: writes the cache
    datasets = build(GPTDataset, config, sizes)  # warm: maps it, as every later start
    train = datasets[0]  # the other splits stay alive: they hold their files too
    folders = {"data": str(Path(sources[0]).parents[1]), "cache": str(tmp_path / "cache")}
    held = open_files(folders)
    mmaps = sum(held["maps"].values())
    fds = sum(held["fds"].values())
    expected = report.resources["stock"]["per_process"]
    assert (mmaps, fds) == (expected["mmaps"], expected["fds"])
    P, K = len(sources), 3
    assert (mmaps, fds) == (2 * P + 3 * P * K + 2 * K, INDEXED_FDS * P + 3 * P * K + 2 * K)
    # forked DataLoader workers (Linux's default) inherit all of it: each holds as much
    loader = torch.utils.data.DataLoader(
        Probe(train, folders),
        batch_size=2,
        num_workers=2,
        collate_fn=list,
        multiprocessing_context="fork",
    )
    seen = {}
    for batch in loader:
        for sample in batch:
            seen[sample["pid"]] = sample["open"]
        if len(seen) == 2:
            break
    assert len(seen) == 2
    for worker in seen.values():
        assert sum(worker["maps"].values()) == mmaps
        assert sum(worker["fds"].values()) == fds
    node = report.resources["stock"]["per_node"]
    assert node == {"mmaps": mmaps * 4 * 3, "fds": fds * 4 * 3}


def test_files_held_for_a_per_split_blend_are_the_formula(
    sources: list[str], tmp_path: Path
) -> None:
    # each split builds its own IndexedDataset of each of its prefixes; a lone prefix gets no
    # BlendedDataset
    weights = weights_for(sources)
    blend_per_split = [[sources[:8], weights[:8]], [sources[8:9], None], [sources[6:12], None]]
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps({"blend_per_split": blend_per_split}))
    sizes = [600, 60, 30]
    report = doctor(blend, Settings(64, tuple(sizes), None), limits=NO_LIMITS)
    assert report.resources["built"] == {"indexed_datasets": 15, "gpt_datasets": 15, "blended": 2}
    config = gpt_config(blend_per_split=blend_per_split, cache=tmp_path / "cache")
    build(GPTDataset, config, sizes)
    datasets = build(GPTDataset, config, sizes)  # warm
    folders = {"data": str(Path(sources[0]).parents[1]), "cache": str(tmp_path / "cache")}
    held = open_files(folders)
    expected = report.resources["stock"]["per_process"]
    assert (sum(held["maps"].values()), sum(held["fds"].values())) == (
        expected["mmaps"],
        expected["fds"],
    )
    assert all(split is not None for split in datasets)


def test_the_masks_repacked_datasets_hold_are_the_memory_figure(
    sources: list[str], tmp_path: Path
) -> None:
    """The repacked classes hold one set of masks per process and the datasets' loss masks: on
    0.12 to 0.14 (whose GPTDataset writes into its cached loss mask) one per dataset, from 0.15
    one shared. The tensors the datasets and the process's table keep, once each dataset has
    given two samples, add up to the doctor's figure per worker."""
    weights = weights_for(sources)
    out = tmp_path / "out"
    merge(write_flat_blend(tmp_path / "blend.json", sources, weights), out)
    sequence_length, sizes = 48, [600, 0, 0]
    report = doctor(out, Settings(sequence_length, tuple(sizes), "100,0,0"), limits=NO_LIMITS)
    config = gpt_config(
        sources, weights, split="100,0,0", sequence_length=sequence_length, cache=tmp_path / "c"
    )
    SHARED.clear()
    train = build(dataset_class(out), config, sizes)[0]
    tensors = []
    for dataset in train.datasets:
        dataset[0], dataset[1]
        tensors += [dataset.cached_attention_mask, dataset.cached_loss_mask]
        tensors.append(dataset.cached_position_ids)
    tensors += [t for masks in SHARED._masks.values() for t in masks if t is not None]
    tensors += SHARED._loss_masks.values()  # the process's table
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    (split,) = report.resources["memory"]["splits"]
    assert split["sources"] == len(train.datasets) == len(sources)
    assert sum(held.values()) == split["repack_per_worker"]
    # the table's mask, loss mask and position ids; the float32 loss masks of the datasets:
    # one each up to 0.14, from 0.15 one for all (gpt_dataset.py clones it per sample)
    loss_masks = len(sources) if RELEASE < (0, 15) else 1
    S = sequence_length
    assert split["repack_per_worker"] == S * S + 12 * S + loss_masks * 4 * S
