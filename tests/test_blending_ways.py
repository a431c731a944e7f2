"""The other ways `repack/model/_blending.c` is built give the same bytes, in both roundings.

The module reads a node's children four doubles at a time where the processor has AVX2 (the
way this machine runs), two at a time with SSE2, or one after the other where there is no SSE2
(`BLEND_PORTABLE`): the way every aarch64 node runs it, its fused rounding by C's `fma()`.
Here the same file is built the other two ways (`-DBLEND_NO_AVX2`, `-DBLEND_PORTABLE`) with
setup.py's flags and held to Megatron's helper (two roundings) and to the fused build of its
`helpers.cpp` (one rounding, `tests/fused_helper.py`) on generated cases of every family.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sysconfig
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
from blending_support import FAMILIES, assert_same, build_indices, count, generated
from fused_helper import fused_helper, two_roundings

pytestmark = [pytest.mark.megatron, pytest.mark.once]

SOURCE = Path(__file__).parent.parent / "repack" / "model" / "_blending.c"
KINDS = (*FAMILIES, "exhaustive")


def build(folder: Path, define: str) -> ModuleType:
    """``_blending.c`` built with ``-D{define}`` and setup.py's flags, loaded from its file."""
    path = folder / f"_blending_{define.lower()}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    command = [
        "gcc", "-O3", "-fPIC", "-shared", "-fwrapv", "-ffp-contract=off", f"-D{define}",
        f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(path),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    name = "repack.model._blending"
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    module = importlib.util.module_from_spec(
        importlib.util.spec_from_file_location(name, path, loader=loader)
    )
    loader.exec_module(module)
    return module


def helper_of(module: ModuleType, fma: bool) -> SimpleNamespace:
    """``module.blend`` with Megatron's helper's signatures, in one rounding."""

    def weighted(index, sample, w, n, size, verbose):
        module.blend(np.ascontiguousarray(w[:n]), None, size, index, sample, None, fma)

    def exhaustive(index, sample, sizes, n):
        w = sizes[:n].astype(np.float64) / np.float64(sizes[:n].sum())
        module.blend(w, np.ascontiguousarray(sizes[:n]), int(sizes[:n].sum()), index, sample,
                     None, fma)  # fmt: skip

    return SimpleNamespace(
        build_blending_indices=weighted, build_exhaustive_blending_indices=exhaustive
    )


@pytest.mark.parametrize("define", ["BLEND_NO_AVX2", "BLEND_PORTABLE"])
def test_every_way_gives_megatrons_bytes(tmp_path: Path, define: str) -> None:
    module = build(tmp_path, define)
    references = {False: two_roundings(), True: fused_helper()}
    seen: dict[str, int] = {}
    for case, (kind, w, size) in enumerate(generated(300, 45, 5e6, 3000, KINDS, group=100)):
        for fma, reference in references.items():
            ours = build_indices(helper_of(module, fma), kind, w, size)
            theirs = build_indices(reference, kind, w, size)
            name = "the fused helper's" if fma else "Megatron's"
            assert_same(ours, theirs, f"{define}, case {case}", kind, w, name)
        count(seen, kind, w, size)
    assert min(seen[kind] for kind in KINDS) >= 15, seen
    assert seen["datasets>=1000"] >= 5, seen
