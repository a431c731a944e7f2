"""verify hashes shards in threads and reports exactly what a one-thread run reports, in the
same order, whatever the damage; and the copy and hashing helpers give the same bytes and
checksums through buffers of any kind and size, by copy_file_range or by reading and writing."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from repack.checksum import new_hasher
from repack.errors import ShortRead
from repack.fileio import BUFFER, HashFeeder, copy_range, hash_range, io_buffer
from repack.format.manifest import load_manifest
from repack.merge import merge
from repack.read.verify import _shard_groups, verify
from repack.synth import DemoBlend, make_blend

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


@pytest.mark.parametrize("kernel", [True, False], ids=["copy_file_range", "read-write"])
@pytest.mark.parametrize(
    "buffer",
    [
        None,
        ("bytearray", 1),
        ("bytearray", 3 * BUFFER),
        ("io", 1),
        ("io", 4096),
        ("io", BUFFER + 1),
        ("io", 3 * BUFFER),
    ],
    ids=str,
)
def test_hash_and_copy_through_any_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, buffer: tuple | None, kernel: bool
) -> None:
    import repack.fileio as fileio

    if not kernel:
        monkeypatch.setattr(fileio, "_copy_file_range_works", False)
    # a buffer of a few bytes moves them a few at a time: through a few pages, not megabytes
    tiny = buffer is not None and buffer[1] < 4096
    data = os.urandom(3 * 4096 + 12345 if tiny else 2 * BUFFER + 12345)
    src = tmp_path / "src"
    src.write_bytes(data)
    expected = new_hasher("xxh3-128")
    expected.update(data[100:])
    if buffer is None:
        scratch = None
    else:
        kind, size = buffer
        scratch = bytearray(size) if kind == "bytearray" else io_buffer(size)

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


@pytest.mark.parametrize("size", [0, 1, 4096, 128 * 1024, BUFFER])
def test_io_buffers_start_just_after_a_page_boundary(size: int) -> None:
    import ctypes

    import repack.fileio as fileio

    buffer = io_buffer(size)
    assert len(buffer) == max(1, size) and not buffer.readonly and not any(buffer)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert address % 4096 == fileio.BUFFER_OFFSET
    # what the read paths hand to pread: the start of the buffer
    assert fileio._scratch(buffer, size)[:1].obj is buffer.obj


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


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("kernel", [True, False], ids=["copy_file_range", "read-write"])
def test_feeder_hashes_in_order_what_copies_hand_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: bool
) -> None:
    import repack.fileio as fileio

    monkeypatch.setattr(fileio, "CHUNK", 256 * 1024)  # many chunks queued per copy
    if not kernel:
        monkeypatch.setattr(fileio, "_copy_file_range_works", False)
    parts = [os.urandom(n) for n in (3 * BUFFER + 5, 1, 700_000, 2 * BUFFER)]
    expected_all, expected_each = new_hasher("xxh3-128"), []
    fds_before = _open_fds()
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT)
    everything, each = new_hasher("xxh3-128"), []
    position = 0
    try:
        with HashFeeder(depth=2) as feeder:
            for i, part in enumerate(parts):
                (tmp_path / f"src{i}").write_bytes(part)
                feeder.update([everything], b"pad")
                expected_all.update(b"pad")
                expected_all.update(part)
                expected_each.append(new_hasher("xxh3-128"))
                expected_each[-1].update(part)
                each.append(new_hasher("xxh3-128"))
                src = os.open(tmp_path / f"src{i}", os.O_RDONLY)
                try:
                    copy_range(
                        src, dst, 0, position, len(part), [everything, each[-1]], None, None, feeder
                    )
                finally:
                    os.close(src)  # the feeder reads its own duplicate
                position += len(part)
    finally:
        os.close(dst)
    assert everything.hexdigest() == expected_all.hexdigest()
    assert [h.hexdigest() for h in each] == [h.hexdigest() for h in expected_each]
    assert (tmp_path / "dst").read_bytes() == b"".join(parts)
    assert _open_fds() == fds_before


def test_feeder_hands_its_error_to_the_caller(tmp_path: Path) -> None:
    (tmp_path / "short").write_bytes(b"x" * 100)
    fds_before = _open_fds()
    fd = os.open(tmp_path / "short", os.O_RDONLY)
    try:
        with pytest.raises(ShortRead, match=r"short: ends 900 bytes before offset 1000"):
            with HashFeeder() as feeder:
                feeder.update_range([new_hasher("xxh3-128")], fd, 0, 1000)  # past the end
                for _ in range(20):  # queued after the failure: skipped, descriptors closed
                    feeder.update_range([new_hasher("xxh3-128")], fd, 0, 100)
    finally:
        os.close(fd)
    assert _open_fds() == fds_before


def test_feeder_left_by_an_exception_stops_without_hashing_the_rest(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(os.urandom(BUFFER))
    fds_before = _open_fds()
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(KeyboardInterrupt):
            with HashFeeder(depth=1) as feeder:
                for _ in range(5):
                    feeder.update_range([new_hasher("sha256")], fd, 0, BUFFER)
                raise KeyboardInterrupt
        assert not feeder._thread.is_alive()
    finally:
        os.close(fd)
    assert _open_fds() == fds_before


@pytest.mark.parametrize("how", ["cut-first", "cut-last", "padding", "many"])
def test_damage_found_after_the_one_pass_check_names_its_sources(
    cut_repack: Path, tmp_path: Path, how: str
) -> None:
    # an intact shard is hashed once; a damaged one again, segment by segment: the second
    # pass must name exactly the damaged sources, and progress must count each byte once
    out = tmp_path / "out"
    shutil.copytree(cut_repack, out)
    damage(out, how)
    manifest = load_manifest(out)
    cut = next(s for s in manifest.sources if len(s.segments) > 1)
    if how in ("cut-first", "cut-last"):
        expected = {cut.name}
    elif how == "padding":
        expected = set()
    else:
        expected = {
            s.name
            for shard in manifest.shards[::3]
            for s in manifest.sources
            if any(seg.shard == shard.number and seg.offset == 0 for seg in s.segments)
        }
    seen, totals = [], []

    def progress(description: str, total: int):
        totals.append(total)
        return seen.append

    report = verify(out, workers=2, progress=progress)
    assert not report.ok
    assert {name for p in report.problems for name in p.sources} == expected
    assert sum(seen) == totals[0]


FEEDER_CUT_ANYWHERE = """
import random, signal, sys, threading
from repack.fileio import HashFeeder
from repack.checksum import new_hasher

def cut(signum, frame):
    raise KeyboardInterrupt

signal.signal(signal.SIGALRM, cut)
rng = random.Random(int(sys.argv[1]))
hasher = new_hasher("xxh3-128")
cuts = 0
for _ in range(int(sys.argv[2])):
    try:
        with HashFeeder(depth=1) as feeder:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0001, 0.003))
            while True:
                feeder.update([hasher], b"x" * 64)
                if rng.random() < 0.01:
                    feeder.wait()
    except KeyboardInterrupt:
        cuts += 1
    signal.setitimer(signal.ITIMER_REAL, 0)
    assert not feeder._thread.is_alive()
print(cuts, threading.active_count())
"""


def test_feeder_cut_anywhere_by_a_signal_always_stops() -> None:
    """A signal handler raising in the main thread may cut the caller's side of the feeder at
    any bytecode (as ^C does a merge): leaving the block must end its thread every time. A
    ``queue.Queue`` cut in its ``put`` between the lock and the notify left the thread waiting
    for good (the merge that did not end after ^C); 2,000 random cuts here, in a child whose
    hang fails the test by its timeout."""
    done = subprocess.run(
        [sys.executable, "-c", FEEDER_CUT_ANYWHERE, "7", "2000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2000", "1"]
