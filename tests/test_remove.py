"""``repack remove OUT SOURCE...`` takes sources out of a repack, and their bytes out of its files.

After a remove the removed sources' bytes are in no file of OUT (every file searched for long
byte strings of theirs that no remaining source holds, in the decompressed content of
compressed shards too, and the search shown able to find them before); ``verify`` and
``verify --sources`` pass; every remaining source extracts byte-identical; ``inspect`` shows
the new totals; ``add`` works again (the removed sources can come back); the Megatron loader
gives stock Megatron's samples over the remaining prefixes. All on raw, zstd-compressed and
appended repacks. A process that opened the repack before keeps reading it. A remove killed
before every file-system step leaves the old or the new repack, and running it again finishes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from kill_support import fork_cli, run, start_caught, tree
from megatron_support import (
    GPTDataset,
    assert_same_samples,
    build,
    collect,
    gpt_config,
    init_process_group,
)

from repack.cli import main
from repack.errors import UnknownSource
from repack.format import spec as fmt
from repack.format.codec import CompressedShard
from repack.format.manifest import load_manifest
from repack.megatron import dataset_class
from repack.merge import merge
from repack.merge.append import add
from repack.read.extract import extract
from repack.read.reader import Repack
from repack.read.verify import verify
from repack.store.lock import LOCK_FILE
from repack.synth import DemoBlend, make_blend

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
KINDS = ("raw", "zstd", "appended")
SHARD_SIZE = 12 * 1024
#: Length of the byte strings searched for: long enough that no other data holds one by chance.
NEEDLE = 64


def cli(*args: object):
    return CliRunner().invoke(main, [os.fspath(a) for a in args])


def original(prefix: str) -> tuple[bytes, bytes]:
    return Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes()


# --- searching every file of a folder for bytes ---------------------------------------------


def needles(removed: list[str], kept: list[str], per_source: int = 12) -> list[bytes]:
    """Byte strings of the removed sources' ``.bin`` files that no kept source holds:
    ``per_source`` pieces of ``NEEDLE`` bytes spread over each file, its first and last
    included, or the whole file if shorter (at least 16 bytes)."""
    kept_bins = [original(p)[0] for p in kept]
    found = []
    for prefix in removed:
        data = original(prefix)[0]
        if len(data) <= NEEDLE:
            pieces = [data]
        else:
            starts = np.linspace(0, len(data) - NEEDLE, per_source).astype(int)
            pieces = [data[i : i + NEEDLE] for i in sorted(set(starts.tolist()))]
        for piece in pieces:
            if len(piece) >= 16 and piece.strip(b"\0") and not any(piece in k for k in kept_bins):
                found.append(piece)
    return found


def _decompressed(path: Path) -> bytes:
    """The logical bytes of a compressed shard file (its trailer gives the size)."""
    data = path.read_bytes()
    magic, _, _, logical = struct.unpack("<8sQQQ", data[-32:])
    assert magic == b"RPKZSTD\0"
    shard = CompressedShard(str(path), logical)
    try:
        return bytes(shard.read(0, logical))
    finally:
        shard.close()


def haystacks(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (the loader's cache and leftovers included), and the
    decompressed content of every compressed shard."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            name = str(path.relative_to(folder))
            found[name] = path.read_bytes()
            if path.name.endswith(".zst") and fmt.is_shard_name(path.name):
                found[name + " (decompressed)"] = _decompressed(path)
    return found


def where_found(folder: Path, pieces: list[bytes]) -> list[str]:
    return [name for name, data in haystacks(folder).items() if any(p in data for p in pieces)]


# --- the golden repack ----------------------------------------------------------------------


def golden_prefixes() -> list[str]:
    return json.loads((GOLDEN / "sources" / "blend.json").read_text())[1::2]


def test_remove_from_the_golden_repack(tmp_path: Path) -> None:
    out = tmp_path / "golden"
    shutil.copytree(GOLDEN / "repack", out)
    sources = GOLDEN / "sources"
    gone = ["web/cc-00000", "big/long-0000"]  # shares shard 0; alone in shards 2 and 3
    kept = [p for p in golden_prefixes() if p not in gone]
    pieces = needles([str(sources / p) for p in gone], [str(sources / p) for p in kept])
    assert len(pieces) == 12 + 1  # big/long-0000's 10 000 bytes, web/cc-00000's 18
    assert set(where_found(out, pieces)) == {
        "shard-00000.bin",
        "shard-00002.bin",
        "shard-00003.bin",
    }
    untouched = {n: (out / n).stat() for n in ("shard-00001.bin", "shard-00004.bin")}

    dry = cli("remove", "--dry-run", out, *gone)
    assert dry.exit_code == 0, dry.output
    assert "shard-00000.bin  shard-00005.bin" in dry.output and "(dropped)" in dry.output
    assert sorted(os.listdir(out)) == sorted(os.listdir(GOLDEN / "repack"))  # wrote nothing

    result = cli("remove", "--json", "-q", out, *gone)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["removed"] == gone and report["remaining_sources"] == 4
    assert report["removed_bytes"] == 18 + 10_000
    assert where_found(out, pieces) == []
    manifest = load_manifest(out)
    assert [s.file for s in manifest.shards] == [
        "shard-00005.bin",  # shard 0 rewritten without web/cc-00000
        "shard-00001.bin",
        "shard-00004.bin",  # shards 2 and 3 (big/long-0000 only) dropped
    ]
    assert manifest.index_file == "index-1.rpx"
    assert sorted(os.listdir(out)) == [
        "index-1.rpx",
        "manifest.json",
        "shard-00001.bin",
        "shard-00004.bin",
        "shard-00005.bin",
    ]
    assert [s.name for s in manifest.sources] == kept
    assert [s.id for s in manifest.sources] == [0, 1, 2, 3]
    assert {p for b in manifest.blends for e in b.splits["all"] for p in [e.prefix]} == set(kept)
    for name, before in untouched.items():
        after = (out / name).stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert cli("verify", "-q", out).exit_code == 0
    totals = json.loads(cli("inspect", "--json", out).output)["totals"]
    assert (totals["sources"], totals["shards"], totals["tokens"]) == (4, 3, 5028 - 9 - 5000)
    for prefix in kept:
        extract(out, prefix, tmp_path / "x", overwrite=True)
        assert original(str(tmp_path / "x")) == original(str(sources / prefix)), prefix


# --- a 300-source blend, three kinds of repack ------------------------------------------------


def write_blend(path: Path, blend: DemoBlend, indices) -> Path:
    items = [x for i in indices for x in (blend.weights[i], blend.prefixes[i])]
    path.write_text(json.dumps(items))
    return path


def build_kind(kind: str, blend: DemoBlend, out: Path) -> None:
    if kind == "appended":  # 200 sources merged raw, 100 added
        merge(write_blend(out.parent / "first.json", blend, range(200)), out, shard_size=SHARD_SIZE)
        add(out, write_blend(out.parent / "more.json", blend, range(200, 300)))
    else:
        codec = ("zstd", 3) if kind == "zstd" else None
        merge(blend.flat_json, out, shard_size=SHARD_SIZE, codec=codec)


def chosen(blend: DemoBlend, out: Path) -> list[str]:
    """Sources to remove: a multimodal one, the largest (cut across shards), two of the
    appended part, and a few more; absolute prefixes."""
    manifest = load_manifest(out)
    largest = max(manifest.sources, key=lambda s: s.bin_size)
    assert len(largest.segments) > 1  # premise: it is cut across shards
    picks = {blend.multimodal[0], largest.path, blend.prefixes[205], blend.prefixes[290]}
    picks |= {blend.prefixes[i] for i in (3, 17, 42, 99, 150, 151)}
    return sorted(picks)


@pytest.fixture(scope="module")
def removed(
    demo_blend: DemoBlend, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, list[str], dict[str, bytes], set[str]]]:
    """Each kind of repack after a remove: (folder, removed prefixes, what a reader opened
    before the remove read afterwards, by prefix, the files of the rewritten shards)."""
    done = {}
    for kind in KINDS:
        out = tmp_path_factory.mktemp(f"remove-{kind}") / "out"
        build_kind(kind, demo_blend, out)
        gone = chosen(demo_blend, out)
        kept = [p for p in demo_blend.prefixes if p not in gone]
        pieces = needles(gone, kept)
        assert len(pieces) > 8 * len(gone)
        assert where_found(out, pieces), kind  # the search finds them before the remove
        before = Repack(str(out), backend="pread")  # a reader that opened the repack before
        result = cli("remove", "-q", "--json", out, *gone)
        assert result.exit_code == 0, result.output
        rewritten = json.loads(result.output)["rewritten"]
        new_files = {s["new_file"] for s in rewritten if s["new_file"]}
        assert new_files and len(new_files) < len(rewritten)  # some rewritten, some dropped
        assert where_found(out, pieces) == [], kind
        read_before = {}
        for source in before.manifest.sources:
            parts = [bytes(before.read_bytes(s.shard, s.offset, s.size)) for s in source.segments]
            read_before[source.path] = b"".join(parts)
        before.close()
        done[kind] = (out, gone, read_before, new_files)
    return done


@pytest.mark.parametrize("kind", KINDS)
def test_removed_bytes_are_gone_and_the_rest_is_intact(
    kind: str, removed: dict, demo_blend: DemoBlend, tmp_path: Path
) -> None:
    out, gone = removed[kind][:2]
    assert cli("verify", "-q", out).exit_code == 0
    manifest = load_manifest(out)
    assert len(manifest.sources) == 300 - len(gone)
    assert not any(manifest.find_source(p) for p in gone)
    info = json.loads(cli("inspect", "--json", out).output)
    tokens = sum(np.fromfile(p + ".bin", dtype=_dtype(p)).size for p in demo_blend.prefixes)
    gone_tokens = sum(np.fromfile(p + ".bin", dtype=_dtype(p)).size for p in gone)
    assert info["totals"]["sources"] == 300 - len(gone)
    assert info["totals"]["tokens"] == tokens - gone_tokens
    for source in manifest.sources:
        extract(out, source.path, tmp_path / "x", overwrite=True)
        assert original(str(tmp_path / "x")) == original(source.path), source.path


def _dtype(prefix: str) -> np.dtype:
    return fmt.dtype_from_code(Path(prefix + ".idx").read_bytes()[17])


@pytest.mark.parametrize(
    "kind",
    [
        "raw",
        "zstd",
        "appended",
    ],
)
def test_verify_sources_after_remove(kind: str, removed: dict) -> None:
    out = removed[kind][0]
    result = cli("verify", "-q", "--sources", out)
    assert result.exit_code == 0, result.output
    assert "originals compared byte for byte" in result.output


@pytest.mark.parametrize("kind", KINDS)
def test_a_reader_opened_before_kept_reading(kind: str, removed: dict, demo_blend) -> None:
    read_before = removed[kind][2]
    assert len(read_before) == 300
    for prefix in demo_blend.prefixes:  # the removed sources too
        assert read_before[prefix] == original(prefix)[0], prefix


@pytest.mark.parametrize("kind", KINDS)
def test_add_after_remove_brings_them_back(
    kind: str, removed: dict, demo_blend: DemoBlend, tmp_path: Path
) -> None:
    folder, gone = removed[kind][:2]
    out = tmp_path / "out"
    shutil.copytree(folder, out)
    indices = [demo_blend.prefixes.index(p) for p in gone]
    result = cli("add", "-q", out, write_blend(tmp_path / "back.json", demo_blend, indices))
    assert result.exit_code == 0, result.output
    manifest = load_manifest(out)
    assert len(manifest.sources) == 300
    files = [s.file for s in manifest.shards]
    assert len(set(files)) == len(files)
    assert cli("verify", "-q", out).exit_code == 0
    for prefix in gone:
        extract(out, prefix, tmp_path / "x", overwrite=True)
        assert original(str(tmp_path / "x")) == original(prefix), prefix


@pytest.mark.parametrize("kind", KINDS)
def test_the_loader_after_remove_gives_the_stock_samples(
    kind: str, removed: dict, demo_blend: DemoBlend, tmp_path: Path
) -> None:
    init_process_group()
    out, gone = removed[kind][:2]
    new_files = removed[kind][3]
    manifest = load_manifest(out)
    # 24 remaining sources with tokens in every document (Megatron loops forever on a
    # dataset without tokens), those in rewritten shards first
    rewritten = {n for n, s in enumerate(manifest.shards) if s.file in new_files}
    usable = [s for s in manifest.sources if s.token_count >= 500 and s.document_count >= 3]
    in_new = [s.path for s in usable if {g.shard for g in s.segments} & rewritten]
    assert in_new
    prefixes = (in_new + [s.path for s in usable if s.path not in in_new])[:24]
    weights = [1.0 + i % 3 for i in range(len(prefixes))]
    sizes = [300, 0, 0]
    kwargs = dict(seed=3, split="100,0,0")
    config = gpt_config(prefixes, weights, cache=tmp_path / "stock-cache", **kwargs)
    stock = collect(build(GPTDataset, config, sizes))
    assert len(stock[0]) >= 300
    config = gpt_config(prefixes, weights, cache=tmp_path / "repacked-cache", **kwargs)
    assert_same_samples(stock, collect(build(dataset_class(out), config, sizes)))
    config = gpt_config([gone[0], prefixes[0]], [1.0, 1.0], cache=tmp_path / "c2", **kwargs)
    with pytest.raises(UnknownSource, match="repack inspect"):
        build(dataset_class(out), config, sizes)


# --- bad requests ---------------------------------------------------------------------------


@pytest.fixture
def golden(tmp_path: Path) -> Path:
    out = tmp_path / "golden"
    shutil.copytree(GOLDEN / "repack", out)
    return out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no/such-source"], "'no/such-source': not a source of this repack"),
        (golden_prefixes(), "that is every source of the repack (6)"),
        ([], "name the sources to remove"),
    ],
    ids=["unknown", "every-source", "nothing"],
)
def test_refused_requests_change_nothing(golden: Path, args: list[str], message: str) -> None:
    before = tree(golden)
    result = run(["remove", "-q", golden, *args])
    assert result.returncode == 3
    assert result.stderr.startswith(f"Error: {golden}" if args else "Error: ")
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert tree(golden) == before


def test_not_a_repack(tmp_path: Path) -> None:
    result = run(["remove", tmp_path / "nothing", "a"])
    assert result.returncode == 3 and "Error: " in result.stderr
    assert "not a complete repack" in result.stderr or "not found" in result.stderr


def test_remove_by_blend_file(golden: Path, tmp_path: Path) -> None:
    # the golden manifest holds the paths of the machine that merged it: the blend's entry
    # is found by its prefix as written, after its absolute path
    blend = tmp_path / "withdrawn.json"
    blend.write_text(json.dumps(["mm/obelics-0000"]))
    before = load_manifest(golden)
    result = cli("remove", "-q", golden, "--blend", blend)
    assert result.exit_code == 0, result.output
    manifest = load_manifest(golden)
    assert [s.name for s in manifest.sources] == [
        s.name for s in before.sources if s.name != "mm/obelics-0000"
    ]
    assert cli("verify", "-q", golden).exit_code == 0


# --- concurrent writers and crashes -------------------------------------------------------------


def test_add_during_a_remove_is_refused_and_the_reverse(
    removed: dict, demo_blend: DemoBlend, tmp_path: Path
) -> None:
    folder, gone = removed["raw"][:2]
    out = tmp_path / "out"
    shutil.copytree(folder, out)
    back = write_blend(
        tmp_path / "back.json", demo_blend, [demo_blend.prefixes.index(p) for p in gone]
    )
    keep = [s.path for s in load_manifest(out).sources]
    remover = start_caught(["remove", "-q", out, *keep[:150]], out / LOCK_FILE)
    try:
        refused = run(["add", "-q", out, back])
        assert refused.returncode == 3
        assert f"another repack command is writing here: pid {remover.pid}" in refused.stderr
        assert "remove -q" in refused.stderr
    finally:
        os.kill(remover.pid, signal.SIGCONT)
        remover.communicate(timeout=300)
    assert remover.returncode == 0
    adder = start_caught(["add", "-q", out, back], out / LOCK_FILE)
    try:
        refused = run(["remove", "-q", out, keep[-1]])
        assert refused.returncode == 3
        assert f"pid {adder.pid}" in refused.stderr and "add -q" in refused.stderr
    finally:
        os.kill(adder.pid, signal.SIGCONT)
        adder.communicate(timeout=300)
    assert adder.returncode == 0
    assert cli("verify", "-q", out).exit_code == 0


def repack_tree(folder: Path) -> dict:
    """The files of the repack: without the lock file a killed writer leaves."""
    return {k: v for k, v in tree(folder).items() if k != LOCK_FILE}


@pytest.fixture(scope="module")
def small_zstd(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("remove-kill-zstd")
    blend = make_blend(root / "src", 12, seed=31)
    out = root / "out"
    merge(blend.flat_json, out, shard_size=8192, codec=("zstd", 3))
    return out, [blend.prefixes[1], blend.prefixes[6]]


@pytest.mark.parametrize("kind", ["golden", "zstd"])
def test_remove_killed_before_every_mutation_then_run_again(
    kind: str, small_zstd: tuple[Path, list[str]], tmp_path: Path
) -> None:
    if kind == "golden":
        source, gone = GOLDEN / "repack", ["web/cc-00000", "big/long-0000"]
    else:
        source, gone = small_zstd
    expected_dir = tmp_path / "expected"
    shutil.copytree(source, expected_dir)
    old = repack_tree(expected_dir)
    status, points = fork_cli(["remove", "-q", expected_dir, *gone])
    assert status == 0 and points > 10
    new = repack_tree(expected_dir)
    new_manifest = new[fmt.MANIFEST_FILE]
    out = tmp_path / "out"
    for point in range(1, points + 1):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(source, out)
        status, _ = fork_cli(["remove", "-q", out, *gone], kill_at=point)
        context = f"killed before mutation {point} of {points}"
        assert status == -signal.SIGKILL, context
        manifest = (out / fmt.MANIFEST_FILE).read_bytes()
        assert manifest in (old[fmt.MANIFEST_FILE], new_manifest), context
        Repack(str(out)).close()  # a complete repack, old or new
        assert verify(out).ok, context
        status, _ = fork_cli(["remove", "-q", out, *gone])
        if status != 0:  # killed after everything but the last fsync: nothing left to do
            assert status == 3 and manifest == new_manifest, context
        assert repack_tree(out) == new, context


def test_a_loader_cache_that_cannot_be_cleaned_stops_the_remove(tmp_path: Path) -> None:
    """A damaged catalog in ``OUT/cache``: the remove refuses (status 3), saying to delete the
    cache, and leaves the repack as it was; without the cache it goes through."""
    out = tmp_path / "golden"
    shutil.copytree(GOLDEN / "repack", out)
    catalog = out / "cache" / "GPTDataset_indices" / "repack-index-cache.json"
    catalog.parent.mkdir(parents=True)
    catalog.write_text("{not json")
    before = {name: (out / name).read_bytes() for name in os.listdir(out) if name != "cache"}

    result = cli("remove", "-q", out, "web/cc-00000")
    assert result.exit_code == 3, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {catalog.parent}: cannot take")
    assert f"delete {out / 'cache'}" in lines[0]
    after = {name: (out / name).read_bytes() for name in os.listdir(out) if name != "cache"}
    assert after == before  # nothing of the remove is left: the old repack, whole

    shutil.rmtree(out / "cache")
    names = [s.name for s in load_manifest(out).sources]
    assert cli("remove", "-q", out, "web/cc-00000").exit_code == 0
    assert [s.name for s in load_manifest(out).sources] == [n for n in names if n != "web/cc-00000"]
