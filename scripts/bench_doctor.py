#!/usr/bin/env python3
"""Benchmark ``repack doctor`` on a blend of many small sources, next to reading its indices.

Writes (once; reused from ``--data DIR`` when there) a flat blend of ``--sources`` prefixes
(default 10,000) of 4 to 12 documents each, one sequence per document of 50 to 2,000 tokens,
uint16, with uneven weights: the blend of the issue, whose 4-document sources get no validation
sequence with ``--split 99,1,0``. Then runs, alternating, ``--repeat`` times each, every run a
fresh process:

* ``read .idx``   a Python process that opens and reads every ``.idx`` file whole: the I/O
  floor of anything that looks at the blend's indices (the reference);
* ``doctor``      ``repack doctor -q --json BLEND --seq-length 4096 --split 99,1,0
  --train-iters 100000 --global-batch-size 512`` (exit status 1: it finds the empty slices);
* ``doctor text`` the same, printing the text report instead of JSON;
* ``doctor plot`` the same with ``--plot`` (PNG), when matplotlib is installed.

Wall times are medians; peak RSS is each process's own (``os.wait4``). The files are in the page
cache (read once before the first run).

Usage::

    python scripts/bench_doctor.py                     # 10,000 sources in /tmp/repack-bench-doctor
    python scripts/bench_doctor.py --sources 1000 --repeat 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from repack.synth import write_prefix

SEED = 11
DOCTOR_ARGS = [
    "--seq-length", "4096", "--split", "99,1,0", "--train-iters", "100000",
    "--global-batch-size", "512",
]  # fmt: skip

READ_IDX = """
import json, sys
n = 0
for weight, prefix in zip(*[iter(json.load(open(sys.argv[1])))] * 2):
    with open(prefix + ".idx", "rb") as f:
        n += len(f.read())
print(n)
"""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_data(root: Path, sources: int) -> Path:
    """The bench blend in ``root`` (reused when ``root/blend.json`` names ``sources`` prefixes)."""
    blend = root / "blend.json"
    if blend.exists() and len(json.loads(blend.read_text())) == 2 * sources:
        return blend
    log(f"writing {sources:,} sources into {root} ...")
    rng = np.random.default_rng(SEED)
    items: list = []
    for i in range(sources):
        prefix = root / "data" / f"part-{i // 1000:02d}" / f"src-{i:05d}"
        documents = int(rng.integers(4, 13))
        sequences = [rng.integers(1, 60000, int(rng.integers(50, 2001))) for _ in range(documents)]
        write_prefix(prefix, sequences, dtype=np.uint16)
        items += [round(float(rng.uniform(0.1, 2.0)), 4), str(prefix)]
    blend.write_text(json.dumps(items))
    return blend


def timed(cmd: list[str], ok: tuple[int, ...] = (0,)) -> tuple[float, int]:
    """Wall seconds and peak RSS (KiB) of ``cmd``, whose exit status must be in ``ok``."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
        code = os.waitstatus_to_exitcode(status)
        if code not in ok:
            err.seek(0)
            raise RuntimeError(f"{cmd[:3]} exited {code}: {err.read().decode()[-2000:]}")
        return seconds, usage.ru_maxrss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("/tmp/repack-bench-doctor"))
    parser.add_argument("--sources", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()

    blend = ensure_data(args.data, args.sources)
    repack = [sys.executable, "-m", "repack.cli"]
    picture = args.data / "mix.png"
    runs = {
        "read .idx": ([sys.executable, "-c", READ_IDX, str(blend)], (0,)),
        "doctor": ([*repack, "doctor", "-q", "--json", str(blend), *DOCTOR_ARGS], (1,)),
        "doctor text": ([*repack, "doctor", "-q", str(blend), *DOCTOR_ARGS], (1,)),
    }
    try:
        import matplotlib  # noqa: F401

        runs["doctor plot"] = (
            [*repack, "doctor", "-q", str(blend), *DOCTOR_ARGS, "--plot", str(picture)],
            (1,),
        )
    except ImportError:
        log("matplotlib is missing: no 'doctor plot' runs")
    timed(runs["read .idx"][0])  # warm the page cache
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in runs}
    for _ in range(args.repeat):
        for name, (cmd, ok) in runs.items():
            results[name].append(timed(cmd, ok))
    reference = statistics.median(s for s, _ in results["read .idx"])
    table = {
        name: {
            "seconds": round(statistics.median(s for s, _ in found), 3),
            "vs_read_idx": round(statistics.median(s for s, _ in found) / reference, 2),
            "peak_rss_mib": round(max(r for _, r in found) / 1024, 1),
        }
        for name, found in results.items()
    }
    facts = {
        "sources": args.sources,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "command": " ".join(["repack", "doctor", "-q", "--json", str(blend), *DOCTOR_ARGS]),
    }
    if args.json:
        print(json.dumps({"machine": facts, "results": table}, indent=2))
        return 0
    print(f"{args.sources:,} sources, median of {args.repeat} runs, each a fresh process")
    print(f"{'':<12} {'seconds':>8} {'vs read .idx':>13} {'peak RSS MiB':>13}")
    for name, row in table.items():
        print(
            f"{name:<12} {row['seconds']:>8.3f} {row['vs_read_idx']:>12.2f}x "
            f"{row['peak_rss_mib']:>13.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
