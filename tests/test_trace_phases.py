"""``repack trace --phases FILE``: a run in blend phases, against Megatron-LM's real code.

* Exactness: tests/phases_child.py runs each phase's launch through Megatron-LM's own
  ``parse_args`` / ``validate_args`` (``--phase-transition-iterations``), its
  ``get_train_valid_test_num_samples`` and ``build_train_valid_test_data_loaders`` (shipped in
  the megatron-core 0.17+ wheels), and the train loop's reads, rank by rank; every rank's
  indices and tokens of every iteration and evaluation must be what ``repack trace --phases
  ... --iterations 1:N --tokens --json`` says. A 2-phase run (2 ranks, flat blends, stock
  ``GPTDataset``) and a 3-phase one (1 rank, per-split blends, a repack, a phase with its own
  seed, the cyclic loader), evaluations at a transition included; and the checkpoints
  Megatron-LM's ``save_checkpoint`` writes at each exit, read back by ``--checkpoint``.
  Skipped where Megatron-LM's training code is not installed, failed where
  ``REPACK_TEST_SAMPLERS`` says it must be (CI's Python 3.12 jobs). Marked ``slow``: CI runs it
  on the newest release (0.19), where it takes about 16 s (one child process).
* Reverse queries under phases equal a scan of the forward answer.
* ``--continued``: each phase's samples are those of ``dataset_class(repack, phases=, phase=)``.
* Refusals, one line each.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from megatron_support import (
    BlendedMegatronDatasetBuilder,
    gpt_config,
    init_process_group,
    write_flat_blend,
    write_sources,
)

from repack.cli import main
from repack.errors import PhaseError
from repack.megatron import dataset_class
from repack.merge import merge
from repack.trace.phases import trace_phases
from repack.trace.run import trace
from repack.trace.settings import UnsupportedRun

pytestmark = pytest.mark.megatron

TESTS = Path(__file__).parent
SEQ = 16


def _need_training_code() -> None:
    """Megatron-LM's phased launch code (megatron/training, 0.17+ wheels), or skip; fail where
    ``REPACK_TEST_SAMPLERS`` is set."""
    problem = None
    if importlib.util.find_spec("megatron.training") is None:
        problem = "megatron/training is not installed (the megatron-core wheels have it from 0.17)"
    else:
        found = importlib.util.find_spec("megatron.training.training")
        text = Path(found.origin).read_text() if found and found.origin else ""
        if "phase_transition_iterations" not in text:
            problem = "this Megatron-LM has no --phase-transition-iterations"
    if problem is not None:
        if os.environ.get("REPACK_TEST_SAMPLERS"):
            pytest.fail(f"REPACK_TEST_SAMPLERS is set but {problem}")
        pytest.skip(problem)


def _schedule(folder: Path, phases: list[dict], batch: int, seed: int | None = None) -> Path:
    items = []
    for number, phase in enumerate(phases):
        blend = folder / f"phase{number}.json"
        blend.write_text(json.dumps(phase["blend"]))
        item = {"blend": blend.name, "start_iteration": phase["start"]}
        if "seed" in phase:
            item["seed"] = phase["seed"]
        items.append(item)
    path = folder / "phases.json"
    data: dict = {"global_batch_size": batch, "phases": items}
    if seed is not None:
        data["seed"] = seed
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs: their schedules, targets and flags."""
    init_process_group()
    root = tmp_path_factory.mktemp("trace-phases")
    p = write_sources(root, 5, sequences=(24, 40), tokens=(3, 60))
    everything = write_flat_blend(root / "all.json", p)
    repack = root / "all.repack"
    merge(everything, repack)
    two = root / "two"
    two.mkdir()
    flat = _schedule(
        two,
        [
            {"blend": [1.0, p[0], 1.0, p[1], 1.0, p[2]], "start": 0},
            {"blend": [3.0, p[0], 1.0, p[1], 1.0, p[2], 2.0, p[3]], "start": 6},
        ],
        batch=8,
    )
    three = root / "three"
    three.mkdir()
    per_split = _schedule(
        three,
        [
            {"blend": {"train": [1, p[0], 2, p[1]], "valid": [p[2]], "test": [p[4]]}, "start": 0},
            {
                "blend": {"train": [1, p[1], 1, p[3]], "valid": [1, p[2], 1, p[3]], "test": [p[4]]},
                "start": 4,
            },
            {
                "blend": {"train": [2, p[0], 1, p[3], 1, p[4]], "valid": [p[2]], "test": [p[4]]},
                "start": 9,
                "seed": 77,
            },
        ],
        batch=6,
        seed=1234,
    )
    return {
        "prefixes": p,
        "save": str(root / "checkpoints"),
        "repack": str(repack),
        "two": {
            "schedule": str(flat),
            "repack": None,
            "save": str(root / "checkpoints"),
            "ranks": 2,
            "seed": 1234,
            "flags": [
                *("--seq-length", str(SEQ), "--split", "80,15,5", "--train-samples", "100"),
                *("--global-batch-size", "8", "--micro-batch-size", "2"),
                *("--eval-interval", "3", "--eval-iters", "1"),
            ],
        },
        "three": {
            "schedule": str(per_split),
            "repack": str(repack),
            "ranks": 1,
            "seed": 1234,
            "flags": [
                *("--seq-length", str(SEQ), "--train-samples", "80"),
                *("--global-batch-size", "6", "--micro-batch-size", "2"),
                *("--eval-interval", "4", "--eval-iters", "2", "--dataloader-type", "cyclic"),
            ],
        },
    }


def _trace_flags(case: dict) -> list[str]:
    """The run's flags for ``repack trace``: Megatron-LM's, the ranks as data-parallel size."""
    flags = list(case["flags"])
    return [*flags, "--data-parallel-size", str(case["ranks"]), "--seed", str(case["seed"])]


def _trace(case: dict, *extra: str) -> dict:
    target = [case["repack"]] if case["repack"] else []
    args = ["trace", *target, "--phases", case["schedule"], *_trace_flags(case), *extra]
    done = CliRunner().invoke(main, [*args, "--json", "-q"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    return json.loads(done.output)


# slow: CI runs it on the newest release (0.19, Python 3.12), whose wheel ships
# megatron/training, where it must run, and in the main suite (0.16: skipped, no megatron/training)
@pytest.mark.slow
def test_trace_is_what_megatrons_phased_launches_read(runs, tmp_path):
    """Every rank's indices and tokens, every iteration and evaluation of the runs, as
    Megatron-LM's own launch code reads them (about 15 s: one child process)."""
    _need_training_code()
    cases = [runs["two"], runs["three"]]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), *(p for p in sys.path if p)]))
    done = subprocess.run(
        [sys.executable, str(TESTS / "phases_child.py"), str(tmp_path / "cases.json"),
         str(tmp_path / "out.json")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    found = json.loads((tmp_path / "out.json").read_text())
    # what could not run here, and nothing else (the save's CUDA calls: checkpoint_child's)
    assert set(found["patched"]) <= {
        "torch.tensor(device='cuda')",
        "mpu.get_data_parallel_rank",
        "mpu.get_data_parallel_world_size",
        "torch.cuda.get_rng_state",
        "torch.cuda.synchronize",
        "torch.cuda.current_device",
    }
    answers = []
    for case, megatron in zip(cases, found["runs"]):
        answer = _trace(case, "--iterations", f"1:{megatron['launches'][0]['iters']}", "--tokens")
        answers.append(answer)
        # the launches' sizes are the header's
        for launch, phase in zip(megatron["launches"], answer["phases"]):
            assert launch["sizes"][0] == phase["samples"]
            assert launch["sizes"][1:] == answer["split_samples"][1:]
            assert launch["iteration"] == phase["start_iteration"]
        # Megatron-LM fails a phased run given --train-iters: trace refuses it
        assert megatron["train_iters_error"].startswith("TypeError")
        train = {
            (r["iteration"], r["rank"], r["microbatch"], r["row"]): r for r in answer["samples"]
        }
        rows = 0
        for iteration, per_rank in megatron["train"].items():
            for rank, batches in enumerate(per_rank):
                for microbatch, batch in enumerate(batches):
                    for row, (index, tokens) in enumerate(batch):
                        record = train[(int(iteration), rank, microbatch, row)]
                        assert record["index"] == index, (iteration, rank, microbatch, row)
                        assert record["tokens"] == tokens, (iteration, rank, microbatch, row)
                        rows += 1
        assert rows == len(train) == len(answer["samples"])
        starts = [p["start_iteration"] for p in answer["phases"]]
        for record in answer["samples"]:
            assert record["phase"] == sum(record["iteration"] > s for s in starts) - 1
        valid: dict = {}
        for r in answer["validation"]:
            valid.setdefault(r["iteration"], {}).setdefault(r["evaluation"], {})[
                (r["rank"], r["microbatch"], r["row"])
            ] = r
        assert sorted(valid) == sorted(int(i) for i in megatron["valid"])
        assert any(int(i) in starts for i in megatron["valid"])  # one at a transition
        rows = 0
        for iteration, evaluations in megatron["valid"].items():
            mine = valid[int(iteration)]
            assert len(mine) == len(evaluations)
            for evaluation, per_rank in zip(sorted(mine), evaluations):
                for rank, batches in enumerate(per_rank):
                    for microbatch, batch in enumerate(batches):
                        for row, (index, tokens) in enumerate(batch):
                            record = mine[evaluation][(rank, microbatch, row)]
                            assert (record["index"], record["tokens"]) == (index, tokens)
                            rows += 1
        assert rows == len(answer["validation"])
    # the checkpoints Megatron-LM's save_checkpoint wrote at each launch's exit: the run's
    # settings read from them give the same answer; their transitions must be the schedule's
    saved = Path(cases[0]["save"])
    for folder in (saved, saved / "iter_0000006"):
        args = ["trace", "--checkpoint", str(folder), "--phases", cases[0]["schedule"]]
        done = CliRunner().invoke(main, [*args, "--iterations", "1:12", "--tokens", "--json"])
        assert done.exit_code == 0, done.output
        via = json.loads(done.stdout)
        assert via["samples"] == answers[0]["samples"]
        assert via["validation"] == answers[0]["validation"]
    other = Path(cases[0]["schedule"]).with_name("other.json")
    schedule = json.loads(Path(cases[0]["schedule"]).read_text())
    schedule["phases"][1]["start_iteration"] = 5
    other.write_text(json.dumps(schedule))
    for extra, message in (
        (["--phases", str(other)], "phase_transition_iterations [6] (from its checkpoint) differ "
         "from the schedule's start iterations [5]"),
        ([], "give --phases FILE"),
    ):  # fmt: skip
        done = CliRunner().invoke(
            main, ["trace", "--checkpoint", str(saved), *extra, "--iteration", "2"]
        )
        assert done.exit_code != 0 and message in done.output, done.output


def _reads(answer: dict, source: str, document: int | None) -> dict[str, set]:
    """A scan of the forward answer: every read of (source, document), or of source."""
    found: dict[str, set] = {"train": set(), "valid": set()}
    for name, key in (("train", "samples"), ("valid", "validation")):
        for r in answer[key]:
            if r["source"] != source:
                continue
            base = (r["phase"], r["iteration"], r.get("evaluation"), r["rank"], r["microbatch"],
                    r["row"], r["index"])  # fmt: skip
            if document is None:
                found[name].add(base)
            for d in r["documents"] if document is not None else ():
                if d["document"] == document and d["end"] > d["start"]:
                    found[name].add((*base, d["start"], d["end"]))
    return found


def _as_set(records: list[dict], document: bool) -> set:
    keys = ["phase", "iteration", "evaluation", "rank", "microbatch", "row", "index"]
    keys += ["start", "end"] * document
    return {tuple(r.get(k) for k in keys) for r in records}


@pytest.mark.once
@pytest.mark.parametrize("run", ["two", "three"])
def test_reverse_queries_are_a_scan_of_the_forward_answer(runs, run):
    """--document and --source across phases find exactly the reads the forward answer holds,
    each in the phases that read it."""
    case = runs[run]
    forward = _trace(case, "--iterations", "1:12" if run == "two" else "1:13")
    phases_of: dict[str, set] = {}
    for r in forward["samples"]:
        phases_of.setdefault(r["source"], set()).add(r["phase"])
    # a source of one phase only, and one of several
    sources = sorted(phases_of, key=lambda s: len(phases_of[s]))
    picks = [sources[0], sources[-1]]
    assert len(phases_of[picks[0]]) < len(phases_of[picks[1]])
    for source in picks:
        answer = _trace(case, "--source", source)
        expected = _reads(forward, source, None)
        assert _as_set(answer["samples"], False) == expected["train"]
        assert _as_set(answer["validation"], False) == expected["valid"]
        documents = [d["document"] for r in forward["samples"] if r["source"] == source
                     for d in r["documents"]]  # fmt: skip
        for document in (documents[0], documents[-1]):
            answer = _trace(case, "--document", f"{source}:{document}")
            expected = _reads(forward, source, document)
            assert _as_set(answer["occurrences"], True) == expected["train"], document
            assert _as_set(answer["validation"], True) == expected["valid"], document


@pytest.mark.once
def test_continued_is_what_the_continued_classes_build(runs, tmp_path):
    """--continued: phase k's train samples are those of dataset_class(repack, phases=FILE,
    phase=k)'s build, at the indices Megatron's sampler hands out; and they differ from stock's
    (the comparison sees the continuation)."""
    case = {**runs["two"], "repack": runs["repack"]}
    continued = _trace(case, "--iterations", "1:12", "--tokens", "--continued")
    stock = _trace(case, "--iterations", "1:12", "--tokens")
    assert [r["index"] for r in continued["samples"]] == [r["index"] for r in stock["samples"]]
    for phase in continued["phases"]:
        k = phase["phase"]
        blend = json.loads(Path(phase["blend"]).read_text())
        config = gpt_config(blend[1::2], blend[0::2], sequence_length=SEQ, split="80,15,5")
        cls = dataset_class(case["repack"], phases=case["schedule"], phase=k)
        sizes = [phase["samples"], *continued["split_samples"][1:]]
        built = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()[0]
        records = [r for r in continued["samples"] if r["phase"] == k]
        assert len(records) == (phase["end_iteration"] - phase["start_iteration"]) * 8
        for r in records:
            # Megatron's single sampler: the phase's samples in order, rank-major micro-batches
            local = (r["iteration"] - 1 - phase["start_iteration"]) * 8
            assert r["index"] == local + r["microbatch"] * 4 + r["rank"] * 2 + r["row"]
            item = built[r["index"]]
            ids = np.concatenate([np.asarray(item["tokens"]), np.asarray(item["labels"])[-1:]])
            assert r["tokens"] == ids.tolist()
    changed = sum(
        a["tokens"] != b["tokens"] for a, b in zip(continued["samples"], stock["samples"])
    )
    first = [a["tokens"] == b["tokens"] for a, b in zip(continued["samples"], stock["samples"])]
    assert all(first[: 6 * 8])  # phase 0 is stock's
    assert changed > 0
    assert any("continuation" in note for note in continued["notes"])


def _values(**extra) -> dict:
    values = {
        "seq_length": SEQ,
        "split": "80,15,5",
        "seed": 1234,
        "micro_batch_size": 2,
        "data_parallel_size": 2,
        "train_samples": 100,
        "eval_interval": 3,
        "eval_iters": 1,
    }
    return {**values, **extra}


@pytest.mark.once
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rampup-batch-size", "4", "4", "40"], "need a constant global batch size"),
        (["--iterations", "1:999"], "the run has iterations 1 to 12"),
        (["--global-batch-size", "16"], "differs from the schedule's global_batch_size 8"),
        (["--train-iters", "12"], "gives --train-samples"),
        (["--continued"], "--continued goes with --phases FILE and the repack"),
        (["--blend", "BLEND"], "--blend with --phases"),
    ],
)
def test_cli_refusals_are_one_line(runs, extra, message):
    case = runs["two"]
    flags = _trace_flags(case)
    if "--train-iters" in extra:
        at = flags.index("--train-samples")
        del flags[at : at + 2]
    target = [runs["repack"]] if "--blend" in extra else []
    blend = str(Path(case["schedule"]).parent / "phase0.json")
    extra = [blend if x == "BLEND" else x for x in extra]
    args = ["trace", *target, "--phases", case["schedule"], *flags, *extra]
    if "--iterations" not in extra:
        args += ["--iteration", "3"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code != 0
    assert message in done.output, done.output
    assert "Traceback" not in done.output
    lines = [line for line in done.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1, done.output


@pytest.mark.once
def test_refusals_of_the_library(runs, monkeypatch):
    """A run whose (checkpoint's) transitions are not the schedule's; a phased run without
    --phases; no phase with the source; the continuation's variables in trace's environment."""
    schedule = runs["two"]["schedule"]
    with pytest.raises(PhaseError, match=r"phase_transition_iterations \[5\].*\[6\]"):
        trace(None, _values(phase_transition_iterations=[5]), phases=schedule, iterations=(1, 1))
    with pytest.raises(UnsupportedRun, match="give --phases FILE"):
        trace(runs["repack"], _values(phase_transition_iterations=[6]), iterations=(1, 1))
    answer = trace(None, _values(phase_transition_iterations="6"), phases=schedule,
                   iterations=(6, 7))  # fmt: skip
    assert [r["phase"] for r in answer.train] == [0] * 8 + [1] * 8
    with pytest.raises(PhaseError, match="phase 1's launch, whose --seed is the phase's own"):
        seeded = Path(schedule).with_name("seeded.json")
        data = json.loads(Path(schedule).read_text())
        data["phases"][1]["seed"] = 5
        seeded.write_text(json.dumps(data))
        trace_phases(None, _values(), seeded, release="0.19", typed=set(), iterations=(1, 1),
                     saved_at=12)  # fmt: skip
    with pytest.raises(Exception, match="no phase's blend has a source"):
        trace(None, _values(), phases=schedule, source="/nowhere/src")
    monkeypatch.setenv("REPACK_PHASE", "1")
    with pytest.raises(Exception, match="REPACK_PHASE set in this environment"):
        trace(runs["repack"], _values(), phases=schedule, iterations=(1, 1))
    with pytest.raises(Exception, match="REPACK_PHASE set in this environment"):
        trace(runs["repack"], _values(global_batch_size=8, train_iters=12, train_samples=None),
              iterations=(1, 1))  # fmt: skip
