"""A ``BlendedDataset`` over a repack's datasets holds its description compressed.

``BlendedDataset.__init__`` (every release from 0.12 to Megatron-LM main) describes the blend as
``indent=4`` JSON of its class, every dataset's identifiers, its split, weights and size, reads
the text once to hash it and once more, on a cache miss, to write it beside its cached index,
and keeps it: about 600 bytes per source (6 MiB at 10,000 sources) in the process that built it
and in every DataLoader worker forked from it (docs/benchmarks.md, issue 44).

:func:`install` puts :class:`BlendedDescription` on Megatron's ``BlendedDataset`` as
``unique_description`` (once per process; ``import repack.megatron`` does it). A blend keeps what
it is given, in its ``__dict__`` under that name as stock keeps it, unless every dataset of it
is a repacked one and Megatron's ``__init__`` gave it: then, at its first read (the hash), the
text is held ``zlib``-compressed instead (level 1: about 20 bytes per source, 11 ms at 10,000
sources), and every later read gives the same text back, decompressed (9 ms).
"""

from __future__ import annotations

import zlib
from typing import Any

from repack.megatron.mixin import Repacked

__all__ = ["BlendedDescription", "install"]

_NAME = "unique_description"
#: Where a blend holds its description compressed (UTF-8, zlib), or ``None`` until its first
#: read; absent from stock blends.
_HELD = "_repack_description_z"


def _repacked_blend(blend: Any) -> bool:
    datasets = getattr(blend, "datasets", None)
    return (
        isinstance(datasets, list)
        and len(datasets) > 0
        and all(isinstance(d, Repacked) for d in datasets)
    )


class BlendedDescription:
    """``BlendedDataset.unique_description`` (see the module docstring)."""

    def __get__(self, blend: Any, owner: type | None = None) -> Any:
        if blend is None:
            return self
        held = blend.__dict__
        if _NAME in held:
            value = held[_NAME]
            if _HELD in held:  # read once (the hash): held compressed from now on
                held[_HELD] = zlib.compress(value.encode("utf-8"), 1)
                del held[_NAME]
            return value
        compressed = held.get(_HELD)
        if compressed is not None:
            return zlib.decompress(compressed).decode("utf-8")
        raise AttributeError(f"{type(blend).__name__!r} object has no attribute {_NAME!r}")

    def __set__(self, blend: Any, value: Any) -> None:
        held = blend.__dict__
        held.pop(_HELD, None)
        held[_NAME] = value
        # Megatron's own set, before its hash; one of a later hand is held as given
        if "unique_description_hash" not in held and type(value) is str and _repacked_blend(blend):
            held[_HELD] = None

    def __delete__(self, blend: Any) -> None:
        held = blend.__dict__
        if _NAME not in held and held.get(_HELD) is None:
            raise AttributeError(_NAME)
        held.pop(_NAME, None)
        held.pop(_HELD, None)


def install() -> None:
    """Put :class:`BlendedDescription` on Megatron's ``BlendedDataset`` (once)."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    if _NAME not in vars(BlendedDataset):
        setattr(BlendedDataset, _NAME, BlendedDescription())
