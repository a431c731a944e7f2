"""docs/megatron.md runs: every Python block marked ``<!-- test: run -->`` is executed, and the
first example, marked ``<!-- test: run-after-demo -->``, runs as a newcomer runs it.

The first example runs as it is, ``python first.py`` in a new process of its own (nothing set
up for it), in a folder where the README's demo ran; what it prints is what the guide says and
what ``repack doctor`` computes for those settings.

The blocks run in order, each in a fresh process (forked from one that imported torch and
Megatron once, so that no block sees another's open files or environment), in a folder that
holds what the guide assumes: a Megatron data-args file ``data_args.txt`` naming six small
uint16 prefixes under ``data/``, and its repack ``blend.repack`` made with ``repack merge``.
Files the blocks write stay for the next ones. As in a training job, ``torch.distributed`` is
initialized (one rank, gloo) before each block.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from repack.merge import merge
from repack.synth import write_prefix

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow  # one Megatron import, seven blocks, one spawned worker: ~30 s

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "megatron.md"
MARKER = "<!-- test: run -->"
DEMO_MARKER = "<!-- test: run-after-demo -->"

_BLOCK = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```\s*$", re.M | re.S)


def runnable_blocks(text: str, marker: str = MARKER) -> list[tuple[int, str]]:
    """``(line, code)`` of every Python block right after a ``marker`` line."""
    blocks = []
    for match in _BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        if before != marker:
            continue
        if match["lang"] != "python":
            raise AssertionError(f"a {marker} block must be python, not {match['lang']!r}")
        line = text.count("\n", 0, match.start()) + 2  # first line of code, 1-based
        blocks.append((line, match["body"]))
    return blocks


RUNNER = textwrap.dedent(
    """
    import json, os, sys, tempfile, time, traceback, warnings

    def run_block(line, code, report):
        import torch

        error = ""
        try:
            with tempfile.NamedTemporaryFile() as rendezvous:
                torch.distributed.init_process_group(
                    "gloo", init_method="file://" + rendezvous.name, rank=0, world_size=1
                )
            exec(compile(code, f"docs/megatron.md:{line}", "exec"), {"__name__": "__main__"})
        except BaseException:
            error = traceback.format_exc()
        with open(report, "w") as stream:
            stream.write(error)

    def main():
        warnings.simplefilter("ignore")
        # what every block imports, once: each block then runs in a fork of this process
        import torch  # noqa: F401
        import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
        import repack.megatron  # noqa: F401

        blocks = json.load(open(sys.argv[1]))
        results = []
        for number, (line, code) in enumerate(blocks):
            report = f"block-{number}.txt"
            started = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                try:
                    run_block(line, code, report)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(0)
            _, status = os.waitpid(pid, 0)
            if os.path.exists(report):
                error = open(report).read() or None
            else:
                error = f"the block's process died: wait status {status}"
            results.append([error, time.perf_counter() - started])
        json.dump(results, open(sys.argv[2], "w"))

    if __name__ == "__main__":  # DataLoader workers started with "spawn" import this file
        main()
    """
)


def make_workdir(root: Path) -> None:
    """The files the guide assumes: ``data_args.txt``, ``data/``, ``blend.repack``."""
    rng = np.random.default_rng(7)
    lines = []
    for i in range(6):
        lengths = rng.integers(5, 300, int(rng.integers(40, 81)))
        tokens = rng.integers(0, 65535, int(lengths.sum()), dtype=np.uint16)
        write_prefix(root / "data" / f"src-{i}", np.split(tokens, np.cumsum(lengths)[:-1]))
        lines.append(f"{rng.uniform(0.5, 2.0):.2f} data/src-{i}")
    (root / "data_args.txt").write_text("\n".join(lines) + "\n")
    merge(root / "data_args.txt", root / "blend.repack")


@pytest.fixture(scope="module")
def guide_results(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, str | None, float]]:
    blocks = runnable_blocks(GUIDE.read_text(encoding="utf-8"))
    work = tmp_path_factory.mktemp("megatron-docs")
    make_workdir(work)
    (work / "blocks.json").write_text(json.dumps(blocks))
    (work / "run_blocks.py").write_text(RUNNER)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("REPACK_DIR", None)
    done = subprocess.run(
        [sys.executable, "run_blocks.py", "blocks.json", "results.json"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results_path = work / "results.json"
    if not results_path.exists():
        pytest.fail(f"the block runner failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    results = json.loads(results_path.read_text())
    return [(line, error, took) for (line, _), (error, took) in zip(blocks, results, strict=True)]


def test_the_guide_has_runnable_blocks() -> None:
    blocks = runnable_blocks(GUIDE.read_text(encoding="utf-8"))
    assert len(blocks) >= 6, [line for line, _ in blocks]


def test_markers_precede_blocks() -> None:
    """A marker not followed by a code block would silently test nothing."""
    lines = GUIDE.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines):
        if line.strip() in (MARKER, DEMO_MARKER):
            assert lines[number + 1].startswith("```python"), f"docs/megatron.md:{number + 1}"


def test_every_runnable_block_runs(guide_results: list[tuple[int, str | None, float]]) -> None:
    failures = [f"docs/megatron.md:{line}\n{error}" for line, error, _ in guide_results if error]
    assert not failures, "\n".join(failures)
    print(", ".join(f"line {line}: {took:.1f} s" for line, _, took in guide_results))


def test_the_first_example_runs_after_the_readme_demo(tmp_path: Path) -> None:
    guide = GUIDE.read_text(encoding="utf-8")
    ((line, code),) = runnable_blocks(guide, DEMO_MARKER)
    first = next(m for m in _BLOCK.finditer(guide) if m["lang"] == "python")
    assert first["body"] == code, "the block run after the demo is the guide's first example"

    env = {k: v for k, v in os.environ.items() if k != "REPACK_DIR"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONWARNINGS"] = "ignore"
    demo = subprocess.run(  # the README's demo, as it runs it
        [
            "bash",
            "-c",
            "set -e; blend=$(python -m repack.synth demo --sources 300) && "
            'repack merge -q "$blend" demo/out',
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stderr
    (tmp_path / "first.py").write_text(code)
    done = subprocess.run(
        [sys.executable, "first.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"docs/megatron.md:{line}\n{done.stdout}\n{done.stderr[-4000:]}"
    printed = done.stdout.strip().splitlines()[-1]
    samples = int(printed.split()[0])

    said = re.search(r"It prints the number of training samples, ([\d,]+)", guide)
    assert said and int(said[1].replace(",", "")) == samples, (said, printed)
    doctor = subprocess.run(
        "repack doctor -q demo/blend.json --seq-length 256 --split 100,0,0 --samples 2000,0,0 "
        "--json",
        shell=True,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(doctor.stdout)
    assert report["ok"] is True and doctor.returncode == 0
    assert [(s["split"], s["size"]) for s in report["splits"]] == [("train", samples)]
    assert (tmp_path / "demo" / "cache").is_dir()  # the cache went where the example says

    # what the guide says of a 90,5,5 split on the demo
    other = code.replace('split="100,0,0"', 'split="90,5,5"').replace(
        "[2000, 0, 0]", "[2000, 100, 20]"
    )
    assert other != code
    (tmp_path / "split.py").write_text(other)
    done = subprocess.run(
        [sys.executable, "split.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode != 0
    assert (
        "repack.errors.UndrawableSplit:" in done.stderr and "slice holds no tokens" in done.stderr
    )
