#!/usr/bin/env python3
"""Benchmark ``repack prepare`` against the job's own cold build, and the job's build after it.

Generates a blend of ``--sources`` prefixes (``python -m repack.synth``), merges it, then, each
in a new process (imports not timed, but for the ``prepare`` commands' wall time):

* the job's cold build: ``BlendedMegatronDatasetBuilder`` with the repacked class, an empty
  cache folder, and its first sample (which packs the indices);
* ``repack prepare`` with the job's settings, ``--workers 1`` and ``--workers W``, each into an
  empty cache folder (the seconds it reports, and its wall time);
* the job's build and first sample after ``prepare`` (no file written: checked), and a warm
  build (the cache the cold build left) for comparison.

    python scripts/bench_prepare.py --sources 3000 --workers 2 [--data DIR]
    python scripts/bench_prepare.py --sources 3000 --workers 2 --data DIR --jobs-only 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

JOB = r"""
import json, os, sys, time, warnings
warnings.simplefilter("ignore")
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from repack.megatron import dataset_class
from repack.read.reader import Repack

repack, cache, seq, iters, gbs, tokenizer = sys.argv[1:7]
class Tok:
    eod = 0
    vocab_size = 65536
    unique_identifiers = json.loads(tokenizer)
torch.distributed.init_process_group(
    "gloo", init_method="file://" + os.path.join(cache + ".store"), rank=0, world_size=1)
blend = Repack(repack).manifest.blend
entries = blend.splits["all"]
config = GPTDatasetConfig(
    random_seed=1234, sequence_length=int(seq),
    blend=([e.path for e in entries], [e.weight for e in entries]), split="100,0,0",
    tokenizer=Tok(), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
    path_to_cache=cache)
before = {n: os.stat(os.path.join(cache, n)).st_mtime_ns for n in os.listdir(cache)} \
    if os.path.isdir(cache) else {}
started = time.perf_counter()
train, _, _ = BlendedMegatronDatasetBuilder(
    dataset_class(repack), [int(iters) * int(gbs), 0, 0], lambda: True, config).build()
built = time.perf_counter() - started
train[0]
first = time.perf_counter() - started
after = {n: os.stat(os.path.join(cache, n)).st_mtime_ns for n in os.listdir(cache)}
print(json.dumps({"build": built, "build_and_first_sample": first,
                  "files_written": sum(1 for n, t in after.items() if before.get(n) != t)}))
"""

TOKENIZER = json.dumps({"class": "BenchTok", "vocab_size": 65536})


def job(repack: str, cache: str, seq: int, iters: int, gbs: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", JOB, repack, cache, str(seq), str(iters), str(gbs), TOKENIZER],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def prepare(repack: str, cache: str, seq: int, iters: int, gbs: int, workers: int) -> dict:
    started = time.perf_counter()
    out = subprocess.run(
        [
            *(sys.executable, "-m", "repack.cli", "prepare", repack, "--seq-length", str(seq)),
            *("--split", "100,0,0", "--train-iters", str(iters), "--global-batch-size", str(gbs)),
            *("--eval-iters", "0", "--data-cache-path", cache, "--tokenizer-identifiers"),
            *(TOKENIZER, "--workers", str(workers), "--json", "-q"),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found = json.loads(out)
    return {
        "seconds": found["seconds"],
        "wall": time.perf_counter() - started,
        "files": len(found["files"]),
        "bytes": found["bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--train-iters", type=int, default=1000)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--data", help="a folder to keep the blend and repack in")
    parser.add_argument(
        "--jobs-only",
        type=int,
        metavar="N",
        help="with --data of an earlier run: time only the job's builds on the caches it left "
        "(warm, and after each prepare), N rounds interleaved, and print their medians",
    )
    args = parser.parse_args()
    root = args.data or tempfile.mkdtemp(prefix="bench-prepare-")
    repack = os.path.join(root, "out")
    if args.jobs_only:
        run = (args.seq_length, args.train_iters, args.global_batch_size)
        caches = {"job warm build": "cold"}
        for workers in sorted({1, args.workers}):
            caches[f"job after prepare --workers {workers}"] = f"prepared-{workers}"
        times: dict[str, list[float]] = {name: [] for name in caches}
        for _ in range(args.jobs_only):  # interleaved: the machine's load hits all alike
            for name, folder in caches.items():
                found = job(repack, os.path.join(root, "caches", folder), *run)
                if found["files_written"]:
                    raise SystemExit(f"{name}: wrote {found['files_written']} files")
                times[name].append(found["build_and_first_sample"])
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(json.dumps({"sources": args.sources, "runs": times, "medians": medians}, indent=2))
        return
    if not os.path.isdir(repack):
        subprocess.run(
            [
                *(sys.executable, "-m", "repack.synth", os.path.join(root, "blend")),
                *("--sources", str(args.sources)),
            ],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [
                *(sys.executable, "-m", "repack.cli", "merge", "-q"),
                *(os.path.join(root, "blend", "blend.json"), repack),
            ],
            check=True,
            capture_output=True,
        )
    caches = os.path.join(root, "caches")
    shutil.rmtree(caches, ignore_errors=True)
    os.makedirs(caches)
    run = (args.seq_length, args.train_iters, args.global_batch_size)
    rows = {}
    rows["job cold build"] = job(repack, os.path.join(caches, "cold"), *run)
    rows["job warm build"] = job(repack, os.path.join(caches, "cold"), *run)
    for workers in sorted({1, args.workers}):
        cache = os.path.join(caches, f"prepared-{workers}")
        rows[f"prepare --workers {workers}"] = prepare(repack, cache, *run, workers)
        rows[f"job after prepare --workers {workers}"] = job(repack, cache, *run)
    print(json.dumps({"sources": args.sources, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
