"""scripts/slurm/ on a real SLURM cluster of one node: the result is a local merge's bytes.

The module starts its own cluster from a slurm.conf in a temp folder: ``slurmctld`` and
``slurmd`` in the foreground on free local ports, ``auth/none`` (no munge), one node
``localhost`` with up to 2 CPUs, one partition, ``proctrack/linuxproc`` and ``task/none`` (no
cgroups). It stops both daemons at the end. When SLURM is not installed or does not start, every
test here is skipped with the reason (``pytest -rs`` prints it); ``.ci/run`` installs SLURM where
it can (Debian packages ``slurmctld slurmd slurm-client``).
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kill_support import child_env, repack_command, run, tree

from repack.format import spec as fmt
from repack.synth import DemoBlend, make_blend

ROOT = Path(__file__).resolve().parent.parent
SUBMIT = ROOT / "scripts" / "slurm" / "submit.sh"
SBATCH_SCRIPT = ROOT / "scripts" / "slurm" / "merge.sbatch"
OPTIONS = ("--shard-size", "16KiB")
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")
#: How long a job may take to finish, scheduling included.
JOB_TIMEOUT = 180

pytestmark = pytest.mark.slow


def _which(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return shutil.which(name, path=path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"({path.name}: none)"
    return f"{path.name}: " + " | ".join(text[-lines:])


def _memory_mib() -> int:
    with open("/proc/meminfo") as stream:
        total_kib = int(stream.readline().split()[1])
    return total_kib // 1024 * 3 // 4


class Cluster:
    """A one-node SLURM cluster of this test run."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []
        self.env = child_env({"SLURM_CONF": str(self.conf)})
        # jobs inherit the environment of sbatch: find this repack first
        self.env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), self.env["PATH"]])
        self.env["REPACK"] = " ".join(repack_command())

    def write_conf(self) -> None:
        user = getpass.getuser()
        memory = _memory_mib()
        cpus = min(2, os.cpu_count() or 1)
        if memory < 2048:  # less than merge.sbatch asks for: ask for what the node has
            self.env["SBATCH_MEM_PER_NODE"] = f"{memory}M"
        for name in ("state", "spool", "log"):
            (self.root / name).mkdir()
        self.conf.write_text(
            f"""\
ClusterName=repacktest
SlurmctldHost=localhost
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/none
CredType=cred/none
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2,batch_sched_delay=0
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""
        )

    def start(self) -> str | None:
        """Start the daemons; returns why the cluster is unusable, or None."""
        self.write_conf()
        for command in (
            [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)],
            [_which("slurmd"), "-D", "-N", "localhost", "-f", str(self.conf)],
        ):
            name = Path(command[0]).name
            with open(self.root / "log" / f"{name}.stderr", "wb") as stderr:
                self.daemons.append(
                    subprocess.Popen(
                        command,
                        stdout=subprocess.DEVNULL,
                        stderr=stderr,
                        env=self.env,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline:
            for daemon in self.daemons:
                if daemon.poll() is not None:
                    return f"{Path(daemon.args[0]).name} exited with status {daemon.returncode}"
            done = self.command("sinfo", "-h", "-N", "-o", "%T")
            state = done.stdout.strip() or done.stderr.strip()
            if done.returncode == 0 and state in ("idle", "mixed", "allocated"):
                return None
            time.sleep(0.5)
        return f"the node did not come up within 30 s (sinfo: {state!r})"

    def logs(self) -> str:
        return "; ".join(_tail(p) for p in sorted((self.root / "log").iterdir()))

    def stop(self) -> None:
        for daemon in self.daemons:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()

    def command(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_which(args[0]) or args[0], *args[1:]],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=cwd,
            timeout=60,
        )

    def job_states(self, job: str) -> list[str]:
        """The state of the job, or of each task of an array job in task order."""
        done = self.command("scontrol", "-o", "show", "job", job)
        assert done.returncode == 0, done.stderr
        states = []
        for line in done.stdout.splitlines():
            state = re.search(r"\bJobState=(\w+)", line)
            task = re.search(r"\bArrayTaskId=(\d+)\b", line)
            if state:
                states.append((int(task[1]) if task else 0, state[1]))
        return [state for _, state in sorted(states)]

    def wait(self, job: str, final: set[str]) -> list[str]:
        """Wait until every state of ``job`` is in ``final``; return them."""
        deadline = time.monotonic() + JOB_TIMEOUT
        while time.monotonic() < deadline:
            states = self.job_states(job)
            if states and all(s in final for s in states):
                return states
            time.sleep(0.5)
        pytest.fail(f"job {job} still {self.job_states(job)} after {JOB_TIMEOUT} s; {self.logs()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    missing = [n for n in ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol") if not _which(n)]
    if missing:
        pytest.skip(
            f"SLURM is not installed: {', '.join(missing)} not found on PATH or in "
            f"{', '.join(SBIN)} (.ci/run installs it with apt-get where it can)"
        )
    # a short path: SLURM keeps socket paths under SlurmdSpoolDir
    root = Path(tmp_path_factory.mktemp("slurm"))
    cluster = Cluster(root)
    try:
        problem = cluster.start()
        if problem is not None:
            pytest.skip(f"SLURM did not start: {problem}; {cluster.logs()}")
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def blend(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    return make_blend(tmp_path_factory.mktemp("slurm-blend"), 80, seed=12)


@pytest.fixture(scope="module")
def expected(blend: DemoBlend, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The files of a local merge in one go."""
    out = tmp_path_factory.mktemp("slurm-reference") / "out"
    done = run(["merge", "-q", *OPTIONS, blend.flat_json, out])
    assert done.returncode == 0, done.stderr
    files = tree(out)
    assert len([name for name in files if fmt.is_shard_name(name)]) >= 8
    return files


def submit(cluster: Cluster, blend: DemoBlend, out: Path, tasks: int, cwd: Path):
    done = cluster.command(
        str(SUBMIT), str(blend.flat_json), str(out), str(tasks), *OPTIONS, cwd=cwd
    )
    assert done.returncode == 0, f"{done.stderr}; {cluster.logs()}"
    lines = done.stdout.strip().splitlines()
    array = re.search(r"^array job (\d+):", done.stdout, re.M)
    assert array, done.stdout
    return array[1], lines[-1], done.stdout


def test_submit_merges_like_a_local_merge(
    cluster: Cluster, blend: DemoBlend, expected: dict, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    array, final, printed = submit(cluster, blend, out, 4, tmp_path)
    assert printed.startswith(f"planned {out}: ") and ", 4 task(s)" in printed
    assert cluster.wait(final, {"COMPLETED", "FAILED", "CANCELLED"}) == ["COMPLETED"]
    assert cluster.job_states(array) == ["COMPLETED"] * 4
    assert tree(out) == expected
    logs = sorted(tmp_path.glob(f"repack-merge-{array}_*.log"))
    assert [log.read_text().split(":")[0] for log in logs] == [f"task {i} of 4" for i in range(4)]
    assert (tmp_path / f"repack-finalize-{final}.log").read_text().startswith("finalized 80 ")


def test_a_failed_task_stops_finalize_and_submitting_again_finishes(
    cluster: Cluster, blend: DemoBlend, expected: dict, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    planned = run(["merge", "-q", "--plan-only", *OPTIONS, blend.flat_json, out])
    assert planned.returncode == 0, planned.stderr
    # task 1 of 3 cannot put shard 1 in place: a non-empty folder has taken its name
    blocker = out / fmt.shard_name(1)
    blocker.mkdir()
    (blocker / "in-the-way").write_text("")

    array, final, printed = submit(cluster, blend, out, 3, tmp_path)
    assert printed.startswith(f"plan already in {out}: ")
    states = cluster.wait(array, {"COMPLETED", "FAILED", "CANCELLED"})
    assert states[1] == "FAILED", states
    assert cluster.wait(final, {"COMPLETED", "FAILED", "CANCELLED"}) == ["CANCELLED"]
    assert not (out / fmt.MANIFEST_FILE).exists()
    log = (tmp_path / f"repack-merge-{array}_1.log").read_text()
    assert log.startswith("Error: ") and log.count("\n") == 1

    shutil.rmtree(blocker)
    array, final, printed = submit(cluster, blend, out, 3, tmp_path)
    assert printed.startswith(f"plan already in {out}: ")
    assert cluster.wait(final, {"COMPLETED", "FAILED", "CANCELLED"}) == ["COMPLETED"]
    assert cluster.job_states(array) == ["COMPLETED"] * 3
    assert tree(out) == expected


def test_sbatch_script_with_a_stepped_array(
    cluster: Cluster, blend: DemoBlend, expected: dict, tmp_path: Path
) -> None:
    """The array job alone, submitted by hand with --array=0-4:2 (tasks 0, 1, 2 of 3)."""
    out = tmp_path / "out"
    planned = run(["merge", "-q", "--plan-only", *OPTIONS, blend.flat_json, out])
    assert planned.returncode == 0, planned.stderr
    done = cluster.command(
        "sbatch", "--parsable", "--array=0-4:2", str(SBATCH_SCRIPT), str(out), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    array = done.stdout.strip().split(";")[0]
    done = cluster.command(
        "sbatch",
        "--parsable",
        f"--dependency=afterok:{array}",
        str(SBATCH_SCRIPT),
        str(out),
        "--finalize",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    final = done.stdout.strip().split(";")[0]
    assert cluster.wait(final, {"COMPLETED", "FAILED", "CANCELLED"}) == ["COMPLETED"]
    texts = sorted(log.read_text() for log in tmp_path.glob(f"repack-merge-{array}_*.log"))
    assert [text.split(":")[0] for text in texts] == [f"task {i} of 3" for i in range(3)]
    assert tree(out) == expected
