"""Document fingerprints (docs/format.md 2.11): written by merge, its tasks, workers, zstd
shards and ``add``, kept right by ``remove``, checked by ``verify``.

The expected fingerprints are computed here from the original ``.bin``/``.idx`` files with
numpy and xxhash directly (the spec's definition), never with repack's hasher.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import xxhash
from click.testing import CliRunner

from repack.cli import main
from repack.format import spec as fmt
from repack.merge import merge
from repack.merge.append import add
from repack.merge.remove import remove
from repack.read.fingerprints import EMPTY, load_fingerprints
from repack.read.reader import Repack
from repack.read.verify import verify
from repack.synth import make_blend


@pytest.fixture(scope="module")
def small_blend(tmp_path_factory: pytest.TempPathFactory):
    """40 sources of the demo generator (multi-sequence documents, edge cases), and their
    merge into 8 KiB shards (most sources cut across shards)."""
    blend = make_blend(tmp_path_factory.mktemp("small"), 40, seed=4)
    out = tmp_path_factory.mktemp("small-repack") / "out"
    merge(blend.flat_json, out, shard_size=8192)
    return blend, out


def expected_of(prefix: str) -> list[int]:
    """XXH3-64 of each document's bytes, parsing the ``.idx`` by hand (docs/format.md 1)."""
    idx = Path(prefix + ".idx").read_bytes()
    code = idx[17]
    count = int.from_bytes(idx[18:26], "little")
    doc_count = int.from_bytes(idx[26:34], "little")
    lengths = np.frombuffer(idx, np.int32, count, 34).astype(np.int64)
    documents = np.frombuffer(idx, np.int64, doc_count, 34 + 12 * count)
    itemsize = fmt.dtype_from_code(code).itemsize
    ends = np.concatenate([[0], np.cumsum(lengths * itemsize)])
    data = Path(prefix + ".bin").read_bytes()
    return [
        xxhash.xxh3_64_intdigest(data[ends[a] : ends[b]]) for a, b in itertools.pairwise(documents)
    ]


def fingerprints_by_path(folder) -> dict[str, list[int]]:
    repack = Repack(folder)
    found = load_fingerprints(folder, repack.manifest)
    assert not isinstance(found, str), found
    return {s.path: found.of(s.id).tolist() for s in repack.manifest.sources}


def fingerprint_bytes(folder: Path) -> bytes:
    member = json.loads((folder / fmt.MANIFEST_FILE).read_bytes())["fingerprints"]
    return (folder / member["file"]).read_bytes()


def test_merge_stores_every_documents_fingerprint(demo_repack_cut: Path) -> None:
    # 8 KiB shards: most sources are cut across shards, and documents across segments
    found = fingerprints_by_path(demo_repack_cut)
    assert len(found) == 300
    cut = 0
    for source in Repack(demo_repack_cut).manifest.sources:
        assert found[source.path] == expected_of(source.path), source.name
        cut += len(source.segments) > 1
    assert cut > 50  # premise: many sources cut across shards
    assert verify(demo_repack_cut).ok


def test_workers_tasks_and_zstd_write_the_same_fingerprints(small_blend, tmp_path: Path) -> None:
    demo_blend, cut = small_blend
    reference = fingerprint_bytes(cut)
    assert fingerprints_by_path(cut) == {p: expected_of(p) for p in demo_blend.prefixes}
    merge(demo_blend.flat_json, tmp_path / "w", shard_size=8192, workers=2)
    assert fingerprint_bytes(tmp_path / "w") == reference
    merge(demo_blend.flat_json, tmp_path / "z", shard_size=8192, codec=("zstd", 1))
    assert fingerprint_bytes(tmp_path / "z") == reference
    assert verify(tmp_path / "z").ok
    out = str(tmp_path / "t")
    cli = CliRunner()
    assert cli.invoke(main, ["merge", "-q", "--plan-only", "--shard-size", "8KiB",
                             str(demo_blend.flat_json), out]).exit_code == 0  # fmt: skip
    for task in (2, 0, 1):
        result = cli.invoke(main, ["merge", "-q", out, "--task", str(task), "--tasks", "3"])
        assert result.exit_code == 0, result.output
    assert cli.invoke(main, ["merge", "-q", out, "--finalize"]).exit_code == 0
    assert fingerprint_bytes(Path(out)) == reference


def test_finalize_hashes_shards_whose_task_saved_no_fingerprints(
    small_blend, tmp_path: Path
) -> None:
    demo_blend, cut = small_blend
    # a shard copied by a release that did not compute fingerprints: finalize reads it
    out = str(tmp_path / "t")
    cli = CliRunner()
    assert cli.invoke(main, ["merge", "-q", "--plan-only", "--shard-size", "8KiB",
                             str(demo_blend.flat_json), out]).exit_code == 0  # fmt: skip
    assert cli.invoke(main, ["merge", "-q", out, "--task", "0", "--tasks", "1"]).exit_code == 0
    work = Path(out) / ".work"
    stems = sorted({p.stem for p in work.iterdir() if p.name.startswith("fingerprints-")})
    assert len(stems) > 3
    for stem in stems[::3]:
        (work / f"{stem}.json").unlink()
        (work / f"{stem}.u64").unlink()
    assert cli.invoke(main, ["merge", "-q", out, "--finalize"]).exit_code == 0
    assert fingerprint_bytes(Path(out)) == fingerprint_bytes(cut)


def test_add_appends_fingerprints_and_remove_keeps_them_right(
    make_source, write_blend, tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    prefixes = []
    for k in range(6):
        sequences = [rng.integers(0, 60000, rng.integers(0, 900)) for _ in range(40)]
        documents = sorted({0, 40, *rng.integers(1, 40, 12).tolist()})
        prefixes.append(make_source(f"s{k}", sequences, documents=documents))
    first = write_blend(prefixes[:3], name="first.json")
    everything = write_blend(prefixes, name="all.json")
    out = tmp_path / "out"
    merge(first, out, shard_size=16384)
    add(out, everything)
    assert os.path.exists(out / "fingerprints-1.rpf")
    assert not os.path.exists(out / "fingerprints.rpf")  # replaced
    found = fingerprints_by_path(out)
    assert list(found) == prefixes
    for prefix in prefixes:
        assert found[prefix] == expected_of(prefix)
    assert verify(out).ok

    remove(out, [prefixes[1], prefixes[4]])
    found = fingerprints_by_path(out)
    assert list(found) == [prefixes[k] for k in (0, 2, 3, 5)]
    for prefix, hashes in found.items():
        assert hashes == expected_of(prefix)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("finger")) == [
        "fingerprints-2.rpf"
    ]
    assert verify(out).ok


def test_without_fingerprints_the_repack_reads_verifies_and_says_so(
    demo_blend, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["merge", "-q", "--no-fingerprints", str(demo_blend.flat_json), str(out)]
    )
    assert result.exit_code == 0, result.output
    assert not any(p.name.startswith("fingerprints") for p in out.iterdir())
    assert "fingerprints" not in json.loads((out / fmt.MANIFEST_FILE).read_bytes())
    assert verify(out).ok
    found = load_fingerprints(out, Repack(out).manifest)
    assert isinstance(found, str) and found.startswith("no fingerprints")


def test_add_to_a_repack_without_fingerprints_writes_none(
    make_source, write_blend, tmp_path: Path
) -> None:
    a = make_source("a", [[1, 2, 3], [4]])
    b = make_source("b", [[5, 6]])
    out = tmp_path / "out"
    merge(write_blend([a], name="a.json"), out, fingerprints=False)
    add(out, write_blend([a, b], name="ab.json"))
    assert "fingerprints" not in json.loads((out / fmt.MANIFEST_FILE).read_bytes())
    assert not any(p.name.startswith("fingerprints") for p in out.iterdir())
    assert verify(out).ok


def test_empty_documents_have_the_hash_of_no_bytes(make_source, write_blend, tmp_path) -> None:
    a = make_source("a", [[1, 2], [], [3]], documents=[0, 1, 1, 2, 3, 3])
    out = tmp_path / "out"
    merge(write_blend([a]), out)
    hashes = fingerprints_by_path(out)[a]
    assert hashes[1] == hashes[2] == hashes[4] == EMPTY == xxhash.xxh3_64_intdigest(b"")
    assert hashes == expected_of(a)


@pytest.mark.parametrize("damage", ["byte", "truncate", "member"])
def test_verify_names_a_damaged_fingerprint_file(demo_repack: Path, tmp_path: Path, damage) -> None:
    out = tmp_path / "out"
    shutil.copytree(demo_repack, out)
    path = out / "fingerprints.rpf"
    data = bytearray(path.read_bytes())
    if damage == "byte":
        data[100] ^= 1
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-8]))
    else:
        path.rename(out / "fingerprints-7.rpf")
    report = verify(out)
    assert not report.ok
    problem = report.problems[-1]
    assert problem.file == "fingerprints.rpf", report.problems
    expected = {"byte": "stored checksum", "truncate": "bytes, expected", "member": "cannot read"}
    assert expected[damage] in problem.message
    result = CliRunner().invoke(main, ["verify", "-q", str(out)])
    assert result.exit_code != 0 and "fingerprints.rpf" in result.output


GOLDEN = Path(__file__).parent / "fixtures" / "golden"


@pytest.mark.parametrize("folder", ["repack", "repack-zstd", "repack-appended"])
def test_fingerprint_adds_them_to_a_repack_written_before_them(folder, tmp_path: Path) -> None:
    """The golden repacks written before fingerprints get, read from their shards, exactly
    the fingerprints a merge writes today (golden/repack-fingerprints)."""
    out = tmp_path / folder
    shutil.copytree(GOLDEN / folder, out)
    result = CliRunner().invoke(main, ["fingerprint", "-q", "--json", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads(result.stdout)
    assert written["documents"] == 13 and written["sources"] == 6
    expected = (GOLDEN / "repack-fingerprints" / "fingerprints.rpf").read_bytes()
    assert (out / written["file"]).read_bytes() == expected
    assert verify(out).ok
    # again: a new file under a name not in use, the old one removed once replaced
    again = json.loads(CliRunner().invoke(main, ["fingerprint", "-q", "--json", str(out)]).stdout)
    assert again["file"] != written["file"]
    assert not (out / written["file"]).exists()
    assert (out / again["file"]).read_bytes() == expected
    assert verify(out).ok


def test_inspect_shows_the_duplicates(small_blend) -> None:
    _, repack = small_blend
    result = CliRunner().invoke(main, ["inspect", str(repack)])
    assert result.exit_code == 0, result.output
    assert "duplicates (exact, from fingerprints): 0 of " in result.stdout
    info = json.loads(CliRunner().invoke(main, ["inspect", "--json", str(repack)]).stdout)
    assert info["duplicates"]["available"] and info["duplicates"]["problems"] == []
    old = CliRunner().invoke(main, ["inspect", str(GOLDEN / "repack")])
    assert "duplicates: no fingerprints (" in old.stdout


@pytest.mark.parametrize("fill", ["random", "zeros", "ones"])
def test_the_array_hash_is_xxh3_64_for_every_length(fill: str) -> None:
    # every length class of XXH3 up to 240 bytes (0, 1-3, 4-8, 9-16, 17-128 by its four
    # steps, 129-240 by its rounds), at odd offsets, against xxhash itself; all-0xff bytes
    # carry through every addition of the 128-bit products
    from repack.format.xxh3 import MAX_LENGTH, xxh3_64_many

    rng = np.random.default_rng(11)
    size = 20_000
    data = {
        "random": rng.integers(0, 256, size, dtype=np.uint8),
        "zeros": np.zeros(size, np.uint8),
        "ones": np.full(size, 255, np.uint8),
    }[fill].tobytes()
    lengths = np.repeat(np.arange(MAX_LENGTH + 1), 5)
    starts = rng.integers(0, size - MAX_LENGTH, len(lengths))
    starts[::5] = 0  # a string at the very start of the buffer
    ends = starts + lengths
    ends[1::5] = size  # and one ending at its very end
    starts[1::5] = size - lengths[1::5]
    got = xxh3_64_many(data, starts, lengths)
    expected = [xxhash.xxh3_64_intdigest(data[a : a + n]) for a, n in zip(starts, lengths)]
    assert got.tolist() == expected
    for lo, hi in ((0, 0), (1, 3), (4, 8), (9, 16), (17, 128), (129, 240), (5, 5), (3, 9)):
        # strings of one length class only (or two), as most pieces of a source hold
        one = (lengths >= lo) & (lengths <= hi)
        got = xxh3_64_many(data, starts[one], lengths[one])
        assert got.tolist() == [e for e, o in zip(expected, one) if o], (lo, hi)
    with pytest.raises(ValueError):
        xxh3_64_many(data, [0], [MAX_LENGTH + 1])


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_the_document_hasher_fed_in_pieces_gives_xxh3_64_of_each_document(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # short documents (hashed as arrays) and long ones (one call each), empty ones, and
    # documents cut by the pieces fed, at random piece sizes; by the compiled loop
    # (repack/read/_hashes.c) and by the Python path an install without a C compiler uses
    from repack.read import fingerprints
    from repack.read.fingerprints import DocumentHasher

    if native and not fingerprints.NATIVE:
        pytest.skip("repack.read._hashes was not built (tests/test_native.py says why in CI)")
    if not native:
        monkeypatch.setattr(fingerprints, "_native_ranges", None)

    rng = np.random.default_rng(12)
    lengths = np.concatenate(
        [rng.integers(0, 33, 3000), rng.integers(0, 600, 500), rng.integers(200, 300, 500)]
    )
    rng.shuffle(lengths)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    data = rng.integers(0, 256, int(bounds[-1]), dtype=np.uint8).tobytes()
    expected = [xxhash.xxh3_64_intdigest(data[a:b]) for a, b in itertools.pairwise(bounds)]
    for steps in ([len(data)], rng.integers(1, 64, 40_000), rng.integers(1000, 9000, 400)):
        hasher = DocumentHasher(bounds, 0, len(data), True)
        offset = 0
        for step in steps:
            if offset >= len(data):
                break
            hasher.update(memoryview(data)[offset : offset + int(step)])
            offset += int(step)
        if offset < len(data):
            hasher.update(data[offset:])
        first, hashes = hasher.finish()
        assert first == 0 and hashes.tolist() == expected


@pytest.mark.parametrize("command", ["add", "remove"])
def test_add_and_remove_refuse_to_drop_a_damaged_fingerprint_file(
    make_source, write_blend, tmp_path: Path, command: str
) -> None:
    """A fingerprint file missing or cut short is an error, not a repack without them: the
    edit would drop them silently (as it refuses one whose checksum is wrong)."""
    a = make_source("a", [[1, 2, 3], [4]])
    b = make_source("b", [[5, 6]])
    out = tmp_path / "out"
    merge(write_blend([a, b] if command == "remove" else [a], name="first.json"), out)
    manifest_before = (out / fmt.MANIFEST_FILE).read_bytes()
    (out / "fingerprints.rpf").write_bytes((out / "fingerprints.rpf").read_bytes()[:-8])
    args = [str(out), write_blend([a, b], name="ab.json")] if command == "add" else [str(out), b]
    result = CliRunner().invoke(main, [command, "-q", *map(str, args)])
    assert result.exit_code != 0
    message = result.output.strip().splitlines()[-1]
    assert message.startswith("Error: ") and "fingerprints would be lost" in message, message
    assert "repack fingerprint" in message
    assert (out / fmt.MANIFEST_FILE).read_bytes() == manifest_before
