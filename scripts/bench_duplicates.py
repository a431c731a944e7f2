#!/usr/bin/env python3
"""Benchmark the duplicate analysis at scale: ``repack doctor`` on a repack (fingerprints, no
token read) and on the plain blend with ``--duplicates`` (every token read), next to reading
the blend's ``.bin`` files with ``cat``.

Writes (once; reused from ``--data DIR`` when there) a flat blend of ``--sources`` uint16
prefixes (default 10,000) holding ``--documents`` documents in all (default 10^8), one
sequence per document of 4 to 8 random tokens, written with numpy straight in the ``MMIDIDX``
v1 format, with planted duplicates: source 1 a byte-identical copy of source 0, source 2 its
first documents repeated 8 times, source 3 half copied from source 4. Then merges it (timed,
``repack merge -q --shard-size 4GiB``) and runs, each a fresh process, ``--repeat`` times:

* ``cat``               ``cat`` of every ``.bin`` to ``/dev/null``: the read floor;
* ``doctor repack``     ``repack doctor -q --json REPACK``;
* ``doctor --duplicates``  ``repack doctor -q --json BLEND --duplicates``.

Wall times are medians; peak RSS is each process's own (``os.wait4``). The files stay in the
page cache when they fit (a warm-up read precedes the runs).

Usage::

    python scripts/bench_duplicates.py --data /tmp/repack-bench-dups
    python scripts/bench_duplicates.py --sources 1000 --documents 10000000 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SEED = 19
LAYOUT = 1
DOCTOR_ARGS = ["--seq-length", "4096", "--split", "99,1,0", "--samples", "1000000,10000,0"]
HEADER = b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8])  # uint16


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_source(prefix: Path, docs: np.ndarray, lengths: np.ndarray) -> None:
    """One sequence per document: ``docs`` is the tokens of every document back to back."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    n = len(lengths)
    pointers = np.zeros(n, np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * 2, out=pointers[1:])
    with open(f"{prefix}.bin", "wb") as f:
        f.write(docs.astype("<u2").tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(HEADER + n.to_bytes(8, "little") + (n + 1).to_bytes(8, "little"))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(np.arange(n + 1, dtype="<i8").tobytes())


def split_docs(tokens: np.ndarray, lengths: np.ndarray, take: np.ndarray) -> tuple:
    """The documents ``take`` of a source, as (tokens, lengths)."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    pieces = [tokens[starts[k] : ends[k]] for k in take]
    return np.concatenate(pieces), lengths[take]


def ensure_data(root: Path, sources: int, documents: int) -> Path:
    marker = root / "layout.json"
    wanted = {"layout": LAYOUT, "sources": sources, "documents": documents}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return root / "blend.json"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(SEED)
    counts = np.maximum(8, rng.lognormal(0, 1.0, sources))
    counts = np.maximum(8, (counts / counts.sum() * documents).astype(np.int64))
    counts[-1] += documents - counts.sum()
    prefixes = []
    kept: dict[int, tuple] = {}
    started = time.monotonic()
    for i, n in enumerate(counts.tolist()):
        prefix = root / "data" / f"{i // 1000:02d}" / f"src-{i:05d}"
        prefixes.append(prefix)
        lengths = rng.integers(4, 9, n).astype(np.int64)
        tokens = rng.integers(0, 65536, int(lengths.sum()), dtype=np.uint16)
        if i == 1:  # a byte-identical copy of source 0
            tokens, lengths = kept[0]
        elif i == 2:  # its first eighth, each document 8 times
            base = np.arange(max(1, n // 8))
            tokens, lengths = split_docs(tokens, lengths, np.repeat(base, 8))
        elif i == 3:  # half of it copied from source 4: written after source 4
            pass
        if i == 0:
            kept[0] = (tokens, lengths)
        if i == 3:
            kept[3] = (tokens, lengths)
            continue
        write_source(prefix, tokens, lengths)
        if i == 4:
            own_tokens, own_lengths = kept.pop(3)
            half = len(own_lengths) // 2
            a_tok, a_len = split_docs(tokens, lengths, np.arange(min(half, len(lengths))))
            b_tok, b_len = split_docs(own_tokens, own_lengths, np.arange(half, len(own_lengths)))
            write_source(
                prefixes[3], np.concatenate([a_tok, b_tok]), np.concatenate([a_len, b_len])
            )
        if i % 1000 == 999:
            log(f"  wrote {i + 1:,} sources ({time.monotonic() - started:.0f} s)")
    kept.clear()
    blend = root / "blend.json"
    items: list[object] = []
    for k, prefix in enumerate(prefixes):
        items += [float(counts[k]), str(prefix)]
    blend.write_text(json.dumps(items))
    marker.write_text(json.dumps(wanted))
    return blend


def run_timed(cmd: list[str], ok=(0, 1)) -> tuple[float, int, str]:
    """Wall time, peak RSS (KiB) of the process, stdout."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code not in ok:
        raise SystemExit(f"{' '.join(cmd)}: exit {code}")
    return seconds, usage.ru_maxrss, out.decode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("/tmp/repack-bench-dups"))
    parser.add_argument("--sources", type=int, default=10_000)
    parser.add_argument("--documents", type=int, default=100_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--memory", default="1GiB", help="--duplicates-memory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    log(f"data: {args.sources:,} sources, {args.documents:,} documents in {args.data}")
    blend = ensure_data(args.data, args.sources, args.documents)
    repack = args.data / "repack"
    bins = [p + ".bin" for p in json.loads(blend.read_text())[1::2]]
    results: dict[str, list] = {}
    facts = {
        "cpus": os.cpu_count(),
        "load average at start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "bytes": sum(os.path.getsize(b) for b in bins),
    }
    cat = ["sh", "-c", 'xargs cat < "$0" > /dev/null', str(args.data / "bins.txt")]
    (args.data / "bins.txt").write_text("\n".join(bins) + "\n")
    run_timed(cat, ok=(0,))  # warm
    if not (repack / "manifest.json").exists():
        log("merging (timed once) ...")
        cmd = [sys.executable, "-m", "repack", "merge", "-q", "--shard-size", "4GiB",
               str(blend), str(repack)]  # fmt: skip
        seconds, rss, _ = run_timed(cmd, ok=(0,))
        facts["merge_seconds"], facts["merge_rss_mib"] = seconds, rss / 1024
    doctor = [sys.executable, "-m", "repack", "doctor", "-q", "--json", *DOCTOR_ARGS,
              "--duplicates-memory", args.memory]  # fmt: skip
    runs = {
        "cat": cat,
        "doctor repack": [*doctor, str(repack)],
        "doctor --duplicates": [*doctor, str(blend), "--duplicates"],
    }
    reports = {}
    for rep in range(args.repeat):
        for name, cmd in runs.items():
            seconds, rss, out = run_timed(cmd)
            results.setdefault(name, []).append((seconds, rss / 1024))
            if out.strip():
                reports[name] = json.loads(out)
            log(
                f"rep {rep + 1}/{args.repeat} {name:22s} {seconds:8.2f} s"
                f"  rss {rss / 1024:7.0f} MiB"
            )
    summary = {
        name: {
            "seconds": statistics.median(s for s, _ in values),
            "runs": [round(s, 2) for s, _ in values],
            "rss_mib": max(r for _, r in values),
        }
        for name, values in results.items()
    }
    facts["load average at end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    codes = {
        name: sorted(
            {
                p["code"]
                for p in report["problems"]
                if p["code"]
                in ("identical-sources", "repeated-documents", "shared-documents", "split-overlap")
            }
        )
        for name, report in reports.items()
    }
    dups = {name: report["duplicates"] for name, report in reports.items()}
    print(json.dumps({"facts": facts, "summary": summary, "codes": codes, "duplicates": dups},
                     indent=1, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
