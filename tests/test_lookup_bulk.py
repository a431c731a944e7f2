"""A warm build's per-dataset lookups: a blend's prefixes found at once
(:meth:`~repack.format.sources.SourceTable.find_all`, :class:`~repack.read.views.BlendIds`)
give every dataset the source the lookup of its prefix alone gives, in order or not, in a
list changed since; a catalog's sample count read in place is the record's."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from repack.cache.index_records import Records, parse_entry, record_pack_samples
from repack.format.sources import TextIndex, Texts


def _texts() -> list[str]:
    return ["a", "bb", "a", "", "ccc", "bb", "dddd", "e"]


def test_find_all_is_find() -> None:
    values = _texts()
    index = TextIndex(Texts(values))
    asked = [*values, "x", "a", "abb", "b"]
    rows = index.find_all(asked)
    assert rows.tolist() == [-1 if index.find(t) is None else index.find(t) for t in asked]
    assert [index.find(t) for t in values] == [0, 1, 0, 3, 4, 1, 6, 7]  # the first wins
    assert index.find_all([]).tolist() == []
    assert TextIndex(Texts([])).find_all(["a"]).tolist() == [-1]
    assert TextIndex(Texts([])).find("a") is None


def test_find_all_leaves_a_shared_hash_to_find() -> None:
    """Two rows of one hash (the second's string under the first's hash): find walks them;
    find_all gives the first only where it is the string, else leaves it to find (-1)."""
    values = ["first", "second", "third"]
    hashes = np.array([hash("second"), hash("second"), hash("third")], np.int64)
    index = TextIndex(Texts(values), hashes)
    assert index.find("second") == 1 and index.find("first") is None
    assert index.find_all(["second", "third", "first"]).tolist() == [-1, 2, -1]


def test_a_text_index_pickles_as_its_texts() -> None:
    """Hashes of strings differ between processes: an unpickled index hashes again."""
    index = TextIndex(Texts(_texts()))
    again = pickle.loads(pickle.dumps(index))
    assert [again.find(t) for t in _texts()] == [index.find(t) for t in _texts()]
    assert again.find("x") is None


def test_a_records_pack_and_samples_read_in_place() -> None:
    good = "pack-a.rpc 0:<i4:12 64:<i4:9x2 192:<i4:8"
    decoded = {
        "good": good,
        "bad": "pack-a.rpc 0:<f4:12 64:<i4:9x2 192:<i4:8",
        "short": "pack-a.rpc 0:<i4:12 64:<i4:9x2",
        "dots": ".. 0:<i4:12 64:<i4:9x2 192:<i4:8",
        "tail": good + " ",
        "": "p 7:<i2:3 64:>i8:1 192:=u8:5",
        "last": "pack-b.rpc 0:<i4:1 64:<i4:3x2 128:<u4:1",
        "arabic digits": "pack-a.rpc 0:<i4:12 64:<i4:\u0669x2 192:<i4:8",  # parse_entry's
    }
    records = Records(decoded)
    for name in [*decoded, "missing"]:
        assert records.pack_samples(name) == record_pack_samples(records.get(name)), name
    assert records.pack_samples("good") == (8, "pack-a.rpc")
    assert records.pack_samples("bad") is None and records.pack_samples("missing") is None
    # not as repack writes it: left to the whole parse, which reads the same count
    assert records.pack_samples("arabic digits") is None
    assert parse_entry("x", decoded["arabic digits"]).sample_count == 8
    records["good"] = "pack-c.rpc 0:<i4:1 64:<i4:5x2 128:<u4:1"
    assert records.pack_samples("good") == (4, "pack-c.rpc")


@pytest.fixture(scope="module")
def repack(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    from repack.merge import merge
    from repack.synth import write_prefix

    root = tmp_path_factory.mktemp("lookup")
    prefixes = []
    for i in range(12):
        prefix = str(root / "data" / f"s{i:02d}")
        write_prefix(prefix, [np.arange(1, 5 + i, dtype=np.uint16)], dtype=np.uint16)
        prefixes.append(prefix)
    # one source written twice in the blend: found once, its first prefix wins
    blend = [*prefixes, prefixes[3]]
    (root / "blend.json").write_text(json.dumps(blend))
    merge(root / "blend.json", root / "out")
    return root / "out", prefixes


def test_a_tables_find_all_is_find(repack) -> None:
    from repack.read.reader import open_repack

    out, prefixes = repack
    table = open_repack(out).manifest.source_table
    asked = [*prefixes, prefixes[3], prefixes[0] + "/", "nowhere", prefixes[5].replace("/s", "//s")]
    rows, ids = table.find_all(asked)
    for prefix, row, found in zip(asked, rows.tolist(), ids.tolist()):
        if found >= 0:
            assert found == table.find(prefix) and table.holds_prefix(row, prefix)
        else:  # not written so: find asked (a path, or nothing)
            assert row == -1 and table._indexes()[0].find(prefix) is None
    assert ids[: len(prefixes)].tolist() == list(range(len(prefixes)))


def _views(cls, config, asked):
    """The views a build of ``asked`` makes (in the scope of a build, as Megatron's builder
    calls it: :func:`repack.megatron.buildscope.building`)."""
    from repack.megatron import buildscope

    with buildscope.building():
        return [cls.build_low_level_dataset(prefix, config) for prefix in asked]


def _config(prefixes, per_split=None):
    from types import SimpleNamespace

    if per_split is not None:
        return SimpleNamespace(blend=None, blend_per_split=per_split, mmap_bin_files=True)
    return SimpleNamespace(blend=(prefixes, None), blend_per_split=None, mmap_bin_files=True)


def _counting(monkeypatch) -> list:
    import repack.read.views as views

    calls: list = []
    resolve = views._resolve_id

    def counted(repack, prefix):
        calls.append(prefix)
        return resolve(repack, prefix)

    monkeypatch.setattr(views, "_resolve_id", counted)
    return calls


def test_a_blend_is_found_at_once_and_as_one_by_one(repack, monkeypatch) -> None:
    """A builder's prefixes, in order: no lookup of its own per prefix, the same sources; out
    of order, a list changed since, a prefix written as another path or not a source: each
    prefix as on its own (the same source, the same error)."""
    pytest.importorskip("megatron.core")
    from repack.errors import UnknownSource
    from repack.megatron import buildscope, dataset_class
    from repack.read.views import SourceDataset

    out, prefixes = repack
    cls = dataset_class(out)
    calls = _counting(monkeypatch)

    def ids(views):
        return [view._id for view in views]

    def alone(asked):
        return [SourceDataset(str(out), prefix)._id for prefix in asked]

    asked = [*prefixes, prefixes[3]]
    config = _config(asked)
    for _ in range(2):  # built again: found at once again
        built = ids(_views(cls, config, asked))
        assert calls == []  # found at once, checked one by one
        assert built == alone(asked)
        calls.clear()

    shuffled = asked[:1] + asked[1:][::-1]
    built = ids(_views(cls, config, shuffled))
    assert len(calls) > 1  # out of order: found on their own
    assert built == alone(shuffled)

    changed = list(asked)
    config = _config(changed)
    with buildscope.building():  # one build
        _views(cls, config, changed[:4])  # its prefixes cut short
        changed[5], changed[6] = changed[6], changed[5]  # the list changed in place
        assert ids(_views(cls, config, changed)) == alone(changed)

    expected = alone(changed)
    calls.clear()  # outside a build: each found on its own, nothing held past the call
    assert [cls.build_low_level_dataset(p, config)._id for p in changed] == expected
    assert len(calls) == len(changed) and buildscope.memo() is None

    other = [prefixes[2], os.path.relpath(prefixes[4])]
    other += [prefixes[7] + "/", *prefixes[8:]]
    assert ids(_views(cls, _config(other), other)) == alone(other)

    missing = [*prefixes[:3], str(out / "nowhere"), *prefixes[3:]]
    config = _config(missing)
    with pytest.raises(UnknownSource) as alone_error:
        SourceDataset(str(out), missing[3])
    assert ids(_views(cls, config, missing[:3])) == alone(missing[:3])
    with pytest.raises(UnknownSource) as error:
        cls.build_low_level_dataset(missing[3], config)
    assert str(error.value) == str(alone_error.value)
    assert ids(_views(cls, config, missing[4:])) == alone(missing[4:])


def test_per_split_blends_sharing_a_first_prefix(repack, monkeypatch) -> None:
    pytest.importorskip("megatron.core")
    from repack.megatron import buildscope, dataset_class
    from repack.read.views import SourceDataset

    out, prefixes = repack
    cls = dataset_class(out)
    train, valid = prefixes[:6], [prefixes[0], *prefixes[6:]]
    config = _config(None, per_split=[(train, None), (valid, None), None])
    calls = _counting(monkeypatch)
    for _ in range(2):
        with buildscope.building():  # one build of both splits
            built = [[v._id for v in _views(cls, config, asked)] for asked in (train, valid)]
        assert calls == []  # each list found at once
        assert built == [[SourceDataset(str(out), p)._id for p in a] for a in (train, valid)]
        calls.clear()


def test_too_many_prefixes_refused_before_the_first_dataset(repack) -> None:
    pytest.importorskip("megatron.core")
    from repack.errors import TooManyDatasets
    from repack.megatron import buildscope, dataset_class

    out, prefixes = repack
    cls = dataset_class(out)
    many = prefixes * (32767 // len(prefixes) + 1)
    with pytest.raises(TooManyDatasets):
        cls.build_low_level_dataset(many[0], _config(many))
    config = _config(list(prefixes))
    with buildscope.building():  # one build
        _views(cls, config, prefixes[:3])
        config.blend = (many, None)  # another blend, the same config: checked again
        with pytest.raises(TooManyDatasets):
            cls.build_low_level_dataset(many[3], config)


def test_find_searches_the_bucket_of_a_hash() -> None:
    """Rows sorted by hash, in buckets of their top bits: every row lies in its own bucket
    (the extreme hashes too), and find over thousands of strings is the first equal row."""
    extremes = np.array([-(2**63), 2**63 - 1, 0, -1, 1, 2**62, -(2**62)] * 3, np.int64)
    index = TextIndex(Texts([str(i) for i in range(len(extremes))]), extremes)
    for at, key in enumerate(index._hashes.tolist()):
        bucket = (key + 2**63) >> index._shift
        assert index._starts[bucket] <= at < index._starts[bucket + 1]
    rng = np.random.default_rng(5)
    values = [f"p/{n}" for n in rng.integers(0, 4000, 6000)]
    index = TextIndex(Texts(values))
    first: dict[str, int] = {}
    for row, value in enumerate(values):
        first.setdefault(value, row)
    asked = [*values, *(f"p/{n}" for n in range(4000, 4100))]
    assert [index.find(t) for t in asked] == [first.get(t) for t in asked]
    assert index.find_all(asked).tolist() == [first.get(t, -1) for t in asked]
