"""SIGINT (^C) and SIGTERM (kill, scancel, SLURM at a time limit) stop ``merge``, ``add``,
``remove`` and ``verify`` at once, whatever ``--workers`` is.

Real signals to real process groups: a real ``repack`` process is started in a session of its
own, watched until it reaches a point (its copy workers starting up, its plan saved, shards
being written, shards being hashed) and the whole group is sent the signal with
``os.killpg``, as a terminal's ^C or SLURM's SIGTERM reach every process of a job. Then:

* the exit status is 130 for SIGINT, 143 for SIGTERM;
* stderr is exactly one line, ``Error: interrupted (SIGINT) — rerun the same command to
  resume`` (for ``verify``: ``— nothing was changed; rerun the same command to verify``), from
  the parent alone: no traceback from it nor from a worker, even one still starting;
* the copy did not run on: no more shards were finished after the signal than there were
  workers busy with one;
* every process of the group (workers, multiprocessing's resource tracker) is gone soon
  after (a generous bound of ``GONE_WITHIN`` seconds, a guard against hangs, not a speed test;
  the measured times are printed with ``pytest -s``);
* nothing looks complete: no manifest for a merge, the old manifest for ``add`` and ``remove``,
  and for ``verify`` the folder is untouched;
* the same command run again ends with exactly the files of an uninterrupted run.

The points are found by watching the process and its files, never by sleeping; a run that
ends before its point is started again from scratch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kill_support import group_members, popen, proc_stat, run, tree

from repack.format import spec as fmt
from repack.interrupt import STUCK_REPORT
from repack.merge import PLAN_FILE, WORK_DIR
from repack.synth import DemoBlend, make_blend

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")

#: Small shards, so that a merge writes many of them and a signal lands in the middle.
OPTIONS = ("-q", "--shard-size", "256KiB")
#: Bound on the time from the signal until every process of the group is gone: a guard
#: against a hang, far above the fraction of a second it takes.
GONE_WITHIN = 10.0
ATTEMPTS = 4
RESUME = "rerun the same command to resume"
VERIFY_AGAIN = "nothing was changed; rerun the same command to verify"


# --- the data -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    """300 sources, 33 MiB: 174 shards of 256 KiB."""
    return make_blend(
        tmp_path_factory.mktemp("signals-blend"), 300, seed=3, tokens_per_source=(20000, 60000)
    )


@pytest.fixture(scope="module")
def reference(blend: DemoBlend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted merge of ``blend``."""
    out = tmp_path_factory.mktemp("signals-reference") / "out"
    done = run(["merge", *OPTIONS, blend.flat_json, out])
    assert done.returncode == 0, done.stderr
    assert len(shard_numbers(out)) > 100
    return out


@pytest.fixture(scope="module")
def halves(blend: DemoBlend, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two blend files, of the first and of the second half of the sources."""
    folder = tmp_path_factory.mktemp("signals-halves")
    first, second = folder / "first.json", folder / "second.json"
    first.write_text(json.dumps(blend.prefixes[:150]))
    second.write_text(json.dumps(blend.prefixes[150:]))
    return first, second


@pytest.fixture(scope="module")
def slow_to_verify(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """174 MiB hashed with sha256: long enough to verify that a signal lands while it hashes."""
    root = tmp_path_factory.mktemp("signals-verify")
    big = make_blend(root / "src", 60, seed=4, tokens_per_source=(500000, 1500000))
    out = root / "out"
    done = run(["merge", "-q", "--checksum", "sha256", "--shard-size", "8MiB", big.flat_json, out])
    assert done.returncode == 0, done.stderr
    return out


def shard_numbers(out: Path) -> set[int]:
    """Numbers of the finished shard files in ``out`` (temp files left out)."""
    try:
        names = os.listdir(out)
    except FileNotFoundError:
        return set()
    return {fmt.shard_number(name) for name in names if fmt.is_shard_name(name)}


# --- watching a process -------------------------------------------------------------------------


def spawned_workers(pid: int) -> list[int]:
    """Children of ``pid`` that are multiprocessing workers (spawned)."""
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


def open_files(pid: int) -> list[str]:
    """What the process ``pid`` has open (the targets of /proc/PID/fd)."""
    found = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            found.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return found


def wait_until_gone(pgid: int, timeout: float) -> tuple[list[int], float]:
    """Poll /proc until no process of group ``pgid`` is left; (those left, seconds waited)."""
    started = time.monotonic()
    left = group_members(pgid)
    while left and time.monotonic() - started < timeout:
        time.sleep(0.01)
        left = group_members(pgid)
    return left, time.monotonic() - started


def interrupt(
    args: list,
    signum: int,
    reached: Callable[[subprocess.Popen], bool],
    reset: Callable[[], None],
    out: Path,
    group: bool = True,
) -> dict:
    """Start ``repack ARGS``, send ``signum`` to its process group (to the process alone if
    not ``group``) once ``reached(process)``, and return what happened. A run that ends before
    its point is started again after ``reset()``, up to ``ATTEMPTS`` times."""
    # STUCK_REPORT, a file of its own per call: see check_stopped
    stuck = out.parent / f"stuck-{out.name}-{time.monotonic_ns()}.txt"
    for _ in range(ATTEMPTS):
        reset()
        process = popen(args, {STUCK_REPORT: str(stuck)})
        try:
            deadline = time.monotonic() + 120
            while process.poll() is None and not reached(process):
                assert time.monotonic() < deadline, f"{args} never reached its point"
                time.sleep(0.002)
            if process.poll() is not None:
                process.communicate()
                continue  # too fast: again
            members = group_members(process.pid)
            shards = shard_numbers(out)
            (os.killpg if group else os.kill)(process.pid, signum)
            signalled = time.monotonic()
            stdout, stderr = process.communicate(timeout=120)
            exited = time.monotonic() - signalled
            left, waited = wait_until_gone(process.pid, GONE_WITHIN)
            print(
                f"{' '.join(map(str, args[:2]))} {signal.Signals(signum).name}: exit "
                f"{process.returncode} {exited:.2f} s after the signal, every process of the "
                f"group gone {exited + waited:.2f} s after it ({len(members)} at the signal)"
            )
            return {
                "status": process.returncode,
                "stdout": stdout,
                "stderr": stderr,
                "members": members,
                "left": left,
                "shards_at_signal": shards,
                "shards_at_exit": shard_numbers(out),
                "stuck": stuck.read_text() if stuck.exists() else None,
            }
        finally:
            if process.poll() is None or group_members(process.pid):
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    raise AssertionError(f"{args} ended before its point {ATTEMPTS} times")


def check_stopped(outcome: dict, signum: int, tail: str, workers: int) -> None:
    """The contract of an interrupted command, but for what its folder holds."""
    name = signal.Signals(signum).name
    # the command stopped by itself, not by a safety net (which writes where it was stuck)
    assert outcome["stuck"] is None, outcome["stuck"]
    assert outcome["status"] == 128 + signum, outcome["stderr"]
    assert "Traceback" not in outcome["stderr"], outcome["stderr"]
    assert outcome["stderr"] == f"Error: interrupted ({name}) — {tail}\n"
    assert outcome["stdout"] == ""
    assert not outcome["left"], f"still running {GONE_WITHIN} s after the signal: {outcome}"
    more = outcome["shards_at_exit"] - outcome["shards_at_signal"]
    assert len(more) <= workers, f"{len(more)} shards finished after the signal: {sorted(more)}"


SIGNALS = [signal.SIGINT, signal.SIGTERM]
SIGNAL_IDS = ["SIGINT", "SIGTERM"]


# --- merge ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", SIGNALS, ids=SIGNAL_IDS)
@pytest.mark.parametrize(
    ("workers", "point"),
    [(4, "start-up"), (4, "copy"), (1, "plan"), (1, "copy")],
    ids=["workers4-start-up", "workers4-copy", "workers1-plan", "workers1-copy"],
)
def test_merge_stops_and_resumes(
    blend: DemoBlend, reference: Path, tmp_path: Path, workers: int, point: str, signum: int
) -> None:
    out = tmp_path / "out"
    command = ["merge", *OPTIONS, "--workers", str(workers), blend.flat_json, out]

    def reached(process: subprocess.Popen) -> bool:
        if point == "start-up":  # a worker is there, still starting: importing repack
            return bool(spawned_workers(process.pid))
        if point == "plan":
            return (out / WORK_DIR / PLAN_FILE).exists()
        return len(shard_numbers(out)) >= 5 and not (out / fmt.MANIFEST_FILE).exists()

    outcome = interrupt(command, signum, reached, lambda: shutil.rmtree(out, True), out)
    check_stopped(outcome, signum, RESUME, workers)
    if workers > 1 and point == "copy":
        assert len(outcome["members"]) > workers, "the workers were not running"
    assert not (out / fmt.MANIFEST_FILE).exists()
    again = run(command)
    assert again.returncode == 0, again.stderr
    assert tree(out) == tree(reference)


@pytest.mark.parametrize("signum", SIGNALS, ids=SIGNAL_IDS)
def test_merge_signalled_alone_stops_its_workers(
    blend: DemoBlend, reference: Path, tmp_path: Path, signum: int
) -> None:
    """``kill PID`` reaches the merge only, not its workers: it stops them itself."""
    out = tmp_path / "out"
    command = ["merge", *OPTIONS, "--workers", "4", blend.flat_json, out]

    def reached(process: subprocess.Popen) -> bool:
        return len(shard_numbers(out)) >= 5 and not (out / fmt.MANIFEST_FILE).exists()

    outcome = interrupt(command, signum, reached, lambda: shutil.rmtree(out, True), out, False)
    check_stopped(outcome, signum, RESUME, 4)
    assert len(outcome["members"]) > 4, "the workers were not running"
    assert not (out / fmt.MANIFEST_FILE).exists()
    again = run(command)
    assert again.returncode == 0, again.stderr
    assert tree(out) == tree(reference)


# --- add and remove -----------------------------------------------------------------------------


@pytest.mark.parametrize("signum", SIGNALS, ids=SIGNAL_IDS)
@pytest.mark.parametrize("workers", [4, 1], ids=["workers4", "workers1"])
def test_add_stops_and_resumes(
    halves: tuple[Path, Path], tmp_path: Path, workers: int, signum: int
) -> None:
    first, second = halves
    base = tmp_path / "base"
    done = run(["merge", *OPTIONS, first, base])
    assert done.returncode == 0, done.stderr
    expected = tmp_path / "expected"
    shutil.copytree(base, expected)
    done = run(["add", "-q", "--workers", str(workers), expected, second])
    assert done.returncode == 0, done.stderr
    old = shard_numbers(base)
    out = tmp_path / "out"
    command = ["add", "-q", "--workers", str(workers), out, second]

    def reset() -> None:
        shutil.rmtree(out, True)
        shutil.copytree(base, out)

    def reached(process: subprocess.Popen) -> bool:
        return len(shard_numbers(out) - old) >= 3

    outcome = interrupt(command, signum, reached, reset, out)
    check_stopped(outcome, signum, RESUME, workers)
    assert (out / fmt.MANIFEST_FILE).read_bytes() == (base / fmt.MANIFEST_FILE).read_bytes()
    again = run(command)
    assert again.returncode == 0, again.stderr
    assert tree(out) == tree(expected)


@pytest.mark.parametrize("signum", SIGNALS, ids=SIGNAL_IDS)
def test_remove_stops_and_resumes(
    blend: DemoBlend, reference: Path, tmp_path: Path, signum: int
) -> None:
    gone = [str(prefix) for prefix in blend.prefixes[::3]]  # a source in most shards
    expected = tmp_path / "expected"
    shutil.copytree(reference, expected)
    done = run(["remove", "-q", expected, *gone])
    assert done.returncode == 0, done.stderr
    old = shard_numbers(reference)
    out = tmp_path / "out"
    command = ["remove", "-q", out, *gone]

    def reset() -> None:
        shutil.rmtree(out, True)
        shutil.copytree(reference, out)

    def reached(process: subprocess.Popen) -> bool:
        return len(shard_numbers(out) - old) >= 3

    outcome = interrupt(command, signum, reached, reset, out)
    check_stopped(outcome, signum, RESUME, 1)
    assert (out / fmt.MANIFEST_FILE).read_bytes() == (reference / fmt.MANIFEST_FILE).read_bytes()
    again = run(command)
    assert again.returncode == 0, again.stderr
    assert tree(out) == tree(expected)


# --- verify ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", SIGNALS, ids=SIGNAL_IDS)
@pytest.mark.parametrize("workers", [4, 1], ids=["workers4", "workers1"])
def test_verify_stops(slow_to_verify: Path, workers: int, signum: int) -> None:
    out = slow_to_verify
    before = tree(out)
    command = ["verify", "-q", "--workers", str(workers), out]
    shards = str(out / "shard-")

    def reached(process: subprocess.Popen) -> bool:  # hashing a shard
        return any(path.startswith(shards) for path in open_files(process.pid))

    outcome = interrupt(command, signum, reached, lambda: None, out)
    check_stopped(outcome, signum, VERIFY_AGAIN, workers)
    assert tree(out) == before
    again = run(command)
    assert again.returncode == 0 and again.stdout.startswith("OK: "), again.stdout


# --- the handler, in this process ---------------------------------------------------------------


@pytest.fixture
def restore_handlers():
    saved = {signum: signal.getsignal(signum) for signum in SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_signal_becomes_interrupted_once(restore_handlers: None) -> None:
    from repack.interrupt import Interrupted, handle_signals, received

    with pytest.raises(Interrupted) as caught, handle_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # interrupted at once
    assert caught.value.signum == signal.SIGTERM and caught.value.exit_code == 143
    assert isinstance(caught.value, KeyboardInterrupt)
    assert received() is None  # outside the block
    # the process is on its way out: later signals are ignored, not raised
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    with handle_signals():
        pass
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # restored as it was


def test_a_signal_in_a_deferred_block_is_raised_at_its_end(restore_handlers: None) -> None:
    from repack.interrupt import Interrupted, deferred, handle_signals

    reached_end = False
    with pytest.raises(Interrupted) as caught, handle_signals():
        with deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # blocked here; another thread may take it: then recorded
            reached_end = True
        pytest.fail("not raised when the deferred block ended")
    assert reached_end and caught.value.signum == signal.SIGINT
    assert str(caught.value) == "SIGINT"


def test_without_a_signal_the_handlers_are_restored(restore_handlers: None) -> None:
    from repack.interrupt import handle_signals

    before = signal.getsignal(signal.SIGINT)
    with handle_signals():
        assert signal.getsignal(signal.SIGINT) != before
    assert signal.getsignal(signal.SIGINT) == before


def test_a_command_stuck_after_a_signal_is_ended_at_the_deadline(tmp_path: Path) -> None:
    """The safety net: a command that, told to stop, neither stops nor prints its line within
    ``interrupt.DEADLINE`` seconds (here shortened) is ended with that line and the signal's
    status, by a thread that waits for it; with ``STUCK_REPORT`` set it first writes where
    each thread was."""
    script = """
import os, signal, threading, sys
from repack import interrupt
interrupt.DEADLINE = 0.5
with interrupt.handle_signals(lambda signum: f"stuck ({interrupt.signal_name(signum)})"):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(5)
    except interrupt.Interrupted:
        threading.Event().wait(60)  # stuck on the way out, say in a lock
print("not ended", flush=True)
"""
    report = tmp_path / "stuck.txt"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, STUCK_REPORT: str(report)},
    )
    assert done.returncode == 143, done
    assert done.stderr == "Error: stuck (SIGTERM)\n" and done.stdout == ""
    assert time.monotonic() - started < 30  # ended by the deadline, not by the 60 s wait
    stacks = report.read_text()
    assert "ended by its safety net (0.5 s after SIGTERM)" in stacks
    assert 'File "<string>", line 10' in stacks, stacks  # the main thread, in its wait


def test_a_command_that_stops_in_time_is_not_ended_by_the_deadline() -> None:
    script = """
import os, signal, threading, time
from repack import interrupt
interrupt.DEADLINE = 0.3
with interrupt.handle_signals(lambda signum: "stuck"):
    try:
        os.kill(os.getpid(), signal.SIGINT)
        threading.Event().wait(5)
    except interrupt.Interrupted:
        pass
time.sleep(1)  # past the deadline, outside the block: called off
print("ended normally", flush=True)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout == "ended normally\n", done
    assert done.stderr == ""


def test_at_signal_runs_at_once_where_the_exception_waits(restore_handlers: None) -> None:
    """``deferred(mask=False)`` holds the exception to the end of the block, but the handler
    runs at the signal: an ``at_signal`` callback (telling workers to stop) does not wait."""
    from repack.interrupt import Interrupted, at_signal, deferred, handle_signals

    seen = []
    with pytest.raises(Interrupted), handle_signals(), at_signal(lambda: seen.append(1)):
        with deferred(mask=False):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler runs between bytecodes, soon
                if seen:
                    break
                time.sleep(0.01)
            called_in_the_block = bool(seen)
    assert called_in_the_block and seen == [1]
