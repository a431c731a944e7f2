"""The three steps of a merge and the functions that chain them.

1. **plan** (:func:`plan_merge`): save the plan of :func:`~repack.merge.prepare.prepare` in
   ``OUT/.work/plan.json`` by conditional create and write the combined index
   (:func:`write_index`);
2. **tasks** (:func:`run_task`): write the shards; shard ``k`` belongs to task ``k % N``;
3. **finalize** (:func:`finalize`): check that every shard has its receipt, write the manifest
   by conditional create (the commit point), remove ``.work``.

:func:`merge` (= :func:`~repack.merge.prepare.prepare` + :func:`execute`) runs them all, the
index in a thread while the shards are written. Each step runs on any
:class:`~repack.store.Store`: under the writer lock of a local folder, where a second writer
cannot come in; on object storage, where there is no lock, the conditional creates of the
plan and the manifest are what keeps two writers from both committing.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from repack import interrupt
from repack.checksum import DEFAULT
from repack.errors import InputError, ObjectExists, ObjectMissing, OutputExists
from repack.format import spec as fmt
from repack.format.manifest import Manifest, dump_manifest, parse_manifest
from repack.merge.entries import manifest_body
from repack.merge.fingerprint_file import assemble
from repack.merge.index import IndexWritten, Stopped, write_index_file
from repack.merge.prepare import DEFAULT_SHARD_SIZE, MergeResult, Prepared, prepare
from repack.merge.shards import copy_shards
from repack.merge.workdir import (
    INDEX_ENTRY_KEY,
    PLAN_KEY,
    Receipt,
    check_not_inside_sources,
    finished_shards,
    is_ours,
    load_plan,
    prepare_out,
    read_work_json,
    remove_partial,
    remove_work,
    require_plan,
    save_plan,
    top_names,
)
from repack.progress import Progress, no_progress
from repack.store import Store, open_store
from repack.units import format_size, plural

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
    prepared: Prepared,
    out: str | os.PathLike | Store,
    *,
    overwrite: bool = False,
    index: bool = True,
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
    check_not_inside_sources(store, prepared.sources)
    store.prepare()  # (a local folder, where the lock file goes)
    with store.lock():
        return _plan_merge(prepared, store, overwrite, index)


def _plan_merge(
    prepared: Prepared, store: Store, overwrite: bool, index: bool
) -> tuple[Prepared, PlanState]:
    clean = overwrite
    if not overwrite:
        found = _finished_manifest(store)
        if found is not None:
            if _same_merge(prepared, found):
                # killed after the manifest, before or during the clean-up: finish it
                remove_work(store)
                return prepared, PlanState.COMPLETE
        else:
            stored = load_plan(store)
            if stored is not None:
                if _comparable(stored) != _comparable(prepared):
                    raise OutputExists(
                        f"{store.location}: holds an unfinished merge of "
                        f"{'; '.join(differences(stored, prepared))}; "
                        f"'repack merge {store.location} --resume' finishes it as it was "
                        "started, --force starts this one over",
                        path=store.location,
                    )
                return stored, PlanState.RESUMED
            # killed before its plan was saved: what is there is ours and worth nothing
            clean = all(map(is_ours, top_names(store)))
    prepare_out(store, clean)
    try:
        save_plan(store, prepared)
    except ObjectExists:
        # no lock keeps writers out here (object storage): another merge planned at the same
        # moment; go on with it if it is this one
        stored = load_plan(store)
        if stored is None or _comparable(stored) != _comparable(prepared):
            raise OutputExists(
                f"{store.location}: another merge of another blend or options planned here at "
                "the same time"
            ) from None
        return stored, PlanState.RESUMED
    if index:
        write_index(prepared, store)
    return prepared, PlanState.NEW


def _finished_manifest(store: Store) -> Manifest | None:
    """The manifest of the repack in ``store``, or None if there is none."""
    try:
        data, _ = store.get(fmt.MANIFEST_FILE, fmt.MAX_MANIFEST_SIZE)
    except ObjectMissing:
        return None
    return parse_manifest(data, store.url(fmt.MANIFEST_FILE))


def write_index(
    prepared: Prepared, out: str | os.PathLike | Store, *, stop: threading.Event | None = None
) -> None:
    """Write the combined index of a planned merge into ``out``, unless it is there already.

    Needs no shard: :func:`execute` runs it in a thread while the shards are copied, and sets
    ``stop`` to have it give up (between two sources) when the copy fails.
    """
    store = open_store(out)
    if store.stat(INDEX_ENTRY_KEY) is not None:
        return
    try:
        with store.staged(fmt.INDEX_FILE) as path:
            written = write_index_file(
                path, fmt.INDEX_FILE, prepared.algorithm, prepared=prepared, stop=stop
            )
    except BaseException:
        remove_partial(store, own=True)
        raise
    store.put(INDEX_ENTRY_KEY, json.dumps(written.to_json(), sort_keys=True).encode())


def _without_source(blend: dict | None) -> dict | None:
    """A blend without the path of its file as typed: the same file reached from another
    folder, or spelled otherwise, is the same merge."""
    return None if blend is None else {k: v for k, v in blend.items() if k != "source"}


def _comparable(prepared: Prepared) -> dict:
    data = prepared.to_json()
    data["blend"] = _without_source(data["blend"])
    return data


def differences(stored: Prepared, prepared: Prepared, shown: int = 3) -> list[str]:
    """What differs between the unfinished merge ``stored`` and ``prepared``, as the user
    would say it: the options (``--shard-size 8.0 MiB → 64.0 GiB (the default)``), the blend,
    the sources (up to ``shown`` named). Options that do not change what is written
    (``--workers``, ``--quiet``) are not in a plan, so never differ."""
    found = []
    old, new = stored.plan.shard_size, prepared.plan.shard_size
    if old != new:
        default = " (the default)" if new == DEFAULT_SHARD_SIZE else ""
        found.append(f"--shard-size {format_size(old)} → {format_size(new)}{default}")
    if stored.algorithm != prepared.algorithm:
        default = " (the default)" if prepared.algorithm == DEFAULT else ""
        found.append(f"--checksum {stored.algorithm} → {prepared.algorithm}{default}")
    if stored.codec != prepared.codec:

        def codec(value):
            return "none" if value is None else f"{value[0]}:{value[1]}"

        found.append(f"--compress {codec(stored.codec)} → {codec(prepared.codec)}")
    if stored.fingerprints != prepared.fingerprints:
        found.append(
            "--no-fingerprints → fingerprints (the default)"
            if prepared.fingerprints
            else "fingerprints → --no-fingerprints"
        )
    if _without_source(stored.blend.to_json()) != _without_source(prepared.blend.to_json()):
        found.append("another blend (its splits, prefixes or weights)")
    before = {info.path: (info, c) for info, c in zip(stored.sources, stored.idx_checksums)}
    after = {info.path: (info, c) for info, c in zip(prepared.sources, prepared.idx_checksums)}

    def named(paths: list[str]) -> str:
        more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
        return ", ".join(paths[:shown]) + more

    gone = [path for path in before if path not in after]
    added = [path for path in after if path not in before]
    # checksums of one algorithm only compare: with another, the sizes
    same_algorithm = stored.algorithm == prepared.algorithm
    changed = [
        path
        for path, (info, checksum) in after.items()
        if path in before
        and (
            before[path][0].bin_size != info.bin_size
            or (same_algorithm and before[path][1] != checksum)
        )
    ]
    if gone:
        found.append(f"other sources: without {named(gone)}")
    if added:
        found.append(f"other sources: with {named(added)} too")
    if changed:
        found.append(f"sources changed since it started: {named(changed)} (.idx or .bin)")
    if not found and list(before) != list(after):
        found.append("its sources in another order")
    return found or ["another plan (the same blend and options planned otherwise)"]


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
    out: str | os.PathLike | Store,
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
    if not 0 <= task < tasks:
        raise InputError(f"task {task} is not in 0..{tasks - 1}")
    if store.stat(PLAN_KEY) is None:
        require_plan(store)  # says what to run first
    with store.lock(shared=True):
        return _run_task(store, task, tasks, workers, progress)


def _run_task(
    store: Store, task: int, tasks: int, workers: int, progress: Progress
) -> tuple[int, int]:
    prepared = require_plan(store)
    mine = [s for s in prepared.plan.shards if s.number % tasks == task]
    done = finished_shards(store, mine, prepared.codec_name)
    todo = [s for s in mine if s.number not in done]
    advance = progress("merge", sum(s.size for s in todo))
    try:
        copy_shards(store, prepared, todo, workers, advance)
    except BaseException:
        remove_partial(store, own=True)
        raise
    return len(todo), len(mine) - len(todo)


def finalize(out: str | os.PathLike | Store, *, progress: Progress = no_progress) -> MergeResult:
    """Write the manifest once every shard has its receipt; remove the work folder.

    The manifest is the commit point, written by conditional create: of two writers finishing
    at once on object storage, where no lock keeps them apart, one commits and the other is
    told so (ObjectExists). A local folder's exclusive lock keeps a second writer out; what
    it can find is a manifest of this very merge, written by a run killed before its
    clean-up, which it finishes.

    Raises:
        ObjectExists: another writer committed a repack here first (this one wrote nothing
            that stays: the work objects are removed, as that writer removes them).
    """
    started = time.monotonic()
    store = open_store(out)
    if store.stat(PLAN_KEY) is None:
        require_plan(store)  # says what to run first
    with store.lock():
        prepared = require_plan(store)
        try:
            _commit(store, prepared)
        except (ObjectExists, ObjectMissing):
            found = _finished_manifest(store)
            if found is None:
                raise  # not another writer's commit: a real error
            if not (store.exclusive_lock and _same_merge(prepared, found)):
                # another finalize committed while this one read the work files it removed
                remove_work(store)
                raise ObjectExists(
                    f"{store.url(fmt.MANIFEST_FILE)}: another writer committed a repack here "
                    "first; this merge did not replace it (run 'repack verify' on it, or "
                    "choose another prefix)",
                    location=store.url(fmt.MANIFEST_FILE),
                ) from None
        remove_work(store)  # and the temp files killed runs left, such as an unfinished shard
    return MergeResult(
        store.location,
        len(prepared.plan.shards),
        len(prepared.sources),
        prepared.plan.total_bytes,
        time.monotonic() - started,
    )


def _commit(store: Store, prepared: Prepared) -> None:
    """Check every shard is finished, then write the manifest (by conditional create)."""
    codec = prepared.codec_name
    done = finished_shards(store, prepared.plan.shards, codec)
    missing = [s.name for s in prepared.plan.shards if s.number not in done]
    if missing and store.stat(fmt.MANIFEST_FILE) is not None:
        raise ObjectExists(store.url(fmt.MANIFEST_FILE))
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise InputError(
            f"{store.location}: {plural(len(missing), 'shard')} not finished yet: {shown}"
        )
    receipts = {shard.number: Receipt.load(store, shard.number) for shard in prepared.plan.shards}
    write_index(prepared, store)  # not there if the merge was planned without it and killed
    index = IndexWritten.from_json(read_work_json(store, INDEX_ENTRY_KEY))
    body = manifest_body(store, prepared, receipts, index)
    if prepared.fingerprints:
        body[fmt.FINGERPRINT_MEMBER] = assemble(store, fmt.fingerprint_name(0), prepared)
    store.create(fmt.MANIFEST_FILE, dump_manifest(body, prepared.algorithm))


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
    out: str | os.PathLike | Store,
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
    check_not_inside_sources(store, prepared.sources)
    store.prepare()
    with store.lock():
        return _execute(prepared, store, overwrite, workers, progress, started)


def resume(
    out: str | os.PathLike | Store, *, workers: int = 1, progress: Progress = no_progress
) -> MergeResult:
    """Finish the interrupted merge in ``out``: every remaining task, then finalize.

    Returns:
        What was written, ``resumed_shards`` counting the shards already done.
    """
    store = open_store(out)
    if store.stat(PLAN_KEY) is None:
        require_plan(store)  # says what to run first
    with store.lock():
        _, skipped = run_task(store, workers=workers, progress=progress)
        return dataclasses.replace(finalize(store, progress=progress), resumed_shards=skipped)


def _execute(
    prepared: Prepared,
    store: Store,
    overwrite: bool,
    workers: int,
    progress: Progress,
    started: float,
) -> MergeResult:
    prepared, state = plan_merge(prepared, store, overwrite=overwrite, index=False)
    if state is PlanState.COMPLETE:
        plan = prepared.plan
        return MergeResult(
            store.location,
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
        index = pool.submit(write_index, prepared, store, stop=stop)
        try:
            _, skipped = run_task(store, workers=workers, progress=progress)
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
    result = finalize(store, progress=progress)
    return MergeResult(
        result.out,
        result.shards,
        result.sources,
        result.bytes,
        time.monotonic() - started,
        skipped,
    )
