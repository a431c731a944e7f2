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

``--scaling`` and ``--cold-reads`` (the scale measurements) run every job in a new Python
process instead, started for it (see ``Fresh``): in a forked child each full garbage
collection copies the zygote's pages, a cost no training process has. A timed build starts
right after a full collection; the collections during it are counted (see ``_GcTimer``).

``--compare-sources M`` repeats the build measurements (no read throughput) on the first M
sources of the same data, to show which counts grow with the number of sources.

``--profile-cold N`` says where a repack's cold build of N scale sources spends its time: one
cold build (and first sample) under ``cProfile``, with the builder's thread pool run in the
calling thread so that the per-source builds are profiled too, then the functions that take
the most of it, grouped as Megatron's own per-dataset work, repack's, and the rest.

Usage::

    python scripts/bench_loader.py                   # 1000 sources, compared with 250
    python scripts/bench_loader.py --data /tmp/bench --sources 2000 --json
    python scripts/bench_loader.py --data /tmp/b34 --profile-cold 30000

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
MACHINE_KEYS = ("nproc", "ram_gib", "python", "numpy", "torch", "megatron-core", "kernel")
_SYSCALL_LINE = re.compile(r"^(\w+)\((.*)$")
_PATH = re.compile(r'"([^"]*)"|<([^<>]*)>')


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- data ------------------------------------------------------------------------------------


def source_prefix(data: Path, i: int) -> Path:
    return data / f"d{i // 100:03d}" / f"s{i:05d}"


def generate_sources(
    data: Path,
    count: int,
    seed: int,
    sequences: tuple[int, int] = (40, 80),
    tokens: tuple[int, int] = (5, 600),
) -> list[tuple[float, str]]:
    """Write (or find) ``count`` uint16 prefixes; return ``(weight, prefix)`` pairs.

    Source ``i`` depends only on ``(seed, i)``, so smaller blends are prefixes of larger ones.
    Every source has ``sequences`` (inclusive) sequences (one document each) of ``tokens``
    tokens; the default, 40-80 of 5-600, is enough for every split to hold tokens (Megatron
    loops forever on an empty split).
    """
    from repack.synth import write_prefix

    pairs = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        lengths = rng.integers(
            tokens[0], tokens[1], int(rng.integers(sequences[0], sequences[1] + 1))
        )
        weight = round(float(rng.uniform(0.1, 2.0)), 4)
        prefix = source_prefix(data, i)
        if not (Path(f"{prefix}.idx").exists() and Path(f"{prefix}.bin").exists()):
            ids = rng.integers(1, 65000, int(lengths.sum()), dtype=np.uint16)
            write_prefix(prefix, np.split(ids, np.cumsum(lengths)[:-1]), dtype=np.uint16)
        pairs.append((weight, str(prefix)))
    return pairs


def prepare_blend(root: Path, pairs: list[tuple[float, str]], count: int) -> tuple[Path, Path]:
    """The blend file of the first ``count`` sources and its repack (merged if missing)."""
    from repack.merge import merge

    root.mkdir(parents=True, exist_ok=True)

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
    roots = [os.path.realpath(r) for r in roots]  # /proc shows resolved paths
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
    t0, c0 = time.perf_counter(), time.process_time()
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
    build_s, build_cpu_s = time.perf_counter() - t0, time.process_time() - c0
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
        "build_cpu_s": build_cpu_s,
        "first_sample_s": first_s,
        "lengths": [len(d) if d is not None else 0 for d in datasets],
        "live_after_build": after_build,
    }
    if job["samples"] > 1:
        tokens = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for i in indices[1:].tolist():
            tokens += train[i]["tokens"].numel()
        read_s, read_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        result["read"] = {
            "samples": len(indices) - 1,
            "tokens": tokens,
            "seconds": read_s,
            "cpu_seconds": read_cpu_s,
            "samples_per_cpu_s": (len(indices) - 1) / read_cpu_s,
            "samples_per_s": (len(indices) - 1) / read_s,
            "tokens_per_s": tokens / read_s,
        }
        result["live_after_read"] = live_resources(roots)
        digest = 0
        for i in indices[:DIGEST_SAMPLES].tolist():
            digest = zlib.crc32(train[i]["tokens"].numpy().tobytes(), digest)
        result["digest"] = f"{digest:08x}"
    return result


def zygote_main(fresh: bool = False) -> int:
    """Import Megatron once; fork one child per job line read from stdin. ``fresh``: run one
    job in this process instead (see :class:`Fresh`)."""
    import warnings

    warnings.simplefilter("ignore")
    import torch

    # one intra-op thread, as in a DataLoader worker: idle OpenMP threads spinning after
    # torch's mask ops would otherwise eat the second core
    torch.set_num_threads(1)
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
        if fresh:
            code = _run_job_here(job)
            print(json.dumps({"pid": os.getpid(), "exit": code}), file=protocol, flush=True)
            return 0
        pid = os.fork()
        if pid == 0:
            code = _run_job_here(job)
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        reply = {"pid": pid, "exit": os.waitstatus_to_exitcode(status)}
        print(json.dumps(reply), file=protocol, flush=True)
    return 0


def _run_job_here(job: dict) -> int:
    """Run ``job`` in this process, its result (or the error it died of) in ``job["out"]``."""
    runners = {"loader": run_job, "scale": run_scale_job, "read": run_read_job}
    code = 0
    # opened first: a job that dies of "too many open files" still reports it
    out = open(job["out"], "w")
    try:
        result = runners[job.get("kind", "loader")](job)
    except BaseException as err:
        import traceback

        traceback.print_exc()
        cause = err.__cause__ or err  # Megatron wraps an OSError in an Exception
        result = {"error": f"{type(cause).__name__}: {cause}"}
        code = 0 if job.get("kind", "loader") != "loader" else 1
    out.write(json.dumps(result))
    out.close()
    return code


# --- the driver --------------------------------------------------------------------------------


class Zygote:
    """A ``--zygote`` process, optionally under strace, that runs jobs in forked children."""

    def __init__(
        self, workdir: Path, name: str, trace_prefix: Path | None = None, fresh: bool = False
    ) -> None:
        self.log_path = workdir / f"{name}.log"
        self.trace_prefix = trace_prefix
        command = [sys.executable, os.path.abspath(__file__), "--fresh" if fresh else "--zygote"]
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
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
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


class Fresh:
    """Runs every job in a new Python process of its own, as a training job starts (the timed
    build starts after a full collection: :class:`_GcTimer`). A forked child
    (:class:`Zygote`) is no stand-in here: every full collection in it copies the parent's
    pages (copy-on-write), which no training process pays."""

    def __init__(self, workdir: Path, name: str) -> None:
        self.workdir = workdir
        self.name = name
        self.log_path = workdir / f"{name}.log"

    def wait_ready(self) -> None:
        pass

    def run(self, job: dict) -> dict:
        process = Zygote(self.workdir, self.name, fresh=True)
        try:
            process.wait_ready()
            return process.run(job)
        finally:
            process.close()

    def close(self) -> None:
        pass


def trace_files(trace_prefix: Path) -> set[Path]:
    """strace's per-thread output files (``-ff``) present now."""
    return set(trace_prefix.parent.glob(f"{trace_prefix.name}.*"))


def count_syscalls(files: set[Path], pid: int, job_id: str, roots: list[str]) -> dict:
    """Syscalls on files under ``roots`` in strace's per-thread files of one child process.

    ``files`` are the files the child's threads wrote (the child's own is named after its
    ``pid``). The child's file is cut at its markers; its other threads (Megatron's
    dataset-builder pool) live only during the build and count towards it.
    """
    roots = [*roots, *(os.path.realpath(r) for r in roots)]  # as given, and as strace -y shows
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
        "nproc": len(os.sched_getaffinity(0)),
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
    *,
    seq_length: int,
    repeat: int,
    samples: int,
) -> dict:
    """Every configuration on the blend of ``count`` sources: ``repeat`` timed cold+warm pairs,
    then (with a tracer) one traced cold+warm pair for the syscall counts."""
    sizes = [TRAIN_SAMPLES_PER_SOURCE * count] + [
        max(TRAIN_SAMPLES_PER_SOURCE * count // 20, 1)
    ] * 2
    roots = [str(workdir / "data"), str(repack_dir), str(workdir / "cache")]
    base = {
        "blend": str(blend),
        "repack": str(repack_dir),
        "seq_length": seq_length,
        "sizes": sizes,
        "roots": roots,
    }

    def pair(runner: Zygote, tag: str, config: str) -> dict[str, dict]:
        """A cold build on a new empty cache, then a warm build on what it left, each in a
        new process. The cold process reads one sample: repack packs Megatron's indices then."""
        name = f"{count}-{config.replace(' ', '-')}-{tag}"
        cache = workdir / "cache" / name
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        results = {}
        for phase in PHASES:
            job = {
                **base,
                "id": f"{name}-{phase}",
                "config": config,
                "phase": phase,
                "cache": str(cache),
                "samples": samples if phase == "warm" and runner is zygote else 1,
                "out": str(workdir / "jobs" / f"{name}-{phase}.json"),
            }
            before = trace_files(runner.trace_prefix) if runner.trace_prefix else set()
            t0 = time.perf_counter()
            result = runner.run(job)
            took = time.perf_counter() - t0
            if runner.trace_prefix:
                files = trace_files(runner.trace_prefix) - before
                result["syscalls"] = count_syscalls(files, result["pid"], job["id"], roots)
                b = result["syscalls"]["build"]
                detail = f"{b['opens']} opens, {b['stats']} stats, {b['mmaps']} mmaps"
            else:
                read = result.get("read")
                detail = (
                    f"build {result['build_s']:.2f} s, 1st sample {result['first_sample_s']:.3f} s"
                )
                if read:
                    detail += f", {read['samples_per_s']:,.0f} samples/s"
            log(f"  {count} sources, {config:13s} {tag:6s} {phase}: {detail} ({took:.0f} s)")
            results[phase] = result
        return results

    runs: dict[str, list[dict[str, dict]]] = {c: [] for c in CONFIGS}
    for r in range(repeat):  # interleaved, so that drifting machine load hits all alike
        for config in CONFIGS:
            runs[config].append(pair(zygote, f"run{r}", config))
    traced = {c: pair(tracer, "traced", c) for c in CONFIGS} if tracer else {}
    return summarize(runs, traced, count, sizes)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(runs: dict, traced: dict, count: int, sizes: list[int]) -> dict:
    """Medians of the timed runs, live resources of the first, syscall counts of the traced."""
    configs = {}
    for config, pairs in runs.items():
        cold = [p["cold"] for p in pairs]
        warm = [p["warm"] for p in pairs]
        entry: dict = {}
        for phase, results in (("cold", cold), ("warm", warm)):
            for key in ("build_s", "build_cpu_s", "first_sample_s"):
                entry[f"{phase}_{key}"] = _median([r[key] for r in results])
            entry[f"{phase}_build_runs_s"] = [r["build_s"] for r in results]
        entry["lengths"] = warm[0]["lengths"]
        entry["live_after_build"] = warm[0]["live_after_build"]
        if "read" in warm[0]:
            for key in ("samples_per_s", "tokens_per_s", "samples_per_cpu_s"):
                entry[key] = _median([r["read"][key] for r in warm])
            entry["samples_per_s_runs"] = [r["read"]["samples_per_s"] for r in warm]
            entry["read_samples"] = warm[0]["read"]["samples"]
            entry["live_after_read"] = warm[0]["live_after_read"]
            entry["digests"] = sorted({r["digest"] for r in warm})
        if config in traced:
            entry["syscalls"] = {phase: traced[config][phase]["syscalls"] for phase in PHASES}
        configs[config] = entry
    return {"sources": count, "sizes": sizes, "configs": configs}


def ratios(main: dict, compare: dict | None) -> dict:
    """The goals' ratios: repack against stock."""
    c = main["configs"]
    pairs = {
        "repack mmap vs stock mmap": ("repack mmap", "stock mmap"),
        "repack pread vs stock no-mmap": ("repack pread", "stock no-mmap"),
        "repack pread vs stock mmap": ("repack pread", "stock mmap"),
    }
    out: dict = {}
    for key in ("warm_build_s", "warm_build_cpu_s", "cold_build_s", "cold_build_cpu_s"):
        out[f"{key.removesuffix('_s')}_speedup"] = {
            label: c[stock][key] / c[ours][key] for label, (ours, stock) in pairs.items()
        }
    if "samples_per_s" in c["stock mmap"]:
        for key in ("samples_per_s", "samples_per_cpu_s"):
            base = c["stock mmap"][key]
            out[f"read_{key}_vs_stock_mmap"] = {name: c[name][key] / base for name in CONFIGS}
    if compare is not None and all("syscalls" in c[n] for n in CONFIGS):
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

    def line(cells: list[str]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _osm(counts: dict | None) -> str:
    if not counts:
        return "n/a"
    return f"{counts['opens']}/{counts['stats']}/{counts['mmaps']}"


def render(report: dict) -> str:
    """The human-readable tables of a report."""
    facts = report["machine"]
    parts = [
        f"repack loader benchmark: {report['sources']:,} sources ({report['tokens']:,} uint16 "
        f"tokens), sequence length {report['seq_length']}; times are medians of "
        f"{report['repeat']} runs, wall (cpu) seconds",
        "machine: " + ", ".join(f"{k} {facts[k]}" for k in MACHINE_KEYS if k in facts),
        "load average before/after: "
        + " / ".join(", ".join(f"{x:.1f}" for x in la) for la in report["loadavg"]),
        f"syscall counts: {report['counter']}",
        "",
    ]
    for result in report["results"]:
        c = result["configs"]
        parts.append(
            f"{result['sources']:,} sources, samples requested train/valid/test "
            f"{'/'.join(map(str, result['sizes']))}:"
        )
        with_read = "samples_per_s" in c["stock mmap"]
        headers = ["config", "cold build", "cold 1st", "warm build", "warm 1st"]
        if with_read:
            headers += ["samples/s", "Mtokens/s", "samples/cpu-s"]
        rows = []
        for name in CONFIGS:
            e = c[name]
            row = [
                name,
                f"{e['cold_build_s']:.2f} ({e['cold_build_cpu_s']:.2f})",
                f"{e['cold_first_sample_s']:.3f}",
                f"{e['warm_build_s']:.2f} ({e['warm_build_cpu_s']:.2f})",
                f"{e['warm_first_sample_s']:.3f}",
            ]
            if with_read:
                row += [
                    f"{e['samples_per_s']:,.0f}",
                    f"{e['tokens_per_s'] / 1e6:.2f}",
                    f"{e['samples_per_cpu_s']:,.0f}",
                ]
            rows.append(row)
        parts += [_table(headers, rows), ""]
        headers = ["opens/stats/mmaps", "cold build", "cold 1st", "warm build", "warm 1st"]
        headers += ["live mmaps/fds: built"] + (["read"] if with_read else [])
        rows = []
        for name in CONFIGS:
            e = c[name]
            s = e.get("syscalls", {})
            row = [name] + [
                _osm(s.get(phase, {}).get(window))
                for phase in PHASES
                for window in ("build", "first_sample")
            ]
            row.append(f"{e['live_after_build']['mmaps']}/{e['live_after_build']['fds']}")
            if with_read:
                row.append(f"{e['live_after_read']['mmaps']}/{e['live_after_read']['fds']}")
            rows.append(row)
        parts += [_table(headers, rows), ""]
    r = report["ratios"]
    parts.append("repack against stock (goal):")
    for label, value in r["warm_build_speedup"].items():
        cpu = r["warm_build_cpu_speedup"][label]
        parts.append(f"  warm build {label}: {value:.2f}x faster, cpu {cpu:.2f}x (goal >= 3x)")
    for label, value in r["cold_build_speedup"].items():
        cpu = r["cold_build_cpu_speedup"][label]
        parts.append(f"  cold build {label}: {value:.2f}x faster, cpu {cpu:.2f}x")
    for name, value in r.get("read_samples_per_s_vs_stock_mmap", {}).items():
        if name != "stock mmap":
            cpu = r["read_samples_per_cpu_s_vs_stock_mmap"][name]
            parts.append(
                f"  read throughput {name} / stock mmap: {value:.2f}, per cpu-s {cpu:.2f} "
                "(goal >= 0.95)"
            )
    growth = r.get("warm_build_syscalls_small_vs_large")
    if growth:
        small, large = report["results"][1]["sources"], report["results"][0]["sources"]
        parts.append(
            f"  warm build opens/stats/mmaps at {small} -> {large} sources (goal: independent "
            "of the source count):"
        )
        for name, g in growth.items():
            parts.append(
                f"    {name:13s} " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in g.items())
            )
    digests = {d for e in report["results"][0]["configs"].values() for d in e.get("digests", [])}
    if digests:
        parts.append(
            f"  samples read: {'identical' if len(digests) == 1 else 'DIFFERENT'} in every "
            f"configuration and run (crc32 of the first {DIGEST_SAMPLES}: "
            f"{', '.join(sorted(digests))})"
        )
    return "\n".join(parts)


# --- scaling: many small sources ---------------------------------------------------------------

#: The scaling mode's blend: small sources, a flat blend, train only (as in issue 10).
SCALE_SEQUENCES = (4, 12)
SCALE_TOKENS = (40, 400)
SCALE_SPLIT = "100,0,0"
SCALE_SEQ_LENGTH = 64
SCALE_SAMPLES_PER_SOURCE = 20
#: The cold-read mode's sources: ~330 KB of uint16 tokens each, as in the issue's report.
READ_SEQUENCES = (60, 99)
READ_TOKENS = (200, 4000)
READ_SEQ_LENGTH = 2048
#: Samples per DataLoader batch in the cold-read mode (one sample per batch measures the
#: workers' inter-process hand-over rather than reading).
READ_BATCH = 16


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as stream:
        for line in stream:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _init_process_group() -> None:
    import logging

    import torch

    logging.disable(logging.WARNING)
    with tempfile.NamedTemporaryFile(prefix="bench-dist-") as rendezvous:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{rendezvous.name}", rank=0, world_size=1
        )


def _build(job: dict, use_repack: bool, mmap_bin_files: bool, sizes: list[int]):
    """Megatron's blended datasets of the job's blend (the process group is up)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from repack.megatron import dataset_class

    items = json.loads(Path(job["blend"]).read_text())
    cls = dataset_class(job["repack"]) if use_repack else GPTDataset
    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=job["seq_length"],
        blend=([str(p) for p in items[1::2]], [float(w) for w in items[0::2]]),
        split=job["split"],
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=job["cache"],
        mmap_bin_files=mmap_bin_files,
    )
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def run_scale_job(job: dict) -> dict:
    """Build (cold or warm, as the cache is) and read the first sample; time, memory, files."""
    use_repack, mmap_bin_files = CONFIGS[job["config"]]
    _init_process_group()
    rss_start = _status_kib("VmRSS")
    before = set(os.listdir(job["cache"]))
    collections = _GcTimer()
    t0 = time.perf_counter()
    datasets = _build(job, use_repack, mmap_bin_files, job["sizes"])
    build_s = time.perf_counter() - t0
    train = datasets[0]
    t1 = time.perf_counter()
    sample = train[int(np.random.default_rng(SEED).integers(0, len(train)))]
    first_s = time.perf_counter() - t1
    collections.stop()
    created = sorted(set(os.listdir(job["cache"])) - before)
    return {
        "build_s": build_s,
        "first_sample_s": first_s,
        "total_s": build_s + first_s,
        "rss_start_mib": rss_start / 1024,
        "peak_rss_mib": _status_kib("VmHWM") / 1024,
        "files_created": len(created),
        "created": created[:20],
        "live": live_resources(job["roots"]),
        "length": len(train),
        "digest": f"{zlib.crc32(sample['tokens'].numpy().tobytes()):08x}",
        "gc_full": collections.full,
        "gc_s": collections.seconds,
    }


class _GcTimer:
    """Starts with a full garbage collection, then counts the collections that follow and the
    time they take, until :meth:`stop`.

    A process that has just imported torch and Megatron (about 400,000 objects) owes a full
    collection (0.2 s here) that lands in whatever runs next; a training process has done
    other work (its process group, its model) before it builds its datasets, so that the
    state the build starts in is arbitrary. Starting every timed build right after a
    collection treats stock and repack alike; full collections that the build's own objects
    set off still count, and are reported (``gc_full``, ``gc_s``)."""

    def __init__(self) -> None:
        import gc

        gc.collect()
        self.full = 0
        self.seconds = 0.0
        self._started = 0.0
        self._gc = gc
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._started
        self.full += info["generation"] == 2

    def stop(self) -> None:
        self._gc.callbacks.remove(self._callback)


def run_read_job(job: dict) -> dict:
    """Build on a warm index cache, then read ``samples`` random samples through a DataLoader
    with ``workers`` workers; the driver evicted every file from the page cache before."""
    import gc

    import torch

    use_repack, mmap_bin_files = CONFIGS[job["config"]]
    _init_process_group()
    t0 = time.perf_counter()
    train = _build(job, use_repack, mmap_bin_files, job["sizes"])[0]
    build_s = time.perf_counter() - t0
    indices = np.random.default_rng(SEED).integers(0, len(train), job["samples"]).tolist()
    loader = torch.utils.data.DataLoader(
        train, batch_size=READ_BATCH, sampler=indices, num_workers=job["workers"]
    )
    # Every configuration alike: what the workers inherit is frozen before they are forked.
    # Otherwise whether a worker runs a full collection at its start, walking (and copying)
    # the parent's whole heap, 0.5 s each, depends on the collector's state the parent left,
    # not on the storage this measures. (repack freezes in forked children on its own.)
    gc.freeze()
    digest = 0
    t0 = time.perf_counter()
    for n, batch in enumerate(loader):
        if n * READ_BATCH < DIGEST_SAMPLES:
            digest = zlib.crc32(batch["tokens"].numpy().tobytes(), digest)
    read_s = time.perf_counter() - t0
    return {
        "build_s": build_s,
        "read_s": read_s,
        "samples_per_s": len(indices) / read_s,
        "digest": f"{digest:08x}",
    }


def evict(roots: list[str]) -> dict:
    """Drop every file under ``roots`` from the page cache: ``sync``, then
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each (dirty pages would stay). Returns what
    ``fincore`` still finds resident of a few of them, where fincore is installed."""
    os.sync()
    sample = []
    for root in roots:
        for folder, _, files in os.walk(root):
            for name in files:
                path = os.path.join(folder, name)
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                if len(sample) < 3 and name.endswith(".bin"):
                    sample.append(path)
    fincore = shutil.which("fincore")
    if not fincore or not sample:
        return {}
    out = subprocess.run(
        [fincore, "--bytes", "--noheadings", "--output", "RES,FILE", *sample],
        capture_output=True,
        text=True,
    ).stdout
    return {line.split()[1]: int(line.split()[0]) for line in out.splitlines() if line.strip()}


def _stat(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def scaling(
    runner: Zygote | Fresh, workdir: Path, counts: list[int], repeat: int, seed: int
) -> dict:
    """Cold and warm builds + first sample, stock and repack, at every count."""
    root = workdir / "scale"
    pairs = generate_sources(
        root / "data", max(counts), seed, sequences=SCALE_SEQUENCES, tokens=SCALE_TOKENS
    )
    blends = {n: prepare_blend(root, pairs, n) for n in counts}
    configs = ("stock mmap", "repack mmap")
    runs: dict = {(n, c, p): [] for n in counts for c in configs for p in PHASES}
    died: dict[str, dict] = {}
    for r in range(repeat):  # interleaved, so that drifting machine load hits all alike
        for n in counts:
            for config in configs:
                if config in died and died[config]["sources"] < n:
                    continue
                cache = root / "cache" / f"{n}-{config.replace(' ', '-')}-run{r}"
                shutil.rmtree(cache, ignore_errors=True)
                cache.mkdir(parents=True)
                for phase in PHASES:
                    job = {
                        "kind": "scale",
                        "id": f"scale-{n}-{config}-{phase}-{r}",
                        "config": config,
                        "blend": str(blends[n][0]),
                        "repack": str(blends[n][1]),
                        "cache": str(cache),
                        "split": SCALE_SPLIT,
                        "seq_length": SCALE_SEQ_LENGTH,
                        "sizes": [SCALE_SAMPLES_PER_SOURCE * n, 0, 0],
                        "roots": [str(root / "data"), str(blends[n][1]), str(cache)],
                        "out": str(workdir / "jobs" / "scale.json"),
                    }
                    result = runner.run(job)
                    runs[(n, config, phase)].append(result)
                    if "error" in result:
                        died.setdefault(config, {"sources": n, "phase": phase, **result})
                        log(f"  {n} sources, {config} {phase}: died: {result['error']}")
                        break
                    log(
                        f"  {n} sources, {config} {phase}: build {result['build_s']:.2f} s + "
                        f"1st {result['first_sample_s']:.3f} s, {result['files_created']} files, "
                        f"{result['gc_full']} full GC ({result['gc_s']:.2f} s in GC)"
                    )
                shutil.rmtree(cache, ignore_errors=True)
    rows = []
    for n in counts:
        for config in configs:
            row: dict = {"sources": n, "config": config}
            for phase in PHASES:
                ok = [x for x in runs[(n, config, phase)] if "error" not in x]
                for key in ("build_s", "first_sample_s", "total_s", "peak_rss_mib", "gc_s"):
                    row[f"{phase}_{key}"] = _stat([x[key] for x in ok])
                row[f"{phase}_gc_full_runs"] = [x["gc_full"] for x in ok]
                row[f"{phase}_total_runs_s"] = [x["total_s"] for x in ok]
                row[f"{phase}_files_created"] = _stat([x["files_created"] for x in ok])
                row[f"{phase}_live"] = ok[0]["live"] if ok else None
                row[f"{phase}_digests"] = sorted({x["digest"] for x in ok})
                if ok:
                    row[f"{phase}_per_source_ms"] = 1000 * row[f"{phase}_total_s"] / n
            row["error"] = next(
                (x["error"] for p in PHASES for x in runs[(n, config, p)] if "error" in x), None
            )
            if row["error"] is None and config in died and died[config]["sources"] < n:
                row["error"] = f"not run: died at {died[config]['sources']} sources"
            rows.append(row)
    return {"counts": counts, "rows": rows, "died": died}


def cold_reads(
    runner: Zygote | Fresh,
    workdir: Path,
    counts: list[int],
    workers: list[int],
    samples: int,
    repeat: int,
    seed: int,
) -> dict:
    """Random-sample reads with every file evicted from the page cache before each run."""
    root = workdir / "reads"
    pairs = generate_sources(
        root / "data", max(counts), seed, sequences=READ_SEQUENCES, tokens=READ_TOKENS
    )
    blends = {n: prepare_blend(root, pairs, n) for n in counts}
    runs: dict = {}
    residue: dict = {}
    failed: dict[tuple[int, str], str] = {}
    for n in counts:
        base = {
            "kind": "read",
            "blend": str(blends[n][0]),
            "repack": str(blends[n][1]),
            "split": SCALE_SPLIT,
            "seq_length": READ_SEQ_LENGTH,
            "sizes": [SCALE_SAMPLES_PER_SOURCE * n, 0, 0],
            "samples": samples,
            "out": str(workdir / "jobs" / "read.json"),
        }
        roots = [str(root / "data"), str(blends[n][1])]
        for config in CONFIGS:  # untimed: a warm index cache for every configuration
            cache = root / "cache" / f"{n}-{config.replace(' ', '-')}"
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True)
            job = {**base, "config": config, "cache": str(cache), "workers": 0, "samples": 1}
            result = runner.run(job)
            if "error" in result:
                failed[(n, config)] = result["error"]
                log(f"  {n} sources, {config}: died: {result['error']}")
        for _ in range(repeat):
            for w in workers:
                for config in CONFIGS:
                    if (n, config) in failed:
                        continue
                    cache = root / "cache" / f"{n}-{config.replace(' ', '-')}"
                    residue = evict([*roots, str(cache)])
                    job = {**base, "config": config, "cache": str(cache), "workers": w}
                    result = runner.run(job)
                    if "error" in result:
                        failed[(n, config)] = result["error"]
                        log(f"  {n} sources, {config}: died: {result['error']}")
                        continue
                    runs.setdefault((n, w, config), []).append(result)
                    log(
                        f"  {n} sources, {w} workers, {config}: "
                        f"{result['samples_per_s']:,.0f} samples/s"
                    )
    rows = []
    for (n, w, config), results in runs.items():
        rows.append(
            {
                "sources": n,
                "workers": w,
                "config": config,
                "samples_per_s": _stat([x["samples_per_s"] for x in results]),
                "runs": [round(x["samples_per_s"], 1) for x in results],
                "digests": sorted({x["digest"] for x in results}),
            }
        )
    died = [{"sources": n, "config": c, "error": e} for (n, c), e in failed.items()]
    return {"rows": rows, "samples": samples, "resident_after_evict": residue, "died": died}


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def render_scaling(report: dict) -> str:
    facts = report["machine"]
    parts = [
        "machine: " + ", ".join(f"{k} {facts[k]}" for k in MACHINE_KEYS if k in facts),
        "load average before/after: "
        + " / ".join(", ".join(f"{x:.1f}" for x in la) for la in report["loadavg"]),
    ]
    scale = report.get("scaling")
    if scale:
        parts += [
            "",
            f"scaling: build + first sample, medians of {report['repeat']} runs, each in a new "
            f"process; {SCALE_SAMPLES_PER_SOURCE} train samples per source, split "
            f"{SCALE_SPLIT}, sequence length {SCALE_SEQ_LENGTH}, mmap",
        ]
        headers = ["sources", "config", "cold build+1st", "warm build+1st", "warm ms/source"]
        headers += ["warm GC s (full)", "cold files", "peak RSS MiB", "live mmaps/fds"]
        rows = []
        for row in scale["rows"]:
            if row["error"] and row["cold_total_s"] is None:
                what = "not run" if row["error"].startswith("not run") else "died"
                rows.append([f"{row['sources']:,}", row["config"], what, *["-"] * 6])
                continue
            live = row["warm_live"] or row["cold_live"]
            rows.append(
                [
                    f"{row['sources']:,}",
                    row["config"],
                    f"{_fmt(row['cold_build_s'], '.2f')}+{_fmt(row['cold_first_sample_s'], '.3f')}",
                    f"{_fmt(row['warm_build_s'], '.2f')}+{_fmt(row['warm_first_sample_s'], '.3f')}",
                    _fmt(row.get("warm_per_source_ms"), ".3f"),
                    f"{_fmt(row['warm_gc_s'], '.2f')} "
                    f"({','.join(map(str, row['warm_gc_full_runs'])) or '-'})",
                    _fmt(row["cold_files_created"], ".0f"),
                    _fmt(row["warm_peak_rss_mib"] or row["cold_peak_rss_mib"], ".0f"),
                    f"{live['mmaps']}/{live['fds']}" if live else "-",
                ]
            )
        parts.append(_table(headers, rows))
        for config, death in scale["died"].items():
            parts.append(
                f"{config} died at {death['sources']:,} sources ({death['phase']}): "
                f"{death['error']}"
            )
        ratio = report["scaling_ratios"]
        parts.append("repack against stock (medians of build + first sample):")
        for n, r in ratio["speedup"].items():
            if r["warm"] is None and r["cold"] is None:
                parts.append(f"  {n} sources: stock did not run")
                continue
            parts.append(
                f"  {n} sources: warm {_fmt(r['warm'], '.2f')}x, cold {_fmt(r['cold'], '.2f')}x"
            )
        parts.append(
            "  repack warm per-source cost, largest / smallest count: "
            f"{_fmt(ratio['per_source_growth'], '.2f')} (goal <= 1.5)"
        )
        parts.append(
            f"  most files created in the cache folder by a repack build: "
            f"{ratio['max_files']:.0f} (goal <= 10)"
        )
    reads = report.get("cold_reads")
    if reads:
        parts += [
            "",
            f"cold page cache: {reads['samples']} random samples of {READ_SEQ_LENGTH} tokens in "
            f"batches of {READ_BATCH}, "
            "every file evicted (sync + POSIX_FADV_DONTNEED) before each run; samples/s, "
            f"medians of {report['repeat']}",
        ]
        rows = []
        base = {
            (r["sources"], r["workers"]): r["samples_per_s"]
            for r in reads["rows"]
            if r["config"] == "stock mmap"
        }
        for r in reads["rows"]:
            stock = base.get((r["sources"], r["workers"]))
            rows.append(
                [
                    f"{r['sources']:,}",
                    str(r["workers"]),
                    r["config"],
                    f"{r['samples_per_s']:,.0f}",
                    f"{r['samples_per_s'] / stock:.2f}" if stock else "-",
                    ", ".join(f"{x:,.0f}" for x in r["runs"]),
                    ",".join(r["digests"]),
                ]
            )
        parts.append(
            _table(
                ["sources", "workers", "config", "samples/s", "vs stock mmap", "runs", "crc32"],
                rows,
            )
        )
        for death in reads["died"]:
            parts.append(
                f"{death['config']} at {death['sources']:,} sources died: {death['error']}"
            )
        if reads["resident_after_evict"]:
            parts.append(
                "resident after eviction (fincore, bytes): "
                + ", ".join(
                    f"{os.path.basename(k)} {v}" for k, v in reads["resident_after_evict"].items()
                )
            )
    return "\n".join(parts)


def scaling_ratios(scale: dict) -> dict:
    by = {(r["sources"], r["config"]): r for r in scale["rows"]}
    speedup = {}
    for n in scale["counts"]:
        stock, ours = by[(n, "stock mmap")], by[(n, "repack mmap")]
        speedup[n] = {
            p: (stock[f"{p}_total_s"] / ours[f"{p}_total_s"])
            if stock[f"{p}_total_s"] and ours[f"{p}_total_s"]
            else None
            for p in PHASES
        }
    small, large = min(scale["counts"]), max(scale["counts"])
    a = by[(small, "repack mmap")].get("warm_per_source_ms")
    b = by[(large, "repack mmap")].get("warm_per_source_ms")
    files = [r["cold_files_created"] or 0 for r in scale["rows"] if r["config"] == "repack mmap"]
    return {
        "speedup": speedup,
        "per_source_growth": b / a if a and b else None,
        "max_files": max(files),
    }


def main_scaling(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    load_before = os.getloadavg()
    temporary = args.data is None
    workdir = Path(tempfile.mkdtemp(prefix="bench-loader-") if temporary else args.data).resolve()
    (workdir / "jobs").mkdir(parents=True, exist_ok=True)
    runner = Fresh(workdir, "fresh")
    report: dict = {"repeat": args.repeat, "machine": machine_facts(), "processes": "fresh"}
    try:
        if args.scaling:
            counts = [int(x) for x in args.scaling.split(",")]
            log(f"scaling over {counts} sources")
            report["scaling"] = scaling(runner, workdir, counts, args.repeat, args.seed)
            report["scaling_ratios"] = scaling_ratios(report["scaling"])
        if args.cold_reads:
            counts = [int(x) for x in args.cold_reads.split(",")]
            workers = [int(x) for x in args.workers.split(",")]
            log(f"cold-page-cache reads at {counts} sources, workers {workers}")
            report["cold_reads"] = cold_reads(
                runner, workdir, counts, workers, args.read_samples, args.repeat, args.seed
            )
    finally:
        runner.close()
    report["command"] = " ".join(["python", "scripts/bench_loader.py", *sys.argv[1:]])
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["loadavg"] = [load_before, os.getloadavg()]
    if temporary:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True, default=str))
    else:
        print(render_scaling(report))
        print(f"\n(benchmark ran {report['seconds']:.0f} s)")
    return 0


#: What --profile-cold reports: (label, the function's file and name as cProfile names them)
PROFILED = [
    ("the whole build (after the imports)", "blended_megatron_dataset_builder.py", "build"),
    ("  per-source GPTDataset.__init__ (Megatron's)", "gpt_dataset.py", "__init__"),
    (
        "    their indices: Megatron's _build_document_sample_shuffle_indices",
        "gpt_dataset.py",
        "_build_document_sample_shuffle_indices",
    ),
    ("      of which build_sample_idx (C++)", "helpers.py", "build_sample_idx"),
    ("    MegatronDataset.__init__ (description, hash)", "megatron_dataset.py", "__init__"),
    ("    json.dumps (descriptions, indent=4: Python's encoder)", "__init__.py", "dumps"),
    ("    log_single_rank (Megatron's per-dataset logs)", "_rank_utils.py", "log_single_rank"),
    ("  BlendedDataset.__init__", "blended_dataset.py", "__init__"),
    ("  repack: the index cache written (IndexCache.flush)", "indexcache.py", "flush"),
    ("  repack: the manifest parsed", "manifest.py", "parse_manifest"),
]


def profile_cold(workdir: Path, count: int, seed: int) -> int:
    """--profile-cold: one cold build of ``count`` scale sources under cProfile."""
    import cProfile
    import gc
    import pstats
    from concurrent.futures import Future

    root = workdir / "scale"
    pairs = generate_sources(
        root / "data", count, seed, sequences=SCALE_SEQUENCES, tokens=SCALE_TOKENS
    )
    blend, repack = prepare_blend(root, pairs, count)
    cache = root / "cache" / f"profile-{count}"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    job = {
        "blend": str(blend),
        "repack": str(repack),
        "cache": str(cache),
        "split": SCALE_SPLIT,
        "seq_length": SCALE_SEQ_LENGTH,
    }
    _init_process_group()
    import megatron.core.datasets.blended_megatron_dataset_builder as builder

    class Inline:  # the builder's ThreadPoolExecutor, run in this thread: cProfile sees it
        def __init__(self, max_workers=None) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> bool:
            return False

        def submit(self, function, *args, **kwargs) -> Future:
            future: Future = Future()
            try:
                future.set_result(function(*args, **kwargs))
            except BaseException as err:
                future.set_exception(err)
            return future

    builder.ThreadPoolExecutor = Inline
    import repack.megatron  # (its import is not the build's)

    gc.collect()
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    datasets = _build(job, True, True, [SCALE_SAMPLES_PER_SOURCE * count, 0, 0])
    datasets[0][0]
    profile.disable()
    total = time.perf_counter() - started
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    print(
        f"cold build + first sample of {count:,} sources, profiled: {total:.1f} s "
        f"(load average {os.getloadavg()[0]:.1f})"
    )
    for label, file, name in PROFILED:
        seconds = sum(
            ct for (f, _, n), (_, _, _, ct, _) in stats.items() if f.endswith(file) and n == name
        )
        print(f"  {label:<62} {seconds:7.2f} s  {seconds / total:6.1%}")
    shutil.rmtree(cache, ignore_errors=True)
    return 0


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
    parser.add_argument(
        "--scaling",
        metavar="COUNTS",
        help="scaling mode: cold and warm build + first sample, stock and repack, at these "
        "comma-separated source counts of small sources (e.g. 1000,3000,10000,30000)",
    )
    parser.add_argument(
        "--cold-reads",
        metavar="COUNTS",
        help="random-sample reads with the page cache bypassed (every file evicted before "
        "each run) at these comma-separated source counts (e.g. 1000,10000)",
    )
    parser.add_argument("--workers", default="0,2,4", help="DataLoader workers (--cold-reads)")
    parser.add_argument(
        "--read-samples", type=int, default=3000, help="samples per run (--cold-reads)"
    )
    parser.add_argument(
        "--profile-cold",
        type=int,
        metavar="N",
        help="where a repack's cold build of N small sources spends its time (cProfile)",
    )
    parser.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fresh", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.zygote or args.fresh:
        return zygote_main(fresh=args.fresh)
    if args.profile_cold:
        workdir = Path(args.data or tempfile.mkdtemp(prefix="bench-loader-")).resolve()
        return profile_cold(workdir, args.profile_cold, args.seed)
    if args.scaling or args.cold_reads:
        return main_scaling(args)
    if args.compare_sources >= args.sources:
        parser.error("--compare-sources must be smaller than --sources")

    started = time.perf_counter()
    load_before = os.getloadavg()
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
    elif args.no_strace:
        counter = "not measured (--no-strace)"
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
        log(
            f"{args.sources} sources ready in {workdir / 'data'} ({time.perf_counter() - t0:.1f} s)"
        )
        counts = [args.sources] + ([args.compare_sources] if args.compare_sources else [])
        blends = {n: prepare_blend(workdir, pairs, n) for n in counts}
        from repack.read.reader import open_repack

        tokens = sum(s.token_count for s in open_repack(blends[args.sources][1]).manifest.sources)
        zygote.wait_ready()
        if tracer:
            tracer.wait_ready()
        results = []
        for n in counts:
            log(f"measuring {n} sources")
            samples = args.samples if n == args.sources else 0
            results.append(
                measure(
                    zygote,
                    tracer,
                    workdir,
                    n,
                    *blends[n],
                    seq_length=args.seq_length,
                    repeat=args.repeat if n == args.sources else 1,
                    samples=samples,
                )
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
        "loadavg": [load_before, os.getloadavg()],
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
