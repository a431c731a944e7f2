"""The figures of a duplicate analysis (:mod:`repack.doctor.duplicates`): what the documents
found more than once add per source, per pair of sources and per split, summed over the
partitions (:class:`Accumulator`), and the :class:`Result` they make, with its JSON summaries.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MIN_TOKENS",
    "PAIR_CAP",
    "SPLIT_BITS",
    "Accumulator",
    "Result",
    "SourceMeta",
    "bit_index",
    "per_source",
    "share",
    "summarize",
]

#: Documents shorter than this (in tokens) count for neither ``repeated-documents`` nor
#: ``shared-documents``: a sentence or so. Generated blends (``python -m repack.synth``, random
#: tokens) share documents only by chance, and only documents of one or two tokens (3,000 and
#: 10,000 sources, several seeds: docs/doctor.md#duplicates).
DEFAULT_MIN_TOKENS = 32
#: A document in more sources than this is counted as shared but adds no source pairs (pairs
#: would grow as the square of the sources it is in).
PAIR_CAP = 64

#: Each split's bit in a document's split mask.
SPLIT_BITS = {"train": 1, "valid": 2, "test": 4, "all": 1}


@dataclass(frozen=True)
class SourceMeta:
    """What the analysis needs of a source besides its documents.

    Attributes:
        key: Its absolute path.
        name: How the blend names it.
        dtype_code: Its token dtype.
        splits: ``(split, first sequence, end sequence, epochs)`` per split it is drawn in:
            its slice, and the epochs of it the split draws (summed when named twice).
    """

    key: str
    name: str
    dtype_code: int
    splits: tuple[tuple[str, int, int, float], ...] = ()


@dataclass
class Result:
    """The figures :class:`Analysis` computed, per source (by position) and per split."""

    sources: list[SourceMeta]
    documents: np.ndarray
    nonempty: np.ndarray
    tokens: np.ndarray
    repeated_documents: np.ndarray
    repeated_tokens: np.ndarray
    max_copies: np.ndarray
    shared_documents: np.ndarray
    shared_tokens: np.ndarray
    #: (a, b) -> [documents of a also in b, their tokens, and the same of the documents of
    #: at least ``min_tokens``], a != b
    pairs: dict[tuple[int, int], list[int]]
    #: source -> the first source it is a byte-identical copy of
    identical: dict[int, int]
    #: split -> distinct documents' tokens among its slices, and the tokens of the slices
    unique_tokens: dict[str, int]
    split_tokens: dict[str, int]
    #: (split, source) -> its non-empty documents in the split
    split_documents: dict[tuple[str, int], int]
    #: split -> per source, how often its most-seen document is seen
    effective: dict[str, np.ndarray]
    #: split (valid, test) -> per source [documents also in train, their tokens]
    overlap: dict[str, np.ndarray]
    #: (split, source) -> the train source sharing most of those documents
    overlap_partner: dict[tuple[str, int], int]
    partitions: int
    records: int
    #: the shortest document the ``long_*`` figures count (``Options.min_tokens``)
    min_tokens: int = DEFAULT_MIN_TOKENS
    #: per source: its documents of at least ``min_tokens``; of them, the repeats of another
    #: (and their tokens), and the copies of the most repeated
    long_documents: np.ndarray | None = None
    long_repeated_documents: np.ndarray | None = None
    long_repeated_tokens: np.ndarray | None = None
    long_max_copies: np.ndarray | None = None


def bit_index(split: str) -> int:
    return {"train": 0, "all": 0, "valid": 1, "test": 2}[split]


class Accumulator:
    """Per-source and per-pair figures, summed over the partitions."""

    def __init__(self, n: int, min_tokens: int = DEFAULT_MIN_TOKENS) -> None:
        self.n = n
        self.min_tokens = min_tokens
        self.repeated_documents = np.zeros(n, np.int64)
        self.repeated_tokens = np.zeros(n, np.int64)
        self.max_copies = np.zeros(n, np.int64)
        self.long_repeated_documents = np.zeros(n, np.int64)
        self.long_repeated_tokens = np.zeros(n, np.int64)
        self.long_max_copies = np.zeros(n, np.int64)
        self.shared_documents = np.zeros(n, np.int64)
        self.shared_tokens = np.zeros(n, np.int64)
        self.pairs: dict[tuple[int, int], list[int]] = {}
        self.unique_tokens: dict[str, int] = defaultdict(int)
        self.effective = np.zeros((3, n), np.float64)
        self.overlap = np.zeros((3, n, 2), np.int64)
        self._partners: dict[tuple[int, int, int], int] = defaultdict(int)
        self.epochs: np.ndarray | None = None
        # what the repeated documents add to the per-source figures of Analysis
        self._repeated = np.zeros(n, np.int64)
        self._in_split = np.zeros((n, 3, 2), np.int64)
        self._with_train = np.zeros((n, 3, 2), np.int64)

    def partner(self) -> dict[tuple[str, int], int]:
        best: dict[tuple[str, int], tuple[int, int]] = {}
        for (k, source, other), count in sorted(self._partners.items()):
            name = ("train", "valid", "test")[k]
            if (name, source) not in best or count > best[(name, source)][0]:
                best[(name, source)] = (count, other)  # ties: the first source
        return {key: other for key, (_, other) in best.items()}

    def repeats(self, records: np.ndarray) -> None:
        """Add the documents of some fingerprints there more than once (all their copies);
        what they add to their sources' per-split figures is kept for :meth:`singles`."""
        self._groups(records)
        src = records["source"].astype(np.int64)
        tok = records["tokens"].astype(np.int64)
        mask = records["mask"]
        np.add.at(self._repeated, src, 1)
        train = (mask & 1) != 0
        for k, bit in enumerate((1, 2, 4)):
            member = (mask & bit) != 0
            if not member.any():
                continue
            np.add.at(self._in_split[:, k, 0], src[member], 1)
            np.add.at(self._in_split[:, k, 1], src[member], tok[member])
            if k:
                both = member & train
                np.add.at(self._with_train[:, k, 0], src[both], 1)
                np.add.at(self._with_train[:, k, 1], src[both], tok[both])

    def singles(self, nonempty: np.ndarray, in_split: np.ndarray, with_train: np.ndarray) -> None:
        """Add the documents found once, each its own group, from the per-source figures of
        every document (``Analysis.in_split``, ``Analysis.with_train``) less those of the
        repeated ones (:meth:`repeats`)."""
        once = nonempty - self._repeated
        np.maximum(self.max_copies, (once > 0).astype(np.int64), out=self.max_copies)
        split = in_split - self._in_split
        train = with_train - self._with_train
        for k in range(3):
            drawn = split[:, k, 0] > 0
            if not drawn.any():
                continue
            self.unique_tokens[("train", "valid", "test")[k]] += int(split[:, k, 1].sum())
            if self.epochs is not None:
                seen = np.where(drawn, self.epochs[:, k], 0.0)
                np.maximum(self.effective[k], seen, out=self.effective[k])
            if k:  # a source drawn in train and in this split: its own documents overlap
                self.overlap[k, :, 0] += train[:, k, 0]
                self.overlap[k, :, 1] += train[:, k, 1]
                for source in np.flatnonzero(train[:, k, 0]).tolist():
                    self._partners[(k, source, source)] += int(train[source, k, 0])

    def _groups(self, records: np.ndarray) -> None:
        """Documents whose fingerprint is there more than once."""
        order = np.lexsort((records["source"], records["key"]))
        key = records["key"][order]
        src = records["source"][order].astype(np.int64)
        tok = records["tokens"][order].astype(np.int64)
        mask = records["mask"][order]
        del order
        count = len(key)
        # runs: one fingerprint in one source
        new_run = np.empty(count, bool)
        new_run[0] = True
        np.not_equal(key[1:], key[:-1], out=new_run[1:])
        new_group = new_run.copy()
        new_run[1:] |= src[1:] != src[:-1]
        run_start = np.flatnonzero(new_run)
        run_len = np.diff(np.append(run_start, count))
        run_src = src[run_start]
        run_tok = tok[run_start]
        np.add.at(self.repeated_documents, run_src, run_len - 1)
        np.add.at(self.repeated_tokens, run_src, (run_len - 1) * run_tok)
        np.maximum.at(self.max_copies, run_src, run_len)
        long = run_tok >= self.min_tokens
        np.add.at(self.long_repeated_documents, run_src[long], run_len[long] - 1)
        np.add.at(self.long_repeated_tokens, run_src[long], (run_len[long] - 1) * run_tok[long])
        np.maximum.at(self.long_max_copies, run_src[long], run_len[long])
        # groups: one fingerprint, every source
        group_of_record = np.cumsum(new_group) - 1
        group_start = np.flatnonzero(new_group)
        group_of_run = group_of_record[run_start]
        runs_per_group = np.bincount(group_of_run)
        multi = runs_per_group[group_of_record] > 1
        np.add.at(self.shared_documents, src[multi], 1)
        np.add.at(self.shared_tokens, src[multi], tok[multi])
        self._pairs(runs_per_group, group_of_run, run_src, run_len, run_tok)
        # splits
        group_tokens = tok[group_start]
        groups = len(group_start)
        in_split = []
        for k, bit in enumerate((1, 2, 4)):
            member = (mask & bit) != 0
            in_split.append(member)
            if not member.any():
                continue
            present = np.bincount(group_of_record[member], minlength=groups) > 0
            self.unique_tokens[("train", "valid", "test")[k]] += int(group_tokens[present].sum())
            if self.epochs is not None:
                weight = self.epochs[src[member], k]
                seen = np.bincount(group_of_record[member], weights=weight, minlength=groups)
                np.maximum.at(self.effective[k], src[member], seen[group_of_record[member]])
        train = in_split[0]
        if train.any():
            in_train = np.bincount(group_of_record[train], minlength=groups) > 0
            first_train = np.full(groups, -1, np.int64)
            # the train source of each group: the first one (records are sorted by source)
            rev = np.flatnonzero(train)[::-1]
            first_train[group_of_record[rev]] = src[rev]
            for k in (1, 2):
                hit = in_split[k] & in_train[group_of_record]
                if not hit.any():
                    continue
                np.add.at(self.overlap[k, :, 0], src[hit], 1)
                np.add.at(self.overlap[k, :, 1], src[hit], tok[hit])
                codes = src[hit] * self.n + first_train[group_of_record[hit]]
                values, counts = np.unique(codes, return_counts=True)
                for code, c in zip(values.tolist(), counts.tolist()):
                    self._partners[(k, code // self.n, code % self.n)] += c

    def _pairs(self, runs_per_group, group_of_run, run_src, run_len, run_tok) -> None:
        """Documents of each source also in each other source (with their copies)."""
        two = np.flatnonzero(runs_per_group[group_of_run] == 2)
        if len(two):
            first = two[::2]  # runs of a group are consecutive
            second = first + 1
            for a, b in ((first, second), (second, first)):
                self._add_pairs(run_src[a], run_src[b], run_len[a], run_tok[a])
        many = np.flatnonzero((runs_per_group > 2) & (runs_per_group <= PAIR_CAP))
        if len(many):
            starts = np.searchsorted(group_of_run, many)
            a_all, b_all = [], []
            for start, size in zip(starts.tolist(), runs_per_group[many].tolist()):
                idx = np.arange(start, start + size)
                a, b = np.meshgrid(idx, idx, indexing="ij")
                off = a != b
                a_all.append(a[off])
                b_all.append(b[off])
            a = np.concatenate(a_all)
            b = np.concatenate(b_all)
            self._add_pairs(run_src[a], run_src[b], run_len[a], run_tok[a])

    def _add_pairs(self, a, b, copies, length) -> None:
        """Add to each pair (``a``, ``b``) ``copies`` documents of ``a`` of ``length`` tokens
        each, also in ``b``: to all four figures of :attr:`Result.pairs`."""
        codes = a * self.n + b
        values, inverse = np.unique(codes, return_inverse=True)
        long = length >= self.min_tokens
        sums = [
            np.bincount(inverse, weights=w, minlength=len(values)).astype(np.int64).tolist()
            for w in (copies, copies * length, copies * long, copies * length * long)
        ]
        for code, *figures in zip(values.tolist(), *sums):
            entry = self.pairs.setdefault((code // self.n, code % self.n), [0, 0, 0, 0])
            for k, value in enumerate(figures):
                entry[k] += value


def share(part: int, whole: int) -> float:
    """``part / whole``, 0 for an empty whole."""
    return part / whole if whole else 0.0


def summarize(result: Result) -> dict[str, Any]:
    """Totals of a result, JSON-able."""
    documents = int(result.nonempty.sum())
    repeated = int(result.repeated_documents.sum())
    return {
        "documents": int(result.documents.sum()),
        "nonempty_documents": documents,
        "repeated_documents": repeated,
        "repeated_tokens": int(result.repeated_tokens.sum()),
        "repeated_share": share(repeated, documents),
        "identical_sources": len(result.identical),
        "sources_with_repeats": int((result.repeated_documents > 0).sum()),
        "source_pairs_sharing": len({frozenset(k) for k in result.pairs}),
        "partitions": result.partitions,
    }


def per_source(result: Result, i: int) -> dict[str, Any]:
    """The figures of source ``i``, JSON-able (``sources[*].duplicates``)."""
    copy_of = result.identical.get(i)
    return {
        "documents": int(result.documents[i]),
        "empty_documents": int(result.documents[i] - result.nonempty[i]),
        "repeated_documents": int(result.repeated_documents[i]),
        "repeated_tokens": int(result.repeated_tokens[i]),
        "repeated_share": share(int(result.repeated_documents[i]), int(result.nonempty[i])),
        "max_copies": int(result.max_copies[i]),
        "long_documents": int(result.long_documents[i]),
        "long_repeated_documents": int(result.long_repeated_documents[i]),
        "long_repeated_tokens": int(result.long_repeated_tokens[i]),
        "shared_documents": int(result.shared_documents[i]),
        "shared_tokens": int(result.shared_tokens[i]),
        "identical_to": None if copy_of is None else result.sources[copy_of].name,
        "effective_epochs": {
            split: float(values[i])
            for split, values in sorted(result.effective.items())
            if any(s == split for s, *_ in result.sources[i].splits)
        },
        "split_overlap": {
            split: {"documents": int(values[i, 0]), "tokens": int(values[i, 1])}
            for split, values in result.overlap.items()
            if values[i, 0]
        },
    }
