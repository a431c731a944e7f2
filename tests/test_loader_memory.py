"""What a repacked dataset holds per source (issue 44): the description Megatron builds for
every dataset is computed again when read, not held; its identifiers are one tuple of names
shared by every dataset, their values read again from the dataset; the split's ``indices`` are
held as their two ends; the index arrays are views of one array per pack, made when read and
held by no dataset; the manifest's sources, its blend and the cache's catalog are columns, not
objects per source. What Megatron reads of them is what stock's hold, pickled or not, and a
user's class whose description is not Megatron's keeps its own.
"""

from __future__ import annotations

import collections
import gc
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from megatron_support import (
    GPTDataset,
    assert_same_samples,
    build,
    collect,
    gpt_config,
    init_process_group,
    merged_blend,
)

from repack.cache import indexcache
from repack.format import manifest
from repack.megatron import dataset_class, repacked
from repack.megatron.mixin import describe
from repack.read import reader

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> None:
    init_process_group()


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("memory")
    prefixes, weights, out = merged_blend(root, 5, seed=44, sequences=(4, 12), tokens=(40, 400))
    return prefixes, weights, out, root


def built(cls: type, blend, cache: Path):
    prefixes, weights, _, _ = blend
    config = gpt_config(prefixes, weights, split="100,0,0", cache=cache)
    return build(cls, config, [20 * len(prefixes), 0, 0])


def test_held_once_and_read_as_stock(blend) -> None:
    _, _, out, root = blend
    ours = built(dataset_class(out), blend, root / "ours")
    stock = built(GPTDataset, blend, root / "stock")
    assert_same_samples(collect(stock), collect(ours))
    for mine, theirs in zip(ours[0].datasets, stock[0].datasets):
        assert "unique_description" not in vars(mine)
        assert mine._repack_description is None  # read once, for Megatron's hash
        assert "indices" not in vars(mine)
        assert mine.unique_description == theirs.unique_description
        assert mine.unique_description_hash == theirs.unique_description_hash
        assert mine.indices.dtype == theirs.indices.dtype
        assert np.array_equal(mine.indices, theirs.indices)
        for name in ("document_index", "sample_index", "shuffle_index"):
            array = getattr(mine, name)
            assert np.array_equal(array, getattr(theirs, name))
            assert isinstance(array.base, np.ndarray) and array.base.dtype == np.uint8
    # no buffer objects per array: one pack's array is the base of all of them
    bases = {id(d.sample_index.base) for d in ours[0].datasets}
    assert len(bases) == 1
    names = {id(d._repack_identifiers) for d in ours[0].datasets}
    for mine, theirs in zip(ours[0].datasets, stock[0].datasets):
        assert type(mine.unique_identifiers) is type(theirs.unique_identifiers)
        ours_items = list(mine.unique_identifiers.items())
        # each build has a tokenizer of its own: the same object as the config's, as stock's
        assert ("tokenizer", mine.config.tokenizer) in ours_items
        assert [(k, v) for k, v in ours_items if k != "tokenizer"] == [
            (k, v) for k, v in theirs.unique_identifiers.items() if k != "tokenizer"
        ]
        # read, and held by the pack's cache only; Megatron's None not held either
        assert not {
            f"_repack_{name}" for name in ("document_index", "sample_index", "shuffle_index")
        } & set(vars(mine))
    assert len(names) == 1  # one tuple of names for every dataset


def _tracked(sources: int, root: Path) -> tuple[int, collections.Counter]:
    """Objects the collector tracks, and their types, that a warm build of a blend of
    ``sources`` sources and a sample of every dataset leave."""
    prefixes, weights, out = merged_blend(
        root, sources, seed=45, sequences=(4, 8), tokens=(40, 200)
    )
    config = gpt_config(prefixes, weights, split="100,0,0", cache=root / "cache")
    cls = dataset_class(out)
    build(cls, config, [20 * sources, 0, 0])[0][0]  # cold: writes the cache at its sample
    # forget the open repack, its parsed manifest and the cache's catalog: counted from here
    reader._OPEN.clear()
    manifest._LAST_PARSED.clear()
    indexcache._CACHES.clear()
    gc.collect()
    before = collections.Counter(type(o).__name__ for o in gc.get_objects())
    train = build(cls, config, [20 * sources, 0, 0])[0]
    for dataset in train.datasets:
        dataset[0]
    gc.collect()
    after = collections.Counter(type(o).__name__ for o in gc.get_objects())
    assert len(train.datasets) == sources
    return sum(after.values()) - sum(before.values()), after - before


def test_a_source_adds_few_objects_for_the_collector(tmp_path: Path) -> None:
    """Per source, a warm build (the manifest and the catalog read again) keeps its
    ``GPTDataset`` and its view of the source: no manifest entry, blend entry, identifiers dict
    or index array (6.9 objects per source at 2fd8707)."""
    small, small_types = _tracked(20, tmp_path / "small")
    large, types = _tracked(220, tmp_path / "large")
    # Megatron's own masks per dataset (Tensor) are left out: whether a dataset's are shared
    # yet depends on what the process read before (repack.megatron.masks)
    tensors = types["Tensor"] - small_types["Tensor"]
    per_source = (large - small - tensors) / 200
    assert per_source < 2.5, (per_source, types.most_common(12))
    for kind in ("SourceEntry", "SegmentEntry", "BlendEntry", "OrderedDict"):
        assert types[kind] <= 5, (kind, types[kind])


def test_pickled_datasets_read_the_same(blend) -> None:
    _, _, out, root = blend
    ours = built(dataset_class(out), blend, root / "pickled")
    before = collect(ours)
    again = pickle.loads(pickle.dumps(ours[0]))
    for mine, theirs in zip(again.datasets, ours[0].datasets):
        assert mine.unique_description == theirs.unique_description
        assert np.array_equal(mine.indices, theirs.indices)
    assert_same_samples(before[:1], collect([again]))


def test_a_description_of_its_own_is_kept(blend) -> None:
    """A class whose ``__init__`` changes its identifiers after Megatron described them keeps
    the description Megatron made, as stock does."""
    _, _, out, root = blend

    class Described(GPTDataset):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.unique_identifiers["extra"] = 1

    ours = built(repacked(Described, str(out)), blend, root / "own")
    for dataset in ours[0].datasets:
        assert dataset._repack_description is not None
        assert dataset.unique_description == describe(
            {k: v for k, v in dataset.unique_identifiers.items() if k != "extra"}
        )


def test_a_blend_of_datasets_with_identifiers_of_their_own_describes_them_as_stock(
    tmp_path: Path,
) -> None:
    """A blend describes its datasets' identifiers as they are when it is made, as stock's,
    where a class's ``__init__`` changed them after Megatron described them: a blend of more
    than the 64 datasets below which its list of them is written whole anyway."""

    class Described(GPTDataset):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.unique_identifiers["extra"] = 1

    prefixes, weights, out = merged_blend(tmp_path, 70, seed=48, sequences=(4, 6), tokens=(40, 80))
    config = gpt_config(prefixes, weights, split="100,0,0", cache=tmp_path / "ours")
    (ours, *_) = build(repacked(Described, str(out)), config, [140, 0, 0])
    config = gpt_config(prefixes, weights, split="100,0,0", cache=tmp_path / "stock")
    (stock, *_) = build(Described, config, [140, 0, 0])
    assert len(ours.datasets) == 70
    assert ours.unique_description == stock.unique_description
    assert ours.unique_description.count('"extra": 1') == 70


def test_indices_not_a_range_are_kept_as_given() -> None:
    from repack.megatron.mixin import _span

    assert _span(np.arange(3, 9, dtype=np.int32)) == (3, 9)
    for value in (
        np.array([3, 5, 4, 6], dtype=np.int32),
        np.array([3, 5, 5, 6], dtype=np.int32),
        np.arange(3, 9, dtype=np.int64),
        np.array([], dtype=np.int32),
        None,
    ):
        assert _span(value) is value
    assert json.loads(describe({"a": [1, 2.5, None]})) == {"a": [1, 2.5, None]}


@pytest.mark.parametrize("held", [False, True], ids=["inline", "python-3.10"])
def test_identifiers_are_compacted_alike_on_every_python(held: bool) -> None:
    """``unique_identifiers`` as a non-data descriptor (Megatron's dict the dataset's own
    attribute until compacted, Python 3.11+) and as the data descriptor Python 3.10 gets: the
    same reads, the same names held, a dict whose values are not Megatron's kept."""
    import enum
    from collections import OrderedDict

    from repack.megatron import mixin

    class Split(enum.Enum):
        train = 0

    class Config:
        random_seed = 1234
        split_matrix = [(0, 1.0)]  # noqa: RUF012

    class Dataset:
        unique_identifiers = (mixin._HeldIdentifiers if held else mixin._Identifiers)()

        def __init__(self, seed: int) -> None:
            self.dataset_path, self.num_samples, self.index_split = "/p", 3, Split.train
            self.config = Config()
            self.unique_identifiers = OrderedDict()  # as MegatronDataset.__init__ fills it
            self.unique_identifiers["class"] = type(self).__name__
            self.unique_identifiers["dataset_path"] = self.dataset_path
            self.unique_identifiers["num_samples"] = self.num_samples
            self.unique_identifiers["index_split"] = self.index_split.name
            self.unique_identifiers["random_seed"] = seed
            self.unique_identifiers["split_matrix"] = self.config.split_matrix

    descriptor = vars(Dataset)["unique_identifiers"]
    dataset, other = Dataset(Config.random_seed), Dataset(99)
    expected = [OrderedDict(dataset.unique_identifiers), OrderedDict(other.unique_identifiers)]
    for made in (dataset, other):
        descriptor.compact(made)
        descriptor.compact(made)  # a second time: nothing to do
    assert type(dataset._repack_identifiers) is tuple  # the names only
    assert "unique_identifiers" not in vars(dataset)
    assert [dataset.unique_identifiers, other.unique_identifiers] == expected
    assert type(dataset.unique_identifiers) is OrderedDict
    assert type(other.unique_identifiers) is OrderedDict  # not the config's seed: its dict kept
    assert other.unique_identifiers["random_seed"] == 99
    state = Dataset.__new__(Dataset)  # a spawned worker's copy: the state of the dataset
    state.__dict__.update(vars(dataset))
    assert state.unique_identifiers == expected[0]
