"""Megatron-Core integration: any ``IndexedDataset``-based dataset class, reading a repack.

Swap the class given to ``BlendedMegatronDatasetBuilder`` and keep everything else — the
config, the blend, the weights, the seed::

    from repack.megatron import RepackedGPTDataset      # REPACK_DIR=/lustre/me/blend.repack
    BlendedMegatronDatasetBuilder(RepackedGPTDataset, sizes, is_built_on_rank, config).build()

    from repack.megatron import repacked                # any other class, e.g. BERT, T5, FIM
    BERT = repacked(BERTMaskedWordPieceDataset, "/lustre/me/blend.repack")

Samples are bit-identical to stock Megatron's, while the process holds a constant number of
mmaps and file descriptors:

* every blend prefix becomes a :class:`~repack.megatron.views.SourceDataset` over the shared shards;
* ``GPTDataset``'s per-dataset cached ``.npy`` indices (and those of its subclasses) are
  consolidated into one mapped pack per build (:mod:`repack.megatron.indexcache`); with
  ``path_to_cache`` unset they live in ``OUT/cache/``, as do the sample indices of the masked
  (BERT, T5) datasets;
* the ``BlendedDataset`` over them builds its index with :mod:`repack.model.blending` (the
  same bytes as Megatron's helper, without its samples x datasets loop); :func:`fast_blending`
  does the same for stock blends (:mod:`repack.megatron.blendhook`).

Works with megatron-core 0.12 to Megatron-LM's main branch (0.20 dev). What repack relies on is
checked when a class is made, by feature (a method and its parameters), not by version number:
a release that lacks it fails there with :class:`~repack.errors.UnsupportedMegatron`, naming
the version and what is missing. Megatron calls the class by its stock name (``__name__``), so
cache hashes and file names are stock Megatron's.

This module imports megatron-core, which the user brings (``pip install megatron-repack`` never
installs or changes torch or megatron-core); the rest of repack does not.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
import os
import sys
import threading
from typing import Any, ClassVar

import megatron.core
import numpy as np
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset

from repack.errors import PhaseError, RepackError, UndrawableSplit, UnsupportedMegatron
from repack.megatron import blendhook
from repack.megatron.blendhook import fast_blending
from repack.megatron.indexcache import IndexCache
from repack.megatron.masks import SHARED as SHARED_MASKS
from repack.megatron.masks import install as install_shared_masks
from repack.megatron.masks import shares as shares_masks
from repack.megatron.views import SourceDataset
from repack.model.blending import build_blending_indices, build_exhaustive_blending_indices
from repack.read.reader import Repack
from repack.store import normalize

try:  # absent from none of the supported releases, but not needed by GPT users
    from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset
except ImportError:  # pragma: no cover - a release without it fails only for masked classes
    MaskedWordPieceDataset = None

__all__ = [
    "ENV_VAR",
    "MEGATRON_VERSION",
    "NPY_ENV_VAR",
    "READY_MADE",
    "RepackedGPTDataset",
    "build_blending_indices",
    "build_exhaustive_blending_indices",
    "dataset_class",
    "fast_blending",
    "repacked",
]

#: Environment variable naming the repack folder when a class is not bound to one.
ENV_VAR = "REPACK_DIR"
#: Set (to anything but 0) to have Megatron also write its own cache files for every dataset
#: and split (``-description.txt`` and three ``.npy``), which stock ``GPTDataset`` can read.
NPY_ENV_VAR = "REPACK_NPY_CACHE"
#: The megatron-core release in use, as it reports itself.
MEGATRON_VERSION: str = str(getattr(megatron.core, "__version__", "unknown"))
#: Sub-folder of OUT for Megatron's cached indices when ``config.path_to_cache`` is unset
#: (stock Megatron would write ``<prefix>/cache/GPTDataset_indices`` next to every source).
CACHE_SUBDIR = os.path.join("cache", "GPTDataset_indices")


# --- what repack relies on, checked when a class is made ------------------------------------

#: Methods the repacked classes override or call, with the parameters Megatron passes them.
_NEEDS: dict[str, dict[str, tuple[str, ...]]] = {
    "any": {"build_low_level_dataset": ("dataset_path", "config")},
    "gpt": {
        "_build_document_sample_shuffle_indices": (),
        "_get_num_tokens_per_epoch": (),
    },
    "masked": {"_build_sample_index": ("sequence_length", "min_sentences_per_sample")},
}


def _family(cls: type) -> str:
    if issubclass(cls, GPTDataset):
        return "gpt"
    if MaskedWordPieceDataset is not None and issubclass(cls, MaskedWordPieceDataset):
        return "masked"
    return "any"


def _check_supported(cls: type) -> str:
    """The family of ``cls`` (``gpt``, ``masked`` or ``any``), after checking that it has every
    method repack relies on, with the parameters repack passes.

    Raises:
        UnsupportedMegatron: ``cls`` is not a Megatron dataset class, or lacks one of them.
    """
    if not (isinstance(cls, type) and issubclass(cls, MegatronDataset)):
        raise UnsupportedMegatron(
            f"repack.megatron: {cls!r} is not a Megatron-Core dataset class (a subclass of "
            "megatron.core.datasets.megatron_dataset.MegatronDataset)"
        )
    family = _family(cls)
    wanted = {**_NEEDS["any"], **(_NEEDS[family] if family != "any" else {})}
    for name, parameters in wanted.items():
        method = getattr(cls, name, None)
        problem = None
        if not callable(method):
            problem = f"has no method {name}()"
        else:
            try:
                found = [
                    p.name
                    for p in inspect.signature(method).parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                    and p.default is p.empty
                    and p.name != "self"
                ]
            except (TypeError, ValueError):  # a builtin without a signature: trust it
                found = list(parameters)
            if len(found) != len(parameters):
                problem = (
                    f"has {name}({', '.join(found)}), repack calls {name}({', '.join(parameters)})"
                )
        if problem:
            raise UnsupportedMegatron(
                f"repack.megatron: {cls.__module__}.{cls.__qualname__} of megatron-core "
                f"{MEGATRON_VERSION} {problem}; repack supports megatron-core 0.12 to 0.20 "
                "(please report this release at the repack issue tracker)"
            )
    return family


# --- the mixins -------------------------------------------------------------------------------


class _Repacked:
    """What every repacked class shares: the repack folder and the low-level datasets."""

    #: The bound repack folder; ``None`` reads ``REPACK_DIR``.
    repack_dir: ClassVar[str | None] = None
    #: Whether sources are read as ``IndexedDataset(multimodal=True)`` reads them.
    repack_multimodal: ClassVar[bool] = False
    #: The stock class this one reads a repack for.
    repack_base: ClassVar[type]
    #: The phase schedule and phase of the continuation (:mod:`repack.phases.continuation`);
    #: ``None`` reads ``REPACK_PHASES`` and ``REPACK_PHASE`` (unset: stock's order).
    repack_phases: ClassVar[str | None] = None
    repack_phase: ClassVar[int | None] = None

    @classmethod
    def repack_path(cls) -> str:
        """The repack folder this class reads."""
        path = cls.repack_dir or os.environ.get(ENV_VAR)
        if not path:
            raise RepackError(
                f"{cls.__qualname__}: no repack folder: set {ENV_VAR}=/path/to/repack or use "
                "repack.megatron.repacked(cls, '/path/to/repack')"
            )
        return path

    @classmethod
    def build_low_level_dataset(cls, dataset_path: str, config: Any) -> SourceDataset:
        """The blend prefix ``dataset_path`` as a view of its source in the repack."""
        return SourceDataset(
            cls.repack_path(),
            dataset_path,
            multimodal=cls.repack_multimodal,
            mmap=getattr(config, "mmap_bin_files", True),
        )

    def _split_origin(self) -> str:
        """Where this dataset's slice comes from: the split string, or a per-split blend."""
        split = getattr(self.config, "split", None)
        return f"split {split!r}" if split else "its per-split blend"

    def _undrawable(self, problem: str, stock: str) -> UndrawableSplit:
        """The error for a slice that samples are asked of but that cannot give any, where
        stock Megatron would ``stock`` instead."""
        return UndrawableSplit(
            f"{self.dataset.path_prefix}: {problem}, yet {self.num_samples} samples are asked "
            f"of it: stock Megatron would {stock}. Give the split more weight, or leave the "
            f"source out of the {self.index_split.name} blend"
        )

    def _default_cache(self, kind: str) -> str:
        """``OUT/cache/{kind}``: where stock Megatron's ``<prefix>/cache/{kind}`` goes (for a
        repack on object storage, in its node-local cache folder)."""
        return os.path.join(self.dataset.repack.local_folder, "cache", kind)

    def __getstate__(self) -> dict:
        return self.__dict__.copy()

    def __reduce__(self):
        cls = type(self)
        state = self.__getstate__()
        bound = (cls.repack_base, cls.repack_dir, cls.repack_multimodal)
        return (_rebuild, (*bound, state, cls.repack_phases, cls.repack_phase))


class _IndexArray:
    """One of ``GPTDataset``'s index arrays, attached from the shared pack on first use (by
    Megatron's own code or by a subclass reading ``self.shuffle_index`` directly)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_repack_" + name

    def __get__(self, dataset: Any, owner: type | None = None) -> Any:
        if dataset is None:
            return self
        # getattr/setattr, not dataset.__dict__: that would give every dataset a dict object
        # of its own for the garbage collector to walk (CPython keeps attributes inline)
        value = getattr(dataset, self.slot, None)
        if value is None and getattr(dataset, "_index_cache", None) is not None:
            dataset._attach_indices()
            value = getattr(dataset, self.slot)
        return value

    def __set__(self, dataset: Any, value: Any) -> None:
        setattr(dataset, self.slot, value)


class _RepackedGPT(_Repacked):
    """``GPTDataset`` and its subclasses: indices consolidated into one pack per build, and
    a clear error where stock Megatron would loop forever."""

    document_index = _IndexArray()
    sample_index = _IndexArray()
    shuffle_index = _IndexArray()

    def _cache_folder(self) -> str:
        return self.config.path_to_cache or self._default_cache("GPTDataset_indices")

    def _check_drawable(self) -> None:
        """Refuse a split slice with no tokens that samples are asked of: stock Megatron's
        ``_get_num_epochs`` adds epochs of zero tokens forever."""
        if self.num_samples is None:
            return
        requested = self.num_samples * self.config.sequence_length + int(
            getattr(self.config, "add_extra_token_to_sequence", True)
        )
        if requested <= 0 or self._get_num_tokens_per_epoch() > 0:
            return
        total = len(self.dataset.document_indices) - 1
        raise self._undrawable(
            f"the {self.index_split.name} slice holds no tokens ({len(self.indices)} of its "
            f"{len(self.dataset)} sequences, {total} documents, {self._split_origin()})",
            "loop forever in GPTDataset._get_num_epochs",
        )

    def _build_document_sample_shuffle_indices(self):
        """Find this dataset's indices in the consolidated cache, else have Megatron compute
        them and register them for packing. Nothing is mapped here: the arrays are attached on
        first access, from one shared pack.

        Three cases, none of which touches the file system per dataset unless told to:

        * in the catalog (a warm start): nothing to build;
        * Megatron's own ``.npy`` files are there (a stock cache, found in one listing of the
          folder): they are registered, and copied into the pack at the first sample;
        * else (a cold start): Megatron's own ``_build_document_sample_shuffle_indices`` runs
          with a config whose ``path_to_cache`` is ``""``. In every megatron-core from 0.12 to
          Megatron-LM main that branch computes the three arrays with Megatron's functions and
          saves nothing (``if not path_to_cache``: build on every rank; ``if path_to_cache``:
          save), so no file is created per dataset; the arrays go into the pack at the first
          sample. With ``REPACK_NPY_CACHE=1`` Megatron writes its files as stock does.
        """
        cache = IndexCache.for_folder(self._cache_folder())
        name = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        source = self.dataset.source.path  # recorded with the arrays, for `repack remove`
        continued = self._repack_continuation()
        if continued is not None:  # never a stock cache's name, nor a stock cache's arrays
            name += f"-phase{continued[1]}-{continued[0].digest()}"
        entry = cache.lookup(name)
        if entry is None:
            self._check_drawable()  # only a build can hang: a cache of such a slice cannot exist
            if continued is not None:
                entry = cache.add_arrays(name, self._continued_build(*continued), source)
            elif cache.has_stock(name):
                entry = cache.add_stock(name, source)
            elif os.environ.get(NPY_ENV_VAR, "") not in ("", "0"):
                self._megatron_build(cache.folder)  # writes (or finds) Megatron's 4 files
                entry = cache.add_stock(name, source)
            else:
                entry = cache.add_arrays(name, self._megatron_build(""), source)
        self._index_cache = (cache.folder, name)
        self._sample_count = entry.sample_count
        return None, None, None

    def _repack_continuation(self):
        """``(schedule, phase)`` when this dataset continues earlier phases: a training split,
        the continuation asked for, a phase after the first; else ``None`` (stock)."""
        cls = type(self)
        if self.index_split.name != "train":
            return None
        if cls.repack_phases is None and not (
            os.environ.get("REPACK_PHASES") or os.environ.get("REPACK_PHASE")
        ):
            return None  # off: nothing imported, nothing read
        from repack.phases.continuation import announce, selected

        found = selected(cls.repack_phases, cls.repack_phase)
        if found is not None:
            announce(*found, given=cls.repack_phases is not None)
        return found if found is not None and found[1] > 0 else None

    def _continued_build(self, schedule: Any, phase: int):
        """The continuation's three arrays (:func:`repack.model.gpt_indices.continued_indices`):
        this source's documents no earlier phase trained on first; stock's where no earlier
        phase trained on its slice. The sample index is Megatron's own ``build_sample_idx``
        over the continued document index (same epochs, same length as stock)."""
        from megatron.core.datasets import helpers

        from repack.model.arithmetic import built_samples
        from repack.model.gpt_indices import continued_indices
        from repack.model.splits import Settings
        from repack.phases.continuation import check_launch, earlier_counts

        config = self.config
        extra = int(bool(getattr(config, "add_extra_token_to_sequence", True)))
        settings = Settings(
            sequence_length=config.sequence_length,
            sizes=(0, 0, 0),
            split=getattr(config, "split", None),
            surplus=float(getattr(config, "mid_level_dataset_surplus", 0.005)),
            add_extra_token=bool(extra),
        )
        key = (-1, self.dataset.source.id)
        check_launch(
            schedule,
            phase,
            self.dataset.repack_dir,
            settings,
            config.random_seed,
            key,
            self.num_samples,
            self.dataset.path_prefix,
        )
        counts = earlier_counts(
            schedule, phase, self.dataset.repack_dir, settings, config.random_seed
        ).get(key)
        indices = np.asarray(self.indices)
        begin, end = (int(indices[0]), int(indices[-1]) + 1) if len(indices) else (0, 0)
        if counts is None or not counts[begin:end].any() or end - begin != len(indices):
            return self._megatron_build("")  # nothing trained before here: stock's order
        tokens = self._get_num_tokens_per_epoch()
        epochs = self._get_num_epochs(tokens)
        length = config.sequence_length
        lengths = np.ascontiguousarray(self.dataset.sequence_lengths, dtype=np.int32)
        built = built_samples(epochs, tokens, length, True, bool(extra))
        document_index, shuffle_index, _ = continued_indices(
            begin, end, epochs, built, lengths, counts, config.random_seed, length
        )
        sample_index = helpers.build_sample_idx(
            lengths, document_index, length, epochs, tokens, True, bool(extra)
        )
        if sample_index.shape[0] - 1 != built:  # the arithmetic is stock's: never, but say so
            raise RepackError(
                f"{self.dataset.path_prefix}: the continued sample index has "
                f"{sample_index.shape[0] - 1} samples, expected {built}"
            )
        return document_index, sample_index, shuffle_index

    def _megatron_build(self, path_to_cache: str):
        """Megatron's own index build (or cache load) with ``path_to_cache`` in place of the
        config's; ``""`` computes in memory and saves nothing."""
        stock_config = copy.copy(self.config)
        stock_config.path_to_cache = path_to_cache
        # the stock build must really build: skip the newer releases' shortcuts
        stock_config.fast_cache_load = False
        stock_config.defer_npy_index_mmap = False
        own_config, self.config = self.config, stock_config
        _IN_MEMORY.active = not path_to_cache
        try:
            return super()._build_document_sample_shuffle_indices()
        finally:
            self.config = own_config
            _IN_MEMORY.active = False

    def _attach_indices(self) -> None:
        folder, name = self._index_cache
        arrays = IndexCache.for_folder(folder).arrays(name, self.dataset.source.path)
        self.document_index, self.sample_index, self.shuffle_index = arrays

    #: Where this dataset's cached masks stand: 0 not cached, 1 cached by its first sample, 2
    #: settled (its loss mask shared where the release allows it, :mod:`repack.megatron.masks`).
    _repack_masks: ClassVar[int] = 0

    def __getitem__(self, idx):
        """Stock's sample, with the masks and position ids stock caches per dataset held once
        per process (:mod:`repack.megatron.masks`); on object storage, its byte ranges (and those
        of the samples expected next) are fetched first, merged and in parallel
        (:mod:`repack.read.readahead`)."""
        ahead = getattr(getattr(self.dataset, "repack", None), "read_ahead", None)
        if ahead is not None and idx is not None:
            self._repack_read_ahead(ahead, int(idx), sys._getframe(1))
        if (
            self._repack_masks == 2
            or not getattr(self, "masks_and_position_ids_are_cacheable", False)
            or not shares_masks(type(self))  # a __getitem__ of its own: stock's way
        ):
            return super().__getitem__(idx)
        if not getattr(self, "masks_and_position_ids_are_cached", False):
            with SHARED_MASKS.lending():  # the sample that computes (and caches) the masks
                sample = super().__getitem__(idx)
            if getattr(self, "masks_and_position_ids_are_cached", False):
                self._repack_masks = 2 if SHARED_MASKS.settle_first(self) else 1
            return sample
        sample = super().__getitem__(idx)
        if SHARED_MASKS.settle(self, idx, sample):
            self._repack_masks = 2
        return sample

    def _repack_read_ahead(self, ahead: Any, idx: int, caller: Any) -> None:
        """Fetch sample ``idx``'s ranges, and those of the samples expected next: of the
        blend that asks for this sample (``caller``: the frame of ``BlendedDataset.__getitem__``,
        whose next indices map to this or another dataset of the blend), else of this
        dataset."""
        if not ahead.ahead:
            ahead.fetch(self._repack_ranges(idx))
            return
        blend = caller.f_locals.get("self") if caller is not None else None
        outer_idx = caller.f_locals.get("idx") if caller is not None else None
        try:
            in_blend = (
                isinstance(blend, BlendedDataset)
                and isinstance(outer_idx, (int, np.integer))
                and blend.datasets[int(blend.dataset_index[outer_idx])] is self
                and int(blend.dataset_sample_index[outer_idx]) == idx
            )
        except (TypeError, IndexError, AttributeError):
            in_blend = False
        if not in_blend:
            blend, outer_idx = self, idx
        order = ahead.order(blend)
        if not order.see(int(outer_idx)):  # not fetched ahead: fetch it now
            ahead.fetch(self._repack_ranges(idx))
        for following in order.fresh(ahead.ahead, len(blend)):
            if blend is self:
                dataset, sample = self, following
            else:
                dataset = blend.datasets[int(blend.dataset_index[following])]
                sample = int(blend.dataset_sample_index[following])
            reader = getattr(dataset, "_repack_ranges", None)
            if reader is None or getattr(dataset.dataset, "repack", None) is None:
                continue
            target = dataset.dataset.repack.read_ahead
            if target is not None:
                target.fetch(reader(sample), ahead=True)

    def _repack_ranges(self, idx: int) -> list[tuple[int, int, int]]:
        """The byte ranges ``(shard, offset, size)`` of sample ``idx``'s pieces (raw shards on
        object storage only), as stock's ``_query_document_sample_shuffle_indices`` reads
        them (the last piece holds the extra token, even where that is the first token of the
        next sequence, as stock reads it)."""
        try:
            sample = int(self.shuffle_index[idx])
            first, first_offset = (int(x) for x in self.sample_index[sample])
            last, last_offset = (int(x) for x in self.sample_index[sample + 1])
            extra = int(bool(getattr(self.config, "add_extra_token_to_sequence", True)))
            lengths = self.dataset.sequence_lengths
            documents = [int(d) for d in self.document_index[first : last + 1]]
        except (IndexError, ValueError, TypeError):
            return []  # not a sample (stock says why when it is read): nothing to fetch
        repack = self.dataset.repack
        ranges = []
        for i, document in enumerate(documents, first):
            start = first_offset if i == first else 0
            end = last_offset + extra if i == last else int(lengths[document])
            if end <= start:
                continue
            try:
                found = self.dataset.byte_range(document, start, end - start)
            except RepackError:
                continue  # out of the source: the read itself says so
            if repack.remote_raw(found[0]):
                ranges.append(found)
        return ranges

    def __len__(self) -> int:
        if getattr(self.config, "defer_npy_index_mmap", False):
            return super().__len__()  # stock's own arithmetic, as stock would answer
        return self._sample_count

    def __getstate__(self) -> dict:
        # Indices re-attach to the process's shared pack after unpickling (spawned workers):
        # pack what this process has pending so that the worker finds it in the catalog.
        folder, name = self._index_cache
        cache = IndexCache.for_folder(folder)
        cache.flush()
        state = self.__dict__.copy()
        for array in ("document_index", "sample_index", "shuffle_index"):
            state.pop("_repack_" + array, None)
        if not cache.is_packed(name):  # the cache folder cannot be written: send the arrays
            arrays = cache.arrays(name)
            for array, value in zip(("document_index", "sample_index", "shuffle_index"), arrays):
                state["_repack_" + array] = value
        return state


class _InMemoryBuild(threading.local):
    active = False


_IN_MEMORY = _InMemoryBuild()


def _drop_unable_to_save(record: logging.LogRecord) -> bool:
    # Megatron warns, once per dataset, that it cannot save indices "because path_to_cache is
    # None" when it computes them in memory, which is what repack asks of it on a cold build
    return not (_IN_MEMORY.active and str(record.msg).startswith("Unable to save"))


logging.getLogger(GPTDataset.__module__).addFilter(_drop_unable_to_save)
install_shared_masks()  # GPTDataset's cached masks, once per process (repack.megatron.masks)
# BlendedDataset's index: repack's for a repack's blends, stock's helper for stock ones unless
# fast_blending() is called (repack.megatron.blendhook)
blendhook.register_repacked(_Repacked)
blendhook.install()


#: Megatron's ``helpers.build_mapping`` skips a document holding a sentence longer than this
#: (``LONG_SENTENCE_LEN`` in helpers.cpp, the same from 0.12 to main).
_LONG_SENTENCE_LEN = 512


class _RepackedMasked(_Repacked):
    """The masked WordPiece datasets (BERT, T5): their sample index cached in
    ``path_to_cache``, else in ``OUT/cache/`` instead of next to every prefix; and a slice that
    cannot give a sample built at once, where stock Megatron spends ``2**31 - 2`` epochs on it.
    The vocabulary list every such dataset keeps (``token_lookup``) is one list per process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if hasattr(self, "token_lookup"):
            self.token_lookup = SHARED_MASKS.token_lookup(self.token_lookup)

    def _build_sample_index(self, sequence_length: int, min_sentences_per_sample: int):
        cache = self.config.path_to_cache or self._default_cache(f"{type(self).__name__}_indices")
        name = f"{self.unique_description_hash}-{type(self).__name__}"
        files = (f"{name}-description.txt", f"{name}-sample_index.npy")
        self._repack_min_sentences = min_sentences_per_sample
        cache_hit = all(os.path.isfile(os.path.join(cache, f)) for f in files)  # Megatron's test
        if not cache_hit and self.num_samples and not self._drawable(min_sentences_per_sample):
            return self._build_empty_sample_index(cache, name, sequence_length)
        if self.config.path_to_cache:
            return super()._build_sample_index(sequence_length, min_sentences_per_sample)
        own_config, self.config = self.config, copy.copy(self.config)
        self.config.path_to_cache = cache
        try:
            return super()._build_sample_index(sequence_length, min_sentences_per_sample)
        finally:
            self.config = own_config

    def _drawable(self, min_sentences: int) -> bool:
        """Whether a document of this split slice can give a sample.

        ``helpers.build_mapping`` draws from a document that has at least ``min_sentences``
        sentences (and at least one) and, if it has more than one, none longer than 512 tokens;
        each such document gives at least one sample per epoch. Without one, and samples asked,
        stock runs ``2**31 - 2`` epochs of the slice (some 10 s per document) and finds none.
        """
        if not len(self.indices):
            return True  # stock's own build fails on an empty slice (self.indices[-1]): let it
        documents = self.dataset.document_indices
        lengths = self.dataset.sequence_lengths
        bounds = documents[np.append(self.indices, self.indices[-1] + 1)]  # as Megatron
        starts, ends = bounds[:-1], bounds[1:]
        long_before = np.concatenate([[0], np.cumsum(lengths > _LONG_SENTENCE_LEN)])
        counts = ends - starts
        has_long = long_before[ends] - long_before[starts] > 0
        return bool(np.any((counts >= max(min_sentences, 1)) & ~((counts > 1) & has_long)))

    def _build_empty_sample_index(self, cache: str, name: str, sequence_length: int):
        """What stock's ``_build_sample_index`` makes of a slice without a drawable document,
        without its ``2**31 - 2`` empty epochs: ``helpers.build_mapping`` over one epoch finds
        the same no sample (same dtype and shape), saved where and as stock saves it."""
        from megatron.core.datasets import helpers

        description = os.path.join(cache, f"{name}-description.txt")
        path = os.path.join(cache, f"{name}-sample_index.npy")
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return np.load(path, allow_pickle=False, mmap_mode="r")  # rank 0 built it, as stock
        if hasattr(self, "built_anew_on_cache_miss"):  # 0.12 verifies the blends built anew
            self.built_anew_on_cache_miss = True
        os.makedirs(cache, exist_ok=True)
        with open(description, "w") as writer:
            writer.write(self.unique_description)
        sample_index = helpers.build_mapping(
            self.dataset.document_indices[np.append(self.indices, self.indices[-1] + 1)],
            self.dataset.sequence_lengths,
            1,
            self.num_samples,
            sequence_length,
            self.config.short_sequence_probability,
            self.config.random_seed,
            False,
            self._repack_min_sentences,
        )
        np.save(path, sample_index, allow_pickle=True)
        return sample_index

    def __len__(self) -> int:
        length = super().__len__()
        if length == 0 and self.num_samples:
            # Megatron's over-draw check asks the length of each dataset a blend draws from, and
            # stops with IndexError when the draws exceed it: there, and only there, stock fails.
            # It runs in BlendedDataset._build_indices (0.13 and later; the draws in `_size`)
            # or in BlendedMegatronDatasetBuilder.build (0.12: the blend in `dataset`, `size`)
            local = sys._getframe(1).f_locals
            blend = local.get("self")
            if not isinstance(blend, BlendedDataset):
                blend = local.get("dataset")
            if isinstance(blend, BlendedDataset) and any(d is self for d in blend.datasets):
                raise self._undrawable_masked(local.get("_size", local.get("size")))
        return length

    def _undrawable_masked(self, drawn: Any) -> UndrawableSplit:
        need = max(self._repack_min_sentences, 1)
        draws = "it" if drawn is None else f"{int(drawn):,} samples of it"
        return self._undrawable(
            f"none of the {len(self.indices)} documents of the {self.index_split.name} slice "
            f"({self._split_origin()}) has {need} or more sentences with none longer than "
            f"{_LONG_SENTENCE_LEN} tokens, which {type(self).__name__} needs to draw a sample",
            "run helpers.build_mapping for 2**31 - 2 epochs of the slice to find no sample, "
            f"then stop with IndexError in its over-draw check (the blend draws {draws})",
        )


_MIXINS = {"gpt": _RepackedGPT, "masked": _RepackedMasked, "any": _Repacked}


# --- making classes ---------------------------------------------------------------------------


def _make(
    base: type,
    parent: type | None,
    repack_dir: str | None,
    multimodal: bool,
    phases: str | None = None,
    phase: int | None = None,
) -> type:
    """A new class reading a repack for ``base``: a subclass of ``parent`` (the unbound class
    of ``base``) when there is one, else of ``base`` and the mixin of its family."""
    bases = (parent,) if parent is not None else (_MIXINS[_check_supported(base)], base)
    where = repack_dir or f"the repack in ${ENV_VAR}"
    namespace = {
        "repack_dir": repack_dir,
        "repack_multimodal": multimodal,
        "repack_phases": phases,
        "repack_phase": phase,
        "repack_base": base,
        "__module__": __name__,
        "__qualname__": f"Repacked{base.__name__}",
        "__doc__": f"{base.__qualname__} reading its sources from {where}.",
    }
    # Megatron names cache files, and hashes dataset descriptions, with type(self).__name__:
    # the stock name keeps every hash and file name identical to stock Megatron's: a stock
    # cache is a hit here (and, with REPACK_NPY_CACHE=1, the reverse).
    return type(base.__name__, bases, namespace)


RepackedGPTDataset = _make(GPTDataset, None, None, False)
RepackedGPTDataset.__doc__ = """Megatron-Core's ``GPTDataset``, reading its sources from a repack.

Use it as the ``cls`` of ``BlendedMegatronDatasetBuilder`` with an unchanged
``GPTDatasetConfig``. The repack is the folder in the ``REPACK_DIR`` environment variable
(or bind one with :func:`dataset_class`). ``config.mmap_bin_files`` picks the shard backend
(mmap, or pread without data mmaps).
"""

_BOUND_LOCK = threading.RLock()
_BOUND: dict[tuple, type] = {(GPTDataset, None, False, None, None): RepackedGPTDataset}


def repacked(
    cls: type,
    repack_dir: str | os.PathLike | None = None,
    *,
    multimodal: bool = False,
    phases: str | os.PathLike | None = None,
    phase: int | None = None,
) -> type:
    """``cls``, a Megatron dataset class over ``IndexedDataset`` prefixes, reading a repack.

    Works for ``GPTDataset`` and its subclasses (``GPTFIMDataset``, ``MockGPTDataset``-free
    user subclasses...), the masked WordPiece datasets (``BERTMaskedWordPieceDataset``,
    ``T5MaskedWordPieceDataset``) and any other ``MegatronDataset`` whose
    ``build_low_level_dataset`` makes an ``IndexedDataset``. The returned class answers to
    ``cls.__name__``, so that Megatron's cache hashes and file names are stock's, and is made
    once per ``(cls, repack_dir, multimodal)``.

    Args:
        cls: The stock dataset class (or a class made by this function: its stock class is
            used).
        repack_dir: The repack folder. It is opened, and its structure checked, right away, so
            that a wrong path fails here rather than deep inside the builder. ``None`` reads the
            folder from ``REPACK_DIR`` when datasets are built.
        multimodal: Read sources as ``IndexedDataset(path, multimodal=True)`` does: items are
            ``(tokens, mode)`` pairs.
        phases, phase: The continuation across blend phases (``GPTDataset`` and its
            subclasses; docs/megatron.md, "Blend phases"): the phase schedule file and the
            phase this launch trains. Then the training split of phase ``phase > 0`` draws,
            from every source, the documents no earlier phase trained on before any other.
            ``None`` reads ``REPACK_PHASES`` and ``REPACK_PHASE``; both unset: stock's order.

    Raises:
        UnsupportedMegatron: ``cls`` lacks something repack relies on in this megatron-core.
        RepackError: ``repack_dir`` is not a readable repack.
        PhaseError: ``phases`` is not a readable phase schedule, or ``phase`` not one of it.
    """
    base = getattr(cls, "repack_base", cls)
    # s3://, msc:// as given (an unknown scheme is refused when opened), a path absolute
    path = None if repack_dir is None else normalize(repack_dir)
    schedule = None if phases is None else os.path.abspath(os.fspath(phases))
    number = None if phase is None else int(phase)
    if schedule is not None or number is not None:
        from repack.phases.continuation import selected

        if schedule is None or number is None:
            raise PhaseError("repack.megatron.repacked: give both phases= and phase=, or neither")
        if not issubclass(base, GPTDataset):
            raise PhaseError(
                f"repack.megatron.repacked: the continuation across phases is for GPTDataset and "
                f"its subclasses, not {base.__qualname__}"
            )
        selected(schedule, number)  # checked now, as the folder is
    key = (base, path, bool(multimodal), schedule, number)
    with _BOUND_LOCK:
        made = _BOUND.get(key)
        if made is None:
            parent = None
            if path is not None or schedule is not None:
                if path is not None:
                    Repack(path).close()  # checked now; datasets open it with their backend
                parent = repacked(base, None, multimodal=multimodal)
            made = _BOUND[key] = _make(base, parent, path, bool(multimodal), schedule, number)
        return made


#: Ready-made classes reading ``REPACK_DIR``, made on first use (``from repack.megatron import
#: RepackedT5MaskedWordPieceDataset``); they pickle by name, like ``RepackedGPTDataset``.
#: ``GPTFIMDataset`` lives in Megatron-LM's ``megatron.training``: only where Megatron-LM is.
READY_MADE = {
    "RepackedBERTMaskedWordPieceDataset": (
        "megatron.core.datasets.bert_dataset",
        "BERTMaskedWordPieceDataset",
    ),
    "RepackedT5MaskedWordPieceDataset": (
        "megatron.core.datasets.t5_dataset",
        "T5MaskedWordPieceDataset",
    ),
    "RepackedGPTFIMDataset": ("megatron.training.datasets.fim_dataset", "GPTFIMDataset"),
}


def __getattr__(name: str) -> type:
    if name not in READY_MADE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, stock = READY_MADE[name]
    return repacked(getattr(importlib.import_module(module), stock))


def dataset_class(
    repack_dir: str | os.PathLike,
    *,
    phases: str | os.PathLike | None = None,
    phase: int | None = None,
) -> type:
    """A ``RepackedGPTDataset`` bound to the repack at ``repack_dir``:
    ``repacked(GPTDataset, repack_dir, phases=phases, phase=phase)``."""
    return repacked(GPTDataset, repack_dir, phases=phases, phase=phase)


def _rebuild(
    base: type,
    repack_dir: str | None,
    multimodal: bool,
    state: dict,
    phases: str | None = None,
    phase: int | None = None,
) -> Any:
    cls = repacked(base, repack_dir, multimodal=multimodal, phases=phases, phase=phase)
    dataset = cls.__new__(cls)
    dataset.__dict__.update(state)
    return dataset
