"""The ``repack doctor`` examples of README.md run, after the README's demo, as written.

The README's examples run "after the demo, in the same shell": this test makes the demo
folder (``python -m repack.synth demo --sources 300`` and its repack ``demo/out``), then runs
every line of the shell blocks of the ``repack doctor`` section with bash, each of which must
succeed (the examples that expect exit status 1 say so with ``|| echo``). A ``text`` block
right after a shell block of one line shows lines of what it prints: each is in its output.
The section shows a healthy run (exit status 0, ``OK``) before the example of failure.
"""

from __future__ import annotations

import json
from pathlib import Path

from readme_support import DEMO, readme_blocks, shell


def doctor_blocks() -> list[tuple[str, list[str]]]:
    """``(language, lines)`` of the ``sh`` and ``text`` blocks of the doctor section."""
    return readme_blocks("doctor")


def doctor_examples() -> list[str]:
    return [line for lang, lines in doctor_blocks() if lang == "sh" for line in lines]


def test_readme_doctor_examples_run(tmp_path: Path) -> None:
    sh = shell(tmp_path, options="-e", timeout=300)
    setup = sh(DEMO)
    assert setup.returncode == 0, setup.stderr
    examples = doctor_examples()
    assert len(examples) >= 5
    outputs = []
    shown = 0
    for lang, lines in doctor_blocks():
        if lang == "text":  # what the shell block before it prints
            printed = outputs[-1].splitlines()
            missing = [line for line in lines if line not in printed]
            assert not missing, f"{examples[len(outputs) - 1]} does not print {missing}"
            shown += 1
            continue
        for line in lines:
            done = sh(line)
            assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            outputs.append(done.stdout)
    assert shown >= 2
    # what the examples claim: the first is healthy (exit status 0: the line has no `|| echo`),
    # the second finds empty valid slices (exit status 1), the fifth a too-low --mmap-limit;
    # the JSON report is complete
    assert "|" not in examples[0] and outputs[0].splitlines()[-1].startswith("OK: ")
    assert "ERROR" not in outputs[0] and "FAIL" not in outputs[0]
    assert "exit status 1" in outputs[1] and "[empty-split]" in outputs[1]
    assert "FAIL: " in outputs[1]
    assert "--mmap-limit 590" in outputs[4] and "FAIL: 1 problem would" in outputs[4]
    report = json.loads((tmp_path / "demo" / "doctor.json").read_text())
    assert len(report["sources"]) == 300 and report["ok"] is True
    full = (tmp_path / "demo" / "doctor.txt").read_text()
    assert "Sources, most repeated first:" in full  # --top 0: every source
