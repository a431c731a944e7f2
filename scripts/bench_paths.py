#!/usr/bin/env python3
"""Benchmark the code of a past commit against this tree's, side by side: what a reshaping
of the write path (issue 25, "one storage path") costs or saves.

Extracts ``--old REF`` (``git archive``) into a temp folder, builds its compiled helpers
there, and runs each case with ``PYTHONPATH`` set to one tree or the other, in a
fresh process, a fresh output every run, the two alternated (old first in even repetitions,
new first in odd ones), ``--repeat`` times each; the page cache stays warm (the sources are
read once before the first run), and before every run dirty pages are flushed and the disk
left to go idle (``bench_merge.settle``: a run that starts while the disk still writes back or
trims the previous output took up to 7x as long here). Cases:

* ``merge``          ``repack merge -q BLEND OUT`` into a local folder (every shard, the
  index and the manifest fsynced before it exits);
* ``merge-zstd``     the same with ``--compress zstd``;
* ``verify``         ``repack verify -q OUT`` of the repack the new tree merged;
* ``read``           a fresh process opens that repack (``Repack``, mmap) and reads
  ``READS`` random sequences of it, the loader's read path;
* ``merge-s3``       ``repack merge`` into ``s3://`` on SeaweedFS (127.0.0.1, started the
  way the tests start it: tests/s3_support.py), a new prefix every run;
* ``verify-s3``      ``repack verify -q`` of a repack the new tree merged into the bucket;
* ``merge-from-s3``  ``repack merge`` of the same blend with its sources uploaded to the
  bucket (``s3://`` prefixes) into a local folder.

Reported: the median wall time of each tree and the ratio new / old (below 1: the new tree
is faster).

Usage::

    python scripts/bench_paths.py --old f612ded                 # 480 sources, 1 GiB
    python scripts/bench_paths.py --sources 3000 --size 512MiB --repeat 7 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_merge import ensure_data, remove, settle, warm  # noqa: E402

from repack.units import parse_size  # noqa: E402

CASES = ("merge", "merge-zstd", "verify", "read", "merge-s3", "verify-s3", "merge-from-s3")
REMOTE = ("merge-s3", "verify-s3", "merge-from-s3")
#: Sequences the ``read`` case reads.
READS = 200_000
READ = f"""
import sys, numpy as np
try:
    from repack.read.reader import Repack
    from repack.read.views import SourceDataset
except ImportError:  # a tree from before the packages of issue 37
    from repack.reader import Repack
    from repack.views import SourceDataset
names = [source.name for source in Repack(sys.argv[1]).manifest.sources]
views = [SourceDataset(sys.argv[1], name) for name in names]
rng = np.random.default_rng(0)
total = 0
for k in rng.integers(0, len(views), {READS}):
    view = views[int(k)]
    total += int(view[int(rng.integers(0, len(view)))][:8].sum())
print(total)
"""


def checkout(ref: str, into: Path) -> Path:
    """The tree of commit ``ref`` in ``into``, with its compiled helpers built."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref], capture_output=True, check=True
    ).stdout
    into.mkdir(parents=True)
    path = into / "tree.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    path.unlink()
    # its own compiled helpers, where its layout has them (they moved with issue 37)
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=into,
        check=True,
        capture_output=True,
    )
    return into


def upload_sources(data, bucket: str) -> Path:
    """The sources of ``data`` uploaded to ``bucket``, and a blend of their URLs."""
    from repack.store import open_store

    store = open_store(f"s3://{bucket}")
    urls = []
    for prefix in data.prefixes:
        name = f"src/{Path(prefix).name}"
        for ext in (".bin", ".idx"):
            store.put(name + ext, Path(f"{prefix}{ext}").read_bytes())
        urls.append(f"s3://{bucket}/{name}")
    blend = data.blend.parent / f"blend-s3-{bucket}.json"
    blend.write_text(json.dumps([x for url in urls for x in (1.0, url)]))
    return blend


def command(case: str, data, out: str, remote_blend=None) -> list[str]:
    python = [sys.executable, "-m", "repack"]
    if case == "merge-from-s3":
        return [*python, "merge", "-q", str(remote_blend), out]
    if case == "read":
        return [sys.executable, "-c", READ, out]
    if case in ("verify", "verify-s3"):
        return [*python, "verify", "-q", out]
    extra = ["--compress", "zstd"] if case == "merge-zstd" else []
    return [*python, "merge", "-q", *extra, str(data.blend), out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--old", default="f612ded", help="the commit to compare with")
    parser.add_argument("--data", type=Path, default=Path("/tmp/repack-bench-paths"))
    parser.add_argument("--sources", type=int, default=480)
    parser.add_argument("--size", default="1GiB", help="total token bytes")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    data = ensure_data(args.data / f"{args.sources}", args.sources, parse_size(args.size))
    work = Path(tempfile.mkdtemp(prefix="bench-paths-"))
    trees = {"old": checkout(args.old, work / "old"), "new": ROOT}
    server = remote_blend = None
    try:
        if any(case in REMOTE for case in cases):
            from s3_support import server_env, start_server

            server = start_server(work / "server")
            env_context = server_env(server)
            env_context.__enter__()
            bucket = server.new_bucket()
            remote_blend = upload_sources(data, bucket) if "merge-from-s3" in cases else None
        warm([f"{p}.bin" for p in data.prefixes] + [f"{p}.idx" for p in data.prefixes])
        verified = work / "verified"  # what verify reads: a repack the new tree merged
        subprocess.run(
            [sys.executable, "-m", "repack", "merge", "-q", str(data.blend), str(verified)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        if "verify-s3" in cases:
            verified_s3 = f"s3://{bucket}/verified.repack"
            subprocess.run(
                [sys.executable, "-m", "repack", "merge", "-q", str(data.blend), verified_s3],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        times: dict[str, dict[str, list[float]]] = {c: {"old": [], "new": []} for c in cases}
        count = 0
        for i in range(args.repeat):
            for case in cases:
                for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                    count += 1
                    if case in ("verify", "read"):
                        out = str(verified)
                    elif case == "verify-s3":
                        out = verified_s3
                    elif case == "merge-s3":
                        out = f"s3://{bucket}/run-{count}.repack"
                    else:
                        out = str(work / f"out-{name}")
                    env = {**os.environ, "PYTHONPATH": str(trees[name])}
                    settle(False)  # dirty pages flushed and the disk idle (bench_merge.py)
                    started = time.perf_counter()
                    result = subprocess.run(
                        command(case, data, out, remote_blend), env=env, capture_output=True
                    )
                    seconds = time.perf_counter() - started
                    if result.returncode:
                        raise RuntimeError(f"{name} {case}: {result.stderr.decode()[-2000:]}")
                    times[case][name].append(seconds)
                    if case in ("merge", "merge-zstd", "merge-from-s3"):
                        remove(Path(out))
            print(f"repetition {i + 1} of {args.repeat} done", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        case: {
            "old_s": round(statistics.median(t["old"]), 3),
            "new_s": round(statistics.median(t["new"]), 3),
            "new_over_old": round(statistics.median(t["new"]) / statistics.median(t["old"]), 3),
            "runs_old_s": [round(x, 3) for x in t["old"]],
            "runs_new_s": [round(x, 3) for x in t["new"]],
        }
        for case, t in times.items()
    }
    facts = {
        "old": args.old,
        "new": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "sources": args.sources,
        "bytes": data.bytes,
        "repeat": args.repeat,
        "nproc": os.cpu_count(),
        "load average at start": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps({"facts": facts, "cases": summary}, indent=1))
        return 0
    print(f"\n{facts}\n")
    print("| case | old (s) | new (s) | new / old | runs old | runs new |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for case, s in summary.items():
        print(
            f"| {case} | {s['old_s']:.2f} | {s['new_s']:.2f} | {s['new_over_old']:.3f} "
            f"| {', '.join(map(str, s['runs_old_s']))} | {', '.join(map(str, s['runs_new_s']))} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
