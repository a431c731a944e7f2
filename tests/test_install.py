"""Installing repack: the distribution ``megatron-repack``, and what it leaves alone.

* The wheel built from this tree is named ``megatron-repack`` (the package index's ``repack``
  is an unrelated project) and, installed into a fresh venv with its dependencies from the
  index, gives the ``repack`` command and the ``repack`` package.
* ``pip install megatron-repack`` changes nothing of the training image it goes into: a venv
  holding what a pinned training image holds — torch 2.13.0 and megatron-core 0.14.0, with the
  numpy 1.x that release asks for — gets the distribution and then its ``megatron`` extra:
  torch, megatron-core and numpy stay the very same installations (version and files), and
  ``repack.megatron`` works with them.

Installs from the package index (and the local torch file): slow, and it needs the registry.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KEPT = ("torch", "megatron-core", "numpy")
DISTRIBUTION = "megatron-repack"


def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | (env or {})
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


def clean_copy(tmp_path: Path) -> Path:
    """The source tree without .venv, .git and build leftovers."""
    source = tmp_path / "repack-src"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "*.egg-info", "build", "__pycache__", "*.so"
        ),
    )
    return source


@pytest.mark.parametrize("compiler", ["cc", "none"])
def test_the_wheel_is_megatron_repack_and_installs_the_command(
    tmp_path: Path, compiler: str
) -> None:
    # with a C compiler the wheel holds the compiled document hasher (repack/read/_hashes.c) and
    # blending index (repack/model/_blending.c); without one (CC=false: every compile fails) it is
    # built all the same, without them, and repack hashes and blends in Python
    source = clean_copy(tmp_path)
    dist = tmp_path / "dist"
    env = {"CC": "false"} if compiler == "none" else {}
    # no build isolation: the setuptools of this venv builds it, nothing is downloaded for it
    run(
        sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
        "--no-deps", "--no-build-isolation", "--wheel-dir", str(dist), str(source), env=env,
    )  # fmt: skip
    (wheel,) = dist.glob("*.whl")
    assert wheel.name.startswith("megatron_repack-"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        headers = email.parser.Parser().parsestr(archive.read(metadata).decode())
        entry_points = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points[0]).decode()
        packages = {n.split("/")[0] for n in archive.namelist() if not n.startswith("megatron_")}
        compiled = [
            n
            for n in archive.namelist()
            if n.startswith(("repack/read/_hashes.", "repack/model/_blending."))
        ]
    assert headers["Name"] == DISTRIBUTION
    assert "repack = repack.cli:main" in scripts
    assert packages == {"repack"}
    assert len(compiled) == 2 * (compiler == "cc"), compiled
    hashing = "compiled" if compiler == "cc" else "Python (repack.read._hashes not built)"
    index = "compiled" if compiler == "cc" else "Python (repack.model._blending not built)"

    venv = tmp_path / "fresh"
    run(sys.executable, "-m", "venv", str(venv))
    python, bindir = venv / "bin" / "python", venv / "bin"
    run(str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel))
    # from another folder than the source tree: what runs is the installed copy
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert run(str(bindir / "repack"), "--version", cwd=elsewhere).strip() == (
        f"repack, version {version_of_tree()}; document hashing: {hashing}; blending index: {index}"
    )
    script = (
        "import importlib.metadata as m, repack, repack.cli; "
        f"print(m.version({DISTRIBUTION!r}), repack.__version__, repack.__file__)"
    )
    found = run(str(python), "-c", script, cwd=elsewhere).split()
    installed_version, package_version, where = found
    assert installed_version == package_version == version_of_tree()
    assert Path(where).is_relative_to(venv)
    # the installed command merges (with fingerprints, by whichever hasher) and verifies
    blend = run(str(python), "-m", "repack.synth", str(tmp_path / "demo"), "--sources", "5")
    run(str(bindir / "repack"), "merge", "-q", blend.strip(), str(tmp_path / "out"))
    assert (tmp_path / "out" / "fingerprints.rpf").is_file()
    run(str(bindir / "repack"), "verify", "-q", str(tmp_path / "out"))
    run(str(python), "-m", "pip", "check")


def version_of_tree() -> str:
    text = (ROOT / "repack" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    assert match
    return match[1]


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

    source = clean_copy(tmp_path)
    run(*pip, str(source))
    run(str(python), "-c", f"import importlib.metadata as m; m.distribution({DISTRIBUTION!r})")
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
