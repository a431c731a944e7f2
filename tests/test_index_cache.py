"""The consolidated index cache at many sources: a constant number of files, cold or warm.

A cold build has Megatron compute every dataset's indices in memory (its own functions, so the
samples are stock Megatron's) and writes them into one pack at the first sample: the cache
folder gets the same few files for 40 sources as for 400, where stock Megatron writes four per
source and split. Concurrent ranks on a cold shared cache, real processes, write one pack
between them and read identical samples; a stock cache is still used as is.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
from megatron_support import (
    GPTDataset,
    assert_same_samples,
    build,
    collect,
    digest,
    gpt_config,
    init_process_group,
    run_children,
    weights_for,
    write_flat_blend,
    write_sources,
)

import repack.cache.indexcache
from repack.cache.indexcache import CATALOG_FILE, LOCK_FILE, IndexCache
from repack.errors import FormatError
from repack.megatron import dataset_class
from repack.merge import merge

#: issue 10's blend: train only, 20 samples per source
SPLIT = "100,0,0"
SAMPLES_PER_SOURCE = 20


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> None:
    init_process_group()


def small_blend(root: Path, count: int) -> tuple[list[str], list[float], Path]:
    """``count`` sources of 4 to 12 sequences of 40 to 400 tokens, merged."""
    prefixes = write_sources(root, count, seed=count, sequences=(4, 12), tokens=(40, 400))
    weights = weights_for(prefixes, seed=count)
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes, weights), out)
    return prefixes, weights, out


def config(prefixes: list[str], weights: list[float], cache: Path, **kwargs):
    return gpt_config(prefixes, weights, split=SPLIT, cache=cache, **kwargs)


def sizes(prefixes: list[str]) -> list[int]:
    return [SAMPLES_PER_SOURCE * len(prefixes), 0, 0]


def forget_open_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Have the next build read the catalog from disk, as a new process would."""
    monkeypatch.setattr(repack.cache.indexcache, "_CACHES", {})


def forbid_index_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self):
        raise AssertionError(f"{self.unique_description_hash}: indices built, not a cache hit")

    monkeypatch.setattr(GPTDataset, "_build_document_sample_shuffle_indices", refuse)


def warm_build(
    monkeypatch: pytest.MonkeyPatch, out: Path, cfg: object, prefixes: list[str]
) -> list[list[dict]]:
    """The samples of a build, as a new process would make them, in which Megatron may not
    build any index (they must all come from the cache)."""
    forget_open_caches(monkeypatch)
    with monkeypatch.context() as patch:
        forbid_index_builds(patch)
        return collect(build(dataset_class(out), cfg, sizes(prefixes)))


def ours_files(cache: Path) -> list[str]:
    """The cache's files that are not ``BlendedDataset``'s own."""
    return sorted(f for f in os.listdir(cache) if "-BlendedDataset-" not in f)


@pytest.mark.slow
def test_cache_files_do_not_grow_with_the_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = {}
    for count in (40, 400):
        prefixes, weights, out = small_blend(tmp_path / f"b{count}", count)
        cache = tmp_path / f"cache-{count}"
        stock_cache = tmp_path / f"stock-{count}"
        ours = collect(build(dataset_class(out), config(prefixes, weights, cache), sizes(prefixes)))
        stock = collect(build(GPTDataset, config(prefixes, weights, stock_cache), sizes(prefixes)))
        assert_same_samples(stock, ours)
        assert len(ours[0]) >= SAMPLES_PER_SOURCE * count
        found[count] = sorted(os.listdir(cache))
        assert len(os.listdir(stock_cache)) == 4 * count + 3  # stock: 4 per source
        files = ours_files(cache)
        assert len(files) == 3, files
        assert {CATALOG_FILE, LOCK_FILE} < set(files)
        assert [f for f in files if f.endswith(".rpc")]
        catalog = json.loads((cache / CATALOG_FILE).read_text())
        assert len(catalog["entries"]) == count

        # warm: nothing built, nothing written, the same samples
        again = warm_build(monkeypatch, out, config(prefixes, weights, cache), prefixes)
        assert_same_samples(ours, again)
        assert sorted(os.listdir(cache)) == found[count]
    assert len(found[40]) == len(found[400]) <= 10


def test_cold_build_does_not_warn_per_dataset(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Megatron's "Unable to save ... path_to_cache is None", once per dataset computed in
    memory, is dropped; its other messages are not."""
    prefixes, weights, out = small_blend(tmp_path, 6)
    with caplog.at_level(logging.INFO):
        build(dataset_class(out), config(prefixes, weights, tmp_path / "c"), sizes(prefixes))
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if m.startswith("Unable to save")]
    assert [m for m in messages if m.startswith("Build and save the GPTDataset")]


@pytest.mark.slow
def test_concurrent_cold_ranks_write_one_pack(tmp_path: Path) -> None:
    """Two ranks of one gloo group (rank 0 builds first, as Megatron's builder does) and two
    independent processes, all at once on one cold cache folder: one pack, one catalog, and
    every process reads stock Megatron's samples."""
    prefixes, weights, out = small_blend(tmp_path, 60)
    stock_config = config(prefixes, weights, tmp_path / "s", attention_mask=False)  # as children
    stock = digest(collect(build(GPTDataset, stock_config, sizes(prefixes))))
    cache = tmp_path / "shared-cache"
    job = {
        "prefixes": prefixes,
        "weights": weights,
        "sizes": sizes(prefixes),
        "split": SPLIT,
        "sequence_length": 64,
        "cache": str(cache),
        "mmap": True,
        "repack": str(out),
        "watch": {"cache": str(cache)},
    }
    store = str(tmp_path / "gloo-store")
    ranks = [{**job, "rank": r, "world_size": 2, "store": store} for r in (0, 1)]
    children = run_children([*ranks, job, job], tmp_path / "jobs", parallel=4)
    results = [child.result for child in children]
    assert len(results) == 4
    for result in results:
        assert result["digest"] == stock
    files = ours_files(cache)
    assert len([f for f in files if f.endswith(".rpc")]) == 1, files
    assert not [f for f in files if ".tmp-" in f or "-GPTDataset-" in f], files
    catalog = json.loads((cache / CATALOG_FILE).read_text())
    assert len(catalog["entries"]) == 60


def test_stock_cache_found_in_one_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A stock cache is found without a stat per dataset, and packed: stock's ``.npy`` files
    are used as they are (no dataset is built)."""
    prefixes, weights, out = small_blend(tmp_path, 12)
    cache = tmp_path / "cache"
    stock = collect(build(GPTDataset, config(prefixes, weights, cache), sizes(prefixes)))
    stats = []
    real_stat = os.stat

    def counting_stat(path, *args, **kwargs):
        stats.append(os.fspath(path))
        return real_stat(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        forbid_index_builds(patch)
        patch.setattr(os, "stat", counting_stat)
        datasets = build(dataset_class(out), config(prefixes, weights, cache), sizes(prefixes))
    npy_stats = [p for p in stats if "-GPTDataset-" in p]
    assert not npy_stats, npy_stats[:4]
    assert_same_samples(stock, collect(datasets))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda r: r.rsplit(":", 2)[0] + ":|O:" + r.rsplit(":", 1)[1], "integer dtype"),
        (lambda r: r.rsplit(" ", 1)[0], "does not hold a pack and 3 arrays"),
        (lambda r: r.split(" ")[0] + " -64:" + r.split(":", 1)[1], "document_index.offset is -64"),
        (lambda r: r.rsplit(":", 1)[0] + ":8y2", "expected offset:dtype:shape"),
        (lambda r: "../x " + r.split(" ", 1)[1], "is not a plain file name"),
    ],
    ids=["object-dtype", "missing-array", "negative-offset", "bad-shape", "pack-path"],
)
def test_damaged_catalog_entry_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage, message: str
) -> None:
    prefixes, weights, out = small_blend(tmp_path, 4)
    cache = tmp_path / "cache"
    collect(build(dataset_class(out), config(prefixes, weights, cache), sizes(prefixes)))
    catalog = json.loads((cache / CATALOG_FILE).read_text())
    name = sorted(catalog["entries"])[1]
    catalog["entries"][name] = damage(catalog["entries"][name])
    (cache / CATALOG_FILE).write_text(json.dumps(catalog))
    forget_open_caches(monkeypatch)
    with pytest.raises(FormatError, match=f"{CATALOG_FILE}: entry '{name}'.*{re.escape(message)}"):
        build(dataset_class(out), config(prefixes, weights, cache), sizes(prefixes))


def as_version_1(record: str) -> dict:
    """A version-2 catalog record as version 1 wrote it (an object of objects and lists)."""
    pack, *arrays = record.split(" ")
    item: dict = {"pack": pack}
    for name, text in zip(("document_index", "sample_index", "shuffle_index"), arrays):
        offset, dtype, shape = text.split(":")
        item[name] = {
            "offset": int(offset),
            "dtype": dtype,
            "shape": [int(n) for n in shape.split("x")],
        }
    return item


def test_catalog_records_are_strings_and_version_1_catalogs_are_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records decode to strings only (nothing for the garbage collector to walk per entry);
    a catalog written by the previous version is a hit, and is rewritten as version 2 by the
    next build that adds to it."""
    prefixes, weights, out = small_blend(tmp_path, 6)
    cache = tmp_path / "cache"
    stock = collect(
        build(GPTDataset, config(prefixes, weights, tmp_path / "stock"), sizes(prefixes))
    )
    collect(build(dataset_class(out), config(prefixes, weights, cache), sizes(prefixes)))
    catalog = json.loads((cache / CATALOG_FILE).read_text())
    assert catalog["version"] == 2
    assert all(isinstance(r, str) for r in catalog["entries"].values()), catalog["entries"]

    old = {**catalog, "version": 1}
    old["entries"] = {n: as_version_1(r) for n, r in catalog["entries"].items()}
    (cache / CATALOG_FILE).write_text(json.dumps(old))
    again = warm_build(monkeypatch, out, config(prefixes, weights, cache), prefixes)
    assert_same_samples(stock, again)

    # another sequence length: new entries, so the catalog is written again, all in version 2
    forget_open_caches(monkeypatch)
    other = config(prefixes, weights, cache)
    other.sequence_length += 1
    collect(build(dataset_class(out), other, sizes(prefixes)))
    rewritten = json.loads((cache / CATALOG_FILE).read_text())
    assert rewritten["version"] == 2
    assert set(catalog["entries"]) < set(rewritten["entries"])
    assert {n: rewritten["entries"][n] for n in catalog["entries"]} == catalog["entries"]
    assert all(isinstance(r, str) for r in rewritten["entries"].values())


def test_catalog_of_an_unknown_version_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefixes, weights, out = small_blend(tmp_path, 3)
    cache = tmp_path / "cache"
    collect(build(dataset_class(out), config(prefixes, weights, cache), sizes(prefixes)))
    catalog = json.loads((cache / CATALOG_FILE).read_text())
    (cache / CATALOG_FILE).write_text(json.dumps({**catalog, "version": 3}))
    forget_open_caches(monkeypatch)
    with pytest.raises(FormatError, match=f"{CATALOG_FILE}: format 'repack-index-cache' version 3"):
        build(dataset_class(out), config(prefixes, weights, cache), sizes(prefixes))


def test_pack_shorter_than_its_catalog_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefixes, weights, out = small_blend(tmp_path, 4)
    cache = tmp_path / "cache"
    collect(build(dataset_class(out), config(prefixes, weights, cache), sizes(prefixes)))
    (pack,) = cache.glob("*.rpc")
    os.truncate(pack, 64)
    forget_open_caches(monkeypatch)
    train = build(dataset_class(out), config(prefixes, weights, cache), sizes(prefixes))[0]
    with pytest.raises(FormatError, match=f"{pack.name}: 64 bytes, the catalog places"):
        train[0]


def test_arrays_stay_in_memory_where_the_folder_cannot_be_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = IndexCache("/proc/no-such-folder/cache")
    arrays = (
        np.arange(5, dtype=np.int32),
        np.arange(8, dtype=np.int32).reshape(4, 2),
        np.arange(3, dtype=np.uint32),
    )
    entry = cache.add_arrays("x-GPTDataset-train", arrays)
    assert entry.sample_count == 3
    with caplog.at_level(logging.WARNING):
        got = cache.arrays("x-GPTDataset-train")
    assert all(a is b for a, b in zip(got, arrays))
    assert "cannot write the index cache" in caplog.text
    assert not cache.is_packed("x-GPTDataset-train")


@pytest.mark.parametrize("fraction", [0.0, 1e9], ids=["page-by-page", "read-around"])
def test_both_mmap_read_paths_read_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fraction: float
) -> None:
    """Large repacks are read page by page (``MADV_RANDOM`` + ``MADV_WILLNEED``), small ones
    with the kernel's read-around: the same bytes either way."""
    import repack.read.reader

    *_, out = small_blend(tmp_path, 8)
    monkeypatch.setattr(repack.read.reader, "EXACT_READS_ABOVE_RAM_FRACTION", fraction)
    opened = repack.read.reader.Repack(str(out))
    assert opened._exact_reads is (fraction == 0.0)
    reference = repack.read.reader.Repack(str(out), "pread")
    for source in opened.manifest.sources:
        for seg in source.segments:
            for start, size in ((0, seg.size), (seg.size // 3, 5), (seg.size - 7, 7)):
                got = opened.read(seg.shard, seg.offset + start, size, np.dtype(np.uint8))
                want = reference.read(seg.shard, seg.offset + start, size, np.dtype(np.uint8))
                assert np.array_equal(got, want)


def _random_read_flags(path: str) -> list[bool]:
    """Whether each mapping of ``path`` in this process is marked for random reads (``rr`` in
    ``/proc/self/smaps``: ``MADV_RANDOM``, no read-around on a fault)."""
    flags, current = [], None
    with open("/proc/self/smaps") as stream:
        for line in stream:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                current = fields[5] if len(fields) > 5 else None
            elif fields[0] == "VmFlags:" and current == path:
                flags.append("rr" in fields[1:])
    return flags


def test_forked_children_read_page_by_page(tmp_path: Path) -> None:
    """A small repack is read with the kernel's read-around in the process that opened it; a
    forked child (a DataLoader worker, one of several reading at random) reads it page by
    page, from its own mapping, and reads the same bytes; the parent's mapping is unchanged."""
    import repack.read.reader

    *_, out = small_blend(tmp_path, 8)
    opened = repack.read.reader.open_repack(str(out))
    seg = opened.manifest.sources[3].segments[0]
    want = bytes(opened.read(seg.shard, seg.offset, seg.size, np.dtype(np.uint8)))
    shard = os.path.realpath(opened.shard_path(seg.shard))
    assert not opened._exact_reads and _random_read_flags(shard) == [False]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports on one line, then leaves without pytest's clean-up
        try:
            got = bytes(opened.read(seg.shard, seg.offset, seg.size, np.dtype(np.uint8)))
            report = [opened._exact_reads, _random_read_flags(shard), got == want]
            os.write(write, json.dumps(report).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as stream:
        report = json.loads(stream.read())
    os.waitpid(pid, 0)
    assert report == [True, [True], True]
    assert not opened._exact_reads and _random_read_flags(shard) == [False]


# --- repack remove and the cache in OUT/cache ---------------------------------------------


def pack_tiles(pack: Path, entries: list[tuple[int, int]]) -> bool:
    """Whether the arrays ``(offset, nbytes)`` tile ``pack`` exactly (64-byte alignment apart):
    the file holds those arrays and nothing else."""
    position = 0
    for offset, nbytes in sorted(entries):
        if offset != -(-position // 64) * 64:
            return False
        position = offset + nbytes
    return pack.stat().st_size == max(position, 1)


def catalog_sources(catalog: dict) -> dict[str, str]:
    """The catalog's ``sources`` member (``NAME<tab>SOURCE`` lines) as a dict."""
    lines = catalog["sources"].split("\n")
    assert lines[-1] == ""
    return dict(line.split("\t") for line in lines[:-1])


def catalog_arrays(catalog: dict) -> dict[str, list[tuple[int, int]]]:
    """``{pack: [(offset, nbytes), ...]}`` of every array the catalog places."""
    placed: dict[str, list[tuple[int, int]]] = {}
    for record in catalog["entries"].values():
        pack, *arrays = record.split(" ")
        for text in arrays:
            offset, dtype, shape = text.split(":")
            count = int(np.prod([int(n) for n in shape.split("x")]))
            placed.setdefault(pack, []).append((int(offset), count * np.dtype(dtype).itemsize))
    return placed


@pytest.mark.slow
def test_remove_takes_the_sources_indices_out_of_the_loader_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs cached their indices in ``OUT/cache`` (``path_to_cache`` unset): the whole
    blend, with Megatron's own files too (``REPACK_NPY_CACHE=1``), and the blend without one
    source. ``repack remove`` of that source leaves no record, array or file of it in the
    cache, while the second run's warm build still hits and reads stock Megatron's samples."""
    from repack.merge.remove import remove

    prefixes, weights, out = small_blend(tmp_path, 12)
    gone = prefixes[3]
    rest = [p for p in prefixes if p != gone]
    rest_weights = [w for p, w in zip(prefixes, weights) if p != gone]
    cache = out / "cache" / "GPTDataset_indices"

    with monkeypatch.context() as patch:
        patch.setenv("REPACK_NPY_CACHE", "1")
        collect(build(dataset_class(out), config(prefixes, weights, None), sizes(prefixes)))
    forget_open_caches(monkeypatch)
    before = collect(build(dataset_class(out), config(rest, rest_weights, None), sizes(rest)))

    catalog = json.loads((cache / CATALOG_FILE).read_text())
    entries = len(catalog["entries"])
    assert 12 < entries <= 12 + 11  # the second build shares the datasets whose sizes it keeps
    assert set(catalog_sources(catalog)) == set(catalog["entries"])
    ours = {n for n, source in catalog_sources(catalog).items() if source == gone}
    assert len(ours) == 1  # premise: the cache holds the removed source's arrays
    descriptions = {
        f.name: json.loads(f.read_text())["dataset_path"] for f in cache.glob("*-description.txt")
    }
    assert gone in descriptions.values()  # and Megatron's own files of it

    forget_open_caches(monkeypatch)
    result = remove(out, [gone])
    assert result.cache.datasets == 2  # its packed entry and Megatron's files of it
    assert result.to_json()["cache_datasets_dropped"] == 2

    catalog = json.loads((cache / CATALOG_FILE).read_text())
    assert len(catalog["entries"]) == entries - 1
    assert not ours & set(catalog["entries"]) and gone not in catalog_sources(catalog).values()
    assert set(catalog_sources(catalog)) == set(catalog["entries"])
    placed = catalog_arrays(catalog)
    packs = sorted(f.name for f in cache.glob("pack-*"))
    assert packs == sorted(placed)  # no pack but those the catalog names (no temp files)
    for pack, arrays in placed.items():
        assert pack_tiles(cache / pack, arrays), pack  # nothing but the kept arrays
    for name in os.listdir(cache):
        assert not any(name.startswith(dataset) for dataset in ours), name
    left = [json.loads(f.read_text())["dataset_path"] for f in cache.glob("*-description.txt")]
    assert len(left) == 11 and gone not in left
    for path in cache.iterdir():
        assert gone.encode() not in path.read_bytes(), path.name

    # the remaining sources: a cache hit, nothing written, stock Megatron's samples
    files = sorted(os.listdir(cache))
    warm = warm_build(monkeypatch, out, config(rest, rest_weights, None), rest)
    assert_same_samples(before, warm)
    assert sorted(os.listdir(cache)) == files
    stock = collect(build(GPTDataset, config(rest, rest_weights, tmp_path / "stock"), sizes(rest)))
    assert_same_samples(stock, warm)


def test_drop_rewrites_packs_and_a_reader_of_the_old_catalog_finds_the_kept_arrays(
    tmp_path: Path,
) -> None:
    """``IndexCache.drop`` at the level of the cache: datasets of other sources are moved into
    a new pack, those of no recorded source dropped; a reader that read the catalog before
    and maps the pack after finds what was kept, and is told what is gone."""
    folder = str(tmp_path / "cache")
    rng = np.random.default_rng(0)
    arrays = {
        f"{name}-GPTDataset-train": tuple(
            rng.integers(0, 1000, n, dtype=np.int32) for n in (7, 9, 5)
        )
        for name in ("a", "b", "c")
    }
    writer = IndexCache(folder)
    writer.add_arrays("a-GPTDataset-train", arrays["a-GPTDataset-train"], "/src/a")
    writer.add_arrays("b-GPTDataset-train", arrays["b-GPTDataset-train"], "/src/b")
    writer.add_arrays("c-GPTDataset-train", arrays["c-GPTDataset-train"])  # source unknown
    writer.flush()
    (old_pack,) = [f for f in os.listdir(folder) if f.endswith(".rpc")]

    # two other processes, which read the catalog before the drop and map the pack after
    readers = [IndexCache(folder), IndexCache(folder)]
    for reader in readers:
        assert reader.is_packed("a-GPTDataset-train") and reader.is_packed("b-GPTDataset-train")

    dropped, deleted = IndexCache(folder).drop(lambda source: source == "/src/b")
    assert dropped == ["a-GPTDataset-train", "c-GPTDataset-train"]
    assert deleted == [old_pack]
    catalog = json.loads(Path(folder, CATALOG_FILE).read_text())
    assert list(catalog["entries"]) == ["b-GPTDataset-train"]
    assert catalog["sources"] == "b-GPTDataset-train\t/src/b\n"
    for pack, placed in catalog_arrays(catalog).items():
        assert pack != old_pack and pack_tiles(Path(folder, pack), placed)

    with pytest.raises(FormatError, match="cached indices of a-GPTDataset-train are gone"):
        readers[0].arrays("a-GPTDataset-train")
    for got, want in zip(readers[1].arrays("b-GPTDataset-train"), arrays["b-GPTDataset-train"]):
        assert np.array_equal(got, want)
    assert IndexCache(folder).drop(lambda source: source == "/src/b") == ([], [])  # idempotent


def test_catalog_records_in_columns_read_as_the_dict() -> None:
    """The catalog's records, held in columns, answer as the dict they were decoded to; a
    record set since wins, and a version-1 catalog (objects) stays a dict."""
    from repack.cache.index_records import Records

    decoded = {
        f"{i:032x}-GPTDataset-train": f"pack-a.rpc {64 * i}:<i4:3 0:<i4:2x2 0:<u4:1"
        for i in range(50)
    }
    records = Records.of(decoded)
    assert isinstance(records, Records)
    assert all(records.get(name) == item for name, item in decoded.items())
    assert records.get("missing") is None and records.get("missing", 7) == 7
    name = next(iter(decoded))
    records[name] = "pack-b.rpc 0:<i4:3 64:<i4:2x2 128:<u4:1"
    records["new"] = "pack-b.rpc 0:<i4:1 64:<i4:1x2 128:<u4:1"
    assert records.get(name).startswith("pack-b") and records.get("new").startswith("pack-b")
    assert dict(records.items()) == {**decoded, name: records.get(name), "new": records.get("new")}
    version1 = {"x": {"pack": "pack-a.rpc"}}
    assert Records.of(version1) is version1


def test_a_records_sample_count_is_read_as_parse_entry_reads_it() -> None:
    """A warm build reads each dataset's sample count with one regular expression: the same
    count as the full parse, and no count (the parse then names the damage) for a record the
    parse refuses."""
    from repack.cache.index_records import parse_entry, record_samples

    good = [
        "pack-a.rpc 0:<i4:12 64:<i4:9x2 192:<i4:8",
        "pack-a.rpc 0:|u1:0 64:<i8:1x2 192:<u4:0",
        "p 7:<i2:3 64:>i8:1 192:=u8:5",
    ]
    for record in good:
        assert record_samples(record) == parse_entry("x", record).sample_count
    bad = [
        "pack-a.rpc 0:<f4:12 64:<i4:9x2 192:<i4:8",  # not an integer dtype
        "pack-a.rpc 0:<i4:12 64:<i4:9x2",  # two arrays
        "../pack.rpc 0:<i4:12 64:<i4:9x2 192:<i4:8",  # not a plain file name
        ".. 0:<i4:12 64:<i4:9x2 192:<i4:8",
        "pack-a.rpc -1:<i4:12 64:<i4:9x2 192:<i4:8",
        "pack-a.rpc 0:<i4:12 64:<i4:9x2x3 192:<i4:8",  # three dimensions
        "pack-a.rpc 0:<i4:12 64:<i4:9x2 192:<i4:8 ",
    ]
    for record in bad:
        assert record_samples(record) is None, record
        with pytest.raises(ValueError):
            parse_entry("x", record)
    assert record_samples({"pack": "pack-a.rpc"}) is None  # version 1: parsed whole
