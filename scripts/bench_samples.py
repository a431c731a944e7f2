#!/usr/bin/env python3
"""Benchmark ``repack.samples.GPTSamples`` against megatron-core's own ``GPTDataset`` and
``BlendedDataset`` on the same repack, side by side.

Generates (or reuses, ``--data DIR``) blends of ``--sources`` uint16 prefixes (the sources of
``scripts/bench_loader.py``), merges each, then runs, every run in a new Python process:

* ``megatron``: ``BlendedMegatronDatasetBuilder(dataset_class(REPACK), ...)`` (megatron-core's
  ``GPTDataset.__getitem__`` and ``BlendedDataset``, reading the repack), on an empty
  ``path_to_cache`` (cold) and again on what it left (warm);
* ``samples``: ``GPTSamples(REPACK, ...)`` with the same settings (it keeps no cache).

Each run reports the import time (torch and megatron-core, or repack.samples), the time to the
first sample (build + one sample), and samples per second over ``--samples`` random indices
(the same for every run; a CRC of their tokens checks that both read the same). Medians over
``--repeat`` runs.

Usage::

    python scripts/bench_samples.py --data /tmp/bench-samples --sources 1000,10000 --repeat 3

Needs the ``megatron`` extra (megatron-core, torch) for the ``megatron`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loader import generate_sources, prepare_blend

SEED = 1234
SAMPLES_PER_SOURCE = 20


def _settings(job: dict) -> dict:
    items = json.loads(Path(job["blend"]).read_text())
    return {
        "blend": ([str(p) for p in items[1::2]], [float(w) for w in items[0::2]]),
        "sizes": [SAMPLES_PER_SOURCE * job["sources"], 0, 0],
    }


def _run_megatron(job: dict) -> dict:
    t0 = time.perf_counter()
    import logging

    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from repack.megatron import dataset_class

    imported = time.perf_counter() - t0
    logging.disable(logging.WARNING)
    with tempfile.NamedTemporaryFile(prefix="bench-dist-") as rendezvous:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{rendezvous.name}", rank=0, world_size=1
        )

    class Tokenizer:
        vocab_size = 65000
        eod = 0
        unique_identifiers = {"class": "BenchTokenizer"}  # noqa: RUF012

    s = _settings(job)
    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=job["seq_length"],
        blend=s["blend"],
        split="100,0,0",
        tokenizer=Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=job["cache"],
    )
    import gc

    gc.collect()
    t1 = time.perf_counter()
    train = BlendedMegatronDatasetBuilder(
        dataset_class(job["repack"]), s["sizes"], lambda: True, config
    ).build()[0]
    train[0]
    first = time.perf_counter() - t1
    return _read(train, job, imported, first, lambda v: v.numpy())


def _run_samples(job: dict) -> dict:
    t0 = time.perf_counter()
    from repack.samples import GPTSamples

    imported = time.perf_counter() - t0
    s = _settings(job)
    import gc

    gc.collect()
    t1 = time.perf_counter()
    train = GPTSamples(
        job["repack"],
        blend=s["blend"],
        sizes=s["sizes"],
        random_seed=SEED,
        sequence_length=job["seq_length"],
        split="100,0,0",
        eod=0,
        create_attention_mask=False,
    )
    train[0]
    first = time.perf_counter() - t1
    return _read(train, job, imported, first, lambda v: v)


def _read(train, job: dict, imported: float, first: float, as_numpy) -> dict:
    indices = np.random.default_rng(SEED).integers(0, len(train), job["samples"])
    crc = 0
    t = time.perf_counter()
    for i in indices.tolist():
        crc = zlib.crc32(as_numpy(train[i]["tokens"]).tobytes(), crc)
    seconds = time.perf_counter() - t
    return {
        "import_s": imported,
        "first_s": first,
        "samples_per_s": len(indices) / seconds,
        "length": len(train),
        "crc": f"{crc:08x}",
        "torch_loaded": "torch" in sys.modules,
    }


def run(job: dict) -> dict:
    """One run in a new process (as a job starts)."""
    out = subprocess.run(
        [sys.executable, __file__, "--job", json.dumps(job)],
        capture_output=True,
        text=True,
        check=False,
        timeout=3600,
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/tmp/bench-samples")
    parser.add_argument("--sources", default="1000,10000")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        job = json.loads(args.job)
        result = _run_samples(job) if job["kind"] == "samples" else _run_megatron(job)
        print(json.dumps(result))
        return 0
    root = Path(args.data)
    counts = [int(c) for c in args.sources.split(",")]
    pairs = generate_sources(root / "data", max(counts), SEED)
    print(f"machine: nproc {os.cpu_count()}, python {platform.python_version()}")
    print(f"load average before: {os.getloadavg()}")
    rows = []
    for count in counts:
        blend, repack = prepare_blend(root, pairs, count)
        base = {
            "blend": str(blend),
            "repack": str(repack),
            "sources": count,
            "seq_length": args.seq_length,
            "samples": args.samples,
        }
        results: dict[str, list[dict]] = {"megatron cold": [], "megatron warm": [], "samples": []}
        for _ in range(args.repeat):
            cache = Path(tempfile.mkdtemp(prefix="bench-samples-cache-", dir=root))
            job = {**base, "kind": "megatron", "cache": str(cache)}
            results["megatron cold"].append(run(job))
            results["megatron warm"].append(run(job))
            shutil.rmtree(cache)
            results["samples"].append(run({**base, "kind": "samples", "cache": ""}))
        crcs = {r["crc"] for rs in results.values() for r in rs}
        lengths = {r["length"] for rs in results.values() for r in rs}
        assert len(crcs) == 1 and len(lengths) == 1, (crcs, lengths)
        for name, rs in results.items():
            rows.append(
                (
                    count,
                    name,
                    statistics.median(r["import_s"] for r in rs),
                    statistics.median(r["first_s"] for r in rs),
                    statistics.median(r["samples_per_s"] for r in rs),
                    rs[0]["torch_loaded"],
                )
            )
    print(f"load average after: {os.getloadavg()}")
    print(
        f"medians of {args.repeat} runs, each in a new process; {SAMPLES_PER_SOURCE} train "
        f"samples per source, split 100,0,0, sequence length {args.seq_length}, "
        f"{args.samples} random samples read; same tokens in every run (CRC)"
    )
    print(
        f"{'sources':>8}  {'reader':<14}{'import s':>9}{'build+1st s':>13}{'samples/s':>11}  torch"
    )
    for count, name, imported, first, rate, torch_loaded in rows:
        print(
            f"{count:>8,}  {name:<14}{imported:>9.2f}{first:>13.2f}{rate:>11,.0f}  "
            f"{'yes' if torch_loaded else 'no'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
