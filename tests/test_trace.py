"""``repack trace`` against Megatron's real samplers, data loaders and calculators.

* The forward trace (which samples each rank's loader yields at iteration N) is compared with
  Megatron-LM's own samplers (``megatron/training/datasets/data_samplers.py``, shipped in the
  megatron-core 0.17+ wheels, or Megatron-Bridge's copies), run in a ``torch`` DataLoader as
  ``build_pretraining_data_loader`` runs them, over datasets built by stock ``GPTDataset``: every
  rank, every micro-batch, every iteration of short runs with a skipped iteration and a
  batch-size ramp, tokens identical. Those samplers exist only on Python 3.12 here: the test
  skips elsewhere, and fails where ``REPACK_TEST_SAMPLERS`` is set (CI sets it for its
  megatron-core 0.19 run).
* The batch-size schedule is compared with megatron-core's calculator classes (every release).
* The reverse query (``--document``, ``--source``) equals a brute-force scan over every sample
  of generated runs, documents read one sample at a time from the datasets' arrays.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
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

from repack.cli import main
from repack.megatron import MEGATRON_VERSION
from repack.merge import merge
from repack.trace.batches import Schedule, locate
from repack.trace.draws import DrawSettings, build_draws
from repack.trace.query import Tracer
from repack.trace.run import trace
from repack.trace.settings import TraceSettings, UnsupportedRun, release_of

pytestmark = pytest.mark.megatron

RELEASE = release_of(MEGATRON_VERSION)
SEQ = 16


SAMPLERS = megatron_samplers()


def _need_samplers():
    megatron_samplers(required=True)


# --- runs -----------------------------------------------------------------------------------


def _write_blend(root: Path, per_split: bool) -> Path:
    prefixes = write_sources(root, 5, sequences=(24, 40), tokens=(3, 60))
    weights = weights_for(prefixes, seed=3)
    if not per_split:
        return write_flat_blend(root / "blend.json", prefixes, weights)
    blend = {
        "train": [x for w, p in zip(weights[:4], prefixes[:4]) for x in (w, p)],
        "valid": [1.0, prefixes[2], 2.0, prefixes[4]],
        "test": [prefixes[0]],
    }
    path = root / "blend_per_split.json"
    path.write_text(json.dumps(blend))
    return path


def _stock(blend: Path, settings: TraceSettings):
    """The run's datasets, built by stock GPTDataset as the run builds them."""
    data = json.loads(blend.read_text())
    if isinstance(data, dict):
        per = [
            None
            if data[s] is None
            else (data[s][1::2], data[s][0::2])
            if not isinstance(data[s][0], str)
            else (data[s], None)
            for s in ("train", "valid", "test")
        ]
        config = gpt_config(blend_per_split=per, sequence_length=SEQ, seed=settings.seed)
    else:
        config = gpt_config(
            data[1::2], data[0::2], sequence_length=SEQ, split=settings.split, seed=settings.seed
        )
    return BlendedMegatronDatasetBuilder(
        GPTDataset, list(settings.sizes), lambda: True, config
    ).build()


def _calculator(values: dict):
    """megatron-core's own num-microbatches calculator for the run."""
    from megatron.core import num_microbatches_calculator as calc

    mbs, dp = values["micro_batch_size"], values["data_parallel_size"]
    if values.get("step_batch_size_schedule"):
        return calc.StepBatchsizeNumMicroBatchesCalculator(
            mbs, dp, False, 0, values["step_batch_size_schedule"], SEQ
        )
    if values.get("rampup_batch_size"):
        start, increment, samples = values["rampup_batch_size"]
        return calc.RampupBatchsizeNumMicroBatchesCalculator(
            values["global_batch_size"], mbs, dp, False, 0, start, increment, samples
        )
    return calc.ConstantNumMicroBatchesCalculator(values["global_batch_size"], mbs, dp, False, 0)


def _schedule_values(unit: int) -> dict:
    """A batch-size ramp the installed release applies: --step-batch-size-schedule (0.18 and
    later, thresholds in tokens) or --rampup-batch-size (before)."""
    if RELEASE >= (0, 18):
        return {
            "step_batch_size_schedule": f"0:{unit} {3 * unit * SEQ}:{2 * unit} "
            f"{8 * unit * SEQ}:{3 * unit}",
            "train_samples": 18 * unit,  # the last iteration ends there: 3 x 1, 3 x 2, 3 x 3
        }
    return {
        "rampup_batch_size": (unit, unit, 6 * unit),
        "global_batch_size": 3 * unit,
        "train_samples": 20 * unit,
    }


def _cyclic(loader):
    """Megatron-LM's ``cyclic_iter``."""
    while True:
        yield from loader


def _loaders(samplers, dataset, kind: str, mbs: int, dp: int, sharding: bool):
    """Per rank: an iterator of (indices, batch) from Megatron's sampler and a DataLoader over
    another instance of it, as ``build_pretraining_data_loader`` builds it."""

    def sampler(rank):
        if kind == "single":
            return samplers.MegatronPretrainingSampler(len(dataset), 0, mbs, rank, dp)
        return samplers.MegatronPretrainingRandomSampler(
            dataset, len(dataset), 0, mbs, rank, dp, sharding
        )

    out = []
    for rank in range(dp):
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler(rank), num_workers=0)
        indices = sampler(rank)
        if kind == "single":
            out.append(zip(iter(indices), iter(loader)))
        else:
            out.append(zip(_cyclic(indices), _cyclic(loader)))
    return out


def _check_batch(records: list[dict], indices: list[int], batch: dict, where: str) -> None:
    records = sorted(records, key=lambda r: r["row"])
    assert [r["index"] for r in records] == indices, where
    for row, record in enumerate(records):
        full = np.append(batch["tokens"][row].numpy(), batch["labels"][row].numpy()[-1])
        assert record["tokens"] == full.tolist(), f"{where} row {row}: tokens differ"


def _cases():
    """Data-parallel sizes x micro-batch sizes (every pair), with the loader type, the blend's
    form and the target (blend or repack) varied so that every pair of values of any two
    factors is covered."""
    cases = []
    for i, (dp, mbs) in enumerate(itertools.product((1, 2, 4, 8), (1, 2, 3, 4))):
        kind = ("single", "cyclic")[(i % 2) ^ ((i // 4) % 2)]
        per_split = bool(((i // 2) % 2) ^ (i // 8))
        target = ("blend", "repack")[(i % 2) ^ ((i // 2) % 2) ^ ((i // 4) % 2)]
        cases.append((dp, mbs, kind, per_split, target))
    columns = list(zip(*cases))
    for a, b in itertools.combinations(range(5), 2):
        pairs = set(zip(columns[a], columns[b]))
        assert len(pairs) == len(set(columns[a])) * len(set(columns[b])), (a, b)
    return cases


@pytest.fixture(scope="module")
def blends(tmp_path_factory):
    init_process_group()
    root = tmp_path_factory.mktemp("trace")
    out = {}
    for per_split in (False, True):
        folder = root / ("per-split" if per_split else "flat")
        blend = _write_blend(folder, per_split)
        repack = folder / "out"
        merge(blend, repack)
        out[per_split] = (blend, repack)
    return out


#: --no-data-sharding, where Megatron's cyclic sampler keeps its ranks in step (micro-batch
#: size = data-parallel size: every epoch's leftover fits), on both targets and blend forms
UNSHARDED = [(2, 2, "cyclic", False, "repack"), (4, 4, "cyclic", True, "blend")]


@pytest.mark.parametrize(
    ("dp", "mbs", "kind", "per_split", "target", "sharding"),
    [(*case, True) for case in _cases()] + [(*case, False) for case in UNSHARDED],
)
def test_forward_trace_is_what_each_rank_loads(blends, dp, mbs, kind, per_split, target, sharding):
    """For every rank, micro-batch and iteration of a run with a skipped iteration and a
    batch-size ramp, trace names the samples Megatron's sampler gives that rank's loader, and
    their tokens; and the evaluations' samples likewise (with --data-sharding, Megatron-LM's
    default, and without)."""
    _need_samplers()
    blend, repack = blends[per_split]
    unit = mbs * dp
    skip = 2  # the iteration Megatron-LM logs as 2
    values = {
        "seq_length": SEQ,
        "split": "90,5,5",
        "micro_batch_size": mbs,
        "data_parallel_size": dp,
        "dataloader_type": kind,
        "eval_interval": 3,
        "eval_iters": 1,
        "iterations_to_skip": (skip - 1,) if RELEASE < (0, 17) else (skip,),
        "data_sharding": sharding,
        **_schedule_values(unit),
    }
    settings = TraceSettings.from_values(values, RELEASE)
    answer = trace(
        repack if target == "repack" else blend,
        values,
        iterations=(1, settings.train_iters),
        tokens=True,
    )
    assert skip in answer.skipped
    train, valid, _ = _stock(blend, settings)
    loaders = _loaders(SAMPLERS, train, kind, mbs, dp, sharding)
    by_step: dict[tuple, list[dict]] = {}
    for record in answer.train:
        by_step.setdefault((record["iteration"], record["microbatch"], record["rank"]), [])
        by_step[(record["iteration"], record["microbatch"], record["rank"])].append(record)
    calculator = _calculator(settings.values)
    consumed, ramp = 0, set()
    for iteration in range(1, settings.train_iters + 1):
        calculator.update(consumed, True)
        micro = calculator.get()
        ramp.add(micro)
        for m in range(micro):
            for rank in range(dp):
                indices, batch = next(loaders[rank])
                where = f"iteration {iteration} micro-batch {m} rank {rank}"
                _check_batch(by_step.pop((iteration, m, rank)), indices, batch, where)
        consumed += unit * micro
    assert not by_step, f"trace named more micro-batches: {sorted(by_step)[:3]}"
    assert len(ramp) > 1  # the run went through a ramp
    # the evaluations: eval_iters batches of the eval global batch, where the last stopped
    emb, egbs = settings.eval_micro_batch_size, settings.eval_global_batch_size
    loaders = _loaders(SAMPLERS, valid, kind, emb, dp, sharding)
    by_step = {}
    for record in answer.validation:
        by_step.setdefault((record["evaluation"], record["microbatch"], record["rank"]), [])
        by_step[(record["evaluation"], record["microbatch"], record["rank"])].append(record)
    points = settings.eval_points()
    assert points[-1] == settings.train_iters and len(points) > 1
    for evaluation, point in enumerate(points):
        for m in range(settings.eval_iters * egbs // (emb * dp)):
            for rank in range(dp):
                indices, batch = next(loaders[rank])
                records = by_step.pop((evaluation, m, rank))
                assert {r["iteration"] for r in records} == {point}
                _check_batch(records, indices, batch, f"evaluation {evaluation} rank {rank}")
    assert not by_step


# --- the batch-size schedule ------------------------------------------------------------------


def _schedules():
    yield {"micro_batch_size": 2, "data_parallel_size": 3, "global_batch_size": 12}
    if RELEASE < (0, 18):
        yield {
            "micro_batch_size": 1,
            "data_parallel_size": 2,
            "global_batch_size": 64,
            "rampup_batch_size": (8, 8, 1000),
        }
        yield {  # samples per increment not a whole number
            "micro_batch_size": 2,
            "data_parallel_size": 2,
            "global_batch_size": 96,
            "rampup_batch_size": (16, 4, 777),
        }
    else:
        yield {
            "micro_batch_size": 1,
            "data_parallel_size": 4,
            "step_batch_size_schedule": "0:8 1K:16 2.5K:32 40K:64",
        }


@pytest.mark.parametrize("values", list(_schedules()))
def test_schedule_is_megatrons_calculator(values):
    """Every iteration's batch and the samples consumed before it, as Megatron-LM's training
    loop gets them from megatron-core's calculator class."""
    calculator = _calculator(values)
    steps = values.get("step_batch_size_schedule")
    if steps is not None:
        from repack.trace.batches import parse_step_schedule

        steps = tuple(parse_step_schedule(steps, SEQ))
    schedule = Schedule(
        values["micro_batch_size"],
        values["data_parallel_size"],
        values.get("global_batch_size")
        or values["micro_batch_size"] * values["data_parallel_size"],
        values.get("rampup_batch_size"),
        steps,
    )
    iterations = 300
    segments = schedule.segments(iterations)
    consumed, expected = 0, []
    for _ in range(iterations):
        calculator.update(consumed, True)
        batch = calculator.get() * schedule.micro_times_dp
        expected.append((consumed, batch))
        consumed += batch
    found = locate(segments, np.arange(1, iterations + 1))
    assert list(zip(found[0].tolist(), found[1].tolist())) == expected
    assert len({b for _, b in expected}) > 1 or "rampup_batch_size" not in values


def _megatron_update_train_iters():
    """Megatron-LM's own ``update_train_iters``, from the release's ``megatron/training/
    training.py`` (shipped with megatron-core 0.17 and later), taken out of the module whose
    import needs the whole training stack: its source, run with megatron-core's calculator
    functions bound to a calculator of the test's. None where the release does not ship it."""
    spec = importlib.util.find_spec("megatron")
    for folder in spec.submodule_search_locations if spec else []:
        path = Path(folder) / "training" / "training.py"
        if path.is_file():
            break
    else:
        return None
    source = path.read_text()
    tree = ast.parse(source)
    [function] = [n for n in tree.body if getattr(n, "name", None) == "update_train_iters"]
    code = ast.get_source_segment(source, function)

    def run(args, calculator) -> None:
        namespace = {
            "update_num_microbatches": lambda consumed, consistency_check=True: calculator.update(
                consumed, consistency_check
            ),
            "get_current_global_batch_size": calculator.get_current_global_batch_size,
            "print_rank_0": lambda *a, **k: None,
        }
        exec(code, namespace)
        namespace["update_train_iters"](args)

    return run


def test_train_iters_from_train_samples_is_megatrons():
    """``update_train_iters`` from --train-samples: Megatron-LM's own function of the release
    where it ships (0.17 and later), with megatron-core's calculator; before, the loop of that
    release's training.py, transcribed (those wheels do not ship megatron/training)."""
    update = _megatron_update_train_iters()
    if update is None and os.environ.get("REPACK_TEST_SAMPLERS"):
        pytest.fail("REPACK_TEST_SAMPLERS is set but megatron/training/training.py is absent")
    for values in _schedules():
        calculator = _calculator(values)
        schedule = TraceSettings.from_values(
            {"seq_length": SEQ, "train_samples": 5000, **values}, RELEASE
        )
        gbs = values.get("global_batch_size")
        if update is not None:
            args = argparse.Namespace(
                train_iters=None,
                train_samples=5000,
                global_batch_size=gbs,
                rampup_batch_size=values.get("rampup_batch_size"),
                step_batch_size_schedule=values.get("step_batch_size_schedule"),
            )
            update(args, calculator)
            iterations = args.train_iters
        elif values.get("rampup_batch_size"):  # training.py of 0.12-0.16, transcribed
            iterations, consumed = 0, 0
            while consumed <= values["rampup_batch_size"][2] and consumed <= 5000:
                calculator.update(consumed, False)
                consumed += calculator.get_current_global_batch_size()
                iterations += 1
            iterations += (5000 - consumed) // gbs if 5000 > consumed else 0
        else:
            iterations = 5000 // gbs
        assert schedule.train_iters == iterations, values


# --- the reverse query against a brute-force scan -----------------------------------------------


def _documents(dataset, sample: int) -> list[tuple[int, int, int]]:
    """The documents of ``dataset[sample]`` and their token ranges, one sample at a time as
    ``GPTDataset._query_document_sample_shuffle_indices`` reads them (checked against it)."""
    extra = int(dataset.config.add_extra_token_to_sequence)
    shuffled = int(dataset.shuffle_index[sample])
    beg, beg_offset = (int(x) for x in dataset.sample_index[shuffled])
    end, end_offset = (int(x) for x in dataset.sample_index[shuffled + 1])
    lengths = dataset.dataset.sequence_lengths
    found = []
    for i in range(beg, end + 1):
        document = int(dataset.document_index[i])
        start = beg_offset if i == beg else 0
        stop = end_offset + extra if i == end else int(lengths[document])
        found.append((document, start, stop))
    text, ids = dataset._query_document_sample_shuffle_indices(sample)[:2]
    assert [d for d, _, _ in found] == [int(x) for x in ids]
    tokens = [dataset.dataset.get(d, offset=s, length=e - s) for d, s, e in found]
    assert np.array_equal(np.concatenate(tokens), text)
    return found


def _brute_force(tracer: Tracer, source: str, document: int | None):
    """Every read of (source, document), or of any sample of source, by scanning every sample
    of every iteration and evaluation one at a time."""
    found = {"train": set(), "valid": set()}
    runs = [("train", tracer.train_rows(np.arange(1, tracer.settings.train_iters + 1)))]
    if tracer.valid_sampler is not None:
        runs.append(("valid", tracer._valid_rows(np.arange(len(tracer.points)))))
    for name, rows in runs:
        split = tracer.draws.split(name)
        for n in range(len(rows.index)):
            (position,), (sample,) = split.locate(rows.index[n : n + 1])
            draws = split.datasets[int(position)]
            if draws.source != source:
                continue
            key = tuple(
                int(getattr(rows, k)[n])
                for k in ("iteration", "rank", "microbatch", "row", "index")
            )
            if rows.evaluation is not None:
                key += (int(rows.evaluation[n]),)
            if document is None:
                found[name].add(key)
                continue
            for doc, start, end in _documents(draws.dataset, int(sample)):
                if doc == document and end > start:
                    found[name].add((*key, start, end))
    return found


def _as_set(records: list[dict], document: bool, evaluation: bool) -> set:
    keys = ["iteration", "rank", "microbatch", "row", "index"]
    keys += ["evaluation"] * evaluation + ["start", "end"] * document
    return {tuple(r[k] for k in keys) for r in records}


REVERSE_RUNS = {
    "single": {"micro_batch_size": 2, "data_parallel_size": 2, "global_batch_size": 8},
    "cyclic": {
        "micro_batch_size": 1,
        "data_parallel_size": 4,
        "global_batch_size": 12,
        "dataloader_type": "cyclic",
    },
    "cyclic-unsharded": {
        "micro_batch_size": 3,
        "data_parallel_size": 2,
        "global_batch_size": 12,
        "dataloader_type": "cyclic",
        "data_sharding": False,
    },
    "lone-source": {"micro_batch_size": 1, "data_parallel_size": 2, "global_batch_size": 6},
}


@pytest.fixture(scope="module")
def reverse_blends(tmp_path_factory):
    init_process_group()
    root = tmp_path_factory.mktemp("reverse")
    prefixes = write_sources(root, 4, sequences=(24, 40), tokens=(3, 60))
    flat = write_flat_blend(root / "blend.json", prefixes, weights_for(prefixes, seed=5))
    lone = root / "lone.json"  # one prefix, no weight: Megatron uses its GPTDataset alone
    lone.write_text(json.dumps([prefixes[1]]))
    per_split = _write_blend(root / "per-split", True)
    return {"flat": flat, "lone": lone, "per-split": per_split}


@pytest.mark.once
@pytest.mark.parametrize("run", [*REVERSE_RUNS, "per-split-repack"])
def test_reverse_query_is_a_brute_force_scan(reverse_blends, tmp_path, run):
    """--document and --source find exactly the reads a scan over every sample finds, in
    training and in the evaluations, repeats in later epochs included."""
    values = {
        "seq_length": SEQ,
        "split": "80,15,5",
        "seed": 7,
        "train_iters": 30,
        "eval_interval": 7,
        "eval_iters": 2,
        **REVERSE_RUNS.get(run, {"micro_batch_size": 2, "data_parallel_size": 2}),
    }
    target = reverse_blends["lone" if run == "lone-source" else "flat"]
    if run == "per-split-repack":
        target = tmp_path / "out"
        merge(reverse_blends["per-split"], target)
        values.update(_schedule_values(4))
        values.pop("train_iters")
    settings = TraceSettings.from_values(values, RELEASE)
    v = settings.values
    draws = build_draws(
        target,
        DrawSettings(SEQ, seed=7, split=v["split"], sizes=settings.sizes),
    )
    tracer = Tracer(draws, settings)
    train = draws.split("train")
    # documents: some read early, some late, one of a validation sample, one never read
    picks = []
    for iteration in (1, settings.train_iters // 2, settings.train_iters):
        first = tracer.iterations(iteration, iteration).train[-1]
        picks.append((first["source"], first["documents"][-1]["document"]))
    if tracer.valid_sampler is not None:
        record = tracer.iterations(tracer.points[0], tracer.points[0]).validation[0]
        picks.append((record["source"], record["documents"][0]["document"]))
    lengths = train.datasets[0].dataset.dataset.sequence_lengths
    picks.append((train.datasets[0].source, len(lengths) - 1))  # the last: a test sequence
    repeats = 0
    for source, document in picks:
        expected = _brute_force(tracer, source, document)
        answer = tracer.document(source, document)
        assert _as_set(answer.train, True, False) == expected["train"], (source, document)
        assert _as_set(answer.validation, True, True) == expected["valid"], (source, document)
        assert len(answer.train) == len(expected["train"])  # no read twice
        repeats = max(repeats, len({r["index"] for r in answer.train}))
    assert repeats > 1 or run == "per-split-repack"  # a document read by several samples
    for source in {s for s, _ in picks}:
        expected = _brute_force(tracer, source, None)
        answer = tracer.source(source)
        assert _as_set(answer.train, False, False) == expected["train"]
        assert _as_set(answer.validation, False, True) == expected["valid"]


# --- the command line -------------------------------------------------------------------------

FLAGS = [
    "--seq-length",
    str(SEQ),
    "--split",
    "80,15,5",
    "--train-iters",
    "12",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--data-parallel-size",
    "2",
    "--eval-interval",
    "4",
    "--eval-iters",
    "1",
]


def _run(*args: str):
    return CliRunner().invoke(main, ["trace", *args], catch_exceptions=False)


@pytest.mark.once
def test_cli_json_is_the_issues_schema(reverse_blends):
    blend = str(reverse_blends["flat"])
    result = _run(blend, "--iteration", "4", "--tokens", "--json", *FLAGS)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert "repack: built" in result.stderr  # progress on stderr
    assert len(data["samples"]) == 8
    keys = {"iteration", "rank", "microbatch", "row", "index", "source", "sample", "documents"}
    for record in data["samples"]:
        assert set(record) == keys | {"tokens"}
        assert len(record["tokens"]) == SEQ + 1
        assert all(set(d) == {"document", "start", "end"} for d in record["documents"])
    assert {r["iteration"] for r in data["validation"]} == {4}  # an evaluation after it
    assert all(set(r) == keys | {"tokens", "evaluation"} for r in data["validation"])
    source, document = data["samples"][3]["source"], data["samples"][3]["documents"][0]
    result = _run(blend, "--document", f"{source}:{document['document']}", "--json", *FLAGS)
    assert result.exit_code == 0, result.output
    occurrences = json.loads(result.stdout)["occurrences"]
    place = {k: data["samples"][3][k] for k in ("iteration", "rank", "microbatch", "row", "index")}
    assert {**place, "start": document["start"], "end": document["end"]} in occurrences
    assert all(
        set(r) == {"iteration", "rank", "microbatch", "row", "index", "start", "end"}
        for r in occurrences
    )
    table = _run(blend, "--iterations", "3:4", *FLAGS)
    assert table.exit_code == 0 and "training: 16 samples" in table.stdout


@pytest.mark.once
def test_a_trace_leaves_no_temporary_folder(reverse_blends, tmp_path):
    # with a cache folder, trace starts a one-process gloo group (BlendedDataset asks the rank
    # when it caches), whose rendezvous file is gone when trace exits
    temp = tmp_path / "tmp"
    temp.mkdir()
    cache = ["--data-cache-path", str(tmp_path / "cache")]
    args = [str(reverse_blends["flat"]), "--iteration", "2", "--json", *FLAGS, *cache]
    done = subprocess.run(
        [sys.executable, "-m", "repack", "trace", *args],
        env={**os.environ, "TMPDIR": str(temp)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["samples"]
    assert (tmp_path / "cache").is_dir()  # premise: a cache, so a group
    assert sorted(p.name for p in temp.iterdir()) == []


@pytest.mark.once
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dataloader-type", "external"], "external"),
        (["--iteration", "13"], "iterations 13:13: the run has iterations 1 to 12"),
        (["--source", "no/such/prefix"], "no source 'no/such/prefix'"),
        (["--global-batch-size", "6"], "not divisible by micro batch size 2"),
        (
            ["--step-batch-size-schedule", "0:8", "--megatron-release", "0.16"],
            "from Megatron-LM 0.18",
        ),
    ],
)
def test_cli_refuses_clearly(reverse_blends, extra, message):
    args = [str(reverse_blends["flat"]), *FLAGS, *extra]
    if not any(a.startswith("--iteration") or a == "--source" for a in extra):
        args += ["--iteration", "1"]
    result = _run(*args)
    assert result.exit_code == 3, result.output
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert result.stderr.splitlines()[-1] == errors[0]  # after progress lines, if any


@pytest.mark.once
@pytest.mark.parametrize(
    "name",
    [
        "hybrid_context_parallel",
        "sft",
        "full_validation",
        "skip_train",
        "phase_transition_iterations",
    ],
)
def test_settings_refuse_what_trace_cannot_reproduce(name):
    with pytest.raises(UnsupportedRun, match="cannot name this run's samples exactly"):
        TraceSettings.from_values(
            {"seq_length": SEQ, "micro_batch_size": 1, "train_iters": 4, name: True}, RELEASE
        )


@pytest.mark.once
def test_uneven_cyclic_without_sharding_is_refused(reverse_blends):
    """Megatron's cyclic sampler without data sharding gives ranks different numbers of
    micro-batches per epoch when total // mbs * mbs - active > (mbs - 1) * dp: refused."""
    values = {
        "seq_length": SEQ,
        "split": "80,15,5",
        "train_samples": 10,
        "global_batch_size": 4,
        "micro_batch_size": 1,
        "data_parallel_size": 4,
        "dataloader_type": "cyclic",
        "data_sharding": False,
        "eval_iters": 0,
    }
    with pytest.raises(UnsupportedRun, match="out of step"):
        trace(reverse_blends["flat"], values, iterations=(1, 1))
    if SAMPLERS is not None:  # Megatron's own sampler: ranks 0, 1 get 3 batches, 2, 3 get 2
        counts = [
            len(list(SAMPLERS.MegatronPretrainingRandomSampler(None, 10, 0, 1, r, 4, False)))
            for r in range(4)
        ]
        assert counts == [3, 3, 2, 2]


@pytest.mark.once
@pytest.mark.slow  # transformers' import and a 200,001-word vocabulary: about 13 s
def test_tokenizer(reverse_blends, tmp_path):
    """--tokenizer DIR decodes with a local Hugging Face tokenizer, or says transformers is
    missing."""
    args = [str(reverse_blends["flat"]), "--iteration", "1", "--json", *FLAGS]
    try:
        import transformers
    except ImportError:
        result = _run(*args, "--tokenizer", str(tmp_path))
        assert result.exit_code == 3
        assert "needs the transformers package" in result.stderr
        return
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(200_001)}
    model = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "tokenizer"
    transformers.PreTrainedTokenizerFast(tokenizer_object=model).save_pretrained(folder)
    result = _run(*args, "--tokenizer", str(folder), "--tokens")
    assert result.exit_code == 0, result.output
    for record in json.loads(result.stdout)["samples"]:
        assert record["text"] == " ".join(f"t{i}" for i in record["tokens"])


@pytest.mark.once
def test_a_slice_without_tokens_is_refused_not_hung(tmp_path):
    """A source whose valid slice is empty while valid samples are asked: stock Megatron loops
    forever in GPTDataset._get_num_epochs; trace, building stock, says so instead."""
    from repack.synth import write_prefix

    prefix = str(tmp_path / "one")
    write_prefix(prefix, [np.arange(1, 300, dtype=np.uint16)])  # one sequence: all in train
    blend = write_flat_blend(tmp_path / "blend.json", [prefix])
    result = _run(str(blend), *FLAGS, "--iteration", "1")
    assert result.exit_code == 3, result.output
    assert "its valid slice holds no tokens" in result.stderr
    assert "loops forever" in result.stderr.splitlines()[-1]


_CACHE_RUN = {
    "seq_length": SEQ,
    "split": "80,15,5",
    "train_iters": 12,
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "data_parallel_size": 2,
    "eval_interval": 4,
    "eval_iters": 1,
}


@pytest.mark.once
def test_the_runs_megatron_cache_is_used(reverse_blends, tmp_path):
    """With --data-cache-path naming the run's cache folder, trace builds with the tokenizer
    identifiers recorded there, so Megatron finds every cached index (GPTDataset's and
    BlendedDataset's) and writes nothing new; the answer is the one built from scratch."""
    cache = tmp_path / "cache"
    values = dict(_CACHE_RUN)
    settings = TraceSettings.from_values(values, RELEASE)
    blend = reverse_blends["flat"]
    data = json.loads(blend.read_text())
    config = gpt_config(data[1::2], data[0::2], sequence_length=SEQ, split="80,15,5", cache=cache)
    BlendedMegatronDatasetBuilder(GPTDataset, list(settings.sizes), lambda: True, config).build()
    written = sorted(os.listdir(cache))
    assert any("BlendedDataset" in name for name in written)
    cached = trace(blend, {**values, "data_cache_path": str(cache)}, iterations=(5, 6))
    assert sorted(os.listdir(cache)) == written  # all found, none built
    fresh = trace(blend, values, iterations=(5, 6))
    assert cached.to_json()["samples"] == fresh.to_json()["samples"]


@pytest.mark.once
def test_a_blend_stock_cannot_open_is_refused_clearly(reverse_blends):
    """Stock Megatron opens files per prefix and split: past the descriptor limit trace says
    so in one line, and points at a repack (no __del__ noise from Megatron's half-built
    datasets)."""
    import resource

    trace(reverse_blends["flat"], {**_CACHE_RUN}, iterations=(1, 1))  # imports done
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # room for exactly 12 more descriptors: the limit bounds their numbers, and a new one takes
    # the lowest free number, so the limit goes past the 12th free number (earlier tests' closed
    # descriptors leave holes below the highest one open; counting them let more through)
    taken = {int(fd) for fd in os.listdir("/proc/self/fd")}
    free = [n for n in range(max(taken) + 13) if n not in taken][:12]
    resource.setrlimit(resource.RLIMIT_NOFILE, (free[-1] + 1, hard))
    try:
        result = _run(str(reverse_blends["flat"]), *FLAGS, "--iteration", "1")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert result.exit_code == 3, result.output
    assert "stock Megatron cannot open this blend's 4 prefixes" in result.stderr
    assert "Exception ignored" not in result.stderr


@pytest.mark.once
def test_progress_names_the_installed_release_and_warns_on_another(reverse_blends):
    """The datasets are built by the installed megatron-core, whatever --megatron-release
    says: the progress line names it, and a different --megatron-release is warned about (on
    stderr, and in the answer's notes)."""
    from repack.trace.run import installed_release

    installed = installed_release()
    blend = str(reverse_blends["flat"])
    same = _run(blend, "--iteration", "1", *FLAGS)
    assert same.exit_code == 0, same.output
    assert f"building the run's datasets with the installed megatron-core {installed}:" in (
        same.stderr
    )
    assert "warning:" not in same.stderr
    other = "0.15" if RELEASE != (0, 15) else "0.14"
    result = _run(blend, "--iteration", "1", "--json", "--megatron-release", other, *FLAGS)
    assert result.exit_code == 0, result.output
    warning = (
        f"--megatron-release {other} is not the installed megatron-core {installed}: the run's "
        f"iterations, batch schedule and samplers follow {other}, but its datasets are built by "
        "the installed release's code"
    )
    assert f"warning: {warning}" in result.stderr
    assert f"building the run's datasets with the installed megatron-core {installed}:" in (
        result.stderr
    )
    assert any(note.startswith(warning) for note in json.loads(result.stdout)["notes"])


# --- the order of aarch64 nodes (--fma) ------------------------------------------------------

#: Hand-written weights, two decimals and several equal: the two roundings part early.
HAND_WRITTEN = [0.3, 0.3, 0.4, 0.15, 0.35, 0.5]
FMA_FLAGS = ["--seq-length", str(SEQ), "--split", "90,5,5", "--train-iters", "60",
             "--global-batch-size", "16", "--micro-batch-size", "4", "--data-parallel-size", "2",
             "--eval-interval", "1000", "--eval-iters", "0", "--seed", "7"]  # fmt: skip


@pytest.fixture(scope="module")
def hand_written(tmp_path_factory):
    """A blend of hand-written weights, and its train split's dataset index as megatron-core
    builds it with its own (x86-64) helper and with the fused one (an aarch64 node's)."""
    from fused_helper import fused_helper
    from megatron.core.datasets import helpers as megatron_helpers

    init_process_group()
    root = tmp_path_factory.mktemp("hand-written")
    prefixes = write_sources(root, len(HAND_WRITTEN), sequences=(60, 90), tokens=(3, 60))
    blend = write_flat_blend(root / "blend.json", prefixes, HAND_WRITTEN)
    config = gpt_config(prefixes, HAND_WRITTEN, sequence_length=SEQ, split="90,5,5", seed=7)
    sizes = [960, 0, 0]
    orders = {}
    with pytest.MonkeyPatch.context() as patch:
        for fma in (False, True):
            if fma:
                patch.setattr(megatron_helpers, "build_blending_indices",
                              fused_helper().build_blending_indices)  # fmt: skip
            built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
            orders[fma] = np.asarray(built[0].dataset_index).copy()
    assert (orders[False] != orders[True]).any()  # the premise: the blend tells them apart
    return blend, prefixes, orders


def test_fma_traces_the_order_of_aarch64_nodes(hand_written):
    """trace's datasets with fma=True are megatron-core's built with the fused helper (an
    aarch64 node's), with fma=False its own helper's (this x86-64 machine's)."""
    blend, _, orders = hand_written
    for fma in (False, True):
        draws = build_draws(blend, DrawSettings(SEQ, seed=7, split="90,5,5", sizes=(960, 0, 0),
                                                fma=fma))  # fmt: skip
        found = np.asarray(draws.split("train").top.dataset_index)
        assert np.array_equal(found, orders[fma]), fma


@pytest.mark.once
def test_cli_fma_says_the_rounding_and_warns_on_the_other(hand_written, tmp_path):
    blend, prefixes, orders = hand_written
    first = int(np.flatnonzero(orders[False] != orders[True])[0])
    last = first // 16 + 1  # the iteration of the first sample where the orders part
    asked = ["--iterations", f"1:{last}", "--json", *FMA_FLAGS]
    found = {}
    for flag, fma in (("--fma", True), ("--no-fma", False)):
        result = _run(str(blend), *asked, flag)
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        described = "one rounding (aarch64 builds)" if fma else "two roundings (x86-64 builds)"
        assert data["blending_arithmetic"] == {"fma": fma, "description": described}
        for record in data["samples"]:
            assert record["source"] == prefixes[orders[fma][record["index"]]], record
        found[fma] = [r["source"] for r in data["samples"]]
        warning = [n for n in data["notes"] if n.startswith("blending arithmetic")]
        if fma:  # this machine's megatron-core rounds twice
            assert warning == [
                "blending arithmetic one rounding (aarch64 builds) differs from this machine's "
                "megatron-core (two roundings (x86-64 builds)): the order shown is the other "
                "machine's (built without a cache folder, whose blending index would hold one "
                "machine's order)"
            ]
            assert f"repack: warning: {warning[0]}\n" in result.stderr
        else:
            assert not warning and "warning" not in result.stderr
        table = _run(str(blend), "--iteration", "1", *FMA_FLAGS, flag)
        assert table.stdout.splitlines()[0] == f"blending arithmetic: {described}"
    assert found[True] != found[False]
    default = json.loads(_run(str(blend), *asked).stdout)
    assert default["blending_arithmetic"]["fma"] is False  # this machine's helper's


@pytest.mark.once
def test_another_rounding_reads_and_writes_no_cache(hand_written, tmp_path):
    """A cached blending index holds one machine's order: --fma here builds without the cache
    folder (nothing read, nothing written); the machine's own rounding uses it."""
    blend, prefixes, orders = hand_written
    cache = tmp_path / "cache"
    args = [str(blend), "--json", *FMA_FLAGS, "--data-cache-path", str(cache)]
    assert _run(*args, "--iteration", "1", "--fma").exit_code == 0
    assert not cache.exists() or not list(cache.iterdir())
    assert _run(*args, "--iteration", "1", "--no-fma").exit_code == 0
    [index] = [p for p in cache.iterdir() if p.name.endswith("-train-dataset_index.npy")]
    assert np.array_equal(np.load(index), orders[False])  # this machine's rounding caches
    result = _run(*args, "--iterations", "1:60", "--fma")  # not the cached x86-64 order
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)["samples"]
    assert len(records) == 960
    assert all(r["source"] == prefixes[orders[True][r["index"]]] for r in records)


@pytest.mark.once
def test_fma_without_the_compiled_index_is_one_error(hand_written, monkeypatch):
    """Without repack.model._blending, fast_blending leaves the index to Megatron's helper,
    which rounds twice here: --fma is refused, in one line, rather than traced wrong."""
    from repack.model import blending

    monkeypatch.setattr(blending, "_compiled_blend", None)
    monkeypatch.setattr(blending, "COMPILED", False)
    blend, _, _ = hand_written
    result = CliRunner().invoke(main, ["trace", str(blend), "--iteration", "1", *FMA_FLAGS,
                                       "--fma"])  # fmt: skip
    assert result.exit_code == 3, result.output
    assert result.stderr.splitlines()[-1].startswith(
        "Error: blending arithmetic one rounding (aarch64 builds) (--fma) needs "
        "repack.model._blending"
    )
    assert "Traceback" not in result.output
    assert _run(str(blend), "--iteration", "1", *FMA_FLAGS, "--no-fma").exit_code == 0
