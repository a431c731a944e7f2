"""DataLoader workers read the repacked blend with a few files each and the stock samples.

Workers are forked (they inherit the parent's open repack) or spawned (they unpickle the
datasets, which re-attach to the repack and index cache by reference). Each sample carries the
files its worker holds, counted in the worker itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron_support import (
    GPTDataset,
    Probe,
    build,
    collect,
    gpt_config,
    init_process_group,
    weights_for,
    write_flat_blend,
    write_sources,
)

from repack.format.manifest import load_manifest
from repack.megatron import dataset_class
from repack.merge import merge

pytestmark = pytest.mark.megatron

SIZES = [240, 24, 24]
#: Megatron's BlendedDataset maps its two cached index arrays per split when it hits the cache
BLENDED_MAPS = 2 * 3


@dataclass(frozen=True)
class Data:
    root: Path
    prefixes: list[str]
    weights: list[float]
    out: Path
    shards: int
    #: stock Megatron's train split
    expected: list[dict[str, np.ndarray]]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Data:
    init_process_group()
    root = tmp_path_factory.mktemp("workers")
    prefixes = write_sources(root, 20, seed=17)
    weights = weights_for(prefixes, seed=17)
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes, weights), out)
    config = gpt_config(prefixes, weights, cache=root / "stock-cache")
    expected = collect(build(GPTDataset, config, SIZES))[0]
    return Data(root, prefixes, weights, out, len(load_manifest(out).shards), expected)


def read_with_workers(data: Data, cache: Path, context: str, *, touch: bool) -> list[dict]:
    """Build the repacked splits; read the train split through two workers. ``touch``: read a
    sample in the parent first."""
    train = build(
        dataset_class(data.out), gpt_config(data.prefixes, data.weights, cache=cache), SIZES
    )[0]
    if touch:
        train[0]
    loader = torch.utils.data.DataLoader(
        Probe(train, {"repack": data.out, "cache": cache}),
        batch_size=None,
        num_workers=2,
        multiprocessing_context=context,
    )
    return list(loader)


def check(data: Data, items: list[dict]) -> None:
    assert [item["index"] for item in items] == list(range(len(data.expected)))
    assert len({item["pid"] for item in items}) == 2
    for item in items:
        expected = data.expected[item["index"]]
        assert set(item) - {"index", "pid", "open"} == set(expected)
        for key, value in expected.items():
            assert np.array_equal(np.asarray(item[key]), value), (item["index"], key)
        maps, fds = item["open"]["maps"], item["open"]["fds"]
        assert maps["repack"] <= data.shards + 1  # the index and the shards, once
        assert fds["repack"] <= data.shards + 1
        assert maps["cache"] <= 1 + BLENDED_MAPS  # one pack, and the blended indices
        assert fds["cache"] <= 1 + BLENDED_MAPS


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_workers_hold_few_files_and_read_the_stock_samples(
    data: Data, tmp_path: Path, context: str
) -> None:
    items = read_with_workers(data, tmp_path / "cache", context, touch=True)
    check(data, items)
    assert max(item["open"]["maps"]["repack"] for item in items) >= 2  # counted where it maps


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_workers_need_no_sample_read_in_the_parent(
    data: Data, tmp_path: Path, context: str
) -> None:
    """Megatron hands freshly built datasets to the DataLoader: the parent may never have read
    a sample, so the index cache may hold the built indices only as pending ``.npy`` files."""
    items = read_with_workers(data, tmp_path / "cache", context, touch=False)
    check(data, items)
    assert len(list((tmp_path / "cache").glob("*.rpc"))) == 1


class _GcProbe(torch.utils.data.Dataset):
    """Answers, in the worker, how many objects the collector holds frozen, and whether a
    cycle made in the worker is still collected."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> dict:
        import gc
        import weakref

        class Node:
            pass

        node = Node()
        node.self = node  # a reference cycle, garbage once `node` is dropped
        alive = weakref.ref(node)
        del node
        gc.collect()
        return {"frozen": gc.get_freeze_count(), "cycle_collected": alive() is None}


@pytest.mark.once  # repack's own fork hook (repack.read.reader), whatever the release
@pytest.mark.parametrize("setting", [None, "0"], ids=["default", "off"])
def test_forked_workers_freeze_what_they_inherit(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    """A forked worker of a process with a repack open freezes the objects it inherits (a full
    collection would otherwise copy the parent's heap page by page); what it makes itself is
    still collected. ``REPACK_FORK_GC_FREEZE=0`` leaves the collector alone."""
    import gc

    from repack.read.reader import FORK_GC_FREEZE_ENV

    if setting is None:
        monkeypatch.delenv(FORK_GC_FREEZE_ENV, raising=False)
    else:
        monkeypatch.setenv(FORK_GC_FREEZE_ENV, setting)
    # Python 3.12 starts with a few hundred objects frozen already (3.11: none)
    frozen_at_start = gc.get_freeze_count()
    build(dataset_class(data.out), gpt_config(data.prefixes, data.weights, cache=tmp_path), SIZES)
    assert gc.get_freeze_count() == frozen_at_start  # the parent keeps collecting everything
    loader = torch.utils.data.DataLoader(
        _GcProbe(), batch_size=None, num_workers=1, multiprocessing_context="fork"
    )
    for item in loader:
        assert item["cycle_collected"]
        if setting is None:
            assert item["frozen"] > 100_000  # torch's and Megatron's objects, at least
        else:
            assert item["frozen"] == frozen_at_start


@pytest.mark.parametrize("setting", [None, "0"])
def test_a_fork_returns_the_free_heap_first(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    """A process with a repack open gives the C heap's free pages back before it forks a
    worker (``malloc_trim(0)``), so that the worker does not start with the build's freed
    memory; ``REPACK_FORK_TRIM=0`` keeps them."""
    import os

    from repack.read import reader

    if setting is None:
        monkeypatch.delenv(reader.FORK_TRIM_ENV, raising=False)
    else:
        monkeypatch.setenv(reader.FORK_TRIM_ENV, setting)
    calls: list[int] = []
    monkeypatch.setattr(reader, "_malloc_trim", lambda: calls.append)
    build(dataset_class(data.out), gpt_config(data.prefixes, data.weights, cache=tmp_path), SIZES)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert calls == ([0] if setting is None else [])


def test_a_forked_worker_keeps_glibcs_thresholds(
    data: Data, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """glibc raises its mmap threshold to the size of each mapped block freed, and a forked
    worker inherits it: a worker of a process with a repack open takes a block below it from
    the heap, as the parent and a stock worker do. (Fixed back to 128 KiB there, every large
    per-sample temporary, as the masks of ``reset_attention_mask``, was mapped and faulted in
    again: 1.5-3x the time of a sample at 1,024 tokens.)"""
    import ctypes
    import json
    import os

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc 2.33 or later")

    class Info(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
            "keepcost".split()
        ]

    libc.mallinfo2.restype = Info
    build(dataset_class(data.out), gpt_config(data.prefixes, data.weights, cache=tmp_path), SIZES)
    raised = 30 << 20  # glibc raises it up to 32 MiB
    big = bytearray(raised)  # mapped; freed, it raises this process's threshold to 30 MiB
    del big
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            size = 4 << 20
            before = libc.mallinfo2().hblkhd
            block = bytearray(size)
            mapped = libc.mallinfo2().hblkhd >= before + len(block)
            os.write(write, json.dumps({"mapped": mapped}).encode())
        finally:
            os._exit(0)
    os.close(write)
    found = json.loads(os.read(read, 1 << 16))
    os.close(read)
    os.waitpid(pid, 0)
    assert found["mapped"] is False
