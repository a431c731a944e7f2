"""The documents of a blend's sources for the duplicate analysis: fingerprints, tokens and
first sequences, from a repack's fingerprint file (no token read) or, for a plain blend (or a
repack without fingerprints) with ``--duplicates``, by reading every source's tokens.

Sources are read in ``workers`` threads (``pread`` and xxhash release the GIL), each through
1 MiB reads; they are handed to the analysis one at a time, in blend order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from repack import interrupt
from repack.errors import ShortRead, SourceError
from repack.format import spec as fmt
from repack.inputs.facts import Loaded, Source
from repack.read.fingerprints import (
    DocumentHasher,
    hash_stored_source,
    load_fingerprints,
)
from repack.store.prefixes import open_bin, open_idx

__all__ = ["DEFAULT_READERS", "fingerprint_status", "iter_documents", "reloader"]

#: Sources read at once by ``--duplicates``.
DEFAULT_READERS = 4
_READ = 1 << 20

Documents = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(fingerprints, tokens, first sequence) of each document of a source."""


def fingerprint_status(loaded: Loaded):
    """The repack's fingerprints (:class:`~repack.read.fingerprints.Fingerprints`), or why there
    are none (a string); None for a plain blend."""
    if loaded.repack is None:
        return None
    return load_fingerprints(loaded.repack, loaded.open_repack().manifest)


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
    fingerprints=None,
) -> Iterator[tuple[int, Documents]]:
    """``(position, documents)`` of each of ``sources`` (readable ones), in order.

    From the repack's fingerprint file when it has one (slices of ``fingerprints.hashes``,
    when given what :func:`fingerprint_status` gave); else, with ``read_tokens``, hashed
    from the tokens (the ``.bin`` files, or the repack's shards); else nothing is yielded.
    ``advance`` is fed bytes read (tokens) or documents (fingerprints).
    """
    advance = advance or (lambda n: None)
    if loaded.repack is not None:
        repack = loaded.open_repack()
        manifest = repack.manifest
        found = fingerprints or load_fingerprints(loaded.repack, manifest)
        entries = [_entry(manifest, s) for s in sources]
        if not isinstance(found, str):
            for i, (source, entry) in enumerate(zip(sources, entries)):
                documents = repack.source_arrays(entry)[2]
                hashes = found.of(entry.id)
                yield i, (hashes, _tokens(source.facts.cumulative(), documents), documents[:-1])
                advance(len(hashes))
            return
        if not read_tokens:
            return

        def job(i: int) -> Documents:
            entry = entries[i]
            documents = repack.source_arrays(entry)[2]
            hashes = hash_stored_source(repack, entry, advance)
            return hashes, _tokens(sources[i].facts.cumulative(), documents), documents[:-1]

    else:
        if not read_tokens:
            return

        def job(i: int) -> Documents:
            source = sources[i]
            documents = _document_indices(source)
            size = source.info.bin_size
            # the pointers were checked to follow the lengths when the blend was loaded
            itemsize = fmt.dtype_from_code(source.info.dtype_code).itemsize
            cumulative = source.facts.cumulative()
            bounds = cumulative[documents] * itemsize
            hasher = DocumentHasher(bounds, 0, size, True)
            with open_bin(source.info, "since the blend was read") as handle:
                for view in handle.scan(0, size):  # (read ahead on object storage)
                    hasher.update(view)
                    advance(len(view))
            tokens = _tokens(cumulative, documents)
            return hasher.finish()[1], tokens, documents[:-1]

    # bounded: at most 2 x readers sources read ahead of the one handed on
    with ThreadPoolExecutor(max(1, readers), thread_name_prefix="repack-duplicates") as pool:
        pending = []
        nxt = 0
        for i in range(len(sources)):
            while nxt < len(sources) and nxt < i + 2 * max(1, readers):
                pending.append(pool.submit(job, nxt))
                nxt += 1
            yield i, interrupt.result_of(pending.pop(0))


def reloader(loaded: Loaded, sources: list[Source]) -> Callable[[int], tuple]:
    """``reload(i)``: the tokens and first sequences of each document of ``sources[i]`` (as
    :func:`iter_documents` gave them), from the repack's index or the source's ``.idx``."""
    if loaded.repack is not None:
        repack = loaded.open_repack()
        manifest = repack.manifest

        def reload(i: int) -> tuple[np.ndarray, np.ndarray]:
            documents = repack.source_arrays(_entry(manifest, sources[i]))[2]
            return _tokens(sources[i].facts.cumulative(), documents), documents[:-1]

    else:

        def reload(i: int) -> tuple[np.ndarray, np.ndarray]:
            documents = _document_indices(sources[i])
            return _tokens(sources[i].facts.cumulative(), documents), documents[:-1]

    return reload


def _document_indices(source: Source) -> np.ndarray:
    """The document indices of a source of a plain blend, read alone from its ``.idx`` (the
    rest of it was read and checked when the blend was loaded; checked again here: its size
    and the indices' ends and order): one read of a local file, one ranged GET of an
    object."""
    info = source.info
    changed = f"{source.key}.idx: changed since the blend was read"
    offset = fmt.MEGATRON_HEADER_SIZE + 12 * info.sequence_count
    with open_idx(info) as handle:
        if handle.size != info.idx_size:
            raise SourceError(changed)
        try:
            data = handle.read(offset, 8 * info.document_count)
        except ShortRead:
            raise SourceError(changed) from None
    documents = np.frombuffer(data, "<i8")
    if (
        len(documents) != info.document_count
        or documents[0] != 0
        or documents[-1] != info.sequence_count
        or (len(documents) > 1 and np.diff(documents).min() < 0)
    ):
        raise SourceError(changed)
    return documents.astype(np.int64, copy=False)


def _entry(manifest, source: Source):
    if source.identity is not None and source.identity[0] == -1:
        return manifest.sources[source.identity[1]]
    return manifest.find_source(source.key)
