"""The blend of the issue: a source whose validation slice is empty.

With ``--split 99,1,0`` a prefix of 4 sequences gets ``round(0.99 * 4) = 4`` of them for
training and none for validation. ``repack doctor`` exits 1 naming the source and the split;
stock Megatron, given the same blend, never returns from ``GPTDataset._get_num_epochs``
(shown in a child process, stopped after a timeout, with its stack dumped where it loops),
while the same blend without that source builds at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from repack.cli import main
from repack.synth import write_prefix

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # two Megatron imports in child processes, one held 20 s

#: Seconds the hanging build is given after the control build has shown how long one takes.
HANG_WAIT = 20

CHILD = textwrap.dedent(
    """
    import faulthandler, json, sys, tempfile, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {tests!r})
    from megatron_support import GPTDataset, build, gpt_config, init_process_group

    prefixes, weights = json.load(open(sys.argv[1]))
    init_process_group(tempfile.mkdtemp())
    config = gpt_config(prefixes, weights, split="99,1,0", cache=sys.argv[2])
    print("BUILDING", flush=True)
    faulthandler.dump_traceback_later({dump}, exit=False)  # where it is, if still running
    build(GPTDataset, config, [1000, 20, 0])
    faulthandler.cancel_dump_traceback_later()
    print("BUILT", flush=True)
    """
)


@pytest.fixture
def blend(tmp_path: Path) -> tuple[Path, list[str]]:
    rng = np.random.default_rng(2)
    prefixes = []
    for i, n in enumerate([150, 200, 4, 120]):  # source 2 has 4 sequences
        prefix = str(tmp_path / "data" / f"src-{i}")
        write_prefix(prefix, [rng.integers(1, 60000, 120) for _ in range(n)])
        prefixes.append(prefix)
    items: list = []
    for prefix in prefixes:
        items += [1.0, prefix]
    path = tmp_path / "blend.json"
    path.write_text(json.dumps(items))
    return path, prefixes


def test_doctor_names_the_source_and_the_split(blend: tuple[Path, list[str]]) -> None:
    path, prefixes = blend
    args = [
        "doctor",
        str(path),
        "--seq-length",
        "64",
        "--split",
        "99,1,0",
        "--samples",
        "1000,20,0",
        "--json",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    errors = [p for p in report["problems"] if p["level"] == "error"]
    assert [(p["code"], p["source"], p["split"]) for p in errors] == [
        ("empty-split", prefixes[2], "valid")
    ]
    assert "hangs" in errors[0]["message"]
    text = CliRunner().invoke(main, args[:-1])
    assert text.exit_code == 1
    line = next(x for x in text.stdout.splitlines() if x.startswith("ERROR"))
    assert prefixes[2] in line and "valid slice" in line and "sequences [4, 4) of 4" in line
    assert text.stdout.rstrip().endswith("would stop or hang training")


def _start(folder: Path, name: str, prefixes: list[str], dump: int) -> subprocess.Popen:
    job = folder / f"{name}.json"
    job.write_text(json.dumps([prefixes, [1.0] * len(prefixes)]))
    script = folder / f"{name}.py"
    tests = str(Path(__file__).resolve().parent)
    script.write_text(CHILD.format(tests=tests, dump=dump))
    return subprocess.Popen(
        [sys.executable, str(script), str(job), str(folder / f"cache-{name}")],
        stdout=open(folder / f"{name}.out", "w"),
        stderr=open(folder / f"{name}.err", "w"),
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )


def _wait_for(path: Path, marker: str, process: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker in path.read_text():
            return True
        if process.poll() is not None:
            return marker in path.read_text()
        time.sleep(0.1)
    return False


def test_stock_megatron_hangs_on_it(blend: tuple[Path, list[str]], tmp_path: Path) -> None:
    _, prefixes = blend
    control = _start(tmp_path, "control", prefixes[:2] + prefixes[3:], dump=HANG_WAIT * 3)
    stuck = _start(tmp_path, "stuck", prefixes, dump=HANG_WAIT // 2)
    try:
        # the control: the same blend without the 4-sequence source builds within seconds
        assert _wait_for(tmp_path / "control.out", "BUILT", control, 300), (
            tmp_path / "control.err"
        ).read_text()[-2000:]
        assert _wait_for(tmp_path / "stuck.out", "BUILDING", stuck, 300)
        started = time.monotonic()
        assert not _wait_for(tmp_path / "stuck.out", "BUILT", stuck, HANG_WAIT)
        assert stuck.poll() is None  # still running, not failed
        assert time.monotonic() - started >= HANG_WAIT
        # the stack faulthandler dumped while it was stuck: Megatron's epoch loop
        assert "_get_num_epochs" in (tmp_path / "stuck.err").read_text()
    finally:
        for process in (control, stuck):
            if process.poll() is None:
                process.kill()
            process.wait()
