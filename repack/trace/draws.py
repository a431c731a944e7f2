"""A run's datasets, built as Megatron builds them, and what each of their samples holds.

``repack trace`` (and anything else that asks "which documents does sample ``i`` of the train
split hold?") needs the arrays Megatron-Core's own build makes: ``BlendedDataset``'s
``dataset_index`` and ``dataset_sample_index``, and each ``GPTDataset``'s ``document_index``,
``sample_index`` and ``shuffle_index``. They are not recomputed here: :func:`build_draws`
runs the real ``BlendedMegatronDatasetBuilder`` of the megatron-core installed, with stock
``GPTDataset`` for a blend file and :func:`repack.megatron.dataset_class` for a repack (the
same samples), so that the answer is the training run's by construction. What this module adds
is the reading of those arrays, vectorised with numpy over any number of samples:

* :meth:`SourceDraws.ranges`: samples of one source's dataset -> the documents (the ``.idx``
  sequences GPTDataset draws from) and token ranges each spans, as
  ``GPTDataset._query_document_sample_shuffle_indices`` reads them (the last range includes the
  extra token, the next sample's first, that Megatron reads as the last label);
* :meth:`SourceDraws.holding`: the reverse, every sample of the dataset holding tokens of one
  document;
* :meth:`SplitDraws.locate` and :meth:`SplitDraws.positions`: a split's global sample index
  (what the samplers hand out) to ``(dataset, sample)`` and back.

Indices are Megatron's cached ones when the cache holds them (``path_to_cache``: stock
``.npy`` files, or a repack's index pack), else built as Megatron builds them. Megatron hashes
its cache names with the tokenizer's identifiers; a stock cache folder's descriptions name that
tokenizer, and the build adopts it so that the names match (:func:`cached_tokenizer`).

Imports megatron-core and torch only when a build is asked for.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import gc
import glob
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from repack.errors import NotCompiled, RepackError, UndrawableSplit, UnsupportedMegatron

if TYPE_CHECKING:
    from repack.format.blend import Blend

__all__ = [
    "SPLITS",
    "DrawSettings",
    "Draws",
    "SourceDraws",
    "SplitDraws",
    "build_draws",
    "cached_tokenizer",
]

SPLITS = ("train", "valid", "test")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrawSettings:
    """What Megatron's datasets depend on (the ``GPTDatasetConfig`` fields that change samples).

    Attributes:
        seq_length: ``--seq-length``.
        seed: ``--seed``.
        split: ``--split`` (flat blends; ignored for per-split ones, as Megatron does).
        sizes: Samples asked of train, valid and test (``get_train_valid_test_num_samples``).
        surplus: ``--mid-level-dataset-surplus``.
        data_cache_path: ``--data-cache-path`` (``path_to_cache``), or ``None``.
        drop_last_partial_validation_sequence: GPTDatasetConfig's field (default True).
        add_extra_token_to_sequence: GPTDatasetConfig's field (default True).
        fma: The rounding of ``BlendedDataset``'s error in the run's Megatron build: ``True``
            once (aarch64 builds), ``False`` twice (x86-64 builds), ``None`` as the installed
            megatron-core's helper (:func:`repack.megatron.fast_blending`'s ``fma``). Another
            rounding than the helper's builds without a cache folder: a cached blending index
            holds one machine's order, and one written here would be read by this machine's
            runs.
        tokenizer: The job's tokenizer's ``unique_identifiers`` (they enter every cache name),
            or ``None``: those recorded in the cache folder for this run, else a placeholder.
        mmap_bin_files: ``--no-mmap-bin-files`` is False: the sources' ``.bin`` are read with
            file reads, not mapped (how stock's ``IndexedDataset`` and repack's views read;
            no sample changes).
    """

    seq_length: int
    seed: int = 1234
    split: str | None = "969, 30, 1"
    sizes: tuple[int, int, int] = (0, 0, 0)
    surplus: float = 0.005
    data_cache_path: str | None = None
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True
    fma: bool | None = None
    tokenizer: Any = None
    mmap_bin_files: bool = True


class _Tokenizer:
    """What ``GPTDataset`` asks of a tokenizer to build its indices: its identifiers (hashed into
    every cache name) and the end-of-document and pad ids (used only by ``__getitem__``)."""

    eod = 0
    pad = -1
    vocab_size = None  # token_dtype_code only matters with --per-dataset-sequences-path

    def __init__(self, identifiers: Any = None) -> None:
        self.unique_identifiers = identifiers or {"class": "repack-trace"}


def cached_descriptions(folder: str, kind: str) -> Iterator[tuple[str, dict]]:
    """``(file name, description)`` of every ``{kind}`` description Megatron cached in
    ``folder`` (``*-{kind}-*-description.txt``) that reads as a JSON object, by name."""
    pattern = os.path.join(glob.escape(folder), f"*-{kind}-*-description.txt")
    for path in sorted(glob.glob(pattern)):
        try:
            with open(path, encoding="utf-8") as f:
                description = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(description, dict):
            yield os.path.basename(path), description


def cached_tokenizer(folder: str | None, prefixes: list[str], settings: DrawSettings) -> Any:
    """The tokenizer identifiers recorded in a stock Megatron cache folder for one of
    ``prefixes`` built with this seed and sequence length, or ``None``.

    Megatron names a dataset's cache files by the MD5 of its description, which holds the
    tokenizer's ``unique_identifiers``; with the same identifiers, this process's build finds
    the training run's files instead of computing the arrays again. Descriptions are read until
    one matches (at most one per prefix).
    """
    if not folder or not os.path.isdir(folder):
        return None
    wanted = set(prefixes)
    for _, description in cached_descriptions(folder, "GPTDataset"):
        if (
            description.get("dataset_path") in wanted
            and description.get("random_seed") == settings.seed
            and description.get("sequence_length") == settings.seq_length
            and "tokenizer" in description
        ):
            return description["tokenizer"]
    return None


@dataclass
class SourceDraws:
    """One ``GPTDataset`` of a split (a source of the blend, in that split).

    Attributes:
        position: Its index among the split's datasets (``BlendedDataset.dataset_index``).
        source: The prefix as the blend names it.
        path: The prefix's absolute path.
        dataset: The Megatron dataset.
    """

    position: int
    source: str
    path: str
    dataset: Any = field(repr=False)

    @property
    def extra(self) -> int:
        return int(bool(getattr(self.dataset.config, "add_extra_token_to_sequence", True)))

    def __len__(self) -> int:
        return len(self.dataset)

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dataset = self.dataset
        if getattr(dataset, "shuffle_index", None) is None and hasattr(
            dataset, "_query_document_sample_shuffle_indices"
        ):  # a release that maps its indices lazily (defer_npy_index_mmap)
            dataset._query_document_sample_shuffle_indices(0)
        return dataset.document_index, dataset.sample_index, dataset.shuffle_index

    def ranges(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The documents and token ranges of dataset samples ``samples`` (``dataset[j]``).

        Returns:
            ``(owner, document, start, end)``, one entry per document a sample spans, in the
            sample's order: ``owner`` indexes ``samples``; tokens ``[start, end)`` of sequence
            ``document`` of the source's ``.idx``. As ``GPTDataset`` reads them: every document
            between the first and the last is listed, even one with no token in range.
        """
        document_index, sample_index, shuffle_index = self._arrays()
        samples = np.asarray(samples, dtype=np.int64)
        shuffled = np.asarray(shuffle_index[samples], dtype=np.int64)
        first = np.asarray(sample_index[shuffled], dtype=np.int64)
        last = np.asarray(sample_index[shuffled + 1], dtype=np.int64)
        counts = last[:, 0] - first[:, 0] + 1
        owner = np.repeat(np.arange(len(samples), dtype=np.int64), counts)
        starts_at = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(counts) else counts
        within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts_at, counts)
        positions = first[owner, 0] + within
        documents = np.asarray(document_index[positions], dtype=np.int64)
        lengths = np.asarray(self.dataset.dataset.sequence_lengths, dtype=np.int64)[documents]
        start = np.where(within == 0, first[owner, 1], 0)
        is_last = positions == last[owner, 0]
        end = np.where(is_last, last[owner, 1] + self.extra, lengths)
        return owner, documents, start, end

    def holding(self, document: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every sample of this dataset holding tokens of sequence ``document``, with the range.

        Returns:
            ``(sample, start, end)`` arrays, one entry per (sample, occurrence of the document
            in the document index) with ``end > start``, sorted by sample.
        """
        document_index, sample_index, shuffle_index = self._arrays()
        where = np.flatnonzero(np.asarray(document_index) == document)
        empty = np.zeros(0, dtype=np.int64)
        if not len(where):
            return empty, empty, empty
        firsts = np.asarray(sample_index[:, 0], dtype=np.int64)  # len(samples) + 1 entries
        # sample s spans document-index positions firsts[s] .. firsts[s + 1]
        lo = np.searchsorted(firsts[1:], where, side="left")  # first s with firsts[s+1] >= p
        hi = np.searchsorted(firsts[:-1], where, side="right") - 1  # last s with firsts[s] <= p
        counts = np.maximum(hi - lo + 1, 0)
        position = np.repeat(where, counts)
        base = np.repeat(lo, counts)
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
        shuffled = base + np.arange(int(counts.sum())) - np.repeat(offsets, counts)
        first = np.asarray(sample_index[shuffled], dtype=np.int64)
        last = np.asarray(sample_index[shuffled + 1], dtype=np.int64)
        length = int(self.dataset.dataset.sequence_lengths[document])
        start = np.where(position == first[:, 0], first[:, 1], 0)
        end = np.where(position == last[:, 0], last[:, 1] + self.extra, length)
        keep = end > start
        shuffled, start, end = shuffled[keep], start[keep], end[keep]
        # the dataset samples j with shuffle_index[j] == shuffled
        inverse = np.empty(len(shuffle_index), dtype=np.int64)
        inverse[np.asarray(shuffle_index, dtype=np.int64)] = np.arange(len(shuffle_index))
        sample = inverse[shuffled]
        order = np.argsort(sample, kind="stable")
        return sample[order], start[order], end[order]

    def tokens(self, document: int, start: int, end: int) -> np.ndarray:
        """Tokens ``[start, end)`` of sequence ``document``."""
        return np.asarray(self.dataset.dataset.get(int(document), offset=start, length=end - start))


@dataclass
class SplitDraws:
    """One split of the run: its top dataset (a ``BlendedDataset``, or a lone ``GPTDataset``
    when the blend is one prefix without a weight, as Megatron builds it) and its sources."""

    name: str
    top: Any = field(repr=False)
    datasets: list[SourceDraws]

    @property
    def size(self) -> int:
        """``len()`` of the split's dataset: what the samplers are given as ``total_samples``."""
        return len(self.top)

    @property
    def blended(self) -> bool:
        return hasattr(self.top, "dataset_index")

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Split sample indices -> ``(dataset position, sample of that dataset)``."""
        indices = np.asarray(indices, dtype=np.int64)
        if not self.blended:
            return np.zeros(len(indices), dtype=np.int64), indices
        dataset = np.asarray(self.top.dataset_index[indices], dtype=np.int64)
        sample = np.asarray(self.top.dataset_sample_index[indices], dtype=np.int64)
        return dataset, sample

    def positions(self, dataset: int, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Split indices where dataset ``dataset``'s samples ``samples`` are drawn.

        Returns:
            ``(index, which)``: the split indices, sorted, and for each the position in
            ``samples`` of the sample it draws.
        """
        samples = np.asarray(samples, dtype=np.int64)
        if not self.blended:
            keep = samples < self.size
            return samples[keep], np.flatnonzero(keep)
        # a BlendedDataset draws a dataset sample at most once; ``samples`` may repeat one (a
        # document read twice by one sample, across an epoch's end)
        unique, inverse = np.unique(samples, return_inverse=True)
        where = np.flatnonzero(np.asarray(self.top.dataset_index) == dataset)
        drawn = np.asarray(self.top.dataset_sample_index[where], dtype=np.int64)
        slot = np.searchsorted(unique, drawn)
        slot_ok = slot < len(unique)
        hit = np.zeros(len(drawn), dtype=bool)
        hit[slot_ok] = unique[slot[slot_ok]] == drawn[slot_ok]
        index_of = np.full(len(unique), -1, dtype=np.int64)
        index_of[slot[hit]] = where[hit]
        which = np.flatnonzero(index_of[inverse] >= 0)
        index = index_of[inverse[which]]
        order = np.argsort(index, kind="stable")
        return index[order], which[order]


@dataclass
class Draws:
    """The run's splits (``None`` for a split Megatron does not build)."""

    splits: dict[str, SplitDraws | None]
    target: str
    repack: bool

    def split(self, name: str) -> SplitDraws:
        found = self.splits.get(name)
        if found is None:
            raise RepackError(f"{self.target}: the run builds no {name} split")
        return found


def _megatron():
    try:
        with warnings.catch_warnings():  # Megatron warns that Transformer Engine/Apex are missing
            warnings.simplefilter("ignore")
            from megatron.core.datasets.blended_megatron_dataset_builder import (
                BlendedMegatronDatasetBuilder,
            )
            from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    except ImportError as err:
        raise UnsupportedMegatron(
            "repack trace builds the run's datasets with Megatron-Core's own code, which is not "
            f"importable here ({err}): install the megatron-core the run used "
            "(pip install megatron-core)"
        ) from None
    return BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig


_GUARDED: dict[type, type] = {}


def _guarded(gpt_class: type) -> type:
    """Stock ``GPTDataset`` (under its own name: cache hashes and files are stock's) that
    refuses a slice with no tokens that samples are asked of, where stock's
    ``_get_num_epochs`` loops forever: the run could not have trained with these settings."""
    found = _GUARDED.get(gpt_class)
    if found is not None:
        return found

    def _build_document_sample_shuffle_indices(self):
        extra = int(getattr(self.config, "add_extra_token_to_sequence", True))
        asked = (self.num_samples or 0) * self.config.sequence_length + extra
        if self.num_samples and asked > 0 and self._get_num_tokens_per_epoch() <= 0:
            raise UndrawableSplit(
                f"{self.dataset_path}: its {self.index_split.name} slice holds no tokens, yet "
                f"{self.num_samples:,} samples are asked of it: Megatron loops forever there "
                "(GPTDataset._get_num_epochs), so a run with these settings never trained; "
                "check --split and the blend (repack doctor names every such slice)"
            )
        return gpt_class._build_document_sample_shuffle_indices(self)

    found = type(
        gpt_class.__name__,
        (gpt_class,),
        {
            "__module__": __name__,
            "__qualname__": "GuardedGPTDataset",
            "_build_document_sample_shuffle_indices": _build_document_sample_shuffle_indices,
        },
    )
    _GUARDED[gpt_class] = found
    return found


def _init_distributed() -> None:
    """A one-process gloo group: ``BlendedDataset`` asks for the rank when it caches."""
    import torch

    if torch.distributed.is_initialized():
        return
    folder = tempfile.mkdtemp(prefix="repack-trace-")
    # the group's rendezvous file: needed for the life of the process, gone with it
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    torch.distributed.init_process_group(
        "gloo", init_method="file://" + os.path.join(folder, "store"), rank=0, world_size=1
    )


def _entries(blend, name: str):
    entries = blend.splits.get(name)
    return list(entries) if entries else None


def build_draws(
    target: str | os.PathLike[str] | Blend,
    settings: DrawSettings,
    *,
    blend_file: str | os.PathLike[str] | Blend | None = None,
    continuation: tuple[str, int] | None = None,
    share: tuple[int, int] | None = None,
) -> Draws:
    """Build the run's datasets with the installed megatron-core.

    Args:
        target: A blend file or a parsed blend (stock ``GPTDataset`` over its prefixes) or a
            repack folder (its recorded blend, or ``blend_file``'s, through the repacked class).
        settings: The run's settings.
        blend_file: With a repack: the blend the run trained with (a file, or parsed).
        continuation: With a repack: ``(phase schedule, phase)`` of repack's continuation
            (:mod:`repack.phases.continuation`), the class then
            ``dataset_class(repack, phases=..., phase=...)``.
        share: With a repack: ``(k, n)``, build and pack only the per-source indices of
            every ``n``-th dataset from the ``k``-th, in the builder's order, into the cache
            folder, and cache no blending index (``repack prepare --workers``); the other
            datasets and the splits' blends are built in memory, not to be read.

    Raises:
        UnsupportedMegatron: megatron-core is not importable.
        BlendError, UnknownSource: the blend cannot be read or names a prefix the repack lacks.
        NotCompiled: ``settings.fma`` is the fused rounding, which neither the installed
            helper nor this install's repack (no ``repack.model._blending``) computes.
    """
    from repack.format.blend import Blend
    from repack.inputs.blend_files import load_blend
    from repack.store import names_folder

    builder_class, gpt_class, config_class = _megatron()
    foreign = _foreign_rounding(settings.fma)
    given: Blend | None = target if isinstance(target, Blend) else None
    target = given.source if given is not None else os.fspath(target)  # type: ignore[arg-type]
    is_repack = given is None and names_folder(target)
    if is_repack:
        from repack.megatron import CACHE_SUBDIR, dataset_class
        from repack.read.reader import Repack

        repack = Repack(target)
        if blend_file is None:
            blend = repack.manifest.blend
        else:
            blend = blend_file if isinstance(blend_file, Blend) else load_blend(blend_file)
        folder = repack.local_folder
        repack.close()
        if continuation is None:
            cls = dataset_class(target)
        else:
            cls = dataset_class(target, phases=continuation[0], phase=continuation[1])
        cache = settings.data_cache_path or os.path.join(folder, CACHE_SUBDIR)
        if not settings.data_cache_path and not _writable(cache):
            cache = None
    else:
        if blend_file is not None:
            raise RepackError(f"{target}: not a repack folder; --blend goes with a repack")
        if continuation is not None:
            raise RepackError(f"{target}: not a repack folder; the continuation reads a repack")
        blend = given if given is not None else load_blend(target)
        cls = _guarded(gpt_class)
        cache = settings.data_cache_path
    if foreign:  # a cached blending index holds one machine's order: neither read nor write
        cache = None
    if share is not None:
        if not is_repack or cache is None:
            raise RepackError(f"{target}: a share of the build goes with a repack and its cache")
        cls = _shared(cls, share, cache)
    names: dict[str, str] = {}
    for entries in blend.splits.values():
        for entry in entries or ():
            names.setdefault(entry.path, entry.prefix)

    def as_megatron(entries):
        if entries is None:
            return None
        weights = [e.weight for e in entries]
        return [e.path for e in entries], (None if weights[0] is None else weights)

    identifiers = settings.tokenizer or cached_tokenizer(cache, list(names), settings)
    if share is not None:  # the datasets of the share pack into it; the blends stay in memory
        cache = None
    fields = {f.name for f in dataclasses.fields(config_class)}
    kwargs: dict[str, Any] = {
        "random_seed": settings.seed,
        "sequence_length": settings.seq_length,
        "tokenizer": _Tokenizer(identifiers),
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "path_to_cache": cache,
    }
    if blend.per_split:
        kwargs["blend_per_split"] = [as_megatron(_entries(blend, s)) for s in SPLITS]
    else:
        kwargs["blend"] = as_megatron(_entries(blend, "all"))
        kwargs["split"] = settings.split
    optional = {
        "mid_level_dataset_surplus": settings.surplus,
        "drop_last_partial_validation_sequence": settings.drop_last_partial_validation_sequence,
        "add_extra_token_to_sequence": settings.add_extra_token_to_sequence,
        "mmap_bin_files": settings.mmap_bin_files,
    }
    for key, value in optional.items():
        if key in fields:
            kwargs[key] = value
        elif key == "mid_level_dataset_surplus" and value != 0.005:
            raise UnsupportedMegatron(
                f"megatron-core here has no mid_level_dataset_surplus; --mid-level-dataset-"
                f"surplus {value} cannot be reproduced with it"
            )
    if cache:
        os.makedirs(cache, exist_ok=True)
        _init_distributed()
    config = config_class(**kwargs)
    sizes = [int(n) for n in settings.sizes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        failure, hook = None, sys.unraisablehook
        try:
            # the blending index of repack.model.blending, stock blends too: the same bytes
            # as Megatron's helper (held equal on every release), without its samples x
            # sources loop, the most of a first trace's time at thousands of sources; in the
            # rounding of the run's build (x86-64: twice, aarch64: once)
            from repack.megatron import fast_blending

            with fast_blending(fma=settings.fma):
                built = builder_class(cls, sizes, lambda: True, config).build()
        except Exception as err:  # 0.19 wraps the OSError in an Exception of its own
            cause = _out_of_files(err)
            if is_repack or cause is None:
                raise
            failure = cause.strerror
            # the half-built IndexedDatasets complain from __del__ as they go: not news
            sys.unraisablehook = lambda unraisable: None
        if failure is not None:
            try:
                gc.collect()
            finally:
                sys.unraisablehook = hook
            raise RepackError(
                f"{target}: stock Megatron cannot open this blend's {len(names):,} prefixes in "
                f"one process here ({failure}: it maps and opens files per prefix and split, "
                "past this machine's vm.max_map_count or ulimit -n); merge it (repack merge) "
                "and trace the repack, which gives the same samples"
            )
    splits: dict[str, SplitDraws | None] = {}
    for name, top in zip(SPLITS, built):
        if top is None:
            splits[name] = None
            continue
        members = list(top.datasets) if hasattr(top, "dataset_index") else [top]
        datasets = []
        for position, dataset in enumerate(members):
            path = _path_of(dataset)
            datasets.append(SourceDraws(position, names.get(path, path), path, dataset))
        splits[name] = SplitDraws(name, top, datasets)
    return Draws(splits, target, is_repack)


def _shared(cls: type, share: tuple[int, int], folder: str) -> type:
    """``cls`` (under its own name: the cache names are the job's) building the per-source
    indices of datasets ``k``, ``k + n``, ... of the build only, into ``folder`` (where the
    config's ``path_to_cache`` would put them); the others report a length no blend exhausts
    and build nothing."""
    k, n = share
    count = iter(range(1 << 62))

    def _cache_folder(self):
        return folder

    def _build_document_sample_shuffle_indices(self):
        if next(count) % n == k:
            return cls._build_document_sample_shuffle_indices(self)
        self._index_folder = self._index_name = None
        self._sample_count = 1 << 40
        return None, None, None

    return type(
        cls.__name__,
        (cls,),
        {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_cache_folder": _cache_folder,
            "_build_document_sample_shuffle_indices": _build_document_sample_shuffle_indices,
        },
    )


def _foreign_rounding(fma: bool | None) -> bool:
    """Whether ``fma`` asks another rounding than the installed helper's (whose is then not
    what a cache folder of this machine holds).

    Raises:
        NotCompiled: the fused rounding where nothing here computes it: ``fast_blending``
            hands the index to Megatron's own helper where repack's cannot give a rounding
            (no ``repack.model._blending``), and that helper rounds as it was built.
    """
    from repack.megatron.blendhook import helper_fma
    from repack.model import blending, rounding

    helper = helper_fma()
    if fma and helper is not True and not blending.computes(fma):
        raise NotCompiled(
            f"blending arithmetic {rounding.describe(True)} (--fma) needs "
            "repack.model._blending, which this install did not build, and this machine's "
            "megatron-core does not round once: reinstall repack where a C compiler and "
            "Python's headers are at hand"
        )
    return fma is not None and fma != helper


def _out_of_files(err: BaseException | None) -> OSError | None:
    """The OSError for want of descriptors or mappings behind ``err``, if any."""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, OSError) and err.errno in (errno.ENOMEM, errno.EMFILE, errno.ENFILE):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def _path_of(dataset: Any) -> str:
    return os.fspath(getattr(dataset, "dataset_path", None) or dataset.dataset.path_prefix)


def _writable(folder: str) -> bool:
    probe = folder
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return False
        probe = parent
    return os.access(probe, os.W_OK)
