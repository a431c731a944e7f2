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
import os
import threading
from typing import ClassVar

from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from repack.errors import RepackError
from repack.indexcache import IndexCache
from repack.reader import Repack
from repack.views import SourceDataset

__all__ = ["ENV_VAR", "RepackedGPTDataset", "dataset_class"]

#: Environment variable naming the repack folder when no class is bound with dataset_class().
ENV_VAR = "REPACK_DIR"
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
        """Find this dataset's indices in the consolidated cache, else have Megatron build (or
        find) its ``.npy`` files and register them for packing. Nothing is mapped here: the
        arrays are attached on first access, from one shared pack."""
        cache = IndexCache.for_folder(self._cache_folder())
        name = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        entry = cache.lookup(name)
        if entry is None:
            if not cache.has_stock(name):
                stock_config = copy.copy(self.config)
                stock_config.path_to_cache = cache.folder
                stock_config.fast_cache_load = False
                own_config, self.config = self.config, stock_config
                try:
                    super()._build_document_sample_shuffle_indices()
                finally:
                    self.config = own_config
            entry = cache.add_stock(name)
        self._index_cache = (cache.folder, name)
        self._sample_count = entry.sample_count
        return None, None, None

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
        folder, _ = self._index_cache
        IndexCache.for_folder(folder).flush()
        state = self.__dict__.copy()
        state["document_index"] = state["sample_index"] = state["shuffle_index"] = None
        return state

    def __reduce__(self):
        return (_rebuild, (type(self).repack_dir, self.__getstate__()))


# Megatron names cache files, and hashes dataset descriptions, with ``type(self).__name__``.
# Answering to the stock name makes every hash and file name identical to stock Megatron's:
# a cache written by either is a cache hit for the other.
RepackedGPTDataset.__name__ = "GPTDataset"

_BOUND_LOCK = threading.Lock()
_BOUND: dict[str, type[RepackedGPTDataset]] = {}


def dataset_class(repack_dir: str | os.PathLike) -> type[RepackedGPTDataset]:
    """A ``RepackedGPTDataset`` class bound to the repack at ``repack_dir``.

    The repack is opened (and its structure checked) right away, so a wrong path fails here
    rather than deep inside the dataset builder; the datasets open it again with the backend
    they are configured for.
    """
    path = os.path.abspath(os.fspath(repack_dir))
    with _BOUND_LOCK:
        cls = _BOUND.get(path)
        if cls is None:
            Repack(path).close()
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
