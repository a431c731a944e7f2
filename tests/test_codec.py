"""Compressed shards: any byte range reads back exactly; damage is refused, not misread."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from repack.errors import FormatError
from repack.format.codec import CompressedShard, compress_file, parse_codec


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    # Zipf-like token ids compress, as real text does; odd total size on purpose
    tokens = np.minimum(rng.zipf(1.3, 300_001), 60_000).astype(np.uint16)
    path = tmp_path / "raw.bin"
    path.write_bytes(tokens.tobytes() + b"\x07")
    return path


def test_random_ranges_read_back_exactly(raw: Path, tmp_path: Path) -> None:
    data = raw.read_bytes()
    dst = tmp_path / "shard.zst"
    size = compress_file(str(raw), str(dst), 3, block_size=4096)
    assert size == dst.stat().st_size < len(data)
    shard = CompressedShard(str(dst), len(data))
    rng = np.random.default_rng(1)
    for _ in range(500):
        offset = int(rng.integers(0, len(data)))
        length = int(rng.integers(0, min(20_000, len(data) - offset) + 1))
        assert shard.read(offset, length) == data[offset : offset + length]
    assert shard.read(0, len(data)) == data
    shard.close()


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    compress_file(str(tmp_path / "empty"), str(tmp_path / "e.zst"), 3)
    shard = CompressedShard(str(tmp_path / "e.zst"), 0)
    assert shard.read(0, 0) == b""


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[:-1], "bad trailer|too short|inconsistent|trailer says"),
        (lambda b: b[:-32] + b"XXXXXXXX" + b[-24:], "bad trailer"),
        (lambda b: b + b"\0", "bad trailer|inconsistent"),
    ],
)
def test_damaged_footer_is_refused(raw: Path, tmp_path: Path, damage, message: str) -> None:
    dst = tmp_path / "shard.zst"
    compress_file(str(raw), str(dst), 3, block_size=4096)
    dst.write_bytes(damage(dst.read_bytes()))
    with pytest.raises(FormatError, match=message):
        CompressedShard(str(dst), os.stat(raw).st_size)


def test_damaged_frame_is_refused_not_misread(raw: Path, tmp_path: Path) -> None:
    dst = tmp_path / "shard.zst"
    compress_file(str(raw), str(dst), 3, block_size=4096)
    data = bytearray(dst.read_bytes())
    data[2] ^= 0xFF  # inside frame 0's header
    dst.write_bytes(bytes(data))
    shard = CompressedShard(str(dst), os.stat(raw).st_size)
    with pytest.raises(FormatError, match="frame 0"):
        shard.read(0, 10)


def test_parse_codec() -> None:
    assert parse_codec("zstd") == ("zstd", 3)
    assert parse_codec("zstd:19") == ("zstd", 19)
    for bad in ("lz4", "zstd:x", "zstd:99"):
        with pytest.raises(ValueError):
            parse_codec(bad)


def test_flipped_byte_inside_a_frame_payload_is_refused(raw: Path, tmp_path: Path) -> None:
    dst = tmp_path / "shard.zst"
    compress_file(str(raw), str(dst), 3, block_size=4096)
    shard = CompressedShard(str(dst), os.stat(raw).st_size)
    start, end = int(shard.table[5]), int(shard.table[6])
    shard.close()
    data = bytearray(dst.read_bytes())
    data[(start + end) // 2] ^= 0x01
    dst.write_bytes(bytes(data))
    shard = CompressedShard(str(dst), os.stat(raw).st_size)
    with pytest.raises(FormatError, match="frame 5"):
        shard.read(5 * 4096, 100)
