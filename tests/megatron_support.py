"""What the loader tests share with each other and with their child processes.

A tokenizer stand-in, synthetic sources sized so that every split of every source holds tokens
(Megatron's ``GPTDataset._get_num_epochs`` never returns for a split without tokens), the
``GPTDatasetConfig`` the tests vary, builds with stock ``GPTDataset`` or a repacked class,
sample comparison, and counts of the mmaps and file descriptors a process holds per folder.

Imports megatron-core and torch: only the loader tests use it.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

with warnings.catch_warnings():  # Megatron warns that Transformer Engine/Apex are missing
    warnings.simplefilter("ignore")
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from repack.synth import write_prefix

__all__ = [
    "CHILD",
    "BlendedMegatronDatasetBuilder",
    "Child",
    "GPTDataset",
    "GPTDatasetConfig",
    "Probe",
    "Samples",
    "Tok",
    "assert_same_samples",
    "build",
    "collect",
    "digest",
    "gpt_config",
    "init_process_group",
    "merged_blend",
    "open_files",
    "run_children",
    "shard_maps",
    "weights_for",
    "write_flat_blend",
    "write_sources",
]

#: One split's samples, each a dict of numpy arrays; ``None`` for a split that was not built.
Samples = list[dict[str, np.ndarray]] | None


class Tok:
    """The part of a Megatron tokenizer that ``GPTDataset`` uses. Picklable, so that spawned
    DataLoader workers can unpickle configs that hold it."""

    eod = 0

    def __init__(self, vocab_size: int = 65000) -> None:
        self.vocab_size = vocab_size
        # JSON-dumped into every dataset's description, hence into the cache file names
        self.unique_identifiers = {"class": "Tok", "vocab_size": vocab_size}


def megatron_samplers(required: bool = False):
    """Megatron-LM's sampler module (``megatron/training/datasets/data_samplers.py``, in the
    0.17+ wheels), else Megatron-Bridge's copies, else None; with ``required``, skip the test
    where neither imports, and fail it where ``REPACK_TEST_SAMPLERS`` is set (CI sets it where
    they must import)."""
    for name in ("megatron.training.datasets.data_samplers", "megatron.bridge.data.samplers"):
        try:
            return importlib.import_module(name)
        except Exception:  # absent, or its imports fail on this release
            continue
    if os.environ.get("REPACK_TEST_SAMPLERS"):
        pytest.fail("REPACK_TEST_SAMPLERS is set but no Megatron sampler code imports")
    if required:
        pytest.skip("Megatron-LM's samplers are not installed (megatron-core 0.17+ or Bridge)")
    return None


def init_process_group(folder: str | os.PathLike | None = None) -> None:
    """A one-process gloo group (its file store in ``folder``, default a new temporary one):
    ``BlendedDataset`` asks for the rank when it caches."""
    if not torch.distributed.is_initialized():
        if folder is None:
            folder = tempfile.mkdtemp(prefix="repack-gloo-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)  # not one per process left
        store = os.path.join(folder, f"gloo-store-{os.getpid()}")
        torch.distributed.init_process_group(
            "gloo", init_method="file://" + store, rank=0, world_size=1
        )


def write_sources(
    root: str | os.PathLike,
    count: int,
    *,
    seed: int = 0,
    sequences: tuple[int, int] = (40, 80),
    tokens: tuple[int, int] = (5, 200),
    int32_every: int = 4,
    folder: str = "data",
) -> list[str]:
    """Write ``count`` sources under ``root/folder`` and return their absolute prefixes.

    Every source has ``sequences`` (inclusive bounds) sequences of ``tokens`` tokens each, so
    that with a split like ``"90,5,5"`` each of its three splits holds at least one non-empty
    sequence. Every ``int32_every``-th source is int32 (ids above 65535), the others uint16;
    some sources group sequences into multi-sequence documents (``GPTDataset`` ignores them).
    """
    rng = np.random.default_rng(seed)
    prefixes = []
    for i in range(count):
        wide = int32_every > 0 and i % int32_every == int32_every - 1
        dtype = np.int32 if wide else np.uint16
        high = 200_000 if wide else 60_000
        n = int(rng.integers(sequences[0], sequences[1] + 1))
        seqs = [
            rng.integers(1, high, int(rng.integers(tokens[0], tokens[1] + 1))) for _ in range(n)
        ]
        documents = None
        if i % 3 == 2:  # documents of two sequences, and a last one of one or two
            documents = np.unique(np.append(np.arange(0, n, 2), n))
        prefix = str(Path(root, folder, f"part-{i % 5}", f"src-{i:04d}").absolute())
        write_prefix(prefix, seqs, dtype=dtype, document_indices=documents)
        prefixes.append(prefix)
    return prefixes


def merged_blend(
    root: Path, count: int, *, seed: int, **sources
) -> tuple[list[str], list[float], Path]:
    """``count`` sources (:func:`write_sources`'s ``sources`` options) under ``root``, weighted
    (:func:`weights_for`), merged as one flat blend into ``root/out``: their prefixes, weights
    and the repack."""
    from repack.merge import merge

    prefixes = write_sources(root, count, seed=seed, **sources)
    weights = weights_for(prefixes, seed=seed)
    out = root / "out"
    merge(write_flat_blend(root / "blend.json", prefixes, weights), out)
    return prefixes, weights, out


def weights_for(prefixes: Sequence[str], seed: int = 0) -> list[float]:
    """Uneven sampling weights, one per prefix."""
    rng = np.random.default_rng(seed)
    return [round(float(w), 3) for w in rng.uniform(0.1, 2.0, len(prefixes))]


def write_flat_blend(path: str | os.PathLike, prefixes: Sequence[str], weights=None) -> Path:
    """A ``--data-path`` style JSON blend ``[w1, p1, w2, p2, ...]``."""
    weights = [1.0] * len(prefixes) if weights is None else weights
    items: list[object] = []
    for weight, prefix in zip(weights, prefixes, strict=True):
        items += [weight, prefix]
    path = Path(path)
    path.write_text(json.dumps(items))
    return path


def gpt_config(
    prefixes: Sequence[str] | None = None,
    weights: Sequence[float] | None = None,
    *,
    blend_per_split: list | None = None,
    seed: int = 1234,
    sequence_length: int = 64,
    split: str | None = "90,5,5",
    cache: str | os.PathLike | None = None,
    mmap: bool = True,
    attention_mask: bool = True,
    threads: int = 1,
) -> GPTDatasetConfig:
    """The ``GPTDatasetConfig`` a training run would pass, with the knobs the tests turn."""
    if blend_per_split is not None:
        blend, split = None, None
    else:
        blend = (list(prefixes), None if weights is None else list(weights))
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=sequence_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        tokenizer=Tok(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=None if cache is None else os.fspath(cache),
        mmap_bin_files=mmap,
        create_attention_mask=attention_mask,
        num_dataset_builder_threads=threads,
    )


def build(cls: type, config: GPTDatasetConfig, sizes: Sequence[int | None]) -> list:
    """``BlendedMegatronDatasetBuilder(cls, sizes, ...).build()`` on this (the only) rank."""
    return BlendedMegatronDatasetBuilder(cls, list(sizes), lambda: True, config).build()


def _as_numpy(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.numpy().copy()
    return np.array(value)


def collect(datasets: Iterable) -> list[Samples]:
    """Every sample of every split, as plain numpy arrays (copies: they outlive the datasets,
    whose ``IndexedDataset`` unmaps its files when collected)."""
    return [
        None
        if dataset is None
        else [{k: _as_numpy(v) for k, v in dataset[i].items()} for i in range(len(dataset))]
        for dataset in datasets
    ]


def assert_same_samples(expected: Sequence[Samples], found: Sequence[Samples]) -> None:
    """The splits have the same samples: same count, keys, dtypes, shapes and values."""
    assert len(expected) == len(found)
    for split, (want, got) in enumerate(zip(expected, found)):
        if want is None or got is None:
            assert want is None and got is None, f"split {split}: built on one side only"
            continue
        assert len(got) == len(want), f"split {split}: {len(got)} samples, expected {len(want)}"
        for i, (a, b) in enumerate(zip(want, got)):
            assert a.keys() == b.keys(), f"split {split} sample {i}: keys {b.keys()}"
            for key in a:
                assert b[key].dtype == a[key].dtype, f"split {split} sample {i} {key}: dtype"
                assert np.array_equal(a[key], b[key]), f"split {split} sample {i} {key} differs"


def digest(samples: Sequence[Samples]) -> list[str | None]:
    """One order-sensitive digest per split over keys, dtypes, shapes and bytes of every
    sample: compares samples across processes."""
    out: list[str | None] = []
    for split in samples:
        if split is None:
            out.append(None)
            continue
        h = hashlib.sha256()
        for sample in split:
            for key in sorted(sample):
                value = np.ascontiguousarray(sample[key])
                h.update(f"{key}:{value.dtype.str}:{value.shape};".encode())
                h.update(value.tobytes())
        out.append(h.hexdigest())
    return out


def _under(path: str, folders: Mapping[str, str]) -> str | None:
    for name, folder in folders.items():
        if path == folder or path.startswith(folder.rstrip("/") + "/"):
            return name
    return None


def open_files(folders: Mapping[str, str | os.PathLike]) -> dict[str, dict[str, int]]:
    """Live mmaps (lines of ``/proc/self/maps``) and open descriptors (``/proc/self/fd``) of
    files under each named folder: ``{"maps": {name: n}, "fds": {name: n}}``."""
    roots = {name: os.path.realpath(folder) for name, folder in folders.items()}
    maps = dict.fromkeys(roots, 0)
    fds = dict.fromkeys(roots, 0)
    with open("/proc/self/maps") as stream:
        for line in stream:
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                name = _under(fields[5].strip().removesuffix(" (deleted)"), roots)
                if name is not None:
                    maps[name] += 1
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed meanwhile
            continue
        name = _under(target.removesuffix(" (deleted)"), roots)
        if name is not None:
            fds[name] += 1
    return {"maps": maps, "fds": fds}


def shard_maps(repack_dir: str | os.PathLike) -> int:
    """Live mmaps of the shard files of ``repack_dir`` in this process."""
    root = os.path.realpath(repack_dir)
    count = 0
    with open("/proc/self/maps") as stream:
        for line in stream:
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                path = fields[5].strip()
                if os.path.dirname(path) == root and os.path.basename(path).startswith("shard-"):
                    count += 1
    return count


@dataclass
class Child:
    """A finished ``loader_child.py`` run."""

    job: dict
    returncode: int
    stdout: str
    stderr: str

    @property
    def result(self) -> dict:
        """The child's report; fails the test with the child's stderr if there is none."""
        for line in self.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        raise AssertionError(
            f"child exited with {self.returncode} and no result; stderr ends:\n"
            + self.stderr[-3000:]
        )


CHILD = str(Path(__file__).with_name("loader_child.py"))


class _Forked:
    """A job running in a child of the ``loader_child.py --serve`` process (``Popen``'s
    ``poll``, ``kill``, ``wait`` and ``returncode``)."""

    def __init__(self, pid: int, base: Path) -> None:
        self.pid, self.base = pid, base
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)
                return None
            except ProcessLookupError:  # ended, and reaped by the server
                pass
            status = self.base.with_suffix(".status")
            self.returncode = int(status.read_text()) if status.exists() else -9
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode


def _servable(job: dict) -> bool:
    """Whether ``job`` may run in a child forked from a process that imported torch and
    megatron-core already: not when it needs an environment of its own (read at import), a
    file limit (set before anything runs) or a process group of several ranks."""
    return not (job.get("env") or job.get("nofile") or job.get("world_size"))


def run_children(
    jobs: Sequence[dict],
    folder: str | os.PathLike,
    *,
    env: Mapping[str, str] | None = None,
    parallel: int = 2,
    timeout: float = 300,
) -> list[Child]:
    """Run ``loader_child.py`` once per job, ``parallel`` at a time, each in a fresh process;
    ``env`` and the job's own ``"env"`` are added to this process's environment. A child still
    running after ``timeout`` seconds is killed (its result is then missing).

    Jobs that allow it (:func:`_servable`, and no ``env``) run in children forked from one
    ``loader_child.py --serve`` process, which imports torch and megatron-core once for all
    of them; the others each in a process of their own."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, **(env or {})}
    done: list[Child | None] = [None] * len(jobs)
    pending = list(enumerate(jobs))
    running: list[tuple[int, object, Path, float]] = []
    server = None
    try:
        while pending or running:
            while pending and len(running) < parallel:
                number, job = pending.pop(0)
                base = folder / f"job-{os.getpid()}-{time.monotonic_ns()}-{number}"
                base.with_suffix(".json").write_text(
                    json.dumps({"gloo_folder": str(folder), **job})
                )
                if env is None and _servable(job):
                    if server is None:
                        with open(folder / f"serve-{os.getpid()}.err", "w") as err:
                            server = subprocess.Popen(
                                [sys.executable, CHILD, "--serve"],
                                stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE,
                                stderr=err,
                                text=True,
                            )
                    server.stdin.write(f"{base.with_suffix('.json')}\n")
                    server.stdin.flush()
                    answer = server.stdout.readline()
                    if not answer:
                        raise AssertionError(
                            "loader_child.py --serve ended: "
                            + (folder / f"serve-{os.getpid()}.err").read_text()[-3000:]
                        )
                    process = _Forked(int(answer), base)
                else:
                    # output to files, not pipes: a child must never block on a full pipe
                    with open(base.with_suffix(".out"), "w") as out:
                        with open(base.with_suffix(".err"), "w") as err:
                            process = subprocess.Popen(
                                [sys.executable, CHILD, str(base.with_suffix(".json"))],
                                stdout=out,
                                stderr=err,
                                env={**environment, **job.get("env", {})},
                            )
                running.append((number, process, base, time.monotonic()))
            time.sleep(0.05)
            for entry in list(running):
                number, process, base, started = entry
                if process.poll() is None and time.monotonic() - started > timeout:
                    process.kill()
                    process.wait()
                if process.poll() is not None:
                    running.remove(entry)
                    out = base.with_suffix(".out").read_text()
                    err = base.with_suffix(".err").read_text()
                    done[number] = Child(jobs[number], process.returncode, out, err)
    finally:
        for _, process, _, _ in running:
            process.kill()
        if server is not None:
            server.stdin.close()
            server.wait()
            server.stdout.close()
    return [child for child in done if child is not None]


class Probe(torch.utils.data.Dataset):
    """A dataset's samples, each with the index, the process that read it, and that process's
    open files under ``folders`` (see :func:`open_files`): what DataLoader workers hold."""

    def __init__(self, dataset, folders: Mapping[str, str | os.PathLike]) -> None:
        self.dataset = dataset
        self.folders = {name: os.fspath(folder) for name, folder in folders.items()}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        sample = self.dataset[index]
        return {"index": index, "pid": os.getpid(), "open": open_files(self.folders), **sample}
