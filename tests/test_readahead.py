"""The loader's range cache and read-ahead (repack/read/readahead.py), without a server: a reader
that counts what it is asked for stands for the ranged GETs (the S3 loader tests,
tests/test_objstore_loader.py, run the same code against SeaweedFS)."""

from __future__ import annotations

import os
import threading

import pytest

from repack.errors import InputError, Stalled
from repack.read.readahead import ReadAhead, SampleOrder, merge_ranges, settings

DATA = {shard: bytes((shard * 7 + i) % 251 for i in range(1 << 16)) for shard in range(3)}


class Reader:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, shard: int, offset: int, size: int) -> bytes:
        with self.lock:
            self.calls.append((shard, offset, size))
        return DATA[shard][offset : offset + size]


def test_merge_ranges_joins_near_pieces_of_a_shard_only():
    ranges = [(1, 100, 10), (0, 0, 8), (1, 0, 10), (1, 5000, 4), (0, 8, 0)]
    assert merge_ranges(ranges, gap=200) == [(0, 0, 8, 1), (1, 0, 110, 2), (1, 5000, 5004, 1)]
    assert merge_ranges(ranges, gap=0) == [
        (0, 0, 8, 1),
        (1, 0, 10, 1),
        (1, 100, 110, 1),
        (1, 5000, 5004, 1),
    ]


@pytest.mark.parametrize(
    ("seen", "expected"),
    [
        ([0, 1, 2], [3, 4, 5, 6]),  # the main process, in training order
        ([1, 3, 5], [7, 9, 11, 13]),  # worker 1 of 2, one sample per batch
        # batches of 3, worker 0 of 2: runs of 3 and jumps of 4
        ([0, 1, 2, 6, 7, 8, 12], [13, 14, 18, 19]),
        # batches of 4, worker 0 of 2: the last two gaps are 1 and 1, the period is 4
        ([0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18], [19, 24, 25, 26]),
        ([5, 2, 9], []),  # no pattern: no guess
        ([4], []),
    ],
)
def test_sample_order_continues_the_pattern_it_saw(seen, expected):
    order = SampleOrder()
    for index in seen:
        order.see(index)
    assert order.following(4, 100) == expected


def test_sample_order_stops_at_the_end_and_asks_each_index_once():
    order = SampleOrder()
    for index in (95, 96, 97):
        order.see(index)
    assert order.following(5, 100) == [98, 99]
    assert order.fresh(2, 100) == [98, 99]
    assert order.fresh(2, 100) == []  # fetched ahead already
    assert order.see(98) is True  # it was
    order.see(99)
    order.see(50)
    assert order.see(51) is False


def test_reads_come_from_the_ranges_fetched():
    reader = Reader()
    ahead = ReadAhead(reader, limit=1 << 20, gap=1024)
    sample = [(0, 100, 50), (0, 400, 20), (2, 0, 10)]
    ahead.fetch(sample)
    for shard, offset, size in sample:
        assert ahead.get(shard, offset, size) == DATA[shard][offset : offset + size]
    assert sorted(reader.calls) == [(0, 100, 320), (2, 0, 10)]  # one GET per shard here
    assert ahead.stats.hits == 3 and ahead.stats.misses == 0 and ahead.stats.requests == 2
    assert ahead.get(1, 0, 4) is None and ahead.stats.misses == 1
    ahead.fetch(sample)  # held already: nothing sent
    assert len(reader.calls) == 2


def test_the_bound_holds_and_ranges_read_go_first():
    reader = Reader()
    ahead = ReadAhead(reader, limit=1000, gap=0)
    ahead.fetch([(0, 0, 400)])
    assert ahead.get(0, 0, 400) is not None  # read: the first to go
    ahead.fetch([(0, 1000, 400)], ahead=True)
    ahead.fetch([(0, 2000, 400)], ahead=True)  # makes room by dropping the read one
    assert ahead.held == 800 and ahead.stats.peak_bytes <= 1000
    assert ahead.get(0, 0, 400) is None  # dropped
    assert ahead.get(0, 1000, 400) == DATA[0][1000:1400]  # the read-ahead, kept
    assert ahead.get(0, 2000, 400) == DATA[0][2000:2400]
    assert ahead.stats.evicted_unused == 0 and ahead.stats.ahead_hits == 2
    ahead.fetch([(1, 0, 2000)])  # larger than the bound: not fetched, read by the caller
    assert ahead.stats.skipped == 1 and ahead.get(1, 0, 2000) is None
    assert ahead.held <= 1000


def test_a_failed_fetch_is_left_to_the_caller():
    def failing(shard, offset, size):
        raise OSError("connection reset")

    ahead = ReadAhead(failing, limit=1 << 20)
    ahead.fetch([(0, 0, 10)])
    assert ahead.get(0, 0, 10) is None  # the caller's own read raises what went wrong
    assert ahead.held == 0


def test_a_fetch_that_failed_after_its_retries_is_the_reads_error():
    """A store's error (its request retried already, or a silent server given up on) is
    raised for the read: the caller does not make the request, and wait, once more."""
    calls = []

    def stalled(shard, offset, size):
        calls.append((shard, offset, size))
        raise Stalled("s3://b/x/shard-00000.bin: no answer from the server in 120 s")

    ahead = ReadAhead(stalled, limit=1 << 20)
    ahead.fetch([(0, 0, 10)])
    with pytest.raises(Stalled, match="no answer from the server"):
        ahead.get(0, 0, 10)
    assert calls == [(0, 0, 10)] and ahead.held == 0
    assert ahead.get(0, 0, 10) is None  # dropped: a later read makes its own request


def test_a_forked_child_starts_empty():
    reader = Reader()
    ahead = ReadAhead(reader, limit=1 << 20)
    ahead.fetch([(0, 0, 10)])
    ahead.get(0, 0, 10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing held, its own threads work
        ok = ahead.held == 0 and ahead.stats.hits == 0
        ahead.fetch([(1, 0, 10)])
        ok = ok and ahead.get(1, 0, 10) == DATA[1][:10]
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(pid, 0)
    assert ahead.held == 10


def test_settings_from_the_environment(monkeypatch):
    monkeypatch.delenv("REPACK_READ_CACHE", raising=False)
    monkeypatch.delenv("REPACK_READ_AHEAD", raising=False)
    assert settings() == (64 * 1024 * 1024, 16)
    monkeypatch.setenv("REPACK_READ_CACHE", "8MiB")
    monkeypatch.setenv("REPACK_READ_AHEAD", "0")
    assert settings() == (8 * 1024 * 1024, 0)
    monkeypatch.setenv("REPACK_READ_CACHE", "big")
    with pytest.raises(InputError, match=r"^REPACK_READ_CACHE='big': expected a size"):
        settings()
