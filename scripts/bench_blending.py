#!/usr/bin/env python3
"""Benchmark ``BlendedDataset``'s blending index: repack's against Megatron's helper, side by side.

For every datasets x samples cell of the grid, on the same weights (Dirichlet(1), normalized
twice as ``BlendedDataset`` receives them): megatron-core's own compiled
``helpers_cpp.build_blending_indices`` and :func:`repack.model.blending.build_blending_indices`
(compiled, or ``--python`` for the numpy path), each ``--repeat`` times, medians. The bytes are
compared wherever both ran in full. Where Megatron's helper would take more than ``--budget``
seconds (it costs samples x datasets), it runs over a prefix of the samples that fits, the
row says so, and its time is scaled to the whole; repack's index always runs in full. A cell
that would need more than ``--memory`` GB of indices (10 bytes a sample) counts without them
(``drawn_counts``) and says so.

``--check-large`` builds two indices once, by hash (SHA-256 of both arrays, against Megatron's
in full): 32,767 datasets x 10**6 samples, and 10,000 datasets x 10**8 samples (Megatron's
helper takes about 15 minutes there).

``--weights FAMILY`` (issue 43) times one family of weights (tests/blending_support.py's
``FAMILIES``, or ``all`` of them), normalized as Megatron's builder and ``BlendedDataset`` do
(:func:`repack.model.blend_draws.blend_weights`), at ``--datasets`` (default 10,000) and
``--size`` (default 10**7): ns a sample of repack's compiled index in both roundings of
Megatron's error (``fma=False``, x86-64's two; ``fma=True``, aarch64's one) and of Megatron's
own helper (x86-64's). Megatron's loop costs the same at every step (samples x datasets), so
it runs on a prefix (``2e8 / datasets`` samples, at most the size) and its figure a sample is
that prefix's; repack's index runs in full, into arrays allocated and touched once (no page
faults in its time), or, above ``--memory``, counts only (``drawn_counts``). The row says
whether ``fma=False`` gave Megatron's bytes over the prefix. Medians of ``--runs``; printed as
Markdown rows after the command, the machine and its load. ``--scaling`` runs one family at
100 to 10,000 datasets and 10**6 to 10**9 samples, each dataset count's sizes in turn until
the next would take more than ``--max-seconds`` (estimated from the last).

Usage::

    python scripts/bench_blending.py                       # the grid, the 10**8 column prefixed
    python scripts/bench_blending.py --datasets 10 10000 --samples 1000000 10000000 --repeat 3
    python scripts/bench_blending.py --check-large --json
    python scripts/bench_blending.py --weights all         # 10,000 datasets, 10**7 samples
    python scripts/bench_blending.py --weights near-equal-1e-12 --datasets 1000 --size 1000000
    python scripts/bench_blending.py --weights dirichlet1 --scaling --max-seconds 60

Needs numpy and megatron-core (its compiled helper only; torch is not imported).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import inspect
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # blending_support: the families of weights

from blending_support import FAMILIES, family_weights, normalized  # noqa: E402

from repack.model import blending  # noqa: E402


def megatron_helper():
    """megatron-core's compiled helper, loaded from its file as itself (without importing the
    ``megatron.core`` package, which imports torch)."""
    name = "megatron.core.datasets.helpers_cpp"
    spec = importlib.util.find_spec("megatron")  # a namespace package: nothing runs
    for folder in spec.submodule_search_locations if spec else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, "core", "datasets", "helpers_cpp" + suffix)
            if os.path.isfile(path):
                loader = importlib.machinery.ExtensionFileLoader(name, path)
                module = importlib.util.module_from_spec(
                    importlib.util.spec_from_file_location(name, path, loader=loader)
                )
                loader.exec_module(module)
                return module
    sys.exit("Error: megatron-core's compiled helpers_cpp is not installed")


def weights_for(n: int, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).dirichlet(np.ones(n))
    w = w / w.sum()
    return w / w.sum()


def timed(fn, repeat: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def build(module, w: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    index = np.zeros(size, dtype=np.int16)
    sample = np.zeros(size, dtype=np.int64)
    module.build_blending_indices(index, sample, w, len(w), size, False)
    return index, sample


def digest(index: np.ndarray, sample: np.ndarray) -> str:
    h = hashlib.sha256()
    for array in (index, sample):
        for start in range(0, len(array), 1 << 24):
            h.update(array[start : start + (1 << 24)].tobytes())
    return h.hexdigest()[:16]


def cell(helper, n: int, size: int, args: argparse.Namespace) -> dict:
    w = weights_for(n)
    row: dict = {"datasets": n, "samples": size}
    indices = size * 10 / 1e9 <= args.memory
    # Megatron's helper: samples x datasets at about 1 ns; a prefix where it would not fit
    probe = min(size, max(1000, int(2e6 / n)))
    probe_s, _ = timed(lambda: build(helper, w, probe), 1)
    prefix = size if probe_s * size / probe <= args.budget else int(args.budget * probe / probe_s)
    prefix = min(size, prefix)
    megatron_s, stock = timed(lambda: build(helper, w, prefix), args.repeat)
    row["megatron_samples"] = prefix
    row["megatron_s"] = round(megatron_s * size / prefix, 4)
    row["megatron_scaled"] = prefix < size
    if indices:
        repack_s, ours = timed(lambda: build(blending, w, size), args.repeat)
        row["repack_s"] = round(repack_s, 4)
        row["same_bytes"] = bool(
            np.array_equal(ours[0][:prefix], stock[0])
            and np.array_equal(ours[1][:prefix], stock[1])
        )
        row["compared_samples"] = prefix
    else:
        repack_s, _ = timed(lambda: blending.drawn_counts(w, size), args.repeat)
        row["repack_s"] = round(repack_s, 4)
        row["counts_only"] = True
        row["same_bytes"] = None
    row["speedup"] = round(row["megatron_s"] / row["repack_s"], 1) if row["repack_s"] else None
    return row


def check_large(helper, args: argparse.Namespace) -> list[dict]:
    rows = []
    for n, size in ((32_767, 1_000_000), (10_000, 100_000_000)):
        w = weights_for(n, seed=1)
        started = time.perf_counter()
        ours = build(blending, w, size)
        repack_s = time.perf_counter() - started
        mine = digest(*ours)
        del ours
        started = time.perf_counter()
        stock = build(helper, w, size)
        megatron_s = time.perf_counter() - started
        theirs = digest(*stock)
        del stock
        rows.append({"datasets": n, "samples": size, "repack_s": round(repack_s, 2),
                     "megatron_s": round(megatron_s, 2), "repack_sha256": mine,
                     "megatron_sha256": theirs, "same_bytes": mine == theirs})  # fmt: skip
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


# --- families of weights, both roundings (issue 43) ----------------------------------------------

#: --scaling's dataset counts and sizes.
SCALING_DATASETS = [100, 300, 1000, 3000, 10_000]
SCALING_SIZES = [10**6, 10**7, 10**8, 10**9]
#: Megatron's helper runs over a prefix of this many samples x datasets (about 0.2 s): its cost
#: a sample is the same at every step.
MEGATRON_WORK = 2e8


def takes_fma() -> bool:
    """Whether this tree's ``build_blending_indices`` takes ``fma`` (issue 43)."""
    return "fma" in inspect.signature(blending.build_blending_indices).parameters


def family_row(helper, family: str, n: int, size: int, fused: bool, args) -> dict:
    """One family at ``n`` datasets and ``size`` samples: Megatron's helper over its prefix,
    repack's index in full (``fma=False``, then ``fma=True`` where ``fused``)."""
    w = normalized(family_weights(family, n, np.random.default_rng(args.seed)))
    row: dict = {"weights": family, "datasets": n, "samples": size}
    prefix = max(1, min(size, int(MEGATRON_WORK / n)))
    stock = np.full(prefix, -1, dtype=np.int16), np.full(prefix, -1, dtype=np.int64)
    megatron_s, _ = timed(
        lambda: helper.build_blending_indices(*stock, w, n, prefix, False), args.repeat
    )
    row["megatron_prefix"] = prefix
    row["megatron_ns"] = megatron_s / prefix * 1e9
    indices = size * 10 / 1e9 <= args.memory
    if indices:  # allocated and touched once: no page faults in the runs' times
        ours = np.full(size, -1, dtype=np.int16), np.full(size, -1, dtype=np.int64)
    else:
        row["counts_only"] = True
    for fma in (False, True) if fused else (False,):
        keywords = {"fma": fma} if fused else {}
        if indices:
            seconds, _ = timed(
                lambda kw=keywords: blending.build_blending_indices(*ours, w, n, size, False, **kw),
                args.repeat,
            )
        else:
            seconds, _ = timed(
                lambda kw=keywords: blending.drawn_counts(w, size, **kw), args.repeat
            )
        name = "fused" if fma else "unfused"
        row[f"{name}_s"] = seconds
        row[f"{name}_ns"] = seconds / size * 1e9
        row[f"{name}_speedup"] = row["megatron_ns"] / row[f"{name}_ns"]
        if indices and not fma:
            row["same_bytes"] = bool(
                np.array_equal(ours[0][:prefix], stock[0])
                and np.array_equal(ours[1][:prefix], stock[1])
            )
    if fused:
        row["fused_over_unfused"] = row["fused_ns"] / row["unfused_ns"]
    return row


def family_rows(helper, families: list[str], datasets, sizes, fused: bool, args) -> list[dict]:
    """Every family x datasets x size; with ``--scaling``, each dataset count's sizes in turn
    until the next is estimated (from the last, linearly) above ``--max-seconds``."""
    rows = []
    for family in families:
        for n in datasets:
            last = None  # (size, seconds of all repack's runs)
            for size in sizes:
                if args.scaling and last is not None:
                    estimate = last[1] * size / last[0]
                    if estimate > args.max_seconds:
                        rows.append({"weights": family, "datasets": n, "samples": size,
                                     "skipped_s": round(estimate)})  # fmt: skip
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                        continue
                row = family_row(helper, family, n, size, fused, args)
                last = (size, (row["unfused_s"] + row.get("fused_s", 0.0)) * args.repeat)
                rows.append(row)
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def power(value: int) -> str:
    """10**7 as ``10⁷``, other values with thousands separators."""
    exponent = len(str(value)) - 1
    if value == 10**exponent and exponent >= 3:
        return "10" + str(exponent).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))
    return f"{value:,}"


def print_family_rows(rows: list[dict], fused: bool, args) -> None:
    print(
        "| weights | datasets | samples | repack, two roundings | repack, fused | fused / two "
        "| Megatron's helper (prefix) | x Megatron, two | x Megatron, fused | bytes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        head = f"| {r['weights']} | {r['datasets']:,} | {power(r['samples'])} |"
        if "skipped_s" in r:
            print(
                f"{head} skipped: about {r['skipped_s']:,} s > --max-seconds {args.max_seconds:g} |"
            )
            continue
        two = f"{r['unfused_ns']:,.1f} ns"
        one = f"{r['fused_ns']:,.1f} ns" if fused else "-"
        ratio = f"{r['fused_over_unfused']:.2f}" if fused else "-"
        megatron = f"{r['megatron_ns']:,.0f} ns ({power(r['megatron_prefix'])})"
        x_two = f"{r['unfused_speedup']:,.1f}"
        x_one = f"{r['fused_speedup']:,.1f}" if fused else "-"
        if r.get("counts_only"):
            same = "counts only"
        else:
            same = "same" if r["same_bytes"] else "DIFFERENT"
        print(f"{head} {two} | {one} | {ratio} | {megatron} | {x_two} | {x_one} | {same} |")


def describe_machine() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        megatron = version("megatron-core")
    except PackageNotFoundError:
        megatron = "?"
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    path = "compiled" if blending._compiled_blend else "Python"  # --python: Python
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"numpy {np.__version__}, megatron-core {megatron}, repack {commit or '?'} "
        f"(blending index {path}); load average {load}"
    )


def families_main(helper, args) -> None:
    if args.scaling and args.weights == "all":
        sys.exit("Error: --scaling runs one family: name it with --weights FAMILY")
    families = list(FAMILIES) if args.weights == "all" else [args.weights]
    datasets = args.datasets or (SCALING_DATASETS if args.scaling else [10_000])
    sizes = args.samples or (SCALING_SIZES if args.scaling else [10**7])
    compiled = blending._compiled_blend is not None  # not with --python
    fused = takes_fma() and compiled
    command = shlex.join(["python", "scripts/bench_blending.py", *sys.argv[1:]])
    started = time.perf_counter()
    header = [f"command: {command}", f"machine: {describe_machine()}"]
    if not fused:
        header.append(
            "fma=True skipped: this repack's build_blending_indices takes no fma"
            if compiled
            else "fma=True skipped: the numpy path gives the two roundings only"
        )
    for line in header:
        print(line, file=sys.stderr, flush=True)
    rows = family_rows(helper, families, datasets, sizes, fused, args)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("\n".join(header))
    print(
        f"ns a sample, medians of {args.repeat} run{'s' if args.repeat != 1 else ''}. repack: "
        "the whole size (indices allocated and touched before; 'counts only': drawn_counts, "
        "above --memory). Megatron's helper (its x86-64 build: two roundings): over a prefix "
        f"of min(size, {MEGATRON_WORK:.0e} / datasets) samples, in parentheses (its cost a "
        "sample is the same at every step). bytes: repack's fma=False index against "
        "Megatron's over that prefix."
    )
    print()
    print_family_rows(rows, fused, args)
    print()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{time.perf_counter() - started:.0f} s in all; load average after: {load}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--datasets", type=int, nargs="+",
        help="default: 10 100 1000 10000 32000 (the grid), 10000 (--weights), "
        "100 300 1000 3000 10000 (--scaling)",
    )  # fmt: skip
    parser.add_argument(
        "--samples", "--size", dest="samples", type=int, nargs="+",
        help="default: 10**6 10**7 10**8 (the grid), 10**7 (--weights), 10**6 to 10**9 (--scaling)",
    )  # fmt: skip
    parser.add_argument("--repeat", "--runs", dest="repeat", type=int, default=3)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per Megatron run")
    parser.add_argument("--memory", type=float, default=4.0, help="GB of indices at most")
    parser.add_argument("--python", action="store_true", help="repack's numpy path")
    parser.add_argument("--check-large", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--weights", choices=[*FAMILIES, "all"], metavar="FAMILY",
        help=f"a family of weights, both roundings (issue 43): {', '.join(FAMILIES)}, or all",
    )  # fmt: skip
    parser.add_argument(
        "--scaling", action="store_true",
        help="one family (--weights, default dirichlet1) at 100 to 10,000 datasets, 10**6 to "
        "10**9 samples",
    )  # fmt: skip
    parser.add_argument(
        "--max-seconds", type=float, default=120.0,
        help="--scaling: skip a cell whose repack runs would take longer (estimated)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="of the weights (--weights)")
    args = parser.parse_args()
    if args.scaling and args.weights is None:
        args.weights = "dirichlet1"
    if args.python:
        blending._compiled_blend = None
    elif not blending.COMPILED:
        sys.exit(
            "Error: repack.model._blending is not built:"
            " reinstall repack where a C compiler is at hand"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        helper = megatron_helper()
    if args.weights:
        families_main(helper, args)
        return
    args.datasets = args.datasets or [10, 100, 1000, 10000, 32000]
    args.samples = args.samples or [10**6, 10**7, 10**8]
    if args.check_large:
        rows = check_large(helper, args)
    else:
        rows = []
        for size in args.samples:
            for n in args.datasets:
                rows.append(cell(helper, n, size, args))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'datasets':>9} {'samples':>12} {'Megatron s':>11} {'repack s':>9} {'x':>7}  bytes")
    for r in rows:
        note = " (Megatron: a prefix, scaled)" if r.get("megatron_scaled") else ""
        note += " (counts only)" if r.get("counts_only") else ""
        print(f"{r['datasets']:>9,} {r['samples']:>12,} {r['megatron_s']:>11.3f} "
              f"{r['repack_s']:>9.3f} {r.get('speedup') or 0:>7.1f}  "
              f"{'same' if r['same_bytes'] else r['same_bytes']}{note}")  # fmt: skip


if __name__ == "__main__":
    main()
