"""The documents of a blend's sources for the duplicate analysis: fingerprints, tokens and
first sequences, from a repack's fingerprint file (no token read) or, for a plain blend (or a
repack without fingerprints) with ``--duplicates``, by reading every source's tokens.

Sources are read in ``workers`` threads (``pread`` and xxhash release the GIL), each through
1 MiB reads; they are handed to the analysis one at a time, in blend order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from repack.doctor.inputs import Loaded, Source
from repack.errors import SourceError
from repack.fingerprints import (
    DocumentHasher,
    document_bounds,
    hash_stored_source,
    load_fingerprints,
)
from repack.source_data import bin_chunks, is_remote
from repack.sources import read_source_index

__all__ = ["DEFAULT_READERS", "fingerprint_status", "iter_documents"]

#: Sources read at once by ``--duplicates``.
DEFAULT_READERS = 4
_READ = 1 << 20

Documents = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(fingerprints, tokens, first sequence) of each document of a source."""


def fingerprint_status(loaded: Loaded):
    """The repack's fingerprints (:class:`~repack.fingerprints.Fingerprints`), or why there
    are none (a string); None for a plain blend."""
    if loaded.repack is None:
        return None
    from repack.reader import Repack

    repack = Repack(loaded.repack)
    return load_fingerprints(loaded.repack, repack.manifest)


def _tokens(lengths_cumulative: np.ndarray, documents: np.ndarray) -> np.ndarray:
    ends = lengths_cumulative[np.asarray(documents, dtype=np.int64)]
    return np.diff(ends)


def iter_documents(
    loaded: Loaded,
    sources: list[Source],
    *,
    read_tokens: bool,
    readers: int = DEFAULT_READERS,
    advance: Callable[[int], object] | None = None,
) -> Iterator[tuple[int, Documents]]:
    """``(position, documents)`` of each of ``sources`` (readable ones), in order.

    From the repack's fingerprint file when it has one; else, with ``read_tokens``, hashed
    from the tokens (the ``.bin`` files, or the repack's shards); else nothing is yielded.
    ``advance`` is fed bytes read (tokens) or documents (fingerprints).
    """
    advance = advance or (lambda n: None)
    if loaded.repack is not None:
        from repack.reader import Repack

        repack = Repack(loaded.repack)
        manifest = repack.manifest
        found = load_fingerprints(loaded.repack, manifest)
        entries = [_entry(manifest, s) for s in sources]
        if not isinstance(found, str):
            for i, (source, entry) in enumerate(zip(sources, entries)):
                documents = repack.source_arrays(entry)[2]
                hashes = found.of(entry.id)
                yield i, (hashes, _tokens(source.facts.cumulative, documents), documents[:-1])
                advance(len(hashes))
            return
        if not read_tokens:
            return

        def job(i: int) -> Documents:
            entry = entries[i]
            documents = repack.source_arrays(entry)[2]
            hashes = hash_stored_source(repack, entry, advance)
            return hashes, _tokens(sources[i].facts.cumulative, documents), documents[:-1]

    else:
        if not read_tokens:
            return

        def job(i: int) -> Documents:
            source = sources[i]
            index = read_source_index(source.key)
            bounds = document_bounds(index.pointers, index.documents, index.info.bin_size)
            size = index.info.bin_size
            hasher = DocumentHasher(bounds, 0, size, True)
            if is_remote(source.key):  # on object storage: ranged GETs, fetched ahead
                for data in bin_chunks(index.info, 0, size):
                    hasher.update(data)
                    advance(len(data))
                tokens = _tokens(source.facts.cumulative, index.documents)
                return hasher.finish()[1], tokens, index.documents[:-1]
            try:
                fd = os.open(source.key + ".bin", os.O_RDONLY)
            except OSError as err:
                raise SourceError(f"{source.key}.bin: cannot read: {err.strerror}") from None
            try:
                offset = 0
                while offset < size:
                    data = os.pread(fd, min(_READ, size - offset), offset)
                    if not data:
                        raise SourceError(f"{source.key}.bin: shorter than its index says")
                    hasher.update(data)
                    offset += len(data)
                    advance(len(data))
            finally:
                os.close(fd)
            tokens = _tokens(source.facts.cumulative, index.documents)
            return hasher.finish()[1], tokens, index.documents[:-1]

    # bounded: at most 2 x readers sources read ahead of the one handed on
    with ThreadPoolExecutor(max(1, readers), thread_name_prefix="repack-duplicates") as pool:
        pending = []
        nxt = 0
        for i in range(len(sources)):
            while nxt < len(sources) and nxt < i + 2 * max(1, readers):
                pending.append(pool.submit(job, nxt))
                nxt += 1
            yield i, pending.pop(0).result()


def _entry(manifest, source: Source):
    if source.identity is not None and source.identity[0] == -1:
        return manifest.sources[source.identity[1]]
    return manifest.find_source(source.key)
