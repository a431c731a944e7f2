#!/usr/bin/env python3
"""Benchmark a merge from sources on object storage against a real S3 server (SeaweedFS on
127.0.0.1, started the way the tests start it: tests/s3_support.py).

Generates a blend of ``--sources`` small sources, uploads them to a bucket, writes the same
blend with ``s3://`` prefixes, then measures:

* **validate**: reading every source's ``.idx`` and sizing its ``.bin`` one source after the
  other (``read_source_index`` in a loop) against ``prepare`` (repack's validation, 16 at
  once), with the requests ``prepare`` sends;
* **merge**: the whole merge into a bucket and into a local folder (seconds, requests), and
  the merge of the same sources as local files for scale.

``--latency MS`` adds that long before every request of the process's client (a botocore
``before-send`` hook that sleeps, releasing the GIL), as a server farther than loopback.

Usage::

    python scripts/bench_objstore_sources.py                   # 500 sources
    python scripts/bench_objstore_sources.py --latency 20 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from s3_support import RequestCounter, server_env, start_server  # noqa: E402

from repack.inputs.sources import read_source_index  # noqa: E402
from repack.merge import merge, prepare  # noqa: E402
from repack.synth import make_blend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=int, default=500)
    parser.add_argument("--latency", type=float, default=0.0, help="ms before each request")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="repack-bench-sources-"))
    blend = make_blend(work / "blend", args.sources, seed=3)
    server = start_server(work / "server")
    found: dict = {"sources": args.sources, "latency_ms": args.latency}
    try:
        with server_env(server):
            bucket = server.new_bucket()
            root = f"s3://{bucket}/src"
            client = server.client()

            def put(prefix: str) -> None:
                rel = os.path.relpath(prefix, blend.root)
                for ext in (".bin", ".idx"):
                    body = Path(prefix + ext).read_bytes()
                    client.put_object(Bucket=bucket, Key=f"src/{rel}{ext}", Body=body)

            with ThreadPoolExecutor(16) as pool:
                list(pool.map(put, blend.prefixes))
            items = json.loads(blend.flat_json.read_text())
            urls = []
            for prefix in items[1::2]:
                absolute = os.path.normpath(os.path.join(blend.root, prefix))
                urls.append(f"{root}/{os.path.relpath(absolute, blend.root)}")
            url_blend = work / "url.json"
            url_blend.write_text(json.dumps([x for pair in zip(items[::2], urls) for x in pair]))
            if args.latency:
                from repack.store import s3

                delay = args.latency / 1000
                s3.client().meta.events.register("before-send.s3", lambda **_: time.sleep(delay))
            started = time.monotonic()
            for url in urls:
                read_source_index(url)
            found["validate_one_by_one_s"] = round(time.monotonic() - started, 2)
            started = time.monotonic()
            with RequestCounter() as counter:
                prepare(url_blend)
            found["validate_s"] = round(time.monotonic() - started, 2)
            found["validate_requests"] = dict(counter.counts)
            started = time.monotonic()
            with RequestCounter() as counter:
                merge(url_blend, f"s3://{bucket}/x.repack")
            found["merge_to_s3_s"] = round(time.monotonic() - started, 2)
            found["merge_to_s3_requests"] = dict(counter.counts)
            started = time.monotonic()
            merge(url_blend, work / "out")
            found["merge_to_folder_s"] = round(time.monotonic() - started, 2)
            started = time.monotonic()
            merge(blend.flat_json, work / "local")
            found["merge_of_local_files_s"] = round(time.monotonic() - started, 2)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(found, indent=1))
        return
    for key, value in found.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
