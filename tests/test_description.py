"""``repack.model.description.dumps`` is ``json.dumps(obj, indent=4, default=...)``, text for
text: every type json writes, its subclasses, what ``default`` stands in for, the memo a build
shares, and json's own errors where it refuses."""

from __future__ import annotations

import enum
import json
import math
import random
from collections import OrderedDict

import pytest

from repack.model.description import dumps


def by_identifiers(obj):
    return obj.unique_identifiers


def stock(obj) -> str:
    return json.dumps(obj, indent=4, default=by_identifiers)


class Tokenizer:
    def __init__(self, **identifiers) -> None:
        self.unique_identifiers = OrderedDict(identifiers)


class Level(enum.IntEnum):
    HIGH = 3


class Name(str):
    pass


class Items(list):
    pass


class Ratio(float):
    pass


SCALARS = [
    0, 1, -7, 2**62, -(2**63), 10**30, True, False, None,
    0.0, -0.0, 0.1, 1e300, 1e-300, 2.5e-8, math.nan, math.inf, -math.inf,
    "", "plain", 'quote " and back\\slash', "line\nbreak\ttab", "ünïcødé ✓ 😀", "\x00\x1f",
    Level.HIGH, Name("sub"), Ratio(0.25),
]  # fmt: skip


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 4 else 1)
    if kind == 0:
        return rng.choice(SCALARS)
    if kind == 1:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 2:
        return tuple(random_value(rng, depth + 1) for _ in range(rng.randrange(4)))
    if kind == 3:
        return {
            rng.choice(["a", "b", "ç", "", 'k"']) + str(i): random_value(rng, depth + 1)
            for i in range(rng.randrange(4))
        }
    if kind == 4:
        return OrderedDict((str(i), random_value(rng, depth + 1)) for i in range(rng.randrange(3)))
    if kind == 5:
        return Tokenizer(**{"class": "Tok", "paths": [random_value(rng, depth + 1)]})
    return Items(random_value(rng, depth + 1) for _ in range(rng.randrange(3)))


def test_what_megatron_describes() -> None:
    identifiers = OrderedDict(
        [
            ("class", "GPTDataset"),
            ("dataset_path", "/lustre/data/prefix_000123_text_document"),
            ("num_samples", 12345),
            ("index_split", "train"),
            ("random_seed", 1234),
            ("sequence_length", 4096),
            ("split", "969,30,1"),
            ("split_matrix", [(0, 0.969), (0.969, 0.999), (0.999, 1.0)]),
            ("tokenizer", Tokenizer(**{"class": "HF", "tokenizer_path": ["/t", None]})),
            ("add_extra_token_to_sequence", True),
            ("object_storage_cache_path", None),
        ]
    )
    assert dumps(identifiers, by_identifiers) == stock(identifiers)
    blend = OrderedDict(
        [
            ("class", "BlendedDataset"),
            ("datasets", [identifiers, identifiers]),
            ("split", "train"),
            ("weights", [0.25, 0.75]),
            ("size", None),
        ]
    )
    assert dumps(blend, by_identifiers) == stock(blend)


@pytest.mark.parametrize("value", [*SCALARS, [], {}, (), OrderedDict(), [[]], {"a": {}}])
def test_every_scalar_and_empty_container(value) -> None:
    assert dumps(value, by_identifiers) == stock(value)
    assert dumps({"k": value}, by_identifiers) == stock({"k": value})


def test_keys_as_json_writes_them() -> None:
    for keys in (
        {1: "int", 2.5: "float", None: "null", "s": "str", Level.HIGH: "enum"},
        {True: "true", False: "false", 0.5: "half", math.inf: "inf", math.nan: "nan"},
        {-0.0: "negative zero", -math.inf: "-inf"},
    ):
        assert dumps(keys, by_identifiers) == stock(keys)


def test_random_structures() -> None:
    rng = random.Random(44)
    for _ in range(2000):
        value = random_value(rng)
        assert dumps(value, by_identifiers) == stock(value)


def test_a_memo_writes_a_value_again_at_any_level() -> None:
    rng = random.Random(45)
    memo: dict = {}
    shared = [random_value(rng) for _ in range(20)]
    tokenizer = Tokenizer(**{"class": "Tok", "vocab": [1, 2, {"x": (0.5, None)}]})
    for _ in range(300):
        value = {
            "own": random_value(rng),
            "shared": rng.choice(shared),
            "tokenizer": tokenizer,
            "deeper": [[{"t": tokenizer, "s": rng.choice(shared)}]],
        }
        assert dumps(value, by_identifiers, memo) == stock(value)
    assert id(tokenizer) in memo  # the memo was used, not only filled


def test_a_text_held_at_its_level_is_written_at_any_level() -> None:
    """A caller's ``(value, text, level)``: the text written at the level whose line break is
    ``level``, used as it is there and taken back to the top level elsewhere."""
    rng = random.Random(46)
    for _ in range(200):
        inner = [random_value(rng) for _ in range(3)]
        for depth in range(4):
            level = "\n" + "    " * depth
            held = stock(inner).replace("\n", level)  # json's text one level down per depth
            for value in (inner, [inner], {"a": [inner, inner]}, [[{"b": inner}]]):
                memo = {id(inner): (inner, held, level)}
                assert dumps(value, by_identifiers, memo) == stock(value)


def test_json_refuses_what_it_refuses() -> None:
    circular: list = []
    circular.append(circular)
    for bad in (circular, {(1, 2): "tuple key"}, object(), {"k": [object()]}, {"k": 10**5000}):
        with pytest.raises(Exception) as expected:
            stock(bad)
        with pytest.raises(type(expected.value)) as found:
            dumps(bad, by_identifiers)
        assert str(found.value) == str(expected.value)
