"""verify finds every flipped byte, truncation and extension, names the damaged file and the
sources the damage affects, and compares originals on request."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from repack.cli import main
from repack.format import spec as fmt
from repack.format.manifest import Manifest, SourceEntry, load_manifest
from repack.merge import merge
from repack.read.verify import VerifyReport, verify
from repack.synth import DemoBlend, make_blend

SHARD_SIZE = 8192


@pytest.fixture(scope="module")
def small_blend(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    """24 sources, uint16 and int32, 3 multimodal ones."""
    return make_blend(
        tmp_path_factory.mktemp("verify-src"),
        24,
        seed=5,
        tokens_per_source=(100, 3000),
        multimodal_fraction=0.1,
    )


@pytest.fixture(scope="module")
def pristine(small_blend: DemoBlend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repack in 8 KiB shards: padding between segments, sources cut across shards."""
    out = tmp_path_factory.mktemp("verify-pristine") / "out"
    merge(small_blend.flat_json, out, shard_size=SHARD_SIZE)
    return out


@pytest.fixture
def repack(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of ``pristine`` that a test may damage."""
    out = tmp_path / "out"
    shutil.copytree(pristine, out)
    return out


@contextmanager
def flipped(path: Path, position: int) -> Iterator[None]:
    """Invert every bit of one byte of ``path``; restore it afterwards."""
    data = bytearray(path.read_bytes())
    original = bytes(data)
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))
    try:
        yield
    finally:
        path.write_bytes(original)


@contextmanager
def resized(path: Path, delta: int) -> Iterator[None]:
    """Drop the last byte (``delta=-1``) or append one (``delta=1``); restore afterwards."""
    original = path.read_bytes()
    path.write_bytes(original[:-1] if delta < 0 else original + b"\x00")
    try:
        yield
    finally:
        path.write_bytes(original)


def verdict(report: VerifyReport) -> tuple[set[str], set[str]]:
    """(files named by the problems, sources named by the problems)."""
    files = {p.file for p in report.problems}
    sources = {s for p in report.problems for s in p.sources}
    return files, sources


def check_damage(
    out: Path, file: str, position: int, affected: set[str] | None, failures: list[str]
) -> None:
    """Flip the byte at ``position`` of ``file``; verify must name exactly ``file`` and, if
    ``affected`` is given, exactly those sources."""
    with flipped(out / file, position):
        report = verify(out)
    files, sources = verdict(report)
    where = f"{file}@{position}"
    if report.ok:
        failures.append(f"{where}: not detected")
    elif files != {file}:
        failures.append(f"{where}: problems name {sorted(files)}")
    elif affected is not None and sources != affected:
        failures.append(f"{where}: affects {sorted(sources)}, expected {sorted(affected)}")


def test_fresh_repack_verifies(pristine: Path) -> None:
    report = verify(pristine)
    assert report.ok, report.problems
    manifest = load_manifest(pristine)
    assert len(manifest.shards) > 5  # premise: several shards
    assert report.files == 3 + len(manifest.shards)  # manifest, index, fingerprints, shards
    assert report.sources == len(manifest.sources) == 24
    fingerprints = (pristine / "fingerprints.rpf").stat().st_size
    assert report.bytes == manifest.index_size + sum(s.size for s in manifest.shards) + (
        fingerprints
    )


# --- a flipped byte -------------------------------------------------------------------------


def segments_by_shard(manifest: Manifest) -> dict[int, list[tuple[int, int, SourceEntry]]]:
    by_shard: dict[int, list[tuple[int, int, SourceEntry]]] = {}
    for source in manifest.sources:
        for seg in source.segments:
            by_shard.setdefault(seg.shard, []).append((seg.offset, seg.size, source))
    for segments in by_shard.values():
        segments.sort(key=lambda s: s[0])
    return by_shard


def test_flipped_byte_in_source_data_names_shard_and_source(repack: Path) -> None:
    manifest = load_manifest(repack)
    failures: list[str] = []
    checked = 0
    for number, segments in segments_by_shard(manifest).items():
        file = manifest.shards[number].file
        for offset, size, source in segments:
            if size == 0:
                continue
            for position in sorted({offset, offset + size // 2, offset + size - 1}):
                check_damage(repack, file, position, {source.name}, failures)
                checked += 1
    assert checked > 3 * len(manifest.shards)
    assert failures == []


def test_flipped_byte_in_alignment_padding_names_shard_only(repack: Path) -> None:
    manifest = load_manifest(repack)
    failures: list[str] = []
    gaps = 0
    for number, segments in segments_by_shard(manifest).items():
        for (offset, size, _), (next_offset, _, _) in itertools.pairwise(segments):
            if next_offset > offset + size:
                gaps += 1
                file = manifest.shards[number].file
                for position in {offset + size, next_offset - 1}:
                    check_damage(repack, file, position, set(), failures)
    assert gaps >= 2, "premise: some shards hold padding between segments"
    assert failures == []
    # the message says where the damage is
    number, segments = next((n, s) for n, s in segments_by_shard(manifest).items() if len(s) > 1)
    with flipped(repack / manifest.shards[number].file, segments[0][0] + segments[0][1]):
        report = verify(repack)
    assert "alignment padding" in report.problems[0].message


def owner_of_sequence(manifest: Manifest, sequence: int) -> SourceEntry:
    return next(
        s
        for s in manifest.sources
        if s.sequence_start <= sequence < s.sequence_start + s.sequence_count
    )


def owner_of_document(manifest: Manifest, document: int) -> SourceEntry:
    return next(
        s
        for s in manifest.sources
        if s.document_start <= document < s.document_start + s.document_count
    )


def test_flipped_byte_in_index_names_index_and_source(repack: Path) -> None:
    manifest = load_manifest(repack)
    layout = fmt.index_layout(manifest.sequence_count, manifest.document_count)
    n_seq, n_doc = manifest.sequence_count, manifest.document_count
    multimodal = [s for s in manifest.sources if s.multimodal]
    plain = [s for s in manifest.sources if not s.multimodal and s.sequence_count]
    assert multimodal and plain
    cases: list[tuple[int, set[str] | None]] = [
        (0, None),  # magic
        (8, None),  # version
        (12, None),  # flags
        (16, None),  # sequence count
        (24, None),  # document count
        (40, None),  # reserved
        (fmt.INDEX_HEADER_SIZE - 1, None),
    ]
    for sequence in (0, n_seq // 2, n_seq - 1):
        name = {owner_of_sequence(manifest, sequence).name}
        cases.append((layout.lengths + 4 * sequence, name))  # low byte of a length
        cases.append((layout.lengths + 4 * sequence + 3, name))  # its high byte
        cases.append((layout.pointers + 8 * sequence + 1, name))
    for document in (0, n_doc // 2, n_doc - 1):
        cases.append(
            (layout.documents + 8 * document, {owner_of_document(manifest, document).name})
        )
    mm = multimodal[0]
    cases.append((layout.modes + mm.sequence_start, {mm.name}))
    # the mode byte of a plain source belongs to no original .idx: only the file checksum
    cases.append((layout.modes + plain[0].sequence_start, set()))
    if layout.pointers > layout.lengths + 4 * n_seq:
        cases.append((layout.pointers - 1, set()))  # array alignment padding
    failures: list[str] = []
    for position, affected in cases:
        check_damage(repack, fmt.INDEX_FILE, position, affected, failures)
    assert failures == []


def test_flipped_byte_in_manifest_names_manifest(repack: Path) -> None:
    data = (repack / fmt.MANIFEST_FILE).read_bytes()
    member = data.index(b'"checksum": "') + len(b'"checksum": "')
    positions = [
        0,
        1,
        member,  # algorithm name
        member + len("xxh3-128:"),  # first hex digit
        member + len("xxh3-128:") + 20,
        len(data) // 3,
        len(data) // 2,
        len(data) - 2,
        len(data) - 1,
    ]
    failures: list[str] = []
    for position in positions:
        check_damage(repack, fmt.MANIFEST_FILE, position, set(), failures)
    assert failures == []


def test_cli_prints_fail_lines_and_exits_1(repack: Path) -> None:
    manifest = load_manifest(repack)
    source = manifest.sources[3]
    seg = source.segments[0]
    shard = manifest.shards[seg.shard].file
    with flipped(repack / shard, seg.offset + seg.size // 2):
        result = CliRunner().invoke(main, ["verify", "-q", str(repack)])
    assert result.exit_code == 1
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
    assert len(fails) == 1
    assert fails[0].startswith(f"FAIL {shard}: ") and source.name in fails[0]
    assert "DAMAGED (1 problem)" in result.stdout
    assert "Traceback" not in result.output


# --- truncation, extension, missing files ---------------------------------------------------


@pytest.mark.parametrize("delta", [-1, 1], ids=["truncated", "extended"])
def test_truncated_or_extended_file_is_named(repack: Path, delta: int) -> None:
    failures = []
    names = sorted(os.listdir(repack))
    assert len(names) > 5
    for name in names:
        with resized(repack / name, delta):
            report = verify(repack)
        files, _ = verdict(report)
        if report.ok or files != {name}:
            failures.append(f"{name}: problems name {sorted(files)}")
    assert failures == []


def test_truncated_shard_names_the_source_at_its_end(repack: Path) -> None:
    manifest = load_manifest(repack)
    shard = manifest.shards[-1]
    last = max(
        (seg.offset, source.name)
        for source in manifest.sources
        for seg in source.segments
        if seg.shard == shard.number
    )[1]
    with resized(repack / shard.file, -1):
        report = verify(repack)
    assert [(p.file, p.sources) for p in report.problems] == [(shard.file, (last,))]
    assert "truncated" in report.problems[0].message


def test_truncated_shard_with_sources_is_reported_not_aborted(repack: Path) -> None:
    """Comparing the originals with a shard shorter than the manifest says reports damage (it
    used to escape as EOFError, which click prints as a bare 'Aborted!')."""
    shard = load_manifest(repack).shards[-1]
    for as_json in (False, True):
        with resized(repack / shard.file, -1):
            result = CliRunner().invoke(
                main, ["verify", "-q", "--sources", *(["--json"] * as_json), str(repack)]
            )
        assert result.exit_code == 1, result.output
        assert result.stderr == "" and "Aborted" not in result.output
        if as_json:
            messages = [p["message"] for p in json.loads(result.stdout)["problems"]]
        else:
            messages = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
            assert result.stdout.splitlines()[-1].startswith("DAMAGED (2 problems)")
        assert len(messages) == 2 and "truncated" in messages[0]
        assert f"cannot compare: {repack / shard.file}: ends 1 bytes before offset" in messages[1]


def test_missing_file_is_named(repack: Path) -> None:
    failures = []
    for name in sorted(os.listdir(repack)):
        data = (repack / name).read_bytes()
        (repack / name).unlink()
        try:
            report = verify(repack)
        finally:
            (repack / name).write_bytes(data)
        files, _ = verdict(report)
        if report.ok or files != {name}:
            failures.append(f"{name}: problems name {sorted(files)}")
    assert failures == []
    assert verify(repack).ok  # restored


# --- --sources: the originals ---------------------------------------------------------------


@pytest.fixture
def own_blend(tmp_path: Path) -> tuple[DemoBlend, Path]:
    """A blend whose originals a test may modify, and its repack."""
    blend = make_blend(tmp_path / "src", 6, seed=2, tokens_per_source=(50, 500))
    out = tmp_path / "out"
    merge(blend.flat_json, out)
    return blend, out


def test_sources_compares_originals(own_blend: tuple[DemoBlend, Path]) -> None:
    _, out = own_blend
    report = verify(out, sources=True)
    assert report.ok and report.originals_compared == 6 and report.originals_missing == []


def test_sources_detects_modified_bin(own_blend: tuple[DemoBlend, Path]) -> None:
    blend, out = own_blend
    victim = blend.prefixes[2]
    bin_path = Path(victim + ".bin")
    data = bytearray(bin_path.read_bytes())
    data[37] ^= 1
    bin_path.write_bytes(bytes(data))
    assert verify(out).ok  # the repack itself is intact
    report = verify(out, sources=True)
    assert not report.ok
    assert [(p.file, p.message) for p in report.problems] == [
        (victim, "original .bin differs from the repack at byte 37")
    ]
    assert report.problems[0].sources == (load_manifest(out).sources[2].name,)


def test_sources_detects_modified_idx_and_resized_bin(own_blend: tuple[DemoBlend, Path]) -> None:
    blend, out = own_blend
    idx_path = Path(blend.prefixes[1] + ".idx")
    data = bytearray(idx_path.read_bytes())
    data[fmt.MEGATRON_HEADER_SIZE] ^= 1  # first sequence length
    idx_path.write_bytes(bytes(data))
    with open(blend.prefixes[4] + ".bin", "ab") as stream:
        stream.write(b"\x00\x00")
    report = verify(out, sources=True)
    messages = {p.file: p.message for p in report.problems}
    assert messages == {
        blend.prefixes[1]: f"original .idx differs from the repack at byte "
        f"{fmt.MEGATRON_HEADER_SIZE}",
        blend.prefixes[4]: f"original .bin has {os.path.getsize(blend.prefixes[4] + '.bin')} "
        f"bytes, the repack {os.path.getsize(blend.prefixes[4] + '.bin') - 2}",
    }


def test_sources_reports_missing_originals_without_failing(
    own_blend: tuple[DemoBlend, Path],
) -> None:
    blend, out = own_blend
    os.unlink(blend.prefixes[0] + ".bin")
    os.unlink(blend.prefixes[5] + ".idx")
    report = verify(out, sources=True)
    names = [s.name for s in load_manifest(out).sources]
    assert report.ok
    assert report.originals_missing == [names[0], names[5]]
    assert report.originals_compared == 4
    result = CliRunner().invoke(main, ["verify", "-q", "--sources", str(out)])
    assert result.exit_code == 0
    assert "OK: " in result.stdout and "4 originals compared" in result.stdout
    assert "2 no longer exist" in result.stdout


def test_json_report(own_blend: tuple[DemoBlend, Path]) -> None:
    _, out = own_blend
    result = CliRunner().invoke(main, ["verify", "-q", "--json", str(out)])
    assert result.exit_code == 0
    good = json.loads(result.stdout)
    assert good["ok"] is True and good["problems"] == [] and good["sources_checked"] == 6

    manifest = load_manifest(out)
    seg = manifest.sources[0].segments[0]
    with flipped(out / manifest.shards[seg.shard].file, seg.offset):
        result = CliRunner().invoke(main, ["verify", "-q", "--json", str(out)])
    assert result.exit_code == 1
    bad = json.loads(result.stdout)
    assert bad["ok"] is False
    assert [(p["file"], p["sources"]) for p in bad["problems"]] == [
        (manifest.shards[seg.shard].file, [manifest.sources[0].name])
    ]
    np.testing.assert_equal(bad["files_checked"], good["files_checked"])


def test_broken_index_header_does_not_stop_the_shard_checks(repack: Path) -> None:
    manifest = load_manifest(repack)
    source = next(s for s in manifest.sources if s.bin_size)
    seg = source.segments[0]
    shard = manifest.shards[seg.shard].file
    with flipped(repack / fmt.INDEX_FILE, 0), flipped(repack / shard, seg.offset):
        report = verify(repack)
    files, _ = verdict(report)
    assert files == {fmt.INDEX_FILE, shard}
    index_problem = next(p for p in report.problems if p.file == fmt.INDEX_FILE)
    assert "bad magic" in index_problem.message
    assert set(index_problem.sources) == {s.name for s in manifest.sources}


def test_missing_folder_is_an_input_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "nope")])
    assert result.exit_code == 3
    assert result.stderr.startswith("Error: ") and "no such folder" in result.stderr
