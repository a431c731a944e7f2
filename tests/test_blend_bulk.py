"""A serialized blend's entries are checked in bulk (a list per member) and, only where a bulk
check fails, entry by entry (repack.format.blend: _entries_in_bulk, _entries_by_row), as the
manifest's sources are (tests/test_manifest_bulk.py). The entry loop is the definition of a
valid entry: the bulk path must accept nothing it refuses, read the same columns from what it
accepts, and leave every refusal to it, so that the message names the same first bad entry.
Every case here would fail if the bulk path accepted an entry the loop refuses."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from mutation_support import pick, places

import repack.format.blend as blend_module
from repack.errors import BlendError, FormatError
from repack.format.blend import Blend
from repack.format.manifest import Manifest, dump_manifest, parse_manifest
from repack.format.sources import EntryTable
from repack.merge import merge
from repack.synth import make_blend


def _entry(k: int, weight: Any = 1.5) -> dict[str, Any]:
    return {"prefix": f"data/s{k}", "weight": weight, "path": f"/work/data/s{k}"}


def pristine_json(weights: bool = True) -> dict[str, Any]:
    """A per-split blend as to_json writes it: weights, or bare prefixes (null weights)."""
    return {
        "source": "/work/blend.json",
        "form": "per-split-data-args",
        "splits": {
            "train": [_entry(k, 0.25 * (k + 1) if weights else None) for k in range(6)],
            "valid": [_entry(9, 2.0 if weights else None)],
            "test": None,
        },
    }


def judged(d: Any, monkeypatch: pytest.MonkeyPatch, *, bulk: bool) -> Blend | str:
    """``Blend.from_json(d)``, or the BlendError's message; with ``bulk`` False, the entry loop
    alone (the bulk path gives up at once)."""
    with monkeypatch.context() as patch:
        if not bulk:
            patch.setattr(blend_module, "_entries_in_bulk", lambda raw: None)
        try:
            return Blend.from_json(d)
        except BlendError as err:
            return str(err)


def by_row(raw: Any) -> Any:
    """What the entry loop reads of split ``raw``, or ``None`` where it refuses it."""

    def bad(what: str) -> Any:
        raise BlendError(what)

    try:
        return blend_module._entries_by_row(raw, "train", bad)
    except BlendError:
        return None


@pytest.mark.parametrize("weights", [True, False], ids=["weights", "bare"])
def test_a_valid_blend_takes_the_bulk_path_to_the_same_blend(
    weights: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = pristine_json(weights)
    expected = judged(d, monkeypatch, bulk=False)
    assert isinstance(expected, Blend)

    def refuse(*args: Any) -> None:
        raise AssertionError("the entry loop ran for a valid blend")

    monkeypatch.setattr(blend_module, "_entries_by_row", refuse)
    found = judged(d, monkeypatch, bulk=True)
    assert isinstance(found, Blend) and found == expected
    assert found.to_json() == d
    assert all(type(e.weight) is (float if weights else type(None)) for e in found.splits["train"])


def test_a_scale_shaped_manifest_reads_its_blend_in_bulk_into_the_same_columns(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merged repack's manifest: its blend read in bulk, into the entries the loop reads."""
    blend = make_blend(tmp_path / "src", 12, seed=3)
    merge(blend.flat_json, tmp_path / "out")
    data = (tmp_path / "out" / "manifest.json").read_bytes()
    raw = json.loads(data)["blend"]
    for split in raw["splits"].values():
        if split is not None:
            assert blend_module._entries_in_bulk(split) == by_row(split)
    with monkeypatch.context() as patch:
        patch.setattr(blend_module, "_entries_in_bulk", lambda raw: None)
        expected = parse_manifest(data, "manifest.json")
    monkeypatch.setattr(blend_module, "_entries_by_row", None)  # not called
    found = parse_manifest(data, "manifest.json")
    assert found == expected and found.blend.to_json() == raw
    assert all(isinstance(s, EntryTable) for s in found.blend.splits.values() if s is not None)


# --- one crafted blend per rule -------------------------------------------------------------


def _set(split: str, k: int, member: str, value: Any) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        d["splits"][split][k][member] = value

    return change


def _item(split: str, k: int, value: Any) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        d["splits"][split][k] = value

    return change


def _drop(split: str, k: int, member: str) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        del d["splits"][split][k][member]

    return change


def _every_weight(value: Any) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        for entry in d["splits"]["train"]:
            entry["weight"] = value

    return change


class _Text(str):
    """A string of a subclass (JSON makes none; a blend built in Python may hold one)."""


CASES: dict[str, Callable[[dict], None]] = {
    # weights
    "weight zero": _set("train", 2, "weight", 0.0),
    "weight negative": _set("train", 0, "weight", -1.0),
    "weight nan": _set("train", 3, "weight", float("nan")),
    "weight infinite": _set("train", 5, "weight", float("inf")),
    "weight true": _set("train", 1, "weight", True),
    "weight false": _set("train", 1, "weight", False),
    "weight a string": _set("train", 1, "weight", "1.5"),
    "weight a list": _set("train", 1, "weight", [1.0]),
    "weight an integer": _set("train", 1, "weight", 3),
    "weight integer zero": _set("train", 1, "weight", 0),
    "weight integer past float": _set("train", 1, "weight", 10**400),
    "weight null among numbers": _set("train", 4, "weight", None),
    "weights all integers": _every_weight(2),
    "weights all null": _every_weight(None),
    "weight tiny": _set("train", 2, "weight", 5e-324),
    "weight in the second split zero": _set("valid", 0, "weight", 0.0),
    # members
    "prefix missing": _drop("train", 2, "prefix"),
    "weight missing": _drop("train", 2, "weight"),
    "path missing": _drop("train", 5, "path"),
    "member extra": _set("train", 1, "extra", 1),
    "member renamed": lambda d: d["splits"]["train"][1].update(
        {"paths": d["splits"]["train"][1].pop("path")}
    ),
    "prefix not a string": _set("train", 3, "prefix", 5),
    "prefix null": _set("train", 3, "prefix", None),
    "path not a string": _set("train", 4, "path", ["a"]),
    "prefix of a str subclass": _set("train", 3, "prefix", _Text("data/x")),
    "path of a str subclass": _set("train", 3, "path", _Text("/x")),
    # entries
    "entry a list": _item("train", 2, ["a", 1.0, "/a"]),
    "entry a string": _item("train", 2, "abc"),
    "entry null": _item("train", 0, None),
    "entry empty": _item("train", 0, {}),
    "entry of three other members": _item("train", 0, {"a": 1, "b": 2, "c": 3}),
    "split empty": lambda d: d["splits"].__setitem__("train", []),
    "split of one bad entry": lambda d: d["splits"].__setitem__("valid", [1]),
}


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_blend_is_judged_as_the_entry_loop_judges_it(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = pristine_json()
    CASES[case](d)
    expected = judged(d, monkeypatch, bulk=False)
    found = judged(d, monkeypatch, bulk=True)
    assert found == expected
    if isinstance(expected, Blend):
        assert [type(e.weight) for e in found.splits["train"]] == [
            type(e.weight) for e in expected.splits["train"]
        ]
    for split in d["splits"].values():
        if isinstance(split, list):
            reference = by_row(split)
            got = blend_module._entries_in_bulk(split)
            assert got is None if reference is None else got in (None, reference)


def test_the_crafted_cases_cover_refusals_of_each_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table above is not vacuous: most cases are refused, with these messages among them,
    and the bulk path gives up on every one (accepted ones included, where it is stricter)."""
    messages = []
    for change in CASES.values():
        d = pristine_json()
        change(d)
        found = judged(d, monkeypatch, bulk=False)
        if isinstance(found, str):
            messages.append(found)
    assert len(messages) >= len(CASES) - 8
    for expected in (
        "/work/blend.json: serialized blend entry 3 of split 'train' has weight 0.0; expected a "
        "finite number > 0 or null",
        "/work/blend.json: serialized blend entry 4 of split 'train' has weight NaN",
        "/work/blend.json: serialized blend entry 2 of split 'train' has weight true",
        "/work/blend.json: serialized blend entry 2 of split 'train' has weight 1000",
        "/work/blend.json: serialized blend entry 3 of split 'train' is an object; expected",
        "/work/blend.json: serialized blend entry 3 of split 'train' is a list of 3 items;",
        "/work/blend.json: serialized blend entry 1 of split 'valid' is 1; expected",
    ):
        assert any(m.startswith(expected) for m in messages), expected


def test_a_bad_blend_in_a_manifest_is_refused_with_the_same_message(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the manifest's parser (its blend and an appended one): the same FormatError."""
    blend = make_blend(tmp_path / "src", 5, seed=8)
    merge(blend.flat_json, tmp_path / "out")
    pristine = json.loads((tmp_path / "out" / "manifest.json").read_bytes())
    pristine["appended"] = [copy.deepcopy(pristine["blend"])]
    for member, change in (
        ("blend", lambda entries: entries[3].update(weight=-2.0)),
        ("blend", lambda entries: entries[1].pop("path")),
        ("appended", lambda entries: entries[4].update(weight=True)),
        ("appended", lambda entries: entries[0].update(prefix=7)),
    ):
        raw = copy.deepcopy(pristine)
        target = raw[member] if member == "blend" else raw[member][0]
        change(target["splits"]["all"])
        data = dump_manifest({k: v for k, v in raw.items() if k != "checksum"}, "xxh3-128")
        messages = []
        for bulk in (False, True):
            with monkeypatch.context() as patch:
                if not bulk:
                    patch.setattr(blend_module, "_entries_in_bulk", lambda raw: None)
                with pytest.raises(FormatError) as caught:
                    parse_manifest(data, "manifest.json")
            messages.append(str(caught.value))
        assert messages[0] == messages[1]
        assert messages[0].startswith("manifest.json: invalid manifest: blend: ")
    data = dump_manifest({k: v for k, v in pristine.items() if k != "checksum"}, "xxh3-128")
    assert isinstance(parse_manifest(data, "manifest.json"), Manifest)


# --- random changes ---------------------------------------------------------------------------

_VALUES = (
    True, False, None, 0, 1, -1, 2, 1.0, 1.5, -1.5, 0.0, -0.0, 1e308, 10**400, float("inf"),
    float("nan"), "", "x", "1.5", [], [1.0], {}, {"a": 1}, {"prefix": "a", "weight": 1.0},
)  # fmt: skip


@pytest.mark.parametrize("weights", [True, False], ids=["weights", "bare"])
def test_random_changes_are_judged_as_the_entry_loop_judges_them(
    weights: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any member or entry of a split set to an odd value, renamed, or dropped: the bulk path
    accepts only what the loop accepts (the same columns), else leaves it to the loop, and
    from_json refuses with the loop's message."""
    pristine = pristine_json(weights)["splits"]["train"]
    paths = places(pristine)
    rng = random.Random(45)
    kinds = {"accepted": 0, "refused": 0}
    for _ in range(1500):
        split = copy.deepcopy(pristine)
        for _ in range(rng.choice((1, 1, 2))):
            picked = pick(split, paths, rng)
            if picked is None:
                continue
            target, key, old = picked
            action = rng.random()
            if action < 0.1 and isinstance(target, dict):
                del target[key]
            elif action < 0.2 and isinstance(target, dict):
                target[key + "s"] = target.pop(key)
            else:
                target[key] = copy.deepcopy(rng.choice(_VALUES))
            del old
        expected = by_row(split)
        found = blend_module._entries_in_bulk(split)
        kinds["refused" if expected is None else "accepted"] += 1
        if expected is None:
            assert found is None, split
        elif found is not None:
            assert found == expected
        d = {"source": "b.json", "form": "data-path", "splits": {"all": split}}
        assert judged(d, monkeypatch, bulk=True) == judged(d, monkeypatch, bulk=False)
    assert kinds["refused"] > 1000 and kinds["accepted"] > 50, kinds
