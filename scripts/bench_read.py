"""Compressed vs raw shards: compression ratio and random-sample read throughput.

Generates a blend of Megatron prefixes whose token ids follow a Zipf law (as natural-language
token frequencies do, so the ratio is indicative of real data rather than of random bytes),
merges it twice (raw, and `--compress zstd:LEVEL`), then reads the same random samples — a
window of `--seq-len` + 1 tokens at a random position of a random source, as Megatron's
GPTDataset reads them — through `repack.read.views.SourceDataset`, with 1 and 8 reader
processes, alternating raw/compressed runs, `--repeat` times each. Prints medians and the ratios.

    python scripts/bench_read.py --data /tmp/repack-bench-read
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from repack.merge import merge
from repack.synth import write_prefix


def make_blend(root: Path, sources: int, tokens: int, seed: int) -> Path:
    """``sources`` prefixes of about ``tokens`` uint16 tokens each; returns the blend path."""
    blend = root / "blend.json"
    if blend.exists():
        return blend
    rng = np.random.default_rng(seed)
    items: list[object] = []
    for i in range(sources):
        ids = np.minimum(rng.zipf(1.2, tokens), 50_000).astype(np.uint16)
        cuts = np.sort(rng.choice(np.arange(1, tokens), size=tokens // 1500, replace=False))
        write_prefix(root / "data" / f"src-{i:04d}", np.split(ids, cuts))
        items += [1.0, f"data/src-{i:04d}"]
    blend.write_text(json.dumps(items))
    return blend


def _reader(repack: str, mmap: bool, seconds: float, seq_len: int, seed: int, queue) -> None:
    from repack.format.manifest import load_manifest
    from repack.read.views import SourceDataset

    sources = [SourceDataset(repack, s.path, mmap=mmap) for s in load_manifest(repack).sources]
    rng = np.random.default_rng(seed)
    samples = tokens = 0
    checksum = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(64):
            view = sources[int(rng.integers(0, len(sources)))]
            i = int(rng.integers(0, len(view)))
            n = int(view.sequence_lengths[i])
            want = min(n, seq_len + 1)
            offset = int(rng.integers(0, n - want + 1))
            sample = view.get(i, offset, want)
            checksum += int(sample[:1].sum()) if want else 0
            samples += 1
            tokens += want
    queue.put((samples, tokens, checksum))


def measure(repack: str, processes: int, seconds: float, seq_len: int, mmap: bool) -> float:
    """Samples per second summed over ``processes`` reader processes."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [
        context.Process(target=_reader, args=(repack, mmap, seconds, seq_len, seed, queue))
        for seed in range(processes)
    ]
    for worker in workers:
        worker.start()
    results = [queue.get() for _ in workers]
    for worker in workers:
        worker.join()
    return sum(r[0] for r in results) / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="/tmp/repack-bench-read", type=Path)
    parser.add_argument("--sources", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=1_000_000, help="tokens per source")
    parser.add_argument("--level", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    args.data.mkdir(parents=True, exist_ok=True)
    blend = make_blend(args.data, args.sources, args.tokens, seed=0)
    outs = {"raw": args.data / "raw", "zstd": args.data / f"zstd-{args.level}"}
    for name, out in outs.items():
        if not (out / "manifest.json").exists():
            shutil.rmtree(out, ignore_errors=True)
            started = time.perf_counter()
            merge(blend, out, codec=None if name == "raw" else ("zstd", args.level))
            print(f"merged {name} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    sizes = {name: sum(p.stat().st_size for p in out.glob("shard-*")) for name, out in outs.items()}
    rows = {}
    for processes in (1, 8):
        for mmap in (True, False):
            runs: dict[str, list[float]] = {"raw": [], "zstd": []}
            for _ in range(args.repeat):
                for name in ("raw", "zstd"):  # alternate, so drift hits both alike
                    runs[name].append(
                        measure(str(outs[name]), processes, args.seconds, args.seq_len, mmap)
                    )
            rows[(processes, mmap)] = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "sources": args.sources,
        "tokens_per_source": args.tokens,
        "seq_len": args.seq_len,
        "level": args.level,
        "raw_bytes": sizes["raw"],
        "zstd_bytes": sizes["zstd"],
        "ratio": sizes["raw"] / sizes["zstd"],
        "samples_per_second": [
            {
                "processes": p,
                "backend": "mmap" if m else "pread",
                **v,
                "zstd_vs_raw": v["zstd"] / v["raw"],
            }
            for (p, m), v in rows.items()
        ],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"shards: raw {sizes['raw'] / 2**20:.1f} MiB, zstd:{args.level} "
        f"{sizes['zstd'] / 2**20:.1f} MiB, compression ratio {result['ratio']:.2f}x"
    )
    print(
        f"random samples of {args.seq_len + 1} tokens, medians of {args.repeat} runs of "
        f"{args.seconds:g} s:"
    )
    print(
        f"{'readers':>7}  {'backend':>7}  {'raw samples/s':>14}  {'zstd samples/s':>14}  "
        f"{'zstd/raw':>8}"
    )
    for row in result["samples_per_second"]:
        print(
            f"{row['processes']:>7}  {row['backend']:>7}  {row['raw']:>14,.0f}  "
            f"{row['zstd']:>14,.0f}  {row['zstd_vs_raw']:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
