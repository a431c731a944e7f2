"""Duplicate data in a blend, from document fingerprints: sources that are copies of another,
documents repeated within a source or shared across sources, valid/test documents also in
train, the unique tokens each split trains on, and the repetition of the most-seen document.

Exact duplicates only: two documents are the same when their fingerprints (XXH3-64 of their
token bytes, docs/format.md 2.11) and token dtypes are; near-duplicates are not looked for.
Empty documents (no token) are left out: they all have the same fingerprint and no token to
repeat. The two figures that make problems of repeats (``repeated-documents``,
``shared-documents``) count only documents of at least ``Options.min_tokens`` tokens, and weigh
them by tokens: identical tiny documents (a one-token document two sources share by chance, a
"Thank you!" in many) are in every real corpus and are not what those problems are about.

:class:`Analysis` takes the sources one at a time (:meth:`Analysis.add`) and keeps of each
only per-source figures and the fingerprints of its non-empty documents (8 bytes each, in
memory or a temporary file). Most documents are there once: :meth:`Analysis.finish` tells
them apart by a sort of 32 bits of the fingerprints and counts them from the per-source
figures; only the documents found more than once get a record (their tokens and splits read
again, ``reload``) and are grouped. When the fingerprints of the whole blend would not fit in
``memory`` bytes they are analysed in ``2**k`` partitions by their top bits (a document's
copies all land in one): peak memory is then about ``memory`` plus per-source and per-pair
figures, whatever the blend's size. The fingerprints come from a repack's fingerprint file
or from reading a blend's tokens (:mod:`repack.doctor.documents`); the figures and the result
are in :mod:`repack.doctor.repeats`.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from repack.doctor.repeats import (
    DEFAULT_MIN_TOKENS,
    SPLIT_BITS,
    Accumulator,
    Result,
    SourceMeta,
    bit_index,
)
from repack.errors import SourceError

try:  # built from repack/read/_hashes.c where the install had a C compiler (setup.py)
    from repack.read._hashes import sort_u32 as _radix_sort
except ImportError:  # pragma: no cover - numpy's sort instead
    _radix_sort = None

__all__ = ["DEFAULT_MEMORY", "Analysis", "Options"]

#: Memory for the records of the documents at once; beyond it they are partitioned.
DEFAULT_MEMORY = 1 << 30
#: Bytes of memory per document of a partition while its 32-bit values are sorted (4), with
#: room for partitions fuller than the average.
_BYTES_PER_KEY = 8
#: Bytes per document when the fingerprints are kept in memory.
_BYTES_PER_DOCUMENT = 8
#: Bytes of memory per document found more than once while it is grouped (its record, a
#: sort permutation, the sorted copies and per-run arrays).
_BYTES_PER_CANDIDATE = 112
_RECORD = np.dtype([("key", "<u8"), ("tokens", "<u8"), ("source", "<u4"), ("mask", "u1")])
_LITTLE = sys.byteorder == "little"
#: Mixed into fingerprints so that equal bytes of two token dtypes are different documents.
_DTYPE_SALT = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class Options:
    """Thresholds of the duplicate problems (docs/doctor.md#duplicates).

    Attributes:
        max_repeated: ``repeated-documents`` when more than this share of a source's tokens
            are in copies of another of its documents (of ``min_tokens`` or more).
        max_shared: ``shared-documents`` when more than this share of a source's tokens are in
            documents (of ``min_tokens`` or more) also in one other source.
        max_overlap: ``split-overlap`` when more than this share of a source's valid or test
            documents are also in train (0: any).
        memory: Bytes for the documents' records at once; beyond, they are partitioned.
        min_tokens: The shortest document ``repeated-documents`` and ``shared-documents``
            count.
    """

    max_repeated: float = 0.01
    max_shared: float = 0.01
    max_overlap: float = 0.0
    memory: int = DEFAULT_MEMORY
    min_tokens: int = DEFAULT_MIN_TOKENS


Reload = Callable[[int], tuple[np.ndarray, np.ndarray]]
"""``reload(i)``: source ``i``'s tokens and first sequences, for :meth:`Analysis.finish`."""


def _sort_u32(values: np.ndarray, memory: int) -> None:
    """Sort the ``uint32`` array ``values`` in place: by the compiled radix sort when it was
    built and its scratch copy (4 more bytes a value: ``_BYTES_PER_KEY`` in all) fits in
    ``memory``, else by numpy. On the AMD Zen 4 CPU of docs/benchmarks.md numpy's AVX-512
    sort takes 0.40 s for 10^7 random values, the radix sort 0.07 s (numpy's AVX2 sort,
    where AVX-512 is missing or turned off, 0.06 s)."""
    if _radix_sort is not None and 2 * values.nbytes <= memory and len(values) > 1:
        _radix_sort(values, np.empty_like(values))
    else:
        values.sort()


class Analysis:
    """Accumulates the documents of the sources of a blend; :meth:`finish` analyses them."""

    def __init__(
        self,
        sources: Sequence[SourceMeta],
        total_documents: int,
        options: Options = Options(),
        *,
        stored: np.ndarray | None = None,
    ) -> None:
        """
        Args:
            sources: What the analysis needs of each source, by position.
            total_documents: The documents of all sources (for the memory plan).
            options: Thresholds and the memory bound.
            stored: An array the fingerprints given to :meth:`add` may be slices of (the
                mapped fingerprint file of a repack): those are read again from it when the
                analysis needs them a second time, not kept in memory or a temporary file.
        """
        self.meta = list(sources)
        self.options = options
        n = len(self.meta)
        self.documents = np.zeros(n, np.int64)
        self.nonempty = np.zeros(n, np.int64)
        self.long = np.zeros(n, np.int64)
        self.tokens = np.zeros(n, np.int64)
        self.digests: dict[tuple, list[int]] = defaultdict(list)
        self.split_tokens: dict[str, int] = defaultdict(int)
        self.split_documents: dict[tuple[str, int], int] = defaultdict(int)
        # per source and split bit (train, valid, test), over its non-empty documents: how
        # many are in the split, their tokens; and (valid, test) how many are in train too
        self.in_split = np.zeros((n, 3, 2), np.int64)
        self.with_train = np.zeros((n, 3, 2), np.int64)
        memory = max(1, options.memory)
        total = max(0, int(total_documents))
        bits = 0
        while (total >> bits) * _BYTES_PER_KEY > memory and bits < 16:
            bits += 1
        self.bits = bits
        self.chunk = int(min(1 << 22, max(256, memory // 64)))
        in_memory = total * (_BYTES_PER_DOCUMENT + _BYTES_PER_KEY) <= memory
        self._folder = None if in_memory else tempfile.mkdtemp(prefix="repack-duplicates-")
        try:
            self._keys = _Column(np.uint64, total, self._folder, "keys")
            # one partition: the 32 bits sorted are gathered as the documents come
            self._high_all = np.empty(total, np.uint32) if not bits else None
        except BaseException:
            self._cleanup()
            raise
        self._starts: list[int] = []  # where each added source's records start
        self._ids: list[int] = []
        self.records = 0
        self._stored = None if stored is None else np.asarray(stored)
        #: the records in order, in runs ``[first record, count, start, salt]``: from
        #: ``start`` in ``_stored`` (salted as add() did), or with no salt in ``_keys``
        self._runs: list[list] = []
        self.epochs = np.zeros((n, 3), np.float64)
        for i, meta in enumerate(self.meta):
            for split, _, _, epochs in meta.splits:
                self.epochs[i, bit_index(split)] += epochs

    def add(self, i: int, hashes: np.ndarray, tokens: np.ndarray, first: np.ndarray) -> None:
        """Add source ``i``'s documents: their fingerprints, tokens and first sequences.

        Only the fingerprints of its non-empty documents are kept (in memory or a temporary
        file) with per-source figures; the few documents found more than once get their
        tokens and splits from ``reload`` in :meth:`finish`."""
        meta = self.meta[i]
        hashes = np.asarray(hashes, dtype=np.uint64)
        tokens = np.asarray(tokens, dtype=np.int64)
        self.documents[i] = len(hashes)
        self.tokens[i] = int(tokens.sum())
        digest = xxhash.xxh3_64_intdigest(np.ascontiguousarray(hashes).view(np.uint8))
        self.digests[(meta.dtype_code, len(hashes), digest)].append(i)
        keep = tokens > 0
        nonempty = int(np.count_nonzero(keep))
        self.nonempty[i] = nonempty
        self.long[i] = int(np.count_nonzero(tokens >= max(1, self.options.min_tokens)))
        count = _Counter(tokens, keep if nonempty < len(keep) else None)
        slices: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for split, begin, end, _ in meta.splits:
            lo, hi = (int(x) for x in np.searchsorted(first, [begin, end], "left"))
            slices[bit_index(split)].append((lo, hi))
            documents, tokens_in = count([(lo, hi)])
            self.split_tokens[split] += tokens_in
            self.split_documents[(split, i)] += documents
        if not nonempty:
            return
        for k, ranges in slices.items():
            self.in_split[i, k] = count(ranges)
            if k and 0 in slices:
                both = [
                    (max(a, c), min(b, d))
                    for a, b in ranges
                    for c, d in slices[0]
                    if c < b and a < d
                ]
                self.with_train[i, k] = count(both)
        salt = np.uint64((meta.dtype_code * _DTYPE_SALT) & 0xFFFFFFFFFFFFFFFF)
        self._starts.append(self.records)
        self._ids.append(i)
        keys = (hashes[keep] if nonempty < len(hashes) else hashes) ^ salt
        at = self._stored_at(hashes) if nonempty == len(hashes) else None
        if at is None:  # kept: in memory or the temporary file
            at, salt = self._keys.size, None
            self._keys.append(keys)
        last = self._runs[-1] if self._runs else None
        if last is not None and (last[2] + last[1], last[3]) == (at, salt):
            last[1] += nonempty  # what follows the last run where it is: one run
        else:
            self._runs.append([self.records, nonempty, at, salt])
        if self._high_all is not None:
            self._high_all[self.records : self.records + nonempty] = self._high(keys)
        self.records += nonempty

    def finish(self, reload: Reload) -> Result:
        """Analyse everything added; removes the temporary files.

        Args:
            reload: ``reload(i)`` gives source ``i``'s tokens and first sequences again (as
                :meth:`add` had them), for its documents found more than once.
        """
        self._reload = reload
        n = len(self.meta)
        acc = Accumulator(n, self.options.min_tokens)
        acc.epochs = self.epochs
        try:
            self._keys.seal()
            for p in range(1 << self.bits):
                self._partition(p, acc)
        finally:
            self._cleanup()
        acc.singles(self.nonempty, self.in_split, self.with_train)
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
                split: acc.effective[bit_index(split)]
                for split in {s for m in self.meta for s, *_ in m.splits}
            },
            overlap={name: acc.overlap[k] for k, name in ((1, "valid"), (2, "test"))},
            overlap_partner=acc.partner(),
            partitions=1 << self.bits,
            records=self.records,
            min_tokens=self.options.min_tokens,
            long_documents=self.long,
            long_repeated_documents=acc.long_repeated_documents,
            long_repeated_tokens=acc.long_repeated_tokens,
            long_max_copies=acc.long_max_copies,
        )

    def close(self) -> None:
        """Give up: remove the temporary file (:meth:`finish` does it too)."""
        self._cleanup()

    def _cleanup(self) -> None:
        self._high_all = None
        if getattr(self, "_keys", None) is not None:
            self._keys.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def _stored_at(self, hashes: np.ndarray) -> int | None:
        """Where ``hashes`` starts in ``_stored``, if it is a slice of it."""
        stored = self._stored
        if stored is None or not isinstance(hashes, np.ndarray) or not len(hashes):
            return None
        if hashes.dtype != stored.dtype or hashes.strides != (stored.itemsize,):
            return None
        start = stored.__array_interface__["data"][0]
        delta = hashes.__array_interface__["data"][0] - start
        at, rest = divmod(delta, stored.itemsize)
        if rest or at < 0 or at + len(hashes) > len(stored):
            return None
        return at

    def _scan(self, p: int) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
        """``(offset, keys, where)`` of the records of partition ``p``, a chunk at a time:
        ``keys[where]`` (all of ``keys`` when ``where`` is None) are those in the partition,
        at ``offset + where`` in the records. ``keys`` may be overwritten by the next chunk."""
        shift = np.uint64(64 - self.bits) if self.bits else None
        buffer = None
        for first, count, at, salt in self._runs:
            for lo in range(0, count, self.chunk):
                hi = min(count, lo + self.chunk)
                if salt is None:
                    keys = self._keys.read(at + lo, at + hi)
                else:  # salted as add() did
                    if buffer is None:
                        buffer = np.empty(min(self.chunk, self.records), np.uint64)
                    keys = buffer[: hi - lo]
                    np.bitwise_xor(self._stored[at + lo : at + hi], salt, out=keys)
                if shift is None:
                    yield first + lo, keys, None
                else:
                    yield first + lo, keys, np.flatnonzero((keys >> shift) == np.uint64(p))

    def _high(self, keys: np.ndarray) -> np.ndarray:
        """The 32 bits of ``keys`` after the partition's bits."""
        if self.bits:
            return ((keys << np.uint64(self.bits)) >> np.uint64(32)).astype(np.uint32)
        if _LITTLE and keys.flags.c_contiguous:  # the high halves, as they are in memory
            return keys.view(np.uint32)[1::2]
        return (keys >> np.uint64(32)).astype(np.uint32)

    def _partition(self, p: int, acc: Accumulator) -> None:
        """Add the figures of the documents of partition ``p`` found more than once.

        Most documents are there once. They are told apart by a sort of 32 bits of their
        fingerprints (faster and half the memory of all 64): the values there more than once
        are those of every repeated document and of a few others (a 32-bit collision, about
        ``documents² / 2³³`` of them); a second reading of the fingerprints picks the
        documents with those values, and among them an exact comparison finds the repeated
        ones, which are grouped. Documents found once are counted from the per-source
        figures (:meth:`Accumulator.singles`)."""
        if not self.records:
            return
        if not self.bits:  # gathered by add()
            high, self._high_all = self._high_all[: self.records], None
        else:
            high = np.concatenate([self._high(keys[where]) for _, keys, where in self._scan(p)])
        _sort_u32(high, self.options.memory)
        # one entry per copy after the first of each value there more than once, in order
        copies = high[1:][high[1:] == high[:-1]]
        del high
        if not len(copies):
            return
        new_value = np.empty(len(copies), bool)
        new_value[0] = True
        np.not_equal(copies[1:], copies[:-1], out=new_value[1:])
        starts = np.flatnonzero(new_value)
        values = copies[starts]
        counts = np.diff(np.append(starts, len(copies))) + 1
        del copies, new_value, starts
        # the candidates of a slice of the values at once, within the memory bound
        limit = max(1, self.options.memory // _BYTES_PER_CANDIDATE)
        ends = np.cumsum(counts)
        lo = 0
        while lo < len(values):
            hi = int(np.searchsorted(ends, (ends[lo - 1] if lo else 0) + limit, "right"))
            hi = max(hi, lo + 1)
            self._candidates(p, values[lo:hi], acc)
            lo = hi

    def _candidates(self, p: int, values: np.ndarray, acc: Accumulator) -> None:
        """Group the documents of partition ``p`` whose 32 bits are among ``values``
        (sorted) and that are there more than once."""
        # a table of the values' high 22 bits (fewer for few values: 4 MiB, which the
        # cache holds; 16 MiB took three times as long to look up), then a bitmap of their
        # low 25 bits pick nearly only the documents with one of the values; the others
        # picked (about 1 % of the documents at 10^8) are there once, in the range of
        # ``values`` (so in no other call), and the exact comparison below drops them
        bits = min(22, max(10, len(values).bit_length() + 3))
        shift = np.uint32(32 - bits)
        high_table = np.zeros(1 << bits, bool)
        high_table[values >> shift] = True
        low = np.uint32((1 << min(25, bits + 3)) - 1)
        low_bits = _bitmap(values & low, int(low) + 1)
        least, most = values[0], values[-1]
        found_at, found_keys = [], []
        for offset, keys, where in self._scan(p):
            if where is not None:
                keys = keys[where]
            high = self._high(keys)
            hit = np.flatnonzero(np.take(high_table, high >> shift))
            picked = high[hit]
            hit = hit[_in_bitmap(low_bits, picked & low) & (picked >= least) & (picked <= most)]
            if len(hit):
                found_at.append(offset + (hit if where is None else where[hit]))
                found_keys.append(keys[hit])
        if not found_at:
            return
        at = np.concatenate(found_at)
        keys = np.concatenate(found_keys)
        ordered = np.sort(keys)
        same = ordered[1:] == ordered[:-1]
        repeated = np.unique(ordered[1:][same])
        del ordered, same
        chosen = np.zeros(len(keys), bool)
        if len(repeated):
            # most of the keys are there once: a table of 22 middle bits of the repeated ones
            # leaves few to look up (a binary search of every key took 80 ns each)
            middle = np.uint64(20)
            table = np.zeros(1 << 22, bool)
            table[(repeated >> middle) & np.uint64(0x3FFFFF)] = True
            maybe = np.flatnonzero(np.take(table, (keys >> middle) & np.uint64(0x3FFFFF)))
            slot = np.minimum(np.searchsorted(repeated, keys[maybe]), len(repeated) - 1)
            chosen[maybe] = repeated[slot] == keys[maybe]
        at, keys = at[chosen], keys[chosen]
        if not len(at):
            return
        starts = np.asarray(self._starts, np.int64)
        ids = np.asarray(self._ids, np.int64)
        which = np.searchsorted(starts, at, "right") - 1
        records = np.empty(len(at), _RECORD)
        records["key"] = keys
        for w in np.unique(which).tolist():
            rows = np.flatnonzero(which == w)
            i = int(ids[w])
            tokens, first = self._reload(i)
            tokens = np.asarray(tokens, np.int64)
            if len(tokens) != self.documents[i]:
                raise SourceError(f"{self.meta[i].key}: changed while it was read")
            document = np.flatnonzero(tokens > 0)[at[rows] - starts[w]]
            seq = np.asarray(first)[document]  # in a slice as add() saw it: by its first
            mask = np.zeros(len(rows), np.uint8)
            for split, begin, end, _ in self.meta[i].splits:
                mask[(seq >= begin) & (seq < end)] |= SPLIT_BITS[split]
            records["tokens"][rows] = tokens[document]
            records["mask"][rows] = mask
            records["source"][rows] = i
        acc.repeats(records)


def _bitmap(indices: np.ndarray, size: int) -> np.ndarray:
    """A bitmap of ``size`` bits with those at ``indices`` set."""
    table = np.zeros((size + 7) // 8, np.uint8)
    np.bitwise_or.at(table, indices >> 3, np.left_shift(1, indices & 7).astype(np.uint8))
    return table


def _in_bitmap(table: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Whether each of ``indices`` is set in the bitmap ``table``."""
    return ((np.take(table, indices >> 3) >> (indices & 7).astype(np.uint8)) & 1).view(bool)


class _Counter:
    """Non-empty documents of a source in the union of ranges ``[lo, hi)`` of them, and their
    tokens (``keep``: which are non-empty, None for all); each range summed once."""

    def __init__(self, tokens: np.ndarray, keep: np.ndarray | None) -> None:
        self.tokens, self.keep = tokens, keep
        self._done: dict[tuple[int, int], tuple[int, int]] = {}

    def __call__(self, ranges: list[tuple[int, int]]) -> tuple[int, int]:
        ranges = [(lo, hi) for lo, hi in ranges if hi > lo]
        if not ranges:
            return 0, 0
        if len(ranges) == 1:
            lo, hi = ranges[0]
            found = self._done.get((lo, hi))
            if found is None:
                kept = hi - lo if self.keep is None else int(np.count_nonzero(self.keep[lo:hi]))
                found = self._done[(lo, hi)] = (kept, int(self.tokens[lo:hi].sum()))
            return found
        member = np.zeros(len(self.tokens), bool)
        for lo, hi in ranges:
            member[lo:hi] = True
        kept = member if self.keep is None else member & self.keep
        return int(np.count_nonzero(kept)), int(self.tokens[member].sum())


class _Column:
    """One figure of every record, in the order added: in memory, or in a temporary file
    (written as it comes, read back a chunk at a time)."""

    def __init__(self, dtype, capacity: int, folder: str | None, name: str) -> None:
        self.dtype = np.dtype(dtype)
        self.size = 0
        self.path = None if folder is None else os.path.join(folder, name)
        if self.path is None:
            self.array = np.empty(capacity, self.dtype)  # pages are used as they are written
            self.stream = None
        else:
            self.array = None
            self.stream = open(self.path, "wb")

    def append(self, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, self.dtype)
        if self.stream is None:
            self.array[self.size : self.size + len(values)] = values
        else:
            self.stream.write(memoryview(values).cast("B"))
        self.size += len(values)

    def seal(self) -> None:
        """No more appends: the values can be read."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def read(self, start: int, stop: int) -> np.ndarray:
        if self.array is not None:
            return self.array[start:stop]
        return np.fromfile(self.path, self.dtype, stop - start, offset=start * self.dtype.itemsize)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        self.array = None
