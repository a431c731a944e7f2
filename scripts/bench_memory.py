#!/usr/bin/env python3
"""Host memory of Megatron's DataLoader workers, stock ``GPTDataset`` against
``RepackedGPTDataset``, side by side.

For every number of sources (``--sources``, default 300, 3,000 and 10,000), sequence length
(``--seq-lengths``, default 1,024 and 4,096) and ``create_attention_mask`` (on and off), each
class builds Megatron's blended train dataset of the same blend (``split="100,0,0"``, a warm
index cache: a cold build ran first, in a process of its own), then a ``torch`` DataLoader with
``--workers`` workers (default 2, forked, as Megatron's) reads ``--samples`` samples (default
6,000) in a shuffled order, the same for every run, in batches of ``--batch-size``. Measured,
from ``/proc/PID/smaps_rollup``:

* the main process after the build: anonymous memory, RSS and PSS;
* each worker after the last batch (the workers still alive): the same three, and how many
  sources its samples came from.

Every run is a new Python process (``--child``). A run whose stock workers would hold more
than ``--budget`` (default 70 % of this machine's available memory) by repack's own estimate
(``repack.doctor.memory``) is not started, and the table says so: stock at 4,096 tokens holds
16 MiB of masks per source in every worker.

With ``--doctor``, ``repack doctor`` is also run on each blend, and its estimate of a stock
worker's masks set beside the growth measured between the smallest and the largest blend.

Usage::

    python scripts/bench_memory.py                                  # the whole matrix
    python scripts/bench_memory.py --sources 300,3000 --seq-lengths 1024 --doctor --json

Needs the ``megatron`` extra (megatron-core, torch). Raises its open-file limit where it may
(stock Megatron holds 3 descriptors per source).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loader import _init_process_group as init_process_group
from bench_loader import generate_sources, prepare_blend

MIB = 1 << 20
SEED = 1234
FIELDS = {"Anonymous": "anon", "Rss": "rss", "Pss": "pss"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def rollup(pid: int | str = "self") -> dict[str, int]:
    """Anonymous memory, RSS and PSS of a process, in bytes (``/proc/PID/smaps_rollup``)."""
    found = {}
    with open(f"/proc/{pid}/smaps_rollup") as stream:
        for line in stream:
            name, _, rest = line.partition(":")
            if name in FIELDS:
                found[FIELDS[name]] = int(rest.split()[0]) * 1024
    return found


# --- the measuring child ------------------------------------------------------------------------


def child(job: dict) -> dict:
    """Build, read ``samples`` shuffled samples through a DataLoader, measure."""
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from repack.megatron import dataset_class

    init_process_group()  # BlendedDataset asks for the rank

    class Tokenizer:  # what GPTDataset reads of a tokenizer
        eod = 0
        vocab_size = 65535

        def __init__(self) -> None:
            self.unique_identifiers = {"class": "BenchTokenizer", "vocab_size": 65535}

    items = json.loads(Path(job["blend"]).read_text())
    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=job["seq_length"],
        blend=([str(p) for p in items[1::2]], [float(w) for w in items[0::2]]),
        split="100,0,0",
        tokenizer=Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=job["masks"],
        path_to_cache=job["cache"],
    )
    cls = dataset_class(job["repack"]) if job["class"] == "repack" else GPTDataset
    t0 = time.perf_counter()
    train = BlendedMegatronDatasetBuilder(cls, [job["train"], 0, 0], lambda: True, config).build()[
        0
    ]
    built = time.perf_counter() - t0
    result = {"build_s": built, "main": rollup()}
    if job.get("build_only"):
        return result
    indices = np.random.default_rng(SEED).permutation(len(train))[: job["samples"]]
    loader = torch.utils.data.DataLoader(
        train, batch_size=job["batch_size"], sampler=indices.tolist(), num_workers=job["workers"]
    )
    batches = len(loader)
    t0 = time.perf_counter()
    stream = iter(loader)
    for _ in range(batches):  # the last batch: the workers are still there, waiting for more
        next(stream)
    result["read_s"] = time.perf_counter() - t0
    result["workers"] = [rollup(worker.pid) for worker in stream._workers]
    sources = np.asarray(train.dataset_index)[indices]
    for number, worker in enumerate(result["workers"]):  # batch b goes to worker b % workers
        mine = [
            sources[b * job["batch_size"] : (b + 1) * job["batch_size"]]
            for b in range(number, batches, job["workers"])
        ]
        worker["sources"] = len(np.unique(np.concatenate(mine))) if mine else 0
    del stream
    return result


def run_child(job: dict, timeout: float) -> dict:
    """One run in a new process; ``{"error": ...}`` if it fails."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as spec:
        json.dump(job, spec)
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--child", spec.name],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    finally:
        os.unlink(spec.name)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    lines = done.stderr.strip().splitlines() or ["no output"]
    # the cause, not what a half-built object's __del__ says after it (stock at 10,000
    # sources: "[Errno 24] Too many open files", then an AttributeError from its reader)
    causes = [line for line in lines if "Errno" in line] or lines
    return {"error": f"exit status {done.returncode}: {causes[-1].strip()}"}


# --- the matrix -----------------------------------------------------------------------------------


def doctor_estimate(blend: Path, job: dict) -> dict | None:
    """``repack doctor --json``'s host memory figures for the run of ``job``."""
    command = [
        sys.executable, "-m", "repack", "doctor", "-q", str(blend), "--json",
        "--seq-length", str(job["seq_length"]), "--split", "100,0,0",
        "--samples", f"{job['train']},0,0", "--workers", str(job["workers"]),
        "--ranks-per-node", "1",
    ]  # fmt: skip
    if not job["masks"]:
        command.append("--no-create-attention-mask-in-dataloader")
    done = subprocess.run(command, capture_output=True, text=True)
    try:
        return json.loads(done.stdout)["resources"]["memory"]
    except (ValueError, KeyError):
        log(f"doctor gave no memory figures: {done.stderr.strip()[-300:]}")
        return None


def expected_sources(blend: Path, draws: int) -> float:
    """The sources a worker's ``draws`` samples are expected to come from: each source ``i``,
    drawn with probability ``p_i`` (its normalized weight), is among them with probability
    ``1 - (1 - p_i) ** draws``."""
    weights = np.array(json.loads(blend.read_text())[0::2], dtype=float)
    p = weights / weights.sum()
    return float(np.sum(1 - (1 - p) ** draws))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir(), "bench-memory"))
    parser.add_argument("--sources", default="300,3000,10000")
    parser.add_argument("--seq-lengths", default="1024,4096")
    parser.add_argument("--masks", default="on,off", help="create_attention_mask: on, off or both")
    parser.add_argument("--classes", default="stock,repack", help="stock, repack or both")
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--budget", type=float, default=None, help="GiB (default 70%% of free)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--doctor", action="store_true", help="set repack doctor's estimate beside")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:  # stock Megatron keeps 3 descriptors per source open
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(hard, 1 << 16), max(hard, 1 << 16)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(Path(args.child).read_text()))), flush=True)
        return 0

    from repack.doctor.memory import mask_bytes_per_source

    counts = sorted(int(c) for c in args.sources.split(","))
    lengths = [int(s) for s in args.seq_lengths.split(",")]
    masks = [m == "on" for m in args.masks.split(",")]
    if args.budget is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        args.budget = 0.7 * available / (1 << 30)
    pairs = generate_sources(args.data / "data", counts[-1], SEED)
    rows = []
    for count in counts:
        blend, out = prepare_blend(args.data, pairs, count)
        for length in lengths:
            for mask in masks:
                for name in args.classes.split(","):
                    job = {
                        "class": name, "blend": str(blend), "repack": str(out),
                        "cache": str(args.data / f"cache-{name}-{count}"),
                        "seq_length": length, "masks": mask, "workers": args.workers,
                        "samples": args.samples, "batch_size": args.batch_size,
                        "train": max(3 * args.samples, 2 * count),
                    }  # fmt: skip
                    row = {k: job[k] for k in ("class", "seq_length", "masks")}
                    row["sources"] = count
                    touched = expected_sources(blend, args.samples // args.workers)
                    needed = touched * mask_bytes_per_source(length, mask, name == "stock")
                    if needed * args.workers > args.budget * (1 << 30):
                        row["skipped"] = (
                            f"predicted {needed / (1 << 30):.1f} GiB per worker, x "
                            f"{args.workers} workers > --budget {args.budget:.1f} GiB"
                        )
                        log(f"{count} sources, S={length}, masks {mask}, {name}: skipped")
                        rows.append(row)
                        continue
                    run_child({**job, "build_only": True}, args.timeout)  # the warm cache
                    log(f"{count} sources, S={length}, masks {mask}, {name}: running")
                    row.update(run_child(job, args.timeout))
                    if args.doctor and name == "stock":
                        row["doctor"] = doctor_estimate(blend, job)
                    rows.append(row)
    checks = doctor_checks(rows)
    if args.json:
        report = {"args": vars(args) | {"data": str(args.data)}, "rows": rows, "doctor": checks}
        print(json.dumps(report))
        return 0
    print(
        f"{'sources':>8} {'S':>5} {'masks':>5} {'class':>6} {'worker anon MiB':>17} "
        f"{'RSS':>7} {'PSS':>7} {'touched':>8} {'main anon':>10} {'main PSS':>9}"
    )
    for row in rows:
        head = (
            f"{row['sources']:>8,} {row['seq_length']:>5} {'on' if row['masks'] else 'off':>5} "
            f"{row['class']:>6}"
        )
        if "skipped" in row or "error" in row:
            print(f"{head} {row.get('skipped') or row.get('error')}")
            continue
        w = row["workers"]

        def span(key: str, w=w) -> str:
            low, high = (f"{f(x[key] for x in w) / MIB:,.0f}" for f in (min, max))
            return low if low == high else f"{low}-{high}"

        print(
            f"{head} {span('anon'):>17} {span('rss'):>7} {span('pss'):>7} "
            f"{'/'.join(str(x['sources']) for x in w):>8} {row['main']['anon'] / MIB:>10,.0f} "
            f"{row['main']['pss'] / MIB:>9,.0f}"
        )
    for check in checks:
        print(
            f"doctor, {check['sources']:,} sources, S={check['seq_length']}: "
            f"{check['doctor_per_source'] / MIB:.2f} MiB per source predicted, "
            f"{check['measured_per_source'] / MIB:.2f} measured per source read "
            f"(worker with masks - without, / its sources): ratio {check['ratio']:.2f}"
        )
    return 0


def doctor_checks(rows: list[dict]) -> list[dict]:
    """The doctor's stock figure per source against the growth measured: a stock worker's
    anonymous memory with masks less the same worker's without, per source it read from
    (the worker that grew most)."""
    found = {}
    for row in rows:
        if row["class"] == "stock" and "workers" in row:
            found[(row["sources"], row["seq_length"], row["masks"])] = row
    checks = []
    for (sources, length, masks), row in sorted(found.items()):
        off = found.get((sources, length, False))
        if not masks or off is None or not row.get("doctor"):
            continue
        per_source = max(
            (on["anon"] - without["anon"]) / on["sources"]
            for on, without in zip(row["workers"], off["workers"])
        )
        predicted = row["doctor"]["stock"]["per_source"]
        checks.append(
            {
                "sources": sources,
                "seq_length": length,
                "doctor_per_source": predicted,
                "measured_per_source": per_source,
                "ratio": predicted / per_source if per_source > 0 else None,
            }
        )
    return checks


if __name__ == "__main__":
    sys.exit(main())
