"""README.md's examples of one command, and a docs page's, run as a reader runs them
(tests/test_doctor_docs.py, tests/test_trace_docs.py, tests/test_storage_docs.py): the ``sh``
and ``text`` blocks of its section or page, and a bash shell in a folder, with this
interpreter's ``repack`` and ``python`` first on ``PATH``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The README's demo, which its examples run after ("in the same shell").
DEMO = "python -m repack.synth demo --sources 300 && repack merge -q demo/blend.json demo/out"


def readme_blocks(command: str) -> list[tuple[str, list[str]]]:
    """``(language, non-blank lines)`` of the ``sh`` and ``text`` blocks of README.md's
    ``### `repack COMMAND ...`` section."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(rf"^### `repack {command}.*?$(.*?)(?=^### )", readme, re.M | re.S)
    assert section, f"README.md has no repack {command} section"
    return shell_and_text_blocks(section[1])


def page_blocks(page: str) -> list[tuple[str, list[str]]]:
    """``(language, non-blank lines)`` of the ``sh`` and ``text`` blocks of a whole page
    (``"docs/bench.md"``)."""
    return shell_and_text_blocks((ROOT / page).read_text(encoding="utf-8"))


def shell_and_text_blocks(text: str) -> list[tuple[str, list[str]]]:
    blocks = re.findall(r"^```(sh|text)\n(.*?)^```", text, re.M | re.S)
    return [(lang, [line for line in body.splitlines() if line.strip()]) for lang, body in blocks]


def shell(
    folder: Path, *, options: str, timeout: float
) -> Callable[[str], subprocess.CompletedProcess]:
    """Run a line with bash in ``folder`` (``set OPTIONS`` first), capturing its output."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def sh(line: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", f"set {options}; {line}"],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return sh
