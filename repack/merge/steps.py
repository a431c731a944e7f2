"""The three steps of a merge and the functions that chain them.

1. **plan** (:func:`plan_merge`): save the plan of :func:`~repack.merge.prepare.prepare` in
   ``OUT/.work/plan.json`` and write the combined index (:func:`write_index`);
2. **tasks** (:func:`run_task`): copy the shards; shard ``k`` belongs to task ``k % N``;
3. **finalize** (:func:`finalize`): check that every shard has its receipt, write the manifest,
   remove ``.work``.

:func:`merge` (= :func:`~repack.merge.prepare.prepare` + :func:`execute`) runs them all, the
index in a thread while the shards are copied.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from repack import format as fmt
from repack import interrupt
from repack.checksum import DEFAULT
from repack.errors import InputError, OutputExists
from repack.fileio import atomic_write
from repack.lock import writer_lock
from repack.manifest import Manifest, dump_manifest, load_manifest
from repack.merge import objects
from repack.merge.entries import manifest_body
from repack.merge.fingerprints import assemble
from repack.merge.index import IndexWritten, Stopped, write_index_file
from repack.merge.prepare import DEFAULT_SHARD_SIZE, MergeResult, Prepared, prepare
from repack.merge.shards import copy_shards
from repack.merge.workdir import (
    INDEX_ENTRY_FILE,
    Receipt,
    check_not_inside_sources,
    is_ours,
    load_plan,
    prepare_out,
    read_work_json,
    remove_partial,
    remove_work,
    require_plan,
    save_plan,
    shard_finished,
    work_path,
)
from repack.progress import Progress, no_progress
from repack.store import open_store
from repack.units import plural

__all__ = [
    "PlanState",
    "execute",
    "finalize",
    "merge",
    "plan_merge",
    "resume",
    "run_task",
    "write_index",
]


class PlanState(str, enum.Enum):
    """What :func:`plan_merge` found in the output folder."""

    #: Planned now.
    NEW = "new"
    #: An unfinished merge of the same blend and options, to go on with.
    RESUMED = "resumed"
    #: This very merge, finished: nothing to do.
    COMPLETE = "complete"


def plan_merge(
    prepared: Prepared, out: str | os.PathLike, *, overwrite: bool = False, index: bool = True
) -> tuple[Prepared, PlanState]:
    """Save the plan and write the index in ``out``, or find the same merge already there.

    With ``index=False`` only the plan is saved, and the index is left to
    :func:`write_index` (which :func:`finalize` calls if it has not run).

    Returns:
        The plan in force, and the state found.

    Raises:
        OutputExists: ``out`` holds something else and ``overwrite`` is false.
    """
    store = open_store(out)
    if not store.local:
        return objects.plan_merge(prepared, store, overwrite=overwrite, index=index)
    out = os.fspath(out)
    check_not_inside_sources(out, prepared.sources)
    _make_folder(out)
    with writer_lock(out):
        return _plan_merge(prepared, out, overwrite, index)


def _make_folder(out: str) -> None:
    """Create ``out`` (where the lock file goes) unless it is a folder already."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputExists(f"{out}: exists and is not a folder")
    os.makedirs(out, exist_ok=True)


def _plan_merge(
    prepared: Prepared, out: str, overwrite: bool, index: bool
) -> tuple[Prepared, PlanState]:
    clean = overwrite
    if not overwrite and os.path.isdir(out):
        if os.path.exists(os.path.join(out, fmt.MANIFEST_FILE)):
            if _same_merge(prepared, load_manifest(out)):
                # killed after the manifest, before or during the clean-up: finish it
                remove_work(out)
                return prepared, PlanState.COMPLETE
        else:
            stored = load_plan(out)
            if stored is not None:
                if _comparable(stored) != _comparable(prepared):
                    raise OutputExists(
                        f"{out}: holds an unfinished merge of another blend, other sources or "
                        "other options; pass --force to start over"
                    )
                return stored, PlanState.RESUMED
            # killed before its plan was saved: what is there is ours and worth nothing
            names = [n for n in os.listdir(out) if not fmt.is_litter(n)]
            clean = bool(names) and all(map(is_ours, names))
    prepare_out(out, clean)
    os.makedirs(work_path(out), exist_ok=True)
    if index:
        write_index(prepared, out)
    save_plan(out, prepared)
    return prepared, PlanState.NEW


def write_index(
    prepared: Prepared, out: str | os.PathLike, *, stop: threading.Event | None = None
) -> None:
    """Write the combined index of a planned merge into ``out``, unless it is there already.

    Needs no shard: :func:`execute` runs it in a thread while the shards are copied, and sets
    ``stop`` to have it give up (between two sources) when the copy fails.
    """
    out = os.fspath(out)
    entry_path = work_path(out, INDEX_ENTRY_FILE)
    if os.path.exists(entry_path):
        return
    try:
        written = write_index_file(
            out, fmt.INDEX_FILE, prepared.algorithm, prepared=prepared, stop=stop
        )
    except BaseException:
        remove_partial(out, own=True)
        raise
    atomic_write(entry_path, json.dumps(written.to_json(), sort_keys=True).encode())


def _without_source(blend: dict | None) -> dict | None:
    """A blend without the path of its file as typed: the same file reached from another
    folder, or spelled otherwise, is the same merge."""
    return None if blend is None else {k: v for k, v in blend.items() if k != "source"}


def _comparable(prepared: Prepared) -> dict:
    data = prepared.to_json()
    data["blend"] = _without_source(data["blend"])
    return data


def _same_merge(prepared: Prepared, manifest: Manifest) -> bool:
    """Whether the finished repack ``manifest`` is what ``prepared`` would write."""
    return (
        manifest.algorithm == prepared.algorithm
        and manifest.shard_size == prepared.plan.shard_size
        and _without_source(manifest.blend.to_json()) == _without_source(prepared.blend.to_json())
        and not manifest.appended
        and all(shard.codec == prepared.codec_name for shard in manifest.shards)
        and [(s.path, s.idx_checksum, s.bin_size) for s in manifest.sources]
        == [(i.path, c, i.bin_size) for i, c in zip(prepared.sources, prepared.idx_checksums)]
    )


def run_task(
    out: str | os.PathLike,
    task: int = 0,
    tasks: int = 1,
    *,
    workers: int = 1,
    progress: Progress = no_progress,
) -> tuple[int, int]:
    """Copy the shards of task ``task`` of ``tasks`` (shard ``k`` when ``k % tasks == task``),
    skipping finished ones. Any process on any machine sharing ``out`` may run any task.

    Returns:
        (shards copied, shards skipped because already finished).
    """
    store = open_store(out)
    if not store.local:
        return objects.run_task(store, task, tasks, workers=workers, progress=progress)
    out = os.fspath(out)
    if not 0 <= task < tasks:
        raise InputError(f"task {task} is not in 0..{tasks - 1}")
    if not os.path.isdir(out):
        require_plan(out)  # says what to run first
    with writer_lock(out, shared=True):
        return _run_task(out, task, tasks, workers, progress)


def _run_task(out: str, task: int, tasks: int, workers: int, progress: Progress) -> tuple[int, int]:
    prepared = require_plan(out)
    mine = [s for s in prepared.plan.shards if s.number % tasks == task]
    todo = [s for s in mine if not shard_finished(out, s, prepared.codec_name)]
    advance = progress("merge", sum(s.size for s in todo))
    try:
        copy_shards(out, prepared, todo, workers, advance)
    except BaseException:
        remove_partial(out, own=True)
        raise
    return len(todo), len(mine) - len(todo)


def finalize(out: str | os.PathLike, *, progress: Progress = no_progress) -> MergeResult:
    """Write the manifest once every shard has its receipt; remove the work folder."""
    started = time.monotonic()
    store = open_store(out)
    if not store.local:
        return objects.finalize(store, progress=progress)
    out = os.fspath(out)
    if not os.path.isdir(out):
        require_plan(out)  # says what to run first
    with writer_lock(out):
        return _finalize(out, started)


def _finalize(out: str, started: float) -> MergeResult:
    prepared = require_plan(out)
    codec = prepared.codec_name
    missing = [s.name for s in prepared.plan.shards if not shard_finished(out, s, codec)]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise InputError(f"{out}: {plural(len(missing), 'shard')} not finished yet: {shown}")
    receipts = {shard.number: Receipt.load(out, shard.number) for shard in prepared.plan.shards}
    write_index(prepared, out)  # not there if the merge was planned without it and killed
    index = IndexWritten.from_json(read_work_json(work_path(out, INDEX_ENTRY_FILE)))
    body = manifest_body(out, prepared, receipts, index)
    if prepared.fingerprints:
        body[fmt.FINGERPRINT_MEMBER] = assemble(out, fmt.fingerprint_name(0), prepared)
    atomic_write(os.path.join(out, fmt.MANIFEST_FILE), dump_manifest(body, prepared.algorithm))
    remove_work(out)  # and the temp files killed runs left, such as an unfinished shard
    return MergeResult(
        out,
        len(prepared.plan.shards),
        len(prepared.sources),
        prepared.plan.total_bytes,
        time.monotonic() - started,
    )


def merge(
    blend_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    algorithm: str = DEFAULT,
    codec: tuple[str, int] | None = None,
    fingerprints: bool = True,
    overwrite: bool = False,
    workers: int = 1,
    progress: Progress = no_progress,
) -> MergeResult:
    """Repack the blend at ``blend_path`` into the folder ``out``: plan, every task, finalize.

    An unfinished merge of the same blend with the same options in ``out`` is resumed.
    """
    prepared = prepare(
        blend_path,
        shard_size=shard_size,
        algorithm=algorithm,
        codec=codec,
        fingerprints=fingerprints,
        progress=progress,
    )
    return execute(prepared, out, overwrite=overwrite, workers=workers, progress=progress)


def execute(
    prepared: Prepared,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    workers: int = 1,
    progress: Progress = no_progress,
) -> MergeResult:
    """Write the repack planned in ``prepared`` into ``out``, resuming an unfinished run.

    Raises:
        OutputExists: ``out`` is not empty and ``overwrite`` is false, or holds foreign files.
        SourceError: a source changed or vanished since it was validated.
    """
    started = time.monotonic()
    store = open_store(out)
    if not store.local:
        return objects.execute(
            prepared, store, overwrite=overwrite, workers=workers, progress=progress
        )
    out = os.fspath(out)
    check_not_inside_sources(out, prepared.sources)
    _make_folder(out)
    with writer_lock(out):
        return _execute(prepared, out, overwrite, workers, progress, started)


def resume(
    out: str | os.PathLike, *, workers: int = 1, progress: Progress = no_progress
) -> MergeResult:
    """Finish the interrupted merge in ``out``: every remaining task, then finalize.

    Returns:
        What was written, ``resumed_shards`` counting the shards already done.
    """
    store = open_store(out)
    if not store.local:
        return objects.resume(store, workers=workers, progress=progress)
    out = os.fspath(out)
    if not os.path.isdir(out):
        require_plan(out)  # says what to run first
    with writer_lock(out):
        _, skipped = run_task(out, workers=workers, progress=progress)
        return dataclasses.replace(finalize(out, progress=progress), resumed_shards=skipped)


def _execute(
    prepared: Prepared,
    out: str,
    overwrite: bool,
    workers: int,
    progress: Progress,
    started: float,
) -> MergeResult:
    prepared, state = plan_merge(prepared, out, overwrite=overwrite, index=False)
    if state is PlanState.COMPLETE:
        plan = prepared.plan
        return MergeResult(
            out,
            len(plan.shards),
            len(prepared.sources),
            plan.total_bytes,
            time.monotonic() - started,
            len(plan.shards),
        )
    # the index needs no shard: write it in a thread while the shards are copied (reading
    # and writing it releases the GIL most of the time, and so does copy_file_range)
    stop = threading.Event()
    with ThreadPoolExecutor(
        1, thread_name_prefix="repack-index", initializer=interrupt.block_in_thread
    ) as pool:
        index = pool.submit(write_index, prepared, out, stop=stop)
        try:
            _, skipped = run_task(out, workers=workers, progress=progress)
            interrupt.result_of(index)
        except Exception:
            stop.set()  # the copy failed: do not wait for a whole index
            # the index thread may have failed first (a source changed) and removed the
            # temp files of the folder, the copy's too: its error is the one to tell
            first = index.exception()
            if first is not None and not isinstance(first, Stopped):
                raise first from None
            raise
        except BaseException:
            stop.set()  # interrupted: do not wait for a whole index
            raise
    result = finalize(out, progress=progress)
    return MergeResult(
        result.out,
        result.shards,
        result.sources,
        result.bytes,
        time.monotonic() - started,
        skipped,
    )
