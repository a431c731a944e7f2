"""A ``BlendedDataset`` of a repack's datasets holds its description as text only until Megatron
has hashed it, compressed after (issue 44: about 600 bytes per source in every DataLoader
worker), and gives the same text when read; a stock blend keeps its own
(:mod:`repack.megatron.blenddesc`)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from megatron_support import (
    GPTDataset,
    assert_same_samples,
    build,
    collect,
    gpt_config,
    init_process_group,
    merged_blend,
)

from repack.megatron import blenddesc, dataset_class

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> None:
    init_process_group()


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("blenddesc")
    prefixes, weights, out = merged_blend(root, 5, seed=47, sequences=(4, 12), tokens=(40, 400))
    return prefixes, weights, out, root


def _built(cls: type, blend, cache: Path):
    prefixes, weights, _, _ = blend
    config = gpt_config(prefixes, weights, split="100,0,0", cache=cache)
    return build(cls, config, [20 * len(prefixes), 0, 0])


def _description_file(cache: Path) -> str:
    (found,) = cache.glob("*-BlendedDataset-train-description.txt")
    return found.read_text()


def test_described_again_as_stock_describes(blend) -> None:
    _, _, out, root = blend
    ours = _built(dataset_class(out), blend, root / "ours")  # cold: Megatron writes its text
    stock = _built(GPTDataset, blend, root / "stock")
    assert_same_samples(collect(stock), collect(ours))
    mine, theirs = ours[0], stock[0]
    assert "unique_description" not in vars(mine)  # hashed, then not held
    assert "unique_description" in vars(theirs)  # stock's own, where stock keeps it
    assert blenddesc._HELD not in vars(theirs)
    assert mine.unique_description_hash == theirs.unique_description_hash
    assert mine.unique_description == theirs.unique_description
    assert "unique_description" not in vars(mine)  # read again: still not held
    assert _description_file(root / "ours") == _description_file(root / "stock")
    assert _description_file(root / "ours") == theirs.unique_description

    warm = _built(dataset_class(out), blend, root / "ours")[0]
    assert warm.unique_description == theirs.unique_description
    again = pickle.loads(pickle.dumps(mine))  # what a spawned worker gets
    assert "unique_description" not in vars(again)
    assert again.unique_description == theirs.unique_description
    assert_same_samples(collect(stock), collect([again, None, None]))


def test_held_compressed_as_it_was_described(blend) -> None:
    _, _, out, root = blend
    mine = _built(dataset_class(out), blend, root / "held")[0]
    text = mine.unique_description
    compressed = vars(mine)[blenddesc._HELD]
    assert isinstance(compressed, bytes) and len(compressed) < len(text) // 3
    mine.datasets[0].num_samples += 1  # identifiers changed after: the text is what was hashed
    assert mine.unique_description == text
    mine.datasets[0].num_samples -= 1
    mine.unique_description = "given"  # set by hand: held, as stock holds it
    assert mine.unique_description == "given" and mine.unique_description == "given"
    assert vars(mine)["unique_description"] == "given" and blenddesc._HELD not in vars(mine)
    del mine.unique_description
    with pytest.raises(AttributeError):
        mine.unique_description  # noqa: B018


def test_installed_once() -> None:
    from megatron.core.datasets.blended_dataset import BlendedDataset

    installed = vars(BlendedDataset)["unique_description"]
    assert isinstance(installed, blenddesc.BlendedDescription)
    blenddesc.install()
    assert vars(BlendedDataset)["unique_description"] is installed
