"""Megatron's data arithmetic as small pure functions, mirrored from megatron-core.

Each function names the megatron-core code it mirrors (0.16.1; identical in 0.12.x to 0.15.x and
on Megatron-LM main, see ``docs/doctor.md``), and keeps its expressions, rounding included:
Python's ``round`` (half to even) for the split bounds, ``math.ceil`` of float products for the
per-dataset sample counts, the C++ single-precision ``ceil`` for a sample index that keeps its
last partial sequence. The tests compare every function with the datasets real megatron-core
builds.

No I/O, no imports of Megatron or torch.
"""

from __future__ import annotations

import functools
import itertools
import math
import re

import numpy as np

__all__ = [
    "INT16_DATASETS",
    "INT32_MAX",
    "UINT32_MAX",
    "built_samples",
    "normalize",
    "num_epochs",
    "parse_split",
    "sample_index_dtype",
    "shuffle_index_dtype",
    "size_per_dataset",
    "split_bounds",
    "split_matrix",
    "too_many_datasets",
    "training_samples",
]

#: ``BlendedDataset`` asserts ``len(datasets) < 32767``: its dataset index is int16.
INT16_DATASETS = 32767
INT32_MAX = int(np.iinfo(np.int32).max)
UINT32_MAX = int(np.iinfo(np.uint32).max)
_SPLITS = 3


def too_many_datasets() -> str:
    """What Megatron does with a ``BlendedDataset`` of :data:`INT16_DATASETS` datasets or more
    (``blended_dataset.py``'s ``assert len(datasets) < 32767``; ``helpers.cpp`` stores each
    sample's dataset as ``static_cast<int16_t>``): the clause the doctor, ``GPTSamples`` and
    the loader give."""
    return (
        f"Megatron's BlendedDataset asserts fewer than {INT16_DATASETS:,} datasets (its "
        "dataset index is int16: under python -O, without the assertion, datasets numbered "
        f"past {INT16_DATASETS:,} wrap to negative numbers and their samples come from other "
        "datasets)"
    )


def parse_split(split: str) -> list[float]:
    """Megatron's ``parse_and_normalize_split``: ``"99,1,0"`` -> ``[0.99, 0.01, 0.0]``.

    Numbers are what ``re.findall(r"[.0-9]+")`` finds (so ``"969, 30, 1"`` and ``"969/30/1"``
    parse alike), padded with zeros to three, then normalized.

    Raises:
        ValueError: not a number, more than three numbers, or all zero (where Megatron fails
            an assertion or divides by zero).
    """
    try:
        vector = [float(item) for item in re.findall(r"[.0-9]+", split)]
    except ValueError:
        raise ValueError(f"{split!r} holds a number Megatron cannot read") from None
    if not vector or len(vector) > _SPLITS:
        raise ValueError(f"{split!r} has {len(vector)} numbers; expected 1 to 3 (train,valid,test)")
    vector += [0.0] * (_SPLITS - len(vector))
    if sum(vector) <= 0:
        raise ValueError(f"{split!r} sums to 0; at least one split needs a share")
    return normalize(vector)


def normalize(weights: list[float]) -> list[float]:
    """Megatron's ``utils.normalize``: float64 weights divided by their sum."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def split_matrix(vector: list[float]) -> list[tuple[float, float] | None]:
    """Megatron's ``convert_split_vector_to_split_matrix`` for one vector: the book-ends of
    each split, or ``None`` for a split with no share (Megatron builds nothing for it)."""
    expansion = functools.reduce(lambda a, b: [*a, a[-1] + b], [[0], *vector])
    matrix: list[tuple[float, float] | None] = []
    for begin, end in itertools.pairwise(expansion):
        matrix.append(None if end <= begin else (begin, end))
    return matrix


def split_bounds(bookend: tuple[float, float], num_elements: int) -> tuple[int, int]:
    """The sequences ``[begin, end)`` of a prefix in a split, as
    ``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits`` rounds them."""
    # Megatron's expressions, verbatim
    begin = int(round(bookend[0] * float(num_elements)))  # noqa: RUF046
    end = int(round(bookend[1] * float(num_elements)))  # noqa: RUF046
    return begin, end


def size_per_dataset(
    normalized_weights: list[float], sizes: list[int], surplus: float = 0.0
) -> list[list[int]]:
    """Megatron's ``_get_size_per_split_per_dataset``: samples per dataset (rows) and split.

    With ``surplus=0`` this is the *target* (what the blend plans to draw); with the config's
    ``mid_level_dataset_surplus`` (0.005) what each ``GPTDataset`` is built for.
    """
    return [
        [int(math.ceil(math.ceil(size * weight) * (1 + surplus))) for size in sizes]  # noqa: RUF046
        for weight in normalized_weights
    ]


def num_epochs(
    tokens_per_epoch: int,
    num_samples: int | None,
    sequence_length: int,
    add_extra_token: bool = True,
) -> int | None:
    """``GPTDataset._get_num_epochs`` in closed form; ``None`` where Megatron never returns.

    Megatron adds whole epochs until they hold ``num_samples * sequence_length`` tokens (plus one
    with ``add_extra_token_to_sequence``): the smallest ``e >= 1`` with ``e * tokens >=
    requested``. With no tokens and a positive request that loop never ends: the training job
    hangs, silently.
    """
    if num_samples is None:
        return 1
    requested = num_samples * sequence_length + int(add_extra_token)
    if tokens_per_epoch <= 0:
        return None if requested > 0 else 1
    return max(1, -(-requested // tokens_per_epoch))


def built_samples(
    epochs: int,
    tokens_per_epoch: int,
    sequence_length: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token: bool = True,
) -> int:
    """``len(GPTDataset)``: the samples ``helpers.cpp``'s ``build_sample_idx`` makes.

    ``(epochs * tokens - extra) / sequence_length`` in C++ integer division (truncating towards
    zero), or, keeping the last partial sequence (validation with
    ``drop_last_partial_validation_sequence=False``), its single-precision ``ceil``.
    """
    tokens = epochs * tokens_per_epoch - int(add_extra_token)
    if drop_last_partial_sequence:
        return int(tokens / sequence_length) if tokens < 0 else tokens // sequence_length
    return int(np.ceil(np.float32(tokens) / np.float32(sequence_length)))


def sample_index_dtype(document_index_length: int, longest_sequence: int) -> str:
    """dtype of the sample index (``helpers.build_sample_idx``): int32 unless the document
    index or a sequence of the prefix is longer than int32 can count."""
    return "int32" if max(document_index_length, longest_sequence) <= INT32_MAX else "int64"


def shuffle_index_dtype(samples: int) -> str:
    """dtype of the shuffle index (``gpt_dataset._build_shuffle_index``)."""
    return "int64" if samples >= UINT32_MAX - 1 else "uint32"


def training_samples(
    *,
    global_batch_size: int,
    train_samples: int | None = None,
    train_iters: int | None = None,
    eval_iters: int = 100,
    eval_interval: int | None = 1000,
    eval_global_batch_size: int | None = None,
    start_eval_at_iter: int | None = None,
    skip_train: bool = False,
) -> tuple[int, int, int]:
    """The samples per split Megatron-LM asks the builder for (train, valid, test).

    Mirrors ``megatron/training/training.py:get_train_valid_test_num_samples`` with a constant
    batch size: ``--train-samples`` sets ``train_iters = train_samples // global_batch_size``
    (``update_train_iters``); validation runs ``train_iters // eval_interval + 1`` times (minus
    the points before ``--start-eval-at-iter``) for ``eval_iters`` batches; test runs once.

    Raises:
        ValueError: neither or both of ``train_samples`` and ``train_iters``.
    """
    if (train_samples is None) == (train_iters is None):
        raise ValueError("give exactly one of train_samples and train_iters")
    if train_samples is not None:
        train = train_samples
        train_iters = train_samples // global_batch_size
    else:
        train = train_iters * global_batch_size
    eval_batch = global_batch_size if eval_global_batch_size is None else eval_global_batch_size
    if skip_train:
        eval_steps = eval_iters
    else:
        if not eval_interval:
            raise ValueError("eval_interval is needed to count the validation samples")
        points = train_iters // eval_interval + 1
        if start_eval_at_iter is not None:
            points = max(0, points - start_eval_at_iter // eval_interval)
        eval_steps = points * eval_iters
    return train, eval_steps * eval_batch, eval_iters * eval_batch
