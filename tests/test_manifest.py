"""The manifest refuses what it does not understand or what would mislead a reader, with a
FormatError naming manifest.json; every crafted manifest here carries a valid self-checksum, so
only the structural checks can catch it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from repack.errors import FormatError
from repack.format import spec as fmt
from repack.format.manifest import dump_manifest, load_manifest
from repack.merge import merge
from repack.read.reader import Repack
from repack.synth import write_prefix


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("manifest")
    rng = np.random.default_rng(3)
    for name in ("a", "b"):
        sequences = [rng.integers(0, 1000, int(n)).astype(np.uint16) for n in (5, 900, 7)]
        write_prefix(root / "data" / name, sequences)
    (root / "blend.json").write_text('[1, "data/a", 2, "data/b"]')
    out = root / "out"
    merge(root / "blend.json", out, shard_size=4096)
    return out


def rewrite(out: Path, change: Callable[[dict], None], tmp_path: Path) -> Path:
    """A copy of ``out`` whose manifest was changed by ``change`` and re-checksummed."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in out.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    raw = json.loads((copy / fmt.MANIFEST_FILE).read_bytes())
    algorithm = raw.pop("checksum").split(":")[0]
    change(raw)
    (copy / fmt.MANIFEST_FILE).write_bytes(dump_manifest(raw, algorithm))
    return copy


def test_rewrite_without_change_is_accepted(pristine: Path, tmp_path: Path) -> None:
    copy = rewrite(pristine, lambda raw: None, tmp_path)
    assert load_manifest(copy).sources[1].name == "data/b"


def _set(path: tuple, value) -> Callable[[dict], None]:
    def change(raw: dict) -> None:
        target = raw
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set(("version",), 2), r"format version 2 is not supported .*upgrade repack"),
        (_set(("format",), "other"), r"format is 'other', expected 'repack'"),
        (_set(("index", "file"), "../index.rpx"), r"index.file is '\.\./index\.rpx', expected a "),
        (_set(("index", "file"), "other.rpx"), r"index.file is 'other.rpx', expected 'index.rpx'"),
        (_set(("shards", 0, "file"), "/etc/passwd"), r"shards\[0\]\.file is '/etc/passwd'"),
        (_set(("sources", 1, "segments", 0, "first"), 1), r"does not continue the source"),
        (_set(("sources", 0, "idx_size"), 35), r"idx_size is 35, which disagrees"),
        (_set(("sources", 0, "multimodal"), "yes"), r"multimodal is 'yes', expected true"),
        (_set(("sources", 0, "tokens"), -1), r"tokens is -1, expected an integer from 0"),
        # the sources are held in int64 columns: a larger integer is refused, not a crash
        (_set(("sources", 0, "tokens"), 2**64 + 5), r"tokens is 18446744073709551621, expected "),
        (_set(("blend",), {"form": "nope"}), r"blend: "),
        (_set(("checksum_algorithm",), "sha256"), r"the manifest's own checksum is not sha256"),
    ],
)
def test_structurally_wrong_manifest_is_refused(
    pristine: Path, tmp_path: Path, change, message: str
) -> None:
    copy = rewrite(pristine, change, tmp_path)
    with pytest.raises(FormatError, match=message) as caught:
        Repack(str(copy))
    assert str(caught.value).startswith(f"{copy / fmt.MANIFEST_FILE}: invalid manifest: ")


# --- entries serialize themselves -----------------------------------------------------------


def _roundtrip_cases(tmp_path: Path) -> dict[str, Path]:
    """A raw, a zstd-compressed and an appended repack, and the committed golden one."""
    from repack.merge.append import add
    from repack.synth import make_blend

    first = make_blend(tmp_path / "first", 6, seed=5, multimodal_fraction=0.3)
    more = make_blend(tmp_path / "more", 4, seed=6)
    cases = {"golden": Path(__file__).parent / "fixtures" / "golden" / "repack"}
    cases["raw"] = tmp_path / "raw"
    merge(first.flat_json, cases["raw"], shard_size=8192)
    cases["zstd"] = tmp_path / "zstd"
    merge(first.per_split_json, cases["zstd"], shard_size=8192, codec=("zstd", 5))
    cases["appended"] = tmp_path / "appended"
    merge(first.flat_json, cases["appended"], shard_size=8192, codec=("zstd", 1))
    add(cases["appended"], more.flat_json)
    return cases


def test_entries_serialize_back_to_the_same_manifest_bytes(tmp_path: Path) -> None:
    # add and remove rebuild the manifest from its entries: Manifest.to_json must give back
    # every member exactly, so that dump_manifest reproduces the file byte for byte
    for name, folder in _roundtrip_cases(tmp_path).items():
        data = (folder / fmt.MANIFEST_FILE).read_bytes()
        manifest = load_manifest(folder)
        raw = json.loads(data)
        assert [s.to_json() for s in manifest.shards] == raw["shards"], name
        assert [s.to_json() for s in manifest.sources] == raw["sources"], name
        assert manifest.index_json() == raw["index"], name
        assert dump_manifest(manifest.to_json(), manifest.algorithm) == data, name
    assert any(s.codec for s in load_manifest(folder).shards)  # the appended one: zstd
    assert load_manifest(folder).appended


def test_unknown_members_survive_the_roundtrip(pristine: Path, tmp_path: Path) -> None:
    copy = rewrite(pristine, _set(("future_member",), {"x": 1}), tmp_path)
    manifest = load_manifest(copy)
    assert manifest.to_json()["future_member"] == {"x": 1}


def test_the_same_manifest_bytes_are_parsed_once_whatever_path_names_them(
    pristine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader checks a repack (its path as given), then opens it (its real path): one parse.
    New bytes in the same file are parsed again."""
    import repack.format.manifest

    parsed = []
    real_parse = repack.format.manifest.parse_manifest
    monkeypatch.setattr(
        repack.format.manifest,
        "parse_manifest",
        lambda data, path: parsed.append(path) or real_parse(data, path),
    )
    out = rewrite(pristine, lambda raw: None, tmp_path)
    link = tmp_path / "link"
    link.symlink_to(out)
    first = load_manifest(out)
    assert load_manifest(link) is first
    assert load_manifest(str(out) + "/") is first
    assert len(parsed) == 1

    (tmp_path / "b").mkdir()
    changed_copy = rewrite(out, lambda raw: raw.update(created_by="someone else"), tmp_path / "b")
    (out / fmt.MANIFEST_FILE).write_bytes((changed_copy / fmt.MANIFEST_FILE).read_bytes())
    changed = load_manifest(link)
    assert changed is not first and changed.created_by == "someone else"
    assert len(parsed) == 2


def test_a_parse_sets_off_no_collection(tmp_path: Path) -> None:
    """The collector, paused over the parse, comes back with nothing due: the raw JSON is freed
    first. Held, it set off a collection at once (in a loader process, a full one: 0.17 s at
    30,000 sources)."""
    import gc

    from repack.format.manifest import parse_manifest
    from repack.synth import make_blend

    blend = make_blend(tmp_path / "src", 300, seed=2)
    merge(blend.flat_json, tmp_path / "out")
    data = (tmp_path / "out" / fmt.MANIFEST_FILE).read_bytes()
    started = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.collect()  # nothing counted before the parse
    gc.callbacks.append(record)
    try:
        manifest = parse_manifest(data, "manifest.json")
    finally:
        gc.callbacks.remove(record)
    assert len(manifest.sources) == 300
    assert started == []


def test_sources_in_columns_are_the_entries_they_were_parsed_from(pristine: Path) -> None:
    """The parsed manifest holds its sources and blend in columns; every entry made from them
    equals the one a writer makes, and equal manifests compare equal either way."""
    from repack.format.sources import EntryTable, SourceTable

    manifest = load_manifest(pristine)
    assert isinstance(manifest.sources, SourceTable)
    entries = tuple(manifest.sources)
    assert SourceTable.of(entries) == entries == manifest.sources
    assert manifest.sources[-1] == entries[-1] and manifest.sources[1:3] == entries[1:3]
    with pytest.raises(IndexError):
        manifest.sources[len(entries)]
    assert [s.to_json() for s in entries] == json.loads((pristine / "manifest.json").read_text())[
        "sources"
    ]
    for split in manifest.blend.splits.values():
        if split is not None:
            assert isinstance(split, EntryTable)
            assert EntryTable(tuple(split)) == tuple(split)


def test_a_prefix_is_found_as_the_scan_of_entries_found_it() -> None:
    """The first source that claims a name wins; a path is found normalized."""
    from repack.format.manifest import SegmentEntry, SourceEntry
    from repack.format.sources import SourceTable

    def source(i: int, path: str, prefixes: tuple[str, ...]) -> SourceEntry:
        segment = SegmentEntry(0, 0, 1, 0, 4, 0, "xxh3-64:0")
        return SourceEntry(i, path, prefixes, 8, False, i, 1, i, 2, 2, 4, 34, "c", "d", (segment,))

    table = SourceTable.of(
        [
            source(0, "/d/a", ("a", "x")),
            source(1, "/d/b", ("b", "x", "a")),
            source(2, "/d/ü", ("ü",)),
        ]
    )
    assert [table.find(p) for p in ("a", "b", "x", "ü", "/d/b", "/d//b/", "/d/ü", "c")] == [
        0, 1, 0, 2, 1, 1, 2, None,
    ]  # fmt: skip
    assert table[1].prefixes == ("b", "x", "a") and table[2].path == "/d/ü"


def test_what_a_read_takes_of_the_columns_is_the_entries() -> None:
    """``reading``, ``segment``, ``segment_at`` and the ``sequence_*s`` memoryviews (what every
    sample read takes, as Python integers without a numpy scalar) agree with the entries, and
    are made again for a table that was pickled."""
    import pickle

    from repack.format.manifest import SegmentEntry, SourceEntry
    from repack.format.sources import SourceTable

    def source(i: int, start: int, firsts: tuple[int, ...], count: int) -> SourceEntry:
        ends = (*firsts[1:], count)
        segments = tuple(
            SegmentEntry(i + k, first, end - first, 64 * k + i, 8 * (end - first), 8 * first, "c")
            for k, (first, end) in enumerate(zip(firsts, ends))
        )
        return SourceEntry(
            i, f"/d/{i}", (str(i),), 4 + i % 2, False, start, count, 2 * i, 2, 4 * count,
            8 * count, 34, "b", "c", segments,
        )  # fmt: skip

    entries = [source(0, 0, (0,), 3), source(1, 3, (0, 2, 5), 9), source(2, 12, (0, 1), 2)]
    assert SourceTable.of([]).sequence_counts.tolist() == []
    for table in (SourceTable.of(entries), pickle.loads(pickle.dumps(SourceTable.of(entries)))):
        rows = []
        for entry in entries:
            i = entry.id
            fields = table.reading(i)
            assert all(type(v) is int for v in fields)
            assert fields == (
                entry.dtype_code, entry.sequence_start, entry.sequence_count,
                int(table.segment_starts[i]), int(table.segment_ends[i]),
            )  # fmt: skip
            assert (table.sequence_starts[i], table.sequence_counts[i]) == fields[1:3]
            seg, seg_end = fields[3:]
            for k, segment in zip(range(seg, seg_end), entry.segments):
                found = table.segment(k)
                assert found == (segment.shard, segment.offset, segment.size, segment.source_offset)
                rows.append(found)
            for idx in range(entry.sequence_count):
                held = [s for s in entry.segments if s.first <= idx < s.first + s.count]
                assert (
                    table.segment(table.segment_at(seg, seg_end, idx))
                    == rows[seg + entry.segments.index(held[0])]
                )


def test_equal_texts_are_held_once(tmp_path: Path) -> None:
    """A manifest whose sources are named by their absolute paths, each source one segment,
    holds the paths once for the sources' paths, their prefixes and the blend's prefixes and
    paths, and each checksum once for the source and its segment (issue 44: three copies of
    every path, two of every checksum, in every process that opens the repack); the entries
    are the same."""
    from repack.format.sources import SourceTable

    prefixes = []
    for i in range(3):
        prefix = str(tmp_path / f"s{i}")
        write_prefix(prefix, [np.arange(1, 5 + i, dtype=np.uint16)], dtype=np.uint16)
        prefixes.append(prefix)
    (tmp_path / "blend.json").write_text(json.dumps(prefixes))
    merge(tmp_path / "blend.json", tmp_path / "out")
    manifest = load_manifest(tmp_path / "out")
    table = manifest.sources
    assert table.prefixes is table.path
    assert table.segment_checksum is table.bin_checksum
    assert type(table.bin_checksum).__name__ == "Digests"  # bytes, not hex text
    (split,) = [s for s in manifest.blend.splits.values() if s is not None]
    assert split.prefix is table.prefixes and split.path is table.path
    assert table.find(prefixes[1]) == 1 and table._lookup[0] is table._lookup[1]
    entries = tuple(table)
    assert SourceTable.of(entries) == entries
    assert [e.path for e in entries] == prefixes == [e.name for e in entries]
    assert [tuple(e.prefix for e in split), tuple(e.path for e in split)] == [tuple(prefixes)] * 2


def test_checksums_held_as_bytes_read_as_written() -> None:
    from repack.format.sources import Digests, Texts, _checksums

    values = ["xxh3-128:" + f"{i:032x}" for i in (0, 7, 2**127)]
    digests = Digests.of(values)
    assert digests is not None and len(digests._digests) == 3 * 16
    assert list(digests) == values and digests[-1] == values[-1] and len(digests) == 3
    with pytest.raises(IndexError):
        digests[3]
    for unlike in (
        [values[0], "sha256:" + "0" * 32],  # two algorithms
        [values[0], values[1][:-2]],  # two lengths
        ["xxh3-128:" + "AB" * 16],  # not as fromhex(...).hex() writes it
        ["xxh3-128:0 1"],  # a space fromhex would skip
        ["xxh3-128:abc"],  # odd
        ["no checksum"],
        [],
    ):
        assert Digests.of(unlike) is None
        column = _checksums(unlike)
        assert isinstance(column, Texts) and list(column) == unlike
    assert _checksums(list(values), digests) is digests


def _digests_by_value(values: list[str]) -> bytes | None:
    """The definition of what Digests.of takes, value by value: every value ``prefix:hex``
    with the first value's prefix and length, its hex in lowercase, as ``bytes.hex`` writes it;
    their digests joined."""
    if not values:
        return None
    prefix, colon, first = values[0].rpartition(":")
    if not colon or not first or len(first) % 2:
        return None
    found = []
    for value in values:
        head, hexes = value[: len(prefix) + 1], value[len(prefix) + 1 :]
        if len(value) != len(values[0]) or head != prefix + ":":
            return None
        try:
            digest = bytes.fromhex(hexes)
        except ValueError:
            return None
        if digest.hex() != hexes:
            return None
        found.append(digest)
    return b"".join(found)


def test_checksums_are_held_as_bytes_exactly_where_each_value_allows_it() -> None:
    """Digests.of checks a column at once: it takes the columns the value-by-value definition
    takes, and no other (random columns with one value changed)."""
    import random

    from repack.format.sources import Digests

    rng = random.Random(7)
    base = ["xxh3-128:" + f"{rng.getrandbits(128):032x}" for _ in range(6)]
    odd = (":", " ", "A", "f", "0", "g", "é", "\0", "x", "-", "\n")
    taken = 0
    for _ in range(3000):
        values = list(base)
        k = rng.randrange(len(values))
        value = values[k]
        at = rng.randrange(len(value))
        action = rng.random()
        if action < 0.6:
            value = value[:at] + rng.choice(odd) + value[at + 1 :]
        elif action < 0.8:
            value = value[:at] + value[at + 1 :] + rng.choice(odd)
        elif action < 0.9:
            value = value[:at] + rng.choice(odd) + value[at:]
        values[k] = value
        expected = _digests_by_value(values)
        found = Digests.of(values)
        assert (None if found is None else found._digests) == expected, values
        if found is not None:
            taken += 1
            assert list(found) == values
    assert 300 < taken < 2700, taken
