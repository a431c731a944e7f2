"""One writer at a time: ``merge``, ``add`` and ``remove`` on one repack take one lock.

Real ``repack`` processes: a writer is caught holding the lock (stopped with SIGSTOP the moment
its record appears in ``OUT/.lock``), and a second writer is refused at once with a message
naming it; a writer killed with SIGKILL leaves a lock that the next one takes over; the tasks
of one merge share the lock and still run at the same time, while a finalize or an add is
refused until they are done. Where flock is not supported, the record decides.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from kill_support import finish, popen, run, start_caught, tree

import repack.store.lock as lock_module
from repack.errors import WriterBusy
from repack.store.lock import LOCK_FILE, Holder, held_descriptor, writer_lock
from repack.synth import DemoBlend, make_blend


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    return make_blend(tmp_path_factory.mktemp("lock-first"), 20, seed=41)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    """Enough sources that an add of them holds the lock long enough to be caught."""
    return make_blend(tmp_path_factory.mktemp("lock-big"), 300, seed=42)


@pytest.fixture(scope="module")
def base(first: DemoBlend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lock-base") / "out"
    result = run(["merge", "-q", "--shard-size", "16KiB", first.flat_json, out])
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
def out(base: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "repack"
    shutil.copytree(base, copy)
    return copy


def test_a_second_add_is_refused_naming_the_first(
    out: Path, big: DemoBlend, first: DemoBlend
) -> None:
    holder = start_caught(["add", "-q", out, big.flat_json], out / LOCK_FILE)
    try:
        before = tree(out)
        second = run(["add", "-q", out, big.flat_json])
        assert second.returncode == 3
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        message = lines[0]
        assert message.startswith(f"Error: {out}: another repack command is writing here:")
        assert f"pid {holder.pid} on {socket.gethostname()}" in message
        assert "add -q" in message and big.flat_json.name in message and "since 20" in message
        assert "wait for it to finish" in message
        assert "File exists" not in message and "Traceback" not in second.stderr
        assert tree(out) == before  # the refused add touched nothing
        merge = run(["merge", "-q", "--force", first.flat_json, out])  # nor may a merge
        assert merge.returncode == 3 and f"pid {holder.pid}" in merge.stderr
    finally:
        done = finish(holder)
    assert done.returncode == 0, done.stderr
    assert not (out / LOCK_FILE).exists()  # released and removed
    assert run(["verify", "-q", out]).returncode == 0


def test_a_lock_left_by_a_killed_writer_is_taken_over(out: Path, big: DemoBlend) -> None:
    holder = start_caught(["add", "-q", out, big.flat_json], out / LOCK_FILE)
    os.killpg(holder.pid, signal.SIGKILL)
    holder.communicate()
    left = Holder.parse((out / LOCK_FILE).read_bytes())
    assert left is not None and left.pid == holder.pid and left.alive() is False
    again = run(["add", out, big.flat_json])
    assert again.returncode == 0, again.stderr
    # a note on stderr, not an error; --quiet silences it (test_quiet_takes_over_silently)
    notes = [line for line in again.stderr.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1, again.stderr
    assert notes[0].startswith(f"note: {out}: taking over the lock of pid {holder.pid} on ")
    assert notes[0].endswith("which is no longer running")
    assert not (out / LOCK_FILE).exists()
    assert run(["verify", "-q", out]).returncode == 0


def test_quiet_takes_over_silently(out: Path, big: DemoBlend) -> None:
    holder = start_caught(["add", "-q", out, big.flat_json], out / LOCK_FILE)
    os.killpg(holder.pid, signal.SIGKILL)
    holder.communicate()
    again = run(["add", "-q", "--json", out, big.flat_json])
    assert again.returncode == 0, again.stderr
    assert again.stderr == ""
    assert not (out / LOCK_FILE).exists()


def test_tasks_of_one_merge_share_the_lock(big: DemoBlend, tmp_path: Path) -> None:
    out = tmp_path / "out"
    planned = run(["merge", "-q", "--plan-only", "--shard-size", "64KiB", big.flat_json, out])
    assert planned.returncode == 0, planned.stderr
    writers = out / ".work" / "writers"
    task0 = popen(["merge", "-q", out, "--task", "0", "--tasks", "2"])
    try:
        deadline = time.monotonic() + 60
        while not any(writers.glob(f"*-{task0.pid}.json")):
            assert task0.poll() is None, "task 0 ended before it was seen holding the lock"
            assert time.monotonic() < deadline
            time.sleep(0.001)
        os.kill(task0.pid, signal.SIGSTOP)
        # another task of the same merge runs meanwhile
        task1 = run(["merge", "-q", out, "--task", "1", "--tasks", "2"])
        assert task1.returncode == 0, task1.stderr
        # a finalize, a plain merge and a merge --force must wait for the tasks
        for args in (
            ["merge", "-q", out, "--finalize"],
            ["merge", "-q", "--force", big.flat_json, out],
        ):
            refused = run(args)
            assert refused.returncode == 3, refused.stderr
            assert f"pid {task0.pid} on {socket.gethostname()}" in refused.stderr
            assert "--task 0 --tasks 2" in refused.stderr
    finally:
        done = finish(task0)
    assert done.returncode == 0, done.stderr
    final = run(["merge", "-q", out, "--finalize"])
    assert final.returncode == 0, final.stderr
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    assert run(["verify", "-q", out]).returncode == 0


def test_the_lock_is_reentrant_within_a_process(tmp_path: Path) -> None:
    with writer_lock(tmp_path) as outer, writer_lock(tmp_path) as inner:
        assert inner is outer
        assert Holder.parse((tmp_path / LOCK_FILE).read_bytes()).pid == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()


# --- copy workers share their merge's lock ---------------------------------------------------


def _orphaned_worker(tmp_path: Path) -> tuple[int, int]:
    """``(writer, worker)``: a writer that took the lock of ``tmp_path``, left a process
    holding its lock's descriptor (as copy workers do) and died without releasing it."""
    read_end, write_end = os.pipe()
    writer = os.fork()
    if writer == 0:  # pragma: no cover (child): take the lock, leave a worker, die
        try:
            with writer_lock(tmp_path, command="repack merge b.json out"):
                os.set_inheritable(held_descriptor(tmp_path), True)
                worker = subprocess.Popen(["sleep", "60"], close_fds=False)
                os.write(write_end, str(worker.pid).encode())
                os._exit(0)  # as if killed: the lock is not released
        finally:
            os._exit(1)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as stream:
        worker = int(stream.read())
    assert os.waitpid(writer, 0)[1] == 0
    return writer, worker


def _kill_and_wait(worker: int) -> None:
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # reaped by init (the sleep's parent is gone)


def test_a_worker_of_a_killed_writer_keeps_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer killed while a process writing for it still runs: the next writer waits
    ``ORPHAN_WAIT`` seconds for it, then is refused until that process is gone, so that its
    clean-up never races a writer still at work."""
    monkeypatch.setattr(lock_module, "ORPHAN_WAIT", 0.3)
    writer, worker = _orphaned_worker(tmp_path)
    try:
        with pytest.raises(WriterBusy) as caught, writer_lock(tmp_path):
            pass
        message = str(caught.value)
        assert f"worker processes of pid {writer} on " in message
        assert "which is no longer running" in message
    finally:
        _kill_and_wait(worker)
    with writer_lock(tmp_path) as lock:  # the worker gone, the lock is free
        assert lock.previous is not None and lock.previous.pid == writer


def test_a_writer_waits_for_the_workers_of_a_killed_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copy workers of a killed merge end by themselves within a second or two (the kernel
    kills them with their parent once they have started): a rerun in that time waits for
    them instead of being refused."""
    monkeypatch.setattr(lock_module, "ORPHAN_WAIT", 60.0)
    writer, worker = _orphaned_worker(tmp_path)
    killed = threading.Event()

    def kill() -> None:
        os.kill(worker, signal.SIGKILL)
        killed.set()

    killer = threading.Timer(0.5, kill)
    killer.start()
    try:
        with writer_lock(tmp_path) as lock:
            assert killed.is_set()  # it waited for the worker, and was not refused
            assert lock.previous is not None and lock.previous.pid == writer
    finally:
        killer.join()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_copy_workers_hold_the_lock(big: DemoBlend, tmp_path: Path) -> None:
    out = tmp_path / "out"
    merge = popen(["merge", "-q", "--shard-size", "16KiB", "--workers", "2", big.flat_json, out])
    try:
        holding: set[int] = set()
        deadline = time.monotonic() + 60
        while len(holding) < 2 and merge.poll() is None and time.monotonic() < deadline:
            for pid in _children(merge.pid):
                try:
                    # a copy worker once started: a process being spawned (a worker, the
                    # resource tracker) holds every inherited descriptor until its exec
                    if b"--multiprocessing-fork" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                        continue
                    targets = [
                        os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")
                    ]
                except OSError:
                    continue
                if str(out / LOCK_FILE) in targets:
                    holding.add(pid)
            time.sleep(0.005)
        assert len(holding) == 2, "the copy workers did not hold the lock file open"
    finally:
        _, stderr = merge.communicate(timeout=300)
    assert merge.returncode == 0, stderr


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


# --- where flock is not supported -------------------------------------------------------------


@pytest.fixture
def no_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", refuse)


def write_record(folder: Path, pid: int, host: str | None = None) -> None:
    holder = Holder(pid, host or socket.gethostname(), "repack add x y", time.time() - 60)
    (folder / LOCK_FILE).write_bytes(holder.to_bytes())


def test_without_flock_a_live_writer_refuses(tmp_path: Path, no_flock: None) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        write_record(tmp_path, sleeper.pid)
        with pytest.raises(WriterBusy) as caught, writer_lock(tmp_path):
            pass
        message = str(caught.value)
        assert f"pid {sleeper.pid}" in message and "does not support flock" in message
        assert str(tmp_path / LOCK_FILE) in message
    finally:
        sleeper.kill()
        sleeper.wait()


def test_without_flock_a_writer_of_another_host_refuses(tmp_path: Path, no_flock: None) -> None:
    write_record(tmp_path, 1, host="some-other-node")
    with pytest.raises(WriterBusy, match="pid 1 on some-other-node"), writer_lock(tmp_path):
        pass


def test_without_flock_a_dead_writer_is_taken_over(
    tmp_path: Path, no_flock: None, caplog: pytest.LogCaptureFixture
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_record(tmp_path, gone.pid)
    with writer_lock(tmp_path) as lock:
        assert not lock.flock
        assert lock.previous is not None and lock.previous.pid == gone.pid
        assert json.loads((tmp_path / LOCK_FILE).read_bytes())["pid"] == os.getpid()
    assert f"taking over the lock of pid {gone.pid}" in caplog.text
    assert not (tmp_path / LOCK_FILE).exists()
