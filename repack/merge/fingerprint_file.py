"""The fingerprint file of new sources, assembled from what each shard's task saved (a
merge's finalize step, ``repack add``), after the fingerprints carried over from the repack's
current file (``add``, ``remove``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

import numpy as np

from repack.errors import ChecksumMismatch, SourceError
from repack.format import spec as fmt
from repack.format.manifest import Manifest
from repack.merge.commit import next_generation
from repack.merge.edit import edit
from repack.merge.prepare import Prepared
from repack.merge.shards import finish_documents, segment_documents
from repack.progress import Progress, no_progress
from repack.read.fingerprints import (
    Fingerprints,
    FingerprintWriter,
    check_file,
    check_member,
    load_fingerprints,
    load_parts,
    part_keys,
)
from repack.store import Store
from repack.store.prefixes import open_bin

__all__ = [
    "assemble",
    "carry",
    "fingerprint",
    "with_member",
]


def assemble(
    store: Store,
    name: str,
    prepared: Prepared | None,
    *,
    algorithm: str | None = None,
    carried: tuple[Fingerprints, Sequence[int]] | None = None,
) -> dict:
    """Write the fingerprint file ``name`` into ``store``: first those of the sources
    ``carried`` over (an open file's, by source id), then those of the new sources of
    ``prepared``, from the parts the tasks saved in the work folder (a shard without them,
    copied by a release that did not compute them, is hashed from its sources now).

    Returns:
        The manifest's ``fingerprints`` member.
    """
    old, ids = carried if carried is not None else (None, ())
    new = prepared.sources if prepared is not None else ()
    counts = [int(old.starts[i + 1] - old.starts[i]) for i in ids]
    counts += [info.document_count - 1 for info in new]
    algorithm = algorithm or prepared.algorithm
    shards = prepared.plan.shards if prepared is not None else ()
    keys = [key for shard in shards for key in part_keys(shard.number)]
    with store.fetched(keys) as folder, store.staged(name) as path:
        writer = FingerprintWriter(path, name, algorithm, counts)
        try:
            for i in ids:
                writer.write(old.of(i))
            if prepared is not None:
                for hashes in _new_sources(folder, prepared):
                    writer.write(hashes)
            return writer.commit()
        except BaseException:
            writer.abort()
            raise


def _new_sources(folder: str, prepared: Prepared):
    """The fingerprints of each new source, in order (the parts read from ``folder``)."""
    pieces: list[list[tuple[int, np.ndarray]]] = [[] for _ in prepared.sources]
    for shard in prepared.plan.shards:
        parts = load_parts(folder, shard.number)
        if parts is None:
            parts = _hash_from_sources(prepared, shard)
        for source, first, hashes in parts:
            pieces[source].append((first, hashes))
    for k, info in enumerate(prepared.sources):
        expected = 0
        for first, hashes in sorted(pieces[k], key=lambda p: p[0]):
            if first != expected:
                raise SourceError(f"{info.path}: fingerprints of documents {expected}.. missing")
            expected += len(hashes)
            yield hashes
        if expected != info.document_count - 1:
            raise SourceError(
                f"{info.path}: fingerprints of {expected} of {info.document_count - 1} documents"
            )


def _hash_from_sources(prepared: Prepared, shard) -> list[tuple[int, int, np.ndarray]]:
    """The parts of a shard whose task saved none: its segments' documents, read from the
    sources."""
    documents = []
    for seg in shard.segments:
        hasher = segment_documents(prepared, seg)
        with open_bin(prepared.sources[seg.source]) as source:
            for view in source.scan(seg.source_offset, seg.size):
                hasher.update(view)
        documents.append((seg.source, hasher))
    return finish_documents(prepared, documents)


def carry(
    store: Store,
    manifest: Manifest,
    ids: Sequence[int],
    prepared: Prepared | None = None,
    *,
    taken: Iterable[str] = (),
) -> dict | None:
    """The fingerprint file of a repack changed by ``add`` or ``remove``: the current one's
    fingerprints of the sources ``ids``, then those of the new sources of ``prepared``,
    written as ``fingerprints-N.rpf`` (N the next index generation, after the files in
    ``taken``) into ``store`` (on
    object storage the current file is read from the node-local cache,
    :func:`~repack.read.fingerprints.load_fingerprints`). None when the repack has none to carry
    (written without them): the new repack then has none either.

    Raises:
        ChecksumMismatch: the current fingerprint file does not have its checksum, or is
            missing or damaged otherwise (:func:`_current`).
    """
    found = _current(store.location, manifest)
    if found is None:
        return None
    check_file(store.location, manifest)
    name = fmt.fingerprint_name(next_generation(manifest, taken))
    return assemble(store, name, prepared, algorithm=manifest.algorithm, carried=(found, ids))


def with_member(manifest: Manifest, member: dict | None) -> Manifest:
    """``manifest`` with the ``fingerprints`` member ``member`` (none if None)."""
    raw = {k: v for k, v in manifest.raw.items() if k != fmt.FINGERPRINT_MEMBER}
    if member is not None:
        raw[fmt.FINGERPRINT_MEMBER] = member
    return dataclasses.replace(manifest, raw=raw)


def has_fingerprints(out: str, manifest: Manifest) -> bool:
    """Whether the repack has fingerprints ``add`` can carry over (and so computes them for
    the sources it adds): False for a repack written without them.

    Raises:
        ChecksumMismatch: its fingerprint file is damaged (:func:`_current`).
    """
    return _current(out, manifest) is not None


def _current(out: str, manifest: Manifest) -> Fingerprints | None:
    """The repack's fingerprints to carry over, None when it has none (written without them,
    or a member left stale by a release that does not keep them).

    Raises:
        ChecksumMismatch: the manifest names a usable member but its file is missing, of the
            wrong size or header, or (on object storage, where it is fetched and checked)
            damaged: ``add`` and ``remove`` would silently drop the fingerprints.
    """
    found = load_fingerprints(out, manifest)
    if not isinstance(found, str):
        return found
    if check_member(os.fspath(out), manifest) is not None:
        return None
    raise ChecksumMismatch(
        f"{found}; the repack's fingerprints would be lost: `repack fingerprint "
        f"{os.fspath(out)}` writes them anew (`repack verify` says what else is damaged)"
    )


def fingerprint(
    out: str | os.PathLike,
    *,
    keep_superseded: float | None = None,
    progress: Progress = no_progress,
) -> dict:
    """Write the fingerprints of every source of the repack ``out`` from its shards (a repack
    written without them, or whose file is damaged), then replace the manifest with one
    naming the new file (``fingerprints-N.rpf``, a name not in use). On object storage the
    file it replaces is kept ``keep_superseded`` seconds for the readers of the old repack.

    Returns:
        The manifest's new ``fingerprints`` member.
    """
    with edit(out, backend="pread", keep=keep_superseded) as change:
        change.clean()
        member = write_all(change.repack, change.store, progress, change.taken)
        change.commit(
            with_member(change.manifest, member),
            "meanwhile; the fingerprints were not committed (run it again)",
            "fingerprint",
        )
    return member


def write_all(
    repack, store: Store, progress: Progress = no_progress, taken: Iterable[str] = ()
) -> dict:
    """Write the fingerprints of every source of the open ``repack``, read from its shards,
    into ``store`` under a name its manifest does not use; the new ``fingerprints``
    member."""
    from repack.read.fingerprints import hash_stored_source, member_of

    manifest = repack.manifest
    generation = next_generation(manifest) - 1
    current = member_of(manifest)
    if current is not None and str(current.get("file")) == fmt.fingerprint_name(generation):
        generation = _generation_of(str(current["file"])) + 1
    while fmt.fingerprint_name(generation) in taken:  # kept for a reader: never reused
        generation += 1
    name = fmt.fingerprint_name(generation)
    counts = [source.document_count - 1 for source in manifest.sources]
    advance = progress("fingerprint", sum(s.bin_size for s in manifest.sources))
    with store.staged(name) as path:
        writer = FingerprintWriter(path, name, manifest.algorithm, counts)
        try:
            for source in manifest.sources:
                writer.write(hash_stored_source(repack, source, advance))
            return writer.commit()
        except BaseException:
            writer.abort()
            raise


def _generation_of(name: str) -> int:
    stem = name[: -len(".rpf")]
    return int(stem.split("-", 1)[1]) if "-" in stem else 0
