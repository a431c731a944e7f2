"""``repack bench`` as one call: the run's datasets -> the planned reads -> the page cache
emptied -> the replay -> this node's result (and the same for the original prefixes)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from repack.bench.pagecache import evict, resident
from repack.bench.plan import Plan, plan_reads
from repack.bench.replay import replay
from repack.bench.report import node_result
from repack.errors import InputError
from repack.store import open_store
from repack.trace.run import open_run

__all__ = ["bench", "step_seconds"]

#: Ranks a node hosts when ``--ranks`` is not given: one node of 8 GPUs.
GPUS_PER_NODE = 8


def step_seconds(
    step_time: float | None, tokens_per_second: float | None, global_batch: int, seq_length: int
) -> float | None:
    """Seconds per iteration: given, or the run's global batch of tokens at
    ``tokens_per_second`` (the whole run's throughput); None: flat out."""
    if step_time is not None and tokens_per_second is not None:
        raise InputError("give --step-time or --tokens-per-second, not both")
    if tokens_per_second is not None:
        return global_batch * seq_length / tokens_per_second
    return step_time


def _layout(opened: Any) -> str:
    split = opened.tracer.draws.split("train")
    view = split.datasets[0].dataset.dataset if split.datasets else None
    return "repack" if hasattr(view, "byte_ranges") else "prefixes"


def _cache(plan: Plan, warm: bool, say: Callable[[str], object]) -> dict[str, Any]:
    """Empty this node's page cache of the plan's files (unless ``warm``), then count what it
    still holds of the pages the replay reads."""
    if plan.layout == "repack" and open_store(plan.location).caches_reads:
        # every read a request (object storage): no page cache of this node's to empty
        return {"mode": "object storage", "resident": 0, "pages": 0}
    used = np.unique(plan.read_file)
    paths = [plan.files[int(k)] for k in used]
    if not warm:
        say(f"evicting {len(paths):,} files from this node's page cache")
        evict(paths)
    held = pages = 0
    for k in used:
        pick = plan.read_file == k
        a, b = resident(plan.files[int(k)], plan.read_offset[pick], plan.read_size[pick])
        held, pages = held + a, pages + b
    return {"mode": "warm" if warm else "cold", "resident": held, "pages": pages}


def bench(
    target: Any,
    values: dict[str, Any],
    *,
    typed: set[str] | None = None,
    checkpoint: Any = None,
    release: str | None = None,
    blend_file: Any = None,
    fma: bool | None = None,
    ranks: tuple[int, ...] | None = None,
    workers: int = 2,
    first: int = 1,
    iterations: int = 20,
    seconds: float | None = None,
    step_time: float | None = None,
    tokens_per_second: float | None = None,
    prefetch_factor: int = 2,
    warm: bool = False,
    prefixes: Any = None,
    progress: Callable[[str, int], Callable[[int], object]] | None = None,
    say: Callable[[str], object] | None = None,
) -> list[dict[str, Any]]:
    """Replay a run's reads on this node; with ``prefixes`` (the blend of the original
    prefixes), the same samples from them too. Returns each layout's raw result
    (:func:`repack.bench.report.node_result`), the target's first.

    Raises:
        InputError: settings the run does not have (iterations, ranks), or both step times.
    """
    say = say or (lambda line: None)
    kinds = [(target, blend_file, checkpoint)]
    if prefixes is not None:
        kinds.append((prefixes, None, None))
    results = []
    for where, blend, ckpt in kinds:
        opened = open_run(
            where,
            values,
            typed=typed,
            checkpoint=ckpt if ckpt is not None else checkpoint,
            release=release,
            blend_file=blend,
            fma=fma,
            say=say,
        )
        settings = opened.settings
        v = settings.values
        backend = "mmap" if v["mmap_bin_files"] else "pread"  # Megatron's --no-mmap-bin-files
        dp = int(v["data_parallel_size"])
        chosen = tuple(range(min(dp, GPUS_PER_NODE))) if ranks is None else ranks
        if first > settings.train_iters:
            raise InputError(
                f"--from-iteration {first:,}: the run has iterations 1 to {settings.train_iters:,}"
            )
        last = min(first + iterations - 1, settings.train_iters)
        if last < first + iterations - 1:
            say(f"note: the run ends at iteration {last:,}: replaying {last - first + 1:,}")
        layout = _layout(opened)
        location = os.fspath(opened.target)
        if layout == "repack":
            view = opened.tracer.draws.split("train").datasets[0].dataset.dataset
            location = view.repack_dir
        plan = plan_reads(opened.tracer, first, last, chosen, workers, layout, location)
        if results and plan.bytes != results[0]["_bytes"]:
            say(
                f"warning: {where}: its samples hold {plan.bytes:,} bytes, the repack's "
                f"{results[0]['_bytes']:,}: not the same samples (another blend?)"
            )
        step = step_seconds(
            step_time,
            tokens_per_second,
            int(settings.schedule.global_batch_size),
            int(v["seq_length"]),
        )
        cache = _cache(plan, warm, say)
        say(
            f"replaying iterations {first:,}-{last:,} of {layout} {location}: "
            f"{len(chosen)} ranks x {workers} workers, {len(plan.batch_rank):,} micro-batches, "
            f"{plan.bytes:,} bytes"
        )
        measured = replay(
            plan,
            backend=backend,
            step_time=step,
            prefetch_factor=prefetch_factor,
            seconds=seconds,
            progress=progress,
        )
        first_batches = plan.batch_iteration == first
        micro = int(np.count_nonzero(first_batches & (plan.batch_rank == chosen[0])))
        run = {
            "first": first,
            "seq_length": int(v["seq_length"]),
            "global_batch_size": int(settings.schedule.global_batch_size),
            "micro_batch_size": int(v["micro_batch_size"]),
            "data_parallel_size": dp,
            "micro_batches": micro,
            "prefetch_factor": prefetch_factor,
            "step_time": step,
            "backend": backend,
        }
        result = node_result(plan, measured, cache=cache, run=run)
        result["_bytes"] = plan.bytes
        results.append(result)
    for result in results:
        result.pop("_bytes")
    return results
