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

Usage::

    python scripts/bench_blending.py                       # the grid, the 10**8 column prefixed
    python scripts/bench_blending.py --datasets 10 10000 --samples 1000000 10000000 --repeat 3
    python scripts/bench_blending.py --check-large --json

Needs numpy and megatron-core (its compiled helper only; torch is not imported).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from repack.model import blending


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", type=int, nargs="+", default=[10, 100, 1000, 10000, 32000])
    parser.add_argument("--samples", type=int, nargs="+", default=[10**6, 10**7, 10**8])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per Megatron run")
    parser.add_argument("--memory", type=float, default=4.0, help="GB of indices at most")
    parser.add_argument("--python", action="store_true", help="repack's numpy path")
    parser.add_argument("--check-large", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
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
