"""The ``repack bench`` examples of docs/bench.md run, after the README's demo, as written.

As ``tests/test_trace_docs.py`` does for README.md's ``trace`` section: the demo folder is made,
every line of the page's shell blocks runs with bash and must succeed, and each line of a
``text`` block is a line of what the shell block before it printed, figures aside (a replay's
times and rates differ from run to run, so every number compares as "a number"). The JSON the
page writes holds both layouts' figures, for the same samples.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from readme_support import DEMO, page_blocks, shell

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.once, pytest.mark.slow]  # ~10 s an example

NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def shape(line: str) -> str:
    """``line`` with every number replaced by ``#``."""
    return NUMBER.sub("#", line)


def test_bench_page_examples_run(tmp_path: Path) -> None:
    sh = shell(tmp_path, options="-eo pipefail", timeout=600)
    setup = sh(DEMO)
    assert setup.returncode == 0, setup.stderr
    outputs: list[str] = []
    shown = 0
    for lang, lines in page_blocks("docs/bench.md"):
        if lang == "text":
            printed = {shape(line) for line in outputs[-1].splitlines()}
            assert [line for line in lines if shape(line) not in printed] == [], outputs[-1]
            shown += 1
            continue
        printed = ""
        for line in lines:
            done = sh(line)
            assert done.returncode == 0, (line, done.stderr[-2000:])
            printed += done.stdout
        outputs.append(printed)
    assert len(outputs) >= 5 and shown >= 3
    repack, prefixes = json.loads((tmp_path / "demo" / "bench.json").read_text())
    assert (repack["layout"], prefixes["layout"]) == ("repack", "prefixes")
    for key in ("samples", "bytes", "requests"):
        assert repack[key] == prefixes[key], key
    assert repack["files_opened"] == 3 and prefixes["files_opened"] == 600  # 2 shards + index
