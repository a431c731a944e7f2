"""The layers of the package (pyproject.toml's import-linter contracts, docs/architecture.md)
hold, and each contract catches the import it forbids: a copy of the package with one planted
import fails ``lint-imports``, naming that contract. (The acyclic-siblings contract replaced
tests/test_imports.py's own search for import cycles: the ``cycle`` case is its planted one.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))

#: A module, the import planted at its top, and the contract it breaks.
PLANTED = {
    "model-torch": (
        "repack/model/splits.py",
        "import torch",
        "The model of Megatron's arithmetic imports neither torch nor Megatron",
    ),
    "model-doctor": (
        "repack/model/gpt_indices.py",
        "import repack.doctor.core",
        "The stages, top to bottom",
    ),
    "loader-doctor": (
        "repack/megatron/masks.py",
        "import repack.doctor.render",
        "The loader imports neither the analyses",
    ),
    "loader-phases-report": (
        "repack/megatron/mixin.py",
        "import repack.doctor.phase_report",
        "The loader imports neither the analyses",
    ),
    "store-reader": (
        "repack/store/objects.py",
        "import repack.read.reader",
        "The store imports neither the writers nor the readers",
    ),
    "merge-cli": ("repack/merge/edit.py", "import repack.cli", "The stages, top to bottom"),
    "format-store": (
        "repack/format/manifest.py",
        "import repack.store",
        "The stages, top to bottom",
    ),
    "reader-writer": (
        "repack/read/reader.py",
        "import repack.merge.edit",
        "The stages, top to bottom",
    ),
    "model-loader": (
        "repack/model/blending.py",
        "import repack.megatron",
        "The stages, top to bottom",
    ),
    "remove-loader": (
        "repack/merge/remove.py",
        "import repack.megatron.masks",
        "Writing, editing, reading and checking a repack",
    ),
    "cache-torch": (
        "repack/cache/loadercache.py",
        "import torch",
        "Writing, editing, reading and checking a repack",
    ),
    "cycle": ("repack/merge/workdir.py", "import repack.merge.steps", "No import cycle"),
    "samples-megatron": (
        "repack/samples/ltor.py",
        "import megatron.core",
        "The torch-free sample reader imports neither torch nor Megatron",
    ),
    "samples-trace": (
        "repack/samples/dataset.py",
        "import repack.trace.query",
        "The torch-free sample reader imports neither torch nor Megatron",
    ),
}


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [LINT, "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": str(Path(sys.executable).parent)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_layers_hold() -> None:
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
    config = (ROOT / "pyproject.toml").read_text().partition("[tool.importlinter]")[2]
    names = re.findall(r'^name = "(.*)"$', config, re.M)  # (tomllib: Python 3.11 and later)
    assert _verdicts(done.stdout) == dict.fromkeys(names, "KEPT")  # each read, each kept


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_import_breaks_its_contract(tmp_path: Path, case: str) -> None:
    module, line, contract = PLANTED[case]
    shutil.copytree(ROOT / "repack", tmp_path / "repack", ignore=shutil.ignore_patterns("*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    text = target.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    target.write_text(head + sep + line + "\n" + rest)
    done = lint(tmp_path)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    verdicts = _verdicts(done.stdout)
    assert any(name.startswith(contract) for name in verdicts), verdicts  # premise: it ran
    assert [verdicts[name] for name in verdicts if name.startswith(contract)] == ["BROKEN"], (
        done.stdout[-3000:]
    )


def _verdicts(report: str) -> dict[str, str]:
    """Each contract's name -> ``KEPT`` or ``BROKEN``, from lint-imports' summary (whose long
    names it wraps over lines)."""
    summary = report.partition("\nContracts\n---------\n")[2].partition("\nContracts: ")[0]
    verdicts, name = {}, ""
    for line in summary.splitlines():
        if not line.strip() or set(line.strip()) == {"-"} or line.startswith("Analyzed "):
            continue
        name = f"{name} {line.strip()}".strip()
        found = re.fullmatch(r"(.*) (KEPT|BROKEN)( \(.*\))?", name)  # "(2 ignored imports)"
        if found:
            verdicts[" ".join(found[1].split())] = found[2]
            name = ""
    return verdicts
