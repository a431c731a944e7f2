"""``repack add OUT BLEND`` appends new sources without touching what is there.

New sources land in new shards; existing shards keep their bytes, inode and mtime. The manifest
is replaced atomically: a reader opened before keeps reading the old repack correctly, one
opened after sees everything. Every source, old and new, extracts byte-identical; ``verify``,
``inspect`` and the loader see the new sources; sources already present are skipped or refused;
the committed golden repack (format version 1) accepts appends. An add killed at any point
leaves the repack as it was or as it is after the add, and running it again finishes it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from kill_support import fork_cli, run, tree

from repack.cli import main
from repack.errors import RepackError
from repack.format import spec as fmt
from repack.inputs.sources import read_source_index
from repack.read.extract import extract
from repack.read.reader import Repack
from repack.read.verify import verify
from repack.read.views import SourceDataset
from repack.synth import DemoBlend, make_blend

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
SHARD_SIZE = "16KiB"


def cli(*args: object):
    return CliRunner().invoke(main, [os.fspath(a) for a in args])


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    """The blend merged first: 30 sources."""
    return make_blend(tmp_path_factory.mktemp("append-first"), 30, seed=21)


@pytest.fixture(scope="module")
def more(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    """The blend added: 15 other sources, in another folder."""
    return make_blend(tmp_path_factory.mktemp("append-more"), 15, seed=22)


@pytest.fixture(scope="module")
def base(first: DemoBlend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``first`` merged into 16 KiB shards. Read-only: tests add to a copy."""
    out = tmp_path_factory.mktemp("append-base") / "out"
    result = cli("merge", "-q", "--shard-size", SHARD_SIZE, first.flat_json, out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def out(base: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "repack"
    shutil.copytree(base, copy)
    return copy


def shard_files(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Inode, mtime and bytes of every shard."""
    found = {}
    for path in sorted(folder.iterdir()):
        if fmt.is_shard_name(path.name):
            st = path.stat()
            found[path.name] = (st.st_ino, st.st_mtime_ns, path.read_bytes())
    return found


def assert_extracts_identical(folder: Path, prefixes: list[str], scratch: Path) -> None:
    """Every source named extracts to the bytes of its original prefix."""
    for i, prefix in enumerate(prefixes):
        dest = scratch / f"x{i}"
        extract(folder, prefix, dest, overwrite=True)
        original = Path(prefix) if os.path.isabs(prefix) else GOLDEN / "sources" / prefix
        for ext in (".bin", ".idx"):
            assert Path(f"{dest}{ext}").read_bytes() == Path(f"{original}{ext}").read_bytes(), (
                prefix,
                ext,
            )


def original_sequences(prefix: str) -> list[np.ndarray]:
    index = read_source_index(prefix)
    tokens = np.fromfile(prefix + ".bin", dtype=index.info.dtype)
    starts = index.pointers // index.info.dtype.itemsize
    return [tokens[s : s + n] for s, n in zip(starts.tolist(), index.lengths.tolist())]


def assert_reads_like_original(repack: Repack, prefix: str) -> None:
    source = repack.manifest.find_source(prefix)
    assert source is not None, prefix
    lengths, pointers, documents, _modes = repack.source_arrays(source)
    index = read_source_index(prefix)
    assert np.array_equal(lengths, index.lengths) and np.array_equal(pointers, index.pointers)
    assert np.array_equal(documents, index.documents)
    expected = original_sequences(prefix)
    data = np.concatenate(
        [
            repack.read(seg.shard, seg.offset, seg.size // source.dtype.itemsize, source.dtype)
            for seg in source.segments
        ]
    )
    assert np.array_equal(data, np.concatenate(expected)), prefix


# --- the add itself -------------------------------------------------------------------------


def test_add_writes_new_shards_and_leaves_old_ones_alone(
    first: DemoBlend, more: DemoBlend, out: Path, tmp_path: Path
) -> None:
    old_shards = shard_files(out)
    old_manifest = Repack(str(out)).manifest
    assert old_manifest.index_file == fmt.INDEX_FILE

    done = run(["add", "--json", out, more.per_split_json])  # a real process
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["sources"] == 15 and result["shards"] >= 2

    now = shard_files(out)
    assert {name: now[name] for name in old_shards} == old_shards  # bytes, inode, mtime
    new_names = sorted(set(now) - set(old_shards))
    assert new_names == [fmt.shard_name(len(old_shards) + k) for k in range(result["shards"])]
    manifest = Repack(str(out)).manifest
    assert manifest.index_file == "index-1.rpx"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [fmt.MANIFEST_FILE, "index-1.rpx", "fingerprints-1.rpf", *now]
    )  # the old index and fingerprints are gone, no work folder or temp file is left
    assert [s.path for s in manifest.sources[:30]] == [s.path for s in old_manifest.sources]
    assert [s.id for s in manifest.sources] == list(range(45))
    assert manifest.shards[: len(old_shards)] == old_manifest.shards
    assert manifest.sources[:30] == old_manifest.sources
    assert manifest.blend == old_manifest.blend
    assert len(manifest.appended) == 1 and manifest.appended[0].form == "per-split-data-args"

    report = verify(out, sources=True)
    assert report.ok, [str(p) for p in report.problems]
    assert report.sources == 45 and report.originals_compared == 45
    assert_extracts_identical(out, [*first.prefixes, *more.prefixes], tmp_path / "x")


def test_a_reader_opened_before_keeps_reading_the_old_repack(
    first: DemoBlend, more: DemoBlend, out: Path
) -> None:
    before = {backend: Repack(str(out), backend) for backend in ("mmap", "pread")}
    # one shard already opened, the others opened only after the add
    before["mmap"].read(0, 0, 1, np.uint8)
    assert cli("add", "-q", out, more.flat_json).exit_code == 0
    for repack in before.values():
        assert len(repack.manifest.sources) == 30
        for prefix in first.prefixes:
            assert_reads_like_original(repack, prefix)
        repack.close()
    after = Repack(str(out))
    assert len(after.manifest.sources) == 45
    for prefix in (*first.prefixes, *more.prefixes):
        assert_reads_like_original(after, prefix)


def test_the_loader_reads_the_new_sources(more: DemoBlend, out: Path) -> None:
    assert cli("add", "-q", out, more.flat_json).exit_code == 0
    written = json.loads(more.flat_json.read_text())[1::2]  # as the blend writes them
    assert any(not os.path.isabs(p) for p in written)
    for prefix, name in zip(more.prefixes, written):
        multimodal = prefix in more.multimodal
        dataset = SourceDataset(str(out), prefix, multimodal=multimodal)
        expected = original_sequences(prefix)
        assert len(dataset) == len(expected)
        index = read_source_index(prefix)
        for i, sequence in enumerate(expected):
            item = dataset[i]
            tokens = item[0] if multimodal else item
            assert np.array_equal(tokens, sequence)
            if multimodal:
                assert item[1] == index.modes[i]
        assert np.array_equal(dataset.document_indices, index.documents)
        assert out.joinpath(fmt.MANIFEST_FILE).exists() and name


def test_inspect_lists_the_added_blend(more: DemoBlend, out: Path) -> None:
    assert cli("add", "-q", out, more.per_split_json).exit_code == 0
    per_split = json.loads(more.per_split_json.read_text())
    expected: dict[str, list[dict]] = {}
    for split in ("train", "valid", "test"):
        items = per_split[split]
        for weight, prefix in zip(items[0::2], items[1::2]):
            expected.setdefault(prefix, []).append({"split": split, "weight": weight})
    result = cli("inspect", "--json", out)
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["totals"]["sources"] == 45
    found = {s["path"]: s["splits"] for s in info["sources"][30:]}
    assert found == expected
    text = cli("inspect", out).stdout
    assert any(
        line.split()[2].startswith(("train:", "valid:", "test:"))
        for line in text.splitlines()[31:46]
    )


def test_sources_already_there_are_skipped(first: DemoBlend, more: DemoBlend, out: Path) -> None:
    items: list[object] = []
    for prefix in (*first.prefixes[:5], *more.prefixes):
        items += [0.5, prefix]
    blend = out.parent / "mixed.json"
    blend.write_text(json.dumps(items))
    result = cli("add", "--json", out, blend)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sources"] == 15
    manifest = Repack(str(out)).manifest
    paths = [s.path for s in manifest.sources]
    assert len(paths) == len(set(paths)) == 45
    info = json.loads(cli("inspect", "--json", out).stdout)
    splits = {s["path"]: s["splits"] for s in info["sources"]}
    # a source in both blends shows both uses
    assert len(splits[first.prefixes[0]]) == 2 and len(splits[more.prefixes[0]]) == 1


def test_nothing_new_is_refused(first: DemoBlend, out: Path) -> None:
    before = tree(out)
    result = cli("add", out, first.per_split_json)
    assert result.exit_code == 3 and not result.stdout
    assert result.stderr == (
        f"Error: {first.per_split_json}: every source of this blend is already in {out}\n"
    )
    assert tree(out) == before


def _grow_last_sequence(prefix: str) -> None:
    """One more token in the last sequence: a valid source, with other content."""
    index = read_source_index(prefix)
    with open(prefix + ".bin", "ab") as stream:
        stream.write(bytes(index.info.dtype.itemsize))
    idx = bytearray(Path(prefix + ".idx").read_bytes())
    last = fmt.MEGATRON_HEADER_SIZE + 4 * (index.info.sequence_count - 1)
    length = int.from_bytes(idx[last : last + 4], "little")
    idx[last : last + 4] = (length + 1).to_bytes(4, "little")
    Path(prefix + ".idx").write_bytes(bytes(idx))


def test_a_source_there_with_other_content_is_refused(tmp_path: Path) -> None:
    old = make_blend(tmp_path / "old", 4, seed=3)
    new = make_blend(tmp_path / "new", 2, seed=4)
    out = tmp_path / "out"
    assert cli("merge", "-q", old.flat_json, out).exit_code == 0
    _grow_last_sequence(old.prefixes[1])
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps([1, new.prefixes[0], 1, old.prefixes[1], 1, new.prefixes[1]]))
    before = tree(out)
    result = cli("add", out, blend)
    assert result.exit_code == 3 and not result.stdout
    assert result.stderr.startswith(f"Error: {old.prefixes[1]}: already in {out} with other ")
    assert result.stderr.count("\n") == 1
    assert tree(out) == before


def test_add_names_every_bad_source_at_once(tmp_path: Path) -> None:
    """A held source changed and a held one gone, a new one missing: one error, three lines."""
    old = make_blend(tmp_path / "old", 4, seed=3)
    new = make_blend(tmp_path / "new", 2, seed=4)
    out = tmp_path / "out"
    assert cli("merge", "-q", old.flat_json, out).exit_code == 0
    _grow_last_sequence(old.prefixes[1])
    os.unlink(old.prefixes[2] + ".idx")
    blend = tmp_path / "blend.json"
    items = [1, old.prefixes[1], 1, new.prefixes[0], 1, old.prefixes[2], 1, f"{new.prefixes[1]}x"]
    blend.write_text(json.dumps(items))
    before = tree(out)
    result = cli("add", out, blend)
    assert result.exit_code == 3 and not result.stdout
    lines = result.stderr.splitlines()
    assert lines[0] == f"Error: {blend}: 3 of 4 sources cannot be used; nothing was written:"
    assert lines[1].startswith(f"  {old.prefixes[1]}: already in {out} with other content")
    assert lines[2] == f"  {old.prefixes[2]}.idx: .idx file not found"
    assert lines[3] == f"  {new.prefixes[1]}x.idx: .idx file not found"
    assert len(lines) == 4
    assert tree(out) == before


def test_two_adds(first: DemoBlend, more: DemoBlend, out: Path, tmp_path: Path) -> None:
    third = make_blend(tmp_path / "third", 5, seed=23)
    assert cli("add", "-q", out, more.flat_json).exit_code == 0
    assert cli("add", "-q", out, third.data_args_txt).exit_code == 0
    manifest = Repack(str(out)).manifest
    assert manifest.index_file == "index-2.rpx" and len(manifest.appended) == 2
    assert not (out / "index-1.rpx").exists() and not (out / fmt.INDEX_FILE).exists()
    assert verify(out).ok
    assert_extracts_identical(out, [first.prefixes[0], more.prefixes[3], *third.prefixes], tmp_path)


def test_add_with_workers_writes_the_same_bytes(
    more: DemoBlend, base: Path, tmp_path: Path
) -> None:
    one, three = tmp_path / "one", tmp_path / "three"
    shutil.copytree(base, one)
    shutil.copytree(base, three)
    assert cli("add", "-q", one, more.flat_json).exit_code == 0
    done = run(["add", "-q", "--workers", "3", three, more.flat_json])
    assert done.returncode == 0, done.stderr
    assert tree(one) == tree(three)


def test_add_to_the_golden_repack(tmp_path: Path) -> None:
    """Repacks written by older versions stay readable, and extensible."""
    out = tmp_path / "golden"
    shutil.copytree(GOLDEN / "repack", out)
    old_shards = shard_files(out)
    new = make_blend(tmp_path / "new", 8, seed=24)
    result = cli("add", "--json", out, new.flat_json)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sources"] == 8
    now = shard_files(out)
    assert {name: now[name][2] for name in old_shards} == {
        name: data for name, (_, _, data) in old_shards.items()
    }
    report = verify(out)
    assert report.ok, [str(p) for p in report.problems]
    golden = json.loads((GOLDEN / "sources" / "blend.json").read_text())[1::2]
    assert_extracts_identical(out, [*golden, *new.prefixes], tmp_path / "x")
    info = json.loads(cli("inspect", "--json", out).stdout)
    assert info["totals"]["sources"] == 14 and info["created_by"] == "repack 0.1.0"


def test_add_to_a_folder_that_is_not_a_repack(more: DemoBlend, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = cli("add", tmp_path / "empty", more.flat_json)
    assert result.exit_code == 3 and "manifest.json: not found" in result.stderr
    assert list((tmp_path / "empty").iterdir()) == []


# --- an add killed at every step ------------------------------------------------------------


def test_add_killed_before_every_mutation_then_run_again(tmp_path: Path) -> None:
    old = make_blend(tmp_path / "old", 4, seed=3)
    new = make_blend(tmp_path / "new", 4, seed=5)
    base = tmp_path / "base"
    assert cli("merge", "-q", "--shard-size", "12KiB", old.flat_json, base).exit_code == 0
    before = tree(base)
    expected_dir = tmp_path / "expected"
    shutil.copytree(base, expected_dir)
    status, points = fork_cli(["add", "-q", expected_dir, new.flat_json])
    assert status == 0 and points > 20
    expected = tree(expected_dir)
    out = tmp_path / "out"
    for point in range(1, points + 1):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(base, out)
        status, _ = fork_cli(["add", "-q", out, new.flat_json], kill_at=point)
        context = f"killed before mutation {point} of {points}"
        assert status == -signal.SIGKILL, context
        # the repack is always complete: the old one, or the new one
        try:
            repack = Repack(str(out))
        except RepackError as err:
            pytest.fail(f"{context}: {err}")
        files = tree(out)
        now = before if len(repack.manifest.sources) == 4 else expected
        assert files[fmt.MANIFEST_FILE] == now[fmt.MANIFEST_FILE], context
        for name in [
            repack.manifest.index_file,
            *(s.file for s in repack.manifest.shards),
        ]:
            assert files[name] == now[name], f"{context}: {name}"
        repack.close()
        assert verify(out).ok, context
        status, _ = fork_cli(["add", "-q", out, new.flat_json])
        assert status == 0 or (status == 3 and now is expected), context
        found = tree(out)
        assert found == expected, (
            f"{context}: extra {sorted(set(found) - set(expected))}, "
            f"missing {sorted(set(expected) - set(found))}"
        )
