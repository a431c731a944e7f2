"""The combined index agrees with Megatron-Core's own reader on every source.

For each source of a repack, the arrays of its slice of ``index.rpx`` equal what
``megatron.core.datasets.indexed_dataset.IndexedDataset`` reads from the original prefix, and
the tokens found through the translated pointers equal ``IndexedDataset[i]``.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest

with warnings.catch_warnings():  # Megatron warns that Transformer Engine/Apex are missing
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

from repack.format.manifest import SegmentEntry, SourceEntry
from repack.read.reader import Repack
from repack.synth import DemoBlend

pytestmark = pytest.mark.megatron


def segment_of(source: SourceEntry, sequence: int) -> SegmentEntry:
    for seg in source.segments:
        if seg.first <= sequence < seg.first + seg.count:
            return seg
    raise AssertionError(f"sequence {sequence} of {source.name} is in no segment")


def mismatches(repack: Repack, source: SourceEntry, dataset: IndexedDataset) -> list[str]:
    """Every disagreement between the repack's view of ``source`` and Megatron's."""
    found = []
    lengths, pointers, documents, modes = repack.source_arrays(source)
    index = dataset.index
    if source.dtype != index.dtype:
        found.append(f"dtype {source.dtype} != {index.dtype}")
    if not np.array_equal(lengths, index.sequence_lengths):
        found.append("sequence_lengths")
    if not np.array_equal(pointers, index.sequence_pointers):
        found.append("sequence_pointers")
    if not np.array_equal(documents, index.document_indices):
        found.append("document_indices")
    if not np.array_equal(documents, dataset.document_indices):
        found.append("document_indices (dataset)")
    if source.multimodal:
        if modes is None or not np.array_equal(modes, index.sequence_modes):
            found.append("sequence_modes")
    elif modes is not None or index.sequence_modes is not None:
        found.append("modes of a plain source")
    if len(lengths) != len(dataset):
        found.append(f"{len(lengths)} sequences, Megatron {len(dataset)}")
        return found
    for i, (pointer, length) in enumerate(zip(pointers.tolist(), lengths.tolist())):
        seg = segment_of(source, i)
        position = seg.offset + pointer - seg.source_offset
        try:
            tokens = repack.read(seg.shard, position, length, source.dtype)
        except (ValueError, OSError) as err:  # out of the shard
            found.append(f"cannot read sequence {i}: {err}")
            continue
        expected = dataset[i]
        if source.multimodal:
            expected, mode = expected
            if mode != modes[i]:
                found.append(f"mode of sequence {i}")
        if not np.array_equal(tokens, expected):
            found.append(f"tokens of sequence {i}")
        if length >= 3:
            part = repack.read(
                seg.shard, position + source.dtype.itemsize, length - 2, source.dtype
            )
            expected = dataset.get(i, offset=1, length=length - 2)
            if source.multimodal:
                expected = expected[0]
            if not np.array_equal(part, expected):
                found.append(f"tokens 1..{length - 2} of sequence {i} (get)")
    return found


@pytest.mark.parametrize("which", ["demo_repack", "demo_repack_cut"])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_every_source_agrees_with_megatron(
    request: pytest.FixtureRequest, demo_blend: DemoBlend, which: str, backend: str
) -> None:
    out: Path = request.getfixturevalue(which)
    repack = Repack(str(out), backend=backend)
    sources = repack.manifest.sources
    assert [s.path for s in sources] == list(demo_blend.prefixes)
    assert sum(s.multimodal for s in sources) == len(demo_blend.multimodal) >= 2
    if which == "demo_repack_cut":
        assert sum(len(s.segments) > 1 for s in sources) > 50
    problems = {}
    for source in sources:
        dataset = IndexedDataset(source.path, multimodal=source.multimodal)
        found = mismatches(repack, source, dataset)
        if found:
            problems[source.name] = found
    repack.close()
    assert problems == {}


def test_parity_check_sees_a_wrong_pointer_translation(demo_repack_cut: Path) -> None:
    """The comparison is not vacuous: reading at the untranslated pointer is caught."""
    repack = Repack(str(demo_repack_cut))
    source = next(s for s in repack.manifest.sources if len(s.segments) > 1)
    dataset = IndexedDataset(source.path, multimodal=source.multimodal)
    assert mismatches(repack, source, dataset) == []
    second = dataclasses.replace(source.segments[1], source_offset=0)  # untranslated
    wrong = dataclasses.replace(source, segments=(source.segments[0], second, *source.segments[2:]))
    found = mismatches(repack, wrong, dataset)
    assert any(m.startswith(("tokens of sequence", "cannot read")) for m in found), found
