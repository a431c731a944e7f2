"""merge then extract gives back every source byte for byte, whatever the blend form and
shard size; and the shards are laid out as the format promises."""

from __future__ import annotations

import dataclasses
import filecmp
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest

from repack.errors import OutputExists, UnknownSource
from repack.format import spec as fmt
from repack.format.manifest import Manifest, load_manifest
from repack.inputs.blend_files import load_blend
from repack.inputs.sources import read_source_index
from repack.merge import merge
from repack.read.extract import extract
from repack.read.verify import verify
from repack.synth import DemoBlend


def assert_identical(original: str, extracted: str | Path) -> None:
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(original + ext, f"{extracted}{ext}", shallow=False), (
            f"{extracted}{ext} differs from {original}{ext}"
        )


def extract_all(out: Path, spellings: dict[str, str], dest: Path) -> int:
    """Extract each source by the spelling given (``spelling -> original absolute prefix``)
    and compare it with the original; return how many were compared."""
    for n, (spelling, original) in enumerate(spellings.items()):
        target = dest / f"s{n}"
        entry = extract(out, spelling, target)
        assert entry.path == original
        assert_identical(original, target)
    return len(spellings)


def blend_spellings(blend_file: Path) -> dict[str, str]:
    """Every prefix as written in the blend file -> its absolute path."""
    blend = load_blend(blend_file)
    return {e.prefix: e.path for entries in blend.splits.values() for e in entries or ()}


def test_flat_blend_round_trips_by_prefix_as_written(
    demo_blend: DemoBlend, demo_repack: Path, tmp_path: Path
) -> None:
    flat = json.loads(demo_blend.flat_json.read_text())
    written = flat[1::2]
    spellings = dict(zip(written, demo_blend.prefixes, strict=True))
    assert any(not os.path.isabs(p) for p in spellings)
    assert extract_all(demo_repack, spellings, tmp_path) == len(demo_blend.prefixes) >= 300


def test_flat_blend_round_trips_by_absolute_path(
    demo_blend: DemoBlend, demo_repack: Path, tmp_path: Path
) -> None:
    # every tenth source is enough here: the loop above covers all of them by prefix
    spellings = {p: p for p in demo_blend.prefixes[::10]}
    extract_all(demo_repack, spellings, tmp_path)


@pytest.mark.parametrize("form", ["per_split_json", "data_args_txt"])
def test_other_blend_forms_round_trip(demo_blend: DemoBlend, tmp_path: Path, form: str) -> None:
    blend_file = getattr(demo_blend, form)
    out = tmp_path / "out"
    merge(blend_file, out)
    spellings = blend_spellings(blend_file)
    manifest = load_manifest(out)
    assert len(manifest.sources) == len(set(spellings.values())) == len(demo_blend.prefixes)
    assert extract_all(out, spellings, tmp_path / "x") == len(demo_blend.prefixes)


def test_prefix_in_several_splits_is_stored_once(demo_blend: DemoBlend, tmp_path: Path) -> None:
    out = tmp_path / "out"
    merge(demo_blend.per_split_json, out)
    blend = load_blend(demo_blend.per_split_json)
    uses: dict[str, int] = {}
    for entries in blend.splits.values():
        for entry in entries or ():
            uses[entry.path] = uses.get(entry.path, 0) + 1
    shared = [p for p, n in uses.items() if n > 1]
    assert shared, "the demo blend should reuse prefixes across splits"

    manifest = load_manifest(out)
    paths = [s.path for s in manifest.sources]
    assert sorted(paths) == sorted(uses)  # each source once
    stored = sum(seg.size for s in manifest.sources for seg in s.segments)
    assert stored == sum(os.path.getsize(p + ".bin") for p in uses)
    index_sequences = sum(read_source_index(p).info.sequence_count for p in uses)
    assert manifest.sequence_count == index_sequences


def test_one_source_spelled_two_ways_is_stored_once(make_source, tmp_path: Path) -> None:
    prefix = make_source("data/a", [[1, 2, 3], [4, 5]])
    blend_file = tmp_path / "blend.json"
    blend_file.write_text(json.dumps([0.5, "data/a", 0.5, prefix]))
    out = tmp_path / "out"
    merge(blend_file, out)
    manifest = load_manifest(out)
    assert len(manifest.sources) == 1
    assert manifest.sources[0].prefixes == ("data/a", prefix)
    for n, spelling in enumerate(["data/a", prefix, prefix.replace("/data/", "/data/./")]):
        extract(out, spelling, tmp_path / f"x{n}")
        assert_identical(prefix, tmp_path / f"x{n}")


def test_sha256_round_trips(demo_blend: DemoBlend, tmp_path: Path) -> None:
    out = tmp_path / "out"
    merge(demo_blend.flat_json, out, algorithm="sha256")
    manifest = load_manifest(out)
    assert manifest.algorithm == "sha256"
    checksums = [manifest.checksum, manifest.index_checksum]
    checksums += [s.checksum for s in manifest.shards]
    for source in manifest.sources:
        checksums += [source.bin_checksum, source.idx_checksum]
        checksums += [seg.checksum for seg in source.segments]
    assert all(c.startswith("sha256:") and len(c) == 7 + 64 for c in checksums)
    assert verify(out).ok
    # the checksum algorithm does not touch the data path: a sample of sources suffices
    spellings = {p: p for p in demo_blend.prefixes[::7]}
    extract_all(out, spellings, tmp_path / "x")


# --- layout: dtypes, cutting, alignment -----------------------------------------------------


def shard_layout_problems(out: Path, manifest: Manifest, shard_size: int) -> list[str]:
    """Everything wrong with the layout ``manifest`` describes of the repack in ``out``
    (empty when all holds)."""
    problems = []
    by_shard: dict[int, list[tuple[int, int, int]]] = {}
    for source in manifest.sources:
        index = read_source_index(source.path)
        lengths = index.lengths.astype(np.int64)
        itemsize = source.dtype.itemsize
        covered = 0
        for seg in source.segments:
            shard = manifest.shards[seg.shard]
            name = f"{source.name} segment at sequence {seg.first}"
            if shard.dtype_code != source.dtype_code:
                problems.append(f"{name}: dtype {source.dtype_code} in shard {shard.dtype_code}")
            expected = int(lengths[seg.first : seg.first + seg.count].sum()) * itemsize
            if seg.size != expected:
                problems.append(f"{name}: {seg.size} bytes, its sequences hold {expected}")
            if seg.count and seg.source_offset != int(index.pointers[seg.first]):
                problems.append(f"{name}: does not start at its first sequence")
            if seg.source_offset != covered:
                problems.append(f"{name}: does not continue the previous segment")
            if seg.offset % fmt.ALIGNMENT:
                problems.append(f"{name}: offset {seg.offset} not aligned")
            if seg.offset + seg.size > shard.size:
                problems.append(f"{name}: ends past {shard.file}")
            if os.path.getsize(out / shard.file) != shard.size:
                problems.append(f"{shard.file}: size differs from the manifest")
            covered += seg.size
            by_shard.setdefault(seg.shard, []).append((seg.offset, seg.size, seg.count))
        if covered != source.bin_size or sum(s.count for s in source.segments) != len(lengths):
            problems.append(f"{source.name}: segments do not cover the source")
    for number, segments in by_shard.items():
        segments.sort()
        for (offset, size, _), (next_offset, _, _) in itertools.pairwise(segments):
            if offset + size > next_offset:
                problems.append(f"shard {number}: segments overlap at {next_offset}")
        if manifest.shards[number].size > shard_size and not (
            len(segments) == 1 and segments[0][2] == 1
        ):
            problems.append(f"shard {number}: larger than {shard_size} without a lone sequence")
    if set(by_shard) != set(range(len(manifest.shards))):
        problems.append("some shard holds no segment")
    return problems


def test_default_shards_hold_one_dtype_each(demo_repack: Path) -> None:
    manifest = load_manifest(demo_repack)
    # the demo blend mixes uint16 and int32: one shard each with the default shard size,
    # in order of first appearance
    assert [s.dtype_code for s in manifest.shards] == list(
        dict.fromkeys(s.dtype_code for s in manifest.sources)
    )
    assert len(manifest.shards) == 2
    assert all(len(s.segments) == 1 for s in manifest.sources)
    assert shard_layout_problems(demo_repack, manifest, 64 * 1024**3) == []


def test_small_shards_cut_sources_at_sequence_boundaries(
    demo_blend: DemoBlend, demo_repack_cut: Path, tmp_path: Path
) -> None:
    manifest = load_manifest(demo_repack_cut)
    cut = [s for s in manifest.sources if len(s.segments) > 1]
    assert len(cut) > 50, "premise: many sources are larger than an 8 KiB shard"
    assert any(len({seg.shard for seg in s.segments}) >= 3 for s in cut)
    assert {s.dtype_code for s in manifest.shards} == {4, 8}
    assert shard_layout_problems(demo_repack_cut, manifest, 8192) == []
    spellings = {p: p for p in demo_blend.prefixes}
    assert extract_all(demo_repack_cut, spellings, tmp_path) == len(demo_blend.prefixes)


def test_layout_checker_catches_a_straddling_segment(demo_repack_cut: Path) -> None:
    """shard_layout_problems is not vacuous: move a segment boundary by one token."""
    manifest = load_manifest(demo_repack_cut)
    n, source = next((n, s) for n, s in enumerate(manifest.sources) if len(s.segments) > 1)
    itemsize = source.dtype.itemsize
    first, second, *rest = source.segments
    first = dataclasses.replace(first, size=first.size + itemsize)
    second = dataclasses.replace(
        second, source_offset=second.source_offset + itemsize, size=second.size - itemsize
    )
    source = dataclasses.replace(source, segments=(first, second, *rest))
    sources = (*manifest.sources[:n], source, *manifest.sources[n + 1 :])
    damaged = dataclasses.replace(manifest, sources=sources)
    problems = shard_layout_problems(demo_repack_cut, damaged, 8192)
    assert any("its sequences hold" in p for p in problems), problems


def test_empty_sources_round_trip(make_source, write_blend, tmp_path: Path) -> None:
    prefixes = [
        make_source("no-sequences", []),
        make_source("one-empty-sequence", [[]], dtype=np.int32),
        make_source("empty-documents", [[], [7], []], documents=[0, 0, 2, 3, 3]),
        make_source("mm", [[1, 2], [], [3]], modes=[0, 1, 0]),
    ]
    out = tmp_path / "out"
    merge(write_blend(prefixes), out)
    assert verify(out).ok
    for n, prefix in enumerate(prefixes):
        extract(out, prefix, tmp_path / f"x{n}")
        assert_identical(prefix, tmp_path / f"x{n}")


def test_extract_unknown_source(demo_repack: Path, tmp_path: Path) -> None:
    with pytest.raises(UnknownSource, match=r"no source 'data/web/cc-99999'"):
        extract(demo_repack, "data/web/cc-99999", tmp_path / "x")
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.idx").exists()


def test_extract_refuses_to_overwrite_unless_asked(
    demo_blend: DemoBlend, demo_repack: Path, tmp_path: Path
) -> None:
    source = demo_blend.prefixes[5]
    (tmp_path / "x.idx").write_bytes(b"keep me")
    with pytest.raises(OutputExists, match=r"x\.idx"):
        extract(demo_repack, source, tmp_path / "x")
    assert (tmp_path / "x.idx").read_bytes() == b"keep me"
    extract(demo_repack, source, tmp_path / "x", overwrite=True)
    assert_identical(source, tmp_path / "x")
    assert sorted(os.listdir(tmp_path)) == ["x.bin", "x.idx"]  # no temp files left behind
