"""Megatron-LM's batch samplers as arithmetic: sample position <-> (rank, row) of a micro-batch.

Mirrors ``megatron/training/datasets/data_samplers.py`` (the same logic from Megatron-LM 0.12,
then ``megatron/legacy/data/data_samplers.py``, to main):

* ``MegatronPretrainingSampler`` (``--dataloader-type single``): the split's indices in order,
  from the samples consumed so far; each micro-batch step takes ``micro_batch_size *
  data_parallel_size`` of them and rank ``r`` gets the slice ``[r * mbs, (r + 1) * mbs)``.
* ``MegatronPretrainingRandomSampler`` (``cyclic``): epochs of ``active = total - total %
  (mbs * dp)`` samples, each shuffled by ``torch.randperm`` seeded with the epoch number; with
  data sharding (Megatron-LM's default) rank ``r`` draws from its own bucket ``[r * bucket,
  (r + 1) * bucket)`` of ``bucket = total // (mbs * dp) * mbs`` indices, micro-batch ``q`` of
  the epoch taking ``perm[q * mbs : (q + 1) * mbs]`` of the bucket's permutation; without
  (``--no-data-sharding``), ``perm[q * mbs * dp + row * dp + r]`` of one permutation of
  ``total // mbs * mbs`` indices.

A micro-batch step is named by the samples the loader had consumed before it (``consumed``, a
multiple of ``mbs * dp``), which is also what the training loop counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Sampler"]


@dataclass
class Sampler:
    """One loader's batch sampler, every data-parallel rank at once.

    Attributes:
        kind: ``"single"`` or ``"cyclic"``.
        total: ``len()`` of the split's dataset (the sampler's ``total_samples``).
        micro_batch_size: The loader's micro-batch size.
        data_parallel_size: Data-parallel ranks.
        data_sharding: Megatron-LM's ``--data-sharding`` (cyclic only).
    """

    kind: str
    total: int
    micro_batch_size: int
    data_parallel_size: int
    data_sharding: bool = True
    _perms: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def unit(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    @property
    def active(self) -> int:
        """Samples per epoch of the cyclic sampler."""
        return self.total - self.total % self.unit

    @property
    def bucket(self) -> int:
        if self.data_sharding:
            return (self.total // self.unit) * self.micro_batch_size
        return (self.total // self.micro_batch_size) * self.micro_batch_size

    def uneven(self) -> bool:
        """Whether Megatron's cyclic sampler without data sharding gives the ranks different
        numbers of micro-batches per epoch (its ranks then fall out of step: not reproduced)."""
        if self.kind != "cyclic" or self.data_sharding:
            return False
        rest = self.bucket - self.active
        return rest > (self.micro_batch_size - 1) * self.data_parallel_size

    def permutation(self, epoch: int) -> np.ndarray:
        """``torch.randperm(bucket, generator=torch.Generator().manual_seed(epoch))``."""
        found = self._perms.get(epoch)
        if found is None:
            import torch

            generator = torch.Generator()
            generator.manual_seed(int(epoch))
            found = torch.randperm(self.bucket, generator=generator).numpy()
            self._perms = {epoch: found}  # one at a time: a permutation may be large
        return found

    def indices(self, consumed: np.ndarray, rank: np.ndarray, row: np.ndarray) -> np.ndarray:
        """The split index the loader of data-parallel rank ``rank`` puts at row ``row`` of
        the micro-batch that starts at ``consumed`` samples (arrays broadcast together)."""
        consumed, rank, row = np.broadcast_arrays(
            np.asarray(consumed, dtype=np.int64),
            np.asarray(rank, dtype=np.int64),
            np.asarray(row, dtype=np.int64),
        )
        if self.kind == "single":
            return consumed + rank * self.micro_batch_size + row
        epoch = consumed // self.active
        offset = consumed % self.active
        out = np.empty(consumed.shape, dtype=np.int64)
        for e in np.unique(epoch):
            mask = epoch == e
            perm = self.permutation(int(e))
            if self.data_sharding:
                slot = (offset[mask] // self.unit) * self.micro_batch_size + row[mask]
                out[mask] = rank[mask] * self.bucket + perm[slot]
            else:
                slot = offset[mask] + row[mask] * self.data_parallel_size + rank[mask]
                out[mask] = perm[slot]
        return out

    def positions(
        self, indices: np.ndarray, last: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The inverse: where the loaders read split indices ``indices`` while fewer than
        ``last`` samples are consumed (every epoch of a cyclic sampler, repeats included).

        Returns:
            ``(which, consumed, rank, row)``: ``which`` indexes ``indices``; ``consumed`` starts
            the micro-batch.
        """
        indices = np.asarray(indices, dtype=np.int64)
        empty = np.zeros(0, dtype=np.int64)
        if self.kind == "single":
            keep = indices < min(last, self.total - self.total % self.unit)
            index = indices[keep]
            within = index % self.unit
            return (
                np.flatnonzero(keep),
                index - within,
                within // self.micro_batch_size,
                within % self.micro_batch_size,
            )
        parts: list[tuple[np.ndarray, ...]] = []
        epochs = -(-last // self.active) if self.active else 0
        for epoch in range(epochs):
            perm = self.permutation(epoch)
            inverse = np.empty(len(perm), dtype=np.int64)
            inverse[perm] = np.arange(len(perm), dtype=np.int64)
            if self.data_sharding:
                rank = indices // self.bucket
                keep = rank < self.data_parallel_size
                slot = inverse[indices[keep] % self.bucket]
                consumed = epoch * self.active + (slot // self.micro_batch_size) * self.unit
                row = slot % self.micro_batch_size
                rank = rank[keep]
            else:
                keep = indices < len(perm)
                slot = inverse[indices[keep]]
                inside = slot < self.active
                keep[np.flatnonzero(keep)[~inside]] = False
                slot = slot[inside]
                consumed = epoch * self.active + (slot // self.unit) * self.unit
                rank = slot % self.data_parallel_size
                row = (slot % self.unit) // self.data_parallel_size
            which = np.flatnonzero(keep)
            before = consumed < last
            parts.append((which[before], consumed[before], rank[before], row[before]))
        if not parts:
            return empty, empty, empty, empty
        return tuple(np.concatenate(column) for column in zip(*parts))  # type: ignore[return-value]
