#!/usr/bin/env python3
"""Anchors for ``repack bench``: the run's replayed reads against fio on the same device, and
the repack's layout against the original prefixes'.

Generates (or reuses, ``--data DIR``) a blend of ``--sources`` uint16 Megatron prefixes with
``scripts/bench_loader.py``'s helpers (documents of ``--doc-tokens`` tokens, uniform, one per
sequence: at ``--seq-length 2048`` a sample spans one to three documents), merges it with
``repack merge``, then, for each number of sources and sequence length, runs ``repack bench``
in a new process (``--json``), ``--runs`` times each:

* **cold**: ``--flat-out --prefixes BLEND``: the repack, then the same samples from the
  original prefixes (stock's layout), each after its files' pages were evicted;
* **paced**: ``--step-time S`` on the repack, cold, at two step times derived from the cold
  runs' median seconds per iteration: ``--slack`` times it (the loaders should keep up) and
  ``--tight`` times it (they cannot: stalls);
* **warm**: ``--flat-out --warm`` on the repack, after one unevicted run read its pages;
* **fio**: random reads of the repack's shard files by ``ranks x workers`` processes, one
  request in flight each (``iodepth=1``: the replay's processes read synchronously):
  ``--direct=1 --ioengine=psync`` (O_DIRECT: no page cache, so no eviction needed) for
  ``--fio-seconds``, at the replay's mean request size rounded up to the 4 KiB O_DIRECT needs
  (the page a mapping faults in): the device's limit for that pattern; then, through the page
  cache emptied of the shards first, as many requests as the replay made, of its mean size,
  with ``pread`` (``psync``) and from a mapping (``mmap``, the loader's way): the kernel's
  limit for the replay's own requests.

The replay's MiB/s counts the samples' bytes; "device MiB/s" counts what the kernel fetched
for the workers (``/proc/PID/io`` ``read_bytes``), which is what fio's MiB/s is comparable to.
Medians over ``--runs``; the load average before and after.

Usage::

    python scripts/bench_storage.py                          # 1,000 and 3,000 sources, 2,048
    python scripts/bench_storage.py --sources 3000 --seq-lengths 1024,4096 --runs 3 --json
    python scripts/bench_storage.py --render /tmp/bench-storage/report.json  # the table again

Needs megatron-core and torch (``repack bench`` builds the run's datasets), and ``fio``
(``apt-get install fio``; without it the fio rows say so).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loader import generate_sources, log, machine_facts, prepare_blend

ROOT = Path(__file__).resolve().parent.parent
SEED = 1234
PAGE = 4096


def bench(out: Path, args: argparse.Namespace, seq: int, *extra: str) -> list[dict]:
    """One ``repack bench --json`` in a new process: its figures, one dict per layout."""
    command = [
        sys.executable,
        "-m",
        "repack",
        "bench",
        str(out),
        "--json",
        "-q",
        "--seq-length",
        str(seq),
        "--split",
        "100,0,0",
        "--train-iters",
        str(args.train_iters),
        "--global-batch-size",
        str(args.global_batch_size),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--data-parallel-size",
        str(args.data_parallel_size),
        "--workers",
        str(args.workers),
        "--iterations",
        str(args.iterations),
        "--from-iteration",
        str(args.from_iteration),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\n{done.stderr[-3000:]}")
    found = json.loads(done.stdout)
    return found if isinstance(found, list) else [found]


def fio(
    files: list[str],
    block: int,
    jobs: int,
    *,
    engine: str = "psync",
    direct: bool = True,
    seconds: float | None = None,
    requests: int | None = None,
) -> dict:
    """fio's random reads of ``files``: ``jobs`` processes, one ``block`` in flight each, for
    ``seconds`` or ``requests`` in all; O_DIRECT, or through the page cache emptied of
    ``files`` first (``engine="mmap"``: memcpy from a mapping, page faults as the loader's).
    Returns MiB/s, IOPS and the mean completion latency."""
    if shutil.which("fio") is None:
        return {"error": "fio not installed"}
    if not direct:
        from repack.bench.pagecache import evict

        evict(files)
    command = [
        "fio", "--name=anchor", "--filename=" + ":".join(f.replace(":", "\\:") for f in files),
        "--readonly", "--rw=randread", f"--bs={block}", f"--direct={int(direct)}",
        f"--ioengine={engine}", "--iodepth=1", f"--numjobs={jobs}", "--file_service_type=random",
        "--group_reporting", "--output-format=json",
    ]  # fmt: skip
    if requests is not None:
        command.append(f"--number_ios={math.ceil(requests / jobs)}")
    else:
        command += ["--time_based", f"--runtime={seconds:g}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-500:] or f"fio exited {done.returncode}"}
    read = json.loads(done.stdout[done.stdout.index("{") :])["jobs"][0]["read"]
    return {
        "mib_per_s": read["bw_bytes"] / 2**20,
        "requests_per_s": read["iops"],
        "mean_latency_ms": read["clat_ns"]["mean"] / 1e6,
        "block": block,
        "jobs": jobs,
        "engine": engine,
        "direct": direct,
    }


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def summarize(runs: list[dict]) -> dict:
    """Medians of the figures a table shows, over runs of one layout and mode."""

    def device(f: dict) -> float | None:
        fetched = f["cache"]["fetched_bytes"]
        return fetched / f["seconds"] / 2**20 if fetched and f["seconds"] else None

    def achieved(f: dict) -> dict:
        return f["achieved"] or f["page_cache"]  # a cached replay's figures are the cache's

    return {
        "runs": len(runs),
        "verdicts": sorted({f["verdict"] for f in runs}),
        "seconds": _median([f["seconds"] for f in runs]),
        "samples": runs[0]["samples"],
        "bytes": runs[0]["bytes"],
        "requests": runs[0]["requests"],
        "samples_per_s": _median([achieved(f)["samples_per_s"] for f in runs]),
        "mib_per_s": _median([achieved(f)["mib_per_s"] for f in runs]),
        "requests_per_s": _median([achieved(f)["requests_per_s"] for f in runs]),
        "mean_request_bytes": achieved(runs[0])["mean_request_bytes"],
        "device_mib_per_s": _median([device(f) for f in runs]),
        "fetched_share": _median([f["cache"]["fetched_share"] for f in runs]),
        "resident_before": max(f["cache"]["resident_pages_before"] for f in runs),
        "pages": runs[0]["cache"]["pages_read"],
        "read_p50_s": _median([f["read_time_per_iteration_s"]["p50"] for f in runs]),
        "read_p99_s": _median([f["read_time_per_iteration_s"]["p99"] for f in runs]),
        "stall_share": _median([f["stall"]["share"] for f in runs]),
        "utilization": _median([f["stall"]["utilization"] for f in runs]),
        "needed_mib_per_s": _median([f.get("needed", {}).get("mib_per_s") for f in runs]),
        "files_opened": runs[0]["files_opened"],
        "data_mappings": runs[0]["data_mappings_per_process"],
        "open_files": runs[0]["open_files_per_process"],
    }


def measure(data: Path, pairs: list, count: int, seq: int, args: argparse.Namespace) -> dict:
    blend, out = prepare_blend(data, pairs, count)
    shards = sorted(str(p) for p in out.glob("shard-*"))
    size = sum(os.path.getsize(p) for p in shards)
    log(f"{count} sources, seq {seq}: {len(shards)} shards, {size / 2**20:,.0f} MiB")
    cold: dict[str, list[dict]] = {"repack": [], "prefixes": []}
    for k in range(args.runs):
        for f in bench(out, args, seq, "--flat-out", "--prefixes", str(blend)):
            cold[f["layout"]].append(f)
        log(
            f"  cold run {k + 1}: {cold['repack'][-1]['seconds']:.2f} s repack, "
            f"{cold['prefixes'][-1]['seconds']:.2f} s prefixes"
        )
    iteration = statistics.median(f["seconds"] for f in cold["repack"]) / args.iterations
    paced = {}
    for name, factor in (("slack", args.slack), ("tight", args.tight)):
        step = float(f"{iteration * factor:.3g}")
        paced[name] = {"step_time": step, "runs": []}
        for _ in range(args.runs):
            paced[name]["runs"] += bench(out, args, seq, "--step-time", str(step))
        log(
            f"  paced {name} (step {step:g} s): stall share "
            f"{[round(f['stall']['share'], 2) for f in paced[name]['runs']]}"
        )
    bench(out, args, seq, "--flat-out", "--warm")  # reads the pages in
    warm = [bench(out, args, seq, "--flat-out", "--warm")[0] for _ in range(args.runs)]
    jobs = min(args.data_parallel_size, 8) * args.workers
    mean = cold["repack"][0]["achieved"]["mean_request_bytes"]
    requests = cold["repack"][0]["requests"]
    block = max(PAGE, math.ceil(mean / PAGE) * PAGE)
    setups = {  # name: fio's settings
        f"O_DIRECT {block}": {"block": block, "seconds": args.fio_seconds},
        f"buffered {round(mean)}": {"block": round(mean), "direct": False, "requests": requests},
        f"mmap {round(mean)}": {
            "block": round(mean), "engine": "mmap", "direct": False, "requests": requests,
        },
    }  # fmt: skip
    anchors = {}
    for name, setup in setups.items():
        got = [fio(shards, jobs=jobs, **setup) for _ in range(args.runs)]
        if "error" in got[0]:
            anchors[name] = got[0]
            continue
        anchors[name] = (
            {
                key: _median([g[key] for g in got])
                for key in ("mib_per_s", "requests_per_s", "mean_latency_ms")
            }
            | {k: got[0][k] for k in ("block", "jobs", "engine", "direct")}
            | {"runs": len(got)}
        )
        log(f"  fio {name} x {jobs} jobs: {anchors[name]['mib_per_s']:.1f} MiB/s")
    return {
        "sources": count,
        "seq_length": seq,
        "shards": len(shards),
        "shard_bytes": size,
        "cold": {layout: summarize(runs) for layout, runs in cold.items()},
        "paced": {
            name: {"step_time": p["step_time"], **summarize(p["runs"])} for name, p in paced.items()
        },
        "warm": summarize(warm),
        "fio": anchors,
    }


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[k])) for r in [headers, *rows]) for k in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"

    return "\n".join(
        [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        + [line(r) for r in rows]
    )


def _f(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def render(report: dict) -> str:
    out = [
        f"machine: {report['machine']}",
        "load average before / after: "
        + " / ".join(", ".join(f"{x:.2f}" for x in la) for la in report["loadavg"]),
        f"run: --data-parallel-size {report['settings']['data_parallel_size']} --workers "
        f"{report['settings']['workers']} --micro-batch-size "
        f"{report['settings']['micro_batch_size']} --global-batch-size "
        f"{report['settings']['global_batch_size']} --iterations "
        f"{report['settings']['iterations']}; medians of {report['settings']['runs']} runs",
    ]
    headers = [
        "sources, seq",
        "case",
        "s",
        "samples/s",
        "MiB/s",
        "device MiB/s",
        "requests/s",
        "mean request",
        "fetched",
        "p50 / p99 read",
        "stalls",
        "files",
        "maps/worker",
    ]
    rows = []
    for m in report["measurements"]:
        where = f"{m['sources']:,}, {m['seq_length']:,}"
        cases = [("repack, cold", m["cold"]["repack"]), ("prefixes, cold", m["cold"]["prefixes"])]
        cases += [(f"repack, step {p['step_time']:g} s", p) for p in m["paced"].values()]
        cases.append(("repack, --warm", m["warm"]))
        for name, s in cases:
            rows.append(
                [
                    where,
                    name + ("" if s["verdicts"] != ["cached"] or "warm" in name else " CACHED"),
                    _f(s["seconds"], ".2f"),
                    _f(s["samples_per_s"], ",.0f"),
                    _f(s["mib_per_s"], ".2f"),
                    _f(s["device_mib_per_s"], ".2f"),
                    _f(s["requests_per_s"], ",.0f"),
                    f"{s['mean_request_bytes']:,.0f} B",
                    "n/a" if s["fetched_share"] is None else f"{100 * s['fetched_share']:.0f} %",
                    f"{1000 * s['read_p50_s']:.1f} / {1000 * s['read_p99_s']:.1f} ms",
                    f"{100 * s['stall_share']:.0f} %" if s["needed_mib_per_s"] else "-",
                    f"{s['files_opened']:,}",
                    f"{s['data_mappings']:,}",
                ]
            )
        for name, a in m["fio"].items():
            if "error" in a:
                rows.append([where, f"fio {name}", a["error"]] + [""] * 10)
                continue
            how = "O_DIRECT" if a["direct"] else f"{a['engine']}, evicted"
            rows.append([
                where, f"fio randread {a['block']:,} B x {a['jobs']}, {how}", "", "", "",
                _f(a["mib_per_s"], ".2f") + (" (requests)" if not a["direct"] else ""),
                _f(a["requests_per_s"], ",.0f"), f"{a['block']:,} B", "",
                f"{a['mean_latency_ms']:.3f} ms mean", "", "", "",
            ])  # fmt: skip
    out.append(_table(headers, rows))
    for m in report["measurements"]:
        r, p = m["cold"]["repack"], m["cold"]["prefixes"]
        lines = [f"{m['sources']:,} sources, seq {m['seq_length']:,}:"]
        for name, a in m["fio"].items():
            if "error" in a or not r["device_mib_per_s"]:
                continue
            lines.append(
                f"  replay against fio {name}: {r['requests_per_s'] / a['requests_per_s']:.2f}x "
                "its requests/s"
                + (
                    f", {r['device_mib_per_s'] / a['mib_per_s']:.2f}x its MiB/s (device)"
                    if a["direct"]
                    else ""
                )
            )
        lines.append(
            f"  prefixes against repack: {p['seconds'] / r['seconds']:.2f}x the time, "
            f"{p['files_opened']:,} -> {r['files_opened']:,} files, {p['data_mappings']:,} -> "
            f"{r['data_mappings']:,} data mappings per worker, mean request "
            f"{p['mean_request_bytes']:,.0f} -> {r['mean_request_bytes']:,.0f} B"
        )
        out += lines
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir(), "bench-storage"))
    parser.add_argument("--sources", default="1000,3000")
    parser.add_argument("--seq-lengths", default="2048")
    parser.add_argument("--sequences", default="20,60", help="sequences per source, min,max")
    parser.add_argument("--doc-tokens", default="16,4096", help="tokens per document, min,max")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--from-iteration", type=int, default=1)
    parser.add_argument("--train-iters", type=int, default=2000)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--data-parallel-size", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slack", type=float, default=2.0)
    parser.add_argument("--tight", type=float, default=0.5)
    parser.add_argument("--fio-seconds", type=float, default=10)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--render", type=Path, metavar="JSON", help="print the table of a report")
    args = parser.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0

    counts = sorted(int(c) for c in args.sources.split(","))
    lengths = [int(s) for s in args.seq_lengths.split(",")]
    low, high = (int(x) for x in args.sequences.split(","))
    t_low, t_high = (int(x) for x in args.doc_tokens.split(","))
    started = time.perf_counter()
    load_before = os.getloadavg()
    pairs = generate_sources(args.data / "data", counts[-1], SEED, (low, high), (t_low, t_high))
    measurements = [measure(args.data, pairs, c, s, args) for c in counts for s in lengths]
    report = {
        "machine": machine_facts(),
        "device": _device(args.data),
        "settings": {
            k: getattr(args, k)
            for k in (
                "runs",
                "iterations",
                "global_batch_size",
                "micro_batch_size",
                "data_parallel_size",
                "workers",
                "sequences",
                "doc_tokens",
                "fio_seconds",
            )
        },
        "loadavg": [load_before, os.getloadavg()],
        "seconds": time.perf_counter() - started,
        "measurements": measurements,
    }
    (args.data / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


def _device(path: Path) -> str:
    """The file system and device ``path`` is on (``df``'s line)."""
    done = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=False)
    return done.stdout.splitlines()[-1] if done.returncode == 0 else "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
