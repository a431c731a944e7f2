"""A merge into object storage (``s3://``, ``msc://``): the same three steps as
:mod:`repack.merge.steps`, on a :class:`~repack.store.Store` that has no rename and no lock.

* **plan**: the plan is saved as the object ``.work/plan.json`` by conditional create: of two
  merges starting at once, the second finds the first's plan and goes on with it if it is the
  same merge, or is refused;
* **tasks**: each shard is streamed from the local source ``.bin`` files into one multipart
  upload (:meth:`~repack.store.Store.writer`: a few 8 MiB parts in memory, no local copy),
  hashed as the bytes pass; once the upload is complete its receipt is saved as
  ``.work/shard-NNNNN.bin.json``. A shard with a receipt and an object of its size is never
  sent again, so a killed merge resumes where it stopped (``--resume``, or the same command);
* **finalize**: the index is built in a temp folder (it holds only the index arrays) and
  uploaded, then the manifest is written by conditional create (``If-None-Match: *``), the
  commit point: two writers can never both commit, and the one refused is told so. Then
  ``.work`` and the unfinished uploads of killed runs are removed.

With ``--compress`` each shard is compressed as its bytes pass (:class:`~repack.codec.
FrameWriter`: the frames, table and trailer a local merge writes, byte for byte).

``repack add`` and ``repack remove`` on a store are in :mod:`repack.merge.objects_edit`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from repack import format as fmt
from repack import interrupt
from repack.checksum import digest_of, new_hasher
from repack.codec import CompressedShard, FrameWriter
from repack.errors import (
    InputError,
    ObjectExists,
    ObjectMissing,
    OutputExists,
)
from repack.fileio import BUFFER, CHUNK, io_buffer, read_range
from repack.manifest import dump_manifest, parse_manifest
from repack.merge.entries import manifest_body
from repack.merge.fingerprints import assemble_in_store, save_store_parts
from repack.merge.index import IndexWritten, write_index_file
from repack.merge.prepare import MergeResult, Prepared
from repack.merge.remote import RemoteSegments
from repack.merge.shards import finish_documents, open_source_bin, segment_documents
from repack.merge.workdir import (
    INDEX_ENTRY_FILE,
    MAX_WORK_FILE,
    PLAN_FILE,
    WORK_DIR,
    Receipt,
    is_ours,
)
from repack.plan import PlannedShard
from repack.progress import Progress, no_progress
from repack.store import Store
from repack.store.objects import RemoteShard
from repack.store.transfer import upload

__all__ = [
    "execute",
    "finalize",
    "plan_merge",
    "resume",
    "run_task",
    "spanning_checksums",
    "upload_index",
    "upload_shard",
]

PLAN_KEY = f"{WORK_DIR}/{PLAN_FILE}"
INDEX_ENTRY_KEY = f"{WORK_DIR}/{INDEX_ENTRY_FILE}"


def _receipt_key(number: int) -> str:
    return f"{WORK_DIR}/{fmt.shard_name(number)}.json"


def _load_json(store: Store, key: str):
    data, _ = store.get(key, MAX_WORK_FILE)
    return json.loads(data)


def _load_plan(store: Store) -> Prepared | None:
    if store.stat(PLAN_KEY) is None:
        return None
    try:
        return Prepared.from_json(_load_json(store, PLAN_KEY))
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise InputError(
            f"{store.url(PLAN_KEY)}: not a valid plan ({err}); start over with --force"
        ) from None


def _require_plan(store: Store) -> Prepared:
    prepared = _load_plan(store)
    if prepared is None:
        if store.stat(fmt.MANIFEST_FILE) is not None:
            raise InputError(f"{store.location}: the merge is already finalized")
        raise InputError(
            f"{store.location}: no merge plan here; run 'repack merge BLEND {store.location} "
            "--plan-only' first"
        )
    return prepared


# --- plan -------------------------------------------------------------------------------------


def plan_merge(
    prepared: Prepared, store: Store, *, overwrite: bool = False, index: bool = True
) -> tuple[Prepared, str]:
    """Save the plan in ``store`` (and upload the index), or find the same merge there.

    Returns:
        The plan in force and the state found: ``"new"``, ``"resumed"`` or ``"complete"``.
    """
    from repack.merge.steps import PlanState, _comparable, _same_merge

    objects = dict(store.list())
    if fmt.MANIFEST_FILE in objects and not overwrite:
        data, _ = store.get(fmt.MANIFEST_FILE, fmt.MAX_MANIFEST_SIZE)
        manifest = parse_manifest(data, store.url(fmt.MANIFEST_FILE))
        if _same_merge(prepared, manifest):
            _clean_work(store, objects)
            return prepared, PlanState.COMPLETE
        raise OutputExists(
            f"{store.location}: holds a repack of another blend or other options; pass --force "
            "to replace it"
        )
    if PLAN_KEY in objects and not overwrite:
        stored = _load_plan(store)
        if _comparable(stored) != _comparable(prepared):
            raise OutputExists(
                f"{store.location}: holds an unfinished merge of another blend, other sources or "
                "other options; pass --force to start over"
            )
        return stored, PlanState.RESUMED
    foreign = sorted(name for name in objects if not is_ours(name.split("/", 1)[0]))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise OutputExists(
            f"{store.location}: holds objects repack did not write ({shown}); refusing to "
            "replace them; choose another prefix"
        )
    # what is left is ours: a repack replaced with --force, or what a merge killed before its
    # plan left, worth nothing
    if fmt.MANIFEST_FILE in objects:
        store.delete(fmt.MANIFEST_FILE)  # the commit point goes first
    for name in sorted(objects):
        if name != fmt.MANIFEST_FILE:
            store.delete(name)
    data = json.dumps(prepared.to_json(), sort_keys=True).encode()
    try:
        store.create(PLAN_KEY, data)
    except ObjectExists:
        # another merge planned at the same moment: go on with it if it is this one
        stored = _load_plan(store)
        if stored is None or _comparable(stored) != _comparable(prepared):
            raise OutputExists(
                f"{store.location}: another merge of another blend or options planned here at "
                "the same time"
            ) from None
        return stored, PlanState.RESUMED
    if index:
        write_index(prepared, store)
    return prepared, PlanState.NEW


def write_index(prepared: Prepared, store: Store) -> None:
    """Build the index in a temp folder, upload it, and save its entry, unless saved already."""
    if store.stat(INDEX_ENTRY_KEY) is not None:
        return
    written = upload_index(store, fmt.INDEX_FILE, prepared.algorithm, prepared=prepared)
    store.put(INDEX_ENTRY_KEY, json.dumps(written.to_json(), sort_keys=True).encode())


def upload_index(store: Store, name: str, algorithm: str, **sources) -> IndexWritten:
    """Write the index ``name`` (of ``carried`` and ``prepared`` sources, as
    :func:`~repack.merge.index.write_index_file` takes them) in a temp folder, then upload it
    in a streaming write."""
    folder = tempfile.mkdtemp(prefix="repack-index-")
    try:
        written = write_index_file(folder, name, algorithm, **sources)
        upload(store, name, os.path.join(folder, name))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return written


# --- tasks ------------------------------------------------------------------------------------


def _finished(store: Store, objects: dict, shard: PlannedShard, codec: str | None = None) -> bool:
    """Whether ``shard`` has its receipt and its object (which is complete once there: an
    upload is committed whole or not at all; a raw one's size is checked too)."""
    found = objects.get(fmt.shard_name(shard.number, codec))
    if _receipt_key(shard.number) not in objects or found is None:
        return False
    return codec is not None or found.size == shard.size


def run_task(
    store: Store, task: int = 0, tasks: int = 1, *, workers: int = 1, progress=no_progress
) -> tuple[int, int]:
    """Upload the shards of task ``task`` of ``tasks`` that have no receipt yet.

    Returns:
        (shards uploaded, shards skipped because already finished).
    """
    if not 0 <= task < tasks:
        raise InputError(f"task {task} is not in 0..{tasks - 1}")
    prepared = _require_plan(store)
    objects = dict(store.list())
    mine = [s for s in prepared.plan.shards if s.number % tasks == task]
    todo = [s for s in mine if not _finished(store, objects, s, prepared.codec_name)]
    advance = progress("merge", sum(s.size for s in todo))
    if workers <= 1 or len(todo) <= 1:
        for shard in todo:
            upload_shard(store, prepared, shard, advance)
    else:
        with ThreadPoolExecutor(min(workers, len(todo)), thread_name_prefix="repack-up") as pool:
            for future in [pool.submit(upload_shard, store, prepared, s, advance) for s in todo]:
                interrupt.result_of(future)
    return len(todo), len(mine) - len(todo)


def upload_shard(store: Store, prepared: Prepared, shard: PlannedShard, advance) -> Receipt:
    """Stream one shard from its sources (local files, or objects read by ranged GETs
    fetched ahead: :class:`~repack.merge.remote.RemoteSegments`) into the store, hashing on
    the way (with fingerprints, each document too); save its fingerprint parts, then its
    receipt, once the object is complete."""
    algorithm = prepared.algorithm
    largest = max((seg.size for seg in shard.segments), default=0)
    buffer = io_buffer(min(BUFFER, max(1, largest)))
    shard_hasher = new_hasher(algorithm)
    segments = {}
    documents: list = []
    fingerprints = segment_documents if prepared.fingerprints else None
    name = fmt.shard_name(shard.number, prepared.codec_name)
    with (
        store.writer(name, size_hint=shard.size) as writer,
        RemoteSegments(prepared, shard.segments, fingerprints) as remote,
    ):
        sink, frames, stored_hasher = writer, None, None
        if prepared.codec is not None:  # compressed as the bytes pass, frame by frame
            stored_hasher = new_hasher(algorithm)

            def out(data: bytes) -> None:
                stored_hasher.update(data)
                writer.write(data)

            sink = frames = FrameWriter(out, prepared.codec[1])
        position = 0
        for seg in shard.segments:
            if seg.offset > position:
                padding = bytes(seg.offset - position)
                shard_hasher.update(padding)
                sink.write(padding)
            seg_hasher = new_hasher(algorithm)
            hashers = [shard_hasher, seg_hasher]
            if seg in remote:
                if fingerprints is not None:
                    documents.append((seg.source, remote.documents(seg)))
                    hashers.append(documents[-1][1])
                pieces = remote.pieces(seg)
            else:
                if fingerprints is not None:
                    documents.append((seg.source, segment_documents(prepared, seg)))
                    hashers.append(documents[-1][1])
                pieces = _local_pieces(prepared.sources[seg.source], seg, buffer)
            try:
                for view in pieces:
                    for hasher in hashers:
                        hasher.update(view)
                    sink.write(view)
                    advance(len(view))
            finally:
                pieces.close()  # (a local source's descriptor, at once)
            segments[Receipt.key(seg.source, seg.first_sequence)] = digest_of(seg_hasher, algorithm)
            position = seg.offset + seg.size
        if shard.size > position:
            padding = bytes(shard.size - position)
            shard_hasher.update(padding)
            sink.write(padding)
        stored = (frames.finish(), digest_of(stored_hasher, algorithm)) if frames else (None, None)
        writer.commit()
    if fingerprints is not None:  # before the receipt: a receipt means they are there
        save_store_parts(store, shard.number, finish_documents(prepared, documents))
    receipt = Receipt(digest_of(shard_hasher, algorithm), segments, *stored)
    store.put(_receipt_key(shard.number), json.dumps(receipt.to_json(), sort_keys=True).encode())
    return receipt


def _local_pieces(info, seg, buffer: memoryview):
    """The bytes of segment ``seg`` of a local source ``.bin``, through ``buffer``."""
    src = open_source_bin(info)
    try:
        done = 0
        while done < seg.size:
            n = min(len(buffer), seg.size - done)
            yield read_range(src, seg.source_offset + done, n, buffer)
            done += n
    finally:
        os.close(src)


# --- finalize ---------------------------------------------------------------------------------


def spanning_checksums(store: Store, receipts=None):
    """Checksum of a source cut across shards, read back from the store in ranged GETs
    (through the frames of a compressed shard, whose stored size its receipt gives)."""

    def checksum(prepared: Prepared, source: int) -> str:
        hasher = new_hasher(prepared.algorithm)
        codec = prepared.codec_name
        sizes = {s.number: s.size for s in prepared.plan.shards}
        for seg in prepared.plan.segments_by_source[source]:
            name = fmt.shard_name(seg.shard, codec)
            if codec is None:
                read = lambda start, n, name=name: store.read(name, start, n)  # noqa: E731
            else:
                remote = RemoteShard(store, name, receipts[seg.shard].stored_size, None)
                read = CompressedShard(store.url(name), sizes[seg.shard], remote).read
            for start in range(seg.offset, seg.offset + seg.size, CHUNK):
                hasher.update(read(start, min(CHUNK, seg.offset + seg.size - start)))
        return digest_of(hasher, prepared.algorithm)

    return checksum


def finalize(store: Store, *, progress: Progress = no_progress) -> MergeResult:
    """Write the manifest, by conditional create, once every shard has its receipt.

    Raises:
        ObjectExists: another writer committed a repack here first (this one wrote nothing
            that stays: the work objects are removed, as that writer removes them).
    """
    started = time.monotonic()
    prepared = _require_plan(store)
    try:
        _commit(store, prepared)
    except (ObjectExists, ObjectMissing):
        if store.stat(fmt.MANIFEST_FILE) is None:
            raise  # not another writer's commit: a real error
        # another finalize committed while this one read the work objects it then removed
        _clean_work(store, dict(store.list(WORK_DIR + "/")))
        raise ObjectExists(
            f"{store.url(fmt.MANIFEST_FILE)}: another writer committed a repack here first; "
            "this merge did not replace it (run 'repack verify' on it, or choose another "
            "prefix)",
            location=store.url(fmt.MANIFEST_FILE),
        ) from None
    _clean_work(store, dict(store.list(WORK_DIR + "/")))
    return MergeResult(
        store.location,
        len(prepared.plan.shards),
        len(prepared.sources),
        prepared.plan.total_bytes,
        time.monotonic() - started,
    )


def _commit(store: Store, prepared: Prepared) -> None:
    objects = dict(store.list())
    codec = prepared.codec_name
    missing = [s.name for s in prepared.plan.shards if not _finished(store, objects, s, codec)]
    if missing and fmt.MANIFEST_FILE in objects:
        raise ObjectExists(store.url(fmt.MANIFEST_FILE))
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise InputError(f"{store.location}: {len(missing)} shard(s) not finished yet: {shown}")
    receipts = {
        shard.number: Receipt.from_json(_load_json(store, _receipt_key(shard.number)))
        for shard in prepared.plan.shards
    }
    write_index(prepared, store)
    index = IndexWritten.from_json(_load_json(store, INDEX_ENTRY_KEY))
    spanning = spanning_checksums(store, receipts)
    body = manifest_body(store.location, prepared, receipts, index, spanning=spanning)
    if prepared.fingerprints:
        body[fmt.FINGERPRINT_MEMBER] = assemble_in_store(store, fmt.fingerprint_name(0), prepared)
    store.create(fmt.MANIFEST_FILE, dump_manifest(body, prepared.algorithm))


def _clean_work(store: Store, objects: dict) -> None:
    """Remove the work objects and the unfinished uploads killed runs left."""
    for name in sorted(objects):
        if name.startswith(WORK_DIR + "/"):
            store.delete(name)
    abort = getattr(store, "abort_uploads", None)
    if abort is not None:
        abort()


# --- the whole merge --------------------------------------------------------------------------


def execute(
    prepared: Prepared,
    store: Store,
    *,
    overwrite: bool = False,
    workers: int = 1,
    progress: Progress = no_progress,
) -> MergeResult:
    """Plan (or find the plan of) the merge in ``store``, upload every shard, finalize."""
    from repack.merge.steps import PlanState

    started = time.monotonic()
    prepared, state = plan_merge(prepared, store, overwrite=overwrite, index=False)
    plan = prepared.plan
    if state is PlanState.COMPLETE:
        return MergeResult(
            store.location,
            len(plan.shards),
            len(prepared.sources),
            plan.total_bytes,
            time.monotonic() - started,
            len(plan.shards),
        )
    _, skipped = run_task(store, workers=workers, progress=progress)
    result = finalize(store, progress=progress)
    return MergeResult(
        result.out, result.shards, result.sources, result.bytes, time.monotonic() - started, skipped
    )


def resume(store: Store, *, workers: int = 1, progress: Progress = no_progress) -> MergeResult:
    """Finish the interrupted merge in ``store``: every remaining shard, then finalize."""
    import dataclasses

    _require_plan(store)
    _, skipped = run_task(store, workers=workers, progress=progress)
    return dataclasses.replace(finalize(store, progress=progress), resumed_shards=skipped)
