"""What one ``GPTDataset`` of a phase draws, and which documents its drawn samples train on.

Pure numpy, no Megatron. :func:`stock_indices` is ``GPTDataset``'s own index build
(``_build_document_index`` and ``_build_shuffle_index`` of megatron-core 0.12 to Megatron-LM
main, expression for expression, from one ``numpy.random.RandomState(seed)``: the same
arrays); :func:`continued_indices` is the continuation's (:mod:`repack.phases`). Both give a
document index (the slice's documents, epoch after epoch) and a shuffle index (the order in
which the dataset hands out its samples: its first ``n`` entries are what a ``BlendedDataset``
drawing ``n`` samples of it reads). Sample ``s`` is the token window ``[s L, s L + L + extra)``
of the document index's tokens laid end to end (``helpers.cpp``'s ``build_sample_idx``); its
``tokens`` are the first ``L``, so a document is *trained on* when one of its tokens is in
``[s L, s L + L)`` of a drawn ``s``. :func:`drawn_documents` maps a source's drawn samples to
those documents, vectorised (no loop per sample or document).

A document is one of the ``.idx`` file's sequences, as ``GPTDataset`` indexes them.

Why not :mod:`repack.trace.draws`, which ``repack trace`` reads the same arrays with: that module
runs the installed megatron-core's own build, as a trace must (its answer is the run's, on the
release the run used); the doctor runs without megatron-core, and its phase report builds every
source of every phase, once stock and once continued, in seconds at thousands of sources. This
module computes only the arrays a phase report needs (no sample index: a sample's window is
arithmetic on the document index), and ``tests/test_phases.py`` checks them equal to the arrays
of every supported release's own build.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Draw",
    "continued_indices",
    "drawn_documents",
    "separate_final_epoch",
    "stock_indices",
]

#: ``GPTDataset``'s threshold for shuffling the last epoch on its own.
_FINAL_EPOCH_THRESHOLD = 0.80

_SEEDED = threading.local()


def _random_state(seed: int) -> np.random.RandomState:
    """``numpy.random.RandomState(seed)``, as a fresh one is: its seeded state set on a
    generator kept per thread (seeding anew costs three times as much, per source and phase)."""
    states = getattr(_SEEDED, "states", None)
    if states is None:
        states = _SEEDED.states = {}
        _SEEDED.generator = np.random.RandomState()
    if seed not in states:
        states[seed] = np.random.RandomState(seed).get_state()
    _SEEDED.generator.set_state(states[seed])
    return _SEEDED.generator


def separate_final_epoch(
    epochs: int, tokens: int, num_samples: int | None, sequence_length: int, extra: int
) -> tuple[bool, int]:
    """``GPTDataset``'s choice to shuffle the last epoch apart, and the samples before it.

    Returns:
        ``(separate, samples_sans_final_epoch)`` as ``_build_document_sample_shuffle_indices``
        computes them (the second is 0 for one epoch).
    """
    if epochs == 1 or num_samples is None:
        return False, 0
    sans = ((epochs - 1) * tokens - extra) // sequence_length
    per_epoch = (tokens - extra) // sequence_length
    return (num_samples - sans) < int(_FINAL_EPOCH_THRESHOLD * per_epoch), sans


def _document_index(
    documents: np.ndarray, epochs: int, state: np.random.RandomState, separate: bool
) -> np.ndarray:
    # gpt_dataset._build_document_index, verbatim in effect
    if not separate or epochs == 1:
        index = np.mgrid[0:epochs, 0 : len(documents)][1]
        index[:] = documents
        index = index.reshape(-1).astype(np.int32)
        state.shuffle(index)
        return index
    first = _document_index(documents, epochs - 1, state, False)
    last = _document_index(documents, 1, state, False)
    return np.concatenate((first, last))


def _shuffle_dtype(total: int) -> type:
    return np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32


def _shuffle_index(samples: int, total: int, state: np.random.RandomState) -> np.ndarray:
    # gpt_dataset._build_shuffle_index
    dtype = _shuffle_dtype(total)
    first = np.arange(0, samples, 1, dtype=dtype)
    state.shuffle(first)
    if samples == total:
        return first
    last = np.arange(samples, total, 1, dtype=dtype)
    state.shuffle(last)
    return np.concatenate((first, last))


def stock_indices(
    begin: int,
    end: int,
    epochs: int,
    num_samples: int | None,
    built: int,
    tokens: int,
    seed: int,
    sequence_length: int,
    extra: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Stock ``GPTDataset``'s document index and shuffle index for the slice ``[begin, end)``.

    Args:
        begin, end: The slice's sequences in the prefix (the split's bounds).
        epochs: Epochs of the document index (``_get_num_epochs``).
        num_samples: What the dataset is built for (``None``: one epoch).
        built: Its length (``sample_index.shape[0] - 1``).
        tokens: The slice's tokens (one epoch).
        seed: ``config.random_seed``.
        sequence_length: ``L``.
        extra: ``add_extra_token_to_sequence`` (1 or 0).
    """
    separate, sans = separate_final_epoch(epochs, tokens, num_samples, sequence_length, extra)
    state = _random_state(seed)
    documents = np.arange(begin, end, 1, dtype=np.int32)
    document_index = _document_index(documents, epochs, state, separate)
    shuffle = _shuffle_index(sans if separate else built, built, state)
    return document_index, shuffle


def continued_indices(
    begin: int,
    end: int,
    epochs: int,
    built: int,
    lengths: np.ndarray,
    counts: np.ndarray,
    seed: int,
    sequence_length: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """The continuation's document index and shuffle index for the slice ``[begin, end)``.

    The first epoch lays the documents out by how many earlier phases trained on them (never
    first), shuffled within each count; later epochs (a phase that needs more than one) are
    shuffled as stock shuffles them. The shuffle index hands out first the samples whose
    tokens are all in never-trained documents, then those whose most-trained document was
    trained once, and so on, each group shuffled; the samples of later epochs last. Same
    epochs, same length (same tokens) as stock.

    Args:
        begin, end, epochs, built, seed, sequence_length: As :func:`stock_indices`.
        lengths: The prefix's sequence lengths.
        counts: For every sequence of the prefix, how many earlier phases trained on it.

    Returns:
        ``(document_index, shuffle_index, unseen)``: ``unseen`` is the number of samples
        whose tokens are all in documents no earlier phase trained on (they come first).
    """
    state = _random_state(seed)
    documents = np.arange(begin, end, 1, dtype=np.int32)
    level = np.asarray(counts[begin:end], dtype=np.int64)
    first = documents[np.lexsort((state.random_sample(len(documents)), level))]
    parts = [first]
    if epochs > 1:
        parts.append(_document_index(documents, epochs - 1, state, False))
    document_index = np.concatenate(parts).astype(np.int32, copy=False)
    _, j1 = _windows(document_index, lengths, sequence_length, np.arange(built, dtype=np.int64))
    sorted_levels = level[first - begin]
    top = int(level.max()) + 1 if len(level) else 1
    in_first = j1 < len(first)
    # the first epoch is ordered by level: a window's most-trained document is its last one
    key = np.where(in_first, sorted_levels[np.minimum(j1, max(len(first) - 1, 0))], top)
    shuffle = np.lexsort((state.random_sample(built), key)).astype(_shuffle_dtype(built))
    return document_index, shuffle, int(np.count_nonzero(key == 0))


def _windows(
    document_index: np.ndarray, lengths: np.ndarray, sequence_length: int, samples: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The document-index positions of each sample's first and last ``tokens``."""
    ends = np.cumsum(lengths[document_index], dtype=np.int64)
    first_token = samples.astype(np.int64) * sequence_length
    last = len(document_index) - 1
    j0 = np.minimum(np.searchsorted(ends, first_token, side="right"), last)
    j1 = np.minimum(np.searchsorted(ends, first_token + sequence_length - 1, side="right"), last)
    return j0, j1


@dataclass(frozen=True)
class Draw:
    """The documents a source's drawn samples train on.

    Attributes:
        documents: The documents trained on (sequence numbers in the prefix), sorted, unique.
        before: Of the drawn samples, how many have a token in a document ``counts`` marks.
    """

    documents: np.ndarray
    before: int


def drawn_documents(
    document_index: np.ndarray,
    shuffle_index: np.ndarray,
    lengths: np.ndarray,
    sequence_length: int,
    drawn: int,
    counts: np.ndarray | None = None,
) -> Draw:
    """The documents a dataset's first ``drawn`` samples train on (what a ``BlendedDataset``
    drawing ``drawn`` samples of it reads), and how many of those samples touch a document an
    earlier phase trained on (``counts`` > 0).

    Args:
        document_index, shuffle_index: The dataset's indices.
        lengths: The prefix's sequence lengths.
        sequence_length: ``L``.
        drawn: Samples drawn from the dataset.
        counts: Per sequence of the prefix, how many earlier phases trained on it, or None.
    """
    samples = np.asarray(shuffle_index[:drawn], dtype=np.int64)
    if not len(samples) or not len(document_index):
        return Draw(np.zeros(0, dtype=np.int64), 0)
    j0, j1 = _windows(document_index, lengths, sequence_length, samples)
    positions = len(document_index)
    depth = np.bincount(j0, minlength=positions + 1) - np.bincount(j1 + 1, minlength=positions + 1)
    covered = np.cumsum(depth[:positions]) > 0
    covered &= lengths[document_index] > 0
    documents = np.unique(document_index[covered]).astype(np.int64)
    before = 0
    if counts is not None:
        seen = (counts[document_index] > 0) & (lengths[document_index] > 0)
        prefix = np.concatenate(([0], np.cumsum(seen, dtype=np.int64)))
        before = int(np.count_nonzero(prefix[j1 + 1] - prefix[j0] > 0))
    return Draw(documents, before)
