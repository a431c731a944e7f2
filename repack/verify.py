"""Prove a repack intact: recompute every checksum and compare with the manifest.

What is checked: the manifest against its own checksum; the index file against its checksum;
each source's index entries against the checksum of its original ``.idx`` (so ``extract`` would
reproduce it byte for byte); every shard against its checksum, each stored segment of source
data against its own checksum, and each source's data against the checksum of its original
``.bin``. With ``sources=True`` the original prefixes, where they still exist, are re-read and
compared byte for byte with what the repack holds.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from repack import interrupt
from repack.checksum import Hasher, digest_of, new_hasher
from repack.codec import CompressedShard
from repack.errors import (
    FormatError,
    InputError,
    RepackError,
    ShortRead,
    SourceMissing,
    StoreError,
    UnsafePath,
)
from repack.fileio import BUFFER, CHUNK, hash_range, io_buffer, read_range
from repack.manifest import Manifest, SourceEntry
from repack.progress import Progress, no_progress
from repack.reader import Repack
from repack.store import open_store
from repack.store.ahead import ordered
from repack.store.objects import RemoteShard
from repack.store.sources import bin_jobs, fetch_index, is_remote

__all__ = ["DEFAULT_WORKERS", "Problem", "VerifyReport", "verify"]

#: Bytes per ranged GET of an original ``.bin`` on object storage (``verify --sources``).
ORIGINAL_PIECE = 8 * 1024 * 1024


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
    path = os.fspath(path) if store.local else store.location
    report = VerifyReport(path)
    if store.local and not os.path.isdir(path):
        raise InputError(f"{path}: no such folder")
    try:
        repack = Repack(path, backend="pread", check=False)
    except RepackError as err:
        report.problems.append(Problem(_file_of(err, path), _cause_of(err, path)))
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
        _compare_originals(repack, report, advance)
    repack.close()
    return report


def _verify_fingerprints(repack: Repack, report: VerifyReport) -> None:
    """The fingerprint file, if the manifest names one: its header and counts, then its
    checksum (docs/format.md 2.11). A repack without one is fine."""
    from repack.fingerprints import check_file, check_member, load_fingerprints, member_of

    member = member_of(repack.manifest)
    if member is None:
        return
    name = str(member.get("file"))
    if not repack.store.local and check_member(repack.path, repack.manifest) is None:
        # the object itself, hashed as it is read (a copy in the node cache may be older)
        problem = _hash_remote_fingerprints(repack, member)
        if problem:
            report.problems.append(Problem(name, problem))
            return
    found = load_fingerprints(repack.path, repack.manifest)
    if isinstance(found, str):
        report.problems.append(Problem(name, _cause_of(ValueError(found), repack.path)))
        return
    try:
        check_file(repack.path, repack.manifest)
    except RepackError as err:
        report.problems.append(Problem(name, _cause_of(err, repack.path).split("; `")[0]))
    report.files += 1
    report.bytes += int(member["size"])


def _hash_remote_fingerprints(repack: Repack, member: dict) -> str:
    """Why the fingerprint file of a repack on object storage is not what its manifest
    member says (read from the server, size and checksum), or ``""``."""
    name = str(member["file"])
    try:
        handle, size = _open_file(repack, name)
    except StoreError as err:
        return _unreadable(err, repack.path)
    try:
        if size != member["size"]:
            return f"{size} bytes, expected {member['size']}"
        hasher = new_hasher(repack.manifest.algorithm)
        for piece in handle.scan(0, size):
            hasher.update(piece)
    except RepackError as err:
        return _unreadable(err, repack.path)
    finally:
        _close(handle)
    computed = digest_of(hasher, repack.manifest.algorithm)
    if computed != member.get("checksum"):
        return f"stored checksum {member.get('checksum')}, computed {computed}"
    return ""


def _file_of(err: Exception, folder: str) -> str:
    """The name, in the repack ``folder``, of the file ``err`` is about; ``folder`` itself
    when it is about no file of it."""
    where = getattr(err, "location", None)
    if where is None:  # an error raised without its location: its message starts with it
        where = str(err).split(": ", 1)[0]
    inside = where.startswith(folder.rstrip("/") + "/") or where.startswith(
        os.path.join(folder, "")
    )
    return where[len(folder.rstrip("/")) + 1 :] if inside else folder


def _cause_of(err: Exception, folder: str) -> str:
    """The message of ``err`` without the location it starts with."""
    text = str(err)
    where = getattr(err, "location", None)
    if where is not None and text.startswith(where + ": "):
        return text[len(where) + 2 :]
    head, sep, rest = text.partition(": ")
    return rest if sep and head.startswith(folder) else text


def _open_file(repack: Repack, name: str, etag: str | None = None):
    """A local descriptor of file ``name`` of the repack, or a
    :class:`~repack.store.objects.RemoteShard` of the object; and its size.

    Raises:
        OSError: a local file cannot be opened.
        StoreError: an object cannot be found or read.
    """
    if repack.store.local:
        fd = os.open(os.path.join(repack.path, name), os.O_RDONLY)
        return fd, os.fstat(fd).st_size
    found = repack.store.stat(name)
    if found is None:
        raise StoreError(f"{repack.store.url(name)}: not found", location=repack.store.url(name))
    return RemoteShard(repack.store, name, found.size, etag or found.etag), found.size


def _close(handle) -> None:
    os.close(handle) if isinstance(handle, int) else handle.close()


def _unreadable(err: Exception, folder: str) -> str:
    if isinstance(err, OSError):
        return f"cannot read: {err.strerror}"
    return _cause_of(err, folder)


def _verify_index(repack: Repack, report: VerifyReport, advance) -> None:
    manifest = repack.manifest
    everyone = tuple(source.name for source in manifest.sources)
    try:
        fd, size = _open_file(repack, manifest.index_file)
    except (OSError, StoreError) as err:
        report.problems.append(
            Problem(manifest.index_file, _unreadable(err, repack.path), everyone)
        )
        advance(manifest.index_size)
        return
    try:
        hasher = new_hasher(manifest.algorithm)
        _hash_available(fd, 0, size, size, [hasher], advance, io_buffer(min(size, BUFFER)))
    finally:
        _close(fd)
    report.files += 1
    report.bytes += size
    computed = digest_of(hasher, manifest.algorithm)
    if repack.index_error is not None:
        # header or size broken: no entry of the index can be trusted
        report.problems.append(
            Problem(manifest.index_file, _cause_of(repack.index_error, repack.path), everyone)
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
        # check_structure also checks shard sizes; _verify_shards reports those, with the
        # sources they affect, so only a problem of another file is reported here
        damaged_file = _file_of(err, repack.path)
        shard_files = {shard.file for shard in manifest.shards}
        if damaged_file not in shard_files or isinstance(err, UnsafePath):
            report.problems.append(Problem(damaged_file, _cause_of(err, repack.path)))


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
            stored_problem = _check_stored(fd, size, shard, algorithm, advance, buffer)
            stored = fd
            try:
                fd = CompressedShard(path, shard.size, None if isinstance(fd, int) else fd)
            finally:
                if isinstance(stored, int):
                    os.close(stored)
            size = shard.size
    except (OSError, FormatError, StoreError) as err:
        cause = _unreadable(err, repack.path)
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
        _close(fd)
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


def _hash_available(fd, offset, size, file_size, hashers, advance, buffer) -> bool:
    """Hash what exists of ``[offset, offset + size)``; False if the file ends before (or, for
    a compressed shard, a frame of the range does not decode)."""
    if isinstance(fd, RemoteShard):
        available = max(0, min(size, file_size - offset))
        for data in fd.scan(offset, available):
            for hasher in hashers:
                hasher.update(data)
            advance(len(data))
        if available < size:
            advance(size - available)
        return available == size
    if isinstance(fd, CompressedShard):
        done = 0
        try:
            while done < size:
                n = min(CHUNK, size - done)
                data = fd.read(offset + done, n)
                for hasher in hashers:
                    hasher.update(data)
                advance(n)
                done += n
        except FormatError:
            advance(size - done)
            return False
        return True
    available = max(0, min(size, file_size - offset))
    hash_range(fd, offset, available, hashers, advance, buffer)
    if available < size:
        advance(size - available)
    return available == size


def _compare_originals(repack: Repack, report: VerifyReport, advance) -> None:
    manifest: Manifest = repack.manifest
    largest = max((s.bin_size for s in manifest.sources), default=0)
    buffers = (io_buffer(min(BUFFER, largest)), io_buffer(min(BUFFER, largest)))
    remote = [source for source in manifest.sources if is_remote(source.path)]
    fetched = ordered(_original_jobs(remote)) if remote else iter(())
    for source in manifest.sources:
        if is_remote(source.path):  # an original on object storage, fetched ahead
            problem = _compare_remote_original(repack, source, fetched, report, advance)
            if problem:
                report.problems.append(Problem(source.path, problem, (source.name,)))
            continue
        bin_path, idx_path = source.path + ".bin", source.path + ".idx"
        if not (os.path.exists(bin_path) and os.path.exists(idx_path)):
            report.originals_missing.append(source.name)
            advance(source.bin_size)
            continue
        try:
            problem = _compare_source(repack, source, buffers, advance)
        except OSError as err:
            problem = f"cannot read the original: {err.strerror}"
        except (ShortRead, FormatError) as err:
            # a shard (or the original) shorter than the manifest says, a frame that does not
            # decompress: damage, which the shard checks above name too
            problem = f"cannot compare: {err}"
        report.originals_compared += 1
        if problem:
            report.problems.append(Problem(source.path, problem, (source.name,)))


def _compare_source(
    repack: Repack, source: SourceEntry, buffers: tuple[memoryview, memoryview], advance
) -> str:
    with open(source.path + ".idx", "rb") as stream:
        original_idx = stream.read(source.idx_size + 1)
    stored_idx = b"".join(bytes(chunk) for chunk in repack.source_idx_chunks(source))
    if original_idx != stored_idx:
        at = _first_difference(original_idx, stored_idx)
        return f"original .idx differs from the repack at byte {at}"
    fd = os.open(source.path + ".bin", os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != source.bin_size:
            advance(source.bin_size)
            return f"original .bin has {size} bytes, the repack {source.bin_size}"
        shard_fds: dict[int, int] = {}
        try:
            for seg in source.segments:
                # offsets are logical: a compressed shard is read through its frames, and
                # one on object storage through ranged reads
                compressed = repack.manifest.shards[seg.shard].codec is not None
                compressed = compressed or not repack.store.local
                if not compressed and seg.shard not in shard_fds:
                    shard_fds[seg.shard] = os.open(repack.shard_path(seg.shard), os.O_RDONLY)
                if not repack.store.local and repack.manifest.shards[seg.shard].codec is None:
                    # a raw shard on object storage: ranged GETs with read-ahead
                    problem = _compare_remote(repack, seg, fd, advance)
                    if problem:
                        return problem
                    continue
                done = unreported = 0
                while done < seg.size:
                    n = min(len(buffers[0]), seg.size - done)
                    # offsets are logical: a compressed shard is read through its frames
                    ours = (
                        repack.read_bytes(seg.shard, seg.offset + done, n)
                        if compressed
                        else read_range(shard_fds[seg.shard], seg.offset + done, n, buffers[0])
                    )
                    theirs = read_range(fd, seg.source_offset + done, n, buffers[1])
                    if not np.array_equal(
                        np.frombuffer(ours, np.uint8), np.frombuffer(theirs, np.uint8)
                    ):
                        at = seg.source_offset + done + _first_difference(ours, theirs)
                        return f"original .bin differs from the repack at byte {at}"
                    done += n
                    unreported += n
                    if unreported >= CHUNK or done == seg.size:
                        advance(unreported)
                        unreported = 0
        finally:
            for shard_fd in shard_fds.values():
                os.close(shard_fd)
    finally:
        os.close(fd)
    return ""


def _compare_remote(repack: Repack, seg, fd: int, advance) -> str:
    """Compare a segment of a raw shard on object storage with the original ``.bin`` (open
    as ``fd``), piece by piece as the shard's :meth:`RemoteShard.scan` brings them."""
    done = 0
    for ours in repack._shard(seg.shard).scan(seg.offset, seg.size):
        theirs = read_range(fd, seg.source_offset + done, len(ours))
        if not np.array_equal(np.frombuffer(ours, np.uint8), np.frombuffer(theirs, np.uint8)):
            at = seg.source_offset + done + _first_difference(ours, theirs)
            return f"original .bin differs from the repack at byte {at}"
        done += len(ours)
        advance(len(ours))
    return ""


def _captured(function):
    """``function()``, or the RepackError it raised (reported, not raised, by verify)."""
    try:
        return function()
    except RepackError as err:
        return err


def _pieces(source: SourceEntry) -> int:
    return sum(-(-seg.size // ORIGINAL_PIECE) for seg in source.segments)


def _original_jobs(sources: list[SourceEntry]):
    """The requests of comparing ``sources`` (originals on object storage), in the order
    :func:`_compare_remote_original` takes their results: per source its ``.idx`` and the
    stat of its ``.bin``, then its segments' bytes, ``ORIGINAL_PIECE`` at a time."""
    for source in sources:
        yield 0, functools.partial(_captured, functools.partial(fetch_index, source.path))
        for seg in source.segments:
            for _, job in bin_jobs(source, seg.source_offset, seg.size, ORIGINAL_PIECE):
                yield min(ORIGINAL_PIECE, seg.size), functools.partial(_captured, job)


def _compare_remote_original(
    repack: Repack, source: SourceEntry, fetched, report: VerifyReport, advance
) -> str:
    """Compare the repack's copy of ``source`` with its original on object storage, from
    the results of :func:`_original_jobs` (``fetched``: this source's come next)."""
    left = _pieces(source)

    def skip(problem: str) -> str:
        for _ in range(left):
            next(fetched)
        advance(source.bin_size - done)
        return problem

    done = 0
    head = next(fetched)
    if isinstance(head, SourceMissing):
        report.originals_missing.append(source.name)
        return skip("")
    report.originals_compared += 1
    if isinstance(head, RepackError):
        return skip(f"cannot read the original: {head}")
    original_idx, found = head
    stored_idx = b"".join(bytes(chunk) for chunk in repack.source_idx_chunks(source))
    if original_idx != stored_idx:
        return skip(
            f"original .idx differs from the repack at byte "
            f"{_first_difference(original_idx, stored_idx)}"
        )
    if found.size != source.bin_size:
        return skip(f"original .bin has {found.size} bytes, the repack {source.bin_size}")
    failed: list[RepackError] = []

    def theirs(seg):
        nonlocal left
        for _ in range(-(-seg.size // ORIGINAL_PIECE)):
            piece = next(fetched)
            left -= 1
            if isinstance(piece, RepackError):
                failed.append(piece)
                return
            yield piece

    for seg in source.segments:
        try:
            at = _first_difference_of(_stored_pieces(repack, seg), theirs(seg))
        except (ShortRead, FormatError) as err:
            return skip(f"cannot compare: {err}")
        if failed:
            return skip(f"cannot read the original: {failed[0]}")
        if at is not None:
            return skip(f"original .bin differs from the repack at byte {seg.source_offset + at}")
        done += seg.size
        advance(seg.size)
    return ""


def _stored_pieces(repack: Repack, seg):
    """The bytes the repack holds of segment ``seg``, in pieces."""
    shard = repack.manifest.shards[seg.shard]
    if not repack.store.local and shard.codec is None:
        yield from repack._shard(seg.shard).scan(seg.offset, seg.size)
        return
    for start in range(0, seg.size, CHUNK):
        yield repack.read_bytes(seg.shard, seg.offset + start, min(CHUNK, seg.size - start))


def _first_difference_of(ours, theirs) -> int | None:
    """Where two streams of pieces of the same bytes first differ (or one ends before the
    other), or None if they hold the same bytes."""
    a = b = memoryview(b"")
    done = 0
    while True:
        if not a:
            a = memoryview(next(ours, b"")).cast("B")
        if not b:
            b = memoryview(next(theirs, b"")).cast("B")
        if not a or not b:
            return None if not a and not b else done
        n = min(len(a), len(b))
        if not np.array_equal(np.frombuffer(a[:n], np.uint8), np.frombuffer(b[:n], np.uint8)):
            return done + _first_difference(a[:n], b[:n])
        a, b, done = a[n:], b[n:], done + n


def _first_difference(a: bytes | memoryview, b: bytes | memoryview) -> int:
    """Offset of the first differing byte (or the shorter length)."""
    n = min(len(a), len(b))
    left = np.frombuffer(a, np.uint8, n)
    right = np.frombuffer(b, np.uint8, n)
    diff = np.flatnonzero(left != right)
    return int(diff[0]) if diff.size else n
