"""Duplicate data in a blend, from document fingerprints: sources that are copies of another,
documents repeated within a source or shared across sources, valid/test documents also in
train, the unique tokens each split trains on, and the repetition of the most-seen document.

Exact duplicates only: two documents are the same when their fingerprints (XXH3-64 of their
token bytes, docs/format.md 2.11) and token dtypes are; near-duplicates are not looked for.
Empty documents (no token) are left out: they all have the same fingerprint and no token to
repeat.

:class:`Analysis` takes the sources one at a time (:meth:`Analysis.add`) and keeps of each
only per-source figures and one 21-byte record per non-empty document. When the records of the
whole blend would not fit in ``memory`` bytes they go to ``2**k`` temporary files by the top
bits of their fingerprint (a document's copies all land in one file), and the files are read
back one at a time: peak memory is then about ``memory`` plus per-source and per-pair figures,
whatever the blend's size. The fingerprints come from a repack's fingerprint file or from
reading a blend's tokens (:mod:`repack.doctor.documents`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

__all__ = [
    "DEFAULT_MEMORY",
    "Analysis",
    "Options",
    "Result",
    "SourceMeta",
]

#: Memory for the records of the documents at once; beyond it they are partitioned.
DEFAULT_MEMORY = 1 << 30
#: Bytes of memory one record needs while its partition is analysed (the record, a sort
#: permutation, the sorted copies and per-run arrays).
_BYTES_PER_RECORD = 96
#: A document in more sources than this is counted as shared but adds no source pairs (pairs
#: would grow as the square of the sources it is in).
PAIR_CAP = 64

SPLIT_BITS = {"train": 1, "valid": 2, "test": 4, "all": 1}
_RECORD = np.dtype([("key", "<u8"), ("tokens", "<u8"), ("source", "<u4"), ("mask", "u1")])
#: Mixed into fingerprints so that equal bytes of two token dtypes are different documents.
_DTYPE_SALT = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class Options:
    """Thresholds of the duplicate problems (docs/doctor.md#duplicates).

    Attributes:
        max_repeated: ``repeated-documents`` when more than this share of a source's documents
            are copies of another of its documents.
        max_shared: ``shared-documents`` when more than this share of a source's documents are
            also in one other source.
        max_overlap: ``split-overlap`` when more than this share of a source's valid or test
            documents are also in train (0: any).
        memory: Bytes for the documents' records at once; beyond, they are partitioned.
    """

    max_repeated: float = 0.01
    max_shared: float = 0.01
    max_overlap: float = 0.0
    memory: int = DEFAULT_MEMORY


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
    #: (a, b) -> [documents of a also in b, their tokens], a != b
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


class Analysis:
    """Accumulates the documents of the sources of a blend; :meth:`finish` analyses them."""

    def __init__(
        self, sources: Sequence[SourceMeta], total_documents: int, options: Options = Options()
    ) -> None:
        self.meta = list(sources)
        self.options = options
        n = len(self.meta)
        self.documents = np.zeros(n, np.int64)
        self.nonempty = np.zeros(n, np.int64)
        self.tokens = np.zeros(n, np.int64)
        self.digests: dict[tuple, list[int]] = defaultdict(list)
        self.split_tokens: dict[str, int] = defaultdict(int)
        self.split_documents: dict[tuple[str, int], int] = defaultdict(int)
        per_partition = max(1, options.memory // _BYTES_PER_RECORD)
        bits = 0
        while (total_documents >> bits) > per_partition // 2 and bits < 16:
            bits += 1  # half full on average: room for uneven partitions
        self.bits = bits
        self._chunks: list[np.ndarray] = []
        self._folder: str | None = None
        self._files: list[Any] = []
        self.records = 0
        self.epochs = np.zeros((n, 3), np.float64)
        for i, meta in enumerate(self.meta):
            for split, _, _, epochs in meta.splits:
                self.epochs[i, _bit_index(split)] += epochs
        if bits:
            self._folder = tempfile.mkdtemp(prefix="repack-duplicates-")
            self._files = [
                open(os.path.join(self._folder, f"{p:05d}.rec"), "wb") for p in range(1 << bits)
            ]

    def add(self, i: int, hashes: np.ndarray, tokens: np.ndarray, first: np.ndarray) -> None:
        """Add source ``i``'s documents: their fingerprints, tokens and first sequences."""
        meta = self.meta[i]
        hashes = np.asarray(hashes, dtype=np.uint64)
        tokens = np.asarray(tokens, dtype=np.int64)
        self.documents[i] = len(hashes)
        self.tokens[i] = int(tokens.sum())
        digest = xxhash.xxh3_64_intdigest(np.ascontiguousarray(hashes).view(np.uint8))
        self.digests[(meta.dtype_code, len(hashes), digest)].append(i)
        mask = np.zeros(len(hashes), np.uint8)
        for split, begin, end, _ in meta.splits:
            lo, hi = np.searchsorted(first, [begin, end], "left")
            mask[lo:hi] |= SPLIT_BITS[split]
            self.split_tokens[split] += int(tokens[lo:hi].sum())
            self.split_documents[(split, i)] += int((tokens[lo:hi] > 0).sum())
        keep = tokens > 0
        self.nonempty[i] = int(keep.sum())
        if not keep.any():
            return
        records = np.empty(int(keep.sum()), _RECORD)
        salt = np.uint64((meta.dtype_code * _DTYPE_SALT) & 0xFFFFFFFFFFFFFFFF)
        records["key"] = hashes[keep] ^ salt
        records["tokens"] = tokens[keep]
        records["source"] = i
        records["mask"] = mask[keep]
        self.records += len(records)
        if not self.bits:
            self._chunks.append(records)
            return
        part = (records["key"] >> np.uint64(64 - self.bits)).astype(np.uint16)
        order = np.argsort(part, kind="stable")  # a radix sort for 16-bit integers
        records, part = records[order], part[order]
        bounds = np.searchsorted(part, np.arange((1 << self.bits) + 1))
        for p in np.flatnonzero(np.diff(bounds)):
            self._files[p].write(records[bounds[p] : bounds[p + 1]].tobytes())

    def finish(self) -> Result:
        """Analyse everything added; removes the temporary files."""
        n = len(self.meta)
        acc = _Accumulator(n)
        acc.epochs = self.epochs
        try:
            if not self.bits:
                if self._chunks:
                    acc.partition(np.concatenate(self._chunks))
                self._chunks = []
            else:
                for stream in self._files:
                    stream.close()
                for p in range(1 << self.bits):
                    path = os.path.join(self._folder, f"{p:05d}.rec")
                    records = np.fromfile(path, _RECORD)
                    os.unlink(path)
                    if len(records):
                        acc.partition(records)
        finally:
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
        identical = {}
        for members in self.digests.values():
            members = [m for m in members if self.documents[m] > 0]
            for later in members[1:]:
                identical[later] = members[0]
        copies = {frozenset((a, b)) for a, b in identical.items()}
        pairs = {k: v for k, v in acc.pairs.items() if frozenset(k) not in copies}
        return Result(
            sources=self.meta,
            documents=self.documents,
            nonempty=self.nonempty,
            tokens=self.tokens,
            repeated_documents=acc.repeated_documents,
            repeated_tokens=acc.repeated_tokens,
            max_copies=acc.max_copies,
            shared_documents=acc.shared_documents,
            shared_tokens=acc.shared_tokens,
            pairs=pairs,
            identical=identical,
            unique_tokens=acc.unique_tokens,
            split_tokens=dict(self.split_tokens),
            split_documents=dict(self.split_documents),
            effective={
                split: acc.effective[_bit_index(split)]
                for split in {s for m in self.meta for s, *_ in m.splits}
            },
            overlap={name: acc.overlap[k] for k, name in ((1, "valid"), (2, "test"))},
            overlap_partner=acc.partner(),
            partitions=1 << self.bits,
            records=self.records,
        )


def _bit_index(split: str) -> int:
    return {"train": 0, "all": 0, "valid": 1, "test": 2}[split]


class _Accumulator:
    """Per-source and per-pair figures, summed over the partitions."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.repeated_documents = np.zeros(n, np.int64)
        self.repeated_tokens = np.zeros(n, np.int64)
        self.max_copies = np.zeros(n, np.int64)
        self.shared_documents = np.zeros(n, np.int64)
        self.shared_tokens = np.zeros(n, np.int64)
        self.pairs: dict[tuple[int, int], list[int]] = {}
        self.unique_tokens: dict[str, int] = defaultdict(int)
        self.effective = np.zeros((3, n), np.float64)
        self.overlap = np.zeros((3, n, 2), np.int64)
        self._partners: dict[tuple[int, int, int], int] = defaultdict(int)
        self.epochs: np.ndarray | None = None

    def partner(self) -> dict[tuple[str, int], int]:
        best: dict[tuple[str, int], tuple[int, int]] = {}
        for (k, source, other), count in self._partners.items():
            name = ("train", "valid", "test")[k]
            if (name, source) not in best or count > best[(name, source)][0]:
                best[(name, source)] = (count, other)
        return {key: other for key, (_, other) in best.items()}

    def partition(self, records: np.ndarray) -> None:
        """Add the figures of one partition (every copy of its fingerprints is in it).

        Most documents are there once: they are told apart with a plain sort of the
        fingerprints (no permutation), and only the others are grouped."""
        key = records["key"]
        ordered = np.sort(key)
        equal = ordered[1:] == ordered[:-1]
        if equal.any():
            # a table of the repeated fingerprints' low bits: a record whose slot is marked
            # goes to the grouping (a few that are there once do too; it counts them right)
            repeated = ordered[1:][equal]
            bits = min(26, max(16, len(repeated).bit_length() + 2))
            low = np.uint64((1 << bits) - 1)
            table = np.zeros(1 << bits, bool)
            table[(repeated & low).astype(np.int64)] = True
            many = table[(key & low).astype(np.int64)]
            del table, repeated
        else:
            many = np.zeros(len(key), bool)
        del ordered, equal
        if not many.all():
            self._singles(records[~many] if many.any() else records)
        if many.any():
            self._groups(records[many])

    def _singles(self, records: np.ndarray) -> None:
        """Documents whose fingerprint is nowhere else: each is its own group."""
        src = records["source"].astype(np.int64)
        tok = records["tokens"].astype(np.int64)
        mask = records["mask"]
        present = np.bincount(src, minlength=self.n) > 0
        np.maximum(self.max_copies, present.astype(np.int64), out=self.max_copies)
        for k, bit in enumerate((1, 2, 4)):
            member = (mask & bit) != 0
            if not member.any():
                continue
            self.unique_tokens[("train", "valid", "test")[k]] += int(tok[member].sum())
            if self.epochs is not None:
                drawn = np.bincount(src[member], minlength=self.n) > 0
                seen = np.where(drawn, self.epochs[:, k], 0.0)
                np.maximum(self.effective[k], seen, out=self.effective[k])
            if k:  # a source drawn in train and in this split: its own documents overlap
                hit = member & ((mask & 1) != 0)
                if hit.any():
                    np.add.at(self.overlap[k, :, 0], src[hit], 1)
                    np.add.at(self.overlap[k, :, 1], src[hit], tok[hit])
                    values, counts = np.unique(src[hit], return_counts=True)
                    for source, c in zip(values.tolist(), counts.tolist()):
                        self._partners[(k, source, source)] += c

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
                self._add_pairs(run_src[a], run_src[b], run_len[a], run_len[a] * run_tok[a])
        many = np.flatnonzero((runs_per_group > 2) & (runs_per_group <= PAIR_CAP))
        if len(many):
            starts = np.searchsorted(group_of_run, many)
            a_all, b_all, docs, toks = [], [], [], []
            for start, size in zip(starts.tolist(), runs_per_group[many].tolist()):
                idx = np.arange(start, start + size)
                a, b = np.meshgrid(idx, idx, indexing="ij")
                off = a != b
                a_all.append(a[off])
                b_all.append(b[off])
            a = np.concatenate(a_all)
            b = np.concatenate(b_all)
            docs = run_len[a]
            toks = run_len[a] * run_tok[a]
            self._add_pairs(run_src[a], run_src[b], docs, toks)

    def _add_pairs(self, a, b, docs, toks) -> None:
        codes = a * self.n + b
        values, inverse = np.unique(codes, return_inverse=True)
        doc_sum = np.bincount(inverse, weights=docs).astype(np.int64)
        tok_sum = np.bincount(inverse, weights=toks).astype(np.int64)
        for code, d, t in zip(values.tolist(), doc_sum.tolist(), tok_sum.tolist()):
            entry = self.pairs.setdefault((code // self.n, code % self.n), [0, 0])
            entry[0] += d
            entry[1] += t


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
