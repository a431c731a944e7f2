"""The masks and position ids ``GPTDataset`` caches per dataset, held once per process by the
repacked classes (``repack.megatron.masks``): shared, computed once, and the samples (and batches,
whose samples alias stock's cached tensors) bit-identical to stock's, masks on and off, with padding
labels that stock writes into its cached loss mask.

Run on every megatron-core of the parity matrix (marker ``megatron``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron_support import (
    GPTDataset,
    Tok,
    assert_same_samples,
    build,
    collect,
    digest,
    gpt_config,
    init_process_group,
    write_flat_blend,
)

from repack.megatron import dataset_class
from repack.megatron.masks import SHARED
from repack.merge import merge
from repack.synth import write_prefix

pytestmark = pytest.mark.megatron

SOURCES = 12
SIZES = [400, 40, 40]
#: a token id frequent in the data: stock zeroes the loss mask where a label is padding
PAD = 3


class PadTok(Tok):
    """A tokenizer whose padding id is a frequent token, as with tokenizers that pad with EOD."""

    pad = PAD

    def __init__(self) -> None:
        super().__init__(64)
        self.unique_identifiers = {"class": "PadTok", "vocab_size": 64}


@dataclass(frozen=True)
class Data:
    prefixes: list[str]
    out: Path


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> None:
    init_process_group()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    root = tmp_path_factory.mktemp("masks")
    rng = np.random.default_rng(11)
    prefixes = []
    for i in range(SOURCES):
        sequences = [rng.integers(1, 64, int(rng.integers(5, 90))) for _ in range(30)]
        prefix = str(root / "data" / f"src-{i:02d}")
        write_prefix(prefix, sequences, dtype=np.uint16)
        prefixes.append(prefix)
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes), out)
    return Data(prefixes, out)


def config(
    data: Data,
    cache: Path,
    *,
    masks: bool = True,
    pad: bool = False,
    length: int = 32,
    extra_token: bool = True,
):
    made = gpt_config(
        data.prefixes, [1.0] * SOURCES, sequence_length=length, cache=cache, attention_mask=masks
    )
    if pad:
        made.tokenizer = PadTok()
    made.add_extra_token_to_sequence = extra_token
    return made


def batches(split, seed: int = 5) -> list[dict[str, np.ndarray]]:
    """Every batch of a shuffled single-process DataLoader over ``split``: the samples of one
    batch are collated together, so a cached tensor stock writes into shows in its batch."""
    loader = torch.utils.data.DataLoader(
        split, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed)
    )
    return [{k: v.numpy().copy() for k, v in batch.items()} for batch in loader]


# every value of each knob, and each pair of values of two knobs, in four runs of the eight
@pytest.mark.parametrize(
    ("masks", "pad", "extra_token"),
    [(True, True, True), (False, True, False), (True, False, False), (False, False, True)],
    ids=[
        "masks-pad-extra",
        "no-masks-pad-no-extra",
        "masks-no-pad-no-extra",
        "no-masks-no-pad-extra",
    ],
)
def test_samples_and_batches_are_stock(
    data: Data, tmp_path: Path, masks: bool, pad: bool, extra_token: bool
) -> None:
    def run(cls, cache):
        splits = build(
            cls, config(data, cache, masks=masks, pad=pad, extra_token=extra_token), SIZES
        )
        return batches(splits[0]), collect(splits)

    stock_batches, stock_samples = run(GPTDataset, tmp_path / "stock")
    ours_batches, ours_samples = run(dataset_class(data.out), tmp_path / "ours")
    assert len(ours_batches) == len(stock_batches)
    for want, got in zip(stock_batches, ours_batches):
        assert want.keys() == got.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype
            assert np.array_equal(got[key], want[key]), key
    assert_same_samples(stock_samples, ours_samples)
    assert ("attention_mask" in stock_samples[0][0]) == masks
    if pad:  # premise: padding labels zeroed some of the loss masks
        assert any(not b["loss_mask"].all() for b in stock_batches)


def test_datasets_of_a_process_share_one_set_of_masks(data: Data, tmp_path: Path) -> None:
    SHARED.clear()
    before = SHARED.computed
    train, _, _ = build(dataset_class(data.out), config(data, tmp_path, length=40), SIZES)
    assert len(train.datasets) == SOURCES
    firsts = [dataset[0] for dataset in train.datasets]
    seconds = [dataset[1] for dataset in train.datasets]
    # Megatron's function ran once for the whole build, not once per dataset
    assert SHARED.computed - before == 1
    for key in ("attention_mask", "position_ids"):
        assert len({id(sample[key]) for sample in firsts + seconds}) == 1, key
        assert len({id(getattr(d, "cached_" + key)) for d in train.datasets}) == 1, key
    assert firsts[0]["attention_mask"].shape == (1, 40, 40)
    # the loss masks: one for the process where the release clones it per sample (stock hands
    # out a copy), else each dataset's own, which stock writes into
    loss_masks = {id(d.cached_loss_mask) for d in train.datasets}
    clones = seconds[0]["loss_mask"] is not train.datasets[0].cached_loss_mask
    assert len(loss_masks) == (1 if clones else SOURCES)
    assert all(s["loss_mask"] is not f["loss_mask"] for s, f in zip(seconds, firsts)) == clones


def test_building_more_datasets_adds_no_mask(data: Data, tmp_path: Path) -> None:
    """A second build in the process (other seed, same length) computes nothing: the masks of
    the first are handed out again."""
    SHARED.clear()
    cls = dataset_class(data.out)
    first, _, _ = build(cls, config(data, tmp_path / "a", length=24), SIZES)
    for dataset in first.datasets:
        dataset[0]
    computed = SHARED.computed
    again = config(data, tmp_path / "b", length=24)
    again.random_seed = 99
    second, _, _ = build(cls, again, SIZES)
    for dataset in second.datasets:
        dataset[0]
    assert SHARED.computed == computed
    assert len(SHARED) == 1
    assert second.datasets[-1].cached_attention_mask is first.datasets[0].cached_attention_mask


def test_the_first_masks_give_their_temporaries_back(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Megatron's S x S temporaries, freed into a heap that keeps them resident (a large
    build raised glibc's trim threshold), are given back once, when the table computes masks
    (``malloc_trim(0)``); masks handed out again, and per-sample masks, trim nothing."""
    from repack.read import reader

    SHARED.clear()
    trims: list[int] = []
    monkeypatch.setattr(reader, "_malloc_trim", lambda: trims.append)
    train, _, _ = build(dataset_class(data.out), config(data, tmp_path / "a", length=40), SIZES)
    for dataset in train.datasets:
        dataset[0], dataset[1]
    assert trims == [0]
    made = config(data, tmp_path / "b", length=40)
    made.reset_attention_mask = True  # per sample: computed by each sample, as stock
    train, _, _ = build(dataset_class(data.out), made, SIZES)
    for dataset in train.datasets:
        dataset[0], dataset[1]
    assert trims == [0]


def test_stock_datasets_are_left_alone(data: Data, tmp_path: Path) -> None:
    """The wrapped Megatron function answers stock's own datasets as Megatron does: each keeps
    masks of its own."""
    SHARED.clear()
    train, _, _ = build(GPTDataset, config(data, tmp_path, length=40), SIZES)
    for dataset in train.datasets:
        dataset[0]
    assert len(SHARED) == 0
    assert len({id(d.cached_attention_mask) for d in train.datasets}) == SOURCES


def test_masks_that_depend_on_the_tokens_are_not_shared(data: Data, tmp_path: Path) -> None:
    SHARED.clear()
    made = config(data, tmp_path / "ours", length=40)
    made.reset_position_ids = True
    made.eod_mask_loss = True
    ours = build(dataset_class(data.out), made, SIZES)
    made = config(data, tmp_path / "stock", length=40)
    made.reset_position_ids = True
    made.eod_mask_loss = True
    assert_same_samples(collect(build(GPTDataset, made, SIZES)), collect(ours))
    assert len(SHARED) == 0


# --- only where stock's contract holds ------------------------------------------------------


def stock_reference(data: Data, cache: Path, *, cls: str, masks: bool, length: int) -> list:
    """Stock's per-split digests, computed in a child process that never imports repack
    (tests/stock_masks_child.py): before any wrapper of repack's exists."""
    cache.mkdir(parents=True)
    job = {
        "prefixes": data.prefixes,
        "weights": [1.0] * SOURCES,
        "seed": 1234,
        "length": length,
        "masks": masks,
        "sizes": SIZES,
        "cache": str(cache),
        "cls": cls,
    }
    path = cache / "job.json"
    path.write_text(json.dumps(job))
    child = Path(__file__).with_name("stock_masks_child.py")
    done = subprocess.run(
        [sys.executable, str(child), str(path)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("masks", [True, False], ids=["masks", "no-masks"])
def test_samples_are_those_of_stock_in_a_process_without_repack(
    data: Data, tmp_path: Path, masks: bool
) -> None:
    want = stock_reference(data, tmp_path / "stock", cls="GPTDataset", masks=masks, length=32)
    got = collect(
        build(dataset_class(data.out), config(data, tmp_path / "ours", masks=masks), SIZES)
    )
    assert digest(got) == want


def test_a_subclass_that_writes_into_its_masks_keeps_them_its_own(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stock_masks_child import Flipping

    from repack.megatron import masks, repacked

    want = stock_reference(data, tmp_path / "stock", cls="Flipping", masks=True, length=32)
    cls = repacked(Flipping, data.out)
    assert not masks.shares(cls)
    SHARED.clear()
    got = collect(build(cls, config(data, tmp_path / "ours"), SIZES))
    assert digest(got) == want
    assert len(SHARED) == 0  # nothing lent: each dataset computed its own, as stock
    # the premise: were its datasets to share (allowed by mistake), their samples would differ
    monkeypatch.setattr(masks, "ALLOWED", {Flipping})
    monkeypatch.setattr(masks, "_SHARES", {})
    assert masks.shares(cls)
    SHARED.clear()
    shared = collect(build(cls, config(data, tmp_path / "shared"), SIZES))
    assert digest(shared) != want


def test_stock_getitem_and_allowed_classes_share() -> None:
    from stock_masks_child import Flipping

    from repack.megatron import masks, repacked

    class Plain(GPTDataset):  # no __getitem__ of its own: stock's runs
        pass

    assert masks.shares(repacked(GPTDataset))
    assert masks.shares(repacked(Plain))
    assert not masks.shares(repacked(Flipping))
    try:
        masks.allow(Flipping)
        assert masks.shares(repacked(Flipping))
    finally:
        masks.ALLOWED.discard(Flipping)
        masks._SHARES.clear()
    assert not masks.shares(repacked(Flipping))


def test_lending_nests() -> None:
    state = SHARED._lending
    assert not state.active
    with SHARED.lending():
        with SHARED.lending():
            assert state.active
        assert state.active  # restored, not reset
    assert not state.active


def test_a_worker_forked_while_the_table_is_locked_can_use_it() -> None:
    """A DataLoader worker forked while another thread of its parent held the table's lock
    gets a lock of its own (the fork hook), instead of waiting forever."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with SHARED._lock:
            held.set()
            release.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(10)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the point
            pid = os.fork()
        if pid == 0:  # the child
            os._exit(0 if SHARED._lock.acquire(timeout=5) else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        thread.join()
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child found the table locked"
