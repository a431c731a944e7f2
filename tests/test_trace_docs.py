"""The ``repack trace`` examples of README.md run, after the README's demo, as written.

As ``tests/test_doctor_docs.py`` does for ``doctor``: the demo folder is made, every line of the
shell blocks of the ``repack trace`` section runs with bash and must succeed, and a ``text``
block right after a shell block shows lines of what it prints. The JSON the last example writes
holds reads of the document it names, the one the first example shows read at iteration 3.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.once, pytest.mark.slow]  # ~20 s an example

ROOT = Path(__file__).resolve().parent.parent


def trace_blocks() -> list[tuple[str, list[str]]]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^### `repack trace.*?$(.*?)(?=^### )", readme, re.M | re.S)
    assert section, "README.md has no repack trace section"
    blocks = re.findall(r"^```(sh|text)\n(.*?)^```", section[1], re.M | re.S)
    return [(lang, [line for line in body.splitlines() if line.strip()]) for lang, body in blocks]


def test_readme_trace_examples_run(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def sh(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", f"set -eo pipefail; {command}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    setup = sh(
        "python -m repack.synth demo --sources 300 && repack merge -q demo/blend.json demo/out"
    )
    assert setup.returncode == 0, setup.stderr
    outputs: list[str] = []
    examples = 0
    for lang, lines in trace_blocks():
        if lang == "text":
            printed = outputs[-1].splitlines()
            assert [line for line in lines if line not in printed] == [], printed
            continue
        for line in lines:
            done = sh(line.replace("| head -n 4", "| { head -n 4; cat >/dev/null; }"))
            assert done.returncode == 0, (line, done.stderr)
            outputs.append(done.stdout)
            examples += 1
    assert examples >= 2
    reads = json.loads((tmp_path / "demo" / "reads.json").read_text())["occurrences"]
    assert any(r["iteration"] == 3 for r in reads), reads
