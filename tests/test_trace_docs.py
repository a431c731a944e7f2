"""The ``repack trace`` examples of README.md run, after the README's demo, as written.

As ``tests/test_doctor_docs.py`` does for ``doctor``: the demo folder is made, every line of the
shell blocks of the ``repack trace`` section runs with bash and must succeed, and a ``text``
block right after a shell block shows lines of what it prints. The JSON the last example writes
holds reads of the document it names, the one the first example shows read at iteration 3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from readme_support import DEMO, readme_blocks, shell

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.once, pytest.mark.slow]  # ~20 s an example


def trace_blocks() -> list[tuple[str, list[str]]]:
    return readme_blocks("trace")


def test_readme_trace_examples_run(tmp_path: Path) -> None:
    sh = shell(tmp_path, options="-eo pipefail", timeout=600)
    setup = sh(DEMO)
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
