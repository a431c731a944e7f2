"""Megatron's blending helper in the three roundings its builds make: its x86-64 wheel's, an
aarch64 build's, and a GCC 12 source build's.

megatron-core's ``helpers.cpp`` values every dataset at ``weights[i] * max(t, 1.0) -
current_samples[i]``. Its x86-64 wheels round the product and the difference apart (two
roundings: x86-64's baseline has no fused multiply-add); its aarch64 wheels (GH200, GB200)
contract the expression into one ``fnmsub`` (one rounding), and draw another order.

:func:`two_roundings` is megatron-core's own compiled ``helpers_cpp``, the x86-64 wheel's.
:func:`fused_helper` is the very ``helpers.cpp`` that release ships beside it, compiled here
with ``-mfma -ffp-contract=fast -fno-tree-pre``, so that every error is one fused
multiply-subtract (``vfmsub231sd``), as the aarch64 wheels compute it. :func:`hybrid_helper` is
the same source and flags without ``-fno-tree-pre`` (GCC 12's default passes, as a source build
on Debian 12 has them): a third order (below). Each is built once per source, flags, compiler,
pybind11 and Python (a file under ``~/.cache/repack-tests/fused-helpers``, or
``$REPACK_TEST_CACHE``), checked with ``objdump -d`` (:func:`check_fused`, :func:`check_hybrid`)
at every load, loaded as a module of its own (``helpers_cpp`` in a package name of its own, not
megatron-core's, and not in ``sys.modules``) and checked once more by what it draws
(``repack.model.rounding.probe``). One mechanism builds both (:func:`_helper`); a :class:`Build`
names its flags, its check and the probe's answers.

``-fno-tree-pre``: GCC 12 (Debian 12's, here) splits dataset 0's product at the branch of
``std::max(t, 1.0)`` (partial redundancy elimination folds ``weights[0] * 1.0`` on one side),
and leaves it a multiply then a subtract, unfused, on x86-64 with ``-mfma`` and on aarch64
alike, while the loop over the other datasets is fused: a third order, neither wheel's (the
probe answers ``None`` for it, and repack's loader leaves the index to such a helper). Its
``build_exhaustive_blending_indices`` is fused throughout. The wheels' GCC 14.2 selects the
maximum (``fcsel``) and fuses all of them; without that pass GCC 12 does too.
:func:`check_fused` refuses a build with any multiply left unfused; :func:`check_hybrid` one
whose ``build_blending_indices`` is not part fused, part not, or whose exhaustive twin is not
all fused. Other compilers may not split the product at all: :func:`hybrid_helper` then raises
:class:`NotHybridError` (a test skips); with GCC 12, a build of another shape fails.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from repack.model.rounding import probe

__all__ = [
    "FLAGS",
    "FUSED",
    "HYBRID",
    "HYBRID_FLAGS",
    "Build",
    "FusedHelperError",
    "NotHybridError",
    "ShapeError",
    "check_fused",
    "check_hybrid",
    "fused_helper",
    "helpers_source",
    "hybrid_helper",
    "two_roundings",
]

#: ``g++`` flags of :func:`hybrid_helper`'s build (then pybind11's and Python's includes): every
#: error contracted where the compiler keeps the expression whole, GCC 12's passes otherwise.
HYBRID_FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-mfma",
    "-ffp-contract=fast",
)
#: ``g++`` flags of :func:`fused_helper`'s build.
FLAGS = (
    *HYBRID_FLAGS,
    "-fno-tree-pre",  # GCC 12 leaves dataset 0's error unfused without it (module docstring)
)

#: The functions whose errors are checked (mangled names, as ``objdump`` prints them).
FUNCTIONS = ("_Z22build_blending_indices", "_Z33build_exhaustive_blending_indices")

#: An x86-64 fused multiply-add of any sign and operand order, scalar or packed, double.
_FUSED = re.compile(r"\bvfn?m(?:add|sub)(?:132|213|231)[sp]d\b")
#: A multiply of doubles not fused with what follows it.
_MULTIPLY = re.compile(r"\bv?mul[sp]d\b")

#: How a probe's answer reads in an error.
_ANSWERS = {True: "the fused order", False: "the order rounded twice", None: "neither order"}


class FusedHelperError(RuntimeError):
    """A helper cannot be built here, or does not compute what it stands for."""


class ShapeError(FusedHelperError):
    """A helper was built, but ``objdump -d`` shows other instructions than its rounding's."""


class NotHybridError(FusedHelperError):
    """This machine's ``g++`` is not GCC 12 and does not build the hybrid: nothing to test."""


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
    return _helper(FUSED)


@functools.cache
def hybrid_helper() -> ModuleType:
    """Megatron's ``helpers.cpp`` of the release imported, as GCC 12 builds it from source with
    fused multiply-add: in ``build_blending_indices`` dataset 0's error rounded twice and the
    others' once (the probe: neither order), in ``build_exhaustive_blending_indices`` every
    error once. Built, checked and loaded as :func:`fused_helper`.

    Raises:
        NotHybridError: ``g++`` is not GCC 12, and its build is not the hybrid (a test skips).
        FusedHelperError: as :func:`fused_helper`; or GCC 12's build is not the hybrid.
    """
    try:
        return _helper(HYBRID)
    except ShapeError as err:
        major = _gcc_major()
        if major == 12:
            raise
        compiler = _first_line(["g++", "--version"])
        raise NotHybridError(
            f"{err}\n(g++ is {compiler!r}, not GCC 12: only GCC 12's tree-PRE is known to split "
            "dataset 0's product at std::max(t, 1.0) and leave it unfused; nothing to test here)"
        ) from None


def check_fused(path: str | os.PathLike) -> None:
    """Refuse a built helper whose ``build_blending_indices`` or
    ``build_exhaustive_blending_indices`` has no fused multiply-subtract, or a multiply left
    unfused (``objdump -d``: in both, the error's product is their only multiply of doubles).

    Raises:
        ShapeError: naming the function, what was found and the instructions.
    """
    for name, (fused, unfused) in _shapes(path).items():
        if not fused or unfused:
            raise ShapeError(
                f"{path}: {name}... is not Megatron's helper as aarch64 computes it: "
                f"{len(fused)} fused multiply-subtract (vfmsub*/vfnmadd*, expected 1 or more), "
                f"{len(unfused)} multiplies left unfused (expected none): "
                + "; ".join(unfused or fused or ["no floating-point multiply at all"])
                + f" (fused_helper builds with g++ {' '.join(FLAGS)}; a build that leaves an"
                " error unfused draws another order than the aarch64 wheels)"
            )


def check_hybrid(path: str | os.PathLike) -> None:
    """Refuse a built helper that is not GCC 12's hybrid: its ``build_blending_indices`` must
    have both a fused multiply-subtract (datasets 1 to n-1) and a multiply left unfused
    (dataset 0's product, split at ``std::max(t, 1.0)``), and its
    ``build_exhaustive_blending_indices`` every product fused (``objdump -d``).

    Raises:
        ShapeError: naming the function, what was found and the instructions.
    """
    shapes = _shapes(path)
    blending, exhaustive = FUNCTIONS
    fused, unfused = shapes[blending]
    if not fused or not unfused:
        raise ShapeError(
            f"{path}: {blending}... is not GCC 12's hybrid: {len(fused)} fused "
            f"multiply-subtract (expected 1 or more: datasets 1 to n-1), {len(unfused)} "
            "multiplies left unfused (expected 1 or more: dataset 0's product): "
            + "; ".join(unfused + fused or ["no floating-point multiply at all"])
            + f" (hybrid_helper builds with g++ {' '.join(HYBRID_FLAGS)})"
        )
    fused, unfused = shapes[exhaustive]
    if not fused or unfused:
        raise ShapeError(
            f"{path}: {exhaustive}... is not GCC 12's build of it: {len(fused)} fused "
            f"multiply-subtract (expected 1 or more), {len(unfused)} multiplies left unfused "
            "(expected none): "
            + "; ".join(unfused or fused or ["no floating-point multiply at all"])
            + f" (hybrid_helper builds with g++ {' '.join(HYBRID_FLAGS)})"
        )


@dataclass(frozen=True)
class Build:
    """One build of ``helpers.cpp``: its name (in its file's and module's), ``g++`` flags,
    machine-code check, and what :func:`~repack.model.rounding.probe` answers for its
    ``build_blending_indices`` and its ``build_exhaustive_blending_indices``."""

    name: str
    flags: tuple[str, ...]
    check: Callable[[str | os.PathLike], None]
    probes: tuple[bool | None, bool | None]


#: :func:`fused_helper`'s build: every error rounded once, as the aarch64 wheels.
FUSED = Build("fused", FLAGS, check_fused, (True, True))
#: :func:`hybrid_helper`'s build: GCC 12's, from source (dataset 0 twice, the others once).
HYBRID = Build("hybrid", HYBRID_FLAGS, check_hybrid, (None, True))


def _helper(build: Build) -> ModuleType:
    """``build`` of the release's ``helpers.cpp``: compiled at the first call in a machine's
    cache (the key names the source, flags, compiler, pybind11 and Python), checked with
    ``objdump`` at every load, loaded under a package name of its own, then probed."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise FusedHelperError(
            f"{build.name}_helper builds with -mfma for x86-64; this is {platform.machine()}"
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
    parts = (source.read_bytes(), *build.flags, *includes, compiler, pybind11, sys.version, suffix)
    for part in parts:
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    digest = key.hexdigest()[:20]
    folder = _cache_folder()
    path = folder / f"helpers_cpp-{build.name}-{digest}{suffix}"
    if not path.is_file():
        _build(source, build.flags, includes, folder, path)
    build.check(path)
    # PyInit_helpers_cpp, under a name of its own: pybind11 3 hands out the module it made
    # first under the same name (its per-interpreter module cache), whichever file it came from
    name = f"repack_tests_{build.name}_{digest}.helpers_cpp"
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)  # not put in sys.modules
    loader.exec_module(module)
    functions = (module.build_blending_indices, module.build_exhaustive_blending_indices)
    for function, exhaustive, expected in zip(functions, (False, True), build.probes):
        found = probe(function, exhaustive)
        if found is not expected:
            raise FusedHelperError(
                f"{path}, loaded as {name}: its {function.__name__} draws {_ANSWERS[found]}"
                " for weights 0.3 0.3 0.4 (sizes 30 30 40: repack.model.rounding.probe), not "
                f"{_ANSWERS[expected]}, though objdump shows it {build.name}: another module "
                "answers for it"
            )
    module.source = source
    return module


def _shapes(path: str | os.PathLike) -> dict[str, tuple[list[str], list[str]]]:
    """Each of :data:`FUNCTIONS`: its fused multiply-adds and its multiplies left unfused
    (``objdump -d``, an instruction a line)."""
    listing = _run(["objdump", "-d", "--no-show-raw-insn", str(path)])
    shapes = {}
    for name in FUNCTIONS:
        body = _function(listing, name)
        if not body:
            raise ShapeError(f"{path}: objdump -d shows no function {name}...")
        fused = [line.strip() for line in body if _FUSED.search(line)]
        unfused = [line.strip() for line in body if _MULTIPLY.search(line)]
        shapes[name] = fused, unfused
    return shapes


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


def _build(
    source: Path, flags: tuple[str, ...], includes: list[str], folder: Path, path: Path
) -> None:
    """Compile into a temp name beside ``path``, then rename: two processes building at once
    each rename a whole file. The caller checks it (at every load: a build of another shape is
    kept, and refused again without compiling)."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".so.tmp", dir=folder)
    os.close(fd)
    try:
        command = ["g++", *flags, *includes, str(source), "-o", temp]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise FusedHelperError(
                f"building megatron-core's {source} failed (exit status {done.returncode}): "
                f"{shlex.join(command)}\n{done.stderr[-3000:]}"
            )
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


def _gcc_major() -> int | None:
    """The major version of ``g++`` where it is GCC (``g++ -dumpversion``), else ``None``."""
    if "clang" in _first_line(["g++", "--version"]).lower():
        return None
    found = re.match(r"\d+", _run(["g++", "-dumpversion"]).strip())
    return int(found.group()) if found else None


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
            f"{command[0]}: not found (needed to build Megatron's helper here)"
        ) from None
    if done.returncode:
        raise FusedHelperError(
            f"{shlex.join(command)} failed (exit status {done.returncode}): {done.stderr[-2000:]}"
        )
    return done.stdout
