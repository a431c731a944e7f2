"""``repack add`` and ``repack remove`` on a repack in object storage.

Both write their new objects under names the current manifest does not use (new shards, a
new index ``index-N.rpx``), then replace the manifest **conditionally on the version they
read** (``If-Match``): a reader sees the old repack or the new one, and a writer that finds
the manifest replaced meanwhile commits nothing. Only then are the objects the new manifest
no longer names deleted (removed bytes leave the bucket). One writer at a time through the
lease (:mod:`repack.merge.lease`); holding it, a writer first deletes what an interrupted one
left. The objects are those a local ``add`` or ``remove`` writes, byte for byte, the
fingerprint file (``fingerprints-N.rpf``, carried over and extended) included.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from repack import format as fmt
from repack import interrupt
from repack.checksum import digest_of, new_hasher
from repack.codec import BLOCK_SIZE, FrameWriter
from repack.errors import ChecksumMismatch, ObjectChanged
from repack.fileio import CHUNK
from repack.manifest import dump_manifest, parse_manifest
from repack.merge.fingerprints import carry, has_fingerprints, with_member
from repack.merge.lease import LEASE_KEY, release_lease, take_lease
from repack.merge.objects import spanning_checksums, upload_index, upload_shard
from repack.merge.prepare import MergeResult
from repack.merge.workdir import WORK_DIR
from repack.progress import Progress, no_progress
from repack.store import Store
from repack.store.transfer import upload

__all__ = ["add_to_store", "fingerprint_store", "remove_from_store"]


def add_to_store(
    store: Store, blend_path, *, workers: int = 1, progress: Progress = no_progress
) -> MergeResult:
    """``repack add`` on a repack in object storage: upload the new shards and a new index
    under names the current manifest does not use, then replace the manifest conditionally
    on the version read at the start (``If-Match``), then delete what only the old one named.

    One writer at a time through the lease object (:func:`take_lease`); what an interrupted
    add uploaded is removed by the next writer, which holds the lease.

    Raises:
        WriterBusy: another writer holds the lease.
        ObjectChanged: the manifest was replaced meanwhile (nothing of this add stays).
    """
    from repack.append import added_manifest, plan_addition
    from repack.merge.commit import next_generation
    from repack.reader import Repack

    started = time.monotonic()
    repack = Repack(store.location)
    manifest = repack.manifest
    read = store.stat(fmt.MANIFEST_FILE)
    take_lease(store)
    try:
        _start_edit(store, manifest, read, "add")
        prepared = plan_addition(
            manifest,
            blend_path,
            store.location,
            progress,
            fingerprints=has_fingerprints(store.location, manifest),
        )
        plan = prepared.plan
        advance = progress("add", plan.total_bytes)
        if workers <= 1 or len(plan.shards) <= 1:
            receipts = {s.number: upload_shard(store, prepared, s, advance) for s in plan.shards}
        else:
            with ThreadPoolExecutor(min(workers, len(plan.shards))) as pool:
                futures = {
                    s.number: pool.submit(upload_shard, store, prepared, s, advance)
                    for s in plan.shards
                }
                receipts = {
                    number: interrupt.result_of(future) for number, future in futures.items()
                }
        index = upload_index(
            store,
            fmt.index_name(next_generation(manifest)),
            manifest.algorithm,
            carried=(repack, manifest.sources),
            prepared=prepared,
        )
        spanning = spanning_checksums(store, receipts)
        member = None
        if prepared.fingerprints:
            ids = [s.id for s in manifest.sources]
            member = carry(store.location, manifest, ids, prepared, store=store)
        updated = added_manifest(
            store.location, manifest, prepared, receipts, index, spanning, fingerprints=member
        )
        _commit(
            store,
            repack,
            manifest,
            updated,
            read,
            "during this add; this add did not commit (run it again)",
        )
        for name, _ in list(store.list(WORK_DIR + "/")):
            if name != LEASE_KEY:
                store.delete(name)
    finally:
        release_lease(store)
    return MergeResult(
        store.location,
        len(plan.shards),
        len(prepared.sources),
        plan.total_bytes,
        time.monotonic() - started,
    )


def remove_from_store(store: Store, names, *, dry_run: bool = False, progress=no_progress):
    """``repack remove`` on a repack in object storage: the shards holding removed sources
    are written anew under new names with only what they keep (each kept segment checked
    against its checksum as it passes), a new index is uploaded, the manifest is replaced
    conditionally on the version read (``If-Match``), then the replaced shards and the old
    index are deleted: the removed bytes leave the bucket. One writer at a time through the
    lease (:func:`take_lease`).

    Returns:
        The :class:`~repack.remove.RemovePlan` carried out.
    """
    from repack.merge.commit import next_generation
    from repack.reader import Repack
    from repack.remove import _updated, plan_removal

    repack = Repack(store.location, backend="pread")
    manifest = repack.manifest
    if dry_run:
        return plan_removal(manifest, names, out=store.location)
    read = store.stat(fmt.MANIFEST_FILE)
    take_lease(store)
    try:
        _start_edit(store, manifest, read, "remove")
        plan = plan_removal(manifest, names, out=store.location)
        advance = progress("remove", sum(s.kept_bytes for s in plan.shards))
        new_shards = {}
        for shard in plan.shards:
            entry = manifest.shards[shard.position]
            new_shards[shard.position] = (
                _rewrite_remote(store, repack, entry, shard, advance) if shard.new_file else None
            )
        kept = [s for s in manifest.sources if s.id not in set(plan.removed)]
        index = upload_index(
            store,
            fmt.index_name(next_generation(manifest)),
            manifest.algorithm,
            carried=(repack, kept),
        )
        member = carry(store.location, manifest, [s.id for s in kept], store=store)
        updated = with_member(_updated(manifest, plan, new_shards, kept, index), member)
        _commit(
            store,
            repack,
            manifest,
            updated,
            read,
            "during this remove; this remove did not commit (run it again)",
        )
    finally:
        release_lease(store)
    return plan


def fingerprint_store(store: Store, *, progress: Progress = no_progress) -> dict:
    """``repack fingerprint`` on a repack in object storage: every source hashed from its
    shards (ranged GETs) into a new fingerprint file, written in a temp folder and uploaded
    under a name the manifest does not use, then the manifest replaced conditionally on the
    version read (``If-Match``), then the old file deleted. One writer at a time through the
    lease.

    Returns:
        The manifest's new ``fingerprints`` member.
    """
    from repack.merge.fingerprints import write_all
    from repack.reader import Repack

    repack = Repack(store.location, backend="pread")
    manifest = repack.manifest
    read = store.stat(fmt.MANIFEST_FILE)
    take_lease(store)
    folder = tempfile.mkdtemp(prefix="repack-fingerprints-")
    try:
        _start_edit(store, manifest, read, "fingerprint")
        member = write_all(repack, folder, progress)
        upload(store, member["file"], os.path.join(folder, member["file"]))
        updated = with_member(manifest, member)
        _commit(
            store,
            repack,
            manifest,
            updated,
            read,
            "meanwhile; the fingerprints were not committed (run it again)",
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        release_lease(store)
    return member


def _rewrite_remote(store: Store, repack, entry, shard, advance):
    """Upload the new object of ``shard`` (a :class:`~repack.remove.RewrittenShard`): its
    kept segments, read from the old object with ranged GETs, checked, at their new offsets."""
    algorithm = repack.manifest.algorithm
    shard_hasher = new_hasher(algorithm)
    with store.writer(shard.new_file, size_hint=shard.size) as writer:
        sink, frames, stored_hasher = writer, None, None
        level = entry.level if entry.level is not None else 3
        if entry.codec is not None:  # compressed like the shard it replaces
            stored_hasher = new_hasher(algorithm)

            def out(data: bytes) -> None:
                stored_hasher.update(data)
                writer.write(data)

            sink = frames = FrameWriter(out, level)
        position = 0
        for source, seg, offset in shard.kept:
            if offset > position:
                padding = bytes(offset - position)
                shard_hasher.update(padding)
                sink.write(padding)
            seg_hasher = new_hasher(algorithm)
            for start in range(0, seg.size, CHUNK):
                n = min(CHUNK, seg.size - start)
                data = repack.read_bytes(entry.number, seg.offset + start, n)
                shard_hasher.update(data)
                seg_hasher.update(data)
                sink.write(data)
                advance(n)
            found = digest_of(seg_hasher, algorithm)
            if found != seg.checksum:
                raise ChecksumMismatch(
                    f"{store.url(entry.file)}: the segment of "
                    f"{repack.manifest.sources[source].name!r} at offset {seg.offset} has "
                    f"checksum {found}, the manifest records {seg.checksum}; nothing was "
                    "changed: run 'repack verify'",
                    location=store.url(entry.file),
                )
            position = offset + seg.size
        if shard.size > position:
            padding = bytes(shard.size - position)
            shard_hasher.update(padding)
            sink.write(padding)
        stored = {}
        if frames is not None:
            stored = {
                "stored_size": frames.finish(),
                "stored_checksum": digest_of(stored_hasher, algorithm),
                "level": level,
                "block_size": BLOCK_SIZE,
            }
        writer.commit()
    return dataclasses.replace(
        entry,
        file=shard.new_file,
        size=shard.size,
        checksum=digest_of(shard_hasher, algorithm),
        **stored,
    )


def _commit(store, repack, manifest, updated, read, refused: str) -> None:
    """Replace the manifest ``read`` by ``updated`` on condition that it is still the one
    read, then delete the objects only ``manifest`` named (removed bytes leave the bucket).

    Raises:
        ObjectChanged: another writer replaced the manifest meanwhile; ``refused`` (after
            "replaced by another writer ") says what did not happen.
    """
    data = dump_manifest(updated.to_json(), updated.algorithm)
    try:
        store.replace(fmt.MANIFEST_FILE, data, read.etag)
    except ObjectChanged:
        raise ObjectChanged(
            f"{store.url(fmt.MANIFEST_FILE)}: replaced by another writer {refused}",
            location=store.url(fmt.MANIFEST_FILE),
        ) from None
    from repack.merge.commit import named_files

    repack.close()
    for name in sorted(named_files(manifest) - named_files(updated)):
        store.delete(name)


def _start_edit(store, manifest, read, verb: str) -> None:
    """With the lease taken: check the manifest is still the one read (``read``: its stat
    before the lease), then remove what an interrupted writer left."""
    from repack.merge.commit import named_files

    current, _ = store.get(fmt.MANIFEST_FILE, fmt.MAX_MANIFEST_SIZE)
    if read is None or parse_manifest(current, store.location).checksum != manifest.checksum:
        raise ObjectChanged(
            f"{store.url(fmt.MANIFEST_FILE)}: replaced while this {verb} started; run it again",
            location=store.url(fmt.MANIFEST_FILE),
        )
    named = named_files(manifest) | {fmt.MANIFEST_FILE, LEASE_KEY}
    for name, _ in list(store.list()):
        if name not in named:  # what an interrupted writer left
            store.delete(name)
