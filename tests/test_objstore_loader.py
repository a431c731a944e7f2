"""Training from a repack on S3 (SeaweedFS on 127.0.0.1): Megatron-Core's
``BlendedMegatronDatasetBuilder`` over ``RepackedGPTDataset`` bound to ``s3://...`` gives
stock ``GPTDataset``'s samples on the original local files, bit for bit, cold and warm; the
index caches go to the node-local cache (``REPACK_CACHE_DIR``), not next to anything."""

from __future__ import annotations

import os

import pytest
from megatron_support import (
    GPTDataset,
    assert_same_samples,
    build,
    collect,
    gpt_config,
    init_process_group,
    weights_for,
    write_flat_blend,
    write_sources,
)

from repack.megatron import dataset_class
from repack.merge import merge
from repack.read import readahead
from repack.read.reader import open_repack
from repack.read.views import SourceDataset

pytestmark = pytest.mark.megatron

SIZES = [600, 40, 40]


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> None:
    init_process_group()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("s3-loader")
    prefixes = write_sources(root, 12, seed=3)
    weights = weights_for(prefixes, seed=3)
    return root, prefixes, weights


@pytest.mark.parametrize(
    ("scheme", "mmap"),
    [
        pytest.param("s3", True, marks=pytest.mark.slow),
        ("s3", False),
        pytest.param("msc", True, marks=pytest.mark.slow),
    ],
    ids=["s3-mmap", "s3-pread", "msc"],
)
def test_loader_on_s3_gives_the_stock_samples(s3, sources, tmp_path, monkeypatch, scheme, mmap):
    from s3_support import RequestCounter, missing, msc_profile

    root, prefixes, weights = sources
    cache = tmp_path / "node-cache"
    monkeypatch.setenv("REPACK_CACHE_DIR", str(cache))
    url = f"s3://{s3.new_bucket()}/train.repack"
    if scheme == "msc":
        import importlib.util

        if importlib.util.find_spec("multistorageclient") is None:
            missing("multi-storage-client not installed: pip install -e '.[msc]'")
        monkeypatch.setenv("MSC_CONFIG", "")
        url = msc_profile(s3, tmp_path, s3.new_bucket()) + "/train.repack"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes, weights), url, shard_size=8192)
    kwargs = dict(prefixes=prefixes, weights=weights, seed=77, mmap=mmap, sequence_length=48)
    stock = collect(build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "stock"), SIZES))
    before = sorted(os.listdir(tmp_path))
    data_before = sorted(str(p) for p in root.rglob("*"))
    cold = collect(build(dataset_class(url), gpt_config(**kwargs), SIZES))
    assert_same_samples(stock, cold)
    # nothing written next to the sources or in the working folder: caches are node-local
    assert sorted(set(os.listdir(tmp_path)) - {"node-cache"}) == before
    assert sorted(str(p) for p in root.rglob("*")) == data_before
    assert list(cache.rglob("GPTDataset_indices"))
    reads = []
    real_read = SourceDataset._read

    def counted(self, idx, offset, count):
        reads.append(count)
        return real_read(self, idx, offset, count)

    monkeypatch.setattr(SourceDataset, "_read", counted)
    ahead = open_repack(url, "mmap" if mmap else "pread").read_ahead
    ahead.clear()  # what the cold run fetched
    with RequestCounter() as warm_requests:
        warm = collect(build(dataset_class(url), gpt_config(**kwargs), SIZES))
    assert_same_samples(stock, warm)
    pieces = sum(1 for n in reads if n)
    stats = ahead.stats
    # every piece read came from a range fetched for its sample or ahead of it
    assert stats.misses == 0 and stats.hits == pieces
    # most ahead of it: the samples are read in the blend's order, which the loader learns
    assert stats.ahead_hits >= 0.9 * pieces, stats
    if scheme == "s3":  # (MSC sends its requests through clients of its own)
        # the repack stays open in the process: exact ranged GETs, the pieces of a sample in
        # one shard merged, so at most one per piece of a sample read (none for an empty
        # piece); every one the read-ahead's, nothing else, nothing written
        assert set(warm_requests.counts) == {"GetObject"}
        assert warm_requests.counts["GetObject"] == stats.requests <= pieces


@pytest.mark.slow  # forked workers and S3 clients are repack's: the releases between skip it
def test_dataloader_workers_read_s3_with_clients_of_their_own(s3, sources, tmp_path, monkeypatch):
    """Forked DataLoader workers inherit the open repack and make their own S3 client (a
    connection pool must not cross a fork): the samples are stock's."""
    import numpy as np
    import torch

    _, prefixes, weights = sources
    monkeypatch.setenv("REPACK_CACHE_DIR", str(tmp_path / "node-cache"))
    url = f"s3://{s3.new_bucket()}/train.repack"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes, weights), url, shard_size=8192)
    kwargs = dict(prefixes=prefixes, weights=weights, seed=5, sequence_length=48)
    stock = build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "stock"), SIZES)[0]
    ours = build(dataset_class(url), gpt_config(**kwargs), SIZES)[0]
    ours[0]  # the parent has read (and made its client) before the workers fork
    loader = torch.utils.data.DataLoader(
        ours, batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    for i, sample in enumerate(loader):
        if i == 120:
            break
        assert np.array_equal(sample["tokens"].numpy(), np.asarray(stock[i]["tokens"]))


def test_repack_dir_may_be_a_url(s3, sources, tmp_path, monkeypatch):
    """``REPACK_DIR=s3://...`` with the ready-made ``RepackedGPTDataset``."""
    from repack.megatron import RepackedGPTDataset

    _, prefixes, weights = sources
    monkeypatch.setenv("REPACK_CACHE_DIR", str(tmp_path / "node-cache"))
    url = f"s3://{s3.new_bucket()}/train.repack"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes, weights), url)
    monkeypatch.setenv("REPACK_DIR", url)
    kwargs = dict(prefixes=prefixes, weights=weights, seed=9, sequence_length=32)
    stock = collect(build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "stock"), SIZES))
    ours = collect(build(RepackedGPTDataset, gpt_config(**kwargs), SIZES))
    assert_same_samples(stock, ours)


@pytest.mark.once  # the read-ahead's own bound: the stock samples are checked on every release
def test_read_ahead_holds_at_most_its_bound(s3, sources, tmp_path, monkeypatch):
    """``REPACK_READ_CACHE`` bounds the bytes fetched and in flight: with a bound smaller
    than the read-ahead wants, fetches are skipped or dropped, never held beyond it, and the
    samples are still stock's. ``REPACK_READ_CACHE=0``: one GET per piece, no cache."""
    from s3_support import RequestCounter

    _, prefixes, weights = sources
    monkeypatch.setenv("REPACK_CACHE_DIR", str(tmp_path / "node-cache"))
    monkeypatch.setattr(readahead, "MERGE_GAP", 0)  # one range per piece: many small ones
    url = f"s3://{s3.new_bucket()}/train.repack"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes, weights), url, shard_size=8192)
    kwargs = dict(prefixes=prefixes, weights=weights, seed=11, sequence_length=48)
    stock = collect(build(GPTDataset, gpt_config(**kwargs, cache=tmp_path / "stock"), SIZES))
    limit = 2048
    monkeypatch.setenv("REPACK_READ_CACHE", f"{limit}B")
    monkeypatch.setenv("REPACK_READ_AHEAD", "64")
    ours = collect(build(dataset_class(url), gpt_config(**kwargs), SIZES))
    assert_same_samples(stock, ours)
    stats = open_repack(url).read_ahead.stats
    assert stats.ahead_hits > 0
    assert 0 < stats.peak_bytes <= limit
    assert stats.skipped + stats.evicted_unused > 0, stats  # the bound was met, and held

    # off: no cache at all, one GET per non-empty piece read, in the calling thread
    monkeypatch.setenv("REPACK_READ_CACHE", "0")
    url_off = f"s3://{s3.new_bucket()}/off.repack"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes, weights), url_off, shard_size=8192)
    assert open_repack(url_off).read_ahead is None
    reads = []
    real_read = SourceDataset._read

    def counted(self, idx, offset, count):
        reads.append(count)
        return real_read(self, idx, offset, count)

    monkeypatch.setattr(SourceDataset, "_read", counted)
    build(dataset_class(url_off), gpt_config(**kwargs), SIZES)  # the index caches, cold
    reads.clear()
    with RequestCounter() as requests:
        off = collect(build(dataset_class(url_off), gpt_config(**kwargs), SIZES))
    assert_same_samples(stock, off)
    assert requests.counts == {"GetObject": sum(1 for n in reads if n)}


def test_bad_read_ahead_settings_are_refused(s3, sources, tmp_path, monkeypatch):
    from repack.errors import InputError

    _, prefixes, weights = sources
    monkeypatch.setenv("REPACK_CACHE_DIR", str(tmp_path / "node-cache"))
    url = f"s3://{s3.new_bucket()}/train.repack"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes[:2], weights[:2]), url)
    monkeypatch.setenv("REPACK_READ_CACHE", "lots")
    with pytest.raises(InputError, match=r"^REPACK_READ_CACHE='lots': expected a size"):
        dataset_class(url)
    monkeypatch.setenv("REPACK_READ_CACHE", "1MiB")
    monkeypatch.setenv("REPACK_READ_AHEAD", "-3")
    with pytest.raises(InputError, match=r"^REPACK_READ_AHEAD='-3': expected a number"):
        dataset_class(url)


@pytest.mark.once  # repack's own retries (repack/store/retry.py), not a release's
def test_loader_under_faults(s3, sources, tmp_path, monkeypatch):
    """The loader through a fault-injecting proxy (tests/s3_faults.py), read-ahead on: with
    20 % of requests throttled, and with 30 % of replies cut mid-body, 10 seeds each, the
    samples are those of a run without faults; a frozen server ends the read with one error
    naming a shard and the bound, the read-ahead's wait and the loader's not added up.
    Ranged GETs answered with the whole object after a cut (5 seeds), and always: the same
    samples; the whole object refused (past ``WHOLE_REPLY_SKIP``): a ``StoreError`` naming
    the range ignored, never other bytes."""
    from s3_faults import FaultProxy, whole_reader

    from repack.errors import Stalled, StoreError
    from repack.store import retry
    from repack.store import s3 as s3_store

    _, prefixes, weights = sources
    monkeypatch.setenv("REPACK_CACHE_DIR", str(tmp_path / "node-cache"))
    monkeypatch.setattr(retry, "FIRST_DELAY", 0.01)  # the same policy, shorter waits
    monkeypatch.setattr(retry, "MAX_DELAY", 0.05)
    monkeypatch.setattr(retry, "_silence", retry._Silence())
    url = f"s3://{s3.new_bucket()}/train.repack"
    merge(write_flat_blend(tmp_path / "blend.json", prefixes, weights), url, shard_size=8192)
    config = gpt_config(prefixes=prefixes, weights=weights, seed=21, sequence_length=48, mmap=True)
    train = build(dataset_class(url), config, SIZES)[0]

    def samples() -> list:
        open_repack(url, "mmap").read_ahead.clear()  # nothing fetched, no order learnt
        return collect([[train[i] for i in range(120)]])

    reference = samples()  # straight to the server
    with FaultProxy(s3.endpoint, whole_reader(s3.client())) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        for fault, rate in (("throttle", 0.2), ("cut", 0.3)):
            for seed in range(10):
                proxy.set(seed=seed, **{fault: rate})
                found = samples()
                assert proxy.counts[fault] > 0, (fault, seed, proxy.counts)
                assert_same_samples(reference, found)
        for seed, whole in [(seed, "after-cut") for seed in range(5)] + [(0, "always")]:
            proxy.set(seed=seed, cut=0.3 if whole == "after-cut" else 0, whole=whole)
            found = samples()
            assert proxy.counts["whole"] > 0, (whole, seed, proxy.counts)
            assert_same_samples(reference, found)
        bound = s3_store.WHOLE_REPLY_SKIP
        monkeypatch.setattr(s3_store, "WHOLE_REPLY_SKIP", 0)
        proxy.set(whole="always")
        with pytest.raises(StoreError) as caught:
            samples()
        assert str(caught.value).startswith(f"{url}/shard-"), caught.value
        assert "the server ignored the range bytes=" in str(caught.value)
        monkeypatch.setattr(s3_store, "WHOLE_REPLY_SKIP", bound)
        monkeypatch.setenv("REPACK_S3_STALL_TIMEOUT", "1")
        proxy.set(frozen=True)
        with pytest.raises(Stalled) as caught:
            samples()
        message = str(caught.value)
        assert message.startswith(f"{url}/shard-"), message
        assert message.endswith("(REPACK_S3_STALL_TIMEOUT=1 bounds the wait)"), message
        assert "no answer from the server" in message
        proxy.set()
