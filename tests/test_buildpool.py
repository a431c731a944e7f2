"""Megatron's builder builds a repack's datasets in the calling thread when its pool would have one
thread (issue 44: the pool's futures, made up front and freed after, leave holes that the
datasets built meanwhile pin), and gives what the pool would; stock builds, and builds of more
threads, keep the pool (:mod:`repack.megatron.buildpool`)."""

from __future__ import annotations

import threading
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

from repack.megatron import buildpool, dataset_class
from repack.megatron.mixin import Repacked

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> None:
    init_process_group()


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("buildpool")
    prefixes, weights, out = merged_blend(root, 6, seed=46, sequences=(4, 12), tokens=(40, 400))
    return prefixes, weights, out, root


def _recording(base: type, threads: list) -> type:
    class Recording(base):
        @classmethod
        def build_low_level_dataset(cls, dataset_path, config):
            threads.append(threading.current_thread())
            return super().build_low_level_dataset(dataset_path, config)

    Recording.__name__ = base.__name__  # the stock name: the same cache hashes
    return Recording


def _built(cls: type, blend, cache: Path, threads: int = 1):
    prefixes, weights, _, _ = blend
    config = gpt_config(prefixes, weights, split="100,0,0", cache=cache, threads=threads)
    return build(cls, config, [20 * len(prefixes), 0, 0])


def test_a_repack_is_built_in_the_calling_thread(blend) -> None:
    prefixes, _, out, root = blend
    seen: list = []
    ours = _built(_recording(dataset_class(out), seen), blend, root / "ours")
    assert len(seen) == len(prefixes)
    assert all(thread is threading.current_thread() for thread in seen)

    stock_seen: list = []
    stock = _built(_recording(GPTDataset, stock_seen), blend, root / "stock")
    assert len(stock_seen) == len(prefixes)
    assert all(thread is not threading.current_thread() for thread in stock_seen)  # the pool's
    assert_same_samples(collect(stock), collect(ours))

    many: list = []
    more = _built(_recording(dataset_class(out), many), blend, root / "threads", threads=2)
    assert all(thread is not threading.current_thread() for thread in many)
    assert_same_samples(collect(stock), collect(more))


class _Builder:
    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.calls: list = []

    def build(self, i: int) -> int:
        self.calls.append((i, threading.current_thread()))
        if i in (1, 3):
            raise ValueError(f"dataset {i}")
        return 10 * i


def test_a_failing_call_is_raised_by_its_result_and_the_next_ones_run() -> None:
    class Mine(Repacked):
        pass

    builder = _Builder(Mine)
    with buildpool.BuildPool(max_workers=1) as pool:
        futures = [pool.submit(builder.build, i) for i in range(5)]
    assert [i for i, _ in builder.calls] == [0, 1, 2, 3, 4]  # as the pool: every call runs
    assert all(thread is threading.current_thread() for _, thread in builder.calls)
    assert futures[0].result() == 0 and futures[4].result() == 40
    with pytest.raises(ValueError, match="dataset 1"):
        futures[1].result()
    assert str(futures[3].exception()) == "dataset 3"

    stock = _Builder(object)  # not a repacked class: the real pool
    with buildpool.BuildPool(max_workers=1) as pool:
        futures = [pool.submit(stock.build, i) for i in range(3)]
    assert futures[2].result() == 20
    assert all(thread is not threading.current_thread() for _, thread in stock.calls)


def test_a_pool_of_no_thread_is_refused_as_stock_refuses_it() -> None:
    import concurrent.futures

    with pytest.raises(ValueError) as stock:
        concurrent.futures.ThreadPoolExecutor(max_workers=0)
    with pytest.raises(ValueError) as ours:
        buildpool.BuildPool(max_workers=0)
    assert str(ours.value) == str(stock.value)


def test_installed_once_and_not_over_another_hand() -> None:
    from megatron.core.datasets import blended_megatron_dataset_builder as module

    assert module.ThreadPoolExecutor is buildpool.BuildPool
    buildpool.install()  # again: nothing changes
    assert module.ThreadPoolExecutor is buildpool.BuildPool
    mine = object()
    module.ThreadPoolExecutor = mine
    try:
        buildpool.install()
        assert module.ThreadPoolExecutor is mine
    finally:
        module.ThreadPoolExecutor = buildpool.BuildPool
