"""A ``BlendedDataset`` over a repack's datasets does not hold its description.

``BlendedDataset.__init__`` (every release from 0.12 to Megatron-LM main) describes the blend as
``indent=4`` JSON of its class, every dataset's identifiers, its split, weights and size, reads
the text once to hash it and once more, on a cache miss, to write it beside its cached index,
and keeps it: about 600 bytes per source (6 MiB at 10,000 sources) in the process that built it
and in every DataLoader worker forked from it (docs/benchmarks.md, issue 44).

:func:`install` puts :class:`BlendedDescription` on Megatron's ``BlendedDataset`` as
``unique_description`` (once per process; ``import repack.megatron`` does it). A blend keeps what
it is given, in its ``__dict__`` under that name as stock keeps it, unless every dataset of it
is a repacked one and every ``__init__`` of its class Megatron's: then the first read of the
text Megatron gives it (for the hash) is the last of it held, and a later read describes the
blend again, from its datasets, split name, weights and size as they were when it was
described (``weights`` and ``datasets`` held as tuples: 16 bytes per source), with the call
Megatron makes (:func:`repack.megatron.mixin.describe`), checked against the hash Megatron made
of it: a dataset whose identifiers changed since raises :class:`~repack.errors.RepackError`. A
cold build, which writes the text beside its cached index, describes the blend twice.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from repack.errors import RepackError

__all__ = ["BlendedDescription", "install"]

_NAME = "unique_description"
#: Where a blend that no longer holds its text keeps what describes it again.
_HELD = "_repack_description_of"
#: The repacked classes' common base (registered by repack.megatron, which makes them).
_REPACKED: list[type] = []


def register_repacked(base: type) -> None:
    """Blends of datasets of subclasses of ``base`` drop their description after its hash."""
    if base not in _REPACKED:
        _REPACKED.append(base)


def _repacked_blend(blend: Any) -> bool:
    from repack.megatron.mixin import _megatron_init

    datasets = getattr(blend, "datasets", None)
    return (
        bool(_REPACKED)
        and isinstance(datasets, list)
        and len(datasets) > 0
        and all(isinstance(d, tuple(_REPACKED)) for d in datasets)
        and _megatron_init(type(blend))
    )


class BlendedDescription:
    """``BlendedDataset.unique_description`` (see the module docstring)."""

    def __get__(self, blend: Any, owner: type | None = None) -> Any:
        if blend is None:
            return self
        held = blend.__dict__
        if _NAME in held:
            value = held[_NAME]
            if _HELD in held:  # read once (the hash): not held any longer
                del held[_NAME]
            return value
        if _HELD in held:
            return _describe_again(blend, held[_HELD])
        raise AttributeError(f"{type(blend).__name__!r} object has no attribute {_NAME!r}")

    def __set__(self, blend: Any, value: Any) -> None:
        held = blend.__dict__
        held.pop(_HELD, None)
        held[_NAME] = value
        # Megatron's own set, before the hash; one of a later hand is held as given
        if (
            "unique_description_hash" not in held
            and isinstance(value, str)
            and _repacked_blend(blend)
        ):
            weights = blend.weights
            held[_HELD] = (
                tuple(blend.datasets),
                blend.split.name,
                tuple(weights) if type(weights) is list else weights,
                blend.size,
            )

    def __delete__(self, blend: Any) -> None:
        held = blend.__dict__
        if _NAME not in held and _HELD not in held:
            raise AttributeError(_NAME)
        held.pop(_NAME, None)
        held.pop(_HELD, None)


def _describe_again(blend: Any, state: tuple) -> str:
    """What ``BlendedDataset.__init__`` described, from ``state`` (see :meth:`__set__`)."""
    from repack.megatron.mixin import describe

    datasets, split, weights, size = state
    identifiers = OrderedDict()
    identifiers["class"] = type(blend).__name__
    identifiers["datasets"] = [dataset.unique_identifiers for dataset in datasets]
    identifiers["split"] = split
    identifiers["weights"] = list(weights) if type(weights) is tuple else weights
    identifiers["size"] = size
    text = describe(identifiers)
    digest = blend.__dict__.get("unique_description_hash")
    found = hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()
    if digest is not None and found != digest:
        raise RepackError(
            f"{type(blend).__name__}: its description, described again, is not the one "
            "Megatron hashed (a dataset's identifiers changed after the blend was built?)"
        )
    return text


def install() -> None:
    """Put :class:`BlendedDescription` on Megatron's ``BlendedDataset`` (once)."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    if _NAME not in vars(BlendedDataset):
        setattr(BlendedDataset, _NAME, BlendedDescription())
