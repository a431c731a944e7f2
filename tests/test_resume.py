"""An interrupted merge, run again, ends with exactly the bytes of an uninterrupted one.

Real ``repack merge`` processes are killed with SIGKILL (no clean-up runs, as when a node dies
or a job runs out of time): after random delays, on a blend of 400 sources cut into many small
shards so that the kills land in every phase, and deterministically right before every
file-system mutation of a smaller merge. After each kill:

* the folder is never accepted as a complete repack (by :class:`repack.read.reader.Repack` or
  :func:`repack.read.verify.verify`) unless it is byte-identical to the right result;
* the same command (or ``repack merge OUT --resume``) then ends with every file byte-identical
  to an uninterrupted run;
* the input prefixes are never modified.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner
from kill_support import fork_cli, group_members, kill_group, proc_stat, run, start, tree

from repack.cli import main
from repack.errors import RepackError
from repack.format import spec as fmt
from repack.merge import PLAN_FILE, WORK_DIR
from repack.read.reader import Repack
from repack.read.verify import verify
from repack.synth import DemoBlend, make_blend

#: Options of every merge here: small shards, so that a merge writes many of them.
OPTIONS = ("-q", "--shard-size", "64KiB")
SMALL_OPTIONS = ("-q", "--shard-size", "12KiB")
#: What a merge killed while writing its manifest leaves behind (repack.store.local.temp_name).
MANIFEST_TEMP = re.compile(r"manifest\.json\.tmp-\d+(-[0-9a-f]{8})?")


# --- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_blend(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    """400 sources, about 55 shards of 64 KiB."""
    return make_blend(tmp_path_factory.mktemp("resume-big"), 400, seed=5)


@pytest.fixture(scope="module")
def small_blend(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    """5 sources of both dtypes, one multimodal, one cut across two of the 5 shards of
    12 KiB: every kind of step of a merge, in few steps."""
    blend = make_blend(tmp_path_factory.mktemp("resume-small"), 5, seed=2)
    out = tmp_path_factory.mktemp("resume-small-premises") / "out"
    assert run(["merge", *SMALL_OPTIONS, blend.flat_json, out]).returncode == 0
    manifest = Repack(str(out)).manifest
    assert len(manifest.shards) == 5 and len({s.dtype_code for s in manifest.shards}) == 2
    assert any(len(s.segments) > 1 for s in manifest.sources)
    return blend


def reference(blend: Path, out: Path, *options: str) -> dict[str, bytes | None]:
    """The files of an uninterrupted merge, by a real process."""
    done = run(["merge", *options, blend, out])
    assert done.returncode == 0, done.stderr
    return tree(out)


def input_state(blend: DemoBlend) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file under the blend's folder."""
    state = {}
    for path in sorted(blend.root.rglob("*")):
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            state[str(path)] = (digest, path.stat().st_mtime_ns)
    return state


def assert_same(out: Path, expected: dict[str, bytes | None], context: str) -> None:
    found = tree(out)
    extra, missing = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
    differ = sorted(k for k in set(found) & set(expected) if found[k] != expected[k])
    assert not (extra or missing or differ), (
        f"{context}: extra {extra}, missing {missing}, different {differ}"
    )


def check_killed_folder(out: Path, expected: dict[str, bytes | None], context: str) -> bool:
    """After a kill: a folder accepted as a complete repack must be the right one.

    Returns whether it was accepted.
    """
    try:
        Repack(str(out)).close()
        opened = True
    except RepackError:
        opened = False
    accepted = os.path.isdir(out) and verify(out).ok
    assert opened == accepted, f"{context}: Repack opens it: {opened}, verify passes: {accepted}"
    if accepted:
        manifest = tree(out)[fmt.MANIFEST_FILE]
        assert manifest == expected[fmt.MANIFEST_FILE], context
        files = Repack(str(out)).manifest
        for name in [files.index_file, *(s.file for s in files.shards)]:
            assert (out / name).read_bytes() == expected[name], f"{context}: {name}"
    return accepted


# --- random SIGKILLs of real processes ------------------------------------------------------


def _finish(out: Path, command: list, expected: dict, resume: bool, context: str) -> None:
    """Run the interrupted merge to its end, then compare with the uninterrupted one."""
    if resume and (out / WORK_DIR / PLAN_FILE).exists():
        done = run(["merge", "-q", out, "--resume"])
    else:
        if resume and not (out / fmt.MANIFEST_FILE).exists():
            # killed before the plan was saved: --resume has nothing to go on
            refused = run(["merge", "-q", out, "--resume"])
            assert refused.returncode == 3, refused.stderr
            assert "no merge plan here" in refused.stderr
            assert refused.stderr.startswith("Error: ") and refused.stderr.count("\n") == 1
        done = run(command)
    assert done.returncode == 0, f"{context}: {done.stderr}"
    assert_same(out, expected, context)


def _chain(
    blend: Path, out: Path, expected: dict, seed: int, kills: int, resume: bool, window: float
) -> list[str]:
    """Kill the merge at random ``kills`` times, restarting it after each kill (with the same
    command, or ``--resume`` if ``resume``); a run that ends before its kill is checked and
    started again from an empty folder. After the last kill, finish the merge and check it.

    Returns one line per kill, for the record.
    """
    rng = random.Random(seed)
    command = ["merge", *OPTIONS, blend, out]
    record: list[str] = []
    for _ in range(10 * kills):
        if len(record) == kills:
            break
        args = command
        if resume and (out / WORK_DIR / PLAN_FILE).exists():
            args = ["merge", "-q", out, "--resume"]
        delay = rng.uniform(0.05, window)
        with tempfile.TemporaryFile() as stderr:
            process = start(args, stderr=stderr)
            time.sleep(delay)
            finished = process.poll() is not None
            if not finished:
                kill_group(process)
            process.wait()
            stderr.seek(0)
            said = stderr.read().decode(errors="replace")
        context = f"seed {seed}, kill {len(record)} after {delay:.3f} s of {args}"
        if finished:
            assert process.returncode == 0, f"{context}: {said}"
            assert_same(out, expected, context)
            shutil.rmtree(out)
            continue
        accepted = check_killed_folder(out, expected, context)
        record.append(f"{context}: {'complete' if accepted else 'incomplete'}")
    assert len(record) == kills, f"seed {seed}: the runs kept ending before their kill"
    _finish(out, command, expected, resume, f"seed {seed} after {kills} kills")
    return record


def test_sigkill_at_random_points_then_run_again(big_blend: DemoBlend, tmp_path: Path) -> None:
    before = input_state(big_blend)
    started = time.monotonic()
    expected = reference(big_blend.flat_json, tmp_path / "reference", *OPTIONS)
    window = 1.2 * (time.monotonic() - started)  # kills land anywhere in a whole run
    assert len([k for k in expected if fmt.is_shard_name(k)]) >= 40
    base = random.randrange(1 << 30)
    chains = [(base + i, 3, i % 3 == 2) for i in range(8)]  # 24 kills, a third --resume
    with ThreadPoolExecutor(3) as pool:
        records = list(
            pool.map(
                lambda c: _chain(
                    big_blend.flat_json, tmp_path / f"out-{c[0]}", expected, *c, window
                ),
                chains,
            )
        )
    kills = [line for record in records for line in record]
    assert len(kills) >= 20, kills
    # most kills land in the middle of a merge (a few, at times, after its manifest)
    assert any(line.endswith("incomplete") for line in kills), kills
    assert input_state(big_blend) == before


@pytest.mark.parametrize("work_left", [True, False], ids=["work-folder-left", "work-folder-gone"])
def test_rerun_after_a_kill_past_the_manifest_removes_older_temp_files(
    small_blend: DemoBlend, tmp_path: Path, work_left: bool
) -> None:
    """Killed after its manifest but before its clean-up ended, a merge leaves the temp files
    of runs killed before it (other pids), and its work folder unless it was killed right
    after removing it; running it again removes them in both cases."""
    command = ["merge", *SMALL_OPTIONS, small_blend.flat_json]
    expected = reference(small_blend.flat_json, tmp_path / "reference", *SMALL_OPTIONS)
    out = tmp_path / "out"
    assert run([*command, out]).returncode == 0
    if work_left:
        (out / WORK_DIR).mkdir()
        (out / WORK_DIR / PLAN_FILE).write_text("{}")
        (out / WORK_DIR / "shard-00002.bin.json.tmp-99998").write_text("{")
    (out / "shard-00001.bin.tmp-99999").write_bytes(b"half a shard")
    (out / "manifest.json.tmp-99997").write_bytes(b"{")
    done = run([*command, out])
    assert done.returncode == 0, done.stderr
    assert_same(out, expected, "rerun of a merge killed after its manifest")


# --- a SIGKILL right before every file-system mutation ----------------------------------------


def test_sigkill_before_every_mutation_then_run_again(
    small_blend: DemoBlend, tmp_path: Path
) -> None:
    """Restarted with the same command after odd points, with --resume after even ones.

    Before each restart, a temp shard of an earlier killed run (a pid long gone) is put in
    the folder: whatever point the kill came at, the finished merge must not hold it."""
    before = input_state(small_blend)
    command = ["merge", *SMALL_OPTIONS, small_blend.flat_json]
    expected = reference(small_blend.flat_json, tmp_path / "reference", *SMALL_OPTIONS)
    status, points = fork_cli([*command, tmp_path / "count"])
    assert status == 0 and points > 50
    out = tmp_path / "out"
    for point in range(1, points + 1):
        shutil.rmtree(out, ignore_errors=True)
        status, _ = fork_cli([*command, out], kill_at=point)
        context = f"killed before mutation {point} of {points}"
        assert status == -signal.SIGKILL, context
        check_killed_folder(out, expected, context)
        if out.is_dir():
            (out / "shard-00001.bin.tmp-99999").write_bytes(b"half a shard of a dead run")
        if point % 2 == 0 and (out / WORK_DIR / PLAN_FILE).exists():
            status, _ = fork_cli(["merge", "-q", out, "--resume"])
            if status == 3:  # the plan file removed along with .work, after the manifest
                status, _ = fork_cli([*command, out])
        else:
            status, _ = fork_cli([*command, out])
        assert status == 0, context
        assert_same(out, expected, context)
    assert input_state(small_blend) == before


def test_no_stray_manifest_temp_file_after_resume(small_blend: DemoBlend, tmp_path: Path) -> None:
    """A merge killed between the creation of ``manifest.json.tmp-PID`` and its rename,
    run again, leaves no temp file behind."""
    command = ["merge", *SMALL_OPTIONS, small_blend.flat_json, tmp_path / "out"]
    status, points = fork_cli([*command[:-1], tmp_path / "count"])
    assert status == 0
    # the last mutations of a merge: manifest temp open, fsync, rename, folder fsync, then
    # the removal of .work; find the temp file's open by killing right after it
    for point in range(points, 0, -1):
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        fork_cli(command, kill_at=point)
        if any(MANIFEST_TEMP.fullmatch(p.name) for p in (tmp_path / "out").iterdir()):
            break
    else:
        pytest.fail("no kill point leaves a manifest temp file")
    assert fork_cli(command)[0] == 0
    expected = reference(small_blend.flat_json, tmp_path / "reference", *SMALL_OPTIONS)
    assert tree(tmp_path / "out") == expected


# --- another merge in OUT -----------------------------------------------------------------------


def grow_one_uint16_source(blend: DemoBlend) -> str:
    """Add one token to the last sequence of a uint16 source: still valid, but different."""
    for prefix in blend.prefixes:
        idx = Path(prefix + ".idx")
        data = bytearray(idx.read_bytes())
        if data[17] == 8:  # uint16
            break
    n_seq = int.from_bytes(data[18:26], "little")
    last = 34 + 4 * (n_seq - 1)
    length = int.from_bytes(data[last : last + 4], "little")
    data[last : last + 4] = (length + 1).to_bytes(4, "little")
    with open(prefix + ".bin", "ab") as stream:
        stream.write(bytes(2))
    idx.write_bytes(bytes(data))
    return prefix


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (["--shard-size", "32KiB"], "--shard-size 16.0 KiB → 32.0 KiB"),
        ([], "--shard-size 16.0 KiB → 64.0 GiB (the default)"),
        (["--shard-size", "16KiB", "--checksum", "sha256"], "--checksum xxh3-128 → sha256"),
        (["--shard-size", "16KiB", "--compress", "zstd"], "--compress none → zstd:3"),
        (
            ["--shard-size", "16KiB", "--no-fingerprints"],
            "fingerprints → --no-fingerprints",
        ),
        ("other blend", "another blend (its splits, prefixes or weights)"),
        ("source changed", "sources changed since it started: {source} (.idx or .bin)"),
    ],
    ids=[
        "shard-size",
        "default-shard-size",
        "checksum",
        "compress",
        "fingerprints",
        "other-blend",
        "source-changed",
    ],
)
def test_unfinished_merge_of_another_blend_or_options_is_refused(
    tmp_path: Path, change: list[str] | str, named: str
) -> None:
    """Refused, naming exactly what differs and offering `--resume` (issue 26)."""
    blend = make_blend(tmp_path / "src", 20, seed=4)
    out = tmp_path / "out"
    planned = cli("merge", "-q", "--plan-only", "--shard-size", "16KiB", blend.flat_json, out)
    assert planned.exit_code == 0, planned.output
    assert cli("merge", "-q", out, "--task", "0", "--tasks", "2").exit_code == 0
    options, target = ["--shard-size", "16KiB"], blend.flat_json
    if change == "other blend":
        target = blend.per_split_json
    elif change == "source changed":
        named = named.format(source=grow_one_uint16_source(blend))
    else:
        options = change
    before = tree(out)
    refused = cli("merge", "-q", *options, target, out)
    assert refused.exit_code == 3, refused.output
    assert refused.stderr.count("\n") == 1 and not refused.stdout
    assert refused.stderr == (
        f"Error: {out}: holds an unfinished merge of {named}; 'repack merge {out} --resume' "
        "finishes it as it was started, --force starts this one over\n"
    )
    assert tree(out) == before
    forced = cli("merge", "-q", "--force", *options, target, out)
    assert forced.exit_code == 0, forced.output
    assert cli("merge", "-q", *options, target, tmp_path / "fresh").exit_code == 0
    assert tree(out) == tree(tmp_path / "fresh")


def test_options_that_do_not_change_the_output_resume(tmp_path: Path) -> None:
    """--workers, --quiet and --json change how a merge runs, not what it writes: a rerun
    with others resumes the unfinished merge (they are not in its plan)."""
    blend = make_blend(tmp_path / "src", 12, seed=4)
    out = tmp_path / "out"
    planned = cli(
        "merge",
        "-q",
        "--plan-only",
        "--workers",
        "2",
        "--shard-size",
        "16KiB",
        blend.flat_json,
        out,
    )
    assert planned.exit_code == 0, planned.output
    assert cli("merge", "-q", out, "--task", "0", "--tasks", "2").exit_code == 0
    resumed = cli(
        "merge", "--json", "--workers", "1", "--shard-size", "16KiB", blend.flat_json, out
    )
    assert resumed.exit_code == 0, resumed.output
    assert (
        cli("merge", "-q", "--shard-size", "16KiB", blend.flat_json, tmp_path / "fresh").exit_code
        == 0
    )
    assert tree(out) == tree(tmp_path / "fresh")


def test_finished_merge_of_another_blend_is_refused(tmp_path: Path) -> None:
    blend = make_blend(tmp_path / "src", 10, seed=4)
    out = tmp_path / "out"
    assert cli("merge", "-q", blend.flat_json, out).exit_code == 0
    before = tree(out)
    again = cli("merge", "-q", blend.flat_json, out)
    assert again.exit_code == 0 and tree(out) == before  # the same merge: already complete
    refused = cli("merge", "-q", blend.per_split_json, out)
    assert refused.exit_code == 3 and "not empty" in refused.stderr and "--force" in refused.stderr
    assert tree(out) == before


def cli(*args: object, env: dict | None = None):
    """``repack ARGS`` in this process, SLURM variables of the test run removed."""
    clean = {name: None for name in os.environ if name.startswith("SLURM_")}
    return CliRunner().invoke(main, [os.fspath(a) for a in args], env={**clean, **(env or {})})


def _workers_of(pid: int) -> list[int]:
    """Children of ``pid`` that run a multiprocessing worker."""
    found = []
    for child in group_members(pid):
        try:
            fields = proc_stat(child)
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            found.append(child)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_no_worker_outlives_a_killed_merge(big_blend: DemoBlend, tmp_path: Path) -> None:
    process = start(["merge", *OPTIONS, "--workers", "2", big_blend.flat_json, tmp_path / "out"])
    try:
        deadline = time.monotonic() + 30
        while not _workers_of(process.pid) and time.monotonic() < deadline:
            assert process.poll() is None, "the merge ended before it started a worker"
            time.sleep(0.02)
        assert _workers_of(process.pid), "the merge started no worker"
        os.kill(process.pid, signal.SIGKILL)  # the merge only, as the OOM killer would
        process.wait()
        deadline = time.monotonic() + 10  # a bound, not a speed test: they go at once
        alive = group_members(process.pid)  # its session: workers and resource tracker
        while alive and time.monotonic() < deadline:
            time.sleep(0.01)
            alive = group_members(process.pid)
        assert not alive, f"processes {alive} still run 10 s after their merge was killed"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if group_members(process.pid):
            os.killpg(process.pid, signal.SIGKILL)


def test_same_merge_with_the_blend_path_spelled_otherwise_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blend = make_blend(tmp_path / "src", 10, seed=4)
    monkeypatch.chdir(tmp_path)
    assert cli("merge", "-q", "--plan-only", "src/blend.json", "out").exit_code == 0
    result = cli("merge", "-q", blend.flat_json, "out")  # the same file, by its absolute path
    assert result.exit_code == 0, result.stderr


def test_a_failed_copy_stops_the_index_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # merge writes the index in a thread while the shards copy; when the copy fails, the
    # thread gives up at the next source instead of finishing a whole index, leaves no temp
    # file, and the merge run again ends with the bytes of an uninterrupted one
    import threading

    import repack.merge as m
    import repack.merge.index as index_step
    import repack.merge.steps as steps

    blend = make_blend(tmp_path / "src", 40, seed=8)
    expected = tmp_path / "expected"
    m.merge(blend.flat_json, expected)
    started, calls = threading.Event(), []
    reread = index_step._reread

    def slow_reread(*args):
        calls.append(1)
        started.set()
        time.sleep(0.02)
        return reread(*args)

    def failing_copy(*args):
        assert started.wait(10)
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(index_step, "_reread", slow_reread)
    monkeypatch.setattr(steps, "copy_shards", failing_copy)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk on fire"):
        m.merge(blend.flat_json, out)
    assert 1 <= len(calls) < 40
    assert not (out / WORK_DIR / "index.json").exists()
    assert [p.name for p in out.rglob("*") if ".tmp" in p.name] == []
    monkeypatch.undo()
    m.merge(blend.flat_json, out)
    assert tree(out) == tree(expected)
