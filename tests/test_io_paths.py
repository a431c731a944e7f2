"""verify hashes shards in threads and reports exactly what a one-thread run reports, in the
same order, whatever the damage; and the copy and hashing helpers give the same bytes and
checksums through buffers of any size, by copy_file_range or by reading and writing."""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import pytest

from repack.checksum import new_hasher
from repack.fileio import BUFFER, copy_range, hash_range
from repack.manifest import load_manifest
from repack.merge import merge
from repack.synth import DemoBlend, make_blend
from repack.verify import _shard_groups, verify

SHARD_SIZE = 8192


@pytest.fixture(scope="module")
def cut_repack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 sources in 8 KiB shards: many shards, several sources cut across 2 or more."""
    blend: DemoBlend = make_blend(
        tmp_path_factory.mktemp("workers-src"), 30, seed=11, tokens_per_source=(100, 9000)
    )
    out = tmp_path_factory.mktemp("workers") / "out"
    merge(blend.flat_json, out, shard_size=SHARD_SIZE)
    return out


def test_groups_keep_cut_sources_together(cut_repack: Path) -> None:
    manifest = load_manifest(cut_repack)
    groups = _shard_groups(manifest)
    assert sorted(s.number for g in groups for s in g) == [s.number for s in manifest.shards]
    group_of = {shard.number: i for i, g in enumerate(groups) for shard in g}
    cut = [s for s in manifest.sources if len(s.segments) > 1]
    assert cut, "the fixture must cut sources across shards"
    for source in manifest.sources:
        assert len({group_of[seg.shard] for seg in source.segments}) == 1
    for group in groups:
        assert [s.number for s in group] == sorted(s.number for s in group)
    assert len(groups) > 1


def damage(out: Path, how: str) -> None:
    manifest = load_manifest(out)
    cut = next(s for s in manifest.sources if len(s.segments) > 1)
    first, last = cut.segments[0], cut.segments[-1]

    def flip(shard: int, offset: int) -> None:
        path = out / manifest.shards[shard].file
        data = bytearray(path.read_bytes())
        data[offset] ^= 0xFF
        path.write_bytes(bytes(data))

    if how == "cut-first":
        flip(first.shard, first.offset)
    elif how == "cut-last":
        flip(last.shard, last.offset + last.size - 1)
    elif how == "truncate":
        path = out / manifest.shards[first.shard].file
        os.truncate(path, path.stat().st_size // 2)
    elif how == "missing":
        (out / manifest.shards[last.shard].file).unlink()
    elif how == "padding":
        for shard in manifest.shards:
            ends = sorted(
                (seg.offset + seg.size, seg.offset)
                for s in manifest.sources
                for seg in s.segments
                if seg.shard == shard.number
            )
            gaps = [a for (a, _), (_, b) in itertools.pairwise(ends) if b > a]
            if gaps:
                flip(shard.number, gaps[0])
                return
        raise AssertionError("no padding in the fixture")
    elif how == "many":
        for shard in manifest.shards[::3]:
            flip(shard.number, 0)


@pytest.mark.parametrize(
    "how", ["none", "cut-first", "cut-last", "truncate", "missing", "padding", "many"]
)
def test_threads_report_what_one_thread_reports(cut_repack: Path, tmp_path: Path, how: str) -> None:
    out = tmp_path / "out"
    shutil.copytree(cut_repack, out)
    damage(out, how)
    one = verify(out, workers=1).to_json()
    assert one["ok"] == (how == "none")
    for workers in (2, 3, 8):
        assert verify(out, workers=workers).to_json() == one


def test_progress_adds_up_with_threads(cut_repack: Path) -> None:
    seen = []
    totals = []

    def progress(description: str, total: int):
        totals.append(total)
        return seen.append

    assert verify(cut_repack, workers=4, progress=progress).ok
    assert sum(seen) == totals[0]


@pytest.mark.parametrize("offloads", [True, False], ids=["copy_file_range", "read-write"])
@pytest.mark.parametrize("buffer", [None, 1, 4096, BUFFER + 1, 3 * BUFFER])
def test_hash_and_copy_through_any_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffer: int | None, offloads: bool
) -> None:
    import repack.fileio as fileio

    monkeypatch.setattr(fileio, "copy_offloads", lambda fd: offloads)
    data = os.urandom(2 * BUFFER + 12345)
    src = tmp_path / "src"
    src.write_bytes(data)
    expected = new_hasher("xxh3-128")
    expected.update(data[100:])
    scratch = None if buffer is None else bytearray(buffer)

    fd = os.open(src, os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT)
    try:
        hashed = new_hasher("xxh3-128")
        hash_range(fd, 100, len(data) - 100, [hashed], None, scratch)
        copied = new_hasher("xxh3-128")
        reported = []
        copy_range(fd, dst, 100, 7, len(data) - 100, [copied], reported.append, scratch)
    finally:
        os.close(fd)
        os.close(dst)
    assert hashed.hexdigest() == copied.hexdigest() == expected.hexdigest()
    assert (tmp_path / "dst").read_bytes() == bytes(7) + data[100:]
    assert sum(reported) == len(data) - 100


def test_copy_without_copy_file_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import repack.fileio as fileio

    monkeypatch.setattr(fileio, "_copy_file_range_works", False)
    data = os.urandom(BUFFER + 999)
    (tmp_path / "src").write_bytes(data)
    fd = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT)
    try:
        hasher = new_hasher("sha256")
        copy_range(fd, dst, 0, 4096, len(data), [hasher], None, bytearray(3 * BUFFER))
    finally:
        os.close(fd)
        os.close(dst)
    expected = new_hasher("sha256")
    expected.update(data)
    assert hasher.hexdigest() == expected.hexdigest()
    assert (tmp_path / "dst").read_bytes() == bytes(4096) + data


def test_a_failing_thread_stops_the_others(cut_repack: Path) -> None:
    calls = []

    def progress(description: str, total: int):
        def advance(n: int) -> None:
            calls.append(n)
            if len(calls) == 3:
                raise RuntimeError("progress bar broke")

        return advance

    with pytest.raises(RuntimeError, match="progress bar broke"):
        verify(cut_repack, workers=4, progress=progress)


def test_file_system_of_a_descriptor(tmp_path: Path) -> None:
    import repack.fileio as fileio

    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        kind = fileio._file_system(fd)
        if kind is None:
            pytest.skip("no /proc/self/mountinfo here")
        assert kind.replace(".", "").replace("_", "").isalnum()
        assert fileio.copy_offloads(fd) == (kind in fileio.OFFLOADING_FILE_SYSTEMS)
    finally:
        os.close(fd)
