"""Execute a repack: validate the blend's sources, plan shards, copy data, write the index,
and write the manifest last, atomically.

A merge runs in three steps, which :func:`merge` chains and which can also run apart, on
several machines sharing the file system:

1. **plan** (:func:`plan_merge`): validate every source, plan the shards, write the combined
   index (:func:`write_index`) and save the plan in ``OUT/.work/plan.json``; :func:`merge`
   writes the index in a thread while the tasks copy the shards instead;
2. **tasks** (:func:`run_task`): copy the shards; shard ``k`` belongs to task ``k % N``. Each
   finished shard is renamed into place, then a receipt with its checksums is saved in
   ``OUT/.work``;
3. **finalize** (:func:`finalize`): check that every shard has its receipt, write the manifest,
   remove ``.work``.

Until the manifest exists the output folder is not a repack: an interrupted merge never leaves
a folder that looks complete. Run again, the same merge finds its plan and skips every shard
that has a receipt, and ends with the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass

import numpy as np

from repack import __version__
from repack import format as fmt
from repack.blend import Blend, load_blend
from repack.checksum import DEFAULT, digest_of, new_hasher
from repack.codec import BLOCK_SIZE, CompressedShard, compress_file
from repack.errors import FormatError, InputError, OutputExists, SourceError
from repack.fileio import (
    BUFFER,
    CHUNK,
    HashFeeder,
    atomic_write,
    copy_range,
    fsync_dir,
    hash_range,
    io_buffer,
)
from repack.manifest import dump_manifest, load_manifest
from repack.plan import Plan, PlannedSegment, PlannedShard, plan_repack
from repack.sources import SourceIndex, SourceInfo, read_source_index

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "MergeResult",
    "Prepared",
    "execute",
    "finalize",
    "merge",
    "plan_merge",
    "prepare",
    "run_task",
    "write_index",
]

#: Default largest shard: few enough files for any blend, small enough to copy, verify and
#: re-run one shard at a time.
DEFAULT_SHARD_SIZE = 64 * 1024**3
#: Folder of OUT holding the plan and shard receipts of an unfinished merge.
WORK_DIR = ".work"
PLAN_FILE = "plan.json"
PLAN_FORMAT = "repack-plan"

Progress = Callable[[str, int], Callable[[int], object]]
"""``progress(description, total)`` returns a callable that takes increments."""


@dataclass(frozen=True)
class Prepared:
    """A blend whose sources are validated, and the plan to repack it."""

    blend: Blend
    sources: tuple[SourceInfo, ...]
    prefixes: tuple[tuple[str, ...], ...]
    idx_checksums: tuple[str, ...]
    plan: Plan
    algorithm: str
    #: (codec, level) to store shards compressed, or None for raw shards.
    codec: tuple[str, int] | None = None

    @property
    def codec_name(self) -> str | None:
        """The codec of the shards, or None."""
        return self.codec[0] if self.codec else None

    def describe(self) -> dict:
        """The plan as plain JSON-able data (what ``merge --dry-run`` prints)."""
        return {
            "shard_size": self.plan.shard_size,
            "total_bytes": self.plan.total_bytes,
            "sources": len(self.sources),
            "shards": [
                {
                    "file": shard.name,
                    "dtype": fmt.dtype_from_code(shard.dtype_code).name,
                    "size": shard.size,
                    "sources": [self.prefixes[seg.source][0] for seg in shard.segments],
                }
                for shard in self.plan.shards
            ],
        }

    def to_json(self) -> dict:
        """Everything needed to run tasks and finalize, as plain JSON-able data."""
        return {
            "format": PLAN_FORMAT,
            "version": 1,
            "algorithm": self.algorithm,
            "codec": list(self.codec) if self.codec else None,
            "blend": self.blend.to_json(),
            "shard_size": self.plan.shard_size,
            "sources": [
                {**asdict(info), "prefixes": list(names), "idx_checksum": checksum}
                for info, names, checksum in zip(self.sources, self.prefixes, self.idx_checksums)
            ],
            "shards": [
                {
                    "number": shard.number,
                    "dtype_code": shard.dtype_code,
                    "segments": [
                        [
                            s.source,
                            s.first_sequence,
                            s.sequence_count,
                            s.offset,
                            s.size,
                            s.source_offset,
                        ]
                        for s in shard.segments
                    ],
                }
                for shard in self.plan.shards
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> Prepared:
        """Inverse of :meth:`to_json`."""
        if data.get("format") != PLAN_FORMAT or data.get("version") != 1:
            raise ValueError("not a repack plan of version 1")
        fields = SourceInfo.__dataclass_fields__
        sources = tuple(SourceInfo(**{k: s[k] for k in fields}) for s in data["sources"])
        shards = []
        by_source: list[list[PlannedSegment]] = [[] for _ in sources]
        for item in data["shards"]:
            shard = PlannedShard(item["number"], item["dtype_code"])
            for source, first, count, offset, size, source_offset in item["segments"]:
                seg = PlannedSegment(
                    source, shard.number, first, count, offset, size, source_offset
                )
                shard.segments.append(seg)
                by_source[source].append(seg)
            shards.append(shard)
        for segs in by_source:
            segs.sort(key=lambda s: s.first_sequence)
        plan = Plan(data["shard_size"], tuple(shards), tuple(tuple(s) for s in by_source))
        return cls(
            Blend.from_json(data["blend"]),
            sources,
            tuple(tuple(s["prefixes"]) for s in data["sources"]),
            tuple(s["idx_checksum"] for s in data["sources"]),
            plan,
            data["algorithm"],
            tuple(data["codec"]) if data.get("codec") else None,
        )


@dataclass(frozen=True)
class MergeResult:
    """What a merge wrote."""

    out: str
    shards: int
    sources: int
    bytes: int
    seconds: float
    resumed_shards: int = 0


def _no_progress(description: str, total: int) -> Callable[[int], object]:
    return lambda n: None


def _spellings(blend: Blend) -> dict[str, list[str]]:
    """Each source path of the blend and how the blend writes it, in first-appearance order."""
    spellings: dict[str, list[str]] = {}
    for entries in blend.splits.values():
        for entry in entries or ():
            names = spellings.setdefault(entry.path, [])
            if entry.prefix not in names:
                names.append(entry.prefix)
    return spellings


def _validate(paths: Sequence[str], algorithm: str, progress: Progress):
    infos, checksums = [], []
    step = progress("validate", len(paths))
    for path in paths:
        hasher = new_hasher(algorithm)
        infos.append(read_source_index(path, hasher=hasher).info)
        checksums.append(digest_of(hasher, algorithm))
        step(1)
    return infos, checksums


def prepare(
    blend_path: str | os.PathLike,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    algorithm: str = DEFAULT,
    codec: tuple[str, int] | None = None,
    progress: Progress = _no_progress,
) -> Prepared:
    """Parse the blend, validate every source and plan the shards. Writes nothing.

    ``codec`` = ``("zstd", level)`` stores the shards compressed (:mod:`repack.codec`)."""
    blend = load_blend(blend_path)
    spellings = _spellings(blend)
    paths = list(spellings)
    infos, checksums = _validate(paths, algorithm, progress)
    plan = plan_repack(infos, shard_size, lambda i: read_source_index(paths[i]).lengths)
    return Prepared(
        blend,
        tuple(infos),
        tuple(tuple(spellings[p]) for p in paths),
        tuple(checksums),
        plan,
        algorithm,
        codec,
    )


# --- the output folder ------------------------------------------------------------------------

_OURS_FIXED = {fmt.MANIFEST_FILE, "cache", WORK_DIR}


def _is_ours(name: str) -> bool:
    base = name.split(".tmp", 1)[0]
    return base in _OURS_FIXED or fmt.is_shard_name(base) or fmt.is_index_name(base)


def _check_not_inside_sources(out: str, sources: Iterable[SourceInfo]) -> None:
    """Refuse an OUT that is a folder sources are read from, or that contains one.

    A subfolder of a source folder is fine: sources are read by prefix, never by listing a
    folder, so nothing written there can be read back as input.
    """
    target = os.path.realpath(out)
    for folder in sorted({os.path.dirname(os.path.realpath(s.path)) for s in sources}):
        if folder == target or folder.startswith(target + os.sep):
            raise InputError(
                f"{out}: the output folder {'is' if folder == target else 'contains'} {folder}, "
                "which holds sources of the blend being read; choose another folder"
            )


def _prepare_out(out: str, overwrite: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise OutputExists(f"{out}: exists and is not a folder")
    entries = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if entries and not overwrite:
        raise OutputExists(
            f"{out}: folder is not empty ({len(entries)} entries); choose an empty or new "
            "folder, or pass --force to replace the repack in it"
        )
    if entries:
        foreign = [e for e in entries if not _is_ours(e)]
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise OutputExists(
                f"{out}: holds files repack did not write ({shown}); refusing to replace them"
            )
        manifest = os.path.join(out, fmt.MANIFEST_FILE)
        if os.path.exists(manifest):
            os.unlink(manifest)
            fsync_dir(out)
        for entry in entries:
            path = os.path.join(out, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
    os.makedirs(out, exist_ok=True)


def _work(out: str, *names: str) -> str:
    return os.path.join(out, WORK_DIR, *names)


def _receipt_path(out: str, number: int) -> str:
    return _work(out, fmt.shard_name(number) + ".json")


def load_plan(out: str | os.PathLike) -> Prepared | None:
    """The plan of the unfinished merge in ``out``, or None if there is none."""
    path = _work(os.fspath(out), PLAN_FILE)
    try:
        with open(path, "rb") as stream:
            return Prepared.from_json(json.loads(stream.read()))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise FormatError(f"{path}: not a valid plan ({err}); start over with --force") from None


#: Bound on the files of the work folder read back (plan, index entry, receipts).
MAX_WORK_FILE = 256 * 1024 * 1024


def _read_work_json(path: str):
    """A JSON file of the work folder, or a FormatError naming it."""
    try:
        with open(path, "rb") as stream:
            data = stream.read(MAX_WORK_FILE + 1)
        if len(data) > MAX_WORK_FILE:
            raise ValueError(f"larger than {MAX_WORK_FILE} bytes")
        return json.loads(data)
    except (ValueError, RecursionError) as err:
        raise FormatError(f"{path}: damaged ({err}); start over with --force") from None


def _require_plan(out: str) -> Prepared:
    prepared = load_plan(out)
    if prepared is None:
        if os.path.exists(os.path.join(out, fmt.MANIFEST_FILE)):
            raise InputError(f"{out}: the merge is already finalized")
        raise InputError(
            f"{out}: no merge plan here; run 'repack merge BLEND {out} --plan-only' first"
        )
    return prepared


# --- the three steps ------------------------------------------------------------------------


def plan_merge(
    prepared: Prepared, out: str | os.PathLike, *, overwrite: bool = False, index: bool = True
) -> tuple[Prepared, str]:
    """Save the plan and write the index in ``out``, or find the same merge already there.

    With ``index=False`` only the plan is saved, and the index is left to
    :func:`write_index` (which :func:`finalize` calls if it has not run).

    Returns:
        The plan in force, and the state found: ``"new"`` (planned now), ``"resumed"`` (an
        unfinished merge of the same blend and options) or ``"complete"`` (a finished one).

    Raises:
        OutputExists: ``out`` holds something else and ``overwrite`` is false.
    """
    out = os.fspath(out)
    _check_not_inside_sources(out, prepared.sources)
    clean = overwrite
    if not overwrite and os.path.isdir(out):
        if os.path.exists(os.path.join(out, fmt.MANIFEST_FILE)):
            if _same_merge(prepared, load_manifest(out).raw):
                if os.path.isdir(_work(out)):  # killed after the manifest, before clean-up
                    shutil.rmtree(_work(out))
                return prepared, "complete"
        else:
            stored = load_plan(out)
            if stored is not None:
                if _comparable(stored) != _comparable(prepared):
                    raise OutputExists(
                        f"{out}: holds an unfinished merge of another blend, other sources or "
                        "other options; pass --force to start over"
                    )
                return stored, "resumed"
            # killed before its plan was saved: what is there is ours and worth nothing
            clean = bool(os.listdir(out)) and all(map(_is_ours, os.listdir(out)))
    _prepare_out(out, clean)
    os.makedirs(_work(out), exist_ok=True)
    if index:
        write_index(prepared, out)
    atomic_write(_work(out, PLAN_FILE), json.dumps(prepared.to_json(), sort_keys=True).encode())
    return prepared, "new"


def write_index(
    prepared: Prepared, out: str | os.PathLike, *, stop: threading.Event | None = None
) -> None:
    """Write the combined index of a planned merge into ``out``, unless it is there already.

    Needs no shard: :func:`execute` runs it in a thread while the shards are copied, and sets
    ``stop`` to have it give up (between two sources) when the copy fails.
    """
    out = os.fspath(out)
    entry_path = _work(out, "index.json")
    if os.path.exists(entry_path):
        return
    try:
        index_entry = _write_index(prepared, out, stop=stop)
    except BaseException:
        _remove_partial(out, own=True)
        raise
    atomic_write(entry_path, json.dumps(index_entry, sort_keys=True).encode())


def _without_source(blend: dict | None) -> dict | None:
    """A blend without the path of its file as typed: the same file reached from another
    folder, or spelled otherwise, is the same merge."""
    return None if blend is None else {k: v for k, v in blend.items() if k != "source"}


def _comparable(prepared: Prepared) -> dict:
    data = prepared.to_json()
    data["blend"] = _without_source(data["blend"])
    return data


def _same_merge(prepared: Prepared, raw: dict) -> bool:
    """Whether the finished repack ``raw`` (a manifest) is what ``prepared`` would write."""
    return (
        raw.get("checksum_algorithm") == prepared.algorithm
        and raw.get("shard_size") == prepared.plan.shard_size
        and _without_source(raw.get("blend")) == _without_source(prepared.blend.to_json())
        and "appended" not in raw
        and all(shard.get("codec") == prepared.codec_name for shard in raw["shards"])
        and [(s["path"], s["idx_checksum"], s["bin_size"]) for s in raw["sources"]]
        == [(i.path, c, i.bin_size) for i, c in zip(prepared.sources, prepared.idx_checksums)]
    )


def _remove_partial(out: str, *, own: bool = False) -> None:
    """Remove temp files from OUT and its work folder: all of them, or with ``own`` only
    this process's (other tasks may be writing theirs at the same time)."""
    mark = f".tmp-{os.getpid()}" if own else ".tmp"
    for folder in (out, _work(out)):
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            if mark in name and not os.path.isdir(path):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def _tmp(path: str) -> str:
    """This process's temp name for ``path``: two runs of one task never share a file."""
    return f"{path}.tmp-{os.getpid()}"


def _finished(out: str, shard: PlannedShard, codec: str | None = None) -> bool:
    """Whether ``shard`` has a receipt and its file has the size the receipt records."""
    try:
        with open(_receipt_path(out, shard.number), "rb") as stream:
            receipt = json.loads(stream.read())
        size = os.stat(os.path.join(out, fmt.shard_name(shard.number, codec))).st_size
    except (FileNotFoundError, ValueError):
        return False
    return size == receipt.get("stored_size", shard.size)


def run_task(
    out: str | os.PathLike,
    task: int = 0,
    tasks: int = 1,
    *,
    workers: int = 1,
    progress: Progress = _no_progress,
) -> tuple[int, int]:
    """Copy the shards of task ``task`` of ``tasks`` (shard ``k`` when ``k % tasks == task``),
    skipping finished ones. Any process on any machine sharing ``out`` may run any task.

    Returns:
        (shards copied, shards skipped because already finished).
    """
    out = os.fspath(out)
    if not 0 <= task < tasks:
        raise InputError(f"task {task} is not in 0..{tasks - 1}")
    prepared = _require_plan(out)
    mine = [s for s in prepared.plan.shards if s.number % tasks == task]
    todo = [s for s in mine if not _finished(out, s, prepared.codec_name)]
    advance = progress("merge", sum(s.size for s in todo))
    try:
        _copy_shards(out, prepared, todo, workers, advance)
    except BaseException:
        _remove_partial(out, own=True)
        raise
    return len(todo), len(mine) - len(todo)


def finalize(out: str | os.PathLike, *, progress: Progress = _no_progress) -> MergeResult:
    """Write the manifest once every shard has its receipt; remove the work folder."""
    started = time.monotonic()
    out = os.fspath(out)
    prepared = _require_plan(out)
    missing = [s.name for s in prepared.plan.shards if not _finished(out, s, prepared.codec_name)]
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise InputError(f"{out}: {len(missing)} shard(s) not finished yet: {shown}")
    receipts = {}
    for shard in prepared.plan.shards:
        receipts[shard.number] = _read_work_json(_receipt_path(out, shard.number))
    write_index(prepared, out)  # not there if the merge was planned without it and killed
    index_entry = _read_work_json(_work(out, "index.json"))
    body = _manifest_body(out, prepared, receipts, index_entry, progress)
    atomic_write(os.path.join(out, fmt.MANIFEST_FILE), dump_manifest(body, prepared.algorithm))
    shutil.rmtree(_work(out))
    _remove_partial(out)  # temp files a killed run left, such as an unfinished manifest
    fsync_dir(out)
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
    overwrite: bool = False,
    workers: int = 1,
    progress: Progress = _no_progress,
) -> MergeResult:
    """Repack the blend at ``blend_path`` into the folder ``out``: plan, every task, finalize.

    An unfinished merge of the same blend with the same options in ``out`` is resumed.
    """
    prepared = prepare(
        blend_path, shard_size=shard_size, algorithm=algorithm, codec=codec, progress=progress
    )
    return execute(prepared, out, overwrite=overwrite, workers=workers, progress=progress)


def execute(
    prepared: Prepared,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    workers: int = 1,
    progress: Progress = _no_progress,
) -> MergeResult:
    """Write the repack planned in ``prepared`` into ``out``, resuming an unfinished run.

    Raises:
        OutputExists: ``out`` is not empty and ``overwrite`` is false, or holds foreign files.
        SourceError: a source changed or vanished since it was validated.
    """
    started = time.monotonic()
    out = os.fspath(out)
    prepared, state = plan_merge(prepared, out, overwrite=overwrite, index=False)
    if state == "complete":
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
    with ThreadPoolExecutor(1, thread_name_prefix="repack-index") as pool:
        index = pool.submit(write_index, prepared, out, stop=stop)
        try:
            _, skipped = run_task(out, workers=workers, progress=progress)
        except BaseException:
            stop.set()  # the copy failed or was interrupted: do not wait for a whole index
            raise
        index.result()
    result = finalize(out, progress=progress)
    return MergeResult(
        result.out,
        result.shards,
        result.sources,
        result.bytes,
        time.monotonic() - started,
        skipped,
    )


# --- copying shards -----------------------------------------------------------------------------

_shared_counter = None


def _init_worker(counter) -> None:
    global _shared_counter
    _shared_counter = counter
    _die_with_parent()


def _die_with_parent() -> None:
    """Have the kernel kill this worker when the merge that started it dies (even by
    SIGKILL), so no orphan keeps writing shards while the merge is run again."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the worker ends with its last shard
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _count(n: int) -> None:
    with _shared_counter.get_lock():
        _shared_counter.value += n


def _worker_copy(out: str, number: int) -> int:
    prepared = load_plan(out)
    shard = next(s for s in prepared.plan.shards if s.number == number)
    _copy_shard(out, prepared, shard, _count, _buffer_for(prepared, [shard]))
    return number


def _buffer_for(prepared: Prepared, shards: Iterable[PlannedShard]) -> memoryview:
    # for copy_range where copy_file_range is refused (it reads and writes through this
    # buffer; see io_buffer); no larger than needed
    largest = max((seg.size for shard in shards for seg in shard.segments), default=0)
    return io_buffer(min(BUFFER, largest))


def _copy_shards(
    out: str,
    prepared: Prepared,
    shards: Sequence[PlannedShard],
    workers: int,
    advance: Callable[[int], object],
) -> None:
    if workers <= 1 or len(shards) <= 1:
        buffer = _buffer_for(prepared, shards)
        for shard in shards:
            _copy_shard(out, prepared, shard, advance, buffer)
        return
    context = multiprocessing.get_context("spawn")
    counter = context.Value("q", 0)
    reported = 0
    with ProcessPoolExecutor(
        min(workers, len(shards)),
        mp_context=context,
        initializer=_init_worker,
        initargs=(counter,),
    ) as pool:
        pending = {pool.submit(_worker_copy, out, s.number) for s in shards}
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()
            value = counter.value
            advance(value - reported)
            reported = value


def _open_source_bin(info: SourceInfo) -> int:
    path = info.path + ".bin"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise SourceError(f"{path}: cannot read .bin file: {err.strerror}") from None
    size = os.fstat(fd).st_size
    if size != info.bin_size:
        os.close(fd)
        raise SourceError(
            f"{path}: changed during the merge: {size} bytes, validated with {info.bin_size}"
        )
    return fd


def _copy_shard(
    out: str,
    prepared: Prepared,
    shard: PlannedShard,
    advance: Callable[[int], object],
    buffer: memoryview,
) -> None:
    """Copy the segments of one shard, rename it into place, then save its receipt."""
    algorithm = prepared.algorithm
    final = os.path.join(out, shard.name)
    tmp = _tmp(final)
    segment_hashers = {}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        shard_hasher = new_hasher(algorithm)
        with HashFeeder() as feeder:
            position = 0
            for seg in shard.segments:
                if seg.offset > position:
                    feeder.update((shard_hasher,), bytes(seg.offset - position))
                seg_hasher = new_hasher(algorithm)
                info = prepared.sources[seg.source]
                src = _open_source_bin(info)
                try:
                    copy_range(
                        src,
                        fd,
                        seg.source_offset,
                        seg.offset,
                        seg.size,
                        (shard_hasher, seg_hasher),
                        advance,
                        buffer,
                        feeder,
                    )
                finally:
                    os.close(src)
                segment_hashers[f"{seg.source}:{seg.first_sequence}"] = seg_hasher
                position = seg.offset + seg.size
            os.ftruncate(fd, shard.size)
            os.fsync(fd)  # while the feeder hashes the last chunks
    finally:
        os.close(fd)
    segment_sums = {key: digest_of(h, algorithm) for key, h in segment_hashers.items()}
    receipt = {"checksum": digest_of(shard_hasher, algorithm), "segments": segment_sums}
    if prepared.codec is None:
        os.replace(tmp, final)
    else:
        receipt.update(_compress_shard(out, prepared, shard, tmp))
    fsync_dir(out)
    atomic_write(_receipt_path(out, shard.number), json.dumps(receipt, sort_keys=True).encode())


def _compress_shard(out: str, prepared: Prepared, shard: PlannedShard, raw: str) -> dict:
    """Compress the finished raw shard ``raw`` into place; return its stored size and
    checksum for the receipt."""
    name, level = prepared.codec
    final = os.path.join(out, fmt.shard_name(shard.number, name))
    tmp = _tmp(final)
    stored_size = compress_file(raw, tmp, level)
    hasher = new_hasher(prepared.algorithm)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        hash_range(fd, 0, stored_size, [hasher])
    finally:
        os.close(fd)
    os.replace(tmp, final)
    os.unlink(raw)
    return {"stored_size": stored_size, "stored_checksum": digest_of(hasher, prepared.algorithm)}


# --- index and manifest -------------------------------------------------------------------------


def _write_index(
    prepared: Prepared,
    out: str,
    *,
    previous=None,
    name: str = fmt.INDEX_FILE,
    stop: threading.Event | None = None,
):
    """Write the index one source at a time: the sources of ``previous`` (an open Repack whose
    index is carried over) first, then those of ``prepared``. Returns the index entry of the
    manifest, with each new source's first sequence and document under ``"ranges"``."""
    old = previous.manifest.sources if previous is not None else ()
    new = prepared.sources
    n_seq = sum(s.sequence_count for s in old) + sum(s.sequence_count for s in new)
    n_doc = sum(s.document_count for s in old) + sum(s.document_count for s in new)
    layout = fmt.index_layout(n_seq, n_doc)
    final = os.path.join(out, name)
    tmp = _tmp(final)
    ranges = []
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, layout.size)
        os.pwrite(fd, fmt.pack_index_header(n_seq, n_doc), 0)
        seq = doc = 0
        for source in old:
            lengths, pointers, documents, modes = previous.source_arrays(source)
            _write_source_arrays(fd, layout, seq, doc, lengths, pointers, documents, modes)
            seq += source.sequence_count
            doc += source.document_count
        for i, info in enumerate(new):
            if stop is not None and stop.is_set():
                raise _Stopped
            index = _reread(info, prepared.idx_checksums[i], prepared.algorithm)
            _write_source_arrays(
                fd, layout, seq, doc, index.lengths, index.pointers, index.documents, index.modes
            )
            ranges.append([seq, doc])
            seq += info.sequence_count
            doc += info.document_count
        os.fsync(fd)
        hasher = new_hasher(prepared.algorithm)
        hash_range(fd, 0, layout.size, [hasher])
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(out)
    return {
        "file": name,
        "size": layout.size,
        "checksum": digest_of(hasher, prepared.algorithm),
        "sequence_count": n_seq,
        "document_count": n_doc,
        "ranges": ranges,
    }


class _Stopped(Exception):
    """Raised in the index thread when the merge it works for has failed."""


def _reread(info: SourceInfo, checksum: str, algorithm: str) -> SourceIndex:
    os.close(_open_source_bin(info))  # names a changed .bin as such
    hasher = new_hasher(algorithm)
    index = read_source_index(info.path, hasher=hasher)
    if digest_of(hasher, algorithm) != checksum:
        raise SourceError(f"{info.path}.idx: changed during the merge")
    return index


def _write_source_arrays(fd, layout, seq, doc, lengths, pointers, documents, modes) -> None:
    _pwrite_array(fd, lengths, layout.lengths + 4 * seq)
    _pwrite_array(fd, pointers, layout.pointers + 8 * seq)
    if modes is not None:
        _pwrite_array(fd, modes, layout.modes + seq)
    _pwrite_array(fd, documents, layout.documents + 8 * doc)


def _pwrite_array(fd: int, array: np.ndarray, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(array).view(np.uint8))
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _spanning_checksum(out: str, prepared: Prepared, source: int) -> str:
    """Checksum of a source cut across shards: its segments, read back in order."""
    hasher = new_hasher(prepared.algorithm)
    codec = prepared.codec_name
    for seg in prepared.plan.segments_by_source[source]:
        path = os.path.join(out, fmt.shard_name(seg.shard, codec))
        if codec is not None:
            shard = next(s for s in prepared.plan.shards if s.number == seg.shard)
            compressed = CompressedShard(path, shard.size)
            try:
                for start in range(seg.offset, seg.offset + seg.size, CHUNK):
                    n = min(CHUNK, seg.offset + seg.size - start)
                    hasher.update(compressed.read(start, n))
            finally:
                compressed.close()
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            hash_range(fd, seg.offset, seg.size, [hasher])
        finally:
            os.close(fd)
    return digest_of(hasher, prepared.algorithm)


def _new_entries(
    out: str, prepared: Prepared, receipts: dict, index_entry: dict, first_id: int = 0
) -> tuple[list[dict], list[dict]]:
    """Manifest entries of the shards and sources of ``prepared``."""
    plan = prepared.plan
    shards = []
    for shard in plan.shards:
        entry = {
            "file": fmt.shard_name(shard.number, prepared.codec_name),
            "dtype": fmt.dtype_from_code(shard.dtype_code).name,
            "dtype_code": shard.dtype_code,
            "size": shard.size,
            "checksum": receipts[shard.number]["checksum"],
        }
        if prepared.codec is not None:
            receipt = receipts[shard.number]
            entry.update(
                codec=prepared.codec[0],
                level=prepared.codec[1],
                block_size=BLOCK_SIZE,
                stored_size=receipt["stored_size"],
                stored_checksum=receipt["stored_checksum"],
            )
        shards.append(entry)
    sources = []
    for i, info in enumerate(prepared.sources):
        segments = [
            {
                "shard": seg.shard,
                "first": seg.first_sequence,
                "count": seg.sequence_count,
                "offset": seg.offset,
                "size": seg.size,
                "source_offset": seg.source_offset,
                "checksum": receipts[seg.shard]["segments"][f"{i}:{seg.first_sequence}"],
            }
            for seg in plan.segments_by_source[i]
        ]
        if len(segments) == 1:
            bin_checksum = segments[0]["checksum"]
        else:
            bin_checksum = _spanning_checksum(out, prepared, i)
        seq, doc = index_entry["ranges"][i]
        sources.append(
            {
                "id": first_id + i,
                "path": info.path,
                "prefixes": list(prepared.prefixes[i]),
                "dtype": info.dtype.name,
                "dtype_code": info.dtype_code,
                "multimodal": info.multimodal,
                "sequences": [seq, info.sequence_count],
                "documents": [doc, info.document_count],
                "tokens": info.token_count,
                "bin_size": info.bin_size,
                "idx_size": info.idx_size,
                "bin_checksum": bin_checksum,
                "idx_checksum": prepared.idx_checksums[i],
                "segments": segments,
            }
        )
    return shards, sources


def _index_member(index_entry: dict) -> dict:
    return {k: v for k, v in index_entry.items() if k != "ranges"}


def _manifest_body(
    out: str, prepared: Prepared, receipts: dict, index_entry: dict, progress: Progress
) -> dict:
    shards, sources = _new_entries(out, prepared, receipts, index_entry)
    return {
        "format": fmt.FORMAT_NAME,
        "version": fmt.FORMAT_VERSION,
        "created_by": f"repack {__version__}",
        "checksum_algorithm": prepared.algorithm,
        "alignment": fmt.ALIGNMENT,
        "shard_size": prepared.plan.shard_size,
        "index": _index_member(index_entry),
        "shards": shards,
        "sources": sources,
        "blend": prepared.blend.to_json(),
    }
