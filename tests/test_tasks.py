"""A merge split into plan, tasks and finalize ends with the bytes of a merge in one go.

The plan is written by ``repack merge --plan-only BLEND OUT``; tasks (``repack merge OUT
--task I --tasks N``, or the SLURM array variables) run as separate processes, in any order,
some of them twice, some at the same time; ``repack merge OUT --finalize`` writes the manifest
and refuses, naming the shards still missing, until every task is done.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from kill_support import run, start, tree

from repack.cli import main
from repack.format import spec as fmt
from repack.merge import PLAN_FILE, WORK_DIR
from repack.read.verify import verify
from repack.synth import DemoBlend, make_blend

OPTIONS = ("-q", "--shard-size", "16KiB")


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    return make_blend(tmp_path_factory.mktemp("tasks"), 60, seed=8)


@pytest.fixture(scope="module")
def expected(blend: DemoBlend, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every file of the merge in one go, by one process."""
    out = tmp_path_factory.mktemp("tasks-reference") / "out"
    done = run(["merge", *OPTIONS, blend.flat_json, out])
    assert done.returncode == 0, done.stderr
    files = tree(out)
    assert len([name for name in files if fmt.is_shard_name(name)]) >= 12
    return files


def cli(*args: object, env: dict | None = None):
    """``repack ARGS`` in this process, without the SLURM variables of the test run."""
    clean = {name: None for name in os.environ if name.startswith("SLURM_")}
    return CliRunner().invoke(main, [os.fspath(a) for a in args], env={**clean, **(env or {})})


def shards_in(out: Path) -> set[int]:
    return {int(p.name[6:11]) for p in out.iterdir() if fmt.is_shard_name(p.name)}


def plan(blend: DemoBlend, out: Path) -> int:
    """Plan the merge of ``blend`` into ``out``; returns the number of shards."""
    result = cli("merge", *OPTIONS, "--plan-only", "--json", blend.flat_json, out)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["state"] == "new"
    return data["shards"]


# --- processes ------------------------------------------------------------------------------


def test_tasks_in_shuffled_order_some_twice_then_finalize(
    blend: DemoBlend, expected: dict, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    planned = run(["merge", *OPTIONS, "--plan-only", blend.flat_json, out])
    assert planned.returncode == 0, planned.stderr
    assert planned.stdout.startswith(f"planned {out}: 60 sources, ")
    assert not (out / fmt.MANIFEST_FILE).exists() and (out / WORK_DIR / PLAN_FILE).exists()
    again = run(["merge", *OPTIONS, "--plan-only", blend.flat_json, out])
    assert again.returncode == 0 and again.stdout.startswith(f"plan already in {out}")

    n = 5
    order = [*range(n), 1, 3]  # tasks 1 and 3 run twice
    random.Random(3).shuffle(order)
    seen: set[int] = set()
    for task in order:
        done = run(["merge", "-q", "--json", out, "--task", str(task), "--tasks", str(n)])
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert (report["task"], report["tasks"]) == (task, n)
        if task in seen:  # idempotent: the second run copies nothing
            assert report["copied"] == 0 and report["skipped"] > 0
        else:
            assert report["copied"] > 0 and report["skipped"] == 0
        seen.add(task)
        assert not (out / fmt.MANIFEST_FILE).exists()
    finalized = run(["merge", "-q", out, "--finalize"])
    assert finalized.returncode == 0, finalized.stderr
    assert finalized.stdout.startswith("finalized 60 sources")
    assert tree(out) == expected


def test_tasks_at_the_same_time(blend: DemoBlend, expected: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    plan(blend, out)
    processes = [start(["merge", out, "--task", str(i), "--tasks", "4"]) for i in range(4)]
    assert [p.wait(timeout=120) for p in processes] == [0, 0, 0, 0]
    assert run(["merge", out, "--finalize"]).returncode == 0
    assert tree(out) == expected


def test_workers(blend: DemoBlend, expected: dict, tmp_path: Path) -> None:
    done = run(["merge", *OPTIONS, "--workers", "3", blend.flat_json, tmp_path / "one-go"])
    assert done.returncode == 0, done.stderr
    assert tree(tmp_path / "one-go") == expected

    out = tmp_path / "split"
    plan(blend, out)
    task = run(["merge", "-q", "--workers", "3", out, "--task", "1", "--tasks", "2"])
    assert task.returncode == 0, task.stderr
    resumed = run(["merge", "-q", "--workers", "3", "--json", out, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["resumed_shards"] == len(shards_in(out)) // 2
    assert tree(out) == expected


# --- SLURM array variables ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "task", "tasks"),
    [
        ({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "3"}, 2, 3),
        (
            {
                "SLURM_ARRAY_TASK_ID": "5",
                "SLURM_ARRAY_TASK_MIN": "4",
                "SLURM_ARRAY_TASK_COUNT": "3",
            },
            1,
            3,
        ),
        (
            {"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "5", "SLURM_ARRAY_TASK_MAX": "8"},
            2,
            4,
        ),
        ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MAX": "3"}, 1, 4),
        (  # sbatch --array=0-6:3, as SLURM 22.05 sets it
            {
                "SLURM_ARRAY_TASK_ID": "6",
                "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_ARRAY_TASK_MAX": "6",
                "SLURM_ARRAY_TASK_STEP": "3",
                "SLURM_ARRAY_TASK_COUNT": "3",
            },
            2,
            3,
        ),
        (
            {
                "SLURM_ARRAY_TASK_ID": "5",
                "SLURM_ARRAY_TASK_MIN": "1",
                "SLURM_ARRAY_TASK_MAX": "7",
                "SLURM_ARRAY_TASK_STEP": "2",
            },
            2,
            4,
        ),
    ],
    ids=["id-count", "id-min-count", "id-min-max", "id-max", "step-count", "step-max"],
)
def test_slurm_array_variables_pick_the_task(
    blend: DemoBlend, tmp_path: Path, env: dict, task: int, tasks: int
) -> None:
    out = tmp_path / "out"
    n = plan(blend, out)
    result = cli("merge", "-q", "--json", out, env=env)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["task"], report["tasks"]) == (task, tasks)
    assert shards_in(out) == {k for k in range(n) if k % tasks == task}


def test_slurm_array_tasks_then_finalize(blend: DemoBlend, expected: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    plan(blend, out)
    for array_id in (12, 10, 11):  # sbatch --array=10-12
        env = {"SLURM_ARRAY_TASK_ID": str(array_id), "SLURM_ARRAY_TASK_MIN": "10"}
        env["SLURM_ARRAY_TASK_MAX"] = "12"
        env["SLURM_ARRAY_TASK_COUNT"] = "3"
        assert cli("merge", "-q", out, env=env).exit_code == 0
    assert cli("merge", "-q", out, "--finalize").exit_code == 0
    assert tree(out) == expected


def test_explicit_task_wins_over_slurm_variables(blend: DemoBlend, tmp_path: Path) -> None:
    out = tmp_path / "out"
    n = plan(blend, out)
    env = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"}
    result = cli("merge", "-q", out, "--task", "2", "--tasks", "3", env=env)
    assert result.exit_code == 0, result.output
    assert shards_in(out) == {k for k in range(n) if k % 3 == 2}


def test_slurm_array_of_listed_ids_is_a_usage_error(blend: DemoBlend, tmp_path: Path) -> None:
    """sbatch --array=1,5,7: SLURM 22.05 sets MIN 1, MAX 7, STEP 1, COUNT 3."""
    out = tmp_path / "out"
    plan(blend, out)
    before = tree(out)
    env = {"SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "7"}
    env |= {"SLURM_ARRAY_TASK_STEP": "1", "SLURM_ARRAY_TASK_COUNT": "3"}
    for array_id in ("5", "7"):
        result = cli("merge", "-q", out, env={**env, "SLURM_ARRAY_TASK_ID": array_id})
        assert result.exit_code == 2
        assert f"SLURM array task id {array_id} is not one of 3 evenly spaced ids" in result.stderr
        assert "--array=0-2" in result.stderr
    assert tree(out) == before


def test_slurm_variable_not_a_number_is_a_usage_error(blend: DemoBlend, tmp_path: Path) -> None:
    out = tmp_path / "out"
    plan(blend, out)
    result = cli(
        "merge", "-q", out, env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "x"}
    )
    assert result.exit_code == 2
    assert "SLURM_ARRAY_TASK_COUNT" in result.stderr and "--task" in result.stderr


# --- refusals -------------------------------------------------------------------------------


def test_finalize_before_every_task_names_the_missing_shards(
    blend: DemoBlend, expected: dict, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    n = plan(blend, out)
    assert cli("merge", "-q", out, "--task", "0", "--tasks", "4").exit_code == 0
    assert cli("merge", "-q", out, "--task", "2", "--tasks", "4").exit_code == 0
    before = tree(out)
    result = cli("merge", "-q", out, "--finalize")
    assert result.exit_code == 3 and not result.stdout
    missing = [fmt.shard_name(k) for k in range(n) if k % 2 == 1]
    shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
    assert result.stderr == f"Error: {out}: {len(missing)} shards not finished yet: {shown}\n"
    assert tree(out) == before

    for task in (1, 3):
        assert cli("merge", "-q", out, "--task", str(task), "--tasks", "4").exit_code == 0
    assert cli("merge", "-q", out, "--finalize").exit_code == 0
    assert tree(out) == expected


def test_finalize_with_one_shard_missing(blend: DemoBlend, tmp_path: Path) -> None:
    out = tmp_path / "out"
    n = plan(blend, out)
    for task in range(n - 1):
        assert cli("merge", "-q", out, "--task", str(task), "--tasks", str(n)).exit_code == 0
    result = cli("merge", "-q", out, "--finalize")
    assert result.exit_code == 3
    assert result.stderr == f"Error: {out}: 1 shard not finished yet: {fmt.shard_name(n - 1)}\n"


def test_a_deleted_shard_is_copied_again(blend: DemoBlend, expected: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    plan(blend, out)
    assert cli("merge", "-q", out, "--task", "0", "--tasks", "1").exit_code == 0
    (out / fmt.shard_name(3)).unlink()
    result = cli("merge", "-q", out, "--finalize")
    assert result.exit_code == 3 and fmt.shard_name(3) in result.stderr
    again = cli("merge", "-q", "--json", out, "--task", "1", "--tasks", "2")
    assert json.loads(again.stdout)["copied"] == 1
    assert cli("merge", "-q", out, "--finalize").exit_code == 0
    assert tree(out) == expected


@pytest.mark.parametrize("step", [["--task", "0", "--tasks", "2"], ["--finalize"], ["--resume"]])
@pytest.mark.parametrize("folder", ["missing", "empty", "foreign"])
def test_step_without_a_plan_is_refused(tmp_path: Path, step: list[str], folder: str) -> None:
    out = tmp_path / "out"
    if folder != "missing":
        out.mkdir()
    if folder == "foreign":
        (out / "notes.txt").write_text("mine")
    result = cli("merge", out, *step)
    assert result.exit_code == 3 and not result.stdout
    assert result.stderr == (
        f"Error: {out}: no merge plan here; run 'repack merge BLEND {out} --plan-only' first\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if folder != "missing" else [])


def test_step_on_a_finished_merge(blend: DemoBlend, expected: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli("merge", *OPTIONS, blend.flat_json, out).exit_code == 0
    for step in (["--task", "0", "--tasks", "2"], ["--finalize"]):
        result = cli("merge", out, *step)
        assert result.exit_code == 3
        assert result.stderr == f"Error: {out}: the merge is already finalized\n"
    again = cli("merge", *OPTIONS, "--plan-only", "--json", blend.flat_json, out)
    assert again.exit_code == 0 and json.loads(again.stdout)["state"] == "complete"
    assert tree(out) == expected


def test_task_out_of_range(blend: DemoBlend, tmp_path: Path) -> None:
    out = tmp_path / "out"
    plan(blend, out)
    result = cli("merge", out, "--task", "3", "--tasks", "3")
    assert result.exit_code == 3
    assert result.stderr == "Error: task 3 is not in 0..2\n"


@pytest.mark.parametrize(
    "args",
    [
        ["{out}"],
        ["{out}", "--task", "0"],
        ["{out}", "--tasks", "2"],
        ["{blend}", "{out}", "--task", "0", "--tasks", "2"],
        ["{blend}", "{out}", "--finalize"],
        ["{blend}", "{out}", "--resume"],
        ["{out}", "--plan-only"],
        ["{out}", "--dry-run"],
        ["{blend}", "{out}", "{out}"],
        ["{out}", "--task", "-1", "--tasks", "2"],
        ["{out}", "--task", "0", "--tasks", "0"],
    ],
)
def test_usage_errors(blend: DemoBlend, tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "out"
    plan(blend, out)
    before = tree(out)
    result = cli("merge", *(a.format(out=out, blend=blend.flat_json) for a in args))
    assert result.exit_code == 2, result.output
    assert "Error:" in result.stderr
    assert tree(out) == before


def test_task_refuses_a_source_changed_since_the_plan(blend: DemoBlend, tmp_path: Path) -> None:
    source = make_blend(tmp_path / "src", 6, seed=1)
    out = tmp_path / "out"
    assert cli("merge", "-q", "--plan-only", source.flat_json, out).exit_code == 0
    with open(source.prefixes[2] + ".bin", "ab") as stream:
        stream.write(bytes(4))
    result = cli("merge", "-q", out, "--task", "0", "--tasks", "1")
    assert result.exit_code == 3
    assert result.stderr.startswith(f"Error: {source.prefixes[2]}.bin: changed during the merge")
    assert not (out / fmt.MANIFEST_FILE).exists()
    assert not [p for p in out.iterdir() if ".tmp" in p.name]
    assert not verify(out).ok


def test_a_failing_task_does_not_break_one_running_at_the_same_time(tmp_path: Path) -> None:
    source = make_blend(tmp_path / "src", 20, seed=6)
    out = tmp_path / "out"
    assert cli("merge", "-q", "--plan-only", *OPTIONS, source.flat_json, out).exit_code == 0
    plan_data = json.loads((out / WORK_DIR / PLAN_FILE).read_text())
    first_of_shard_1 = plan_data["shards"][1]["segments"][0][0]
    changed = plan_data["sources"][first_of_shard_1]["path"] + ".bin"

    # task 0 of 2, in a child paused right before it renames its first shard into place
    ready_read, ready_write = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        code = 70
        try:
            real_replace = os.replace

            def replace(src, dst, *args, **kwargs):
                if ".bin.tmp" in str(src):
                    os.replace = real_replace
                    os.write(ready_write, b"1")
                    os.read(go_read, 1)
                return real_replace(src, dst, *args, **kwargs)

            os.replace = replace
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            try:
                main(["merge", "-q", str(out), "--task", "0", "--tasks", "2"])
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 1
        finally:
            os._exit(code)
    try:
        assert os.read(ready_read, 1) == b"1"
        # meanwhile, task 1 of 2 fails: a source of its first shard changed since the plan
        with open(changed, "ab") as stream:
            stream.write(bytes(4))
        failed = cli("merge", "-q", out, "--task", "1", "--tasks", "2")
        assert failed.exit_code == 3 and "changed during the merge" in failed.stderr
    finally:
        os.write(go_write, b"1")
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "task 0 failed"
