"""Prove a repack intact: recompute every checksum and compare with the manifest.

What is checked: the manifest against its own checksum; the index file against its checksum;
each source's index entries against the checksum of its original ``.idx`` (so ``extract`` would
reproduce it byte for byte); every shard against its checksum, each stored segment of source
data against its own checksum, and each source's data against the checksum of its original
``.bin``. With ``sources=True`` the original prefixes, where they still exist, are re-read and
compared byte for byte with what the repack holds.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from repack import interrupt
from repack.checksum import Hasher, digest_of, new_hasher
from repack.errors import (
    FormatError,
    InputError,
    ObjectMissing,
    RepackError,
    StoreError,
    UnsafePath,
    raise_if_unreadable,
)
from repack.fileio import BUFFER, CHUNK, hash_range, io_buffer
from repack.format.codec import CompressedShard
from repack.format.manifest import Manifest, SourceEntry
from repack.progress import Progress, no_progress
from repack.read.originals import compare_originals
from repack.read.reader import Repack
from repack.store import names_folder, open_store
from repack.store.base import Handle

__all__ = ["DEFAULT_WORKERS", "Problem", "VerifyReport", "verify"]


@dataclass(frozen=True)
class Problem:
    """One thing found wrong: the file, what is wrong, and the sources it affects."""

    file: str
    message: str
    sources: tuple[str, ...] = ()

    def __str__(self) -> str:
        affected = f" (affects {', '.join(self.sources)})" if self.sources else ""
        return f"{self.file}: {self.message}{affected}"


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`."""

    path: str
    problems: list[Problem] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    sources: int = 0
    originals_compared: int = 0
    originals_missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether everything checked holds."""
        return not self.problems

    def to_json(self) -> dict:
        """Plain JSON-able form (``repack verify --json``)."""
        return {
            "path": self.path,
            "ok": self.ok,
            "files_checked": self.files,
            "bytes_checked": self.bytes,
            "sources_checked": self.sources,
            "originals_compared": self.originals_compared,
            "originals_missing": self.originals_missing,
            "problems": [
                {"file": p.file, "message": p.message, "sources": list(p.sources)}
                for p in self.problems
            ],
        }


#: Shards hashed at once by default: enough to keep a fast disk busy while hashing, few enough
#: not to make a disk seek between too many files.
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))


def verify(
    path: str | os.PathLike,
    *,
    sources: bool = False,
    workers: int | None = None,
    progress: Progress = no_progress,
) -> VerifyReport:
    """Check every checksum of the repack at ``path``; never raises for damage it finds.

    Args:
        path: The repack folder.
        sources: Also compare the original prefixes, where they exist, byte for byte.
        workers: Shards hashed at once, in threads; default ``DEFAULT_WORKERS``. The report
            is the same whatever the number.
        progress: Progress reporter factory (called from several threads when ``workers``
            > 1, never at the same time).

    Returns:
        The report; ``report.ok`` is true only when everything holds.
    """
    store = open_store(path)
    path = store.location
    report = VerifyReport(path)
    if not names_folder(path):
        raise InputError(f"{path}: no such folder")
    try:
        repack = Repack(path, backend="pread", check=False)
    except RepackError as err:
        raise_if_unreadable(err)
        report.problems.append(Problem(_file_of(err, path), _cause_of(err)))
        return report
    manifest = repack.manifest
    report.files = 1
    total = manifest.index_size + sum(s.size for s in manifest.shards)
    if sources:
        total += sum(s.bin_size for s in manifest.sources)
    workers = DEFAULT_WORKERS if workers is None else workers
    advance = progress("verify", total)
    pool = None
    if workers > 1:
        stop = threading.Event()
        advance = _serialized(advance, stop)
        pool = ThreadPoolExecutor(
            workers, thread_name_prefix="verify", initializer=interrupt.block_in_thread
        )
    try:
        shards = _hash_shards(repack, advance, pool)
        _verify_index(repack, report, advance)  # meanwhile, in this thread
        _report_shards(repack, report, shards())
    except BaseException:
        if pool is not None:
            stop.set()  # the threads stop at their next progress report (Ctrl-C, a bug)
        raise
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    report.sources = len(manifest.sources)
    _verify_fingerprints(repack, report)
    if sources:
        for source, problem in compare_originals(repack, advance):
            if problem is None:
                report.originals_missing.append(source.name)
                continue
            report.originals_compared += 1
            if problem:
                report.problems.append(Problem(source.path, problem, (source.name,)))
    repack.close()
    return report


def _verify_fingerprints(repack: Repack, report: VerifyReport) -> None:
    """The fingerprint file, if the manifest names one: its header and counts, then its
    checksum (docs/format.md 2.11). A repack without one is fine."""
    from repack.read.fingerprints import check_member, load_fingerprints, member_of

    member = member_of(repack.manifest)
    if member is None:
        return
    name = str(member.get("file"))
    if check_member(repack.path, repack.manifest) is None:
        # the stored file itself, hashed as it is read (on object storage, a copy in the
        # node cache may be older)
        problem = _hash_stored_fingerprints(repack, member)
        if problem:
            report.problems.append(Problem(name, problem))
            return
    found = load_fingerprints(repack.path, repack.manifest)  # its header and counts
    if isinstance(found, str):  # why it is unusable (an Unusable: the cause apart)
        report.problems.append(Problem(name, found.cause))
        return
    report.files += 1
    report.bytes += int(member["size"])


def _hash_stored_fingerprints(repack: Repack, member: dict) -> str:
    """Why the stored fingerprint file is not what its manifest member says (its size and
    checksum, read from the store), or ``""``."""
    name = str(member["file"])
    try:
        handle, size = _open_file(repack, name)
    except (StoreError, OSError) as err:
        return _unreadable(err)
    try:
        if size != member["size"]:
            return f"{size} bytes, expected {member['size']}"
        hasher = new_hasher(repack.manifest.algorithm)
        for piece in handle.scan(0, size):
            hasher.update(piece)
    except (RepackError, OSError) as err:
        return _unreadable(err)
    finally:
        handle.close()
    computed = digest_of(hasher, repack.manifest.algorithm)
    if computed != member.get("checksum"):
        return f"stored checksum {member.get('checksum')}, computed {computed}"
    return ""


def _file_of(err: Exception, folder: str) -> str:
    """The name, in the repack ``folder``, of the file ``err`` is about (its ``location``);
    ``folder`` itself when it is about no file of it, or does not say."""
    where = getattr(err, "location", None)
    if where is None:
        return folder
    inside = where.startswith(folder.rstrip("/") + "/") or where.startswith(
        os.path.join(folder, "")
    )
    return where[len(folder.rstrip("/")) + 1 :] if inside else folder


def _cause_of(err: Exception) -> str:
    """The message of ``err`` without the location it starts with (``RepackError.cause``)."""
    return err.cause if isinstance(err, RepackError) else str(err)


def _open_file(repack: Repack, name: str, etag: str | None = None) -> tuple[Handle, int]:
    """A read handle of file ``name`` of the repack (a local file's descriptor, or ranged
    reads of the object pinned to ``etag`` or its version now), and its size.

    Raises:
        OSError: a local file cannot be opened.
        StoreError: the file or object is not there (ObjectMissing), or cannot be read.
    """
    handle = repack.store.open(name, None, etag)
    return handle, handle.size


def _unreadable(err: Exception) -> str:
    """What a problem says of a file that cannot be read because it is missing or damaged
    (raises ``err`` again if the store, not the file, is at fault:
    :func:`~repack.errors.raise_if_unreadable`)."""
    raise_if_unreadable(err)
    if isinstance(err, OSError):
        return f"cannot read: {err.strerror}"
    if isinstance(err, ObjectMissing):
        return "cannot read: not found"
    return _cause_of(err)


def _verify_index(repack: Repack, report: VerifyReport, advance) -> None:
    manifest = repack.manifest
    everyone = tuple(source.name for source in manifest.sources)
    try:
        fd, size = _open_file(repack, manifest.index_file)
    except (OSError, StoreError) as err:
        report.problems.append(Problem(manifest.index_file, _unreadable(err), everyone))
        advance(manifest.index_size)
        return
    try:
        hasher = new_hasher(manifest.algorithm)
        _hash_available(fd, 0, size, size, [hasher], advance, io_buffer(min(size, BUFFER)))
    finally:
        fd.close()
    report.files += 1
    report.bytes += size
    computed = digest_of(hasher, manifest.algorithm)
    if repack.index_error is not None:
        # header or size broken: no entry of the index can be trusted
        report.problems.append(
            Problem(manifest.index_file, _cause_of(repack.index_error), everyone)
        )
        return
    damaged = []
    for source in manifest.sources:
        idx_hasher = new_hasher(manifest.algorithm)
        for chunk in repack.source_idx_chunks(source):
            idx_hasher.update(chunk)
        if digest_of(idx_hasher, manifest.algorithm) != source.idx_checksum:
            damaged.append(source.name)
    if computed != manifest.index_checksum or damaged:
        message = f"checksum stored {manifest.index_checksum}, computed {computed}"
        if damaged:
            message += "; index entries no longer match the original .idx files"
        report.problems.append(Problem(manifest.index_file, message, tuple(damaged)))
    try:
        repack.check_structure()
    except RepackError as err:
        raise_if_unreadable(err)
        # check_structure also checks shard sizes; _verify_shards reports those, with the
        # sources they affect, so only a problem of another file is reported here
        damaged_file = _file_of(err, repack.path)
        shard_files = {shard.file for shard in manifest.shards}
        if damaged_file not in shard_files or isinstance(err, UnsafePath):
            report.problems.append(Problem(damaged_file, _cause_of(err)))


ShardOutcome = tuple[int, int, list[Problem]]
"""What checking one shard found: (files checked, bytes checked, problems)."""


def _hash_shards(
    repack: Repack, advance, pool: ThreadPoolExecutor | None
) -> Callable[[], dict[int, ShardOutcome]]:
    """Start hashing every shard, its segments and the sources cut across shards, in ``pool``
    (in the caller's thread, when it calls the result, if None). Returns a callable that waits
    for the outcomes and returns them by shard number.

    Shards linked by a source cut across them form a group, hashed in shard order by one
    thread (the checksum of such a source runs over its segments in order); the pool hashes
    several groups at once (both hash libraries and ``pread`` release the GIL), largest first.
    """
    manifest = repack.manifest
    by_shard: dict[int, list[tuple[SourceEntry, int]]] = {}
    for source in manifest.sources:
        for k, seg in enumerate(source.segments):
            by_shard.setdefault(seg.shard, []).append((source, k))
    # no larger than needed: allocating a buffer costs more than verifying a tiny repack
    size = max(1, min(BUFFER, max((s.size for s in manifest.shards), default=0)))

    def check(group: list) -> list[ShardOutcome]:
        buffer = io_buffer(size)
        spanning: dict[int, Hasher] = {}
        # sources with a segment already reported damaged: the checksum of the whole source
        # then fails too, and must not be blamed on the (intact) shard holding its last segment
        reported: set[int] = set()
        return [
            _verify_shard(repack, shard, by_shard, spanning, reported, advance, buffer)
            for shard in group
        ]

    groups = _shard_groups(manifest)
    if pool is None:
        return lambda: _by_number(groups, map(check, groups))
    # largest groups first: the last one to start is then a small one
    groups.sort(key=lambda g: -sum(s.size for s in g))
    futures = [pool.submit(check, group) for group in groups]
    return lambda: _by_number(groups, (interrupt.result_of(future) for future in futures))


def _by_number(groups: list[list], outcomes: Iterable[list[ShardOutcome]]) -> dict:
    return {
        shard.number: outcome
        for group, results in zip(groups, outcomes)
        for shard, outcome in zip(group, results)
    }


def _report_shards(repack: Repack, report: VerifyReport, found: dict[int, ShardOutcome]) -> None:
    """Add the outcomes of the shards to ``report``, in shard order."""
    for shard in repack.manifest.shards:
        files, checked, problems = found[shard.number]
        report.files += files
        report.bytes += checked
        report.problems.extend(problems)


class _Stopped(Exception):
    """Raised in a hashing thread when the verification it works for has failed."""


def _serialized(advance: Callable[[int], object], stop: threading.Event) -> Callable[[int], object]:
    """``advance``, called by one thread at a time; raises ``_Stopped`` once ``stop`` is set."""
    lock = threading.Lock()

    def locked(n: int) -> None:
        if stop.is_set():
            raise _Stopped
        with lock:
            advance(n)

    return locked


def _shard_groups(manifest: Manifest) -> list[list]:
    """The shards in groups that share no source, each in manifest (shard number) order."""
    position = {shard.number: i for i, shard in enumerate(manifest.shards)}
    parent = list(range(len(manifest.shards)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for source in manifest.sources:
        first = None
        for seg in source.segments:
            if seg.shard not in position:
                continue
            here = root(position[seg.shard])
            if first is None:
                first = here
            elif here != first:
                parent[max(here, first)] = min(here, first)
                first = min(here, first)
    groups: dict[int, list] = {}
    for i, shard in enumerate(manifest.shards):
        groups.setdefault(root(i), []).append(shard)
    return list(groups.values())


def _verify_shard(
    repack: Repack,
    shard,
    by_shard: dict[int, list[tuple[SourceEntry, int]]],
    spanning: dict[int, Hasher],
    reported: set[int],
    advance,
    buffer: bytearray,
) -> tuple[int, int, list[Problem]]:
    """Hash one shard; (files checked, bytes checked, problems found)."""
    algorithm = repack.manifest.algorithm
    problems: list[Problem] = []
    path = repack.shard_path(shard.number)
    members = sorted(by_shard.get(shard.number, ()), key=lambda m: m[0].segments[m[1]].offset)
    stored_problem = None
    try:
        fd, size = _open_file(repack, shard.file)
        if shard.codec is not None:
            stored = fd
            try:
                stored_problem = _check_stored(fd, size, shard, algorithm, advance, buffer)
                fd = _Logical(CompressedShard(path, shard.size, stored), stored, shard.size)
            except BaseException:
                stored.close()
                raise
            size = shard.size
    except (OSError, FormatError, StoreError) as err:
        cause = _unreadable(err)
        problems.append(Problem(shard.file, stored_problem or cause, _names(members)))
        reported.update(source.id for source, _ in members)
        advance(shard.size)
        return 0, 0, problems
    try:
        # An intact shard proves its segments intact: merge fed the same bytes to the shard's
        # and each segment's hasher. So hash each byte once; only if the shard's checksum
        # fails, hash again segment by segment to find the damaged sources.
        by_segment = shard.codec is not None or size != shard.size
        saved = {} if by_segment else {i: h.copy() for i, h in spanning.items()}
        shard_hasher, damaged = _hash_shard(
            fd, size, members, spanning, reported, algorithm, by_segment, advance, buffer
        )
        if not by_segment and digest_of(shard_hasher, algorithm) != shard.checksum:
            spanning.clear()
            spanning.update(saved)
            shard_hasher, damaged = _hash_shard(
                fd, size, members, spanning, reported, algorithm, True, _no_advance, buffer
            )
    finally:
        fd.close()
    computed = digest_of(shard_hasher, algorithm)
    damaged = list(dict.fromkeys(damaged))
    if size != shard.size:
        problems.append(
            Problem(
                shard.file,
                f"{size} bytes, expected {shard.size} "
                f"({'truncated' if size < shard.size else 'extended'})",
                tuple(damaged),
            )
        )
    elif computed != shard.checksum or damaged:
        where = "" if damaged else "; the damage is outside source data (alignment padding)"
        problems.append(
            Problem(
                shard.file,
                f"checksum stored {shard.checksum}, computed {computed}{where}",
                tuple(damaged),
            )
        )
    elif stored_problem:
        problems.append(Problem(shard.file, stored_problem))
    return 1, min(size, shard.size), problems


def _no_advance(n: int) -> None:
    pass


def _hash_shard(
    fd, size, members, spanning, reported, algorithm, by_segment, advance, buffer
) -> tuple[Hasher, list[str]]:
    """Hash a shard (``members``: its segments in offset order), feeding sources cut across
    shards to their ``spanning`` hashers, and, with ``by_segment``, each segment to its own.
    Returns the shard's hasher and the names of the damaged sources found."""
    shard_hasher = new_hasher(algorithm)
    damaged: list[str] = []
    position = 0
    for source, k in members:
        seg = source.segments[k]
        hashers: list[Hasher] = [shard_hasher]
        if seg.offset > position:
            _hash_available(fd, position, seg.offset - position, size, hashers, advance, buffer)
        seg_hasher = new_hasher(algorithm)
        if by_segment:
            hashers.append(seg_hasher)
        if len(source.segments) > 1:
            hashers.append(spanning.setdefault(source.id, new_hasher(algorithm)))
        complete = _hash_available(fd, seg.offset, seg.size, size, hashers, advance, buffer)
        if by_segment and (not complete or digest_of(seg_hasher, algorithm) != seg.checksum):
            damaged.append(source.name)
            reported.add(source.id)
        if len(source.segments) == 1:
            if seg.checksum != source.bin_checksum:
                damaged.append(source.name)
        elif k == len(source.segments) - 1:
            whole = digest_of(spanning.pop(source.id), algorithm)
            if whole != source.bin_checksum and source.id not in reported:
                damaged.append(source.name)
        position = seg.offset + seg.size
    if size > position:
        _hash_available(fd, position, size - position, size, [shard_hasher], advance, buffer)
    return shard_hasher, damaged


def _check_stored(fd, size: int, shard, algorithm: str, advance, buffer) -> str | None:
    """Size and checksum of a compressed shard's file (open as ``fd``, ``size`` bytes); a
    description of the damage or None."""
    hasher = new_hasher(algorithm)
    _hash_available(fd, 0, size, size, [hasher], lambda n: None, buffer)
    if size != shard.stored_size:
        kind = "truncated" if size < shard.stored_size else "extended"
        return f"compressed file has {size} bytes, expected {shard.stored_size} ({kind})"
    computed = digest_of(hasher, algorithm)
    if computed != shard.stored_checksum:
        return f"compressed file checksum stored {shard.stored_checksum}, computed {computed}"
    return None


def _names(members: list[tuple[SourceEntry, int]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(source.name for source, _ in members))


def _hash_available(handle: Handle, offset, size, file_size, hashers, advance, buffer) -> bool:
    """Hash what exists of ``[offset, offset + size)`` of the file open as ``handle``; False
    if the file ends before (or, for a compressed shard, a frame of the range does not
    decode)."""
    available = max(0, min(size, file_size - offset))
    fd = handle.fileno()
    if fd is not None:
        # a local file: through the caller's one buffer, no scan per call (a shard of
        # thousands of small segments is thousands of calls)
        hash_range(fd, offset, available, hashers, advance, buffer)
    else:
        done = 0
        try:
            for data in handle.scan(offset, available):
                for hasher in hashers:
                    hasher.update(data)
                advance(len(data))
                done += len(data)
        except FormatError:
            advance(size - done)
            return False
    if available < size:
        advance(size - available)
    return available == size


class _Logical(Handle):
    """The logical bytes of a compressed shard (its frames decoded), from the handle of the
    stored file, which it closes."""

    def __init__(self, frames: CompressedShard, stored: Handle, size: int) -> None:
        self._frames, self._stored = frames, stored
        self.size, self.path = size, stored.path

    def read(self, offset: int, size: int) -> bytes:
        return self._frames.read(offset, size)

    def scan(self, offset: int, size: int):
        for start in range(offset, offset + size, CHUNK):
            yield self._frames.read(start, min(CHUNK, offset + size - start))

    def close(self) -> None:
        self._frames.close()
        self._stored.close()
