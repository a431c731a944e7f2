"""``pip install -e '.[test]' && pytest`` where neither torch nor megatron-core is installed:
every test that needs neither is collected, and each test file that needs one is skipped by
its name (tests/conftest.py), instead of the collection stopping at the first import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: A Python in which importing torch or megatron fails as where they are not installed
BLOCKED = (
    "import sys\n"
    "sys.modules['torch'] = sys.modules['megatron'] = None  # ModuleNotFoundError on import\n"
    "import pytest\n"
    "args = ['--collect-only', '-q', '-rs', '-p', 'no:cacheprovider', sys.argv[1]]\n"
    "sys.exit(pytest.main(args))  # 2 on a collection error\n"
)


def test_collection_without_torch_and_megatron_skips_by_file_name() -> None:
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED, str(TESTS)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=TESTS.parent,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    # the files that need them are named, with what they need
    assert any("test_masks.py: needs torch, not installed" in line for line in skipped), skipped
    assert any("needs megatron-core, not installed" in line for line in skipped), skipped
    # and the rest is collected: the store, merge and CLI tests need neither
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    for name in ("test_store.py", "test_roundtrip.py", "test_cli.py", "test_objstore.py"):
        assert any(line.startswith(f"tests/{name}::") for line in collected), name
