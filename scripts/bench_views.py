"""Read cost of a view: microseconds per ``SourceDataset.get()`` and the other calls Megatron's
``GPTDataset`` makes on its low-level dataset, pages cached (the Python around the read, not
the storage).

Builds (once) a repack of ``--sources`` small prefixes with shards small enough that some
sources are cut across two, opens a view of every source, then times calls made as
``GPTDataset.__getitem__`` makes them: ``get(document_index[i], offset=int(...), length=...)``
with a numpy ``int32`` sequence number, a numpy ``int64`` length, or ``None`` for a document's
end. ``--trees NAME=DIR ...`` runs the same measurements with each ``DIR`` on ``PYTHONPATH``
(other checkouts of repack, e.g. ``git archive``s of older commits), each in its own process,
alternating, ``--repeat`` times; medians are printed side by side.

    python scripts/bench_views.py --trees old=/tmp/rc-old now=/tmp/rc-now new=.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

#: What is timed, in order: name -> what it measures.
OPERATIONS = {
    "get": "get(i, offset, length), a random source each call (as a blend reads)",
    "get_runs": "get(i, offset, length), 1 to 4 in a row per random source (as a sample "
    "spanning documents)",
    "get_same": "get(i, offset, length), one source",
    "get_end": "get(i, offset, None): to the document's end",
    "getitem": "view[i]",
    "len": "len(view)",
    "sequence_lengths": "view.sequence_lengths",
    "document_indices": "view.document_indices",
}


def build(root: Path, sources: int, tokens: int, shard_size: int) -> Path:
    """The repack (made on first use) of ``sources`` prefixes of ``tokens`` uint16 tokens."""
    from repack.merge import merge
    from repack.synth import write_prefix

    out = root / "repack"
    if (out / "manifest.json").exists():
        return out
    rng = np.random.default_rng(0)
    items: list[object] = []
    for k in range(sources):
        ids = rng.integers(0, 50_000, tokens).astype(np.uint16)
        cuts = np.sort(rng.choice(np.arange(1, tokens), size=tokens // 500, replace=False))
        write_prefix(root / "data" / f"src-{k:05d}", np.split(ids, cuts))
        items += [1.0, f"data/src-{k:05d}"]
    blend = root / "blend.json"
    blend.write_text(json.dumps(items))
    merge(blend, out, shard_size=shard_size)
    return out


def measure(repack: Path, calls: int, passes: int, seq_len: int, mmap: bool) -> dict[str, float]:
    """Median over ``passes`` of the microseconds per call of each of :data:`OPERATIONS`."""
    from repack.format.manifest import load_manifest
    from repack.read.views import SourceDataset

    views = [SourceDataset(str(repack), s.path, mmap=mmap) for s in load_manifest(repack).sources]
    rng = np.random.default_rng(1)
    picks = rng.integers(0, len(views), calls)
    requests = []  # (view, document_index[i] as int32, offset, length as int64)
    for k in picks:
        view = views[int(k)]
        i = int(rng.integers(0, len(view)))
        n = int(view.sequence_lengths[i])
        want = min(n, seq_len + 1)
        offset = int(rng.integers(0, n - want + 1))
        requests.append((view, np.int32(i), offset, np.int64(want)))
    one = views[len(views) // 2]
    same = []
    for i in rng.integers(0, len(one), calls):
        n = int(one.sequence_lengths[i])
        same.append((one, np.int32(i), 0, np.int64(min(n, seq_len + 1))))
    runs = []  # a random source, then 1 to 4 reads of it in a row (consecutive sequences)
    while len(runs) < calls:
        view = views[int(rng.integers(0, len(views)))]
        first = int(rng.integers(0, len(view)))
        for i in range(first, min(len(view), first + int(rng.integers(1, 5)))):
            n = int(view.sequence_lengths[i])
            runs.append((view, np.int32(i), 0, np.int64(min(n, seq_len + 1))))
    ends = [(v, i, 0, None) for v, i, _, _ in requests]
    plain = [(v, int(i)) for v, i, _, _ in requests]
    chosen = [v for v, *_ in requests]

    def run_get(rows):
        for view, i, offset, length in rows:
            view.get(i, offset=offset, length=length)

    def run_getitem(rows):
        for view, i in rows:
            view[i]

    def run_len(rows):
        for view in rows:
            len(view)

    def run_lengths(rows):
        for view in rows:
            view.sequence_lengths  # noqa: B018

    def run_documents(rows):
        for view in rows:
            view.document_indices  # noqa: B018

    jobs = {
        "get": (run_get, requests),
        "get_runs": (run_get, runs),
        "get_same": (run_get, same),
        "get_end": (run_get, ends),
        "getitem": (run_getitem, plain),
        "len": (run_len, chosen),
        "sequence_lengths": (run_lengths, chosen),
        "document_indices": (run_documents, chosen),
    }
    for fn, rows in jobs.values():  # warm: pages, caches, code paths
        fn(rows[: max(1, calls // 10)])
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(passes):
        for name, (fn, rows) in jobs.items():
            started = time.perf_counter()
            fn(rows)
            times[name].append((time.perf_counter() - started) / len(rows) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="/tmp/repack-bench-views", type=Path)
    parser.add_argument("--sources", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=20_000, help="tokens per source")
    parser.add_argument(
        "--shard-size", type=int, default=8 << 20, help="bytes; small, so sources are cut"
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=100_000, help="calls per pass")
    parser.add_argument("--passes", type=int, default=3, help="passes per process (median)")
    parser.add_argument("--repeat", type=int, default=5, help="processes per tree (median)")
    parser.add_argument("--pread", action="store_true", help="the pread backend, not mmap")
    parser.add_argument(
        "--trees", nargs="*", default=[], metavar="NAME=DIR", help="repack checkouts to compare"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    args.data.mkdir(parents=True, exist_ok=True)
    repack = build(args.data, args.sources, args.tokens, args.shard_size)
    if args.child:
        result = measure(repack, args.calls, args.passes, args.seq_len, not args.pread)
        print(json.dumps(result))
        return 0

    trees = dict(t.split("=", 1) for t in args.trees) or {"this": ""}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    child = [sys.executable, os.path.abspath(__file__), "--child", "--data", str(args.data)]
    child += ["--sources", str(args.sources), "--tokens", str(args.tokens)]
    child += ["--shard-size", str(args.shard_size), "--seq-len", str(args.seq_len)]
    child += ["--calls", str(args.calls), "--passes", str(args.passes)]
    child += ["--pread"] if args.pread else []
    for _ in range(args.repeat):
        for name, tree in trees.items():  # alternate, so drift hits every tree alike
            env = dict(os.environ)
            if tree:
                env["PYTHONPATH"] = os.path.abspath(tree)
            out = subprocess.run(child, env=env, check=True, capture_output=True, text=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    medians = {
        name: {op: statistics.median(r[op] for r in rs) for op in OPERATIONS}
        for name, rs in runs.items()
    }
    if args.json:
        print(json.dumps({"medians_us": medians, "runs_us": runs}, indent=2))
        return 0
    print(
        f"{args.sources} sources, mmap={not args.pread}: us per call, medians of {args.repeat} "
        f"processes x {args.passes} passes of {args.calls:,} calls"
    )
    print(f"{'call':<18}" + "".join(f"{name:>10}" for name in trees))
    for op in OPERATIONS:
        print(f"{op:<18}" + "".join(f"{medians[name][op]:>10.2f}" for name in trees))
    return 0


if __name__ == "__main__":
    sys.exit(main())
