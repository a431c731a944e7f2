#!/usr/bin/env python3
"""Benchmark repack's Megatron loader against stock Megatron-Core, side by side.

Generates (or reuses, ``--data DIR``) a blend of ``--sources`` uint16 Megatron prefixes, merges
it with ``repack merge``, then builds Megatron-Core's blended train/valid/test datasets with
four configurations:

* ``stock mmap``     ``GPTDataset``, ``mmap_bin_files=True`` (Megatron's default)
* ``stock no-mmap``  ``GPTDataset``, ``mmap_bin_files=False``
* ``repack mmap``    ``RepackedGPTDataset`` bound to the repack, ``mmap_bin_files=True``
* ``repack pread``   ``RepackedGPTDataset``, ``mmap_bin_files=False``

and measures, for each:

* build time with a cold cache (empty ``path_to_cache``) and with a warm cache (a second
  build, in a new process, on the cache the cold build left), and the latency of the first
  sample after the build (repack packs Megatron's cached indices, and maps them, lazily then);
* the opens, stats and mmaps of files under the data, repack and cache folders performed during
  the build and the first sample, counted with ``strace -f`` (syscall names in ``--json``);
* the mmaps and open descriptors of those files alive after the build and after reading
  (``/proc/self/maps``, ``/proc/self/fd``);
* random-sample read throughput through the blended train dataset: ``--samples`` indices drawn
  once, identical for every configuration, read after a warm build.

Every measurement runs in a fresh process, forked from a *zygote* that imported torch and
Megatron-Core once (importing them takes ~6 s; a fork is clean: no repack is open and no
Megatron dataset exists in it). Counting runs fork from a second zygote started under strace,
so that tracing never slows a timed run. Times are medians over ``--repeat`` runs.

``--compare-sources M`` repeats the build measurements (no read throughput) on the first M
sources of the same data, to show which counts grow with the number of sources.

Usage::

    python scripts/bench_loader.py                   # 1000 sources, compared with 250
    python scripts/bench_loader.py --data /tmp/bench --sources 2000 --json

Needs the ``megatron`` extra (megatron-core, torch). Syscall counts need ``strace``
(``apt-get install strace``); without it they are reported as unavailable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

CONFIGS = {
    # name: (repack?, mmap_bin_files)
    "stock mmap": (False, True),
    "stock no-mmap": (False, False),
    "repack mmap": (True, True),
    "repack pread": (True, False),
}
PHASES = ("cold", "warm")
SEED = 1234
SPLIT = "90,5,5"
#: Samples per source requested for the train split; valid and test get 1/20 of it each.
TRAIN_SAMPLES_PER_SOURCE = 40
#: Samples whose tokens are hashed (untimed) to check that every configuration reads the same.
DIGEST_SAMPLES = 256

STRACE_SYSCALLS = "open,openat,openat2,creat,%%stat,access,faccessat,faccessat2,mmap"
SYSCALL_KIND = {
    "open": "opens",
    "openat": "opens",
    "openat2": "opens",
    "creat": "opens",
    "mmap": "mmaps",
}  # everything else traced is a stat: stat, lstat, fstat, newfstatat, statx, access, ...
MARKER_ROOT = "/__bench_loader__"
_SYSCALL_LINE = re.compile(r"^(\w+)\((.*)$")
_PATH = re.compile(r'"([^"]*)"|<([^<>]*)>')


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- data ------------------------------------------------------------------------------------


def source_prefix(data: Path, i: int) -> Path:
    return data / f"d{i // 100:03d}" / f"s{i:05d}"


def generate_sources(data: Path, count: int, seed: int) -> list[tuple[float, str]]:
    """Write (or find) ``count`` uint16 prefixes; return ``(weight, prefix)`` pairs.

    Source ``i`` depends only on ``(seed, i)``, so smaller blends are prefixes of larger ones.
    Every source has 40-80 sequences of 5-600 tokens, enough for every split to hold tokens
    (Megatron loops forever on an empty split).
    """
    from repack.synth import write_prefix

    pairs = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        lengths = rng.integers(5, 600, int(rng.integers(40, 81)))
        weight = round(float(rng.uniform(0.1, 2.0)), 4)
        prefix = source_prefix(data, i)
        if not (Path(f"{prefix}.idx").exists() and Path(f"{prefix}.bin").exists()):
            tokens = rng.integers(1, 65000, int(lengths.sum()), dtype=np.uint16)
            write_prefix(prefix, np.split(tokens, np.cumsum(lengths)[:-1]), dtype=np.uint16)
        pairs.append((weight, str(prefix)))
    return pairs


def prepare_blend(root: Path, pairs: list[tuple[float, str]], count: int) -> tuple[Path, Path]:
    """The blend file of the first ``count`` sources and its repack (merged if missing)."""
    from repack.merge import merge

    blend = root / f"blend-{count}.json"
    items: list[object] = []
    for weight, prefix in pairs[:count]:
        items += [weight, prefix]
    text = json.dumps(items)
    out = root / f"repack-{count}"
    if not blend.exists() or blend.read_text() != text:
        blend.write_text(text)
        shutil.rmtree(out, ignore_errors=True)
    if not (out / "manifest.json").exists():
        t0 = time.perf_counter()
        merge(blend, out, overwrite=True)
        log(f"merged {count} sources into {out} in {time.perf_counter() - t0:.1f} s")
    return blend, out


# --- the measuring child (runs forked from a zygote) -------------------------------------------


class _Tokenizer:
    """The least Megatron's GPTDataset needs of a tokenizer."""

    vocab_size = 65000
    eod = 0
    unique_identifiers = {"class": "BenchTokenizer"}  # noqa: RUF012


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def live_resources(roots: list[str]) -> dict[str, int]:
    """Mappings and open descriptors of files under ``roots`` in this process."""
    maps = 0
    mapped = set()
    with open("/proc/self/maps") as stream:
        for line in stream:
            fields = line.split(None, 5)
            if len(fields) == 6:
                path = fields[5].rstrip("\n").removesuffix(" (deleted)")
                if _under(path, roots):
                    maps += 1
                    mapped.add(path)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        fds += _under(target, roots)
    return {"mmaps": maps, "mapped_files": len(mapped), "fds": fds}


def _marker(job: dict, name: str) -> None:
    """A failing stat of a unique path: a mark in the strace output, nothing otherwise."""
    try:
        os.stat(f"{MARKER_ROOT}/{job['id']}/{name}")
    except OSError:
        pass


def run_job(job: dict) -> dict:
    """Build the blended datasets of one configuration, and measure."""
    import logging

    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from repack.megatron import dataset_class

    logging.disable(logging.WARNING)
    with tempfile.NamedTemporaryFile(prefix="bench-dist-") as rendezvous:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{rendezvous.name}", rank=0, world_size=1
        )
    items = json.loads(Path(job["blend"]).read_text())
    use_repack, mmap_bin_files = CONFIGS[job["config"]]
    roots = job["roots"]

    _marker(job, "begin")
    t0 = time.perf_counter()
    cls = dataset_class(job["repack"]) if use_repack else GPTDataset
    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=job["seq_length"],
        blend=([str(p) for p in items[1::2]], [float(w) for w in items[0::2]]),
        split=SPLIT,
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=job["cache"],
        mmap_bin_files=mmap_bin_files,
    )
    datasets = BlendedMegatronDatasetBuilder(cls, job["sizes"], lambda: True, config).build()
    build_s = time.perf_counter() - t0
    _marker(job, "built")
    after_build = live_resources(roots)

    train = datasets[0]
    indices = np.random.default_rng(SEED).integers(0, len(train), max(job["samples"], 1))
    t0 = time.perf_counter()
    train[int(indices[0])]
    first_s = time.perf_counter() - t0
    _marker(job, "first")

    result = {
        "build_s": build_s,
        "first_sample_s": first_s,
        "lengths": [len(d) if d is not None else 0 for d in datasets],
        "live_after_build": after_build,
    }
    if job["samples"] > 1:
        tokens = 0
        t0 = time.perf_counter()
        for i in indices[1:].tolist():
            tokens += train[i]["tokens"].numel()
        read_s = time.perf_counter() - t0
        result["read"] = {
            "samples": len(indices) - 1,
            "tokens": tokens,
            "seconds": read_s,
            "samples_per_s": (len(indices) - 1) / read_s,
            "tokens_per_s": tokens / read_s,
        }
        result["live_after_read"] = live_resources(roots)
        digest = 0
        for i in indices[:DIGEST_SAMPLES].tolist():
            digest = zlib.crc32(train[i]["tokens"].numpy().tobytes(), digest)
        result["digest"] = f"{digest:08x}"
    return result


def zygote_main() -> int:
    """Import Megatron once; fork one child per job line read from stdin."""
    import warnings

    warnings.simplefilter("ignore")
    import torch  # noqa: F401
    from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: F401
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset  # noqa: F401

    import repack.megatron  # noqa: F401

    os.chdir("/")  # strace decorates AT_FDCWD with the cwd: keep it out of the counted folders
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # Megatron and children print to stdout; keep the protocol channel clean
    print(json.dumps({"ready": True}), file=protocol, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                result = run_job(job)
                Path(job["out"]).write_text(json.dumps(result))
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        reply = {"pid": pid, "exit": os.waitstatus_to_exitcode(status)}
        print(json.dumps(reply), file=protocol, flush=True)
    return 0


# --- the driver --------------------------------------------------------------------------------


class Zygote:
    """A ``--zygote`` process, optionally under strace, that runs jobs in forked children."""

    def __init__(self, workdir: Path, name: str, trace_prefix: Path | None = None) -> None:
        self.log_path = workdir / f"{name}.log"
        self.trace_prefix = trace_prefix
        command = [sys.executable, os.path.abspath(__file__), "--zygote"]
        if trace_prefix is not None:
            command = [
                "strace",
                "-ff",
                "-y",
                "-qq",
                "--seccomp-bpf",
                "-e",
                f"trace={STRACE_SYSCALLS}",
                "-o",
                str(trace_prefix),
                *command,
            ]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=env,
        )

    def wait_ready(self) -> None:
        self._reply()

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the benchmark zygote died; see {self.log_path}:\n{self._tail()}")
        return json.loads(line)

    def _tail(self) -> str:
        self._log.flush()
        return "".join(self.log_path.read_text().splitlines(keepends=True)[-25:])

    def run(self, job: dict) -> dict:
        out = Path(job["out"])
        out.unlink(missing_ok=True)
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        reply = self._reply()
        if reply["exit"] != 0 or not out.exists():
            raise SystemExit(f"job {job['id']} failed; see {self.log_path}:\n{self._tail()}")
        result = json.loads(out.read_text())
        result["pid"] = reply["pid"]
        return result

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()
        self._log.close()


def trace_files(trace_prefix: Path) -> set[Path]:
    """strace's per-thread output files (``-ff``) present now."""
    return set(trace_prefix.parent.glob(f"{trace_prefix.name}.*"))


def count_syscalls(files: set[Path], pid: int, job_id: str, roots: list[str]) -> dict:
    """Syscalls on files under ``roots`` in strace's per-thread files of one child process.

    ``files`` are the files the child's threads wrote (the child's own is named after its
    ``pid``). The child's file is cut at its markers; its other threads (Megatron's
    dataset-builder pool) live only during the build and count towards it.
    """
    windows: dict[str, dict[str, int]] = {"build": {}, "first_sample": {}}
    marks = {
        f'"{MARKER_ROOT}/{job_id}/begin"': "build",
        f'"{MARKER_ROOT}/{job_id}/built"': "first_sample",
        f'"{MARKER_ROOT}/{job_id}/first"': None,
    }
    for path in sorted(files):
        is_main = path.suffix == f".{pid}"
        window = None if is_main else "build"
        for line in path.read_text(errors="replace").splitlines():
            match = _SYSCALL_LINE.match(line)
            if not match:
                continue
            name, rest = match.groups()
            if MARKER_ROOT in rest:
                window = next((w for m, w in marks.items() if m in rest), window)
                continue
            if window is None:
                continue
            if not any(_under(a or b, roots) for a, b in _PATH.findall(rest)):
                continue
            counts = windows[window]
            counts[name] = counts.get(name, 0) + 1
        path.unlink()
    return {w: _kinds(c) for w, c in windows.items()}


def _kinds(counts: dict[str, int]) -> dict:
    kinds = {"opens": 0, "stats": 0, "mmaps": 0}
    for name, n in counts.items():
        kinds[SYSCALL_KIND.get(name, "stats")] += n
    return {**kinds, "syscalls": dict(sorted(counts.items()))}


def machine_facts() -> dict:
    import importlib.metadata as md

    with open("/proc/meminfo") as stream:
        kb = int(stream.readline().split()[1])

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "missing"

    return {
        "nproc": os.cpu_count(),
        "ram_gib": round(kb / 2**20, 1),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": version("torch"),
        "megatron-core": version("megatron-core"),
        "kernel": platform.release(),
    }


def measure(
    zygote: Zygote,
    tracer: Zygote | None,
    workdir: Path,
    count: int,
    blend: Path,
    repack_dir: Path,
    args: argparse.Namespace,
    samples: int,
) -> dict:
    """Every configuration on the blend of ``count`` sources."""
    data = workdir / "data"
    sizes = [TRAIN_SAMPLES_PER_SOURCE * count] + [max(TRAIN_SAMPLES_PER_SOURCE * count // 20, 1)] * 2
    roots = [str(data), str(repack_dir), str(workdir / "cache")]
    base = {
        "blend": str(blend),
        "repack": str(repack_dir),
        "seq_length": args.seq_length,
        "sizes": sizes,
        "roots": roots,
    }
    runs: dict[str, dict[str, list[dict]]] = {c: {p: [] for p in PHASES} for c in CONFIGS}
    for r in range(args.repeat):
        for config in CONFIGS:
            cache = workdir / "cache" / f"{count}-{config.replace(' ', '-')}-{r}"
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True)
            for phase in PHASES:
                job_id = f"{count}-{config.replace(' ', '-')}-{r}-{phase}"
                job = {
                    **base,
                    "id": job_id,
                    "config": config,
                    "phase": phase,
                    "cache": str(cache),
                    "samples": samples if phase == "warm" else 1,
                    "out": str(workdir / "jobs" / f"{job_id}.json"),
                }
                result = zygote.run(job)
                runs[config][phase].append(result)
                read = result.get("read")
                log(
                    f"  {count} sources, {config:13s} {phase}: build {result['build_s']:.2f} s, "
                    f"1st sample {result['first_sample_s']:.3f} s"
                    + (f", {read['samples_per_s']:,.0f} samples/s" if read else "")
                )
    counts: dict[str, dict] = {}
    for config in CONFIGS:
        counts[config] = {}
        if tracer is None:
            continue
        for phase in PHASES:
            # cold: a new empty cache; warm: the cache the first timed repeat left
            cache = workdir / "cache" / f"{count}-{config.replace(' ', '-')}-0"
            if phase == "cold":
                cache = workdir / "cache" / f"{count}-{config.replace(' ', '-')}-traced"
                shutil.rmtree(cache, ignore_errors=True)
                cache.mkdir(parents=True)
            job_id = f"{count}-{config.replace(' ', '-')}-traced-{phase}"
            job = {
                **base,
                "id": job_id,
                "config": config,
                "phase": phase,
                "cache": str(cache),
                "samples": 1,
                "out": str(workdir / "jobs" / f"{job_id}.json"),
            }
            before = trace_files(tracer.trace_prefix)
            result = tracer.run(job)
            files = trace_files(tracer.trace_prefix) - before
            counts[config][phase] = count_syscalls(files, result["pid"], job_id, roots)
            build = counts[config][phase]["build"]
            log(
                f"  {count} sources, {config:13s} {phase}: traced build "
                f"{build['opens']} opens, {build['stats']} stats, {build['mmaps']} mmaps"
            )
    return summarize(runs, counts, count, sizes)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(runs: dict, counts: dict, count: int, sizes: list[int]) -> dict:
    configs = {}
    for config, phases in runs.items():
        cold, warm = phases["cold"], phases["warm"]
        entry = {
            "cold_build_s": _median([r["build_s"] for r in cold]),
            "cold_first_sample_s": _median([r["first_sample_s"] for r in cold]),
            "warm_build_s": _median([r["build_s"] for r in warm]),
            "warm_first_sample_s": _median([r["first_sample_s"] for r in warm]),
            "cold_build_runs_s": [r["build_s"] for r in cold],
            "warm_build_runs_s": [r["build_s"] for r in warm],
            "lengths": warm[0]["lengths"],
            "live_after_build": warm[0]["live_after_build"],
            "syscalls": counts.get(config, {}),
        }
        if "read" in warm[0]:
            entry["samples_per_s"] = _median([r["read"]["samples_per_s"] for r in warm])
            entry["tokens_per_s"] = _median([r["read"]["tokens_per_s"] for r in warm])
            entry["samples_per_s_runs"] = [r["read"]["samples_per_s"] for r in warm]
            entry["read_samples"] = warm[0]["read"]["samples"]
            entry["live_after_read"] = warm[0]["live_after_read"]
            entry["digest"] = warm[0]["digest"]
            entry["digests_agree"] = len({r["digest"] for r in warm}) == 1
        configs[config] = entry
    return {"sources": count, "sizes": sizes, "configs": configs}


def ratios(main: dict, compare: dict | None) -> dict:
    c = main["configs"]
    out = {
        "warm_build_speedup": {
            "repack mmap vs stock mmap": c["stock mmap"]["warm_build_s"]
            / c["repack mmap"]["warm_build_s"],
            "repack pread vs stock no-mmap": c["stock no-mmap"]["warm_build_s"]
            / c["repack pread"]["warm_build_s"],
        },
        "cold_build_speedup": {
            "repack mmap vs stock mmap": c["stock mmap"]["cold_build_s"]
            / c["repack mmap"]["cold_build_s"],
            "repack pread vs stock no-mmap": c["stock no-mmap"]["cold_build_s"]
            / c["repack pread"]["cold_build_s"],
        },
    }
    if "samples_per_s" in c["repack mmap"]:
        base = c["stock mmap"]["samples_per_s"]
        out["read_throughput_vs_stock_mmap"] = {
            name: c[name]["samples_per_s"] / base for name in CONFIGS
        }
    if compare is not None and all(c[n]["syscalls"] for n in CONFIGS):
        growth = {}
        for name in CONFIGS:
            small = compare["configs"][name]["syscalls"]["warm"]["build"]
            large = c[name]["syscalls"]["warm"]["build"]
            growth[name] = {k: [small[k], large[k]] for k in ("opens", "stats", "mmaps")}
        out["warm_build_syscalls_small_vs_large"] = growth
    return out


# --- output ------------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(
        zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append(
            "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(
                zip(row, widths)))
        )
    return "\n".join(lines)


def _osm(counts: dict | None) -> str:
    if not counts:
        return "n/a"
    return f"{counts['opens']}/{counts['stats']}/{counts['mmaps']}"


def render(report: dict) -> str:
    facts = report["machine"]
    parts = [
        f"repack loader benchmark: {report['sources']} sources ({report['tokens']:,} tokens, "
        f"uint16), sequence length {report['seq_length']}, median of {report['repeat']} runs",
        "machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()),
        f"syscall counts: {report['counter']}",
        "",
    ]
    for result in report["results"]:
        c = result["configs"]
        parts.append(
            f"== {result['sources']} sources; samples train/valid/test requested "
            f"{'/'.join(map(str, result['sizes']))} ==")
        rows = []
        for name, e in c.items():
            row = [
                name,
                f"{e['cold_build_s']:.2f}",
                f"{e['cold_first_sample_s']:.3f}",
                f"{e['warm_build_s']:.2f}",
                f"{e['warm_first_sample_s']:.3f}",
            ]
            if "samples_per_s" in e:
                row += [f"{e['samples_per_s']:,.0f}", f"{e['tokens_per_s'] / 1e6:.2f}"]
            rows.append(row)
        headers = ["config", "cold build s", "cold 1st s", "warm build s", "warm 1st s"]
        if len(rows[0]) > 5:
            headers += ["samples/s", "Mtokens/s"]
        parts += [_table(headers, rows), ""]
        rows = []
        for name, e in c.items():
            s = e["syscalls"]
            row = [
                name,
                _osm(s.get("cold", {}).get("build")),
                _osm(s.get("cold", {}).get("first_sample")),
                _osm(s.get("warm", {}).get("build")),
                _osm(s.get("warm", {}).get("first_sample")),
                f"{e['live_after_build']['mmaps']}/{e['live_after_build']['fds']}",
            ]
            if "live_after_read" in e:
                row.append(f"{e['live_after_read']['mmaps']}/{e['live_after_read']['fds']}")
            rows.append(row)
        headers = [
            "opens/stats/mmaps",
            "cold build",
            "cold 1st",
            "warm build",
            "warm 1st",
            "live maps/fds built",
        ]
        if len(rows[0]) > 6:
            headers.append("after read")
        parts += [_table(headers, rows), ""]
    r = report["ratios"]
    parts.append("ratios (goal):")
    for name, value in r["warm_build_speedup"].items():
        parts.append(f"  warm build, {name}: {value:.2f}x faster (goal >= 3x)")
    for name, value in r["cold_build_speedup"].items():
        parts.append(f"  cold build, {name}: {value:.2f}x faster")
    for name, value in r.get("read_throughput_vs_stock_mmap", {}).items():
        if name != "stock mmap":
            parts.append(f"  read throughput, {name} / stock mmap: {value:.3f} (goal >= 0.95)")
    growth = r.get("warm_build_syscalls_small_vs_large")
    if growth:
        small, large = report["results"][1]["sources"], report["results"][0]["sources"]
        parts.append(
            f"  warm build opens/stats/mmaps, {small} -> {large} sources (goal: independent of "
            "the source count):"
        )
        for name, g in growth.items():
            parts.append(
                f"    {name:13s} "
                + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in g.items())
            )
    digests = {
        name: e.get("digest")
        for name, e in report["results"][0]["configs"].items()
        if e.get("digest")
    }
    if digests:
        same = len(set(digests.values())) == 1
        parts.append(
            f"  samples read: {'identical' if same else 'DIFFERENT'} in every configuration "
            f"(crc32 of the first {DIGEST_SAMPLES}: {', '.join(sorted(set(digests.values())))})"
        )
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="work folder to create or reuse (default: temp)")
    parser.add_argument("--sources", type=int, default=1000)
    parser.add_argument(
        "--compare-sources", type=int, default=250, help="second, smaller blend (0: none)"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--samples", type=int, default=20000, help="random samples to read")
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated data")
    parser.add_argument("--no-strace", action="store_true", help="skip the syscall counts")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.zygote:
        return zygote_main()
    if args.compare_sources >= args.sources:
        parser.error("--compare-sources must be smaller than --sources")

    started = time.perf_counter()
    temporary = args.data is None
    workdir = Path(tempfile.mkdtemp(prefix="bench-loader-") if temporary else args.data)
    workdir = workdir.resolve()
    (workdir / "jobs").mkdir(parents=True, exist_ok=True)
    strace = shutil.which("strace") if not args.no_strace else None
    if strace:
        counter = (
            "strace -f (opens: open/openat; stats: stat/lstat/fstat/newfstatat/statx/access; "
            "mmap) on files under the data, repack and cache folders; build = "
            "BlendedMegatronDatasetBuilder(...).build(), 1st = the first sample after it"
        )
    else:
        counter = "unavailable (strace not found: apt-get install strace)"
    # the zygotes import torch and Megatron while the data is generated
    zygote = Zygote(workdir, "zygote")
    tracer = None
    if strace:
        trace_dir = workdir / "trace"
        shutil.rmtree(trace_dir, ignore_errors=True)
        trace_dir.mkdir()
        tracer = Zygote(workdir, "zygote-strace", trace_dir / "t")
    try:
        t0 = time.perf_counter()
        pairs = generate_sources(workdir / "data", args.sources, args.seed)
        log(f"{args.sources} sources ready in {workdir / 'data'} ({time.perf_counter() - t0:.1f} s)")
        counts = [args.sources] + ([args.compare_sources] if args.compare_sources else [])
        blends = {n: prepare_blend(workdir, pairs, n) for n in counts}
        from repack.reader import open_repack

        tokens = sum(s.token_count for s in open_repack(blends[args.sources][1]).manifest.sources)
        zygote.wait_ready()
        if tracer:
            tracer.wait_ready()
        results = []
        for n in counts:
            log(f"measuring {n} sources")
            samples = args.samples if n == args.sources else 0
            results.append(
                measure(zygote, tracer, workdir, n, *blends[n], args=args, samples=samples)
            )
    finally:
        zygote.close()
        if tracer:
            tracer.close()
    report = {
        "sources": args.sources,
        "compare_sources": args.compare_sources,
        "tokens": tokens,
        "seq_length": args.seq_length,
        "repeat": args.repeat,
        "samples": args.samples,
        "machine": machine_facts(),
        "counter": counter,
        "command": " ".join(["python", "scripts/bench_loader.py", *(argv or sys.argv[1:])]),
        "results": results,
        "ratios": ratios(results[0], results[1] if len(results) > 1 else None),
        "seconds": round(time.perf_counter() - started, 1),
    }
    if temporary:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
    else:
        print(render(report))
        print(f"\n(benchmark ran {report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
