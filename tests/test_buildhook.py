"""Megatron's builder, building a repack's blend (:mod:`repack.megatron.buildhook`): every
description is the text Megatron's ``json.dumps`` gives, written by repack's encoder; the
collector does not run during the build and runs again after it, also when the build fails;
a stock build goes through Megatron's own ``json`` and collector."""

from __future__ import annotations

import gc
import json
import sys
from collections import OrderedDict

import pytest
from megatron_support import (
    GPTDataset,
    build,
    gpt_config,
    init_process_group,
    merged_blend,
)

from repack.errors import RepackError
from repack.megatron import buildhook, buildscope, dataset_class

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> None:
    init_process_group()


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("buildhook")
    prefixes, weights, out = merged_blend(root, 6, seed=46)
    return prefixes, weights, out, root


class NestedTok:
    """A tokenizer whose identifiers nest (lists, a dict, floats, None), as Megatron-LM's
    tokenizers' do."""

    eod = 0
    vocab_size = 65000

    def __init__(self) -> None:
        self.unique_identifiers = OrderedDict(
            [
                ("class", "NestedTok"),
                ("tokenizer_path", ["/models/vocab.json", None]),
                ("options", {"dropout": 0.1, "special": ["<s>", "</s>"], "ratio": 1e-9}),
            ]
        )


def configured(blend, cache, tokenizer=None):
    prefixes, weights, _, _ = blend
    config = gpt_config(prefixes, weights, split="90,5,5", cache=cache)
    if tokenizer is not None:
        config.tokenizer = tokenizer
    return config


def blended_identifiers(blended) -> OrderedDict:
    """What ``BlendedDataset.__init__`` describes (every release from 0.12 to main)."""
    identifiers = OrderedDict()
    identifiers["class"] = type(blended).__name__
    identifiers["datasets"] = [dataset.unique_identifiers for dataset in blended.datasets]
    identifiers["split"] = blended.split.name
    identifiers["weights"] = blended.weights
    identifiers["size"] = blended.size
    return identifiers


def test_descriptions_are_megatrons_text(blend, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, out, root = blend
    written = []
    for name in ("_describe_dataset", "_describe_blend"):
        describe = getattr(buildhook, name)
        monkeypatch.setattr(
            buildhook,
            name,
            lambda *args, describe=describe: written.append(args[0]) or describe(*args),
        )
    stock = build(GPTDataset, configured(blend, root / "stock", NestedTok()), [60, 20, 10])
    assert written == []  # a stock build: Megatron's json
    ours = build(dataset_class(out), configured(blend, root / "ours", NestedTok()), [60, 20, 10])
    for theirs, mine in zip(stock, ours):
        assert mine.unique_description == theirs.unique_description
        assert mine.unique_description_hash == theirs.unique_description_hash
        assert mine.unique_description == json.dumps(
            blended_identifiers(mine), indent=4, default=lambda obj: obj.unique_identifiers
        )
        for dataset, stock_dataset in zip(mine.datasets, theirs.datasets):
            assert dataset.unique_description_hash == stock_dataset.unique_description_hash
    # repack's encoder wrote every dataset's description and every split's blend's
    assert len(written) == sum(len(split.datasets) + 1 for split in ours)
    assert buildscope.memo() is None


def in_builder() -> bool:
    """Whether Megatron's builder is on the stack (of this thread, or of the builder's pool)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith("blended_megatron_dataset_builder.py"):
            return True
        frame = frame.f_back
    return False


def collections_during(run) -> tuple[list[int], object]:
    """The generations collected while Megatron's builder runs in ``run()``, young ones
    often."""
    collected: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start" and in_builder():
            collected.append(info["generation"])

    thresholds = gc.get_threshold()
    gc.set_threshold(100, 10, 10)
    gc.callbacks.append(note)
    try:
        result = run()
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*thresholds)
    return collected, result


def test_the_collector_waits_for_the_end_of_a_repacked_build(blend) -> None:
    _, _, out, root = blend
    assert gc.isenabled()
    stock, _ = collections_during(
        lambda: build(GPTDataset, configured(blend, root / "gc-stock"), [60, 20, 10])
    )
    assert stock  # a build sets off collections
    cls = dataset_class(out)
    ours, _ = collections_during(lambda: build(cls, configured(blend, root / "gc"), [60, 20, 10]))
    assert ours == []
    assert gc.isenabled()


def test_a_failing_build_turns_the_collector_back_on(blend, tmp_path) -> None:
    prefixes, weights, out, _ = blend
    config = gpt_config([*prefixes, str(tmp_path / "not-merged")], [*weights, 1.0], cache=tmp_path)
    with pytest.raises(RepackError, match="not-merged: not in the repack"):
        build(dataset_class(out), config, [60, 20, 10])
    assert gc.isenabled()
    assert buildscope._STATE == {"memo": None, "running": 0}


def megatrons_identifiers(own: tuple, config: list[tuple[str, object]]) -> OrderedDict:
    """Identifiers as ``MegatronDataset.__init__`` fills them: its own four, then the
    config's."""
    names = ("class", "dataset_path", "num_samples", "index_split")
    return OrderedDict([*zip(names, own), *config])


def describe_in_a_build(identifiers: OrderedDict, memo: dict) -> str:
    buildscope._STATE["memo"] = memo
    try:
        return buildhook._describe_dataset(identifiers, default=lambda obj: obj.unique_identifiers)
    finally:
        buildscope._STATE["memo"] = None


@pytest.mark.parametrize(
    "own",
    [
        ("GPTDataset", "/data/en/wiki_text_document", 12345, "train"),
        ("GPTDataset", '/données/ünïcode "quoted" \\back\\ \t', 0, "valid"),
        ("GPTDataset", "/data/x", None, "test"),
        ("GPTDataset", "/data/x", 10**30, "train"),
        ("GPTDataset", "/data/x", True, "train"),  # a bool: json's true, not 1
        ("MockGPTDataset", "", -1, ""),
        (["class"], {"a": 1.5}, 2.0, None),  # not Megatron's types: the encoder writes them
    ],
)
def test_a_datasets_own_identifiers_as_json_writes_them(own) -> None:
    tokenizer = NestedTok()
    config = [
        ("random_seed", 1234),
        ("split_matrix", [(0, 0.9), (0.9, 1.0)]),
        ("tokenizer", tokenizer),
    ]
    identifiers = megatrons_identifiers(own, config)
    expected = json.dumps(identifiers, indent=4, default=lambda obj: obj.unique_identifiers)
    memo: dict = {}
    assert describe_in_a_build(identifiers, memo) == expected
    assert describe_in_a_build(megatrons_identifiers(own, config), memo) == expected


def test_the_memo_follows_each_config_and_other_orders() -> None:
    memo: dict = {}
    tokenizer = NestedTok()
    first = [("random_seed", 1234), ("split_matrix", [(0, 1.0)]), ("tokenizer", tokenizer)]
    second = [("random_seed", 1234), ("split_matrix", [(0, 1)]), ("tokenizer", tokenizer)]
    assert first == second  # equal values, other texts: the memo goes by identity
    own = ("GPTDataset", "/data/x", 7, "train")
    for config in (first, second, first, second):
        identifiers = megatrons_identifiers(own, config)
        assert describe_in_a_build(identifiers, memo) == json.dumps(
            identifiers, indent=4, default=lambda obj: obj.unique_identifiers
        )
    shuffled = OrderedDict(reversed(megatrons_identifiers(own, first).items()))
    assert describe_in_a_build(shuffled, memo) == json.dumps(
        shuffled, indent=4, default=lambda obj: obj.unique_identifiers
    )


def test_an_identifier_json_refuses_is_refused_as_json_does() -> None:
    import numpy as np

    identifiers = megatrons_identifiers(
        ("GPTDataset", "/data/x", np.int64(3), "train"), [("seed", 1)]
    )
    with pytest.raises(AttributeError) as theirs:
        json.dumps(identifiers, indent=4, default=lambda obj: obj.unique_identifiers)
    with pytest.raises(AttributeError) as ours:
        describe_in_a_build(identifiers, {})
    assert str(ours.value) == str(theirs.value)


def test_a_build_reads_the_environment_once(blend, monkeypatch: pytest.MonkeyPatch) -> None:
    from repack.megatron import gpt

    _, _, out, root = blend
    asked = []
    read = gpt._phases_in_environment
    monkeypatch.setattr(gpt, "_phases_in_environment", lambda: asked.append(1) or read())
    cls = dataset_class(out)
    built = build(cls, configured(blend, root / "environment"), [60, 20, 10])
    assert len(built[0].datasets) > 1 and asked == [1]  # asked of each train dataset before
    build(cls, configured(blend, root / "environment"), [60, 20, 10])
    assert asked == [1, 1]  # each build asks again


@pytest.mark.parametrize("odd", [None, "dict", "short", "types"])
def test_a_blends_description_as_json_writes_it(odd) -> None:
    """``BlendedDataset``'s identifiers, its datasets' written at their level in the list (or,
    where one of them is not as Megatron fills it, by the encoder): json's text."""
    tokenizer = NestedTok()
    config = [
        ("random_seed", 1),
        ("split_matrix", [(0, 0.5), (0.5, 1.0)]),
        ("tokenizer", tokenizer),
    ]
    listed = [
        megatrons_identifiers(("GPTDataset", f"/data/é{i}", i * 10, "train"), config)
        for i in range(5)
    ]
    if odd == "dict":
        listed[2] = dict(listed[2])
    elif odd == "short":
        listed[3] = OrderedDict([("class", "GPTDataset")])
    elif odd == "types":
        listed[1] = megatrons_identifiers((["GPTDataset"], {"p": 1.5}, 2.0, None), config)
    identifiers = OrderedDict(
        [
            ("class", "BlendedDataset"),
            ("datasets", listed),
            ("split", "train"),
            ("weights", [0.2] * 5),
            ("size", 9),
        ]
    )
    expected = json.dumps(identifiers, indent=4, default=lambda obj: obj.unique_identifiers)
    memo: dict = {}
    buildscope._STATE["memo"] = memo
    try:
        for _ in range(2):  # the memo filled, then used
            assert (
                buildhook._describe_blend(identifiers, lambda obj: obj.unique_identifiers)
                == expected
            )
    finally:
        buildscope._STATE["memo"] = None
