"""Run the real ``repack`` command line in child processes, and kill them where it hurts.

Used by the crash tests (test_resume.py, test_append.py, test_tasks.py, test_slurm.py):

* :func:`run` and :func:`start` run ``repack`` in a new process (the console script of this
  environment, else ``python -m repack``), with the SLURM variables of the test run removed;
* :func:`fork_cli` runs the command line in a forked child and SIGKILLs it right before its
  ``n``-th file-system mutation (an fsync, truncate, rename, unlink, rmdir, mkdir, or an open
  for writing): every step where an interrupted merge could leave something behind is hit,
  deterministically, without paying a Python start-up per run;
* :func:`start_caught` starts ``repack`` and stops it (SIGSTOP) while it holds the writer
  lock, for tests of what another writer meets; :func:`finish` lets it go on;
* :func:`tree` reads a folder into a dict, to compare outputs byte for byte.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import repack.merge
import repack.merge.append
import repack.merge.remove
import repack.read.verify
from repack.cli import main
from repack.store.lock import Holder

__all__ = [
    "MUTATIONS",
    "catch_holding",
    "child_env",
    "finish",
    "fork_cli",
    "popen",
    "repack_command",
    "run",
    "start",
    "start_caught",
    "tree",
]

#: The calls :func:`fork_cli` counts as mutation points (``open`` only with a write flag).
MUTATIONS = ("fsync", "ftruncate", "replace", "rename", "unlink", "rmdir", "mkdir", "open")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC


def repack_command() -> list[str]:
    """How to start ``repack``: the console script next to this Python, else ``-m``."""
    script = Path(sys.executable).with_name("repack")
    return [str(script)] if script.exists() else [sys.executable, "-m", "repack"]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without SLURM's variables (the tests may run in a SLURM
    job), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(extra or {})
    return env


def run(
    args: Sequence[str | os.PathLike],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """Run ``repack ARGS`` to completion; output captured as text."""
    return subprocess.run(
        [*repack_command(), *map(os.fspath, args)],
        capture_output=True,
        text=True,
        env=child_env(env),
        timeout=timeout,
    )


def start(args: Sequence[str | os.PathLike], **kwargs) -> subprocess.Popen:
    """Start ``repack ARGS`` in a session of its own (kill it with ``os.killpg``)."""
    return subprocess.Popen(
        [*repack_command(), *map(os.fspath, args)],
        stdout=subprocess.DEVNULL,
        stderr=kwargs.pop("stderr", subprocess.DEVNULL),
        env=child_env(kwargs.pop("env", None)),
        start_new_session=True,
        **kwargs,
    )


def proc_stat(pid: int | str) -> list[str]:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (zombies left out)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            fields = proc_stat(entry) if entry.isdigit() else None
        except OSError:  # gone meanwhile
            continue
        if fields and int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry))
    return found


def kill_group(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGKILL the session ``start`` made, and wait until every process of it is gone — its
    copy workers too, not only the leader — as a job restarted after a crash would find it."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + timeout
    while group_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def fork_cli(args: Sequence[str | os.PathLike], kill_at: int | None = None) -> tuple[int, int]:
    """Run ``repack ARGS`` in a forked child; SIGKILL it right before mutation ``kill_at``.

    Returns:
        (exit status, or ``-SIGKILL`` if killed; mutation points the child reached).
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        code = 70
        try:
            os.close(read_end)
            counted = [0]

            def hook(name, real):
                def call(*a, **kw):
                    if name != "open" or (len(a) > 1 and a[1] & _WRITE_FLAGS):
                        counted[0] += 1
                        if counted[0] == kill_at:
                            os.kill(os.getpid(), signal.SIGKILL)
                        if name == "fsync":
                            return None  # what a killed process wrote survives it anyway
                    return real(*a, **kw)

                return call

            for name in MUTATIONS:
                setattr(os, name, hook(name, getattr(os, name)))
            devnull = os.open("/dev/null", os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            try:
                main([os.fspath(a) for a in args], prog_name="repack")
                code = 0
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 1
            os.write(write_end, str(counted[0]).encode())
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as stream:
        reached = stream.read()
    _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return code, int(reached) if reached else kill_at or 0


def popen(args: list, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [*repack_command(), *map(os.fspath, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(env),
        start_new_session=True,
    )


def catch_holding(process: subprocess.Popen, record: Path, timeout: float = 60) -> bool:
    """Stop ``process`` (SIGSTOP) as soon as ``record`` names it; False if it ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            holder = Holder.parse(record.read_bytes())
        except FileNotFoundError:
            holder = None
        if holder is not None and holder.pid == process.pid:
            os.kill(process.pid, signal.SIGSTOP)
            return True
        if process.poll() is not None:
            return False
        time.sleep(0.001)
    raise AssertionError(f"{record} never named pid {process.pid}")


def start_caught(args: list, record: Path, attempts: int = 5) -> subprocess.Popen:
    """Start ``repack ARGS`` and stop it while it holds the lock (retried if it was faster)."""
    for _ in range(attempts):
        process = popen(args)
        if catch_holding(process, record):
            return process
        process.communicate()
    raise AssertionError(f"could not catch {args} holding the lock in {attempts} attempts")


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    os.kill(process.pid, signal.SIGCONT)
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def tree(folder: str | os.PathLike) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (``None``) under ``folder``, by relative path."""
    found: dict[str, bytes | None] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), folder) + "/"] = None
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = Path(path).read_bytes()
    return found


# keep the modules the children run imported in the parent
_PRELOADED = (repack.merge, repack.merge.append, repack.merge.remove)
