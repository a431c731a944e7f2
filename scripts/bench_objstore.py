#!/usr/bin/env python3
"""Benchmark repack on object storage against a real S3 server (SeaweedFS on 127.0.0.1).

Starts ``weed mini`` the way the tests do (tests/s3_support.py: loopback only, telemetry
off, a private folder), generates a blend (``--sources``, ``--tokens`` per source), and
measures:

* **merge**: ``repack merge BLEND s3://...`` from the local sources (seconds, requests);
* **open**: requests of ``Repack(url)`` cold (empty node cache) and warm;
* **verify vs plain**: ``repack.read.verify.verify(url)`` (every checksum, parallel ranged reads)
  against a plain parallel ranged reader of the same bytes (the index and every shard, in
  ``PIECE`` ranges on ``READERS`` threads of its own boto3 client, bytes dropped): alternated,
  ``--repeat`` times each, medians; the ratio is plain time / verify time (1.0: verify reads
  as fast as the server gives bytes; the goal is >= 0.8).

With ``--loader`` it measures training from the bucket instead, side by side with Megatron-LM
main's own object-storage path on the original blend uploaded to the same server:

* **systems**: ``megatron-msc`` (Megatron main's ``GPTDataset`` on ``msc://`` prefixes:
  ``object_storage_cache_path``, ``mmap_bin_files=False``, its ``_MultiStorageClientBinReader``),
  optionally ``megatron-s3`` (the same on ``s3://`` prefixes: its ``_S3BinReader``, one boto3
  client and one block of up to 256 MiB per prefix), and ``repack-s3`` (``RepackedGPTDataset``
  bound to the repack's ``s3://`` URL, through the same Megatron main code);
* **start**: requests (every boto3 client of the process counted by operation, MSC's too),
  seconds, and local files created, on a cold start (empty caches) and a warm one;
* **reads**: samples per second through a ``DataLoader`` (batches of 4) with 0, 2 and 4
  workers, for random indices of the blended train dataset (``random``) and for the training
  order (``order``: indices 0, 1, 2, ...); memory (RSS) of the main process and of each worker
  (PSS and RSS); every run a new process, systems alternated, ``--repeat`` runs, medians.

Megatron main comes from a checkout (``--megatron-lm``, default ``/work/venvs/mlm``) imported
without ``megatron/core/__init__.py`` (which needs Triton and Transformer Engine); its C++
helpers are the installed megatron-core's (``helpers.cpp`` is the same file).

Usage::

    python scripts/bench_objstore.py                  # 100 sources, ~180 MB
    python scripts/bench_objstore.py --sources 1000 --tokens 20000,60000 --json
    python scripts/bench_objstore.py --loader --sources 1000 --repeat 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from s3_support import RequestCounter, server_env, start_server  # noqa: E402

from repack.merge import merge  # noqa: E402
from repack.read.reader import Repack  # noqa: E402
from repack.read.verify import verify  # noqa: E402
from repack.store import open_store  # noqa: E402
from repack.store.objects import PIECE, READERS  # noqa: E402
from repack.synth import make_blend  # noqa: E402


def plain_read(server, bucket: str, keys: list[tuple[str, int]]) -> int:
    """Every byte of ``keys`` in PIECE ranges on READERS threads; the bytes read."""
    client = server.client()

    def get(job):
        key, start, size = job
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + size - 1}")
        return len(body["Body"].read())

    jobs = [
        (key, start, min(PIECE, size - start))
        for key, size in keys
        for start in range(0, size, PIECE)
    ]
    with ThreadPoolExecutor(READERS) as pool:
        return sum(pool.map(get, jobs))


# --- --loader: training from the bucket, side by side with Megatron main ----------------------

SEED = 1234
SYSTEMS = ("megatron-msc", "repack-s3")


def megatron_main(checkout: str) -> str:
    """Import Megatron-LM main's ``megatron.core`` from ``checkout`` without running its
    ``__init__`` (which imports Triton); its C++ helpers from the installed megatron-core."""
    import importlib.util
    import types

    installed = importlib.util.find_spec("megatron.core.datasets.helpers_cpp")
    helpers = os.path.dirname(installed.origin) if installed else None
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]
    package = types.ModuleType("megatron")
    package.__path__ = [os.path.join(checkout, "megatron")]
    core = types.ModuleType("megatron.core")
    core.__path__ = [os.path.join(checkout, "megatron", "core")]
    sys.modules["megatron"], sys.modules["megatron.core"] = package, core
    package.core = core
    import megatron.core.tensor_parallel  # the order megatron/core/__init__ imports them
    import megatron.core.utils
    from megatron.core import parallel_state  # noqa: F401
    from megatron.core.package_info import __version__

    core.__version__ = __version__
    import megatron.core.datasets

    if helpers:
        megatron.core.datasets.__path__.append(helpers)
    from megatron.core.msc_utils import MultiStorageClientFeature

    MultiStorageClientFeature.enable()  # what --enable-msc does
    return __version__


#: Set in the measured processes: DataLoader workers are spawned, and import this file (as
#: ``__mp_main__``) before they unpickle Megatron main's datasets.
MEGATRON_LM_ENV = "BENCH_MEGATRON_LM"
if os.environ.get(MEGATRON_LM_ENV) and "megatron.core.datasets.gpt_dataset" not in sys.modules:
    megatron_main(os.environ[MEGATRON_LM_ENV])


class _Tokenizer:
    """The least Megatron's GPTDataset needs of a tokenizer."""

    vocab_size = 65000
    eod = 0
    unique_identifiers = {"class": "BenchTokenizer"}  # noqa: RUF012


class _Requests:
    """Counts the requests of every botocore client of this process, by operation."""

    def __init__(self) -> None:
        from collections import Counter

        import botocore.client

        self.counts: Counter[str] = Counter()
        real = botocore.client.BaseClient._make_api_call
        counts = self.counts

        def counted(client, operation, params):
            counts[operation] += 1
            return real(client, operation, params)

        botocore.client.BaseClient._make_api_call = counted


def _files(folders: list[str]) -> int:
    return sum(len(files) for folder in folders for _, _, files in os.walk(folder))


def _memory(pid: int | str = "self") -> dict[str, int]:
    """RSS and PSS in KiB."""
    found = {}
    with open(f"/proc/{pid}/smaps_rollup") as stream:
        for line in stream:
            name, _, rest = line.partition(":")
            if name in ("Rss", "Pss"):
                found[name.lower() + "_kib"] = int(rest.split()[0])
    return found


def loader_child(job: dict) -> dict:
    """One measured process: build the blend's datasets, then read through a DataLoader."""
    import gc

    import megatron.core
    import numpy as np

    version = megatron.core.__version__
    requests = _Requests()
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    system = job["system"]
    weights, prefixes = job["weights"], job["prefixes"][system]
    extra = {}
    if system.startswith("megatron"):
        cls = GPTDataset
        extra = {"object_storage_cache_path": job["idx_cache"], "path_to_cache": job["cache"]}
    else:
        from repack.megatron import dataset_class

        cls = dataset_class(job["repack"])
    config = GPTDatasetConfig(
        random_seed=SEED,
        sequence_length=job["seq_length"],
        blend=(prefixes, weights),
        split="100,0,0",
        tokenizer=_Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mmap_bin_files=False,
        **extra,
    )
    started = time.perf_counter()
    train = BlendedMegatronDatasetBuilder(cls, [job["train"], 0, 0], lambda: True, config)
    train = train.build()[0]
    build_s = time.perf_counter() - started
    start_requests = dict(requests.counts)
    out = {
        "system": system,
        "megatron": version,
        "build_s": build_s,
        "start_requests": start_requests,
        "files": _files(job["local_folders"][system]),
        "after_build": _memory(),
    }
    if not job["workers_list"]:
        return out
    rng = np.random.default_rng(SEED)
    count = job["samples"]
    if job["pattern"] == "random":
        indices = rng.integers(0, len(train), count).tolist()
    else:
        indices = list(range(count))
    workers = job["workers"]
    loader = torch.utils.data.DataLoader(
        train,
        batch_size=4,
        sampler=indices,
        num_workers=workers,
        persistent_workers=workers > 0,
        # spawned: with forked workers Megatron main's MSC reader (its client made in the
        # parent) returned samples of the wrong length here (1075 tokens for 1025)
        multiprocessing_context="spawn" if workers else None,
    )
    gc.freeze()  # alike for every system (see scripts/bench_loader.py)
    batches = iter(loader)
    first = next(batches)  # the workers' start (import, unpickling) is not timed
    digest = zlib.crc32(first["tokens"].numpy().tobytes())
    before = sum(requests.counts.values())
    started = time.perf_counter()
    for batch in batches:
        digest = zlib.crc32(batch["tokens"].numpy().tobytes(), digest)
    read_s = time.perf_counter() - started
    out.update(
        pattern=job["pattern"],
        workers=workers,
        read_s=read_s,
        samples_per_s=(count - len(first["tokens"])) / read_s,
        digest=f"{digest:08x}",
        main_requests_in_reads=sum(requests.counts.values()) - before,
        main_memory=_memory(),
    )
    if workers:
        out["worker_memory"] = [_memory(w.pid) for w in batches._workers]
    ahead = getattr(getattr(getattr(train, "datasets", [None])[0], "dataset", None), "repack", None)
    if ahead is not None and ahead.read_ahead is not None and not workers:
        out["read_ahead"] = vars(ahead.read_ahead.stats)
    return out


def _generate(data: Path, count: int) -> tuple[list[float], list[str]]:
    """``count`` uint16 prefixes of 40-80 sequences (one document each) of 5-600 tokens,
    source ``i`` a function of ``i`` only (as scripts/bench_loader.py makes them)."""
    import numpy as np

    from repack.synth import write_prefix

    weights, prefixes = [], []
    for i in range(count):
        rng = np.random.default_rng([SEED, i])
        lengths = rng.integers(5, 600, int(rng.integers(40, 81)))
        prefix = data / f"d{i // 100:03d}" / f"s{i:05d}"
        if not Path(f"{prefix}.bin").exists():
            ids = rng.integers(1, 65000, int(lengths.sum()), dtype=np.uint16)
            write_prefix(prefix, np.split(ids, np.cumsum(lengths)[:-1]), dtype=np.uint16)
        weights.append(round(float(rng.uniform(0.1, 2.0)), 4))
        prefixes.append(str(prefix))
    return weights, prefixes


def _upload(server, bucket: str, data: Path, prefixes: list[str]) -> dict:
    """The original ``.bin`` and ``.idx`` files of ``prefixes`` into ``bucket`` (as a user
    does for Megatron's object-storage path), 16 at a time."""
    client = server.client()
    files = [f"{p}{ext}" for p in prefixes for ext in (".bin", ".idx")]

    def put(path: str) -> None:
        client.upload_file(path, bucket, os.path.relpath(path, data))

    started = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files))
    return {"objects": len(files), "seconds": round(time.perf_counter() - started, 2)}


def _run_child(job: dict, env: dict) -> dict:
    import subprocess

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as stream:
        json.dump(job, stream)  # too long for a command line at 10,000 sources
    result = subprocess.run(
        [sys.executable, __file__, "--child", stream.name],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    os.unlink(stream.name)
    if result.returncode:
        # the error, without the warnings and Megatron's noise at exit (IndexedDataset.__del__)
        lines = [
            line
            for line in result.stderr.splitlines()
            if line.strip()
            and not any(
                noise in line.lower()
                for noise in ("warn", "__del__", "no attribute 'index'", "exception ignored")
            )
        ]
        found = next((line for line in reversed(lines) if "Error" in line), "")
        print(f"child failed ({job['system']}): {found}", file=sys.stderr)
        return {"system": job["system"], "error": found, "stderr_head": lines[:40]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _load() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def loader_main(args) -> dict:
    """The --loader benchmark (see the module docstring)."""
    from s3_support import msc_profile

    folder = Path(args.folder or tempfile.mkdtemp(prefix="bench-objstore-loader-"))
    folder.mkdir(parents=True, exist_ok=True)
    server = start_server(folder / "server")
    systems = list(SYSTEMS) + (["megatron-s3"] if args.megatron_s3 else [])
    try:
        with server_env(server):
            data = folder / "data"
            weights, prefixes = _generate(data, args.sources)
            blend = folder / "blend.json"
            blend.write_text(json.dumps([x for pair in zip(weights, prefixes) for x in pair]))
            originals = server.new_bucket()
            upload = _upload(server, originals, data, prefixes)
            os.environ["MSC_CONFIG"] = ""
            profile = msc_profile(server, folder, originals)
            bucket = server.new_bucket()
            url = f"s3://{bucket}/bench.repack"
            os.environ["REPACK_CACHE_DIR"] = str(folder / "repack-cache")
            started = time.perf_counter()
            with RequestCounter() as merged:
                merge(blend, url)
            merge_s = time.perf_counter() - started
            names = [os.path.relpath(p, data) for p in prefixes]
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
            env[MEGATRON_LM_ENV] = args.megatron_lm
            local = {
                "megatron-msc": [str(folder / "msc-idx"), str(folder / "msc-cache")],
                "megatron-s3": [str(folder / "s3-idx"), str(folder / "s3-cache")],
                "repack-s3": [str(folder / "repack-cache")],
            }
            job = {
                "megatron_lm": args.megatron_lm,
                "weights": weights,
                "prefixes": {
                    "megatron-msc": [f"{profile}/{n}" for n in names],
                    "megatron-s3": [f"s3://{originals}/{n}" for n in names],
                    "repack-s3": prefixes,
                },
                "repack": url,
                "seq_length": args.seq_length,
                "train": args.train_samples,
                "samples": args.samples,
                "local_folders": local,
                "workers_list": [],
            }
            starts: dict[str, dict] = {}
            for system in systems:
                idx_cache, cache = local[system][0], local[system][-1]
                sys_job = {**job, "system": system, "idx_cache": idx_cache, "cache": cache}
                cold = _run_child(sys_job, env)
                if "error" in cold:
                    starts[system] = {"cold": cold}
                    continue
                warm = _run_child(sys_job, env)
                starts[system] = {"cold": cold, "warm": warm}
                if "error" in warm:
                    continue
                print(
                    f"start {system}: cold {cold['build_s']:.1f} s, warm "
                    f"{warm['build_s']:.1f} s (load {_load()})",
                    file=sys.stderr,
                )
            reads: dict[str, list[dict]] = {}
            loads = []
            for r in range(0 if args.start_only else args.repeat):
                for pattern in args.patterns.split(","):
                    for workers in args.workers_list:
                        order = systems if r % 2 == 0 else systems[::-1]
                        for system in order:
                            idx_cache, cache = local[system][0], local[system][-1]
                            found = _run_child(
                                {
                                    **job,
                                    "system": system,
                                    "idx_cache": idx_cache,
                                    "cache": cache,
                                    "workers_list": args.workers_list,
                                    "workers": workers,
                                    "pattern": pattern,
                                },
                                env,
                            )
                            loads.append(_load())
                            reads.setdefault(f"{system} {pattern} {workers}", []).append(found)
                            print(
                                f"read {system} {pattern} w={workers}: "
                                f"{found['samples_per_s']:.0f}/s (load {loads[-1]})",
                                file=sys.stderr,
                            )
    finally:
        server.stop()
    return _summarize(args, systems, upload, merge_s, dict(merged.counts), starts, reads, loads)


def _summarize(args, systems, upload, merge_s, merge_requests, starts, reads, loads) -> dict:
    table = {}
    for key, runs in reads.items():
        digests = {r["digest"] for r in runs}
        entry = {
            "samples_per_s": round(statistics.median(r["samples_per_s"] for r in runs), 1),
            "all": [round(r["samples_per_s"], 1) for r in runs],
            "same_samples_every_run": len(digests) == 1,
            "main_rss_mib": round(
                statistics.median(r["main_memory"]["rss_kib"] for r in runs) / 1024, 1
            ),
        }
        workers = [m for r in runs for m in r.get("worker_memory", [])]
        if workers:
            entry["worker_pss_mib"] = round(
                statistics.median(m["pss_kib"] for m in workers) / 1024, 1
            )
            entry["worker_rss_mib"] = round(
                statistics.median(m["rss_kib"] for m in workers) / 1024, 1
            )
        if "read_ahead" in runs[-1]:
            entry["read_ahead"] = runs[-1]["read_ahead"]
        table[key] = entry
    ratios = {}
    for key, entry in table.items():
        system, pattern, workers = key.split()
        if system == "repack-s3":
            base = table.get(f"megatron-msc {pattern} {workers}")
            if base:
                ratios[f"{pattern} {workers} workers"] = round(
                    entry["samples_per_s"] / base["samples_per_s"], 2
                )
    digests: dict[str, set[str]] = {}
    for key, runs in reads.items():
        _, pattern, workers = key.split()
        digests.setdefault(f"{pattern} {workers}", set()).update(r["digest"] for r in runs)
    digests_agree = {key: len(found) == 1 for key, found in digests.items()}
    return {
        "sources": args.sources,
        "seq_length": args.seq_length,
        "samples_per_run": args.samples,
        "repeat": args.repeat,
        "megatron": next(
            (r["cold"]["megatron"] for r in starts.values() if "megatron" in r["cold"]), None
        ),
        "upload_originals": upload,
        "merge_repack_s": round(merge_s, 2),
        "merge_requests": merge_requests,
        "start": {
            system: {
                phase: run
                if "error" in run
                else {
                    "seconds": round(run["build_s"], 2),
                    "requests": run["start_requests"],
                    "local_files": run["files"],
                    "rss_mib": round(run["after_build"]["rss_kib"] / 1024, 1),
                }
                for phase, run in runs.items()
            }
            for system, runs in starts.items()
        },
        "reads": table,
        "repack_vs_megatron_msc": ratios,
        "same_samples_across_systems": digests_agree,
        "load_during_reads": loads,
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(loader_child(json.loads(Path(sys.argv[2]).read_text()))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sources", type=int, default=100)
    parser.add_argument("--tokens", default="400000,800000", help="tokens per source: MIN,MAX")
    parser.add_argument("--shard-size", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, default=None, help="verify's workers")
    parser.add_argument("--json", action="store_true")
    loader = parser.add_argument_group("--loader")
    loader.add_argument("--loader", action="store_true", help="measure training from S3")
    loader.add_argument("--megatron-lm", default="/work/venvs/mlm", help="a Megatron-LM checkout")
    loader.add_argument("--megatron-s3", action="store_true", help="also Megatron on s3://")
    loader.add_argument("--seq-length", type=int, default=1024)
    loader.add_argument("--train-samples", type=int, default=20000)
    loader.add_argument("--samples", type=int, default=400, help="samples read per run")
    loader.add_argument("--patterns", default="random,order")
    loader.add_argument(
        "--workers-list", type=lambda t: [int(x) for x in t.split(",")], default=[0, 2, 4]
    )
    loader.add_argument("--folder", help="work folder (default: a new temp folder)")
    loader.add_argument("--start-only", action="store_true", help="measure the starts only")
    args = parser.parse_args()
    if args.loader:
        out = loader_main(args)
        print(json.dumps(out, indent=1))
        return
    low, high = (int(x) for x in args.tokens.split(","))
    folder = Path(tempfile.mkdtemp(prefix="bench-objstore-"))
    server = start_server(folder / "server")
    try:
        with server_env(server):
            os.environ["REPACK_CACHE_DIR"] = str(folder / "cache")
            blend = make_blend(
                folder / "blend", args.sources, seed=1, tokens_per_source=(low, high)
            )
            bucket = server.new_bucket()
            url = f"s3://{bucket}/bench.repack"
            with RequestCounter() as upload:
                started = time.perf_counter()
                result = merge(blend.flat_json, url, shard_size=args.shard_size)
                merge_seconds = time.perf_counter() - started
            with RequestCounter() as cold:
                repack = Repack(url)
            with RequestCounter() as warm:
                Repack(url)
            manifest = repack.manifest
            store = open_store(url)
            keys = [(store.key(manifest.index_file), manifest.index_size)]
            keys += [(store.key(s.file), s.file_size) for s in manifest.shards]
            total = sum(size for _, size in keys)
            times: dict[str, list[float]] = {"verify": [], "plain": []}
            for i in range(args.repeat):
                for name in ("verify", "plain") if i % 2 == 0 else ("plain", "verify"):
                    started = time.perf_counter()
                    if name == "verify":
                        report = verify(url, workers=args.workers)
                        assert report.ok, report.problems
                    else:
                        assert plain_read(server, bucket, keys) == total
                    times[name].append(time.perf_counter() - started)
            medians = {name: statistics.median(values) for name, values in times.items()}
            out = {
                "sources": args.sources,
                "bytes": total,
                "shards": len(manifest.shards),
                "merge_seconds": round(merge_seconds, 3),
                "merge_requests": dict(upload.counts),
                "merge_mb_per_s": round(result.bytes / merge_seconds / 1e6, 1),
                "open_cold_requests": dict(cold.counts),
                "open_warm_requests": dict(warm.counts),
                "verify_seconds": round(medians["verify"], 3),
                "plain_seconds": round(medians["plain"], 3),
                "verify_mb_per_s": round(total / medians["verify"] / 1e6, 1),
                "plain_mb_per_s": round(total / medians["plain"] / 1e6, 1),
                "verify_vs_plain": round(medians["plain"] / medians["verify"], 2),
                "repeat": args.repeat,
                "all_seconds": {k: [round(v, 3) for v in vs] for k, vs in times.items()},
            }
    finally:
        server.stop()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for key, value in out.items():
        print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
