"""Compressed shards (`merge --compress zstd[:LEVEL]`): every source round-trips through
`extract`, the loader reads the same tokens as from raw shards, and verify catches damage."""

from __future__ import annotations

import filecmp
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from repack.cli import main
from repack.format.manifest import load_manifest
from repack.merge import merge
from repack.read.extract import extract
from repack.read.reader import Repack
from repack.read.verify import verify
from repack.read.views import SourceDataset
from repack.synth import DemoBlend, make_blend


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    return make_blend(tmp_path_factory.mktemp("zsrc"), 60, seed=9, multimodal_fraction=0.1)


@pytest.fixture(scope="module")
def pair(blend: DemoBlend, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same blend merged raw and compressed, in small shards (sources cut across)."""
    root = tmp_path_factory.mktemp("zout")
    merge(blend.flat_json, root / "raw", shard_size=8192)
    merge(blend.flat_json, root / "zst", shard_size=8192, codec=("zstd", 5))
    return root / "raw", root / "zst"


def test_layout_and_manifest(pair: tuple[Path, Path]) -> None:
    raw, zst = (load_manifest(p) for p in pair)
    assert [s.file for s in zst.shards] == [f"{s.file}.zst" for s in raw.shards]
    assert all(s.codec == "zstd" and s.stored_size > 0 for s in zst.shards)
    assert any(len(s.segments) > 1 for s in zst.sources)  # cut sources are covered
    # logical sizes and checksums are those of the raw shards
    assert [(s.size, s.checksum) for s in zst.shards] == [(s.size, s.checksum) for s in raw.shards]
    assert sum(s.stored_size for s in zst.shards) < sum(s.size for s in raw.shards)
    assert verify(pair[1]).ok


def test_every_source_extracts_byte_identical(
    blend: DemoBlend, pair: tuple[Path, Path], tmp_path: Path
) -> None:
    manifest = load_manifest(pair[1])
    for source in manifest.sources:
        dest = tmp_path / f"s{source.id}"
        extract(pair[1], source.path, dest)
        assert filecmp.cmp(f"{dest}.bin", source.path + ".bin", shallow=False)
        assert filecmp.cmp(f"{dest}.idx", source.path + ".idx", shallow=False)


@pytest.mark.parametrize("mmap", [True, False])
def test_loader_reads_the_same_tokens(pair: tuple[Path, Path], mmap: bool) -> None:
    raw_dir, zst_dir = pair
    rng = np.random.default_rng(0)
    for source in load_manifest(zst_dir).sources:
        raw = SourceDataset(str(raw_dir), source.path, multimodal=source.multimodal, mmap=mmap)
        zst = SourceDataset(str(zst_dir), source.path, multimodal=source.multimodal, mmap=mmap)
        assert len(raw) == len(zst)
        for i in range(len(raw)):
            a, b = raw[i], zst[i]
            if source.multimodal:
                assert np.array_equal(a[0], b[0]) and a[1] == b[1]
            else:
                assert np.array_equal(a, b)
        if len(raw) > 2:
            i = int(rng.integers(0, len(raw)))
            n = int(raw.sequence_lengths[i])
            got, want = zst.get(i, n // 3, n // 2), raw.get(i, n // 3, n // 2)
            if source.multimodal:
                got, want = got[0], want[0]
            assert np.array_equal(got, want)
            got_slice, want_slice = zst[0:3], raw[0:3]
            if source.multimodal:
                assert np.array_equal(got_slice[1], want_slice[1])
                got_slice, want_slice = got_slice[0], want_slice[0]
            assert all(np.array_equal(x, y) for x, y in zip(got_slice, want_slice, strict=True))
        copy = pickle.loads(pickle.dumps(zst))
        assert copy.repack is zst.repack


def test_flipped_stored_byte_is_caught(pair: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "zst"
    shutil.copytree(pair[1], out)
    manifest = load_manifest(out)
    rng = np.random.default_rng(3)
    caught = 0
    for _ in range(30):
        shard = manifest.shards[int(rng.integers(0, len(manifest.shards)))]
        path = out / shard.file
        data = bytearray(path.read_bytes())
        position = int(rng.integers(0, len(data)))
        original = data[position]
        data[position] ^= int(rng.integers(1, 256))
        path.write_bytes(bytes(data))
        report = verify(out)
        caught += (not report.ok) and {p.file for p in report.problems} == {shard.file}
        data[position] = original
        path.write_bytes(bytes(data))
    assert caught == 30
    assert verify(out).ok


def test_verify_sources_on_a_compressed_repack(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """--sources compares the originals with the shards' logical (decompressed) bytes; it used
    to read the compressed file at logical offsets and end in a bare 'Aborted!'."""
    result = CliRunner().invoke(main, ["verify", "-q", "--sources", str(pair[1])])
    assert result.exit_code == 0, result.output
    n = len(load_manifest(pair[1]).sources)
    assert result.stdout.startswith("OK: ") and result.stdout.endswith(
        f"; {n} originals compared byte for byte\n"
    )
    result = CliRunner().invoke(main, ["verify", "-q", "--sources", "--json", str(pair[1])])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] and report["originals_compared"] == n and not report["problems"]
    # a frame that no longer decompresses: damage named, the comparison goes on
    out = tmp_path / "zst"
    shutil.copytree(pair[1], out)
    shard = load_manifest(out).shards[0]
    data = bytearray((out / shard.file).read_bytes())
    data[20] ^= 0xFF
    (out / shard.file).write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["verify", "-q", "--sources", str(out)])
    assert result.exit_code == 1 and result.stderr == "", result.output
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
    assert fails[0].startswith(f"FAIL {shard.file}: ")
    assert any("cannot compare: " in f and "frame 0 does not decompress" in f for f in fails)


def test_damaged_frame_fails_loudly_in_the_loader(pair: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "zst"
    shutil.copytree(pair[1], out)
    manifest = load_manifest(out)
    source = manifest.sources[0]
    seg = source.segments[0]
    path = out / manifest.shards[seg.shard].file
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF  # inside the first frame: the first block of the shard
    path.write_bytes(bytes(data))
    repack = Repack(str(out), "pread")
    with pytest.raises(Exception, match="frame 0"):
        repack.read(seg.shard, 0, 16, np.dtype(np.uint8))


def test_extract_of_a_damaged_frame_is_damage(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """Status 1, as for damaged data in a raw shard (it was 3, 'bad input'), and no file."""
    out = tmp_path / "zst"
    shutil.copytree(pair[1], out)
    manifest = load_manifest(out)
    source = manifest.sources[0]
    shard = manifest.shards[source.segments[0].shard]
    data = bytearray((out / shard.file).read_bytes())
    data[20] ^= 0xFF  # inside the first frame, which holds the start of the first source
    (out / shard.file).write_bytes(bytes(data))
    dest = tmp_path / "x"
    result = CliRunner().invoke(main, ["extract", "-q", str(out), source.name, str(dest)])
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"Error: {out}: data of {source.name!r} cannot be read ({out / shard.file}: frame 0 "
        "does not decompress: "
    ) and line.endswith("); the repack is damaged (run 'repack verify')")
    assert result.stdout == "" and list(tmp_path.glob("x*")) == []


def test_cli_compress_option_and_resume(blend: DemoBlend, pair, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["merge", "-q", "--compress", "zstd:5", "--shard-size", "8192", str(blend.flat_json)]
    result = CliRunner().invoke(main, [*args, str(out)])
    assert result.exit_code == 0, result.output
    for name in sorted(os.listdir(out)):
        assert (out / name).read_bytes() == (pair[1] / name).read_bytes(), name
    # a second run finds the merge complete and changes nothing
    assert CliRunner().invoke(main, [*args, str(out)]).exit_code == 0
    bad = CliRunner().invoke(main, ["merge", "--compress", "lz4", str(blend.flat_json), str(out)])
    assert bad.exit_code == 2 and "unknown codec" in bad.output
