#!/usr/bin/env python3
"""Benchmark ``repack verify`` against ``cat`` of the same files, side by side.

Merges the bench blend of ``scripts/bench_merge.py`` (generated, or reused with ``--data DIR``)
twice with ``--shard-size 512MiB`` (several shards, one source cut across two): once with the
default ``xxh3-128`` checksums, once with ``--checksum sha256`` (both kept in ``DIR`` and reused
by later runs). Then runs, alternating their order, ``--repeat`` times each:

* ``cat``                 ``cat index.rpx shard-*.bin > /dev/null``: every byte verify reads
  (but the manifest), read once, checked against nothing;
* ``verify xxh3 wN``      ``repack verify -q --workers N`` on the xxh3-128 repack, for N in
  ``--workers`` (default ``1,2``: one thread, and shards hashed two at a time);
* ``verify sha256 wN``    the same on the sha256 repack.

Each run is a fresh process; wall times are medians, throughput is the bytes of the index and
the shards over the median wall time, peak RSS is each process's own (``os.wait4``). By default
the files are in the page cache (warm; read once before the first run); ``--drop-caches`` drops
the page cache before every run, then reloads Python, numpy, repack and cat untimed, so that
only the data is read from disk (needs root, slows every other program on the machine).

Usage::

    python scripts/bench_verify.py                      # data of bench_merge.py, warm cache
    python scripts/bench_verify.py --drop-caches --workers 1,2,4 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_merge import (
    DEFAULT_DATA,
    DEFAULT_SIZE,
    DEFAULT_SOURCES,
    can_drop_caches,
    ensure_data,
    log,
    machine_facts,
    pressure,
    repack_cmd,
    run,
    settle,
    warm,
)

from repack.units import format_size, parse_size

SHARD_SIZE = "512MiB"


def ensure_repack(data, out: Path, algorithm: str, shard_size: str) -> list[str]:
    """The repack of the bench blend in ``out`` (merged unless an intact one is there); returns
    the files verify reads (index, then shards)."""
    manifest = out / "manifest.json"
    if manifest.exists():
        raw = json.loads(manifest.read_text())
        if raw.get("checksum_algorithm") == algorithm and raw.get("shard_size") == parse_size(
            shard_size
        ):
            log(f"reusing {out}")
            return [str(out / raw["index"]["file"])] + [str(out / s["file"]) for s in raw["shards"]]
    log(f"merging the bench blend into {out} ({algorithm}, shards of {shard_size}) ...")
    result = run(
        repack_cmd(
            "merge",
            "-q",
            "--force",
            "--checksum",
            algorithm,
            "--shard-size",
            shard_size,
            str(data.blend),
            str(out),
        )
    )
    log(f"  merged in {result.seconds:.1f} s")
    return ensure_repack(data, out, algorithm, shard_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA))
    parser.add_argument("--sources", type=int, default=DEFAULT_SOURCES)
    parser.add_argument("--size", default=DEFAULT_SIZE, help="total token bytes (3.25GiB)")
    parser.add_argument("--shard-size", default=SHARD_SIZE)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", default="1,2", help="comma-separated verify --workers")
    parser.add_argument("--skip-sha256", action="store_true")
    parser.add_argument("--drop-caches", action="store_true")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args(argv)

    args.data.mkdir(parents=True, exist_ok=True)
    data = ensure_data(args.data, args.sources, parse_size(args.size))
    if args.drop_caches and not can_drop_caches():
        parser.error("cannot write /proc/sys/vm/drop_caches (not root?); run without it")
    algorithms = ["xxh3-128"] + ([] if args.skip_sha256 else ["sha256"])
    files = {
        algo: ensure_repack(data, args.data / f"verify-{algo}", algo, args.shard_size)
        for algo in algorithms
    }
    nbytes = sum(os.path.getsize(f) for f in files["xxh3-128"])
    shards = len(files["xxh3-128"]) - 1
    facts = machine_facts(args.data)

    configs: dict[str, list[str]] = {"cat": ["cat", *files["xxh3-128"]]}
    for algo in algorithms:
        for n in [int(w) for w in args.workers.split(",")]:
            out = str(args.data / f"verify-{algo}")
            configs[f"verify {algo} w{n}"] = repack_cmd("verify", "-q", "--workers", str(n), out)
    names = list(configs)
    if not args.drop_caches:
        for algo in algorithms:
            warm(files[algo])
    results: dict[str, list] = {name: [] for name in names}
    for rep in range(args.repeat):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            settle(args.drop_caches)
            result = run(configs[name], stdout=subprocess.DEVNULL if name == "cat" else None)
            results[name].append(result)
            log(
                f"rep {rep + 1}/{args.repeat} {name:20s} {result.seconds:6.2f} s  "
                f"{nbytes / result.seconds / 2**20:6.0f} MiB/s  "
                f"rss {result.rss_kib / 1024:4.0f} MiB"
            )
    facts["load average at end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    facts["pressure at end"] = pressure()

    summary = {}
    for name, runs in results.items():
        if not runs:
            continue
        seconds = statistics.median(r.seconds for r in runs)
        summary[name] = {
            "seconds": seconds,
            "mib_per_s": nbytes / seconds / 2**20,
            "rss_mib": max(r.rss_kib for r in runs) / 1024,
            "runs": [round(r.seconds, 3) for r in runs],
        }
    print("\n## verify benchmark\n")
    for key, value in facts.items():
        print(f"* {key}: {value}")
    print(
        f"* data: the bench blend ({len(data.prefixes)} sources) in {shards} shards of at most "
        f"{args.shard_size}; {format_size(nbytes)} ({nbytes} bytes) of index and shards"
    )
    print(f"* page cache: {'dropped before every run' if args.drop_caches else 'warm'}")
    print(f"* repetitions: {args.repeat}, order rotated every repetition\n")
    print("| run | median wall (s) | throughput | vs cat | peak RSS | runs (s) |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    cat = summary["cat"]["mib_per_s"] if "cat" in summary else float("nan")
    for name, s in summary.items():
        print(
            f"| {name} | {s['seconds']:.2f} | {s['mib_per_s']:.0f} MiB/s "
            f"| {s['mib_per_s'] / cat:.2f} | {s['rss_mib']:.0f} MiB "
            f"| {', '.join(f'{x:.2f}' for x in s['runs'])} |"
        )
    if args.json:
        print(json.dumps({"facts": facts, "bytes": nbytes, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
