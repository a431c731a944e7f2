"""``repack bench``: its planned reads are the loader's, its cold replays read storage, and its
stall share follows the step time.

* **Exact.** Each rank's loader is built as Megatron-LM builds it (the datasets by megatron-core's
  own builder, with repack's class or stock's ``GPTDataset``; a torch ``DataLoader`` with
  Megatron-LM's batch sampler, started where iteration k starts, with forked workers), every
  read call of its workers recorded (``Repack.read``; stock's ``IndexedDataset.get``) for
  iterations k..k+m, and compared with the bench's plan: the same reads, by the same rank and
  worker. Megatron-LM's samplers ship in the 0.17+ wheels only; elsewhere the batch sampler is
  made from repack's sampler arithmetic (which ``tests/test_trace.py`` holds to Megatron's on
  0.17+), and the test fails instead of falling back where ``REPACK_TEST_SAMPLERS`` is set.
* **Cache bypassed**, on this machine's disk: a cold replay finds 0 pages resident and its
  processes fetch 95-130 % of the bytes its samples hold; run again without eviction, it is
  reported as cached, with no storage figure.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from megatron_support import (
    BlendedMegatronDatasetBuilder,
    GPTDataset,
    gpt_config,
    init_process_group,
    megatron_samplers,
    weights_for,
    write_flat_blend,
    write_sources,
)

from repack.bench.plan import plan_reads
from repack.bench.report import figures
from repack.bench.run import bench
from repack.cli import main
from repack.format.manifest import load_manifest
from repack.megatron import MEGATRON_VERSION, dataset_class
from repack.merge import merge
from repack.read.reader import Repack
from repack.samples.samplers import Sampler
from repack.trace.run import open_run
from repack.trace.settings import TraceSettings, release_of

pytestmark = pytest.mark.megatron

RELEASE = release_of(MEGATRON_VERSION)
SEQ = 32
RUN = {
    "seq_length": SEQ,
    "split": "100,0,0",
    "micro_batch_size": 2,
    "data_parallel_size": 2,
    "global_batch_size": 8,
    "train_iters": 12,
    "eval_iters": 0,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    init_process_group()
    root = tmp_path_factory.mktemp("bench")
    prefixes = write_sources(root, 7, seed=5, sequences=(30, 60), tokens=(3, 90))
    weights = weights_for(prefixes, seed=5)
    blend = write_flat_blend(root / "blend.json", prefixes, weights)
    out = root / "out"
    merge(blend, out)
    return root, prefixes, weights, blend, out


# --- exact: the plan is the loader's reads ---------------------------------------------------


class _Recorder:
    """Records every read call of the processes forked while it is on, one file per process."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.rank = -1

    def log(self, file: str, offset: int, size: int) -> None:
        info = torch.utils.data.get_worker_info()
        worker = -1 if info is None else info.id
        path = self.folder / f"{self.rank}-{worker}-{os.getpid()}.jsonl"
        with open(path, "a") as stream:
            stream.write(json.dumps([self.rank, worker, file, int(offset), int(size)]) + "\n")

    def reads(self) -> collections.Counter:
        found: collections.Counter = collections.Counter()
        for path in self.folder.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                found[tuple(json.loads(line))] += 1
        return found


def _batch_sampler(samplers, dataset, kind: str, consumed: int, rank: int):
    mbs, dp = RUN["micro_batch_size"], RUN["data_parallel_size"]
    if samplers is not None:
        if kind == "single":
            return samplers.MegatronPretrainingSampler(len(dataset), consumed, mbs, rank, dp)
        return samplers.MegatronPretrainingRandomSampler(
            dataset, len(dataset), consumed, mbs, rank, dp, True
        )
    sampler = Sampler(kind, len(dataset), mbs, dp)

    def batches():
        step = consumed
        while step + sampler.unit <= len(dataset) or kind == "cyclic":
            yield [int(i) for i in sampler.indices(step, rank, np.arange(mbs))]
            step += sampler.unit

    return list(itertools.islice(batches(), 64))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("layout", ["repack", "prefixes"])
@pytest.mark.parametrize("kind", ["single", "cyclic"])
def test_the_plan_is_the_loaders_reads(run, tmp_path, monkeypatch, layout, kind):
    """Iterations 5-7 of two ranks, three forked workers each: every read call of the workers
    is a planned read of that rank and worker, and every planned read is made."""
    samplers = megatron_samplers()
    _, prefixes, weights, blend, out = run
    values = {**RUN, "dataloader_type": kind}
    target = out if layout == "repack" else blend
    opened = open_run(target, values)
    first, last, workers = 5, 7, 3  # 8 micro-batches before: worker 2 reads the first
    plan = plan_reads(opened.tracer, first, last, (0, 1), workers, layout, os.fspath(target))
    assert len(plan.read_size) > 30

    recorder = _Recorder(tmp_path)
    if layout == "repack":
        original = Repack.read

        def read(self, shard, offset, count, dtype):
            recorder.log(str(shard), offset, count * np.dtype(dtype).itemsize)
            return original(self, shard, offset, count, dtype)

        monkeypatch.setattr(Repack, "read", read)
        cls = dataset_class(out)
    else:
        from megatron.core.datasets.indexed_dataset import DType, IndexedDataset

        original_get = IndexedDataset.get

        def get(self, idx, offset=0, length=None):
            pointer, size, _ = self.index[idx]
            length = size - offset if length is None else length
            itemsize = DType.size(self.index.dtype)
            recorder.log(self.path_prefix + ".bin", pointer + offset * itemsize, length * itemsize)
            return original_get(self, idx, offset, length)

        monkeypatch.setattr(IndexedDataset, "get", get)
        cls = GPTDataset
    settings = TraceSettings.from_values({**values}, RELEASE)
    config = gpt_config(prefixes, weights, sequence_length=SEQ, split="100,0,0", cache=tmp_path)
    train = BlendedMegatronDatasetBuilder(cls, list(settings.sizes), lambda: True, config).build()[
        0
    ]
    unit = RUN["micro_batch_size"] * RUN["data_parallel_size"]
    per_iteration = RUN["global_batch_size"] // unit
    consumed = (first - 1) * RUN["global_batch_size"]
    for rank in (0, 1):
        recorder.rank = rank
        loader = torch.utils.data.DataLoader(
            train,
            batch_sampler=_batch_sampler(samplers, train, kind, consumed, rank),
            num_workers=workers,
            multiprocessing_context="fork",
        )
        batches = iter(loader)
        for _ in range((last - first + 1) * per_iteration):
            next(batches)
        del batches, loader
    found = recorder.reads()

    def counted(plan):
        return collections.Counter(
            (r, w, str(plan.files.index(f)) if layout == "repack" else f, o, s)
            for r, w, f, o, s in plan.reads()
        )

    planned = counted(plan)
    missing = planned - found
    assert not missing, f"planned, not read: {list(missing)[:3]}"
    # the workers read ahead of the iterations taken (3 workers x prefetch 2 = 3 iterations):
    # what they read is in the plan of those iterations too, read by the worker it names
    wide = counted(plan_reads(opened.tracer, first, last + 3, (0, 1), workers, layout, str(target)))
    unplanned = found - wide
    assert not unplanned, f"read, not planned: {list(unplanned)[:3]}"
    assert all(w >= 0 for _, w, *_ in found), "a read in the main process"


# --- storage, not the page cache --------------------------------------------------------------


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """A repack whose samples are large next to a page: 64 KiB (16,384 int32 tokens) a sample,
    from long documents, so that the pages a replay touches are mostly the samples' own bytes
    (a piece's first and last pages are shared with its neighbours: 8 KiB tokens a sample
    touched 151 % of their bytes here)."""
    init_process_group()
    root = tmp_path_factory.mktemp("bench-large")
    prefixes = write_sources(
        root, 6, seed=9, sequences=(20, 30), tokens=(20000, 40000), int32_every=1
    )
    blend = write_flat_blend(root / "blend.json", prefixes, weights_for(prefixes, seed=9))
    out = root / "out"
    merge(blend, out)
    return out, blend


LARGE = {
    "seq_length": 16384,
    "split": "100,0,0",
    "micro_batch_size": 1,
    "data_parallel_size": 2,
    "global_batch_size": 4,
    "train_iters": 30,
    "eval_iters": 0,
}


@pytest.mark.once
def test_a_cold_replay_reads_storage_and_a_warm_one_is_called_cached(large):
    out, _ = large
    cold = bench(out, LARGE, iterations=20, step_time=None, workers=2)[0]
    f = figures(cold)
    assert f["cache"]["resident_pages_before"] == 0
    assert f["cache"]["pages_read"] > 100
    share = f["cache"]["fetched_share"]
    assert share is not None and 0.95 <= share <= 1.30, f["cache"]
    assert f["verdict"] == "storage"
    again = bench(out, LARGE, iterations=20, step_time=None, workers=2, warm=True)[0]
    g = figures(again)
    assert g["cache"]["resident_pages_before"] == g["cache"]["pages_read"]
    assert g["verdict"] == "cached"
    assert g["achieved"] is None and g["page_cache"]["samples_per_s"] > 0  # no storage figure


@pytest.mark.once
def test_eviction_that_does_not_hold_is_reported_as_cached(large, monkeypatch):
    """With eviction undone (a file system that ignores it), the replay says cached."""
    out, _ = large
    bench(out, LARGE, iterations=5, step_time=None, workers=1, warm=True)  # cache it
    monkeypatch.setattr("repack.bench.run.evict", lambda paths: None)
    result = bench(out, LARGE, iterations=5, step_time=None, workers=1)[0]
    assert figures(result)["verdict"] == "cached"


def _cli(*args: str):
    return CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)


def _flags(values: dict) -> list[str]:
    flags = []
    for name, value in values.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


@pytest.mark.once
def test_cli_reports_both_layouts_and_merges_nodes(large, tmp_path):
    out, blend = large
    common = [*_flags(LARGE), "--iterations", "4", "--step-time", "0.5", "-q"]
    result = _cli(os.fspath(out), *common, "--prefixes", os.fspath(blend), "--json")
    assert result.exit_code == 0, result.output
    both = json.loads(result.output)
    assert [f["layout"] for f in both] == ["repack", "prefixes"]
    assert both[0]["bytes"] == both[1]["bytes"]  # the same samples
    assert both[0]["files_opened"] == len(load_manifest(out).shards) + 1  # and the index
    assert both[1]["files_opened"] == 2 * 6  # a .bin and an .idx a source
    # stock's workers map every prefix's .bin, a repack's its shards
    assert both[1]["data_mappings_per_process"] == 6
    assert both[0]["data_mappings_per_process"] == len(load_manifest(out).shards)
    # --no-mmap-bin-files, in a process of its own (this one holds the repack open, mapped):
    # the repack's shards and the prefixes' .bin are read with pread, not mapped
    found = subprocess.run(
        [
            sys.executable,
            "-m",
            "repack",
            "bench",
            os.fspath(out),
            *common,
            "--json",
            "--prefixes",
            os.fspath(blend),
            "--no-mmap-bin-files",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert found.returncode == 0, found.stderr
    pread = json.loads(found.stdout)
    assert [f["data_mappings_per_process"] for f in pread] == [0, 0]
    assert both[0]["stall"]["share"] == 0.0  # 0.5 s a step: never waits
    parts = []
    for k, ranks in enumerate(("0", "1")):
        path = tmp_path / f"node{k}.json"
        result = _cli(os.fspath(out), *common, "--ranks", ranks, "--output", os.fspath(path))
        assert result.exit_code == 0, result.output
        parts.append(os.fspath(path))
    merged = _cli("--merge-results", *parts, "--json")
    assert merged.exit_code == 0, merged.output
    f = json.loads(merged.output)
    assert f["nodes"] == 2 and f["ranks"] == 2
    assert f["samples"] == 4 * LARGE["global_batch_size"]
    text = _cli("--merge-results", *parts)
    assert "2 ranks x 2 workers on 2 nodes" in text.output


@pytest.mark.once
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ranks", "5"], "--ranks: the run has data-parallel ranks 0 to 1, not 5"),
        (["--from-iteration", "40"], "--from-iteration 40: the run has iterations 1 to 30"),
        ([], "give the run's --step-time (or --tokens-per-second), or --flat-out"),
        (["--flat-out", "--step-time", "1"], "--flat-out has no step time"),
    ],
)
def test_cli_refuses_clearly(large, extra, message):
    out, _ = large
    step = [] if extra == [] or "--flat-out" in extra else ["--flat-out"]
    result = _cli(os.fspath(out), *_flags(LARGE), "-q", *step, *extra)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


# --- stalls: a slow server, a short and a long step -------------------------------------------


@pytest.mark.once
@pytest.mark.slow
def test_a_slow_server_stalls_a_short_step_and_not_a_long_one(large, tmp_path):
    """Through a FUSE view that answers each read 50 ms late: a step of 10 ms waits for data
    in most iterations, a step of 1 s in none (after the first, the loader's start)."""
    from fuse_support import require_fuse, view

    require_fuse()
    out, _ = large
    with view(out, tmp_path / "slow", delay=0.05) as point:
        short = _cli(os.fspath(point), *_flags(LARGE), "--iterations", "6", "--step-time", "0.01")
        assert short.exit_code == 0, short.output
        assert (
            "a step of 10.0 ms spread over 2 micro-batches (5.0 ms each), 2 workers x prefetch 2"
            in short.output
        )
        assert "CACHED" not in short.output
        f = figures(bench(point, LARGE, iterations=6, step_time=0.01)[0])
        assert f["stall"]["share"] > 0.5, f["stall"]
        g = figures(bench(point, LARGE, iterations=6, step_time=1.0)[0])
        assert g["stall"]["share"] == 0.0, g["stall"]
        assert g["stall"]["of"] == 5
        # reads through the view took at least the server's delay
        assert g["read_time_per_iteration_s"]["p50"] >= 0.05


# --- object storage ---------------------------------------------------------------------------


@pytest.mark.once
@pytest.mark.parametrize("scheme", ["s3", "msc"])
def test_a_repack_on_s3_is_replayed_as_a_folder(s3, large, tmp_path, monkeypatch, scheme):
    """The same reads as the folder's (the same shards and ranges), fetched by ranged GETs,
    through boto3 or multi-storage-client."""
    out, blend = large
    monkeypatch.setenv("REPACK_CACHE_DIR", str(tmp_path / "node-cache"))
    url = f"s3://{s3.new_bucket()}/train.repack"
    if scheme == "msc":
        from s3_support import msc_profile

        monkeypatch.setenv("MSC_CONFIG", "")
        url = msc_profile(s3, tmp_path, s3.new_bucket()) + "/train.repack"
    merge(blend, url)
    on_s3 = open_run(url, LARGE)
    local = open_run(out, LARGE)
    a = plan_reads(on_s3.tracer, 3, 6, (0, 1), 2, "repack", url)
    b = plan_reads(local.tracer, 3, 6, (0, 1), 2, "repack", os.fspath(out))
    assert [r[:2] + r[3:] for r in a.reads()] == [r[:2] + r[3:] for r in b.reads()]
    f = figures(bench(url, LARGE, first=3, iterations=4, step_time=None)[0])
    assert f["cache"]["mode"] == "object storage" and f["verdict"] == "storage"
    # every byte of the samples came by GET (ranges merged, at most what the samples hold
    # plus the gaps merged between a sample's pieces)
    assert f["cache"]["store_bytes"] >= f["bytes"] > 0
    assert 0 < f["requests"] <= len(a.read_size)


# --- the step time, --seconds, --plot, merging ---------------------------------------------------


def test_tokens_per_second_is_a_step_time():
    from repack.bench.run import step_seconds

    assert step_seconds(None, 4 * 16384 / 0.5, 4, 16384) == pytest.approx(0.5)
    assert step_seconds(1.5, None, 4, 16384) == 1.5
    assert step_seconds(None, None, 4, 16384) is None
    with pytest.raises(Exception, match="not both"):
        step_seconds(1.0, 10.0, 4, 16384)


@pytest.mark.once
def test_seconds_stops_at_an_iterations_end_and_plot_draws(large, tmp_path):
    out, _ = large
    result = bench(out, LARGE, iterations=30, step_time=0.2, seconds=0.5)[0]
    f = figures(result)
    assert 2 <= f["iterations"] < 30
    assert f["samples"] == f["iterations"] * LARGE["global_batch_size"]
    picture = tmp_path / "reads.png"
    shown = _cli(
        os.fspath(out),
        *_flags(LARGE),
        "--iterations",
        "3",
        "--flat-out",
        "-q",
        "--plot",
        os.fspath(picture),
    )
    assert shown.exit_code == 0, shown.output
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.once
def test_merging_refuses_what_is_not_one_run(large, tmp_path):
    out, _ = large
    paths = []
    for name, ranks, seq in (("a", "0", None), ("b", "0", None), ("c", "1", 8192)):
        flags = _flags({**LARGE, **({"seq_length": seq} if seq else {})})
        path = tmp_path / f"{name}.json"
        result = _cli(
            os.fspath(out),
            *flags,
            "--iterations",
            "2",
            "--flat-out",
            "-q",
            "--ranks",
            ranks,
            "--output",
            os.fspath(path),
        )
        assert result.exit_code == 0, result.output
        paths.append(os.fspath(path))
    (tmp_path / "not.json").write_text("{}")
    for files, message in (
        (paths[:2], "rank 0 is in another result too"),
        ([paths[0], paths[2]], "another run than"),
        ([paths[0], os.fspath(tmp_path / "not.json")], "not a repack bench result"),
    ):
        result = _cli("--merge-results", *files)
        assert result.exit_code != 0 and message in result.output, result.output


@pytest.mark.once
def test_a_checkpoint_gives_the_runs_settings(large, tmp_path):
    """--checkpoint: the settings Megatron-LM saved, --no-mmap-bin-files among them, replay
    what the same flags typed replay."""
    from checkpoint_support import write_torch_checkpoint

    out, blend = large
    data_path = [str(x) for x in json.loads(Path(blend).read_text())]
    saved = {**LARGE, "data_path": data_path, "mmap_bin_files": False, "load": None}
    ckpt = write_torch_checkpoint(tmp_path / "ckpt", saved, iteration=6)
    ask = ["--iterations", "3", "--flat-out", "--json", "-q"]
    from_checkpoint = _cli(os.fspath(out), "--checkpoint", os.fspath(ckpt), *ask)
    assert from_checkpoint.exit_code == 0, from_checkpoint.output
    typed = _cli(os.fspath(out), *_flags(LARGE), "--no-mmap-bin-files", *ask)
    assert typed.exit_code == 0, typed.output
    a, b = json.loads(from_checkpoint.output), json.loads(typed.output)
    for key in ("samples", "bytes", "requests", "iterations", "files_opened"):
        assert a[key] == b[key], key
    assert a["backend"] == b["backend"] == "pread"  # as the checkpoint says
