"""Mounting tests/fuse_view.py: a folder seen as a second NFS client sees it (issue 45), or
as a slow server serves it (issue 46), for the tests that need one.

Needs ``/dev/fuse``, ``fusermount3`` (``apt-get install fuse3``) and mfusepy; ``.ci/run``
installs them. Where they are missing the tests are skipped (failed with ``CI=true``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VIEW = Path(__file__).with_name("fuse_view.py")

__all__ = ["child_env", "require_fuse", "view"]


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason} (CI=true: the FUSE tests must run)")
    pytest.skip(reason)


def require_fuse() -> None:
    """Skip where FUSE cannot run (fail with ``CI=true``: .ci/run installs what it needs)."""
    if not os.path.exists("/dev/fuse"):
        _missing("no /dev/fuse")
    if shutil.which("fusermount3") is None:
        _missing("no fusermount3: apt-get install fuse3")
    if importlib.util.find_spec("mfusepy") is None:
        _missing("mfusepy not installed: pip install mfusepy")


def child_env() -> dict[str, str]:
    """The environment of a child process that imports this checkout's repack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _mounted(point: Path) -> bool:
    real = os.path.realpath(point)
    with open("/proc/self/mountinfo") as stream:
        return any(line.split(" ")[4] == real for line in stream)


@contextlib.contextmanager
def view(folder: Path, point: Path, delay: float = 0.0) -> Iterator[Path]:
    """``folder`` as a second NFS client sees it, mounted at ``point``; each read answered
    ``delay`` seconds late (a slow server)."""
    point.mkdir(parents=True, exist_ok=True)
    log = open(point.parent / f"{point.name}.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            str(VIEW),
            str(folder),
            str(point),
            *(["--delay", str(delay)] * bool(delay)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=child_env(),
    )
    try:
        deadline = time.monotonic() + 20
        while not _mounted(point):
            if server.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"the FUSE view did not mount: {Path(log.name).read_text()}")
            time.sleep(0.05)
        yield point
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(point)], capture_output=True)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
