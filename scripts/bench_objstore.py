#!/usr/bin/env python3
"""Benchmark repack on object storage against a real S3 server (SeaweedFS on 127.0.0.1).

Starts ``weed mini`` the way the tests do (tests/s3_support.py: loopback only, telemetry
off, a private folder), generates a blend (``--sources``, ``--tokens`` per source), and
measures:

* **merge**: ``repack merge BLEND s3://...`` from the local sources (seconds, requests);
* **open**: requests of ``Repack(url)`` cold (empty node cache) and warm;
* **verify vs plain**: ``repack.verify.verify(url)`` (every checksum, parallel ranged reads)
  against a plain parallel ranged reader of the same bytes (the index and every shard, in
  ``PIECE`` ranges on ``READERS`` threads of its own boto3 client, bytes dropped): alternated,
  ``--repeat`` times each, medians; the ratio is plain time / verify time (1.0: verify reads
  as fast as the server gives bytes; the goal is >= 0.8).

Usage::

    python scripts/bench_objstore.py                  # 100 sources, ~180 MB
    python scripts/bench_objstore.py --sources 1000 --tokens 20000,60000 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from s3_support import RequestCounter, server_env, start_server  # noqa: E402

from repack.merge import merge  # noqa: E402
from repack.reader import Repack  # noqa: E402
from repack.store import open_store  # noqa: E402
from repack.store.objects import PIECE, READERS  # noqa: E402
from repack.synth import make_blend  # noqa: E402
from repack.verify import verify  # noqa: E402


def plain_read(server, bucket: str, keys: list[tuple[str, int]]) -> int:
    """Every byte of ``keys`` in PIECE ranges on READERS threads; the bytes read."""
    client = server.client()

    def get(job):
        key, start, size = job
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + size - 1}")
        return len(body["Body"].read())

    jobs = [
        (key, start, min(PIECE, size - start))
        for key, size in keys
        for start in range(0, size, PIECE)
    ]
    with ThreadPoolExecutor(READERS) as pool:
        return sum(pool.map(get, jobs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sources", type=int, default=100)
    parser.add_argument("--tokens", default="400000,800000", help="tokens per source: MIN,MAX")
    parser.add_argument("--shard-size", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, default=None, help="verify's workers")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    low, high = (int(x) for x in args.tokens.split(","))
    folder = Path(tempfile.mkdtemp(prefix="bench-objstore-"))
    server = start_server(folder / "server")
    try:
        with server_env(server):
            os.environ["REPACK_CACHE_DIR"] = str(folder / "cache")
            blend = make_blend(
                folder / "blend", args.sources, seed=1, tokens_per_source=(low, high)
            )
            bucket = server.new_bucket()
            url = f"s3://{bucket}/bench.repack"
            with RequestCounter() as upload:
                started = time.perf_counter()
                result = merge(blend.flat_json, url, shard_size=args.shard_size)
                merge_seconds = time.perf_counter() - started
            with RequestCounter() as cold:
                repack = Repack(url)
            with RequestCounter() as warm:
                Repack(url)
            manifest = repack.manifest
            store = open_store(url)
            keys = [(store.key(manifest.index_file), manifest.index_size)]
            keys += [(store.key(s.file), s.file_size) for s in manifest.shards]
            total = sum(size for _, size in keys)
            times: dict[str, list[float]] = {"verify": [], "plain": []}
            for i in range(args.repeat):
                for name in ("verify", "plain") if i % 2 == 0 else ("plain", "verify"):
                    started = time.perf_counter()
                    if name == "verify":
                        report = verify(url, workers=args.workers)
                        assert report.ok, report.problems
                    else:
                        assert plain_read(server, bucket, keys) == total
                    times[name].append(time.perf_counter() - started)
            medians = {name: statistics.median(values) for name, values in times.items()}
            out = {
                "sources": args.sources,
                "bytes": total,
                "shards": len(manifest.shards),
                "merge_seconds": round(merge_seconds, 3),
                "merge_requests": dict(upload.counts),
                "merge_mb_per_s": round(result.bytes / merge_seconds / 1e6, 1),
                "open_cold_requests": dict(cold.counts),
                "open_warm_requests": dict(warm.counts),
                "verify_seconds": round(medians["verify"], 3),
                "plain_seconds": round(medians["plain"], 3),
                "verify_mb_per_s": round(total / medians["verify"] / 1e6, 1),
                "plain_mb_per_s": round(total / medians["plain"] / 1e6, 1),
                "verify_vs_plain": round(medians["plain"] / medians["verify"], 2),
                "repeat": args.repeat,
                "all_seconds": {k: [round(v, 3) for v in vs] for k, vs in times.items()},
            }
    finally:
        server.stop()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for key, value in out.items():
        print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
