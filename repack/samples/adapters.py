"""Thin adapters of :class:`repack.samples.GPTSamples` (or any object with ``len`` and
``[i]`` returning a dict of arrays) for Grain, PyTorch and Hugging Face ``datasets``.

None imports its framework at import time: :class:`GrainSource` needs no Grain at all (Grain
takes any object with ``__len__`` and ``__getitem__`` as a ``RandomAccessDataSource``),
:class:`TorchSamples` imports torch when made, and :func:`hf_examples` is the generator that
``datasets.Dataset.from_generator`` runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from repack.errors import InputError

__all__ = ["GrainSource", "TorchSamples", "hf_examples"]


def _select(
    sample: dict[str, Any], fields: Sequence[str] | None, rename: Mapping[str, str] | None
) -> dict[str, Any]:
    if fields is not None:
        missing = [f for f in fields if f not in sample]
        if missing:
            raise InputError(f"fields {missing}: the samples have {list(sample)}")
        sample = {f: sample[f] for f in fields}
    if rename:
        sample = {rename.get(k, k): v for k, v in sample.items()}
    return sample


class GrainSource:
    """A Grain ``RandomAccessDataSource``: ``len(source)`` and ``source[record_key]``, the
    sample as a dict of numpy arrays (optionally only ``fields``, keys renamed by ``rename``,
    e.g. ``{"tokens": "inputs", "labels": "targets"}`` for a MaxText-style pipeline).

    Picklable (Grain's worker processes get a copy, which reopens the data by its settings).
    """

    def __init__(
        self,
        samples: Any,
        *,
        fields: Sequence[str] | None = None,
        rename: Mapping[str, str] | None = None,
    ) -> None:
        self.samples = samples
        self.fields = None if fields is None else list(fields)
        self.rename = dict(rename or {})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, record_key: int) -> dict[str, Any]:
        return _select(self.samples[int(record_key)], self.fields, self.rename)

    def __repr__(self) -> str:
        return f"GrainSource({self.samples!r}, fields={self.fields})"


class TorchSamples:
    """A PyTorch map-style dataset (``len`` and ``[i]``, what ``torch.utils.data.DataLoader``
    and torchtitan's loaders take): the sample with Megatron's tensors, ``torch.from_numpy``
    of each array (``dataset_id`` stays the numpy int16 ``BlendedDataset`` gives), so that
    ``default_collate`` batches them as Megatron's loader does.

    Raises:
        InputError: torch is not installed.
    """

    def __init__(self, samples: Any, *, fields: Sequence[str] | None = None) -> None:
        try:
            import torch
        except ImportError as error:
            raise InputError(
                f"TorchSamples needs torch ({error}); use GrainSource without it"
            ) from None
        self._torch = torch
        self.samples = samples
        self.fields = None if fields is None else list(fields)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = _select(self.samples[int(i)], self.fields, None)
        return {
            k: self._torch.from_numpy(v) if getattr(v, "ndim", 0) else v for k, v in sample.items()
        }

    def __getstate__(self) -> dict[str, Any]:
        return {"samples": self.samples, "fields": self.fields}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["samples"], fields=state["fields"])  # type: ignore[misc]


def hf_examples(
    samples: Any,
    start: int = 0,
    stop: int | None = None,
    fields: Sequence[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Samples ``[start, stop)`` in order, each a dict of numpy arrays: the generator of
    ``datasets.Dataset.from_generator(hf_examples, gen_kwargs={"samples": ds, ...})``
    (``datasets`` hashes the arguments to name its cache: :class:`~repack.samples.GPTSamples`
    pickles by its settings). Pass ``fields`` as a tuple: ``datasets`` splits a list argument
    across its shards."""
    stop = len(samples) if stop is None else min(stop, len(samples))
    for i in range(start, stop):
        yield _select(samples[i], fields, None)
