"""The masked WordPiece datasets (BERT, T5), repacked: their sample index cached in the repack's
cache folder instead of next to every prefix, and a slice that cannot give a sample refused at
once, where stock Megatron spends ``2**31 - 2`` epochs on it.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset

from repack.errors import UndrawableSplit
from repack.megatron.masks import SHARED as SHARED_MASKS
from repack.megatron.mixin import Repacked

try:  # absent from none of the supported releases, but not needed by GPT users
    from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset
except ImportError:  # pragma: no cover - a release without it fails only for masked classes
    MaskedWordPieceDataset = None

__all__ = ["RepackedMasked"]


#: Megatron's ``helpers.build_mapping`` skips a document holding a sentence longer than this
#: (``LONG_SENTENCE_LEN`` in helpers.cpp, the same from 0.12 to main).
_LONG_SENTENCE_LEN = 512


class RepackedMasked(Repacked):
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
