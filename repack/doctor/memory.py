"""Host memory a training node's data loading holds from ``GPTDataset``'s cached masks, for
stock Megatron and for the repacked classes.

Stock ``GPTDataset`` computes its attention mask, loss mask and position ids on its first
sample and keeps them (``masks_and_position_ids_are_cacheable``, Megatron's default), in every
process that reads samples: each DataLoader worker of each rank (the rank itself with
``--num-workers 0``), and each split has a loader of its own. A process that has read from
``n`` datasets of sequence length ``S`` holds, per dataset:

* with ``create_attention_mask`` (the default): the ``[1, S, S]`` bool attention mask, ``S**2``
  bytes, made from two ``S x S`` float32 temporaries that are freed; what the allocator keeps
  of those is measured, not derived (:data:`STOCK_MASK_OVERHEAD`: about 3 ``S**2`` per dataset
  up to ``S = 2,896``, 1 beyond);
* the loss mask (``S`` float32) and the position ids (``S`` int64): ``12 S`` bytes, and a few
  hundred bytes of tensor objects.

Over a training run every worker reads from every source its split draws from, so a worker
holds ``n`` of them, with ``n`` the sources drawn. The repacked classes hold one set per
process (:mod:`repack.megatron.masks`'s table), and the datasets' loss masks besides (``4 S`` bytes
each): on megatron-core 0.12 to 0.14, whose ``GPTDataset`` writes into each dataset's cached
loss mask, one per dataset; from 0.15 one the datasets share
(:func:`repack.model.release.loss_mask_per_dataset`). Measured, to the byte, by
``tests/test_doctor_megatron.py`` on every release.

The figures are checked against real megatron-core by ``scripts/bench_memory.py``
(docs/benchmarks.md, "Host memory").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from repack.model import release as rel
from repack.releases import NEWEST

__all__ = [
    "STOCK_MASK_OVERHEAD",
    "Memory",
    "one_set",
    "mask_bytes_per_source",
    "node_memory",
    "predict",
    "repack_bytes",
    "readers_per_node",
]

#: glibc's largest dynamic mmap threshold (64-bit): a block this size or smaller is served from
#: the heap once one such block was freed, and the heap keeps part of what is freed there.
MMAP_THRESHOLD_MAX = 32 << 20
#: What a stock worker holds per dataset with attention masks, in units of ``S**2`` bytes: the
#: bool mask itself (1) plus what the allocator keeps of the two float32 temporaries it was
#: made from (``4 S**2`` bytes each). Measured by scripts/bench_memory.py on megatron-core
#: 0.16.1 (docs/benchmarks.md, "Host memory"): 2.6-3.1 at S = 1,024 and 2.2-2.5 at 2,048,
#: where the temporaries come from the heap; 1.0 at 4,096, where they are mapped and unmapped.
STOCK_MASK_OVERHEAD = 2.75
STOCK_MASK_OVERHEAD_MAPPED = 1.0
#: Per dataset besides the tensors' data: the three tensor objects and their storage headers.
TENSOR_OBJECTS = 3 * 200


def mask_bytes_per_source(
    seq_length: int, create_attention_mask: bool, stock: bool, release: tuple[int, int] = NEWEST
) -> int:
    """What one process holds per dataset it read from: stock's cached masks and position ids,
    or (``stock=False``) what the repacked classes add per dataset: its own float32 loss mask
    on megatron-core 0.12 to 0.14, nothing from 0.15 (the datasets share one)."""
    if not stock:
        return 4 * seq_length if rel.loss_mask_per_dataset(release) else 0
    small = 12 * seq_length + TENSOR_OBJECTS
    if not create_attention_mask:
        return small
    square = seq_length * seq_length
    mapped = 4 * square > MMAP_THRESHOLD_MAX
    return int((STOCK_MASK_OVERHEAD_MAPPED if mapped else STOCK_MASK_OVERHEAD) * square) + small


def one_set(seq_length: int, create_attention_mask: bool) -> int:
    """The repacked classes' one set per process: a mask, a loss mask, position ids."""
    return (seq_length * seq_length if create_attention_mask else 0) + 12 * seq_length


def repack_bytes(
    sources: int, seq_length: int, create_attention_mask: bool, release: tuple[int, int] = NEWEST
) -> int:
    """What the repacked classes hold in a process that read from ``sources`` datasets: the
    table's one set, and the datasets' loss masks (their own, or one shared)."""
    if not sources:
        return 0
    own = mask_bytes_per_source(seq_length, create_attention_mask, False, release)
    shared = 0 if own else 4 * seq_length
    return one_set(seq_length, create_attention_mask) + shared + sources * own


@dataclass(frozen=True)
class Memory:
    """Predicted mask memory for one split's loader.

    Attributes:
        split: ``train``, ``valid`` or ``test``.
        sources: Datasets the split draws samples from (each is read by every worker, in time).
        stock_per_reader: Bytes one stock worker holds.
        repack_per_reader: Bytes one worker of the repacked classes holds.
    """

    split: str
    sources: int
    stock_per_reader: int
    repack_per_reader: int


def predict(
    split: str,
    sources: int,
    seq_length: int,
    create_attention_mask: bool,
    release: tuple[int, int] = NEWEST,
) -> Memory:
    """The masks one reading process of ``split``'s loader holds, stock and repacked, with
    megatron-core ``release``."""
    stock = sources * mask_bytes_per_source(seq_length, create_attention_mask, True)
    repack = repack_bytes(sources, seq_length, create_attention_mask, release)
    return Memory(split, sources, stock, repack)


def readers_per_node(ranks: int, workers: int) -> int:
    """Processes of a node that read samples for one loader: each rank's workers, or the
    rank itself without workers."""
    return ranks * max(workers, 1)


def node_memory() -> int | None:
    """This machine's memory (``MemTotal``), or ``None`` if unknown."""
    try:
        with open("/proc/meminfo") as stream:
            for line in stream:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
