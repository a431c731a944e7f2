"""The fingerprint file of new sources, assembled from what each shard's task saved (a
merge's finalize step, ``repack add``), after the fingerprints carried over from the repack's
current file (``add``, ``remove``)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Sequence

import numpy as np

from repack import format as fmt
from repack.errors import ChecksumMismatch, SourceError
from repack.fileio import hash_range
from repack.fingerprints import (
    Fingerprints,
    FingerprintWriter,
    _part_paths,
    check_file,
    check_member,
    load_fingerprints,
    load_parts,
    save_parts,
)
from repack.manifest import Manifest
from repack.merge.commit import next_generation
from repack.merge.prepare import Prepared
from repack.merge.shards import finish_documents, open_source_bin, segment_documents
from repack.merge.workdir import WORK_DIR, work_path
from repack.progress import Progress, no_progress
from repack.source_data import bin_chunks, is_remote
from repack.store import Store
from repack.store.transfer import download, upload

__all__ = [
    "assemble",
    "assemble_in_store",
    "carry",
    "fetch_store_parts",
    "fingerprint",
    "save_store_parts",
    "with_member",
]


def assemble(
    out: str,
    name: str,
    prepared: Prepared | None,
    *,
    algorithm: str | None = None,
    carried: tuple[Fingerprints, Sequence[int]] | None = None,
) -> dict:
    """Write the fingerprint file ``out/name``: first those of the sources ``carried`` over
    (an open file's, by source id), then those of the new sources of ``prepared``, from the
    parts the tasks saved in the work folder (a shard without them, copied by a release
    that did not compute them, is hashed from its sources now).

    Returns:
        The manifest's ``fingerprints`` member.
    """
    old, ids = carried if carried is not None else (None, ())
    new = prepared.sources if prepared is not None else ()
    counts = [int(old.starts[i + 1] - old.starts[i]) for i in ids]
    counts += [info.document_count - 1 for info in new]
    algorithm = algorithm or prepared.algorithm
    writer = FingerprintWriter(out, name, algorithm, counts)
    try:
        for i in ids:
            writer.write(old.of(i))
        if prepared is not None:
            for hashes in _new_sources(out, prepared):
                writer.write(hashes)
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


def _new_sources(out: str, prepared: Prepared):
    """The fingerprints of each new source, in order."""
    pieces: list[list[tuple[int, np.ndarray]]] = [[] for _ in prepared.sources]
    for shard in prepared.plan.shards:
        parts = load_parts(work_path(out), shard.number)
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
        info = prepared.sources[seg.source]
        hasher = segment_documents(prepared, seg)
        if is_remote(info.path):
            for data in bin_chunks(info, seg.source_offset, seg.size):
                hasher.update(data)
        else:
            src = open_source_bin(info)
            try:
                hash_range(src, seg.source_offset, seg.size, [hasher])
            finally:
                os.close(src)
        documents.append((seg.source, hasher))
    return finish_documents(prepared, documents)


def carry(
    out: str,
    manifest: Manifest,
    ids: Sequence[int],
    prepared: Prepared | None = None,
    *,
    store: Store | None = None,
) -> dict | None:
    """The fingerprint file of a repack changed by ``add`` or ``remove``: the current one's
    fingerprints of the sources ``ids``, then those of the new sources of ``prepared``,
    written as ``fingerprints-N.rpf`` (N the next index generation) into the folder ``out``,
    or uploaded to ``store`` (a repack on object storage, ``out`` its location: the current
    file is read from the node-local cache, :func:`~repack.fingerprints.load_fingerprints`).
    None when the repack has none to carry (written without them): the new repack then has
    none either.

    Raises:
        ChecksumMismatch: the current fingerprint file does not have its checksum, or is
            missing or damaged otherwise (:func:`_current`).
    """
    found = _current(out, manifest)
    if found is None:
        return None
    check_file(out, manifest)
    name = fmt.fingerprint_name(next_generation(manifest))
    if store is not None:
        return assemble_in_store(
            store, name, prepared, algorithm=manifest.algorithm, carried=(found, ids)
        )
    return assemble(out, name, prepared, algorithm=manifest.algorithm, carried=(found, ids))


# --- on object storage ------------------------------------------------------------------------


def save_store_parts(store: Store, number: int, parts) -> None:
    """:func:`~repack.fingerprints.save_parts` for a task writing to object storage: the
    same two files, made in a temp folder, then uploaded as ``.work/fingerprints-NNNNN.*``
    (the table last: :func:`fetch_store_parts` takes parts only with their table)."""
    folder = tempfile.mkdtemp(prefix="repack-parts-")
    try:
        save_parts(folder, number, parts)
        for name in reversed(_part_names(number)):  # the data, then the table
            upload(store, f"{WORK_DIR}/{name}", os.path.join(folder, name))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _part_names(number: int) -> tuple[str, str]:
    """The names of the two files of shard ``number``'s parts (table, data)."""
    return tuple(os.path.basename(p) for p in _part_paths("", number))


def fetch_store_parts(store: Store, prepared: Prepared, work: str) -> None:
    """Download the fingerprint parts the tasks saved in ``store`` into the local work folder
    ``work``, where :func:`assemble` reads them (:func:`~repack.fingerprints.load_parts`)."""
    objects = dict(store.list(WORK_DIR + "/"))
    os.makedirs(work, exist_ok=True)
    for shard in prepared.plan.shards:
        names = _part_names(shard.number)
        found = [objects.get(f"{WORK_DIR}/{name}") for name in names]
        if any(stat is None for stat in found):
            continue  # hashed from the sources instead, as a local merge does
        for name, stat in zip(names, found):
            download(store, f"{WORK_DIR}/{name}", os.path.join(work, name), stat.size, stat.etag)


def assemble_in_store(
    store: Store,
    name: str,
    prepared: Prepared | None,
    *,
    algorithm: str | None = None,
    carried: tuple[Fingerprints, Sequence[int]] | None = None,
) -> dict:
    """:func:`assemble` for a repack on object storage: the file is written in a temp folder
    from the parts the tasks uploaded (fetched there first), then uploaded as ``name``; the
    very bytes a local merge, add or remove writes.

    Returns:
        The manifest's ``fingerprints`` member.
    """
    folder = tempfile.mkdtemp(prefix="repack-fingerprints-")
    try:
        if prepared is not None:
            fetch_store_parts(store, prepared, work_path(folder))
        member = assemble(folder, name, prepared, algorithm=algorithm, carried=carried)
        upload(store, name, os.path.join(folder, name))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return member


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


def fingerprint(out: str | os.PathLike, *, progress: Progress = no_progress) -> dict:
    """Write the fingerprints of every source of the repack ``out`` from its shards (a repack
    written without them, or whose file is damaged), then replace the manifest with one
    naming the new file (``fingerprints-N.rpf``, a name not in use).

    Returns:
        The manifest's new ``fingerprints`` member.
    """
    from repack.lock import writer_lock
    from repack.merge.commit import commit_manifest, named_files
    from repack.merge.workdir import remove_leftovers
    from repack.reader import Repack
    from repack.store import open_store

    store = open_store(out)
    if not store.local:
        from repack.merge.objects_edit import fingerprint_store

        return fingerprint_store(store, progress=progress)
    out = os.fspath(out)
    if not os.path.isdir(out):
        Repack(out)  # says why this is not a repack
    with writer_lock(out):
        repack = Repack(out)
        manifest = repack.manifest
        remove_leftovers(out, named_files(manifest))
        member = write_all(repack, out, progress)
        repack.close()
        commit_manifest(out, manifest, with_member(manifest, member))
    return member


def write_all(repack, folder: str, progress: Progress = no_progress) -> dict:
    """Write the fingerprints of every source of the open ``repack``, read from its shards,
    into the folder ``folder`` under a name its manifest does not use; the new
    ``fingerprints`` member."""
    from repack.fingerprints import hash_stored_source, member_of

    manifest = repack.manifest
    generation = next_generation(manifest) - 1
    current = member_of(manifest)
    if current is not None and str(current.get("file")) == fmt.fingerprint_name(generation):
        generation = _generation_of(str(current["file"])) + 1
    name = fmt.fingerprint_name(generation)
    counts = [source.document_count - 1 for source in manifest.sources]
    advance = progress("fingerprint", sum(s.bin_size for s in manifest.sources))
    writer = FingerprintWriter(folder, name, manifest.algorithm, counts)
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
