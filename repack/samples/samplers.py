"""Megatron-LM's batch samplers as arithmetic, without torch: sample position <-> (rank, row)
of a micro-batch. Shared by :class:`repack.samples.GPTSamples`' users and ``repack trace``.

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

The cyclic sampler's ``torch.randperm(n, generator=torch.Generator().manual_seed(epoch))`` is
computed without torch (:func:`randperm`): torch's CPU kernel is a Fisher-Yates shuffle drawing
``mt19937() % (n - i)``, and its ``mt19937`` seeded with ``epoch`` is numpy's legacy
``MT19937`` seeded alike (the tests compare both). Only above ``2**32 / 20`` samples per
bucket does torch switch to 64-bit draws; there :func:`randperm` asks torch itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from repack.errors import InputError

__all__ = ["Sampler", "micro_batches", "randperm"]

#: Below this ``n``, torch's ``randperm`` on the CPU draws 32-bit numbers (``randperm_cpu``).
_RANDPERM_32BIT = (1 << 32) // 20


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
            found = randperm(self.bucket, epoch)
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


def randperm(n: int, seed: int) -> np.ndarray:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed))`` on the CPU, as
    int64, without torch for ``n`` below ``2**32 / 20`` (about 2 * 10**8; above, torch is
    imported and asked).

    torch's ``randperm_cpu`` fills ``0 .. n-1`` and, for ``i`` from 0 to ``n - 2``, swaps
    entry ``i`` with entry ``i + mt19937() % (n - i)``; its generator is the 32-bit Mersenne
    Twister seeded with ``init_genrand(seed)``, as numpy's legacy ``RandomState(seed)`` is.
    """
    n = int(n)
    if n >= _RANDPERM_32BIT:
        import torch  # torch's 64-bit path; not reproduced here

        generator = torch.Generator()
        generator.manual_seed(int(seed))
        return torch.randperm(n, generator=generator).numpy().astype(np.int64)
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    bits = np.random.MT19937(0)
    bits._legacy_seeding(int(seed) & 0xFFFFFFFF)  # torch's mt19937 keeps the low 32 bits
    draws = bits.random_raw(n - 1).astype(np.uint64)
    targets = (draws % np.arange(n, 1, -1, dtype=np.uint64)).astype(np.int64)
    targets += np.arange(n - 1, dtype=np.int64)
    perm = list(range(n))
    for i, j in enumerate(targets.tolist()):  # sequential by nature: each swap sees the last
        perm[i], perm[j] = perm[j], perm[i]
    return np.array(perm, dtype=np.int64)


def micro_batches(
    kind: str,
    total: int,
    *,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    consumed_samples: int = 0,
    data_sharding: bool = True,
) -> Iterator[list[int]]:
    """The split indices of each micro-batch one data-parallel rank reads, in order: what
    Megatron-LM's ``MegatronPretrainingSampler`` (``kind="single"``) or
    ``MegatronPretrainingRandomSampler`` (``"cyclic"``, epoch after epoch, as
    ``build_pretraining_data_loader`` cycles it) yields for
    ``(total, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)``.

    ``single`` ends with the last full step (``drop_last``); ``cyclic`` never ends.

    Raises:
        InputError: an unknown kind, a rank outside ``[0, data_parallel_size)``, sizes below
            1, ``consumed_samples`` not a multiple of ``micro_batch_size * data_parallel_size``
            (cyclic), no sample for the ranks (Megatron asserts the same), or a cyclic
            sampler without data sharding whose ranks fall out of step.
    """
    if kind not in ("single", "cyclic"):
        raise InputError(f"sampler kind {kind!r}: expected 'single' or 'cyclic'")
    if micro_batch_size < 1 or data_parallel_size < 1:
        raise InputError(
            f"micro_batch_size {micro_batch_size}, data_parallel_size {data_parallel_size}: "
            "both must be 1 or more"
        )
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise InputError(
            f"data_parallel_rank {data_parallel_rank}: expected 0 to {data_parallel_size - 1}"
        )
    sampler = Sampler(kind, int(total), micro_batch_size, data_parallel_size, data_sharding)
    if total <= 0 or (kind == "cyclic" and sampler.active <= 0):
        raise InputError(
            f"{total} samples for micro-batches of {micro_batch_size} on {data_parallel_size} "
            "ranks: Megatron's sampler has no step to take"
        )
    if sampler.uneven():
        raise InputError(
            f"cyclic sampler without data sharding, {total} samples, micro-batches of "
            f"{micro_batch_size} on {data_parallel_size} ranks: Megatron's ranks get different "
            "numbers of micro-batches per epoch and fall out of step (not reproduced)"
        )
    consumed = int(consumed_samples)
    if kind == "cyclic" and consumed % sampler.unit:
        raise InputError(
            f"consumed_samples {consumed}: not a multiple of micro_batch_size x "
            f"data_parallel_size = {sampler.unit}, as Megatron's cyclic sampler asserts"
        )
    rows = np.arange(micro_batch_size, dtype=np.int64)
    while kind == "cyclic" or consumed + sampler.unit <= total:
        yield sampler.indices(consumed, data_parallel_rank, rows).tolist()
        consumed += sampler.unit
