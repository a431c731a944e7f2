"""``repack add``: append the sources of another blend to an existing repack.

New sources go to new shards; existing shards are never rewritten. A new index file (the old
sources' entries carried over, then the new ones) is written under a new name, then the
manifest is replaced atomically, then the old index is removed: a reader sees either the old
repack or the new one, and a process that opened the old one keeps reading it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable

from repack.checksum import digest_of, new_hasher
from repack.errors import BadSources, IncompatibleSources, InputError, SourceError
from repack.format import spec as fmt
from repack.format.manifest import Manifest
from repack.inputs.blend_files import load_blend
from repack.inputs.plan import plan_repack
from repack.inputs.sources import read_source_index
from repack.merge.commit import next_generation, next_shard_number
from repack.merge.edit import edit
from repack.merge.entries import new_entries
from repack.merge.fingerprint_file import carry, has_fingerprints, with_member
from repack.merge.index import write_index_file
from repack.merge.prepare import (
    DEFAULT_SHARD_SIZE,
    MergeResult,
    Prepared,
    blend_spellings,
    validate_sources,
)
from repack.merge.shards import copy_shards
from repack.merge.workdir import Receipt, check_not_inside_sources, save_plan
from repack.progress import Progress, no_progress
from repack.store import Store

__all__ = ["add", "added_manifest", "plan_addition"]


def add(
    out: str | os.PathLike,
    blend_path: str | os.PathLike,
    *,
    workers: int = 1,
    keep_superseded: float | None = None,
    progress: Progress = no_progress,
) -> MergeResult:
    """Add the sources of ``blend_path`` that ``out`` does not hold yet (a folder or object
    storage: the steps of :mod:`repack.merge.edit`; on object storage the old index and
    fingerprint file are kept ``keep_superseded`` seconds for the readers of the old repack).

    Raises:
        IncompatibleSources: a source of the blend is already in the repack with other content.
        InputError: every source of the blend is already in the repack.
        ObjectChanged: another writer replaced the manifest meanwhile (nothing of this add
            stays).
    """
    started = time.monotonic()
    with edit(out, keep=keep_superseded) as change:
        store, manifest = change.store, change.manifest
        change.clean()
        prepared = plan_addition(
            manifest,
            blend_path,
            store.location,
            progress,
            fingerprints=has_fingerprints(store.location, manifest),
            taken=change.taken,
        )
        check_not_inside_sources(store, prepared.sources)
        plan = prepared.plan
        save_plan(store, prepared)  # (what worker processes read)
        copy_shards(store, prepared, plan.shards, workers, progress("add", plan.total_bytes))
        name = fmt.index_name(next_generation(manifest, change.taken))
        with store.staged(name) as path:
            index = write_index_file(
                path,
                name,
                manifest.algorithm,
                carried=(change.repack, manifest.sources),
                prepared=prepared,
            )
        receipts = {shard.number: Receipt.load(store, shard.number) for shard in plan.shards}
        member = None
        if prepared.fingerprints:
            member = carry(
                store, manifest, [s.id for s in manifest.sources], prepared, taken=change.taken
            )
        updated = added_manifest(store, manifest, prepared, receipts, index, fingerprints=member)
        change.commit(updated, "during this add; this add did not commit (run it again)", "add")
    return MergeResult(
        store.location,
        len(plan.shards),
        len(prepared.sources),
        plan.total_bytes,
        time.monotonic() - started,
    )


def plan_addition(
    manifest: Manifest,
    blend_path: str | os.PathLike,
    out: str,
    progress: Progress = no_progress,
    *,
    fingerprints: bool = False,
    taken: Iterable[str] = (),
) -> Prepared:
    """The plan of adding the sources of ``blend_path`` that the repack ``out`` (its
    ``manifest``) does not hold: validated, their shards numbered after the repack's and after
    those in ``taken`` (files superseded generations keep); with ``fingerprints``, the copy
    fingerprints their documents.

    Raises:
        BadSources: several sources are missing, bad, or held with other content.
        IncompatibleSources: a source of the blend is already in the repack with other content.
        InputError: every source of the blend is already in the repack.
    """
    algorithm = manifest.algorithm
    blend = load_blend(blend_path)
    spellings = blend_spellings(blend)
    held = {source.path: source for source in manifest.sources}
    new_paths = []
    errors: list[InputError] = []  # of the sources already held: reported with the new ones'
    for path in spellings:
        source = held.get(path)
        if source is None:
            new_paths.append(path)
            continue
        hasher = new_hasher(algorithm)
        try:
            info = read_source_index(path, hasher=hasher).info
        except SourceError as err:
            errors.append(err)
            continue
        if digest_of(hasher, algorithm) != source.idx_checksum or info.bin_size != source.bin_size:
            errors.append(
                IncompatibleSources(
                    f"{path}: already in {out} with other content (index checksum "
                    f"{source.idx_checksum}, now {digest_of(hasher, algorithm)}); merge anew",
                    path=path,
                )
            )
    if not new_paths:
        if errors:
            raise BadSources.of(errors, len(spellings), os.fspath(blend_path))
        raise InputError(f"{blend_path}: every source of this blend is already in {out}")
    infos, checksums = validate_sources(
        new_paths,
        algorithm,
        progress,
        earlier=errors,
        checked=len(spellings) - len(new_paths),
        blend=blend_path,
    )
    plan = plan_repack(
        infos,
        manifest.shard_size or DEFAULT_SHARD_SIZE,
        lambda i: read_source_index(new_paths[i], known=infos[i]).lengths,
        first_shard=next_shard_number(manifest, taken),
    )
    return Prepared(
        blend,
        tuple(infos),
        tuple(tuple(spellings[p]) for p in new_paths),
        tuple(checksums),
        plan,
        algorithm,
        _codec_of(manifest),
        fingerprints,
    )


def added_manifest(
    store: Store, manifest: Manifest, prepared: Prepared, receipts, index, fingerprints=None
):
    """``manifest`` with the shards and sources of ``prepared`` (written into ``store``)
    added, naming ``index``, and the fingerprint member ``fingerprints`` (none if None:
    fingerprints that do not cover every source are never kept)."""
    shards, sources = new_entries(
        store, prepared, receipts, index, len(manifest.sources), len(manifest.shards)
    )
    updated = dataclasses.replace(
        manifest,
        **index.manifest_fields(),
        shards=manifest.shards + tuple(shards),
        sources=manifest.sources + tuple(sources),
        appended=(*manifest.appended, prepared.blend),
    )
    return with_member(updated, fingerprints)


def _codec_of(manifest) -> tuple[str, int] | None:
    """New shards are stored like the repack's last shard (raw, or compressed alike)."""
    last = manifest.shards[-1] if manifest.shards else None
    if last is None or last.codec is None:
        return None
    return last.codec, last.level if last.level is not None else 3
