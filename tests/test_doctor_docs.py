"""The ``repack doctor`` examples of README.md run, after the README's demo, as written.

The README's examples run "after the demo, in the same shell": this test makes the demo
folder (``python -m repack.synth demo --sources 300`` and its repack ``demo/out``), then runs
every line of the shell block of the ``repack doctor`` section with bash, each of which must
succeed (the examples that expect exit status 1 say so with ``|| echo``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def doctor_examples() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^### `repack doctor.*?$(.*?)(?=^### )", readme, re.M | re.S)
    assert section, "README.md has no repack doctor section"
    blocks = re.findall(r"^```sh\n(.*?)^```", section[1], re.M | re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_readme_doctor_examples_run(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def sh(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", f"set -e; {command}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    setup = sh(
        "python -m repack.synth demo --sources 300 && repack merge -q demo/blend.json demo/out"
    )
    assert setup.returncode == 0, setup.stderr
    examples = doctor_examples()
    assert len(examples) >= 4
    outputs = []
    for line in examples:
        done = sh(line)
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        outputs.append(done.stdout)
    # what the examples claim: the first finds an empty valid slice, the fourth a too-low
    # --mmap-limit; the JSON report is complete
    assert "exit status 1" in outputs[0] and "[empty-split]" in outputs[0]
    assert "--mmap-limit 590" in outputs[3] and "FAIL: 1 problem would" in outputs[3]
    report = json.loads((tmp_path / "demo" / "doctor.json").read_text())
    assert len(report["sources"]) == 300 and report["ok"] is True
    full = (tmp_path / "demo" / "doctor.txt").read_text()
    assert "Sources, most repeated first:" in full  # --top 0: every source
