"""Opening a repack: how long parsing and validating its ``manifest.json`` takes (issue 44).

Every training process and DataLoader worker, and the warm build of the loader, parses the
manifest once. Each run is a new Python process, as a training process meets the manifest,
that times its first ``load_manifest`` (read, the cache's digest of the bytes, then
``parse_manifest``: self-checksum, ``json.loads``, structural checks, the sources' columns),
then ``parse_manifest`` of the same bytes again, and ``json.loads`` alone for scale. Runs
alternate between the source trees of repack given (to compare two commits: each run imports
repack from ``--tree`` through ``PYTHONPATH``), so that the load of a shared machine hits them
alike. Prints, per repack and tree, the median and every run.

    git worktree add /tmp/mf-old main
    python scripts/bench_manifest.py --tree /tmp/mf-old --tree . \\
        --repack /tmp/wwarm/bl/scale/repack-3000 --repack /tmp/wwarm/bl/scale/repack-30000

With ``--open``, each run also times what a training process pays to open the repack in a
new process that imported the loader: ``repack.megatron.dataset_class(folder)`` (the manifest's
load and the structure checks of ``Repack``), wall and CPU time (the CPU time is steadier on a
shared machine):

    python scripts/bench_manifest.py --tree /tmp/mf-old --tree . --open --repeat 9 \\
        --repack /tmp/wwarm/bl/scale/repack-30000

Nothing is written into the repacks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = """
import gc, json, sys, time
from repack.format.manifest import load_manifest, parse_manifest
start = time.perf_counter()
manifest = load_manifest(sys.argv[1])  # read, cache key, parse: what a new process pays
load = time.perf_counter() - start
data = open(sys.argv[1] + "/manifest.json", "rb").read()
start = time.perf_counter()
parse_manifest(data, "manifest.json")  # the same parse again, in a process that did one
parse = time.perf_counter() - start
gc.disable()
start = time.perf_counter()
json.loads(data)
loads = time.perf_counter() - start
import repack.format.manifest as module
print(json.dumps({
    "load": load, "parse": parse, "loads": loads, "sources": len(manifest.sources),
    "file": module.__file__,
}))
"""


_OPEN_CHILD = """
import json, sys, time, warnings
warnings.simplefilter("ignore")  # megatron-core's warnings about optional packages
from repack.megatron import dataset_class
import repack.format.manifest as module
wall, cpu = time.perf_counter(), time.process_time()
dataset_class(sys.argv[1])  # the repack opened and checked, as a training process opens it
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"open": wall, "open_cpu": cpu, "file": module.__file__}))
"""


def run(tree: Path, folder: Path, child: str = _CHILD) -> dict:
    """One parse of ``folder``'s manifest in a new process importing repack from ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        # -P: not the working directory's repack, the tree's
        [sys.executable, "-P", "-c", child, str(folder)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found = json.loads(out.splitlines()[-1])
    if not found["file"].startswith(str(tree) + os.sep):
        raise SystemExit(f"{tree}: the run imported repack from {found['file']}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, action="append", required=True)
    parser.add_argument("--repack", type=Path, action="append", required=True)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--open", action="store_true", help="also time dataset_class(folder) after the imports"
    )
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.tree]
    print(
        f"machine: nproc {os.cpu_count()}, python {platform.python_version()}, "
        f"load average before {', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    for folder in args.repack:
        size = (folder / "manifest.json").stat().st_size
        runs: dict[Path, list[dict]] = {tree: [] for tree in trees}
        for _ in range(args.repeat):
            for tree in trees:
                found = run(tree, folder)
                if args.open:
                    found.update(run(tree, folder, _OPEN_CHILD))
                runs[tree].append(found)
        sources = runs[trees[0]][0]["sources"]
        print(f"\n{folder}: {sources:,} sources, manifest {size / 2**20:.1f} MiB")
        for tree in trees:
            line = f"  {tree!s:<30}"
            for name, what in (("load", "first load_manifest"), ("parse", "parse again")):
                times = [r[name] for r in runs[tree]]
                line += (
                    f" {what} {statistics.median(times):.3f} s"
                    f" ({', '.join(f'{x:.3f}' for x in times)});"
                )
            loads = statistics.median(r["loads"] for r in runs[tree])
            print(f"{line} json.loads alone {loads:.3f} s")
            if args.open:
                times = [r["open"] for r in runs[tree]]
                cpu = statistics.median(r["open_cpu"] for r in runs[tree])
                print(
                    f"  {'':<30} dataset_class {statistics.median(times):.3f} s"
                    f" ({', '.join(f'{x:.3f}' for x in times)}), CPU {cpu:.3f} s"
                )
        if len(trees) > 1:
            first, last = (
                statistics.median(r["load"] for r in runs[t]) for t in (trees[0], trees[-1])
            )
            print(f"  first load_manifest, {trees[0]} / {trees[-1]}: {first / last:.2f}x")
            if args.open:
                for name, what in (("open", "wall"), ("open_cpu", "CPU")):
                    first, last = (
                        statistics.median(r[name] for r in runs[t]) for t in (trees[0], trees[-1])
                    )
                    print(f"  dataset_class {what}, {trees[0]} / {trees[-1]}: {first / last:.2f}x")
    print(f"load average after {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
