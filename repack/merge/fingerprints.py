"""The fingerprint file of new sources, assembled from what each shard's task saved (a
merge's finalize step, ``repack add``), after the fingerprints carried over from the repack's
current file (``add``, ``remove``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from repack import format as fmt
from repack.errors import SourceError
from repack.fileio import hash_range
from repack.fingerprints import (
    Fingerprints,
    FingerprintWriter,
    check_file,
    load_fingerprints,
    load_parts,
)
from repack.manifest import Manifest
from repack.merge.commit import next_generation
from repack.merge.prepare import Prepared
from repack.merge.shards import finish_documents, open_source_bin, segment_documents
from repack.merge.workdir import work_path
from repack.progress import Progress, no_progress

__all__ = ["assemble", "carry", "fingerprint", "with_member"]


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
        src = open_source_bin(info)
        try:
            hasher = segment_documents(prepared, seg)
            hash_range(src, seg.source_offset, seg.size, [hasher])
        finally:
            os.close(src)
        documents.append((seg.source, hasher))
    return finish_documents(prepared, documents)


def carry(
    out: str, manifest: Manifest, ids: Sequence[int], prepared: Prepared | None = None
) -> dict | None:
    """The fingerprint file of a repack changed by ``add`` or ``remove``: the current one's
    fingerprints of the sources ``ids``, then those of the new sources of ``prepared``,
    written as ``fingerprints-N.rpf`` (N the next index generation). None when the repack has
    none to carry (written without them): the new repack then has none either.

    Raises:
        ChecksumMismatch: the current fingerprint file does not have its checksum.
    """
    found = load_fingerprints(out, manifest)
    if isinstance(found, str):
        return None
    check_file(out, manifest)
    name = fmt.fingerprint_name(next_generation(manifest))
    return assemble(out, name, prepared, algorithm=manifest.algorithm, carried=(found, ids))


def with_member(manifest: Manifest, member: dict | None) -> Manifest:
    """``manifest`` with the ``fingerprints`` member ``member`` (none if None)."""
    raw = {k: v for k, v in manifest.raw.items() if k != fmt.FINGERPRINT_MEMBER}
    if member is not None:
        raw[fmt.FINGERPRINT_MEMBER] = member
    return dataclasses.replace(manifest, raw=raw)


def has_fingerprints(out: str, manifest: Manifest) -> bool:
    """Whether the repack has fingerprints ``add`` can carry over (and so computes them for
    the sources it adds)."""
    return not isinstance(load_fingerprints(out, manifest), str)


def fingerprint(out: str | os.PathLike, *, progress: Progress = no_progress) -> dict:
    """Write the fingerprints of every source of the repack ``out`` from its shards (a repack
    written without them, or whose file is damaged), then replace the manifest with one
    naming the new file (``fingerprints-N.rpf``, a name not in use).

    Returns:
        The manifest's new ``fingerprints`` member.
    """
    from repack.fingerprints import hash_stored_source, member_of
    from repack.lock import writer_lock
    from repack.merge.commit import commit_manifest, named_files
    from repack.merge.workdir import remove_leftovers
    from repack.reader import Repack

    out = os.fspath(out)
    if not os.path.isdir(out):
        Repack(out)  # says why this is not a repack
    with writer_lock(out):
        repack = Repack(out)
        manifest = repack.manifest
        remove_leftovers(out, named_files(manifest))
        generation = next_generation(manifest) - 1
        current = member_of(manifest)
        if current is not None and str(current.get("file")) == fmt.fingerprint_name(generation):
            generation = _generation_of(str(current["file"])) + 1
        name = fmt.fingerprint_name(generation)
        counts = [source.document_count - 1 for source in manifest.sources]
        advance = progress("fingerprint", sum(s.bin_size for s in manifest.sources))
        writer = FingerprintWriter(out, name, manifest.algorithm, counts)
        try:
            for source in manifest.sources:
                writer.write(hash_stored_source(repack, source, advance))
            member = writer.commit()
        except BaseException:
            writer.abort()
            raise
        repack.close()
        commit_manifest(out, manifest, with_member(manifest, member))
    return member


def _generation_of(name: str) -> int:
    stem = name[: -len(".rpf")]
    return int(stem.split("-", 1)[1]) if "-" in stem else 0
