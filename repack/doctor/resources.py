"""Files a training process holds open and mapped, for stock Megatron and for a repack.

The counts are the formula measured in ``docs/megatron.md`` ("Resources held per process"),
written per dataset so that it holds for any blend: every ``IndexedDataset`` (one per prefix
of a flat blend, one per prefix and split of a per-split blend) maps its ``.idx`` and, with
``mmap_bin_files``, its ``.bin`` (and, from megatron-core 0.13, keeps the ``.bin`` open:
:func:`repack.model.release.bin_fds`); every ``GPTDataset`` maps its
three cached index arrays; every ``BlendedDataset`` its two. A Python mmap keeps a duplicate
descriptor of its file. DataLoader workers forked from a rank (Linux's default) inherit all
of it: a node holds ``ranks x (1 + workers)`` times one process's count (measured by
``tests/test_doctor_megatron.py``).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

from repack.model import release as rel
from repack.releases import NEWEST

__all__ = ["Held", "Limits", "machine_limits", "per_node", "repack_held", "stock_held"]


@dataclass(frozen=True)
class Held:
    """Memory maps and open descriptors of the blend's files (data and index cache)."""

    mmaps: int
    fds: int


@dataclass(frozen=True)
class Limits:
    """This machine's ceilings.

    Attributes:
        open_files: The soft ``ulimit -n`` of this process (``None``: unlimited).
        open_files_hard: The hard one, up to which a job may raise it.
        max_map_count: ``/proc/sys/vm/max_map_count``: mappings per process (``None``:
            unknown).
        mmap_limit: A file system's ceiling on mappings per process, given by the user
            (WekaFS refused them after about 590 datasets in one rank).
        node_memory: A training node's memory in bytes (``--node-memory``, by default this
            machine's; ``None``: unknown, not checked).
    """

    open_files: int | None
    open_files_hard: int | None
    max_map_count: int | None
    mmap_limit: int | None = None
    node_memory: int | None = None


def machine_limits(mmap_limit: int | None = None, node_memory: int | None = None) -> Limits:
    """The limits of this machine (and ``mmap_limit`` as given; ``node_memory`` as given, else
    this machine's memory)."""
    from repack.doctor.memory import node_memory as this_node

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def finite(value: int) -> int | None:
        return None if value == resource.RLIM_INFINITY else int(value)

    try:
        with open("/proc/sys/vm/max_map_count") as stream:
            max_map_count: int | None = int(stream.read().strip())
    except (OSError, ValueError):
        max_map_count = None
    memory = node_memory if node_memory is not None else this_node()
    return Limits(finite(soft), finite(hard), max_map_count, mmap_limit, memory)


def stock_held(
    low_level: int,
    datasets: int,
    blended: int,
    mmap_bin_files: bool = True,
    release: tuple[int, int] = NEWEST,
) -> Held:
    """What one stock Megatron process holds once its datasets are built from a warm cache.

    Args:
        low_level: ``IndexedDataset`` s built (prefixes; per split for a per-split blend).
        datasets: ``GPTDataset`` s built (prefix and split).
        blended: ``BlendedDataset`` s built (splits of more than one dataset or with weights).
        mmap_bin_files: ``GPTDatasetConfig.mmap_bin_files`` (``--no-mmap-bin-files``: False).
        release: ``(major, minor)`` of megatron-core.
    """
    index_maps = 3 * datasets + 2 * blended
    if mmap_bin_files:
        fds = (1 + rel.bin_fds(release)) * low_level + index_maps
        return Held(2 * low_level + index_maps, fds)
    return Held(low_level + index_maps, low_level + index_maps)


def repack_held(shards: int, blended: int, mmap_bin_files: bool = True, packs: int = 1) -> Held:
    """What one process holds reading the same blend from a repack (``RepackedGPTDataset``).

    Args:
        shards: Shards holding the blend's sources.
        blended: ``BlendedDataset`` s built, as for :func:`stock_held`.
        mmap_bin_files: mmap backend (True) or pread (False).
        packs: Index-cache packs mapped (one per build that found indices to pack).
    """
    maps = 1 + packs + 2 * blended + (shards if mmap_bin_files else 0)
    return Held(maps, maps + (0 if mmap_bin_files else shards))


def per_node(held: Held, ranks: int, workers: int) -> Held:
    """A node's count: ``ranks`` processes, each with ``workers`` forked DataLoader workers."""
    processes = ranks * (1 + workers)
    return Held(held.mmaps * processes, held.fds * processes)
