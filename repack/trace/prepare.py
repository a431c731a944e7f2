"""``repack prepare``: build a run's cached indices before the job, as its ranks would.

The job's ranks build, through Megatron-Core's ``BlendedMegatronDatasetBuilder`` with repack's
repacked class, every split's per-source indices (packed by :mod:`repack.cache.indexcache`) and
each split's blending index (``BlendedDataset``'s own ``.npy`` files). :func:`prepare` runs that
very build (:func:`repack.trace.draws.build_draws`, the build ``repack trace`` runs) with the
run's settings (:class:`repack.trace.settings.TraceSettings`, from Megatron-LM's flags or a
checkpoint), on any machine, into the repack's cache or ``--data-cache-path``; the job then
finds every file and writes none.

What names a cached file is the MD5 of Megatron's description of its dataset, so the build must
describe every dataset exactly as the job's will (:data:`CACHE_KEY_FIELDS`).

With ``workers`` > 1, ``workers`` processes each build a share of the per-source indices
(every ``workers``-th dataset, in the builder's order) and pack them; the process then builds
the whole run, finding them, and writes the blending indices last.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from repack.errors import InputError, UnsupportedMegatron
from repack.releases import installed_release
from repack.trace.settings import TraceSettings, release_of

__all__ = ["CACHE_KEY_FIELDS", "Prepared", "prepare"]

#: What enters the name of a cached index (the MD5 of the dataset's ``unique_description``),
#: in megatron-core 0.12.3 to 0.16.1 alike. ``GPTDataset`` (``MegatronDataset.__init__`` and
#: ``_key_config_attributes``): its class name, ``dataset_path`` (the prefix, as the config's
#: blend spells it), ``num_samples`` (from the split's size, the weights and
#: ``mid_level_dataset_surplus``), ``index_split``, and the config's ``random_seed``,
#: ``sequence_length``, ``split`` (the string as given), ``split_matrix`` and ``tokenizer`` (its
#: ``unique_identifiers``). ``BlendedDataset``: its class name, every dataset's identifiers
#: above, its ``split``, ``weights`` (normalized) and ``size``.
CACHE_KEY_FIELDS = (
    "class",
    "dataset_path",
    "num_samples",
    "index_split",
    "random_seed",
    "sequence_length",
    "split",
    "split_matrix",
    "tokenizer",
    "weights",
    "size",
)


@dataclass
class Prepared:
    """What :func:`prepare` did.

    Attributes:
        folder: The cache folder.
        files: The files it wrote (names in ``folder``), sorted.
        bytes: Their size.
        seconds: The time taken.
        present: Files of the folder there before and left as they were.
        datasets: Datasets of the run (per source and split, blends not counted).
        sizes: Samples asked of train, valid and test.
    """

    folder: str
    files: list[str]
    bytes: int
    seconds: float
    present: int
    datasets: int
    sizes: tuple[int, int, int]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "cache": self.folder,
            "files": self.files,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "already_there": self.present,
            "datasets": self.datasets,
            "split_samples": list(self.sizes),
            "notes": self.notes,
        }


def _listing(folder: str) -> dict[str, tuple[int, int]]:
    """``name -> (size, mtime_ns)`` of the files of ``folder`` (none if it is absent)."""
    found = {}
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return found
    for entry in entries:
        if entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            found[entry.name] = (st.st_size, st.st_mtime_ns)
    return found


def _import_megatron() -> None:
    """Import the loader, hence megatron-core and torch (their warnings that Transformer Engine
    and Apex are missing silenced)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import repack.megatron  # noqa: F401
        except ImportError as err:
            raise UnsupportedMegatron(
                "repack prepare builds the job's indices with Megatron-Core's own code, which is "
                f"not importable here ({err}): install the megatron-core the job uses "
                "(pip install megatron-core)"
            ) from None


def cache_folder(target: str, data_cache_path: str | None) -> str:
    """Where the job's build caches: ``--data-cache-path``, else the repack's own cache."""
    if data_cache_path:
        return os.path.abspath(data_cache_path)
    from repack.read.reader import Repack

    _import_megatron()
    from repack.megatron.mixin import default_cache

    repack = Repack(target)
    try:
        return default_cache(repack)
    finally:
        repack.close()


#: build_draws's stand-in tokenizer's identifiers: what no job's tokenizer gives.
_PLACEHOLDER = {"class": "repack-trace"}


def _blend_descriptions(folder: str):
    """``(file name, description)`` of every ``BlendedDataset`` description in ``folder``."""
    from repack.trace.draws import cached_descriptions

    for name, found in cached_descriptions(folder, "BlendedDataset"):
        if isinstance(found.get("datasets"), list):
            yield name, found


def recorded_tokenizer(folder: str, prefixes: set[str]) -> Any:
    """The tokenizer identifiers an earlier job recorded in ``folder`` for one of ``prefixes``
    (in a ``BlendedDataset`` description: a repack's index pack keeps names, not
    descriptions), whatever its seed, sizes or sequence length, or ``None``."""
    for _, description in _blend_descriptions(folder):
        for found in description["datasets"]:
            if (
                isinstance(found, dict)
                and found.get("dataset_path") in prefixes
                and found.get("tokenizer") not in (None, _PLACEHOLDER)
            ):
                return found["tokenizer"]
    return None


def prepared_for_other_settings(
    folders: list[str], prefixes: set[str], seed: int, seq_length: int, split: str | None
) -> str | None:
    """What to say when ``folders`` hold blending indices of this blend (prepared, or an
    earlier job's) and none for this seed, sequence length and split string: the job would
    find none of its files and build its own. ``None`` when one matches, or none is there.
    (Sizes and the tokenizer are not compared: a match here is no promise.)"""
    others: set[tuple] = set()
    for folder in folders:
        for _, description in _blend_descriptions(folder):
            ours = [
                d
                for d in description["datasets"]
                if isinstance(d, dict) and d.get("dataset_path") in prefixes
            ]
            if not ours:
                continue
            first = ours[0]
            found = (first.get("random_seed"), first.get("sequence_length"), first.get("split"))
            if found == (seed, seq_length, split):
                return None
            others.add(found)
    if not others:
        return None
    listed = "; ".join(
        f"seed {s}, seq-length {n}, split {p!r}"
        for s, n, p in sorted(others, key=lambda x: tuple(map(str, x)))
    )
    return (
        f"{', '.join(folders)} holds indices of this blend prepared for other settings "
        f"({listed}) and none for these (seed {seed}, seq-length {seq_length}, split "
        f"{split!r}): the job will build its own; run repack prepare with the job's settings"
    )


def _share(job: tuple) -> None:
    """One worker: its share of the per-source indices, packed (a child process)."""
    target, draw_settings, blend_file, share = job
    import logging

    from repack.cache.indexcache import IndexCache
    from repack.trace.draws import build_draws

    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    draws = build_draws(target, draw_settings, blend_file=blend_file, share=share)
    _flush(draws, IndexCache)


def _flush(draws: Any, cache_class: Any) -> None:
    """Pack what the build registered (the job's first sample would)."""
    folders = set()
    for split in draws.splits.values():
        for source in split.datasets if split is not None else ():
            folder = getattr(source.dataset, "_index_folder", None)  # (RepackedGPT's)
            if folder is not None:
                folders.add(folder)
    for folder in sorted(folders):
        cache_class.for_folder(folder).flush()


def prepare(
    target: str | os.PathLike[str] | None,
    values: dict[str, Any],
    *,
    typed: set[str] | frozenset[str] | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    release: str | None = None,
    blend_file: str | os.PathLike[str] | None = None,
    tokenizer: Any = None,
    fma: bool | None = None,
    workers: int = 1,
    progress: Callable[[str, int], Callable[[int], object]] | None = None,
    say: Callable[[str], object] | None = None,
) -> Prepared:
    """Build a run's cached indices as its ranks would, into its cache folder.

    Args:
        target: The repack the run reads; with ``checkpoint``, None is refused (a plain
            blend's cache is stock Megatron's, which ``prepare`` does not write).
        values: The run's arguments, by Megatron-LM's names (``seq_length``, ``seed``,
            ``split``, ``train_iters``, ``global_batch_size``, ``data_cache_path``...).
        typed, checkpoint, release, blend_file, fma: As :func:`repack.trace.run.trace`.
        tokenizer: The job's tokenizer's ``unique_identifiers`` (a dict, in its order).
        workers: Processes building the per-source indices.
        progress: ``progress(description, total)`` returns an ``update(n)`` callable.
        say: Called with notes.

    Raises:
        InputError: the target is not a repack, or the settings are not a run's.
        UnsupportedMegatron: megatron-core is not importable.
    """
    from repack.model import rounding
    from repack.store import names_folder
    from repack.trace.build import rounding_mismatch
    from repack.trace.draws import DrawSettings
    from repack.trace.run import _checkpoint_target, _read_checkpoint

    say = say or (lambda line: None)
    notes: list[str] = []
    run = None
    if checkpoint is not None:
        run, values = _read_checkpoint(checkpoint, values, typed, say)
    if target is None:
        raise InputError("give the repack the run reads")
    target = os.fspath(target)
    if not names_folder(target):
        raise InputError(
            f"{target}: not a repack; repack prepare builds a repack's cache (merge the blend "
            "first: repack merge BLEND OUT)"
        )
    values = dict(values)
    if not values.get("micro_batch_size"):  # the samplers' business, not the datasets'
        values["micro_batch_size"] = 1
        if values.get("global_batch_size") is None and values.get("train_samples") is None:
            raise InputError("give --global-batch-size (with --train-iters) or --train-samples")
    settings = TraceSettings.from_values(values, release_of(release or installed_release()))
    if run is not None:
        target, blend_file = _checkpoint_target(run, target, blend_file)
    fma = rounding.default_fma() if fma is None else bool(fma)
    other = rounding_mismatch(fma)
    if other is not None:
        raise InputError(
            f"{other.split(':')[0]}: the job's blending index would be built in another "
            "rounding than this machine's; prepare the cache on a machine of the job's kind"
        )
    v = settings.values
    folder = cache_folder(target, v["data_cache_path"])
    sources, prefixes = _sources(target, blend_file)
    if tokenizer is None:
        tokenizer = recorded_tokenizer(folder, prefixes)
        if tokenizer is not None:
            say(f"note: the tokenizer's identifiers of an earlier job in {folder}: {tokenizer}")
    if tokenizer is None:
        note = (
            "no --tokenizer-identifiers, and no job's recorded in the cache folder: the "
            "indices are named with repack's placeholder tokenizer, which a job's tokenizer "
            "does not match (the job will build its own); give the job's "
            "(json.dumps(tokenizer.unique_identifiers))"
        )
        notes.append(note)
        say(f"warning: {note}")
    draw_settings = DrawSettings(
        seq_length=int(v["seq_length"]),
        seed=int(v["seed"]),
        split=v["split"],
        sizes=settings.sizes,
        surplus=float(v["mid_level_dataset_surplus"]),
        data_cache_path=folder,
        fma=fma,
        tokenizer=tokenizer,
    )
    _import_megatron()  # once, before the clock and the workers (forked: they inherit it)
    before = _listing(folder)
    started = time.perf_counter()
    update = (progress or (lambda d, t: lambda n: None))("prepare", sources)
    import logging

    quiet = logging.getLogger("megatron.core")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        if workers > 1:
            _run_shares(target, draw_settings, blend_file, workers, update, sources)
        from repack.cache.indexcache import IndexCache
        from repack.trace.draws import build_draws

        draws = build_draws(target, draw_settings, blend_file=blend_file)
        _flush(draws, IndexCache)
        update(sources if workers == 1 else 0)
    finally:
        quiet.setLevel(level)
    seconds = time.perf_counter() - started
    after = _listing(folder)
    written = sorted(n for n, stat in after.items() if before.get(n) != stat)
    datasets = sum(len(s.datasets) for s in draws.splits.values() if s is not None)
    return Prepared(
        folder=folder,
        files=written,
        bytes=sum(after[n][0] for n in written),
        seconds=seconds,
        present=sum(1 for n, stat in before.items() if after.get(n) == stat),
        datasets=datasets,
        sizes=settings.sizes,
        notes=notes,
    )


def _sources(target: str, blend_file: Any) -> tuple[int, set[str]]:
    """How many prefixes the run's blend names, and their paths."""
    from repack.format.blend import Blend
    from repack.inputs.blend_files import load_blend
    from repack.read.reader import Repack

    if blend_file is None:
        repack = Repack(target)
        try:
            blend = repack.manifest.blend
        finally:
            repack.close()
    else:
        blend = blend_file if isinstance(blend_file, Blend) else load_blend(blend_file)
    paths = {e.path for entries in blend.splits.values() for e in entries or ()}
    return len(paths), paths


def _run_shares(
    target: str,
    draw_settings: Any,
    blend_file: Any,
    workers: int,
    update: Callable,
    sources: int,
) -> None:
    """``workers`` processes, each building its share of the per-source indices (the
    progress advances by a worker's share of the sources as it ends)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # fork, as DataLoader workers are, unless a process group is up: a forked child's build
    # would join its barriers
    torch = sys.modules.get("torch")
    grouped = torch is not None and torch.distributed.is_initialized()
    method = "spawn" if grouped or os.name != "posix" else "fork"
    jobs = [(target, draw_settings, blend_file, (k, workers)) for k in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
        for done in as_completed([pool.submit(_share, job) for job in jobs]):
            done.result()
            update(sources // workers)
