"""The manifest's sources are checked in bulk (a column per field) and, only where a bulk check
fails, row by row (repack.format.manifest: _sources_in_bulk, _sources_by_row). The row loop is
the definition of a valid source: the bulk path must accept nothing it refuses, build the same
table for what it accepts, and leave every refusal to it, so that the message names the same
first bad value. Every case here would fail if the bulk path accepted a manifest the loop
refuses."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mutation_support import pick, places

import repack.format.manifest as manifest_module
from repack.errors import FormatError
from repack.format import spec as fmt
from repack.format.manifest import Manifest, dump_manifest, parse_manifest
from repack.merge import merge
from repack.synth import make_blend


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The raw manifest of a repack with two dtypes, multimodal sources, a source split over
    two shards, and a source named by two prefixes."""
    root = tmp_path_factory.mktemp("bulk")
    blend = make_blend(root / "src", 8, seed=5, multimodal_fraction=0.3)
    merge(blend.flat_json, root / "out", shard_size=8192)
    raw = json.loads((root / "out" / fmt.MANIFEST_FILE).read_bytes())
    raw["sources"][2]["prefixes"].append("also/the/third")
    sources = raw["sources"]
    assert {s["dtype_code"] for s in sources} == {4, 8}
    assert any(s["multimodal"] for s in sources) and not all(s["multimodal"] for s in sources)
    assert len(sources[1]["segments"]) == 2
    return raw


def crafted(raw: dict[str, Any]) -> bytes:
    """``raw`` serialized with a valid self-checksum: only the structural checks can refuse it."""
    body = {key: value for key, value in raw.items() if key != "checksum"}
    return dump_manifest(body, raw["checksum_algorithm"])


def parse(data: bytes, monkeypatch: pytest.MonkeyPatch, *, bulk: bool) -> Manifest | str:
    """The parsed manifest, or the FormatError's message; with ``bulk`` False, the row loop
    alone (the bulk path gives up at once)."""
    with monkeypatch.context() as patch:
        if not bulk:
            patch.setattr(manifest_module, "_sources_in_bulk", lambda *args: None)
        try:
            return parse_manifest(data, "manifest.json")
        except FormatError as err:
            return str(err)


def assert_same_table(got: Any, expected: Any) -> None:
    """The same columns: dtype, shape, writeability and values of each array, the same kind
    and strings of each text column (Texts, Digests)."""
    assert got.columns.keys() == expected.columns.keys()
    for name, column in expected.columns.items():
        other = got.columns[name]
        if isinstance(column, np.ndarray):
            assert other.dtype == column.dtype and other.shape == column.shape, name
            assert other.flags.writeable == column.flags.writeable, name
            assert np.array_equal(other, column), name
        else:
            assert type(other) is type(column), name
            assert len(other) == len(column), name
            assert [other[i] for i in range(len(other))] == [
                column[i] for i in range(len(column))
            ], name


def test_a_valid_manifest_takes_the_bulk_path_to_the_same_manifest(
    pristine: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = crafted(pristine)
    by_row = parse(data, monkeypatch, bulk=False)
    assert isinstance(by_row, Manifest)

    def refuse(*args: Any) -> None:
        raise AssertionError("the row loop ran for a valid manifest")

    monkeypatch.setattr(manifest_module, "_sources_by_row", refuse)
    in_bulk = parse(data, monkeypatch, bulk=True)
    assert isinstance(in_bulk, Manifest)
    assert in_bulk == by_row
    assert_same_table(in_bulk.sources, by_row.sources)
    assert [s.to_json() for s in in_bulk.sources] == pristine["sources"]
    assert in_bulk.find_source_id("also/the/third") == 2


def test_the_golden_and_scale_shaped_manifests_take_the_bulk_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    golden = Path(__file__).parent / "fixtures" / "golden" / "repack" / fmt.MANIFEST_FILE
    raw = json.loads(golden.read_bytes())
    data = golden.read_bytes()
    by_row = parse(data, monkeypatch, bulk=False)
    assert isinstance(by_row, Manifest)
    shards = list(by_row.shards)
    found = manifest_module._sources_in_bulk(raw["sources"], shards, raw["checksum_algorithm"])
    assert found is not None
    assert_same_table(found[0], by_row.sources)
    assert found[1:] == (by_row.sequence_count, by_row.document_count)


# --- one crafted manifest per rule ----------------------------------------------------------


def _source(n: int, member: str, value: Any) -> Callable[[dict], None]:
    def change(raw: dict) -> None:
        raw["sources"][n][member] = value

    return change


def _segment(n: int, k: int, member: str, value: Any) -> Callable[[dict], None]:
    def change(raw: dict) -> None:
        raw["sources"][n]["segments"][k][member] = value

    return change


def _shift(n: int, k: int, member: str, by: int) -> Callable[[dict], None]:
    def change(raw: dict) -> None:
        raw["sources"][n]["segments"][k][member] += by

    return change


def _pair(n: int, member: str, i: int, value: Any) -> Callable[[dict], None]:
    def change(raw: dict) -> None:
        raw["sources"][n][member][i] = value

    return change


def _drop(n: int, member: str) -> Callable[[dict], None]:
    def change(raw: dict) -> None:
        del raw["sources"][n][member]

    return change


def _sources_member(value: Any) -> Callable[[dict], None]:
    def change(raw: dict) -> None:
        raw["sources"] = value

    return change


def _multimodal_flipped(n: int) -> Callable[[dict], None]:
    """Valid: multimodal flipped with the idx_size that goes with it."""

    def change(raw: dict) -> None:
        src = raw["sources"][n]
        src["multimodal"] = not src["multimodal"]
        sequences, documents = src["sequences"][1], src["documents"][1]
        src["idx_size"] = fmt.megatron_idx_size(sequences, documents, src["multimodal"])

    return change


def _unaligned_in_room(raw: dict) -> None:
    """A segment moved by 4 bytes where it still ends inside its shard."""
    sizes = [shard["size"] for shard in raw["shards"]]
    for src in raw["sources"]:
        for seg in src["segments"]:
            if seg["offset"] + seg["size"] + 4 <= sizes[seg["shard"]]:
                seg["offset"] += 4
                return
    raise AssertionError("no segment with room after it")


def _no_documents_last(raw: dict) -> None:
    """The last source with no document, its idx_size agreeing (nothing after it to break)."""
    src = raw["sources"][-1]
    src["documents"][1] = 0
    src["idx_size"] = fmt.megatron_idx_size(src["sequences"][1], 0, src["multimodal"])


def _idx_size_agreeing_modulo_2_64(raw: dict) -> None:
    """The last source with 2**62 more sequences (in its segment): 12 * 2**62 is 3 * 2**64, so
    its idx_size still agrees with its counts in int64 arithmetic, not in integers."""
    src = raw["sources"][-1]
    src["sequences"][1] += 2**62
    src["segments"][-1]["count"] += 2**62


INT_MAX = 2**63 - 1
ALIGNED_MAX = INT_MAX - INT_MAX % fmt.ALIGNMENT
CASES: dict[str, Callable[[dict], None]] = {
    # id
    "id true": _source(1, "id", True),
    "id float": _source(1, "id", 1.0),
    "id wrong": _source(3, "id", 4),
    # dtype code
    "dtype_code true": _source(0, "dtype_code", True),
    "dtype_code unknown": _source(0, "dtype_code", 9),
    "dtype_code zero": _source(0, "dtype_code", 0),
    "dtype_code of other shards": _source(0, "dtype_code", 8),
    "dtype_code past int64": _source(0, "dtype_code", 2**63),
    # sequences and documents
    "sequences short": _source(2, "sequences", [0]),
    "sequences long": _source(2, "sequences", [0, 1, 2]),
    "sequences string": _source(2, "sequences", "ab"),
    "sequences object": _source(2, "sequences", {"a": 1, "b": 2}),
    "sequences start true": _pair(1, "sequences", 0, True),
    "sequences start off": _pair(2, "sequences", 0, 1),
    "sequences count negative": _pair(2, "sequences", 1, -1),
    "sequences count float": _pair(2, "sequences", 1, 3.0),
    "documents none": _pair(4, "documents", 1, 0),
    "documents none in the last source": _no_documents_last,
    "idx_size agreeing modulo 2**64": _idx_size_agreeing_modulo_2_64,
    "documents start off": _pair(4, "documents", 0, 0),
    "documents count past int64": _pair(7, "documents", 1, 2**64 + 5),
    "documents count at int64 max": _pair(7, "documents", 1, INT_MAX),
    "sequences count at int64 max": _pair(7, "sequences", 1, INT_MAX),
    # prefixes (a string is iterated by the loop, character by character: both accept it)
    "prefixes empty": _source(5, "prefixes", []),
    "prefixes not strings": _source(5, "prefixes", [1]),
    "prefixes none": _source(5, "prefixes", None),
    "prefixes a string": _source(5, "prefixes", "abc"),
    # bin_size
    "bin_size off": _source(3, "bin_size", 1),
    "bin_size true": _source(3, "bin_size", True),
    "bin_size negative": _source(3, "bin_size", -1),
    # segments
    "segments empty": _source(3, "segments", []),
    "segments string": _source(3, "segments", "x"),
    "segments not objects": _source(3, "segments", [1]),
    "segment member missing": lambda raw: raw["sources"][1]["segments"][1].pop("first"),
    "segment first off": _shift(1, 1, "first", 1),
    "segment first true": _segment(0, 0, "first", False),
    "segment count off": _shift(1, 0, "count", 1),
    "segment source_offset off": _shift(1, 1, "source_offset", 4),
    "segment offset unaligned": _unaligned_in_room,
    "segment offset aligned near int64 max": _segment(1, 1, "offset", ALIGNED_MAX),
    "segment offset past the shard": _shift(1, 1, "offset", 1 << 20),
    "segment offset at int64 max": _segment(1, 1, "offset", INT_MAX),
    "segment size at int64 max": _segment(1, 1, "size", INT_MAX),
    "segment shard out of range": _segment(0, 0, "shard", 99),
    "segment shard negative": _segment(0, 0, "shard", -1),
    "segment shard of another dtype": _segment(3, 0, "shard", 0),
    "segment shard true": _segment(0, 0, "shard", True),
    "segment checksum other algorithm": _segment(0, 0, "checksum", "sha256:00"),
    "segment checksum other long algorithm": _segment(0, 0, "checksum", "sha256:" + "0" * 64),
    "segment checksum no digest": _segment(0, 0, "checksum", "xxh3-128:"),
    "segment checksum not a string": _segment(0, 0, "checksum", 5),
    # multimodal
    "multimodal int": _source(0, "multimodal", 1),
    "multimodal none": _source(0, "multimodal", None),
    "multimodal flipped with its idx_size": _multimodal_flipped(3),
    # idx_size
    "idx_size off": _source(6, "idx_size", 35),
    "idx_size true": _source(6, "idx_size", True),
    "idx_size past int64": _source(6, "idx_size", 2**63),
    # tokens
    "tokens negative": _source(6, "tokens", -1),
    "tokens past int64": _source(6, "tokens", 2**64 + 5),
    "tokens at int64 max": _source(6, "tokens", INT_MAX),
    "tokens float": _source(6, "tokens", 1.5),
    "tokens true": _source(6, "tokens", True),
    # path and checksums
    "path not a string": _source(4, "path", 5),
    "path none": _source(4, "path", None),
    "bin_checksum other algorithm": _source(4, "bin_checksum", "sha256:ab"),
    "bin_checksum other long algorithm": _source(4, "bin_checksum", "sha256:" + "0" * 64),
    "idx_checksum other long algorithm": _source(4, "idx_checksum", "blake2b:" + "0" * 64),
    "bin_checksum malformed": _source(4, "bin_checksum", "xxh3-128"),
    "bin_checksum empty": _source(4, "bin_checksum", ""),
    "idx_checksum no digest": _source(4, "idx_checksum", "xxh3-128:"),
    "idx_checksum not a string": _source(4, "idx_checksum", None),
    # members and shapes
    "member missing": _drop(2, "tokens"),
    "source not an object": lambda raw: raw["sources"].__setitem__(2, [1, 2]),
    "sources an object": _sources_member({"0": {}}),
    "sources empty": _sources_member([]),
    "sources null": _sources_member(None),
    "last source dropped": lambda raw: raw["sources"].pop(),
}


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_manifest_is_refused_as_the_row_loop_refuses_it(
    pristine: dict[str, Any], case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = copy.deepcopy(pristine)
    CASES[case](raw)
    data = crafted(raw)
    raw = json.loads(data)  # as the parser sees it
    by_row = parse(data, monkeypatch, bulk=False)
    in_bulk = parse(data, monkeypatch, bulk=True)
    if isinstance(by_row, str):
        assert in_bulk == by_row
    else:
        assert isinstance(in_bulk, Manifest) and in_bulk == by_row
        assert_same_table(in_bulk.sources, by_row.sources)
    # the source checks themselves: where the loop refuses, the bulk path gives up
    shards = list(parse(crafted(pristine), monkeypatch, bulk=False).shards)
    algorithm = raw["checksum_algorithm"]
    try:
        expected = manifest_module._sources_by_row(raw["sources"], shards, algorithm)
    except (KeyError, TypeError, ValueError):
        expected = None
    found = manifest_module._sources_in_bulk(raw["sources"], shards, algorithm)
    if expected is None:
        assert found is None
    elif found is not None:
        assert_same_table(found[0], expected[0])
        assert found[1:] == expected[1:]


def test_the_crafted_cases_cover_refusals_of_each_kind(
    pristine: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table above is not vacuous: most cases are refused, with these messages among them."""
    messages = []
    for change in CASES.values():
        raw = copy.deepcopy(pristine)
        change(raw)
        found = parse(crafted(raw), monkeypatch, bulk=False)
        if isinstance(found, str):
            messages.append(found.split("invalid manifest: ", 1)[1])
    assert len(messages) >= len(CASES) - 6
    for expected in (
        "sources[1].id is True, expected 1",
        "sources[0].dtype_code is 9, not a Megatron dtype code",
        "sources[2]: sequence/document ranges are not contiguous",
        "sources[5].prefixes is empty",
        "sources[1].segments[1] does not continue the source where the previous segment ends",
        "sources[1].segments[1].offset",
        "sources[3].segments[0].shard is 0, not a shard of dtype code 8",
        "sources[3]: segments cover 0 bytes, expected",
        "sources[0].multimodal is 1, expected true or false",
        "sources[6].idx_size is 35, which disagrees with its counts",
        "sources[6].tokens is 18446744073709551621, expected an integer from 0 to 2**63-1",
        "sources[4].bin_checksum uses sha256, expected xxh3-128",
        "missing member 'tokens'",
        "sources do not cover the index exactly",
    ):
        assert any(m.startswith(expected) for m in messages), expected


# --- random changes ---------------------------------------------------------------------------

_VALUES = (
    True, False, None, 0, 1, -1, 2, 4096, 1.0, 1.5, "", "x", "xxh3-128:", "xxh3-128:00",
    "sha256:00", "sha256:" + "0" * 64, [], [0], [0, 1], [0, 1, 2], {}, {"a": 1},
    INT_MAX, 2**63, -(2**63), 2**64 + 5,
)  # fmt: skip


def test_random_changes_are_judged_as_the_row_loop_judges_them(
    pristine: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any member or item of the sources set to an odd value, shifted, or dropped: the bulk
    path accepts only what the loop accepts (the same table), else leaves it to the loop."""
    shards = list(parse(crafted(pristine), monkeypatch, bulk=False).shards)
    algorithm = pristine["checksum_algorithm"]
    paths = places(pristine["sources"])
    rng = random.Random(44)
    kinds = {"accepted": 0, "refused": 0}
    for _ in range(1500):
        sources = copy.deepcopy(pristine["sources"])
        for _ in range(rng.choice((1, 1, 2))):
            picked = pick(sources, paths, rng)
            if picked is None:
                continue
            target, key, old = picked
            action = rng.random()
            if action < 0.1:
                del target[key]
            elif action < 0.35 and type(old) is int:
                target[key] = old + rng.choice((-4096, -8, -1, 1, 8, 4096))
            else:
                target[key] = copy.deepcopy(rng.choice(_VALUES))
        sources = json.loads(json.dumps(sources))
        try:
            expected = manifest_module._sources_by_row(sources, shards, algorithm)
        except (KeyError, TypeError, ValueError):
            expected = None
        found = manifest_module._sources_in_bulk(sources, shards, algorithm)
        kinds["refused" if expected is None else "accepted"] += 1
        if expected is None:
            assert found is None, sources
        elif found is not None:
            assert_same_table(found[0], expected[0])
            assert found[1:] == expected[1:]
    assert kinds["refused"] > 1000 and kinds["accepted"] > 20, kinds
