"""Megatron-Core integration: ``RepackedGPTDataset``, a drop-in for ``GPTDataset``.

Swap the class given to ``BlendedMegatronDatasetBuilder`` and keep everything else — the
``GPTDatasetConfig``, the blend, the weights, the seed::

    from repack.megatron import RepackedGPTDataset      # REPACK_DIR=/lustre/me/blend.repack
    BlendedMegatronDatasetBuilder(RepackedGPTDataset, sizes, is_built_on_rank, config).build()

or bind the repack explicitly with ``dataset_class(OUT)``. Samples are bit-identical to stock
Megatron's, while the process holds a constant number of mmaps and file descriptors:

* every blend prefix becomes a :class:`~repack.views.SourceDataset` over the shared shards;
* Megatron's per-dataset cached ``.npy`` indices are consolidated into one mapped pack per build
  (:mod:`repack.indexcache`); with ``path_to_cache`` unset they live in ``OUT/cache/``.

This module imports megatron-core (``pip install 'repack[megatron]'``); the rest of repack does
not.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from typing import ClassVar

from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from repack.errors import RepackError
from repack.indexcache import IndexCache
from repack.reader import open_repack
from repack.views import SourceDataset

__all__ = ["ENV_VAR", "NPY_ENV_VAR", "RepackedGPTDataset", "dataset_class"]

#: Environment variable naming the repack folder when no class is bound with dataset_class().
ENV_VAR = "REPACK_DIR"
#: Set (to anything but 0) to have Megatron also write its own cache files for every dataset
#: and split (``-description.txt`` and three ``.npy``), which stock ``GPTDataset`` can read.
NPY_ENV_VAR = "REPACK_NPY_CACHE"
#: Sub-folder of OUT for Megatron's cached indices when ``config.path_to_cache`` is unset
#: (stock Megatron would write ``<prefix>/cache/GPTDataset_indices`` next to every source).
CACHE_SUBDIR = os.path.join("cache", "GPTDataset_indices")


class RepackedGPTDataset(GPTDataset):
    """Megatron-Core's ``GPTDataset``, reading its sources from a repack.

    Use it as the ``cls`` of ``BlendedMegatronDatasetBuilder`` with an unchanged
    ``GPTDatasetConfig``. The repack is ``repack_dir`` of a class made by
    :func:`dataset_class`, else the folder in the ``REPACK_DIR`` environment variable.
    ``config.mmap_bin_files`` picks the shard backend (mmap, or pread without data mmaps).
    """

    #: The bound repack folder; ``None`` reads ``REPACK_DIR``.
    repack_dir: ClassVar[str | None] = None

    @classmethod
    def repack_path(cls) -> str:
        """The repack folder this class reads."""
        path = cls.repack_dir or os.environ.get(ENV_VAR)
        if not path:
            raise RepackError(
                f"{cls.__qualname__}: no repack folder: set {ENV_VAR}=/path/to/repack or use "
                "repack.megatron.dataset_class('/path/to/repack')"
            )
        return path

    @classmethod
    def build_low_level_dataset(cls, dataset_path: str, config: GPTDatasetConfig) -> SourceDataset:
        """The blend prefix ``dataset_path`` as a view of its source in the repack."""
        return SourceDataset(
            cls.repack_path(), dataset_path, multimodal=False, mmap=config.mmap_bin_files
        )

    def _cache_folder(self) -> str:
        if self.config.path_to_cache:
            return self.config.path_to_cache
        return os.path.join(self.dataset.repack.path, CACHE_SUBDIR)

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
        entry = cache.lookup(name)
        if entry is None:
            if cache.has_stock(name):
                entry = cache.add_stock(name)
            elif os.environ.get(NPY_ENV_VAR, "") not in ("", "0"):
                self._megatron_build(cache.folder)  # writes (or finds) Megatron's 4 files
                entry = cache.add_stock(name)
            else:
                entry = cache.add_arrays(name, self._megatron_build(""))
        self._index_cache = (cache.folder, name)
        self._sample_count = entry.sample_count
        return None, None, None

    def _megatron_build(self, path_to_cache: str):
        """Megatron's own index build (or cache load) with ``path_to_cache`` in place of the
        config's; ``""`` computes in memory and saves nothing."""
        stock_config = copy.copy(self.config)
        stock_config.path_to_cache = path_to_cache
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
        arrays = IndexCache.for_folder(folder).arrays(name)
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def __len__(self) -> int:
        if self.config.defer_npy_index_mmap:
            return super().__len__()
        return self._sample_count

    def _query_document_sample_shuffle_indices(self, idx: int):
        if self.shuffle_index is None:
            self._attach_indices()
        return super()._query_document_sample_shuffle_indices(idx)

    def __getstate__(self) -> dict:
        # Indices re-attach to the process's shared pack after unpickling (spawned workers):
        # pack what this process has pending so that the worker finds it in the catalog.
        folder, name = self._index_cache
        cache = IndexCache.for_folder(folder)
        cache.flush()
        state = self.__dict__.copy()
        state["document_index"] = state["sample_index"] = state["shuffle_index"] = None
        if not cache.is_packed(name):  # the cache folder cannot be written: send the arrays
            arrays = cache.arrays(name)
            state["document_index"], state["sample_index"], state["shuffle_index"] = arrays
        return state

    def __reduce__(self):
        return (_rebuild, (type(self).repack_dir, self.__getstate__()))


# Megatron names cache files, and hashes dataset descriptions, with ``type(self).__name__``.
# Answering to the stock name makes every hash and file name identical to stock Megatron's:
# a cache written by stock Megatron is a cache hit here (and, with REPACK_NPY_CACHE=1, the
# reverse).
RepackedGPTDataset.__name__ = "GPTDataset"


class _InMemoryBuild(threading.local):
    active = False


_IN_MEMORY = _InMemoryBuild()


def _drop_unable_to_save(record: logging.LogRecord) -> bool:
    # Megatron warns, once per dataset, that it cannot save indices "because path_to_cache is
    # None" when it computes them in memory, which is what repack asks of it on a cold build
    return not (_IN_MEMORY.active and str(record.msg).startswith("Unable to save"))


logging.getLogger(GPTDataset.__module__).addFilter(_drop_unable_to_save)

_BOUND_LOCK = threading.Lock()
_BOUND: dict[str, type[RepackedGPTDataset]] = {}


def dataset_class(repack_dir: str | os.PathLike) -> type[RepackedGPTDataset]:
    """A ``RepackedGPTDataset`` class bound to the repack at ``repack_dir``.

    The repack is opened (and its structure checked) right away, so a wrong path fails here
    rather than deep inside the dataset builder.
    """
    path = os.path.abspath(os.fspath(repack_dir))
    with _BOUND_LOCK:
        cls = _BOUND.get(path)
        if cls is None:
            open_repack(path)
            cls = type(
                "GPTDataset",
                (RepackedGPTDataset,),
                {
                    "repack_dir": path,
                    "__qualname__": "RepackedGPTDataset",
                    "__module__": __name__,
                    "__doc__": f"RepackedGPTDataset bound to {path}.",
                },
            )
            _BOUND[path] = cls
        return cls


def _rebuild(repack_dir: str | None, state: dict) -> RepackedGPTDataset:
    cls = dataset_class(repack_dir) if repack_dir else RepackedGPTDataset
    dataset = cls.__new__(cls)
    dataset.__dict__.update(state)
    return dataset
