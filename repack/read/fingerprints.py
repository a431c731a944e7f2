"""Document fingerprints: a 64-bit hash of every document's token bytes, kept in the repack.

A merge (and ``repack add``) computes them while it copies, from the very bytes it reads for
the copy (:class:`DocumentHasher` is fed like any other hasher), and stores them in one file,
``fingerprints.rpf`` (``fingerprints-N.rpf`` after an add or a remove), named by the manifest's
``fingerprints`` member. docs/format.md section 2.11 is the specification. The doctor finds
duplicates from them without reading a token (:mod:`repack.doctor.duplicates`).

A repack written without them (by repack 0.1.0, or by ``merge --no-fingerprints``) stays
readable and verifiable; :func:`load_fingerprints` then says why there are none.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from repack.checksum import digest_of, new_hasher
from repack.errors import ChecksumMismatch, ObjectMissing
from repack.fileio import hash_range
from repack.format import spec as fmt
from repack.format.xxh3 import xxh3_64_many
from repack.store.members import member_folder

try:  # built from repack/read/_hashes.c where the install had a C compiler (setup.py)
    from repack.read._hashes import xxh3_64_ranges as _native_ranges
except ImportError:  # pragma: no cover - the same values, computed in Python
    _native_ranges = None

__all__ = [
    "EMPTY",
    "NATIVE",
    "NO_FINGERPRINTS",
    "DocumentHasher",
    "Fingerprints",
    "FingerprintWriter",
    "Unusable",
    "document_bounds",
    "hash_documents",
    "load_fingerprints",
    "load_parts",
    "save_parts",
]

#: The fingerprint of an empty document (no token): the hash of no bytes.
EMPTY = xxhash.xxh3_64_intdigest(b"")

#: What is said of a repack without fingerprints.
NO_FINGERPRINTS = (
    "no fingerprints (written by repack 0.1.0, by `merge --no-fingerprints`, or added to a "
    "repack without them); `repack fingerprint OUT` adds them, `repack doctor --duplicates` "
    "reads its shards"
)


class Unusable(str):
    """Why a repack has no usable fingerprints: the message (the file, then the cause), with
    the file (``path``, None when the cause is the manifest's member) and the cause apart, so
    that a report naming the file apart (``repack verify``) needs not parse the message."""

    path: str | None
    cause: str

    def __new__(cls, cause: str, path: str | None = None) -> Unusable:
        self = super().__new__(cls, cause if path is None else f"{path}: {cause}")
        self.path, self.cause = path, cause
        return self


#: Whether documents are hashed by the compiled loop (``repack.read._hashes``): many in one call,
#: without the GIL, about the cost of their bytes. Without it, one ``xxh3_64_intdigest``
#: call a document (some 0.2-0.3 us each), short ones as numpy arrays: the same values.
NATIVE = _native_ranges is not None

_intdigest = xxhash.xxh3_64_intdigest
#: The array hash pays off for documents of up to this many bytes, and only when at least
#: ``_MANY`` of them end in one piece of bytes: a call costs some 50 us whatever its size,
#: and past 32 bytes one xxhash call a document (about 0.2 us) is cheaper than the arrays
#: (docs/benchmarks.md, "With document fingerprints").
_ARRAY_LENGTH = 32
_MANY = 1024


def _hash_many(view, starts: np.ndarray, ends: np.ndarray, out: np.ndarray, where) -> None:
    """``out[where] =`` the XXH3-64 of each ``view[starts[j] : ends[j]]``: all in one call of
    the compiled loop where it was built, else the very short ones in a few array operations
    (:mod:`repack.format.xxh3`) when there are many, the others one call each."""
    if _native_ranges is not None:
        hashes = np.empty(len(starts), dtype=np.uint64)
        _native_ranges(
            view,
            np.ascontiguousarray(starts, dtype=np.int64),
            np.ascontiguousarray(ends, dtype=np.int64),
            hashes,
        )
        out[where] = hashes
        return
    lengths = ends - starts
    if len(lengths) >= _MANY:
        short = lengths <= _ARRAY_LENGTH
        if short.all():
            out[where] = xxh3_64_many(np.frombuffer(view, np.uint8), starts, lengths)
            return
        if np.count_nonzero(short) >= _MANY:
            pick = np.flatnonzero(short)
            out[where[pick]] = xxh3_64_many(
                np.frombuffer(view, np.uint8), starts[pick], lengths[pick]
            )
            keep = ~short
            starts, ends, where = starts[keep], ends[keep], where[keep]
    out[where] = np.fromiter(
        (_intdigest(view[a:b]) for a, b in zip(starts.tolist(), ends.tolist())),
        np.uint64,
        len(starts),
    )


def document_bounds(pointers: np.ndarray, documents: np.ndarray, bin_size: int) -> np.ndarray:
    """Byte offset in the source ``.bin`` of every document boundary (``documents`` values):
    document ``j`` is bytes ``[b[j], b[j + 1])``."""
    starts = np.empty(len(pointers) + 1, dtype=np.int64)
    starts[:-1] = pointers
    starts[-1] = bin_size
    return starts[np.asarray(documents, dtype=np.int64)]


class DocumentHasher:
    """Hashes the documents of one piece ``[start, end)`` of a source ``.bin``, fed its bytes
    in order (``update``), like the checksum hashers a copy feeds.

    The piece *owns* the documents that start in it (and, for the piece that ends the
    source, the empty documents at its very end), so that every document of a source cut into
    pieces is hashed by exactly one of them. A document that goes on past ``end`` is finished
    by :meth:`finish` from the source itself (only its own bytes after ``end`` are read).
    """

    def __init__(self, bounds: np.ndarray, start: int, end: int, last: bool) -> None:
        begins = bounds[:-1]
        first = int(np.searchsorted(begins, start, "left"))
        stop = int(np.searchsorted(begins, end, "right" if last else "left"))
        self.first = first
        self.hashes = np.full(stop - first, EMPTY, dtype=np.uint64)
        lo = begins[first:stop] - start
        hi = bounds[first + 1 : stop + 1] - start
        nonempty = np.flatnonzero(hi > lo)
        # numpy arrays, not lists: a segment may own tens of millions of documents
        self._where = nonempty
        self._starts = np.ascontiguousarray(lo[nonempty])
        self._ends = np.ascontiguousarray(hi[nonempty])
        self._done = 0  # documents hashed, in order
        self._open: xxhash.xxh3_64 | None = None
        self._fed = 0
        self._size = end - start
        self._start = start

    def update(self, data: bytes | memoryview) -> None:
        """Feed the next bytes of the piece."""
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        lo = self._fed
        hi = lo + len(view)
        self._fed = hi
        k = self._done
        if self._open is not None:
            end = int(self._ends[k])
            self._open.update(view[: min(end, hi) - lo])
            if end > hi:
                return
            self.hashes[self._where[k]] = self._open.intdigest()
            self._open = None
            k += 1
        done = int(np.searchsorted(self._ends, hi, "right"))
        if done > k:
            starts, ends = self._starts[k:done] - lo, self._ends[k:done] - lo
            _hash_many(view, starts, ends, self.hashes, self._where[k:done])
        self._done = done
        if done < len(self._starts) and self._starts[done] < hi:
            self._open = xxhash.xxh3_64()
            self._open.update(view[int(self._starts[done]) - lo :])

    def hexdigest(self) -> str:  # the Hasher protocol; never stored
        return ""

    @property
    def needs_rest(self) -> bool:
        """Whether a document goes on past the piece (:meth:`finish` then needs the
        source)."""
        return self._open is not None

    def finish(self, source=None) -> tuple[int, np.ndarray]:
        """Finish the document that goes on past the piece (reading its rest from
        ``source``, a read handle of the source ``.bin``: see
        :func:`~repack.store.prefixes.open_bin`) and return (first document owned, hashes)."""
        if self._open is not None:
            k = self._done
            rest = int(self._ends[k]) - self._size
            if source is None:
                raise ValueError("a document goes on past the piece: its source is needed")
            for chunk in source.scan(self._start + self._size, rest):
                self._open.update(chunk)
            self.hashes[self._where[k]] = self._open.intdigest()
            self._open = None
            self._done = k + 1
        if self._done != len(self._starts):
            raise ValueError(
                f"fed {self._fed} of {self._size} bytes: {self._done} of "
                f"{len(self._starts)} documents hashed"
            )
        return self.first, self.hashes


def hash_documents(
    chunks: Iterable[bytes | memoryview], bounds: np.ndarray, size: int
) -> np.ndarray:
    """The fingerprints of every document of a whole source, from its ``.bin`` bytes given in
    order (``size`` bytes in all)."""
    hasher = DocumentHasher(bounds, 0, size, True)
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.finish()[1]


# --- per-shard parts, in the work folder --------------------------------------------------


def part_keys(number: int) -> tuple[str, str]:
    """The keys of the two files of shard ``number``'s parts in a store (table, data)."""
    stem = f"{fmt.WORK_DIR}/fingerprints-{number:05d}"
    return stem + ".json", stem + ".u64"


def _part_paths(folder: str, number: int) -> tuple[str, str]:
    """Where a local folder holding a store's files (:meth:`~repack.store.Store.fetched`)
    has them."""
    return tuple(os.path.join(folder, *key.split("/")) for key in part_keys(number))


def save_parts(store, number: int, parts: Sequence[tuple[int, int, np.ndarray]]) -> None:
    """Save the fingerprints one shard's task computed: ``(source, first document, hashes)``
    per segment, in the work folder of ``store``. Written before the shard's receipt, so a
    receipt means they are there; the table after the data, so a table means both are."""
    table, data = part_keys(number)
    entries = []
    offset = 0
    for source, first, hashes in parts:
        entries.append([source, first, len(hashes), offset])
        offset += 8 * len(hashes)
    arrays = [np.asarray(hashes, dtype="<u8") for _, _, hashes in parts]
    blob = np.concatenate(arrays) if arrays else np.zeros(0, dtype="<u8")
    store.put(data, blob.view(np.uint8))  # one copy of the hashes, not three
    store.put(table, json.dumps(entries).encode())


def load_parts(folder: str, number: int) -> list[tuple[int, int, np.ndarray]] | None:
    """The parts :func:`save_parts` saved for shard ``number``, or None if there are none,
    from ``folder``, a local folder holding the store's files."""
    table, data = _part_paths(folder, number)
    try:
        with open(table, "rb") as stream:
            entries = json.loads(stream.read())
    except FileNotFoundError:
        return None
    if not os.path.exists(data):
        return None
    total = sum(count for _, _, count, _ in entries)
    blob = np.memmap(data, "<u8", "r") if total else np.zeros(0, dtype="<u8")
    return [
        (source, first, blob[offset // 8 : offset // 8 + count])
        for source, first, count, offset in entries
    ]


# --- the fingerprint file --------------------------------------------------------------------


class FingerprintWriter:
    """Writes the fingerprint file ``name`` as the new file ``path`` (a store's staged file:
    :meth:`~repack.store.Store.staged` publishes it), the hashes of each source in source
    order; :meth:`commit` checks the count, fsyncs and returns the manifest member."""

    def __init__(self, path: str, name: str, algorithm: str, counts: Sequence[int]) -> None:
        self.path, self.name, self.algorithm = path, name, algorithm
        self.total = int(sum(counts))
        self.sources = len(counts)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._hasher = new_hasher(algorithm)
        self._written = 0
        self._write(fmt.pack_fingerprint_header(self.sources, self.total))

    def _write(self, data: bytes | memoryview) -> None:
        self._hasher.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def write(self, hashes: np.ndarray) -> None:
        """Append the next hashes."""
        self._written += len(hashes)
        if self._written > self.total:
            raise ValueError(f"{self.name}: more than the {self.total} documents planned")
        self._write(memoryview(np.ascontiguousarray(hashes, dtype="<u8")).cast("B"))

    def commit(self) -> dict:
        """Finish the file; the manifest's ``fingerprints`` member."""
        try:
            if self._written != self.total:
                raise ValueError(f"{self.name}: {self._written} of {self.total} documents written")
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
        return {
            "file": self.name,
            "hash": fmt.FINGERPRINT_HASH,
            "size": fmt.fingerprint_file_size(self.total),
            "checksum": digest_of(self._hasher, self.algorithm),
            "sources": self.sources,
            "documents": self.total,
        }

    def abort(self) -> None:
        """Close the file (the store drops what it staged)."""
        try:
            os.close(self._fd)
        except OSError:
            pass


@dataclass(frozen=True)
class Fingerprints:
    """The fingerprints of an open repack: ``of(k)`` gives source ``k``'s, in document
    order (a view of the mapped file)."""

    file: str
    hashes: np.ndarray
    #: where each source's documents start in ``hashes``, and the total at the end
    starts: np.ndarray

    def of(self, source: int) -> np.ndarray:
        """The fingerprints of source ``source`` (its id), in document order."""
        return self.hashes[self.starts[source] : self.starts[source + 1]]


def member_of(manifest) -> dict | None:
    """The manifest's ``fingerprints`` member, or None."""
    member = manifest.raw.get(fmt.FINGERPRINT_MEMBER)
    return member if isinstance(member, dict) else None


def expected_counts(manifest) -> list[int]:
    """Fingerprints per source: its documents (``document_count - 1``)."""
    return [source.document_count - 1 for source in manifest.sources]


def check_member(folder: str, manifest) -> Unusable | None:
    """Why the manifest's ``fingerprints`` member cannot be used, or None if it can (file
    name, counts, hash); the file itself is checked by :func:`load_fingerprints`."""
    member = member_of(manifest)
    if member is None:
        return Unusable(NO_FINGERPRINTS)
    name = member.get("file")
    if not isinstance(name, str) or not fmt.is_fingerprint_name(name):
        return Unusable(
            f"fingerprints.file is {name!r}, expected fingerprints.rpf or fingerprints-N.rpf"
        )
    if member.get("hash") != fmt.FINGERPRINT_HASH:
        return Unusable(f"fingerprints.hash is {member.get('hash')!r}; this release knows xxh3-64")
    counts = expected_counts(manifest)
    if member.get("documents") != sum(counts) or member.get("sources") != len(counts):
        return Unusable(
            f"stale: holds {member.get('documents')!r} documents of "
            f"{member.get('sources')!r} sources, the repack {sum(counts)} of {len(counts)} "
            "(changed by a release that does not keep fingerprints)",
            name,
        )
    if member.get("size") != fmt.fingerprint_file_size(sum(counts)):
        return Unusable(
            f"fingerprints.size is {member.get('size')!r}, which disagrees with its counts"
        )
    return None


def load_fingerprints(folder: str | os.PathLike, manifest) -> Fingerprints | Unusable:
    """Map the fingerprint file of the repack ``folder``; or why it has none usable (no
    member, a stale member, a file missing, damaged, of the wrong size or header).
    Checksums are not checked here (``repack verify`` does).

    Raises:
        StoreError: object storage cannot be read (credentials, network, a missing bucket):
            nothing is known of the file then, and a report must not say it has none.
    """
    folder = os.fspath(folder)
    why = check_member(folder, manifest)
    if why is not None:
        return why
    member = member_of(manifest)
    try:  # on object storage: its checked copy in the node cache
        folder = member_folder(os.fspath(folder), manifest, member)
    except (ObjectMissing, ChecksumMismatch) as err:
        return Unusable(err.cause, err.path)
    path = os.path.join(folder, member["file"])
    counts = expected_counts(manifest)
    total = sum(counts)
    try:
        size = os.stat(path).st_size
    except OSError as err:
        return Unusable(f"cannot read: {err.strerror}", path)
    if size != member["size"]:
        return Unusable(f"{size} bytes, expected {member['size']}", path)
    with open(path, "rb") as stream:
        header = stream.read(fmt.FINGERPRINT_HEADER_SIZE)
    magic, version, flags, sources, documents = fmt.unpack_fingerprint_header(header)
    if magic != fmt.FINGERPRINT_MAGIC:
        return Unusable(f"bad magic {magic!r}", path)
    if version != fmt.FINGERPRINT_VERSION or flags != 0:
        return Unusable(
            f"version {version} flags {flags}; this release reads version 1, flags 0", path
        )
    if sources != len(counts) or documents != total:
        return Unusable(
            f"header counts {sources} sources, {documents} documents; expected "
            f"{len(counts)}, {total}",
            path,
        )
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    if total:
        hashes = np.memmap(path, "<u8", "r", fmt.FINGERPRINT_HEADER_SIZE, (total,))
    else:
        hashes = np.zeros(0, dtype="<u8")
    return Fingerprints(member["file"], hashes, starts)


def check_file(folder: str | os.PathLike, manifest) -> str:
    """Recompute the checksum of the repack's fingerprint file (it must have one).

    Returns:
        The checksum computed.

    Raises:
        ChecksumMismatch: it is not the one the manifest records.
    """
    from repack.errors import ChecksumMismatch

    member = member_of(manifest)
    # on object storage: its copy in the node cache, checked when fetched
    folder = member_folder(os.fspath(folder), manifest, member)
    path = os.path.join(folder, member["file"])
    hasher = new_hasher(manifest.algorithm)
    fd = os.open(path, os.O_RDONLY)
    try:
        hash_range(fd, 0, os.fstat(fd).st_size, [hasher])
    finally:
        os.close(fd)
    computed = digest_of(hasher, manifest.algorithm)
    if computed != member.get("checksum"):
        raise ChecksumMismatch(
            f"{path}: stored checksum {member.get('checksum')}, computed {computed}; "
            f"`repack fingerprint {os.fspath(folder)}` writes them anew"
        )
    return computed


def iter_chunks(fd: int, offset: int, size: int, step: int = 1 << 20) -> Iterator[bytes]:
    """The bytes ``[offset, offset + size)`` of ``fd``, ``step`` at a time."""
    end = offset + size
    while offset < end:
        data = os.pread(fd, min(step, end - offset), offset)
        if not data:
            raise OSError(f"short read at offset {offset}")
        yield data
        offset += len(data)


def hash_stored_source(repack, entry, advance=None) -> np.ndarray:
    """The fingerprints of the source ``entry`` of the open repack ``repack``, read from its
    shards (decompressed if need be); ``advance`` is fed the bytes read."""
    _, pointers, documents, _ = repack.source_arrays(entry)
    bounds = document_bounds(pointers, documents, entry.bin_size)
    hasher = DocumentHasher(bounds, 0, entry.bin_size, True)
    step = 1 << 20
    for seg in entry.segments:
        for start in range(0, seg.size, step):
            n = min(step, seg.size - start)
            hasher.update(repack.read_bytes(seg.shard, seg.offset + start, n))
            if advance is not None:
                advance(n)
    return hasher.finish()[1]


def hash_range_documents(fd: int, offset: int, bounds: np.ndarray, size: int) -> np.ndarray:
    """The fingerprints of a source whose ``size`` bytes are at ``offset`` of ``fd``."""
    hasher = DocumentHasher(bounds, 0, size, True)
    hash_range(fd, offset, size, [hasher])
    return hasher.finish()[1]
