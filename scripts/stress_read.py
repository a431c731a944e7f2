#!/usr/bin/env python3
"""Read a repack hard, from many processes and threads at once, and prove every byte right.

Starts ``--processes`` reader processes (default 8) of ``--threads`` threads each (default 4).
Process ``k`` reads through the loader's ``mmap`` backend when ``k`` is even and its ``pread``
backend when ``k`` is odd (``--backend`` picks one for all). Each thread of each process opens
its own ``SourceDataset`` views (the process shares one open repack among them), reads every
sequence of every source once (``--no-sweep`` skips this), then reads random sequences,
slices and partial sequences until ``--seconds`` have passed. Every read is compared with the
original prefix, read with ``pread`` from the source's own ``.bin`` (tokens, dtype) and
``.idx`` (lengths, pointers, document indices, modes).

Reported per process: reads, bytes read, errors (exceptions), wrong reads (data differing
from the original), resident memory at the start of the random phase and at the end
(``VmRSS``, and its anonymous part ``RssAnon``), and the shard files it holds open or mapped.
With the ``mmap`` backend ``VmRSS`` grows as pages of the shards are touched (shared page
cache, not a leak), so growth is judged on ``RssAnon``: more than ``--rss-growth-mib``
(default 16 MiB) is flagged.

Exit status: 0 when every read was right, no error was raised and no process grew beyond the
bound; 1 otherwise; 2 for bad arguments.

Usage::

    python scripts/stress_read.py                          # builds a demo repack, 30 s
    python scripts/stress_read.py --repack OUT --seconds 600 --json

Without ``--repack`` it generates a synthetic blend (``repack.synth``, ``--sources`` sources)
and merges it into small shards, in ``--work`` or a temporary folder. With ``--repack`` the
originals named in its manifest must still exist. Needs numpy and repack only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field

import numpy as np

BACKENDS = ("mmap", "pread")
#: Messages kept per process, of errors and of wrong reads.
KEEP = 5


@dataclass
class Tally:
    reads: int = 0
    bytes: int = 0
    errors: int = 0
    wrong: int = 0
    messages: list[str] = field(default_factory=list)

    def note(self, kind: str, message: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.messages) < KEEP:
            self.messages.append(f"{kind}: {message}")

    def add(self, other: Tally) -> None:
        self.reads += other.reads
        self.bytes += other.bytes
        self.errors += other.errors
        self.wrong += other.wrong
        self.messages.extend(other.messages[: max(0, KEEP - len(self.messages))])


def memory() -> dict[str, int]:
    """Resident memory of this process in KiB: VmRSS, RssAnon, RssFile."""
    found = {}
    with open("/proc/self/status") as stream:
        for line in stream:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                found[key] = int(value.split()[0])
    return found


def held_files(folder: str) -> dict[str, int]:
    """Descriptors and mappings of this process on files of ``folder``."""
    real = os.path.realpath(folder) + os.sep
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(real):
                fds += 1
        except OSError:
            pass
    mapped = set()
    with open("/proc/self/maps") as stream:
        for line in stream:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().startswith(real):
                mapped.add(parts[5].strip())
    return {"fds": fds, "mapped_files": len(mapped)}


class Originals:
    """The original prefixes, read independently of the repack: their arrays and ``.bin``
    descriptors, loaded once per process and shared by its threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, tuple] = {}

    def get(self, source) -> tuple:
        found = self._sources.get(source.name)
        if found is None:
            with self._lock:
                found = self._sources.get(source.name)
                if found is None:
                    from repack.inputs.sources import read_source_index

                    index = read_source_index(source.path)
                    fd = os.open(source.path + ".bin", os.O_RDONLY | os.O_CLOEXEC)
                    found = (index, fd)
                    self._sources[source.name] = found
        return found


def expected_bytes(fd: int, start: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.pread(fd, size - len(data), start + len(data))
        if not chunk:
            break
        data += chunk
    return data


def check_arrays(view, index, tally: Tally) -> None:
    name = view.path_prefix
    checks = [
        ("sequence_lengths", view.sequence_lengths, index.lengths),
        ("sequence_pointers", view.sequence_pointers, index.pointers),
        ("document_indices", view.document_indices, index.documents),
    ]
    if index.modes is not None:
        checks.append(("sequence_modes", view.sequence_modes, index.modes))
    for what, got, want in checks:
        if not np.array_equal(got, want):
            tally.note("wrong", f"{name}: {what} differ from the original .idx")
    if view.dtype != index.info.dtype:
        tally.note("wrong", f"{name}: dtype {view.dtype}, the original {index.info.dtype}")


def read_and_check(view, index, fd: int, op: str, i: int, j: int, tally: Tally) -> None:
    """One read through the view, compared with the original."""
    itemsize = index.info.dtype.itemsize
    lengths, pointers, modes = index.lengths, index.pointers, index.modes
    multimodal = modes is not None
    name = view.path_prefix
    if op == "item":
        got = view[i]
        if multimodal:
            got, mode = got
            if mode != modes[i]:
                tally.note("wrong", f"{name}[{i}]: mode {mode}, the original {modes[i]}")
        pieces = [(got, int(pointers[i]), int(lengths[i]))]
        where = f"{name}[{i}]"
    elif op == "slice":
        got = view[i:j]
        if multimodal:
            got, got_modes = got
            if not np.array_equal(got_modes, modes[i:j]):
                tally.note("wrong", f"{name}[{i}:{j}]: modes differ from the original")
        if len(got) != j - i:
            tally.note("wrong", f"{name}[{i}:{j}]: {len(got)} sequences, expected {j - i}")
            return
        pieces = [(g, int(pointers[k]), int(lengths[k])) for g, k in zip(got, range(i, j))]
        where = f"{name}[{i}:{j}]"
    else:
        n = int(lengths[i])
        offset = random.randint(0, n)
        length = random.randint(0, n - offset)
        got = view.get(i, offset, length)
        if multimodal:
            got = got[0]
        pieces = [(got, int(pointers[i]) + offset * itemsize, length)]
        where = f"{name}.get({i}, {offset}, {length})"
    for array, start, count in pieces:
        tally.reads += 1
        if array.dtype != index.info.dtype or len(array) != count:
            tally.note("wrong", f"{where}: {len(array)} {array.dtype}, expected {count}")
            continue
        data = array.tobytes()
        tally.bytes += len(data)
        if data != expected_bytes(fd, start, count * itemsize):
            tally.note("wrong", f"{where}: tokens differ from the original .bin")


def thread_main(job: dict, sources, originals: Originals, deadline: float, tally: Tally) -> None:
    from repack.read.views import SourceDataset

    rng = random.Random(job["seed"])
    views: dict[str, object] = {}

    def view_of(source):
        view = views.get(source.name)
        if view is None:
            index, _ = originals.get(source)
            view = SourceDataset(
                job["repack"],
                source.name,
                multimodal=index.modes is not None,
                mmap=job["backend"] == "mmap",
            )
            check_arrays(view, index, tally)
            views[source.name] = view
        return view

    def one(source, op: str, i: int, j: int) -> None:
        try:
            index, fd = originals.get(source)
            read_and_check(view_of(source), index, fd, op, i, j, tally)
        except Exception as err:  # counted and reported, never fatal
            tally.note("errors", f"{source.name} {op} {i}: {type(err).__name__}: {err}")

    try:
        if job["sweep"]:
            order = list(sources)
            rng.shuffle(order)
            for source in order:
                for i in range(source.sequence_count):
                    one(source, "item", i, i + 1)
    finally:
        try:
            job["ready"].wait(timeout=max(60.0, deadline - time.monotonic()))
        except threading.BrokenBarrierError:
            pass  # memory is sampled when every thread has swept, or never
    nonempty = [s for s in sources if s.sequence_count]
    while time.monotonic() < deadline and nonempty:
        source = rng.choice(nonempty)
        n = source.sequence_count
        op = rng.choice(("item", "item", "slice", "get"))
        i = rng.randrange(n)
        j = min(n, i + rng.randint(1, 8))
        one(source, op, i, j)


def process_main(job: dict) -> dict:
    """One reader process: ``job["threads"]`` threads until ``job["deadline"]``."""
    from repack.format.manifest import load_manifest

    started = time.monotonic()
    sources = load_manifest(job["repack"]).sources
    originals = Originals()
    ready = threading.Barrier(job["threads"] + 1)
    tallies = [Tally() for _ in range(job["threads"])]
    threads = [
        threading.Thread(
            target=thread_main,
            args=(
                {**job, "seed": job["seed"] * 1000 + t, "ready": ready},
                sources,
                originals,
                job["deadline"],
                tallies[t],
            ),
            daemon=True,
        )
        for t in range(job["threads"])
    ]
    for thread in threads:
        thread.start()
    try:
        ready.wait(timeout=max(60.0, job["deadline"] - time.monotonic()))
    except threading.BrokenBarrierError:
        tallies[0].note("errors", "a thread did not finish its sweep in time")
    at_start = memory()
    for thread in threads:
        thread.join()
    at_end = memory()
    total = Tally()
    for tally in tallies:
        total.add(tally)
    return {
        "process": job["process"],
        "pid": os.getpid(),
        "backend": job["backend"],
        "threads": job["threads"],
        "seconds": round(time.monotonic() - started, 2),
        **asdict(total),
        "memory_kib_start": at_start,
        "memory_kib_end": at_end,
        "anon_growth_kib": at_end["RssAnon"] - at_start["RssAnon"],
        **held_files(job["repack"]),
    }


def build_demo(work: str, sources: int, seed: int) -> str:
    from repack.merge import merge
    from repack.synth import make_blend

    blend = make_blend(
        os.path.join(work, "src"), sources, seed=seed, tokens_per_source=(100, 20000)
    )
    out = os.path.join(work, "repack")
    merge(blend.flat_json, out, shard_size=256 * 1024, overwrite=True)
    return out


def run(args: argparse.Namespace) -> dict:
    repack = args.repack
    temporary = None
    if repack is None:
        if args.work is None:
            temporary = tempfile.TemporaryDirectory(prefix="stress-read-")
            args.work = temporary.name
        t0 = time.monotonic()
        repack = build_demo(args.work, args.sources, args.seed)
        print(f"built {repack} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    from repack.read.reader import Repack

    manifest = Repack(repack).manifest  # fails here, clearly, on a broken repack
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    deadline_in = args.seconds
    context = __import__("multiprocessing").get_context(args.start_method)
    results: list[dict] = []
    broken = []
    started = time.monotonic()
    with ProcessPoolExecutor(args.processes, mp_context=context) as pool:
        # the deadline counts from now, for every process, however long it takes to start
        deadline = time.monotonic() + deadline_in
        futures = [
            pool.submit(
                process_main,
                {
                    "process": k,
                    "repack": repack,
                    "backend": backends[k % len(backends)],
                    "threads": args.threads,
                    "deadline": deadline,
                    "seed": args.seed * 100 + k,
                    "sweep": args.sweep,
                },
            )
            for k in range(args.processes)
        ]
        for k, future in enumerate(futures):
            try:
                results.append(future.result())
            except BrokenProcessPool as err:
                broken.append(f"process {k}: died: {err}")
            except Exception as err:
                broken.append(f"process {k}: {type(err).__name__}: {err}")
    elapsed = time.monotonic() - started
    if temporary is not None:
        temporary.cleanup()
    limit = args.rss_growth_mib * 1024
    flagged = [r["process"] for r in results if r["anon_growth_kib"] > limit]
    totals = {
        "reads": sum(r["reads"] for r in results),
        "bytes": sum(r["bytes"] for r in results),
        "errors": sum(r["errors"] for r in results) + len(broken),
        "wrong": sum(r["wrong"] for r in results),
        "max_anon_growth_kib": max((r["anon_growth_kib"] for r in results), default=0),
        "rss_growth_flagged": flagged,
    }
    ok = not (totals["errors"] or totals["wrong"] or flagged) and len(results) == args.processes
    return {
        "ok": ok,
        "repack": repack,
        "sources": len(manifest.sources),
        "shards": len(manifest.shards),
        "processes": args.processes,
        "threads": args.threads,
        "seconds": round(elapsed, 2),
        "rss_growth_limit_kib": limit,
        "totals": totals,
        "failures": broken,
        "per_process": results,
    }


def print_report(report: dict) -> None:
    header = (
        f"{'proc':>4}  {'backend':7}  {'reads':>9}  {'MiB':>8}  {'errors':>6}  {'wrong':>5}  "
        f"{'RSS start':>9}  {'RSS end':>9}  {'anon +':>8}  {'fds':>3}  {'maps':>4}"
    )
    print(header)
    for r in report["per_process"]:
        print(
            f"{r['process']:>4}  {r['backend']:7}  {r['reads']:>9,}  {r['bytes'] / 2**20:>8.1f}  "
            f"{r['errors']:>6}  {r['wrong']:>5}  {r['memory_kib_start']['VmRSS'] / 1024:>7.1f}M  "
            f"{r['memory_kib_end']['VmRSS'] / 1024:>7.1f}M  {r['anon_growth_kib'] / 1024:>+7.1f}M  "
            f"{r['fds']:>3}  {r['mapped_files']:>4}"
        )
        for message in r["messages"]:
            print(f"      {message}")
    for failure in report["failures"]:
        print(f"      {failure}")
    t = report["totals"]
    rate = t["reads"] / report["seconds"] if report["seconds"] else 0
    verdict = "OK" if report["ok"] else "FAILED"
    limit = report["rss_growth_limit_kib"] / 1024
    flagged = t["rss_growth_flagged"]
    exceeded = f", exceeded by processes {flagged}" if flagged else ""
    print(
        f"{verdict}: {t['reads']:,} reads ({rate:,.0f}/s, {t['bytes'] / 2**20:,.1f} MiB) by "
        f"{report['processes']} processes x {report['threads']} threads in {report['seconds']} s "
        f"over {report['sources']} sources in {report['shards']} shards; {t['errors']} errors, "
        f"{t['wrong']} wrong reads; largest anonymous memory growth "
        f"{t['max_anon_growth_kib'] / 1024:.1f} MiB (limit {limit:g} MiB{exceeded})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repack", help="repack folder to read (its originals must exist)")
    parser.add_argument("--sources", type=int, default=60, help="sources of the demo blend")
    parser.add_argument("--work", help="folder for the demo blend and repack (default: temp)")
    parser.add_argument("--seconds", type=float, default=30.0, help="duration of random reads")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--backend", choices=(*BACKENDS, "both"), default="both")
    parser.add_argument(
        "--no-sweep", dest="sweep", action="store_false", help="skip reading every sequence first"
    )
    parser.add_argument("--rss-growth-mib", type=float, default=16.0)
    parser.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default="fork")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.processes < 1 or args.threads < 1 or args.seconds < 0 or args.sources < 1:
        parser.error("--processes, --threads and --sources must be >= 1, --seconds >= 0")
    from repack.errors import RepackError

    try:
        report = run(args)
    except RepackError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=1, sort_keys=True))
    else:
        print_report(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
