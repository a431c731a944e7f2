#!/usr/bin/env python3
"""Benchmark ``repack merge`` against ``cat`` and Megatron-LM's merge, side by side.

Generates (or reuses, ``--data DIR``) a blend of ``--sources`` uint16 Megatron prefixes of
``--size`` bytes of tokens in total, written with numpy straight in the ``MMIDIDX`` v1 format,
then runs, alternating their order, ``--repeat`` times each:

* ``repack``    ``repack merge -q BLEND OUT`` in a fresh process, fresh ``OUT`` every run. Its
  output is durable when it exits (every shard, the index and the manifest are fsynced).
* ``cat``       ``cat SRC/*.bin > FILE``: the data alone, no index, no checksum. Timed when
  ``cat`` exits (data in the page cache only) and again after an ``fsync`` of ``FILE`` (data on
  disk, as durable as repack's output).
* ``repack-nofp`` (with ``--no-fingerprints-too``) ``repack merge --no-fingerprints``, the
  same merge without document fingerprints: what hashing every document costs.
* ``megatron``  what Megatron-LM's ``tools/merge_datasets.py`` does, in a fresh process:
  ``IndexedDatasetBuilder(out.bin, dtype)``, ``builder.add_index(prefix)`` for every prefix in
  sorted order, ``builder.finalize(out.idx)``. Timed at exit (no fsync, like the tool), after
  an fsync of both files, and from inside the process excluding its imports (torch and
  Megatron-Core take seconds to import).

Wall times are medians; peak RSS is each process's own ``ru_maxrss`` from ``os.wait4``.
Outputs are removed and everything synced (untimed) between runs. By default every run starts
with the sources in the page cache (warm; a warm-up read precedes the first run), and
``--warmup`` untimed runs of repack and cat come first (the first writes to disk space not
written for a while were up to 3x slower here, whichever tool made them);
``--drop-caches`` drops the page cache before every run instead, then reloads the programs
(Python, numpy, repack, cat; torch and Megatron-Core before a Megatron run) untimed, so that
only the data is read from disk (needs root; it slows every other program on the machine).

Usage::

    python scripts/bench_merge.py                       # 480 sources, 3.25 GiB
    python scripts/bench_merge.py --data /tmp/b --repeat 5 --json
    python scripts/bench_merge.py --skip-megatron       # no torch needed
    python scripts/bench_merge.py --repeat 5 --megatron-repeat 1   # Megatron takes minutes

``--size`` should stay well below free RAM for warm-cache figures to mean anything.
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from repack.units import format_size, parse_size

DEFAULT_DATA = "/tmp/repack-bench"
DEFAULT_SOURCES = 480
DEFAULT_SIZE = "3.25GiB"
SEED = 20240611
#: Data layout version; a change regenerates reused data.
LAYOUT = 1
#: Sequence lengths in tokens: log-normal, median 400, mean ~660 (web-text documents).
LENGTH_MEDIAN, LENGTH_SIGMA, LENGTH_MAX = 400, 1.0, 32768
#: The source in the middle of the blend holds this share of the data, so that any shard size
#: below it cuts a source across shards.
BIG_SHARE = 0.2
WRITE_CHUNK = 32 * 1024 * 1024
IDX_HEADER = b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8])  # uint16

MEGATRON_CHILD = r"""
import json, os, resource, sys, time
started = time.perf_counter()
from megatron.core.datasets.indexed_dataset import (
    IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path,
)
imported = time.perf_counter()
rss_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
folder, output_prefix = sys.argv[1], sys.argv[2]
# the loop of Megatron-LM tools/merge_datasets.py main(), verbatim but for names
prefixes = set()
for basename in os.listdir(folder):
    prefix, ext = os.path.splitext(basename)
    if prefix in prefixes:
        continue
    if not os.path.isfile(os.path.join(folder, basename)):
        continue
    ext_pair = ".bin" if ext == ".idx" else ".idx"
    assert os.path.isfile(os.path.join(folder, prefix) + ext_pair)
    prefixes.add(prefix)
builder = None
for prefix in sorted(prefixes):
    if builder is None:
        dataset = IndexedDataset(os.path.join(folder, prefix), multimodal=False)
        builder = IndexedDatasetBuilder(
            get_bin_path(output_prefix), dtype=dataset.index.dtype, multimodal=False
        )
        del dataset
    builder.add_index(os.path.join(folder, prefix))
builder.finalize(get_idx_path(output_prefix))
done = time.perf_counter()
print(json.dumps({"import_seconds": imported - started, "merge_seconds": done - imported,
                  "rss_after_imports_kib": rss_imports}))
"""


MEGATRON_PREWARM = [sys.executable, "-c", "import megatron.core.datasets.indexed_dataset"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- data -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Data:
    """A generated bench blend."""

    root: Path
    blend: Path
    source_dir: Path
    prefixes: tuple[Path, ...]
    bytes: int
    sequences: int

    @property
    def bins(self) -> list[str]:
        return [f"{p}.bin" for p in self.prefixes]


def _source_sizes(rng: np.random.Generator, count: int, total: int) -> np.ndarray:
    """Bytes of each source: log-normal, one big source in the middle, even, summing to total."""
    weights = rng.lognormal(0.0, 1.2, count)
    if count > 2:
        weights[count // 2] = 0.0
        weights *= (1 - BIG_SHARE) / weights.sum()
        weights[count // 2] = BIG_SHARE
    sizes = np.maximum(2, (weights / weights.sum() * total).astype(np.int64) // 2 * 2)
    sizes[-1] += total - sizes.sum()
    return sizes


def _lengths(rng: np.random.Generator, tokens: int) -> np.ndarray:
    lengths: list[np.ndarray] = []
    have = 0
    while have < tokens:
        draw = rng.lognormal(np.log(LENGTH_MEDIAN), LENGTH_SIGMA, tokens // 500 + 16)
        draw = np.clip(draw, 1, LENGTH_MAX).astype(np.int64)
        lengths.append(draw)
        have += int(draw.sum())
    out = np.concatenate(lengths)
    ends = np.cumsum(out)
    stop = int(np.searchsorted(ends, tokens)) + 1
    out = out[:stop]
    out[-1] -= int(ends[stop - 1]) - tokens
    return out.astype("<i4")


def _write_source(prefix: Path, size: int, rng: np.random.Generator) -> int:
    """Write ``prefix.bin``/``.idx`` (uint16, one sequence per document); return sequences."""
    lengths = _lengths(rng, size // 2)
    pointers = np.zeros(len(lengths), "<i8")
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= 2
    documents = np.arange(len(lengths) + 1, dtype="<i8")
    with open(f"{prefix}.bin", "wb") as stream:
        left = size
        while left:
            n = min(left, WRITE_CHUNK)
            stream.write(rng.bytes(n))  # token values do not matter to a merge
            left -= n
    with open(f"{prefix}.idx", "wb") as stream:
        stream.write(IDX_HEADER)
        stream.write(len(lengths).to_bytes(8, "little"))
        stream.write(len(documents).to_bytes(8, "little"))
        for array in (lengths, pointers, documents):
            stream.write(array.tobytes())
    return len(lengths)


def ensure_data(root: Path, sources: int, size: int, seed: int = SEED) -> Data:
    """The bench blend in ``root``: reused if ``root/bench-data.json`` matches, else written."""
    spec = {"layout": LAYOUT, "sources": sources, "size": size, "seed": seed}
    marker = root / "bench-data.json"
    source_dir = root / "src"
    prefixes = tuple(source_dir / f"s-{i:05d}" for i in range(sources))
    if marker.exists():
        stored = json.loads(marker.read_text())
        if stored.get("spec") == spec and all(os.path.exists(f"{p}.idx") for p in prefixes):
            log(f"reusing the bench data in {root}")
            return Data(root, root / "blend.json", source_dir, prefixes, size, stored["sequences"])
        marker.unlink()
    if source_dir.exists():
        shutil.rmtree(source_dir)
    source_dir.mkdir(parents=True)
    log(f"writing {sources} sources, {format_size(size)}, into {source_dir} ...")
    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    sizes = _source_sizes(rng, sources, size)
    sequences = sum(_write_source(p, int(n), rng) for p, n in zip(prefixes, sizes))
    blend = [x for p in prefixes for x in (1.0, str(p.relative_to(root)))]
    (root / "blend.json").write_text(json.dumps(blend))
    marker.write_text(json.dumps({"spec": spec, "sequences": sequences}))
    subprocess.run(["sync"], check=True)
    log(f"  written in {time.perf_counter() - started:.1f} s ({sequences} sequences)")
    return Data(root, root / "blend.json", source_dir, prefixes, size, sequences)


# --- running things ---------------------------------------------------------------------------


@dataclass
class Run:
    seconds: float
    rss_kib: int
    stdout: str


def run(cmd: list[str], *, stdout=None) -> Run:
    """Run ``cmd``; its wall time and its own peak RSS (``os.wait4``); raise on failure."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=stdout if stdout is not None else out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}): {err.read().decode()}")
        return Run(seconds, usage.ru_maxrss, out.read().decode(errors="replace"))


def fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Run (untimed) after dropping the page cache, so that only the data is read cold, not the
#: programs: Python, numpy, repack and cat.
PREWARM = (
    [sys.executable, "-c", "import repack.cli, repack.merge, repack.read.verify"],
    ["cat", "--version"],
)


def _device_busy_ms() -> int | None:
    """Milliseconds the block devices under the data have been busy (``io_ticks``), summed."""
    total = None
    for name in _DEVICES:
        try:
            fields = Path(f"/sys/class/block/{name}/stat").read_text().split()
            total = (total or 0) + int(fields[9])
        except (OSError, IndexError, ValueError):
            pass
    return total


_DEVICES: list[str] = []  # set by machine_facts: the block device holding the data


def wait_until_idle(quiet_s: float = 1.0, limit_s: float = 120.0) -> float:
    """Wait until the data's disk did no I/O for ``quiet_s`` (or ``limit_s`` passed); return
    the seconds waited. A file system mounted with ``discard`` (as here) trims a deleted
    output in the background after ``sync`` returns, and a run started meanwhile was up to
    3x slower, whichever tool it was."""
    started = time.monotonic()
    last = _device_busy_ms()
    if last is None:
        return 0.0
    while time.monotonic() - started < limit_s:
        time.sleep(quiet_s)
        now = _device_busy_ms()
        if now == last:
            break
        last = now
    return time.monotonic() - started


def settle(drop_caches: bool, prewarm: tuple[list[str], ...] = PREWARM) -> None:
    """Flush dirty pages and wait for the disk to go idle (and drop the page cache when asked,
    then reload the programs)."""
    os.sync()
    wait_until_idle()
    if drop_caches:
        with open("/proc/sys/vm/drop_caches", "w") as stream:
            stream.write("3\n")
        for cmd in prewarm:
            subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)


def can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as stream:
            stream.write("1\n")
        return True
    except OSError:
        return False


def warm(files: list[str]) -> None:
    """Read ``files`` once, so that every run starts with them in the page cache."""
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)


def remove(*paths: Path) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    os.sync()


def repack_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "repack", *args]


def run_repack(data: Data, out: Path, extra: list[str]) -> dict:
    result = run(repack_cmd("merge", "-q", "--json", *extra, str(data.blend), str(out)))
    info = json.loads(result.stdout)
    return {
        "exit": result.seconds,
        "durable": result.seconds,
        "rss_kib": result.rss_kib,
        "shards": info["shards"],
    }


def run_cat(data: Data, out: Path) -> dict:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        started = time.perf_counter()
        result = run(["cat", *data.bins], stdout=fd)
        os.fsync(fd)
        durable = time.perf_counter() - started
    finally:
        os.close(fd)
    if out.stat().st_size != data.bytes:
        raise RuntimeError(f"cat wrote {out.stat().st_size} bytes, expected {data.bytes}")
    return {"exit": result.seconds, "durable": durable, "rss_kib": result.rss_kib}


def run_megatron(data: Data, out_prefix: Path) -> dict:
    started = time.perf_counter()
    result = run([sys.executable, "-c", MEGATRON_CHILD, str(data.source_dir), str(out_prefix)])
    fsync_path(f"{out_prefix}.bin")
    fsync_path(f"{out_prefix}.idx")
    durable = time.perf_counter() - started
    inner = json.loads(result.stdout.strip().splitlines()[-1])
    size = os.path.getsize(f"{out_prefix}.bin")
    if size != data.bytes:
        raise RuntimeError(f"Megatron wrote {size} bytes, expected {data.bytes}")
    return {
        "exit": result.seconds,
        "durable": durable,
        "rss_kib": result.rss_kib,
        "merge_only": inner["merge_seconds"],
        "imports": inner["import_seconds"],
        "rss_after_imports_kib": inner["rss_after_imports_kib"],
    }


# --- report -----------------------------------------------------------------------------------


def machine_facts(path: Path) -> dict:
    import importlib.metadata as md

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "missing"

    with open("/proc/meminfo") as stream:
        ram_kib = int(stream.readline().split()[1])
    device = fstype = "?"
    best = ""
    with open("/proc/mounts") as stream:
        for line in stream:
            dev, mount, fs = line.split()[:3]
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, device, fstype = mount, dev, fs
    rotational = "?"
    name = os.path.basename(device)
    _DEVICES[:] = [name]
    try:
        rotational = Path(f"/sys/block/{name}/queue/rotational").read_text().strip()
    except OSError:
        pass
    usage = shutil.disk_usage(path)
    cpu = "?"
    with open("/proc/cpuinfo") as stream:
        for line in stream:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(ram_kib / 2**20, 1),
        "disk": f"{device} ({fstype}, rotational={rotational}, "
        f"{usage.total / 2**30:.0f} GiB, {usage.free / 2**30:.0f} GiB free)",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "xxhash": version("xxhash"),
        "megatron-core": version("megatron-core"),
        "torch": version("torch"),
        "coreutils cat": subprocess.run(
            ["cat", "--version"], capture_output=True, text=True
        ).stdout.splitlines()[0],
        "load average at start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "pressure at start": pressure(),
    }


def pressure() -> str:
    """CPU and I/O pressure (share of the last 60 s some task waited), where the kernel has it."""
    found = []
    for kind in ("cpu", "io"):
        try:
            with open(f"/proc/pressure/{kind}") as stream:
                some = stream.readline().split()
            found.append(f"{kind} {some[2].split('=')[1]}%")
        except (OSError, IndexError):
            pass
    return ", ".join(found) or "unknown"


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize(results: dict[str, list[dict]]) -> dict:
    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "exit_s": median(runs, "exit"),
            "durable_s": median(runs, "durable"),
            "rss_mib": max(r["rss_kib"] for r in runs) / 1024,
            "runs_exit_s": [round(r["exit"], 3) for r in runs],
            "runs_durable_s": [round(r["durable"], 3) for r in runs],
        }
        if "merge_only" in runs[0]:
            summary[name]["merge_only_s"] = median(runs, "merge_only")
            summary[name]["imports_s"] = median(runs, "imports")
            summary[name]["rss_after_imports_mib"] = (
                max(r["rss_after_imports_kib"] for r in runs) / 1024
            )
    return summary


def print_report(facts: dict, data: Data, summary: dict, args) -> None:
    print("\n## merge benchmark\n")
    for key, value in facts.items():
        print(f"* {key}: {value}")
    print(
        f"* data: {len(data.prefixes)} sources, {data.sequences} sequences, "
        f"{format_size(data.bytes)} ({data.bytes} bytes) of uint16 tokens"
    )
    print(f"* page cache: {'dropped before every run' if args.drop_caches else 'warm'}")
    print(
        f"* repetitions: {args.repeat} (Megatron: {min(args.repeat, args.megatron_repeat)}), "
        "order rotated every repetition\n"
    )
    print(
        "| tool | wall at exit (s) | wall durable (s) | throughput durable | peak RSS "
        "| runs, durable (s) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, s in summary.items():
        rate = data.bytes / s["durable_s"] / 2**20
        runs = ", ".join(f"{x:.2f}" for x in s["runs_durable_s"])
        print(
            f"| {name} | {s['exit_s']:.2f} | {s['durable_s']:.2f} | {rate:.0f} MiB/s "
            f"| {s['rss_mib']:.0f} MiB | {runs} |"
        )
    if "megatron" in summary:
        m = summary["megatron"]
        print(
            f"\nMegatron inside its process, imports excluded: {m['merge_only_s']:.2f} s "
            f"(imports {m['imports_s']:.2f} s, RSS after imports "
            f"{m['rss_after_imports_mib']:.0f} MiB)"
        )
    r = summary["repack"]
    c = summary["cat"]
    print("\nratios (medians):")
    print(f"* repack / cat, both durable (cat + fsync): {r['durable_s'] / c['durable_s']:.2f}")
    print(f"* repack (durable) / cat (at exit, unsynced): {r['durable_s'] / c['exit_s']:.2f}")
    if "repack-nofp" in summary:
        n = summary["repack-nofp"]
        ratio = n["durable_s"] / c["durable_s"]
        print(f"* repack --no-fingerprints / cat, both durable: {ratio:.2f}")
        print(f"* repack / repack --no-fingerprints: {r['durable_s'] / n['durable_s']:.2f}")
    if "megatron" in summary:
        m = summary["megatron"]
        print(f"* megatron durable / repack: {m['durable_s'] / r['durable_s']:.2f}x")
        print(f"* megatron at exit (unsynced) / repack: {m['exit_s'] / r['durable_s']:.2f}x")
        print(
            f"* megatron merge only (no imports, unsynced) / repack: "
            f"{m['merge_only_s'] / r['durable_s']:.2f}x"
        )
    print(f"* repack peak RSS: {r['rss_mib']:.0f} MiB (goal <= 256 MiB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA))
    parser.add_argument("--sources", type=int, default=DEFAULT_SOURCES)
    parser.add_argument("--size", default=DEFAULT_SIZE, help="total token bytes (3.25GiB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shard-size", help="passed to repack merge (default: its own)")
    parser.add_argument("--workers", type=int, help="passed to repack merge")
    parser.add_argument("--checksum", help="passed to repack merge")
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument(
        "--megatron-repeat",
        type=int,
        help="runs of Megatron's merge (default: --repeat; each takes minutes)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed runs of repack and cat before the timed ones (default 1)",
    )
    parser.add_argument(
        "--no-fingerprints-too",
        action="store_true",
        help="also time repack merge --no-fingerprints (tool repack-nofp)",
    )
    parser.add_argument(
        "--only", choices=("repack", "repack-nofp", "cat", "megatron"), action="append"
    )
    parser.add_argument("--drop-caches", action="store_true")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args(argv)
    if args.megatron_repeat is None:
        args.megatron_repeat = args.repeat

    args.data.mkdir(parents=True, exist_ok=True)
    data = ensure_data(args.data, args.sources, parse_size(args.size))
    if args.drop_caches and not can_drop_caches():
        parser.error("cannot write /proc/sys/vm/drop_caches (not root?); run without it")
    extra = []
    for option in ("shard_size", "workers", "checksum"):
        if getattr(args, option):
            extra += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    facts = machine_facts(args.data)
    tools = args.only or ["repack", "cat"] + ([] if args.skip_megatron else ["megatron"])
    if args.no_fingerprints_too and "repack-nofp" not in tools:
        tools.insert(1, "repack-nofp")
    nofp = [*extra, "--no-fingerprints"]
    out_repack = args.data / "out-repack"
    out_cat = args.data / "out-cat.bin"
    out_megatron = args.data / "out-megatron"
    outputs = (out_repack, out_cat, Path(f"{out_megatron}.bin"), Path(f"{out_megatron}.idx"))
    remove(*outputs)
    if not args.drop_caches:
        warm(data.bins)
    for rep in range(args.warmup):  # untimed: the first writes to a fresh disk area are slow
        for name in [t for t in tools if t != "megatron"]:
            settle(args.drop_caches)
            if name == "repack-nofp":
                result = run_repack(data, out_repack, nofp)
            elif name == "repack":
                result = run_repack(data, out_repack, extra)
            else:
                result = run_cat(data, out_cat)
            log(f"warm-up {rep + 1}/{args.warmup} {name:9s} durable {result['durable']:7.2f} s")
            remove(*outputs)
    results: dict[str, list[dict]] = {name: [] for name in tools}
    for rep in range(args.repeat):
        order = tools[rep % len(tools) :] + tools[: rep % len(tools)]
        for name in order:
            if name == "megatron" and rep >= args.megatron_repeat:
                continue
            prewarm = PREWARM + ((MEGATRON_PREWARM,) if name == "megatron" else ())
            settle(args.drop_caches, prewarm)
            if name == "repack":
                result = run_repack(data, out_repack, extra)
            elif name == "repack-nofp":
                result = run_repack(data, out_repack, nofp)
            elif name == "cat":
                result = run_cat(data, out_cat)
            else:
                result = run_megatron(data, out_megatron)
            results[name].append(result)
            log(
                f"rep {rep + 1}/{args.repeat} {name:9s} exit {result['exit']:7.2f} s  "
                f"durable {result['durable']:7.2f} s  rss {result['rss_kib'] / 1024:6.0f} MiB"
            )
            if name == "repack" and rep == args.repeat - 1:
                log("checking the last repack with repack verify (untimed) ...")
                run(repack_cmd("verify", "-q", str(out_repack)))
            remove(*outputs)
    facts["load average at end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    facts["pressure at end"] = pressure()
    summary = summarize({k: v for k, v in results.items() if v})
    if {"repack", "cat"} <= summary.keys():
        print_report(facts, data, summary, args)
    if args.json:
        print(json.dumps({"facts": facts, "summary": summary, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
