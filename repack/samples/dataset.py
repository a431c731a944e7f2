"""Megatron's GPT samples, in Megatron's order, without torch or megatron-core.

:class:`GPTSamples` is one split of what ``BlendedMegatronDatasetBuilder(GPTDataset, sizes,
is_built_on_rank, config).build()`` returns: ``len(ds)`` and ``ds[i]`` are the split's
``len()`` and sample ``i``, the same arrays. It is built from repack's numpy port of Megatron's
arithmetic: the builder's plan (:func:`repack.model.splits.plan_splits`: split bounds, samples
per dataset, epochs, lengths), each ``GPTDataset``'s document and shuffle indices
(:func:`repack.model.gpt_indices.stock_indices`), ``BlendedDataset``'s blending index
(:func:`repack.model.blending.build_blending_indices`) and ``__getitem__``'s masks
(:mod:`repack.samples.ltor`). A ``GPTDataset``'s indices are built when one of its samples is
first read, so the first sample of a blend of thousands of sources costs the plan and the
blending index, not every dataset's indices.

Sample ``s`` of a ``GPTDataset`` is the token window ``[s L, s L + L + extra)`` of its
document index's sequences laid end to end (``helpers.cpp``'s ``build_sample_idx``), padded
with the pad id past the last token (a partial last validation sample).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from repack.errors import InputError, TooManyDatasets, UndrawableSplit
from repack.model import blend_draws, rounding
from repack.model.arithmetic import INT16_DATASETS, too_many_datasets
from repack.model.blending import build_blending_indices
from repack.model.gpt_indices import stock_indices
from repack.model.splits import SPLIT_NAMES, DatasetPlan, Facts, Settings, plan_splits
from repack.releases import NEWEST, release_of
from repack.samples.ltor import sample_fields
from repack.samples.tokens import open_prefixes, open_repack_sources

__all__ = ["GPTSamples", "SampleOrigin"]


@dataclass(frozen=True)
class SampleOrigin:
    """Where sample ``i`` of a split comes from.

    Attributes:
        dataset_id: The dataset's position in the split's blend (``BlendedDataset``'s
            ``dataset_id``; 0 for a split of one ``GPTDataset``).
        prefix: The prefix, as the blend names it.
        dataset_sample: The sample's index in that ``GPTDataset``.
        documents: The sequences of the prefix that the sample's window touches, in order
            (``GPTDataset._query_document_sample_shuffle_indices``' document ids).
    """

    dataset_id: int
    prefix: str
    dataset_sample: int
    documents: tuple[int, ...]


class _Indices:
    """One ``GPTDataset``'s document index, token offsets and shuffle index."""

    def __init__(
        self, plan: DatasetPlan, lengths: np.ndarray, seed: int, sequence_length: int, extra: int
    ) -> None:
        documents, shuffle = stock_indices(
            plan.begin,
            plan.end,
            int(plan.epochs),  # type: ignore[arg-type]  (GPTSamples refuses a None first)
            plan.num_samples,
            int(plan.built),  # type: ignore[arg-type]
            plan.tokens,
            seed,
            sequence_length,
            extra,
        )
        self.documents = documents
        self.shuffle = shuffle
        self.offsets = np.zeros(len(documents) + 1, dtype=np.int64)
        np.cumsum(lengths[documents], dtype=np.int64, out=self.offsets[1:])


class GPTSamples:
    """One split of Megatron's GPT datasets: ``len(ds)``, ``ds[i]``, torch-free.

    Settings are ``GPTDatasetConfig``'s fields by name, plus the builder's ``sizes`` and the
    split asked for (``which``). The blend is a repack's (``repack``: a folder, ``s3://`` or
    ``msc://`` URL; its recorded blend unless ``blend`` or ``blend_per_split`` is given, whose
    prefixes are then looked up in it as ``RepackedGPTDataset`` does), or ``blend`` /
    ``blend_per_split`` alone, naming Megatron prefixes (``X.bin`` and ``X.idx``) on a file
    system.

    Args:
        repack: The repack, or ``None`` for a plain blend.
        sizes: The builder's samples per split (train, valid, test).
        which: ``"train"``, ``"valid"`` or ``"test"``.
        random_seed, sequence_length, split, blend, blend_per_split,
            mid_level_dataset_surplus, reset_position_ids, reset_attention_mask,
            eod_mask_loss, create_attention_mask, add_extra_token_to_sequence,
            drop_last_partial_validation_sequence, mmap_bin_files,
            inter_document_masking: ``GPTDatasetConfig``'s (the last from megatron-core 0.19).
        eod: The tokenizer's ``eod`` id.
        pad: The tokenizer's ``pad`` id; -1 (Megatron's ``_PAD_TOKEN_ID``) where the tokenizer
            has none.
        release: The megatron-core release whose arithmetic applies (``"0.14"``, ``(0, 14)``);
            default the newest. Only 0.12 differs (no ``mid_level_dataset_surplus`` setting).
        fma: The rounding of Megatron's blending error: ``True`` once, as its aarch64 builds
            (GH200, GB200); ``False`` twice, as its x86-64 builds; ``None`` (the default) as
            the installed megatron-core's helper, else as this machine's builds
            (:mod:`repack.model.rounding`). The two draw another order for most hand-written
            weights.

    Raises:
        InputError: settings Megatron would refuse (or hang on), each with its cause.
        TooManyDatasets: the split blends 32,767 prefixes or more, which Megatron refuses.
        UndrawableSplit: a dataset of the split has no tokens but samples are asked of it.
        UnknownSource: a prefix is not in the repack.
        SourceError: a prefix's files are missing or damaged.
    """

    def __init__(
        self,
        repack: str | os.PathLike[str] | None = None,
        *,
        sizes: Sequence[int],
        which: str = "train",
        random_seed: int,
        sequence_length: int,
        eod: int,
        pad: int = -1,
        split: str | None = None,
        blend: tuple[list[str], list[float] | None] | None = None,
        blend_per_split: list[tuple[list[str], list[float] | None] | None] | None = None,
        mid_level_dataset_surplus: float = 0.005,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
        create_attention_mask: bool = True,
        add_extra_token_to_sequence: bool = True,
        drop_last_partial_validation_sequence: bool = True,
        mmap_bin_files: bool = True,
        inter_document_masking: bool = False,
        release: str | tuple[int, int] | None = None,
        fma: bool | None = None,
    ) -> None:
        self._arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self._inter_document = bool(inter_document_masking)
        if which not in SPLIT_NAMES:
            raise InputError(f"which={which!r}: expected one of {', '.join(SPLIT_NAMES)}")
        sizes = tuple(int(n) for n in sizes)
        if len(sizes) != 3 or min(sizes) < 0:
            raise InputError(f"sizes={list(sizes)}: expected three sample counts, 0 or more")
        if sequence_length < 1:
            raise InputError(f"sequence_length={sequence_length}: expected 1 or more")
        if blend is not None and blend_per_split is not None:
            raise InputError("give blend or blend_per_split, not both (Megatron takes one)")
        self.which = which
        #: The rounding of Megatron's blending error this split's order follows (``fma``).
        self.fma = rounding.default_fma() if fma is None else bool(fma)
        self._arguments["fma"] = self.fma  # a worker unpickled elsewhere keeps this order
        self.sequence_length = int(sequence_length)
        self._seed = int(random_seed)
        self._extra = int(bool(add_extra_token_to_sequence))
        self._fields = {
            "eod": int(eod),
            "pad": int(pad),
            "add_extra_token": bool(add_extra_token_to_sequence),
            "reset_position_ids": bool(reset_position_ids),
            "reset_attention_mask": bool(reset_attention_mask),
            "eod_mask_loss": bool(eod_mask_loss),
            "create_attention_mask": bool(create_attention_mask),
        }
        location = None if repack is None else os.fspath(repack)
        if blend is None and blend_per_split is None:
            if location is None:
                raise InputError("no data: give a repack, or blend or blend_per_split")
            blend, blend_per_split = _recorded_blend(location)
        position = SPLIT_NAMES.index(which)
        per_split = blend_per_split is not None
        if per_split:
            if len(blend_per_split) != 3:
                raise InputError(
                    f"blend_per_split: {len(blend_per_split)} items, expected 3 "
                    "(train, valid, test)"
                )
            # each split is built on its own: only this one's prefixes are read
            splits: list = [None, None, None]
            splits[position] = _entries(blend_per_split[position], f"blend_per_split[{position}]")
            wanted = splits[position]
        else:
            if not split:
                raise InputError("a blend (not per split) needs split, e.g. split='969,30,1'")
            splits = [_entries(blend, "blend")]
            wanted = splits[0]
        if wanted is None:
            raise InputError(f"blend_per_split names no blend for {which}: Megatron builds none")
        if len(wanted) >= INT16_DATASETS:  # before a reader is opened
            raise TooManyDatasets(
                f"the {which} blend names {len(wanted):,} prefixes: {too_many_datasets()}"
            )
        prefixes = [prefix for prefix, _ in wanted]
        self._weights = [weight for _, weight in wanted]
        if location is None:
            self._readers: dict[str, Any] = open_prefixes(prefixes, mmap_bin_files)
        else:
            self._readers = open_repack_sources(location, prefixes, mmap_bin_files)
        facts = {p: Facts.from_lengths(r.sequence_lengths) for p, r in self._readers.items()}
        settings = Settings(
            sequence_length=self.sequence_length,
            sizes=sizes,  # type: ignore[arg-type]
            split=split,
            surplus=float(mid_level_dataset_surplus),
            add_extra_token=bool(add_extra_token_to_sequence),
            drop_last_partial_validation=bool(drop_last_partial_validation_sequence),
            create_attention_mask=bool(create_attention_mask),
            release=_release(release),
            fma=self.fma,
        )
        plans = {p.name: p for p in plan_splits(splits, facts, settings, per_split=per_split)}
        plan = plans.get(which)
        if plan is None:
            raise InputError(f"split={split!r} gives {which} nothing: Megatron builds no {which}")
        self._plan = plan
        for dataset in plan.datasets:
            if dataset.epochs is None:
                raise UndrawableSplit(
                    f"{dataset.key}: its {which} slice (sequences {dataset.begin}..{dataset.end})"
                    f" has no tokens but {dataset.num_samples} samples are asked of it; "
                    "Megatron's GPTDataset would never finish building"
                )
        self._indices: dict[int, _Indices] = {}
        self._lock = threading.Lock()
        self._dataset_index: np.ndarray | None = None
        self._dataset_sample_index: np.ndarray | None = None
        if plan.blended:
            self._blend()
            self._length = len(self._dataset_index)  # type: ignore[arg-type]
        else:
            self._length = int(plan.datasets[0].built)  # type: ignore[arg-type]

    def _blend(self) -> None:
        plan = self._plan
        lengths = [int(d.built) for d in plan.datasets]  # type: ignore[arg-type]
        if not plan.weighted and not all(lengths):
            empty = plan.datasets[lengths.index(0)].key
            raise UndrawableSplit(
                f"{empty}: no {self.which} sample, in a blend without weights (Megatron weighs "
                "by the datasets' lengths and asserts each is above 0)"
            )
        # the weights as given: the builder normalizes them, BlendedDataset once more
        weights = blend_draws.blend_weights(self._weights if plan.weighted else None, lengths)
        size = int(plan.size or 0)
        self._dataset_index = np.zeros(size, dtype=np.int16)
        self._dataset_sample_index = np.zeros(size, dtype=np.int64)
        build_blending_indices(
            self._dataset_index,
            self._dataset_sample_index,
            np.array(weights, dtype=np.float64),
            len(weights),
            size,
            False,
            fma=self.fma,
        )

    # --- pickling by settings: a worker opens its own readers --------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return self._arguments

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        where = self._arguments["repack"] or "a plain blend"
        return (
            f"GPTSamples({where!r}, which={self.which!r}, {self._length:,} samples, fma={self.fma})"
        )

    # --- random access ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._length

    def _index(self, i: int) -> int:
        n = self._length
        k = int(i)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"sample {int(i)}: out of range for {n:,} {self.which} samples")
        return k

    def _dataset(self, position: int) -> _Indices:
        found = self._indices.get(position)
        if found is None:
            with self._lock:
                found = self._indices.get(position)
                if found is None:
                    plan = self._plan.datasets[position]
                    lengths = self._readers[plan.key].sequence_lengths
                    found = _Indices(plan, lengths, self._seed, self.sequence_length, self._extra)
                    self._indices[position] = found
        return found

    def _where(self, k: int) -> tuple[int, int]:
        if self._dataset_index is None:
            return 0, k
        return int(self._dataset_index[k]), int(self._dataset_sample_index[k])  # type: ignore[index]

    def _window(self, position: int, sample: int) -> np.ndarray:
        """The ``S + extra`` tokens of sample ``sample`` of dataset ``position``, int64."""
        indices = self._dataset(position)
        if not 0 <= sample < len(indices.shuffle):
            raise IndexError(
                f"{self._plan.datasets[position].key}: sample {sample} of a GPTDataset of "
                f"{len(indices.shuffle)} (the blend draws more than the dataset holds)"
            )
        reader = self._readers[self._plan.datasets[position].key]
        want = self.sequence_length + self._extra
        start = int(indices.shuffle[sample]) * self.sequence_length
        offsets = indices.offsets
        stop = min(start + want, int(offsets[-1]))
        text = np.full(want, self._fields["pad"], dtype=np.int64)
        k = int(np.searchsorted(offsets, start, side="right")) - 1
        at = start
        while at < stop:
            first, last = int(offsets[k]), int(offsets[k + 1])
            end = min(stop, last)
            if end > at:
                part = reader.get(int(indices.documents[k]), at - first, end - at)
                text[at - start : end - start] = part
            at = max(at, end)
            k += 1
        return text

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Sample ``i``: ``BlendedDataset``'s ``dataset_id`` (an int16, as Megatron's; only
        where the split blends several datasets), then ``GPTDataset``'s ``tokens``,
        ``labels``, ``attention_mask`` (with ``create_attention_mask``), ``loss_mask`` and
        ``position_ids``, as numpy arrays with Megatron's dtypes."""
        position, sample = self._where(self._index(i))
        text = self._window(position, sample)
        if self._inter_document:
            lengths = self._parts(position, sample)[1]
            fields = sample_fields(
                text,
                **self._fields,
                document_lengths=lengths,
                sequence_length=self.sequence_length,
            )
        else:
            fields = sample_fields(text, **self._fields)
        if self._dataset_index is None:
            return fields
        return {"dataset_id": np.int16(position), **fields}

    def _parts(self, position: int, sample: int) -> tuple[range, list[int]]:
        """The document-index positions sample ``sample`` of dataset ``position`` spans, as
        ``build_sample_idx`` points at them, and the tokens of each part that
        ``_query_document_sample_shuffle_indices`` reads (a part may be empty)."""
        indices = self._dataset(position)
        j = int(indices.shuffle[sample])
        offsets = indices.offsets
        ends = offsets[1:]
        L, extra = self.sequence_length, self._extra

        def pointer(s: int) -> int:  # build_sample_idx's document position of sample s
            if s == 0:
                return 0
            return min(int(np.searchsorted(ends, s * L + extra, side="left")), len(ends) - 1)

        first, last = pointer(j), pointer(j + 1)
        start, stop = j * L, j * L + L + extra
        lengths = [
            max(0, min(stop, int(offsets[k + 1])) - max(start, int(offsets[k])))
            for k in range(first, last + 1)
        ]
        return range(first, last + 1), lengths

    def origin(self, i: int) -> SampleOrigin:
        """Where sample ``i`` comes from: its dataset, its sample there, its documents."""
        position, sample = self._where(self._index(i))
        span = self._parts(position, sample)[0]
        documents = self._dataset(position).documents[span.start : span.stop]
        key = self._plan.datasets[position].key
        return SampleOrigin(position, key, sample, tuple(int(d) for d in documents))

    def datasets(self) -> list[str]:
        """The split's prefixes, in blend order (``dataset_id`` indexes this list)."""
        return [d.key for d in self._plan.datasets]


def _release(release: str | tuple[int, int] | None) -> tuple[int, int]:
    if release is None:
        return NEWEST
    if isinstance(release, tuple):
        return (int(release[0]), int(release[1]))
    found = release_of(release)
    if found == NEWEST:
        raise InputError(f"release={release!r}: expected a megatron-core version such as '0.16'")
    return found


def _entries(blend: Any, name: str) -> list[tuple[str, float | None]] | None:
    """``[(prefix, weight), ...]`` of a Megatron-Core ``(prefixes, weights)`` blend."""
    if blend is None:
        return None
    try:
        prefixes, weights = blend
    except (TypeError, ValueError):
        raise InputError(
            f"{name}: expected (prefixes, weights or None), found {blend!r:.80}"
        ) from None
    if isinstance(prefixes, str) or not prefixes:
        raise InputError(f"{name}: expected a non-empty list of prefixes, found {prefixes!r:.80}")
    prefixes = [os.fspath(p) for p in prefixes]
    if weights is None:
        return [(p, None) for p in prefixes]
    weights = [float(w) for w in weights]
    if len(weights) != len(prefixes):
        raise InputError(f"{name}: {len(weights)} weights for {len(prefixes)} prefixes")
    if not all(np.isfinite(w) and w > 0 for w in weights):
        raise InputError(f"{name}: weights must be finite numbers above 0, found {weights!r:.80}")
    return list(zip(prefixes, weights))


def _recorded_blend(location: str) -> tuple[Any, Any]:
    """The blend a repack records, as ``(blend, blend_per_split)`` in Megatron-Core's form,
    prefixes by their absolute paths."""
    from repack.read.reader import open_repack

    recorded = open_repack(location).manifest.blend

    def megatron_form(entries: Any) -> tuple[list[str], list[float] | None] | None:
        if not entries:
            return None
        weights = [e.weight for e in entries]
        return [e.path for e in entries], None if weights[0] is None else weights

    if recorded.per_split:
        return None, [megatron_form(recorded.splits.get(name)) for name in SPLIT_NAMES]
    return megatron_form(recorded.splits["all"]), None
