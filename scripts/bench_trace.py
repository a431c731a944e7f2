#!/usr/bin/env python3
"""Benchmark ``repack trace``: one iteration, and every read of one document, on a large run.

Generates (or reuses) a blend with ``python -m repack.synth DIR --sources N``, merges it with
``repack merge`` when ``--target repack``, then, each step in a new Python process started for
it (as a user's command is):

* **cold**: the first trace of the run, which builds Megatron's indices (every source's
  ``GPTDataset`` arrays and the ``BlendedDataset``'s, Megatron's own code) into
  ``--data-cache-path`` (a repack: its index pack);
* **iteration** (``--repeat`` times): the samples of the middle iteration, with the indices
  there;
* **document** (``--repeat`` times): every read of one document, the first document of that
  iteration's first sample.

Each warm run reports its phases: importing torch and Megatron-Core, building the run's
datasets on the cached indices (Megatron maps them), and the query itself; and its wall time
as a process. Medians over ``--repeat``.

Usage::

    python scripts/bench_trace.py --data /tmp/trace-bench --sources 10000 \\
        --train-samples 10000000 --global-batch-size 1024 --micro-batch-size 4 \\
        --data-parallel-size 64
    python scripts/bench_trace.py --data /tmp/trace-bench-100 --sources 100 \\
        --train-samples 100000000 --dataloader-type cyclic --json

Needs megatron-core and torch.
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

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("import_s", "build_s", "query_s", "wall_s")


def _child(args: argparse.Namespace) -> None:
    """One warm (or cold) trace, its phases timed; prints JSON."""
    started = time.perf_counter()
    import warnings

    warnings.simplefilter("ignore")
    import torch  # noqa: F401
    from megatron.core.datasets import gpt_dataset  # noqa: F401

    imported = time.perf_counter()
    import logging

    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    from repack.trace.draws import DrawSettings, build_draws
    from repack.trace.query import Tracer
    from repack.trace.run import installed_release
    from repack.trace.settings import TraceSettings, release_of

    settings = TraceSettings.from_values(_values(args), release_of(installed_release()))
    v = settings.values
    draws = build_draws(
        args.target_path,
        DrawSettings(
            int(v["seq_length"]),
            split=v["split"],
            sizes=settings.sizes,
            data_cache_path=args.cache,
        ),
    )
    tracer = Tracer(draws, settings)
    built = time.perf_counter()
    middle = settings.train_iters // 2 + 1
    out: dict = {"import_s": imported - started, "build_s": built - imported}
    if args.child == "document":
        source, document = args.document.rsplit(":", 1)
        answer = tracer.document(source, int(document))
        out["reads"] = len(answer.train) + len(answer.validation)
    else:
        answer = tracer.iterations(middle, middle, tokens=True)
        first = answer.train[0]
        out["samples"] = len(answer.train)
        out["document"] = f"{first['source']}:{first['documents'][0]['document']}"
    out["query_s"] = time.perf_counter() - built
    out["train_iters"] = settings.train_iters
    out["iteration"] = middle
    out["sizes"] = list(settings.sizes)
    print(json.dumps(out))


def _values(args: argparse.Namespace) -> dict:
    return {
        "seq_length": args.seq_length,
        "split": "100,0,0",  # the demo blend has sources of one sequence
        "train_samples": args.train_samples,
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": args.micro_batch_size,
        "data_parallel_size": args.data_parallel_size,
        "dataloader_type": args.dataloader_type,
        "eval_interval": args.eval_interval,
        "eval_iters": 1,
    }


def _run_child(args: argparse.Namespace, kind: str, document: str | None = None) -> dict:
    command = [sys.executable, __file__, *sys.argv[1:], "--child", kind]
    if document:
        command += ["--document", document]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"bench_trace: {kind} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="folder of the blend (made if missing)")
    parser.add_argument("--sources", type=int, default=10_000)
    parser.add_argument("--train-samples", type=int, default=10**7)
    parser.add_argument("--seq-length", type=int, default=16)
    parser.add_argument("--global-batch-size", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--data-parallel-size", type=int, default=64)
    parser.add_argument("--eval-interval", type=int, default=1000)
    parser.add_argument("--dataloader-type", choices=("single", "cyclic"), default="single")
    parser.add_argument("--target", choices=("blend", "repack"), default="blend")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--document", help=argparse.SUPPRESS)
    args = parser.parse_args()
    data = Path(args.data).absolute()
    blend = data / "blend" / "blend.json"
    repack = data / "out"
    args.target_path = str(repack if args.target == "repack" else blend)
    args.cache = str(data / f"cache-{args.target}")
    if args.child:
        _child(args)
        return
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if not blend.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "repack.synth",
                str(blend.parent),
                "--sources",
                str(args.sources),
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
    if args.target == "repack" and not repack.exists():
        subprocess.run(
            [sys.executable, "-m", "repack", "merge", "-q", str(blend), str(repack)],
            check=True,
            env=env,
        )
    cold = _run_child(args, "iteration")
    iteration = [_run_child(args, "iteration") for _ in range(args.repeat)]
    document = cold["document"]
    reverse = [_run_child(args, "document", document) for _ in range(args.repeat)]

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    report = {
        "sources": args.sources,
        "train_samples": args.train_samples,
        "sizes": cold["sizes"],
        "train_iters": cold["train_iters"],
        "target": args.target,
        "dataloader_type": args.dataloader_type,
        "cold": cold,
        "iteration": {
            k: median(iteration, k) for k in ("import_s", "build_s", "query_s", "wall_s")
        },
        "document": {k: median(reverse, k) for k in ("import_s", "build_s", "query_s", "wall_s")},
        "iteration_samples": iteration[0]["samples"],
        "document_name": document,
        "document_reads": reverse[0]["reads"],
        "load": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{args.sources:,} sources, {args.train_samples:,} train samples "
        f"({cold['train_iters']:,} iterations), {args.target}, {args.dataloader_type}"
    )
    print(f"cold (builds the indices): {cold['wall_s']:.1f} s")
    for name in ("iteration", "document"):
        r = report[name]
        print(
            f"{name}: query {r['query_s']:.3f} s; datasets on the cached indices "
            f"{r['build_s']:.1f} s; imports {r['import_s']:.1f} s; process {r['wall_s']:.1f} s"
        )
    print(
        f"iteration {cold['iteration']:,}: {report['iteration_samples']:,} samples; "
        f"{document}: {report['document_reads']:,} reads"
    )


if __name__ == "__main__":
    main()
