"""``pip install repack`` changes nothing of the training image it goes into.

A venv holding what a pinned training image holds — torch 2.13.0 and megatron-core 0.14.0, with
the numpy 1.x that release asks for — gets ``pip install repack`` and then
``pip install 'repack[megatron]'``: torch, megatron-core and numpy stay the very same
installations (version and files), and ``repack.megatron`` works with them.

Installs from the package index (and the local torch file): slow, and it needs the registry.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KEPT = ("torch", "megatron-core", "numpy")


def run(*args: str, cwd: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=900)
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def installed(python: Path) -> dict[str, tuple[str, int]]:
    """``{name: (version, mtime_ns of its dist-info RECORD)}`` of the packages in ``KEPT``:
    a reinstall of the same version rewrites the RECORD, so it shows too."""
    script = f"""
import json, os
from importlib.metadata import distribution
found = {{}}
for name in {KEPT!r}:
    dist = distribution(name)
    record = os.path.join(str(dist._path), "RECORD")
    found[name] = (dist.version, os.stat(record).st_mtime_ns)
print(json.dumps(found))
"""
    return {k: tuple(v) for k, v in json.loads(run(str(python), "-c", script)).items()}


def test_pip_install_leaves_torch_and_megatron_alone(tmp_path: Path) -> None:
    venv = tmp_path / "image"
    run(sys.executable, "-m", "venv", str(venv))
    python = venv / "bin" / "python"
    pip = (str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check")
    run(*pip, "torch==2.13.0")
    run(*pip, "megatron-core==0.14.0")  # with its own requirement: numpy<2
    before = installed(python)
    assert before["torch"][0].startswith("2.13.0") and before["megatron-core"][0] == "0.14.0"
    assert before["numpy"][0].startswith("1.")  # premise: an image unlike CI's own venv

    source = tmp_path / "repack-src"  # a clean copy: no .venv, no build leftovers
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "build", "__pycache__"),
    )
    run(*pip, str(source))
    assert installed(python) == before
    run(*pip, f"{source}[megatron]")
    assert installed(python) == before

    script = (
        "import megatron.core, repack.megatron as m; "
        "print(megatron.core.__version__, m.repacked(m.GPTDataset).__name__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(python), "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0.14.0", "GPTDataset"]
