"""Pure tests of repack.inputs.plan.plan_repack: packing, alignment, cutting, dtype groups."""

from __future__ import annotations

import numpy as np
import pytest

from repack.format import spec as fmt
from repack.inputs.plan import Plan, plan_repack
from repack.inputs.sources import SourceInfo

A = fmt.ALIGNMENT
UINT16, INT32 = fmt.dtype_code(np.uint16), fmt.dtype_code(np.int32)


def source(lengths: list[int], code: int = UINT16, name: str = "s") -> SourceInfo:
    itemsize = fmt.dtype_from_code(code).itemsize
    tokens = sum(lengths)
    return SourceInfo(
        path=f"/data/{name}",
        dtype_code=code,
        sequence_count=len(lengths),
        document_count=len(lengths) + 1,
        multimodal=False,
        bin_size=tokens * itemsize,
        idx_size=fmt.megatron_idx_size(len(lengths), len(lengths) + 1, False),
        token_count=tokens,
    )


def plan(sources: list[tuple[list[int], int]], shard_size: int) -> tuple[Plan, list[int]]:
    """Plan sources given as (lengths, dtype code); also return which sources were cut."""
    infos = [source(lengths, code, f"s{i}") for i, (lengths, code) in enumerate(sources)]
    asked: list[int] = []

    def lengths_of(i: int) -> np.ndarray:
        asked.append(i)
        return np.array(sources[i][0], dtype=np.int32)

    result = plan_repack(infos, shard_size, lengths_of)
    check_invariants(result, infos, [np.array(s[0]) for s in sources])
    return result, asked


def check_invariants(result: Plan, infos: list[SourceInfo], lengths: list[np.ndarray]) -> None:
    """What every plan must satisfy, whatever its input."""
    assert [shard.number for shard in result.shards] == list(range(len(result.shards)))
    for shard in result.shards:
        assert shard.segments, f"{shard.name} is empty"
        end = 0
        for seg in shard.segments:
            assert seg.shard == shard.number
            assert infos[seg.source].dtype_code == shard.dtype_code
            assert seg.offset % A == 0 and seg.offset >= end
            end = seg.offset + seg.size
        lone = len(shard.segments) == 1 and shard.segments[0].sequence_count == 1
        assert shard.size <= result.shard_size or lone
    for i, segments in enumerate(result.segments_by_source):
        itemsize = infos[i].dtype.itemsize
        ends = np.concatenate(([0], np.cumsum(lengths[i]))) * itemsize
        first, offset = 0, 0
        for seg in segments:
            assert seg.source == i
            assert (seg.first_sequence, seg.source_offset) == (first, offset)
            assert seg.source_offset == ends[seg.first_sequence]  # starts at a sequence
            assert seg.source_offset + seg.size == ends[seg.first_sequence + seg.sequence_count]
            first, offset = first + seg.sequence_count, offset + seg.size
        assert (first, offset) == (infos[i].sequence_count, infos[i].bin_size)
    assert result.total_bytes == sum(info.bin_size for info in infos)


def layout(result: Plan) -> list[list[tuple[int, int, int]]]:
    """Per shard: (source, offset, size) of each segment."""
    return [[(s.source, s.offset, s.size) for s in shard.segments] for shard in result.shards]


def test_small_sources_pack_into_one_shard_aligned() -> None:
    result, asked = plan([([10, 20], UINT16), ([5], UINT16), ([3000], UINT16)], 1 << 20)
    assert layout(result) == [[(0, 0, 60), (1, A, 10), (2, 2 * A, 6000)]]
    assert result.shards[0].size == 2 * A + 6000
    assert asked == []  # lengths are only needed to cut


def test_source_that_does_not_fit_starts_a_new_shard() -> None:
    # 3000 bytes each: the second fits at 4096 (ends 7096 <= 8192), the third would end at
    # 8192 + 3000
    result, asked = plan([([1500], UINT16)] * 3, 2 * A)
    assert layout(result) == [[(0, 0, 3000), (1, A, 3000)], [(2, 0, 3000)]]
    assert asked == []


def test_source_ending_exactly_at_the_shard_size_fits() -> None:
    result, _ = plan([([10], UINT16), ([A // 2], UINT16)], 2 * A)
    assert layout(result) == [[(0, 0, 20), (1, A, A)]]
    assert result.shards[0].size == 2 * A


def test_big_source_is_cut_at_sequence_boundaries() -> None:
    lengths = [1000] * 10  # 2000 bytes each: 4 per 8192-byte shard
    result, asked = plan([([7], UINT16), (lengths, UINT16), ([7], UINT16)], 2 * A)
    assert asked == [1]
    cut = result.segments_by_source[1]
    assert [(s.shard, s.first_sequence, s.sequence_count, s.offset) for s in cut] == [
        (1, 0, 4, 0),
        (2, 4, 4, 0),
        (3, 8, 2, 0),
    ]
    # the next source fills the shard holding the last piece
    assert layout(result)[3] == [(1, 0, 4000), (2, A, 14)]


def test_cut_respects_uneven_lengths() -> None:
    lengths = [3000, 1, 1, 5000, 100, 4095]  # int32: 12000, 4, 4, 20000, 400, 16380 bytes
    result, _ = plan([(lengths, INT32)], 5 * A)  # 20480
    pieces = [(s.first_sequence, s.sequence_count, s.size) for s in result.segments_by_source[0]]
    assert pieces == [(0, 3, 12008), (3, 2, 20400), (5, 1, 16380)]


def test_sequence_larger_than_a_shard_gets_its_own_shard() -> None:
    result, _ = plan([([100], UINT16), ([50, 5000, 50], UINT16), ([100], UINT16)], A)
    assert layout(result) == [
        [(0, 0, 200)],
        [(1, 0, 100)],
        [(1, 0, 10000)],  # the lone sequence: larger than the shard size
        [(1, 0, 100)],
        [(2, 0, 200)],  # 200 bytes do not fit at 4096, behind the last piece
    ]
    assert result.shards[2].size == 10000 > A


def test_dtypes_never_share_a_shard() -> None:
    sources = [([5], UINT16), ([5], INT32), ([5], UINT16), ([5], INT32), ([5], UINT16)]
    result, _ = plan(sources, 1 << 20)
    # groups in order of first appearance, blend order within a group
    assert [(s.dtype_code, [seg.source for seg in s.segments]) for s in result.shards] == [
        (UINT16, [0, 2, 4]),
        (INT32, [1, 3]),
    ]


def test_dtype_groups_with_several_shards_each() -> None:
    sources = [([1500], UINT16), ([700], INT32)] * 3
    result, _ = plan(sources, 2 * A)
    assert [(s.dtype_code, [seg.source for seg in s.segments]) for s in result.shards] == [
        (UINT16, [0, 2]),
        (UINT16, [4]),
        (INT32, [1, 3]),
        (INT32, [5]),
    ]


def test_empty_sources_get_empty_segments() -> None:
    result, _ = plan([([], UINT16), ([0, 0], UINT16), ([4], UINT16)], A)
    assert layout(result) == [[(0, 0, 0), (1, 0, 0), (2, 0, 8)]]


def test_shard_size_below_alignment_is_refused() -> None:
    with pytest.raises(ValueError, match="smaller than 4096"):
        plan_repack([source([1])], A - 1, lambda i: np.array([1]))


def test_random_blends_satisfy_the_invariants() -> None:
    rng = np.random.default_rng(3)
    for _ in range(40):
        n = int(rng.integers(1, 30))
        sources = [
            (
                rng.integers(0, int(rng.choice([10, 3000, 20000])), rng.integers(0, 12)).tolist(),
                int(rng.choice([UINT16, INT32, fmt.dtype_code(np.uint8)])),
            )
            for _ in range(n)
        ]
        shard_size = int(rng.choice([A, 3 * A, 10**6]))
        plan(sources, shard_size)  # check_invariants runs inside
