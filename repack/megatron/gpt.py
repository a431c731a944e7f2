"""``GPTDataset`` and its subclasses, repacked: their indices consolidated into one pack per
build (:mod:`repack.cache.indexcache`), built with the installed megatron-core's own
functions (or the phases' continuation), its masks held once per process
(:mod:`repack.megatron.masks`), and a clear error where stock Megatron would loop forever.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
from typing import Any, ClassVar

import numpy as np
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset

from repack.cache.indexcache import IndexCache
from repack.errors import RepackError
from repack.megatron.buildscope import once_per_build
from repack.megatron.masks import SHARED as SHARED_MASKS
from repack.megatron.masks import shares as shares_masks
from repack.megatron.mixin import NPY_ENV_VAR, Repacked

try:  # absent from none of the supported releases, but not needed by GPT users
    from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset
except ImportError:  # pragma: no cover - a release without it fails only for masked classes
    MaskedWordPieceDataset = None

__all__ = ["RepackedGPT"]


class _IndexArray:
    """One of ``GPTDataset``'s index arrays, a view of the shared pack made when read (by
    Megatron's own code or by a subclass reading ``self.shuffle_index`` directly): the pack's
    cache keeps the views of the datasets read last (:meth:`IndexCache.recent`), a dataset
    none (three array objects fewer per source in every process that reads them)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_repack_" + name
        self.position = ("document_index", "sample_index", "shuffle_index").index(name)

    def __get__(self, dataset: Any, owner: type | None = None) -> Any:
        if dataset is None:
            return self
        # getattr/setattr, not dataset.__dict__: that would give every dataset a dict object
        # of its own for the garbage collector to walk (CPython keeps attributes inline)
        value = getattr(dataset, self.slot, None)
        if value is None and getattr(dataset, "_index_name", None) is not None:
            value = dataset._indices()[self.position]
        return value

    def __set__(self, dataset: Any, value: Any) -> None:
        if value is None:
            # Megatron sets all three to None (repack's build returns them so): not held, an
            # attribute of every dataset fewer (8 bytes each, per source)
            if getattr(dataset, self.slot, None) is not None:
                delattr(dataset, self.slot)
            return
        setattr(dataset, self.slot, value)


class _IndexName:
    """``_index_name``: the dataset's name in the index cache, ``{hash}-{class}-{split}`` as
    Megatron names its cache files, made when read (a string of about 100 bytes fewer per
    dataset); held only where it is another (the phases' continuation adds to it)."""

    def __get__(self, dataset: Any, owner: type | None = None) -> Any:
        if dataset is None:
            return self
        held = getattr(dataset, "_repack_index_name", None)
        return _stock_name(dataset) if held is True else held

    def __set__(self, dataset: Any, value: Any) -> None:
        dataset._repack_index_name = True if value == _stock_name(dataset) else value


def _stock_name(dataset: Any) -> str:
    return f"{dataset.unique_description_hash}-{type(dataset).__name__}-{dataset.index_split.name}"


class RepackedGPT(Repacked):
    """``GPTDataset`` and its subclasses: indices consolidated into one pack per build, and
    a clear error where stock Megatron would loop forever."""

    document_index = _IndexArray()
    sample_index = _IndexArray()
    shuffle_index = _IndexArray()
    _index_name = _IndexName()

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
        name = _stock_name(self)
        continued = self._repack_continuation()
        if continued is not None:  # never a stock cache's name, nor a stock cache's arrays
            name += f"-phase{continued[1]}-{continued[0].digest()}"
        count = cache.sample_count(name)
        if count is None:
            self._check_drawable()  # only a build can hang: a cache of such a slice cannot exist
            source = self.dataset.source_path  # recorded with the arrays, for `repack remove`
            if continued is not None:
                entry = cache.add_arrays(name, self._continued_build(*continued), source)
            elif cache.has_stock(name):
                entry = cache.add_stock(name, source)
            elif os.environ.get(NPY_ENV_VAR, "") not in ("", "0"):
                self._megatron_build(cache.folder)  # writes (or finds) Megatron's 4 files
                entry = cache.add_stock(name, source)
            else:
                entry = cache.add_arrays(name, self._megatron_build(""), source)
            count = entry.sample_count
        # two strings, not a tuple of them: one object fewer per dataset
        self._index_folder, self._index_name = cache.folder, name
        self._sample_count = count
        return None, None, None

    def _repack_continuation(self):
        """``(schedule, phase)`` when this dataset continues earlier phases: a training split,
        the continuation asked for, a phase after the first; else ``None`` (stock)."""
        cls = type(self)
        if self.index_split.name != "train":
            return None
        if cls.repack_phases is None and not once_per_build(
            "phases in the environment", _phases_in_environment
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

        from repack.megatron.blendhook import index_fma
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
            fma=index_fma(),  # the earlier phases drew as this process's index draws
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

    def _indices(self):
        """The document, sample and shuffle index, views of the shared pack."""
        name = self._index_name
        cache = IndexCache.for_folder(self._index_folder)
        return cache.recent(name) or cache.arrays(name, self.dataset.source_path)

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
        folder, name = self._index_folder, self._index_name
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


def _phases_in_environment() -> bool:
    return bool(os.environ.get("REPACK_PHASES") or os.environ.get("REPACK_PHASE"))


class _InMemoryBuild(threading.local):
    active = False


_IN_MEMORY = _InMemoryBuild()


def _drop_unable_to_save(record: logging.LogRecord) -> bool:
    # Megatron warns, once per dataset, that it cannot save indices "because path_to_cache is
    # None" when it computes them in memory, which is what repack asks of it on a cold build
    return not (_IN_MEMORY.active and str(record.msg).startswith("Unable to save"))


logging.getLogger(GPTDataset.__module__).addFilter(_drop_unable_to_save)
