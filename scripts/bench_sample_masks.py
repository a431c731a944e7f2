#!/usr/bin/env python3
"""Samples whose masks are computed per sample, in a forked DataLoader worker, stock
``GPTDataset`` against ``RepackedGPTDataset``, side by side.

With ``reset_attention_mask`` (or ``reset_position_ids``, ``eod_mask_loss``) Megatron computes
each sample's masks anew: ``S x S`` temporaries (4 MiB at ``S = 1,024``) allocated and freed per
sample. How glibc serves them depends on its mmap threshold, which it raises as a process frees
large blocks (a build of thousands of sources frees several MiB) and which a worker inherits:
from the heap, or mapped and faulted in again for every sample. This measures the cost per
sample either way (issue 44: a worker whose thresholds were fixed back to 128 KiB took 1.5-3x
as long per sample as one that kept glibc's).

For each class and each of ``--repeat`` rounds (the classes alternating), a new Python process
builds Megatron's blended train dataset of ``--sources`` generated sources (``split="100,0,0"``,
its index cache warmed by a first build), then a DataLoader with one forked worker reads
``--samples`` samples in order, in batches of 8; the time after the first batch is divided by
the samples read.

Usage::

    python scripts/bench_sample_masks.py --data /tmp/bsm --sources 3000 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loader import generate_sources, prepare_blend

SEED = 1234


def child(job: dict) -> dict:
    """One build and read, in this process."""
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    import torch
    from bench_loader import _init_process_group, _Tokenizer
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    torch.set_num_threads(1)
    _init_process_group()
    if job["class"] == "stock":
        cls = GPTDataset
    else:
        from repack.megatron import dataset_class

        cls = dataset_class(job["repack"])
    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=job["seq_length"],
        blend=(job["prefixes"], job["weights"]),
        split="100,0,0",
        tokenizer=_Tokenizer(),
        reset_position_ids=True,
        reset_attention_mask=True,
        eod_mask_loss=False,
        create_attention_mask=True,
        path_to_cache=job["cache"],
        mmap_bin_files=True,
    )
    samples = job["samples"]
    builder = BlendedMegatronDatasetBuilder(cls, [samples * 2, 0, 0], lambda: True, config)
    train = builder.build()[0]
    loader = torch.utils.data.DataLoader(
        train, batch_size=8, num_workers=1, sampler=range(samples), prefetch_factor=2
    )
    batches = iter(loader)
    next(batches)
    start, read = time.perf_counter(), 0
    for batch in batches:
        read += len(batch["tokens"])
    return {"ms_per_sample": (time.perf_counter() - start) / read * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="work folder to create or reuse (default: temp)")
    parser.add_argument("--sources", type=int, default=3000)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    root = args.data or Path(tempfile.mkdtemp(prefix="bench-sample-masks-"))
    root.mkdir(parents=True, exist_ok=True)
    pairs = generate_sources(root / "data", args.sources, SEED)
    _, out = prepare_blend(root, pairs, args.sources)
    job = {
        "prefixes": [p for _, p in pairs],
        "weights": [w for w, _ in pairs],
        "repack": str(out),
        "seq_length": args.seq_length,
        "samples": args.samples,
    }
    times: dict[str, list[float]] = {"stock": [], "repack": []}
    for round_ in range(args.repeat + 1):  # round 0 builds the caches cold: not counted
        for name in times:
            cache = root / f"cache-{name}-{args.sources}-{args.seq_length}"
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    json.dumps({**job, "class": name, "cache": str(cache)}),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            if round_:
                times[name].append(json.loads(done.stdout.splitlines()[-1])["ms_per_sample"])
    result = {
        "sources": args.sources,
        "seq_length": args.seq_length,
        "runs": times,
        "median_ms_per_sample": {k: statistics.median(v) for k, v in times.items()},
    }
    result["repack_over_stock"] = (
        result["median_ms_per_sample"]["repack"] / result["median_ms_per_sample"]["stock"]
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, values in times.items():
            runs = ", ".join(f"{v:.2f}" for v in values)
            print(f"{name}: median {statistics.median(values):.2f} ms/sample ({runs})")
        print(f"repack / stock: {result['repack_over_stock']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
