"""What Megatron builds from a blend, split by split: pure, from counts only.

:func:`plan_splits` follows ``BlendedMegatronDatasetBuilder._build_blended_dataset_splits``
branch by branch (flat blend with a split string or one blend per split; one prefix or many;
weights given or not) and, for every ``GPTDataset`` it would build, computes with
:mod:`repack.model.arithmetic` the sequences of the prefix in the split, their tokens, the
samples the blend plans to draw, the samples the dataset is built for (the 0.5 % surplus), the
epochs of its document index, its length, and the samples ``BlendedDataset`` then draws from it
(:mod:`repack.model.blend_draws`, in the rounding of Megatron's blending error that
:attr:`Settings.fma` names).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from repack.errors import InputError
from repack.model import arithmetic as mm
from repack.model import blend_draws as blending
from repack.model import release as rel
from repack.model import rounding
from repack.releases import installed_release, release_name, release_of

__all__ = [
    "SPLIT_NAMES",
    "DatasetPlan",
    "Facts",
    "Settings",
    "SplitPlan",
    "installed",
    "plan_splits",
]

#: Megatron's ``Split`` enum, in order.
SPLIT_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class Facts:
    """What the arithmetic needs of one prefix: read from its ``.idx``, never its ``.bin``.

    Attributes:
        sequences: Sequences (Megatron's ``numel_low_level_dataset`` for GPT).
        lengths: The length of each sequence, in tokens (a view of a repack's mapped index,
            or a copy of a ``.idx`` file's; nothing per sequence is computed ahead, since at
            10^8 sequences even 8 bytes each are seconds of page faults).
        longest: The longest sequence, in tokens (0 for none).
    """

    sequences: int
    lengths: np.ndarray
    longest: int

    @classmethod
    def from_lengths(cls, lengths: np.ndarray) -> Facts:
        """Facts of a prefix from its ``sequence_lengths`` array (kept, not copied)."""
        return cls(len(lengths), lengths, int(lengths.max()) if len(lengths) else 0)

    def tokens(self, begin: int, end: int) -> int:
        """The tokens of sequences ``[begin, end)``."""
        return int(self.lengths[begin:end].sum(dtype=np.int64))

    def cumulative(self) -> np.ndarray:
        """Cumulative sequence lengths, ``sequences + 1`` int64 values starting at 0: the
        tokens of sequences ``[a, b)`` are ``cumulative[b] - cumulative[a]``. Computed anew at
        each call (the caller keeps it as long as it needs it)."""
        cumulative = np.empty(self.sequences + 1, dtype=np.int64)
        cumulative[0] = 0
        np.cumsum(self.lengths, dtype=np.int64, out=cumulative[1:])
        return cumulative


@dataclass(frozen=True)
class Settings:
    """The training settings that decide what Megatron builds.

    Attributes:
        sequence_length: ``--seq-length``.
        sizes: Samples asked of each split (train, valid, test), as
            ``get_train_valid_test_num_samples`` computes them.
        split: ``--split`` for a flat blend (ignored, as by Megatron, for per-split blends).
        surplus: ``mid_level_dataset_surplus`` (``--mid-level-dataset-surplus``).
        add_extra_token: ``add_extra_token_to_sequence``.
        drop_last_partial_validation: ``drop_last_partial_validation_sequence``.
        create_attention_mask: ``create_attention_mask`` (Megatron-LM's
            ``--no-create-attention-mask-in-dataloader`` turns it off).
        release: ``(major, minor)`` of the megatron-core whose arithmetic applies (where it
            differs: :mod:`repack.model.release`); default the one installed, else the newest.
        fma: The rounding of ``BlendedDataset``'s error, ``weights[i] * t - drawn[i]``, in the
            Megatron build that runs: ``True`` once (its aarch64 builds), ``False`` twice (its
            x86-64 builds); default the installed megatron-core's helper's, else this
            machine's (:func:`repack.model.rounding.default_fma`). The drawn counts follow it.

    Raises:
        InputError: ``surplus`` other than 0.005 for megatron-core 0.12, which has no such
            setting.
    """

    sequence_length: int
    sizes: tuple[int, int, int]
    split: str | None = "969,30,1"
    surplus: float = 0.005
    add_extra_token: bool = True
    drop_last_partial_validation: bool = True
    create_attention_mask: bool = True
    release: tuple[int, int] = field(default_factory=lambda: installed())
    fma: bool = field(default_factory=lambda: rounding.default_fma())

    def __post_init__(self) -> None:
        if not rel.has_surplus_setting(self.release) and self.surplus != rel.FIXED_SURPLUS:
            raise InputError(
                f"mid_level_dataset_surplus {self.surplus:g}: megatron-core "
                f"{release_name(self.release)} has no such setting (--mid-level-dataset-surplus "
                f"came in 0.13); its builder always builds {rel.FIXED_SURPLUS:g} more"
            )


@functools.cache
def installed() -> tuple[int, int]:
    """The release of the megatron-core installed (:func:`repack.releases.installed_release`),
    read once per process; the newest where none is."""
    return release_of(installed_release())


@dataclass(frozen=True)
class DatasetPlan:
    """One ``GPTDataset``: a prefix in a split.

    Attributes:
        split: ``"train"``, ``"valid"`` or ``"test"``.
        position: Position of the prefix in the split's blend (Megatron's dataset id).
        key: The prefix's absolute path.
        share: Its normalized weight in the split, or ``None`` when the blend has no weights.
        begin, end: Its sequences ``[begin, end)`` in the split.
        tokens: Their tokens: one epoch.
        planned: Samples the blend plans to draw from it (``BlendedDataset``'s target; for an
            unweighted blend ``size * len / total``, which Megatron rounds in its interleave).
        num_samples: Samples the dataset is built for (``GPTDataset.num_samples``; ``None``:
            one epoch).
        epochs: Epochs of its document index; ``None`` where Megatron loops forever.
        built: Its length (``len(GPTDataset)``); ``None`` when it is never built.
        index_dtype: dtype of its sample index.
        drawn: Samples the split's ``BlendedDataset`` draws from it (Megatron's greedy
            interleave, :mod:`repack.model.blend_draws`); ``None`` without a ``BlendedDataset``
            or where Megatron stops before drawing (a dataset that never finishes building, an
            unweighted blend with a dataset of length 0).
    """

    split: str
    position: int
    key: str
    share: float | None
    begin: int
    end: int
    tokens: int
    planned: float
    num_samples: int | None
    epochs: int | None
    built: int | None
    index_dtype: str
    drawn: int | None = None

    @property
    def sequences(self) -> int:
        """Sequences of the prefix in this split."""
        return self.end - self.begin

    @property
    def samples(self) -> float:
        """The samples taken from it: those drawn, else (no ``BlendedDataset``) those planned."""
        return self.planned if self.drawn is None else self.drawn

    def repetition(self, sequence_length: int) -> float:
        """Epochs of this split's tokens that its samples consume (``inf`` for none)."""
        if self.tokens <= 0:
            return math.inf if self.samples > 0 else 0.0
        return self.samples * sequence_length / self.tokens


@dataclass(frozen=True)
class SplitPlan:
    """One split: what is asked of it, and its datasets.

    Attributes:
        name: ``"train"``, ``"valid"`` or ``"test"``.
        asked: Samples asked of the split.
        blended: Whether Megatron wraps the datasets in a ``BlendedDataset``.
        size: Samples of the split (the ``BlendedDataset``'s size, or the lone dataset's
            asked samples); ``None`` when unknown (a dataset never finishes building).
        datasets: Its ``GPTDataset`` s, in blend order.
        weighted: Whether the split's blend gives weights.
        weights: The weights its ``BlendedDataset`` hands ``build_blending_indices``
            (:func:`repack.model.blend_draws.blend_weights`); ``None`` where Megatron does not
            get to blend (no ``BlendedDataset``, or it stops before).
    """

    name: str
    asked: int
    blended: bool
    size: int | None
    datasets: tuple[DatasetPlan, ...]
    weighted: bool
    weights: tuple[float, ...] | None = None


def plan_splits(
    splits: Sequence[Sequence[tuple[str, float | None]] | None],
    facts: Mapping[str, Facts],
    settings: Settings,
    *,
    per_split: bool,
) -> list[SplitPlan]:
    """Every split Megatron builds from a blend, with its datasets.

    Args:
        splits: A flat blend's ``[(key, weight), ...]`` as the only item (``per_split=False``),
            or one such list (or ``None``) per split, train, valid, test. Weights are all
            ``None`` or all finite numbers > 0.
        facts: The facts of every key.
        settings: Training settings.
        per_split: Whether ``splits`` holds one blend per split.

    Returns:
        One :class:`SplitPlan` per split Megatron builds, in order.
    """
    plans = []
    if per_split:
        for i, entries in enumerate(splits):
            if entries is None:
                continue
            bookends: list[tuple[float, float] | None] = [None] * 3
            bookends[i] = (0.0, 1.0)
            sizes = [0, 0, 0]
            sizes[i] = settings.sizes[i]
            plans.append(_plan_split(i, entries, bookends[i], sizes, facts, settings, True))
    else:
        matrix = mm.split_matrix(mm.parse_split(settings.split or ""))
        for i, bookend in enumerate(matrix):
            if bookend is not None:
                sizes = list(settings.sizes)
                plans.append(_plan_split(i, splits[0], bookend, sizes, facts, settings, False))
    return plans


def _plan_split(
    i: int,
    entries: Sequence[tuple[str, float | None]],
    bookend: tuple[float, float],
    sizes: list[int],
    facts: Mapping[str, Facts],
    settings: Settings,
    per_split: bool,
) -> SplitPlan:
    name = SPLIT_NAMES[i]
    asked = sizes[i]
    weights = [w for _, w in entries]
    weighted = weights[0] is not None
    lone = len(entries) == 1 and (per_split or not weighted)
    if lone:  # one prefix: a GPTDataset asked for the split's samples, no BlendedDataset
        num_samples: list[int | None] = [asked]
        shares: list[float | None] = [None]
        targets: list[float] = [float(asked)]
    elif weighted:
        shares = mm.normalize(weights)
        targets = [row[i] for row in mm.size_per_dataset(shares, sizes)]
        num_samples = [row[i] for row in mm.size_per_dataset(shares, sizes, settings.surplus)]
    else:
        shares = [None] * len(entries)
        num_samples = [None] * len(entries)
        targets = []
    drop_last = name != "valid" or settings.drop_last_partial_validation
    # each dataset's fields, made a DatasetPlan once all are known (dataclasses.replace took
    # half the time of a split of 10,000 sources)
    rows: list[dict] = []
    for position, ((key, _), samples) in enumerate(zip(entries, num_samples)):
        fact = facts[key]
        begin, end = mm.split_bounds(bookend, fact.sequences)
        tokens = fact.tokens(begin, end)
        epochs = mm.num_epochs(tokens, samples, settings.sequence_length, settings.add_extra_token)
        built = None
        dtype = "int32"
        if epochs is not None:
            built = mm.built_samples(
                epochs, tokens, settings.sequence_length, drop_last, settings.add_extra_token
            )
            dtype = mm.sample_index_dtype(epochs * (end - begin), fact.longest)
        rows.append(
            {
                "split": name,
                "position": position,
                "key": key,
                "share": shares[position],
                "begin": begin,
                "end": end,
                "tokens": tokens,
                "planned": targets[position] if targets else 0.0,
                "num_samples": samples,
                "epochs": epochs,
                "built": built,
                "index_dtype": dtype,
            }
        )
    size: int | None
    lengths = [row["built"] or 0 for row in rows]
    if lone:
        size = asked
    elif weighted:
        size = sum(int(t) for t in targets)
    else:  # BlendedDataset weighs by the datasets' lengths, capped at the asked size
        size = min(asked, sum(lengths))
        total = sum(lengths)
        for row, n in zip(rows, lengths):
            row["planned"] = size * n / total if total else 0.0
    builds = all(row["built"] is not None for row in rows)  # else Megatron never gets to blend
    blend: list[float] | None = None
    if not lone and builds and (weighted or all(lengths)):  # unweighted: asserts lengths > 0
        blend = blending.blend_weights(weights if weighted else None, lengths)
        drawn = blending.drawn_counts(blend, size, fma=settings.fma)
        for row, n in zip(rows, drawn):
            row["drawn"] = int(n)
    datasets = [DatasetPlan(**row) for row in rows]
    return SplitPlan(
        name,
        asked,
        not lone,
        size,
        tuple(datasets),
        weighted,
        None if blend is None else tuple(blend),
    )
