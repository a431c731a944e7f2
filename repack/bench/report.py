"""What a replay says: achieved against needed, read times, stalls, and whether the bytes came
from storage at all.

A node's result is kept raw (one row per rank and iteration, and its totals), so that the
results of several nodes, each replaying its own ranks, merge into the run's
(:func:`merge_results`) and every figure is computed once, from rows (:func:`figures`).

The stall share is DLIO's accelerator utilization turned around, from the run's own pattern:
the share of iterations (after the first, whose wait is the loader's start) in which a rank
waited more than :data:`repack.bench.replay.STALL_SECONDS` for a micro-batch. Its arithmetic
is in the report: the step time, the micro-batches it is spread over, and what that asks of
storage.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from repack.bench.pagecache import PAGE
from repack.bench.plan import Plan
from repack.bench.replay import STALL_SECONDS, Measured
from repack.errors import InputError
from repack.units import format_size, plural

__all__ = ["figures", "merge_results", "node_result", "plot_result", "render"]

#: Resident pages above this share of those a replay reads: the replay measured memory.
CACHED_SHARE = 0.01
#: ``format`` of a node's result file.
FORMAT = "repack-bench/1"


def node_result(
    plan: Plan,
    measured: Measured,
    *,
    cache: dict[str, Any],
    run: dict[str, Any],
) -> dict[str, Any]:
    """This node's raw result: one row per replayed (rank, iteration), and totals.

    Args:
        cache: ``mode`` (``"cold"``, ``"warm"``, ``"object storage"``), ``resident`` and
            ``pages`` (before the replay).
        run: The run's figures the report needs (global batch size, data-parallel size,
            step time, ...).
    """
    sizes = np.bincount(plan.read_batch, weights=plan.read_size, minlength=len(plan.batch_rank))
    reads = np.bincount(plan.read_batch, minlength=len(plan.batch_rank))
    done = measured.batch_done
    rows = []
    keys = sorted({(int(r), int(i)) for r, i in zip(plan.batch_rank, plan.batch_iteration)})
    for rank, iteration in keys:
        pick = (plan.batch_rank == rank) & (plan.batch_iteration == iteration)
        if not done[pick].all():
            continue  # stopped (--seconds) before this iteration ended
        rows.append(
            [
                rank,
                iteration,
                float((measured.batch_end[pick] - measured.batch_start[pick]).sum()),
                float(measured.batch_wait[pick].sum()),
                int(plan.batch_samples[pick].sum()),
                int(sizes[pick].sum()),
                int(reads[pick].sum()),
                float(measured.batch_end[pick].max()),
            ]
        )
    fetched = [w.get("fetched_bytes") for w in measured.workers]
    store_requests = [w.get("store_requests") for w in measured.workers]
    return {
        "format": FORMAT,
        "layout": plan.layout,
        "location": plan.location,
        "ranks": list(plan.ranks),
        "workers": plan.workers,
        "seconds": measured.seconds,
        "run": run,
        "cache": cache,
        "fetched_bytes": None if any(f is None for f in fetched) else int(sum(fetched)),
        # what the workers read: the iterations replayed, and batches asked for past a stop
        "read_bytes": int(sum(w.get("read_bytes", 0) for w in measured.workers)),
        "store_requests": None
        if any(r is None for r in store_requests)
        else int(sum(store_requests)),
        "store_bytes": None
        if any(w.get("store_bytes") is None for w in measured.workers)
        else int(sum(w["store_bytes"] for w in measured.workers)),
        "files_opened": plan.opened,
        "data_mappings": max((w.get("data_mappings", 0) for w in measured.workers), default=0),
        "open_files": max((w.get("open_files", 0) for w in measured.workers), default=0),
        "columns": ["rank", "iteration", "read_s", "wait_s", "samples", "bytes", "reads", "end_s"],
        "rows": rows,
    }


def merge_results(paths: list[str]) -> dict[str, Any]:
    """The results of several nodes (files :func:`node_result` wrote) as one: their rows
    together, their counts summed, the replay as long as the longest.

    Raises:
        InputError: a file that is not a result, or results of different runs or layouts.
    """
    parts = []
    for path in paths:
        try:
            with open(path) as stream:
                found = json.load(stream)
        except (OSError, ValueError) as err:
            raise InputError(f"{path}: not a repack bench result ({err})") from None
        if not isinstance(found, dict) or found.get("format") != FORMAT:
            raise InputError(f"{path}: not a repack bench result (no format {FORMAT!r})")
        parts.append((path, found))
    first_path, merged = parts[0]
    merged = json.loads(json.dumps(merged))
    seen = set(merged["ranks"])
    for path, part in parts[1:]:
        for key in ("layout", "run"):
            if part[key] != merged[key]:
                raise InputError(f"{path}: another {key} than {first_path}'s; not one run")
        overlap = seen & set(part["ranks"])
        if overlap:
            raise InputError(f"{path}: rank {min(overlap)} is in another result too")
        seen |= set(part["ranks"])
        merged["ranks"] = sorted(seen)
        merged["rows"] += part["rows"]
        merged["seconds"] = max(merged["seconds"], part["seconds"])
        merged["read_bytes"] += part["read_bytes"]
        for key in ("fetched_bytes", "store_requests", "store_bytes"):
            a, b = merged[key], part[key]
            merged[key] = None if a is None or b is None else a + b
        for key in ("resident", "pages"):
            merged["cache"][key] = merged["cache"].get(key, 0) + part["cache"].get(key, 0)
        if part["cache"]["mode"] != merged["cache"]["mode"]:
            merged["cache"]["mode"] = "mixed"
        merged["data_mappings"] = max(merged["data_mappings"], part["data_mappings"])
        merged["open_files"] = max(merged["open_files"], part["open_files"])
    merged["nodes"] = len(parts)
    return merged


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0, "max": 0.0}
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "max": float(values.max())}


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """Every figure of the report, from a result's rows and totals."""
    rows = np.array(result["rows"], dtype=np.float64).reshape(-1, len(result["columns"]))
    rank, iteration, read_s, wait_s, samples, nbytes, reads = (rows[:, k] for k in range(7))
    run = result["run"]
    seconds = result["seconds"]
    ranks = len(result["ranks"])
    total_samples = int(samples.sum())
    total_bytes = int(nbytes.sum())
    requests = (
        result["store_requests"] if result["store_requests"] is not None else int(reads.sum())
    )
    out: dict[str, Any] = {
        "layout": result["layout"],
        "backend": run["backend"],
        "ranks": ranks,
        "workers_per_rank": result["workers"],
        "nodes": result.get("nodes", 1),
        "iterations": len(np.unique(iteration)),
        "samples": total_samples,
        "tokens": total_samples * int(run["seq_length"]),
        "bytes": total_bytes,
        "seconds": seconds,
        "requests": int(requests),
    }
    rate = (lambda x: x / seconds) if seconds > 0 else (lambda x: 0.0)
    out["achieved"] = {
        "samples_per_s": rate(total_samples),
        "tokens_per_s": rate(total_samples * int(run["seq_length"])),
        "mib_per_s": rate(total_bytes) / 2**20,
        "requests_per_s": rate(requests),
        "mean_request_bytes": total_bytes / requests if requests else 0.0,
    }
    step = run.get("step_time")
    if step:
        per_iteration = total_samples / max(1, out["iterations"])  # these ranks' samples
        out["needed"] = {
            "step_time_s": step,
            "samples_per_s": per_iteration / step,
            "tokens_per_s": per_iteration * int(run["seq_length"]) / step,
            "mib_per_s": total_bytes / max(1, out["iterations"]) / step / 2**20,
            "run_samples_per_s": int(run["global_batch_size"]) / step,
        }
    out["read_time_per_iteration_s"] = _percentiles(read_s)
    later = iteration > iteration.min() if len(iteration) else iteration.astype(bool)
    stalled = np.unique(iteration[later & (wait_s > STALL_SECONDS)])
    counted = np.unique(iteration[later])
    out["stall"] = {
        "share": len(stalled) / len(counted) if len(counted) else 0.0,
        "iterations": len(stalled),
        "of": len(counted),
        "first_iteration_wait_s": float(wait_s[~later].max()) if (~later).any() else 0.0,
        "wait_per_iteration_s": _percentiles(wait_s[later]),
        "threshold_s": STALL_SECONDS,
        "utilization": _utilization(rank, wait_s, later, step),
    }
    slowest = np.argsort(-read_s, kind="stable")[:5]
    out["slowest_iterations"] = [
        {
            "rank": int(rank[k]),
            "iteration": int(iteration[k]),
            "read_s": float(read_s[k]),
            "wait_s": float(wait_s[k]),
        }
        for k in slowest
    ]
    per_rank = {int(r): float(wait_s[later & (rank == r)].sum()) for r in np.unique(rank)}
    out["slowest_ranks"] = [
        {"rank": r, "wait_s": w} for r, w in sorted(per_rank.items(), key=lambda x: -x[1])[:5]
    ]
    cache = result["cache"]
    fetched = result["fetched_bytes"]
    out["cache"] = {
        "mode": cache["mode"],
        "resident_pages_before": cache.get("resident", 0),
        "pages_read": cache.get("pages", 0),
        "fetched_bytes": fetched if result["layout"] is not None else None,
        "sample_bytes": result["read_bytes"],
        "fetched_share": fetched / result["read_bytes"]
        if fetched and result["read_bytes"]
        else None,
        "store_bytes": result.get("store_bytes"),
    }
    out["verdict"] = _verdict(out["cache"])
    if out["verdict"] == "cached":  # memory's figures: kept apart, no storage figure
        out["page_cache"], out["achieved"] = out["achieved"], None
    out["files_opened"] = result["files_opened"]
    out["data_mappings_per_process"] = result["data_mappings"]
    out["open_files_per_process"] = result["open_files"]
    return out


def _utilization(
    rank: np.ndarray, wait_s: np.ndarray, later: np.ndarray, step: float | None
) -> float | None:
    """DLIO's accelerator utilization from the replay: per rank, the steps' time over the
    steps' time plus its waits (after the first iteration), the lowest rank's (the run goes at
    its pace); None without a step time."""
    if not step:
        return None
    found = []
    for r in np.unique(rank):
        mine = later & (rank == r)
        busy = step * int(np.count_nonzero(mine))
        if busy:
            found.append(busy / (busy + float(wait_s[mine].sum())))
    return min(found) if found else None


def _verdict(cache: dict[str, Any]) -> str:
    """``storage``, or ``cached``: the figures are the page cache's (with ``--warm``, on
    purpose; without, eviction did not hold, or another process read the files meanwhile)."""
    if cache["mode"] == "object storage":
        return "storage"
    pages = cache["pages_read"]
    if pages and cache["resident_pages_before"] > CACHED_SHARE * pages:
        return "cached"
    share = cache["fetched_share"]
    if share is not None and share < 0.5:
        return "cached"  # another process read them meanwhile, or eviction did not hold
    return "storage"


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def render(results: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    """The report's text: one block per layout (``(result, figures)`` pairs), then a
    comparison where there are two."""
    lines: list[str] = []
    for result, f in results:
        run = result["run"]
        title = "repack" if f["layout"] == "repack" else "original prefixes (stock's layout)"
        lines.append(f"{title}: {result['location']}")
        lines.append(
            f"  replayed iterations {run['first']:,}-{run['first'] + f['iterations'] - 1:,}: "
            f"{plural(f['ranks'], 'rank')} x {plural(f['workers_per_rank'], 'worker')}"
            f"{'' if f['nodes'] == 1 else ' on ' + str(f['nodes']) + ' nodes'}, "
            f"{f['samples']:,} samples, "
            f"{format_size(f['bytes'])} in {f['requests']:,} requests, {f['seconds']:.2f} s"
        )
        verdict = f["verdict"]
        cache = f["cache"]
        if verdict == "cached":
            lines.append(
                f"  CACHED: {cache['resident_pages_before']:,} of the {cache['pages_read']:,} "
                "pages read were in this node's page cache before the replay"
                + (
                    f", and the processes fetched {format_size(cache['fetched_bytes'])} for "
                    f"{format_size(cache['sample_bytes'])} of samples"
                    if cache["fetched_bytes"] is not None
                    else ""
                )
                + ": these are the page cache's figures, not storage's"
                + (" (--warm: on purpose)" if cache["mode"] == "warm" else "")
            )
        elif cache["mode"] == "object storage":
            lines.append(
                f"  object storage: {format_size(cache['store_bytes'] or 0)} fetched by ranged GETs"
                f" for {format_size(cache['sample_bytes'])} of samples"
            )
        else:
            fetched = cache["fetched_bytes"]
            lines.append(
                f"  storage: {cache['resident_pages_before']:,} of {cache['pages_read']:,} pages "
                "resident before (evicted); fetched "
                + (
                    f"{format_size(fetched)} ({100 * cache['fetched_share']:.0f} % of the "
                    f"{format_size(cache['sample_bytes'])} the workers read; the pages the plan "
                    f"reads hold {format_size(cache['pages_read'] * PAGE)})"
                    if fetched
                    else "(not counted by this file system)"
                )
            )
        a = f["achieved"]
        if a is not None:
            lines.append(
                f"  achieved: {a['samples_per_s']:,.1f} samples/s, {a['tokens_per_s']:,.0f} "
                f"tokens/s, {a['mib_per_s']:,.1f} MiB/s, {a['requests_per_s']:,.0f} requests/s "
                f"of {format_size(a['mean_request_bytes'])} on average"
            )
        needed = f.get("needed")
        if needed:
            lines.append(
                f"  needed:   {needed['samples_per_s']:,.1f} samples/s, "
                f"{needed['tokens_per_s']:,.0f} tokens/s, {needed['mib_per_s']:,.1f} MiB/s "
                f"(these ranks' {f['samples'] / max(1, f['iterations']):,.0f} samples an "
                f"iteration / a step of {_seconds(needed['step_time_s'])}; the run's "
                f"{run['global_batch_size']:,} a step: {needed['run_samples_per_s']:,.1f} "
                "samples/s)"
            )
        r = f["read_time_per_iteration_s"]
        lines.append(
            f"  read time per rank and iteration: p50 {_seconds(r['p50'])}, p95 "
            f"{_seconds(r['p95'])}, p99 {_seconds(r['p99'])}, max {_seconds(r['max'])}"
        )
        s = f["stall"]
        if needed:
            micro = run["micro_batches"]
            lines.append(
                f"  stalls: {s['iterations']} of {s['of']} iterations "
                f"({100 * s['share']:.1f} %) waited for data: a step of "
                f"{_seconds(needed['step_time_s'])} spread over {micro} micro-batches "
                f"({_seconds(needed['step_time_s'] / micro)} each), {f['workers_per_rank']} "
                f"workers x prefetch {run['prefetch_factor']} ahead; waits over "
                f"{_seconds(s['threshold_s'])} count (the first iteration's, "
                f"{_seconds(s['first_iteration_wait_s'])}, is the loader's start); "
                f"utilization {100 * s['utilization']:.1f} % (DLIO's: the slowest rank's steps "
                "over its steps and waits)"
            )
        else:
            lines.append(
                "  flat out: every batch asked for as soon as there was room; no step time, so "
                "no stall share (give --step-time or --tokens-per-second)"
            )
        worst = f["slowest_iterations"][:3]
        if worst:
            lines.append(
                "  slowest: "
                + ", ".join(
                    f"rank {w['rank']} iteration {w['iteration']:,} ({_seconds(w['read_s'])})"
                    for w in worst
                )
            )
        lines.append(
            f"  files the loader holds open: {f['files_opened']:,}; data mappings per worker: "
            f"{f['data_mappings_per_process']:,}"
        )
    if len(results) == 2:
        (_, a), (_, b) = results
        parts = [
            f"files held open {b['files_opened']:,} -> {a['files_opened']:,}",
            f"data mappings per worker {b['data_mappings_per_process']:,} -> "
            f"{a['data_mappings_per_process']:,}",
            f"read time p95 {_seconds(b['read_time_per_iteration_s']['p95'])} -> "
            f"{_seconds(a['read_time_per_iteration_s']['p95'])}",
        ]
        fetched = (b["cache"]["fetched_bytes"], a["cache"]["fetched_bytes"])
        if all(fetched):
            parts.append(f"fetched {format_size(fetched[0])} -> {format_size(fetched[1])}")
        if not a.get("needed") and a["achieved"] and b["achieved"]:
            ratio = a["achieved"]["samples_per_s"] / b["achieved"]["samples_per_s"]
            parts.append(f"flat out {ratio:.2f}x the samples/s")
        lines.append("the prefixes -> the repack: " + ", ".join(parts))
    return "\n".join(lines)


def plot_result(path: str | os.PathLike[str], result: dict[str, Any]) -> None:
    """Read time per iteration (each rank a line) and the step-time line, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = np.array(result["rows"], dtype=np.float64).reshape(-1, len(result["columns"]))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in np.unique(rows[:, 0]):
        pick = rows[:, 0] == r
        ax.plot(rows[pick, 1], rows[pick, 2], lw=0.8, alpha=0.7, label=f"rank {int(r)}")
        stalled = pick & (rows[:, 3] > STALL_SECONDS)
        ax.scatter(rows[stalled, 1], rows[stalled, 2], s=10, color="red", zorder=3)
    step = result["run"].get("step_time")
    if step:
        ax.axhline(step, color="black", ls="--", lw=1, label=f"step time {step:g} s")
    ax.set_xlabel("iteration")
    ax.set_ylabel("read time of the iteration's micro-batches (s)")
    ax.set_title(f"repack bench: {result['location']} (red: the rank waited)")
    if len(np.unique(rows[:, 0])) <= 8:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)
