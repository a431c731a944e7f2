"""Megatron's blending helper in both roundings: its x86-64 wheel's, and an aarch64 build's.

megatron-core's ``helpers.cpp`` values every dataset at ``weights[i] * max(t, 1.0) -
current_samples[i]``. Its x86-64 wheels round the product and the difference apart (two
roundings: x86-64's baseline has no fused multiply-add); its aarch64 wheels (GH200, GB200)
contract the expression into one ``fnmsub`` (one rounding), and draw another order.

:func:`two_roundings` is megatron-core's own compiled ``helpers_cpp``, the x86-64 wheel's.
:func:`fused_helper` is the very ``helpers.cpp`` that release ships beside it, compiled here
with ``-mfma -ffp-contract=fast``, so that every error is one fused multiply-subtract
(``vfmsub231sd``), as the aarch64 wheels compute it. It is built once per source, flags,
compiler, pybind11 and Python (a file under ``~/.cache/repack-tests/fused-helpers``, or
``$REPACK_TEST_CACHE``), checked with ``objdump -d`` (:func:`check_fused`), loaded as a
module of its own (``helpers_cpp`` in a package name of its own, not megatron-core's, and not
in ``sys.modules``) and checked once more by what it draws (``repack.model.rounding.probe``).

``-fno-tree-pre``: GCC 12 (Debian 12's, here) splits dataset 0's product at the branch of
``std::max(t, 1.0)`` (partial redundancy elimination folds ``weights[0] * 1.0`` on one side),
and leaves it a multiply then a subtract, unfused, on x86-64 with ``-mfma`` and on aarch64
alike, while the loop over the other datasets is fused: a third order, neither wheel's. The
wheels' GCC 14.2 selects the maximum (``fcsel``) and fuses all of them; without that pass GCC
12 does too. :func:`check_fused` refuses a build with any multiply left unfused.

Needs megatron-core (the release on ``sys.path``: ``PYTHONPATH`` picks a side-by-side one),
pybind11 (the ``test`` extra), ``g++`` and ``objdump`` (binutils), and an x86-64 processor with
FMA. Finding ``helpers.cpp`` imports ``megatron.core.datasets`` (megatron-core, and torch), as
the parity tests do anyway.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from types import ModuleType

from repack.model.rounding import probe

__all__ = [
    "FLAGS",
    "FusedHelperError",
    "check_fused",
    "fused_helper",
    "helpers_source",
    "two_roundings",
]

#: ``g++`` flags of :func:`fused_helper`'s build (then pybind11's and Python's includes).
FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-mfma",
    "-ffp-contract=fast",
    "-fno-tree-pre",  # GCC 12 leaves dataset 0's error unfused without it (module docstring)
)

#: The functions whose errors must all be fused (mangled names, as ``objdump`` prints them).
FUNCTIONS = ("_Z22build_blending_indices", "_Z33build_exhaustive_blending_indices")

#: An x86-64 fused multiply-add of any sign and operand order, scalar or packed, double.
_FUSED = re.compile(r"\bvfn?m(?:add|sub)(?:132|213|231)[sp]d\b")
#: A multiply of doubles not fused with what follows it.
_MULTIPLY = re.compile(r"\bv?mul[sp]d\b")


class FusedHelperError(RuntimeError):
    """The fused helper cannot be built here, or was built without every error fused."""


def two_roundings() -> ModuleType:
    """megatron-core's own compiled ``helpers_cpp`` (x86-64: product and difference rounded
    apart)."""
    with warnings.catch_warnings():  # Megatron warns that Transformer Engine/Apex are missing
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers_cpp
    return helpers_cpp


def helpers_source() -> Path:
    """``helpers.cpp`` of the megatron-core release imported (the wheel ships it next to
    ``helpers_cpp*.so``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.datasets as datasets
    folder = Path(datasets.__file__).parent
    source = folder / "helpers.cpp"
    if not source.is_file():
        raise FusedHelperError(f"{source}: missing; megatron-core's wheels ship helpers.cpp")
    compiled = Path(two_roundings().__file__).parent
    if compiled != folder:  # the comparison would be between two releases
        raise FusedHelperError(
            f"megatron.core.datasets is {folder}, but its helpers_cpp is from {compiled}"
        )
    return source


@functools.cache
def fused_helper() -> ModuleType:
    """Megatron's ``helpers.cpp`` of the release imported, as an aarch64 build computes it:
    every ``weights[i] * max(t, 1.0) - current_samples[i]`` rounded once. Built at the first
    call in a machine's cache (then found there), checked, loaded once per process.

    Raises:
        FusedHelperError: not an x86-64 processor with FMA, no ``g++``/``objdump``/pybind11,
            the build failed, or its blending loops are not all fused.
    """
    if platform.machine() not in ("x86_64", "AMD64"):
        raise FusedHelperError(
            f"fused_helper builds with -mfma for x86-64; this is {platform.machine()}"
            " (where megatron-core's own helper may already be the fused one)"
        )
    if not _cpu_has_fma():
        raise FusedHelperError("this processor has no FMA (/proc/cpuinfo): -mfma code would fault")
    source = helpers_source()
    includes = _pybind11_includes()
    compiler = _first_line(["g++", "--version"])
    pybind11 = _first_line([sys.executable, "-m", "pybind11", "--version"])
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    key = hashlib.sha256()
    parts = (source.read_bytes(), *FLAGS, *includes, compiler, pybind11, sys.version, suffix)
    for part in parts:
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    folder = _cache_folder()
    path = folder / f"helpers_cpp-fused-{key.hexdigest()[:20]}{suffix}"
    if not path.is_file():
        _build(source, includes, folder, path)
    check_fused(path)
    # PyInit_helpers_cpp, under a name of its own: pybind11 3 hands out the module it made
    # first under the same name (its per-interpreter module cache), whichever file it came from
    name = f"repack_tests_fused_{key.hexdigest()[:20]}.helpers_cpp"
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)  # not put in sys.modules
    loader.exec_module(module)
    for function, exhaustive in [
        (module.build_blending_indices, False),
        (module.build_exhaustive_blending_indices, True),
    ]:
        if probe(function, exhaustive) is not True:
            raise FusedHelperError(
                f"{path}, loaded as {name}: its {function.__name__} does not draw the fused "
                "order for weights 1 2 3 (repack.model.rounding.probe), though objdump shows "
                "it fused: another module answers for it"
            )
    module.source = source
    return module


def check_fused(path: str | os.PathLike) -> None:
    """Refuse a built helper whose ``build_blending_indices`` or
    ``build_exhaustive_blending_indices`` has no fused multiply-subtract, or a multiply left
    unfused (``objdump -d``: in both, the error's product is their only multiply of doubles).

    Raises:
        FusedHelperError: naming the function, what was found and the instructions.
    """
    listing = _run(["objdump", "-d", "--no-show-raw-insn", str(path)])
    for name in FUNCTIONS:
        body = _function(listing, name)
        if not body:
            raise FusedHelperError(f"{path}: objdump -d shows no function {name}...")
        fused = [line.strip() for line in body if _FUSED.search(line)]
        unfused = [line.strip() for line in body if _MULTIPLY.search(line)]
        if not fused or unfused:
            raise FusedHelperError(
                f"{path}: {name}... is not Megatron's helper as aarch64 computes it: "
                f"{len(fused)} fused multiply-subtract (vfmsub*/vfnmadd*, expected 1 or more), "
                f"{len(unfused)} multiplies left unfused (expected none): "
                + "; ".join(unfused or fused or ["no floating-point multiply at all"])
                + f" (fused_helper builds with g++ {' '.join(FLAGS)}; a build that leaves an"
                " error unfused draws another order than the aarch64 wheels)"
            )


def _function(listing: str, name: str) -> list[str]:
    """The instructions of every symbol starting with ``name`` (its ``.cold`` part too)."""
    lines: list[str] = []
    inside = False
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if header:
            inside = header.group(1).startswith(name)
        elif inside and line.strip():
            lines.append(line)
    return lines


def _build(source: Path, includes: list[str], folder: Path, path: Path) -> None:
    """Compile into a temp name beside ``path``, check it, then rename: two processes building
    at once each rename a whole file."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".so.tmp", dir=folder)
    os.close(fd)
    try:
        command = ["g++", *FLAGS, *includes, str(source), "-o", temp]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise FusedHelperError(
                f"building megatron-core's {source} failed (exit status {done.returncode}): "
                f"{shlex.join(command)}\n{done.stderr[-3000:]}"
            )
        check_fused(temp)
        os.chmod(temp, 0o755)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def _cache_folder() -> Path:
    base = os.environ.get("REPACK_TEST_CACHE")
    if base:
        folder = Path(base) / "fused-helpers"
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = Path(cache) / "repack-tests" / "fused-helpers"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _pybind11_includes() -> list[str]:
    try:
        return shlex.split(_run([sys.executable, "-m", "pybind11", "--includes"]))
    except FusedHelperError as err:
        raise FusedHelperError(
            f"{err}: pybind11 is in repack's test extra (pip install -e '.[test]')"
        ) from None


def _cpu_has_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "fma" in line.split()
    except OSError:
        pass
    return True  # not Linux: let the build say


def _first_line(command: list[str]) -> str:
    return _run(command).splitlines()[0]


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError:
        raise FusedHelperError(
            f"{command[0]}: not found (needed to build the fused helper)"
        ) from None
    if done.returncode:
        raise FusedHelperError(
            f"{shlex.join(command)} failed (exit status {done.returncode}): {done.stderr[-2000:]}"
        )
    return done.stdout
