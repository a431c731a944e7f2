"""``SourceDataset`` answers like Megatron-Core's ``IndexedDataset`` on every source.

The demo blend mixes uint16 and int32 sources, multi-sequence documents, empty sequences, an
empty document and multimodal sources; it is read from a repack with default shards and from
one cut into 8 KiB shards (most sources span several), with both backends. Only what Megatron
itself supports is compared (its ``sequence_modes`` property cannot answer for more than one
sequence, so modes are compared with its index's).
"""

from __future__ import annotations

import copy
import os
import pickle
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

with warnings.catch_warnings():  # Megatron warns that Transformer Engine/Apex are missing
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

from repack.errors import FormatError, RepackError, UnknownSource
from repack.format.manifest import load_manifest
from repack.read.views import SourceDataset
from repack.synth import DemoBlend


class Refused:
    """What a read that raised FormatError returns here (a damaged index is refused)."""


pytestmark = pytest.mark.megatron


def attempt(read):
    try:
        return read()
    except FormatError:
        return Refused()


def same_item(found, expected, multimodal: bool) -> bool:
    """``[int]``/``get`` results agree: tokens (values and dtype), and the mode if any."""
    if isinstance(found, Refused):
        return False
    if multimodal:
        if not (isinstance(found, tuple) and isinstance(expected, tuple)):
            return False
        (found, found_mode), (expected, expected_mode) = found, expected
        if found_mode != expected_mode:
            return False
    return found.dtype == expected.dtype and np.array_equal(found, expected)


def same_slice(found, expected, multimodal: bool) -> bool:
    """``[slice]`` results agree: one array per sequence, and the modes if any."""
    if isinstance(found, Refused):
        return False
    if multimodal:
        (found, found_modes), (expected, expected_modes) = found, expected
        if not np.array_equal(found_modes, expected_modes):
            return False
    return len(found) == len(expected) and all(
        a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(found, expected)
    )


def raises(call, error: type[Exception]) -> bool:
    try:
        call()
    except error:
        return True
    return False


def mismatches(view: SourceDataset, megatron: IndexedDataset, multimodal: bool) -> list[str]:
    """Every way in which ``view`` answers other than ``megatron``."""
    found = []
    n = len(megatron)
    index = megatron.index
    if len(view) != n:
        return [f"{len(view)} sequences, Megatron {n}"]
    if view.path_prefix != megatron.path_prefix:
        found.append(f"path_prefix {view.path_prefix!r}")
    if view.dtype != index.dtype:
        found.append(f"dtype {view.dtype}")
    arrays = {
        "sequence_lengths": (view.sequence_lengths, megatron.sequence_lengths, np.int32),
        "sequence_pointers": (view.sequence_pointers, index.sequence_pointers, np.int64),
        "document_indices": (view.document_indices, megatron.document_indices, np.int64),
        "get_document_indices": (
            view.get_document_indices(),
            megatron.get_document_indices(),
            np.int64,
        ),
    }
    if index.sequence_modes is not None:
        arrays["sequence_modes"] = (view.sequence_modes, index.sequence_modes, np.int8)
    for name, (ours, theirs, dtype) in arrays.items():
        if ours.dtype != dtype or not np.array_equal(ours, theirs):
            found.append(name)

    for i in [*range(n), -1, -n, np.int64(n // 2), np.int32(-1)]:
        if not same_item(attempt(lambda i=i: view[i]), megatron[i], multimodal):
            found.append(f"[{i!r}]")
    for i, length in enumerate(megatron.sequence_lengths.tolist()):
        calls = [(i,), (i, 0, length)]
        if length >= 3:
            calls += [(i, 1, length - 2), (i, 2), (i, length - 1, 1), (i, 1, 0)]
        for args in calls:
            if not same_item(attempt(lambda a=args: view.get(*a)), megatron.get(*args), multimodal):
                found.append(f"get{args}")

    slices = [slice(None), slice(0, n + 5), slice(n // 2, None), slice(None, max(1, n // 2))]
    if n > 2:
        slices += [slice(1, n - 1), slice(-2, None), slice(n // 3, 2 * n // 3 + 1)]
    for s in slices:
        if not same_slice(attempt(lambda s=s: view[s]), megatron[s], multimodal):
            found.append(f"[{s.start}:{s.stop}]")
    if n >= 2:
        for s in (slice(None, None, 2), slice(None, None, -1)):
            if not (
                raises(lambda s=s: view[s], ValueError)
                and raises(lambda s=s: megatron[s], ValueError)
            ):
                found.append(f"[::{s.step}] is not a ValueError on both sides")
    if not (raises(lambda: view["0"], TypeError) and raises(lambda: megatron["0"], TypeError)):
        found.append("['0'] is not a TypeError on both sides")

    prefix = megatron.path_prefix
    if not (view.exists() and view.exists(prefix) and IndexedDataset.exists(prefix)):
        found.append("exists()")
    if view.exists(prefix + "-missing") or IndexedDataset.exists(prefix + "-missing"):
        found.append("exists() of a missing prefix")
    return found


@pytest.mark.parametrize("which", ["demo_repack", "demo_repack_cut"])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_every_source_reads_like_indexed_dataset(
    request: pytest.FixtureRequest, demo_blend: DemoBlend, which: str, backend: str
) -> None:
    out: Path = request.getfixturevalue(which)
    sources = load_manifest(out).sources
    if which == "demo_repack_cut":  # premise: the views must stitch segments together
        assert sum(len(s.segments) > 1 for s in sources) > 50
    multimodal = set(demo_blend.multimodal)
    problems = {}
    for prefix in demo_blend.prefixes:
        for mm in {False, prefix in multimodal}:  # modes asked for, or not, on both sides
            megatron = IndexedDataset(prefix, multimodal=mm, mmap=backend == "mmap")
            view = SourceDataset(str(out), prefix, multimodal=mm, mmap=backend == "mmap")
            assert view.repack.backend == backend
            found = mismatches(view, megatron, mm)
            if found:
                problems[(prefix, mm)] = found
            del megatron  # after the comparison: it unmaps its files when collected
    assert problems == {}


def shift_pointers(view: SourceDataset, by: int) -> None:
    """Make ``view`` read pointers ``by`` bytes off: the view reads its pointers from the
    repack's index, as arrays (``pointers``) and item by item (``pointer_values``)."""
    shifted = copy.copy(view.repack)
    shifted.pointers = shifted.pointers + by
    shifted.pointer_values = memoryview(shifted.pointers)
    view.repack = shifted


def test_mismatches_sees_a_wrong_answer(demo_blend: DemoBlend, demo_repack: Path) -> None:
    """The comparison is not vacuous: pointers one token off are seen, in the pointers and in
    every read."""
    prefix = demo_blend.prefixes[10]
    megatron = IndexedDataset(prefix)
    view = SourceDataset(str(demo_repack), prefix)
    assert mismatches(view, megatron, False) == []
    shift_pointers(view, view.dtype.itemsize)
    found = mismatches(view, megatron, False)
    assert "sequence_pointers" in found
    assert "[0]" in found and "get(0,)" in found and "[None:None]" in found


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_pickled_view_is_equal_and_shares_the_repack(
    demo_blend: DemoBlend, demo_repack_cut: Path, backend: str
) -> None:
    for prefix in demo_blend.prefixes[:12] + demo_blend.multimodal[:2]:
        mm = prefix in demo_blend.multimodal
        view = SourceDataset(str(demo_repack_cut), prefix, multimodal=mm, mmap=backend == "mmap")
        clone = pickle.loads(pickle.dumps(view))
        assert clone is not view
        assert clone.repack is view.repack
        assert clone.path_prefix == prefix
        assert clone.multimodal == mm and clone.repack.backend == backend
        assert repr(clone) == repr(view)
        assert len(clone) == len(view)
        for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
            assert np.array_equal(getattr(clone, name), getattr(view, name))
        assert same_slice(clone[:], view[:], mm)


def test_views_of_a_repack_share_one_repack(demo_blend: DemoBlend, demo_repack: Path) -> None:
    views = [SourceDataset(str(demo_repack), p) for p in demo_blend.prefixes[:50]]
    assert len({id(v.repack) for v in views}) == 1
    pread = SourceDataset(str(demo_repack), demo_blend.prefixes[0], mmap=False)
    assert pread.repack is not views[0].repack and pread.repack.backend == "pread"


def test_prefix_as_written_in_the_blend_names_the_same_source(
    demo_blend: DemoBlend, demo_repack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative prefixes, as the flat blend writes most of them, resolve like Megatron's:
    against the working directory."""
    manifest = load_manifest(demo_repack)
    monkeypatch.chdir(demo_blend.root)
    for source in manifest.sources[:30]:
        relative = os.path.relpath(source.path, demo_blend.root)
        for spelling in {*source.prefixes, source.path, relative, "./" + relative}:
            view = SourceDataset(str(demo_repack), spelling)
            assert view.source == source, spelling
            assert view.path_prefix == spelling


def test_unknown_prefix_is_named(demo_blend: DemoBlend, demo_repack: Path) -> None:
    missing = demo_blend.prefixes[0] + "-not-merged"
    with pytest.raises(UnknownSource, match=re.escape(missing)):
        SourceDataset(str(demo_repack), missing)


def test_modes_of_a_plain_source_are_refused(demo_blend: DemoBlend, demo_repack: Path) -> None:
    plain = next(p for p in demo_blend.prefixes if p not in demo_blend.multimodal)
    with pytest.raises(RepackError, match=re.escape(plain)):
        SourceDataset(str(demo_repack), plain, multimodal=True)
    with pytest.raises(AttributeError, match="not a multimodal source"):
        SourceDataset(str(demo_repack), plain).sequence_modes  # noqa: B018


def test_out_of_range_index_is_an_index_error(demo_blend: DemoBlend, demo_repack: Path) -> None:
    view = SourceDataset(str(demo_repack), demo_blend.prefixes[5])
    megatron = IndexedDataset(demo_blend.prefixes[5])
    n = len(view)
    for i in (n, -n - 1):
        with pytest.raises(IndexError):
            view[i]
        with pytest.raises(IndexError):
            megatron[i]
        with pytest.raises(IndexError):
            view.get(i)


def test_a_pointer_out_of_its_segment_is_refused(demo_blend: DemoBlend, demo_repack: Path):
    """A damaged pointer never serves another source's bytes: the read is refused."""
    view = SourceDataset(str(demo_repack), demo_blend.prefixes[10])
    shift_pointers(view, view.source.segments[0].size)  # past its segment
    with pytest.raises(FormatError, match="damaged or the request is out of range"):
        view[0]
    with pytest.raises(FormatError):
        view.get(len(view) - 1, 1)


def test_byte_ranges_are_byte_range_for_every_piece(demo_blend: DemoBlend, tmp_path: Path) -> None:
    """``byte_ranges`` (what ``repack bench`` plans with) is ``byte_range`` (what every read
    asks) piece by piece, sources cut across shards included, and refuses what it refuses."""
    from repack.merge import merge

    out = tmp_path / "small-shards"
    merge(demo_blend.flat_json, out, shard_size=4096)  # sources cut across shards
    cut = 0
    for source in load_manifest(out).sources[:40]:
        view = SourceDataset(str(out), source.name)
        cut += len(source.segments) > 1
        n = len(view)
        idx = np.arange(n)
        offset = np.minimum(1, view.sequence_lengths)
        count = view.sequence_lengths - offset
        found = view.byte_ranges(idx, offset, count)
        for i in range(n):
            expected = view.byte_range(i, int(offset[i]), int(count[i]))
            assert tuple(int(a[i]) for a in found) == expected
    assert cut > 0
    with pytest.raises(FormatError, match="would read bytes"):
        view.byte_ranges(np.array([0]), np.array([0]), np.array([view.sequence_lengths[0] + 10**6]))
