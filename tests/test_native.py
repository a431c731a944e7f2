"""The compiled document hasher (repack/read/_hashes.c, built by setup.py where a C compiler is at
hand): the very XXH3-64 of the ``xxhash`` package for every range, bad ranges refused, and a
merge hashed without it writing the same fingerprint file byte for byte."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from repack.merge import merge
from repack.read import fingerprints
from repack.synth import make_blend

try:
    from repack.read import _hashes as native
except ImportError:
    # CI installs with a compiler: a build that failed (setup.py only warns) would leave
    # every merge on the slow path unnoticed, so there this is an error, not a skip
    if os.environ.get("CI"):
        raise
    pytest.skip(
        "repack.read._hashes not built (no C compiler at install): the Python path is used",
        allow_module_level=True,
    )


def test_the_fingerprints_use_the_native_hasher() -> None:
    assert fingerprints.NATIVE
    assert native.XXH_VERSION >= 800  # XXH3's output is stable from xxHash 0.8.0 on


def ranges(rng: np.random.Generator, size: int, lengths: np.ndarray):
    starts = rng.integers(0, size - lengths + 1).astype(np.int64)
    return starts, starts + lengths


def hash_ranges(data, starts, ends) -> list[int]:
    out = np.empty(len(starts), dtype=np.uint64)
    native.xxh3_64_ranges(data, starts, ends, out)
    return out.tolist()


@pytest.mark.parametrize("fill", ["random", "zeros", "ones"])
def test_every_length_is_xxh3_64(fill: str) -> None:
    # every length class of XXH3: 0-16, 17-128, 129-240 and the long loop (stripes, blocks
    # of 1,024 bytes, the last partial stripe), at any alignment
    rng = np.random.default_rng(31)
    size = 300_000
    data = {
        "random": rng.integers(0, 256, size, dtype=np.uint8),
        "zeros": np.zeros(size, np.uint8),
        "ones": np.full(size, 255, np.uint8),
    }[fill].tobytes()
    lengths = np.concatenate(
        [np.repeat(np.arange(2100), 2), rng.integers(2100, 200_000, 200), [size]]
    ).astype(np.int64)
    starts, ends = ranges(rng, size, lengths)
    expected = [xxhash.xxh3_64_intdigest(data[a:b]) for a, b in zip(starts, ends)]
    assert hash_ranges(data, starts, ends) == expected


def test_any_buffer_and_no_range() -> None:
    data = bytes(range(256)) * 40
    starts = np.array([0, 3, 100, 10_240], dtype=np.int64)
    ends = np.array([0, 50, 10_000, 10_240], dtype=np.int64)
    expected = [xxhash.xxh3_64_intdigest(data[a:b]) for a, b in zip(starts, ends)]
    with mmap.mmap(-1, len(data)) as mapped:
        mapped[:] = data
        for buffer in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
            assert hash_ranges(buffer, starts, ends) == expected
        assert hash_ranges(memoryview(mapped), starts, ends) == expected
    assert hash_ranges(data, starts[:0], ends[:0]) == []


@pytest.mark.parametrize(
    ("start", "end"), [(-1, 4), (5, 4), (0, 10_241), (10_241, 10_241)], ids=str
)
def test_a_range_outside_the_buffer_is_refused(start: int, end: int) -> None:
    data = bytes(10_240)
    starts = np.array([0, start], dtype=np.int64)
    ends = np.array([8, end], dtype=np.int64)
    with pytest.raises(ValueError, match=rf"range 1: \[{start}, {end}\) is not within 10240"):
        hash_ranges(data, starts, ends)


def test_arrays_of_other_lengths_are_refused() -> None:
    one, two = np.zeros(1, np.int64), np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="ends: 16 bytes, expected 8"):
        native.xxh3_64_ranges(b"x", one, two, np.zeros(1, np.uint64))
    with pytest.raises(ValueError, match="out: 8 bytes, expected 16"):
        native.xxh3_64_ranges(b"x", two, two, np.zeros(1, np.uint64))
    with pytest.raises(TypeError):
        native.xxh3_64_ranges(b"x", one, one, b"\0" * 8)  # out must be writable


def test_a_merge_without_the_native_hasher_writes_the_same_fingerprints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blend = make_blend(tmp_path / "blend", 12, seed=5)
    merge(blend.flat_json, tmp_path / "native", shard_size=8192)
    monkeypatch.setattr(fingerprints, "_native_ranges", None)
    merge(blend.flat_json, tmp_path / "python", shard_size=8192)
    names = sorted(n for n in os.listdir(tmp_path / "native") if n.startswith("fingerprints"))
    assert names
    for name in names:
        native_file, python_file = tmp_path / "native" / name, tmp_path / "python" / name
        assert native_file.read_bytes() == python_file.read_bytes()


@pytest.mark.parametrize("size", [0, 1, 2, 255, 10_000, 300_000])
def test_the_radix_sort_sorts_like_numpy(size: int) -> None:
    rng = np.random.default_rng(size)
    cases = {
        "random": rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32),
        "few values": rng.integers(0, 5, size).astype(np.uint32) << np.uint32(24),
        "one value": np.full(size, 0xDEADBEEF, np.uint32),
        "descending": np.arange(size, dtype=np.uint32)[::-1].copy() * np.uint32(4099),
    }
    for name, values in cases.items():
        expected = np.sort(values)
        native.sort_u32(values, np.empty(size + 3, np.uint32))  # scratch may be larger
        assert np.array_equal(values, expected), name


def test_the_radix_sort_refuses_a_small_scratch() -> None:
    values = np.arange(10, dtype=np.uint32)
    with pytest.raises(ValueError, match="scratch: 36 bytes, at least 40 needed"):
        native.sort_u32(values, np.empty(9, np.uint32))
    with pytest.raises(ValueError, match="not a whole number of uint32"):
        native.sort_u32(bytearray(6), bytearray(8))


def test_the_duplicate_analysis_sorts_the_same_without_the_radix_sort(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from repack.doctor import duplicates

    rng = np.random.default_rng(3)
    values = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    by_radix, by_numpy, tight = values.copy(), values.copy(), values.copy()
    calls = []
    monkeypatch.setattr(
        duplicates, "_radix_sort", lambda v, s: calls.append(len(v)) or native.sort_u32(v, s)
    )
    duplicates._sort_u32(by_radix, 1 << 30)
    duplicates._sort_u32(tight, values.nbytes)  # no room for the scratch copy: numpy
    assert calls == [len(values)]
    monkeypatch.setattr(duplicates, "_radix_sort", None)
    duplicates._sort_u32(by_numpy, 1 << 30)
    assert np.array_equal(by_radix, by_numpy) and np.array_equal(tight, by_numpy)
