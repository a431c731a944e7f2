"""Execute a repack: validate the blend's sources, plan shards, copy data, write the index,
and write the manifest last, atomically.

Until the manifest exists the output folder is not a repack: an interrupted merge never leaves
a folder that looks complete.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from repack import __version__
from repack import format as fmt
from repack.blend import Blend, load_blend
from repack.checksum import DEFAULT, digest_of, new_hasher
from repack.errors import OutputExists, SourceError
from repack.fileio import CHUNK, atomic_write, copy_range, fsync_dir, hash_range
from repack.manifest import dump_manifest
from repack.plan import Plan, plan_repack
from repack.sources import SourceInfo, read_source_index

__all__ = ["DEFAULT_SHARD_SIZE", "MergeResult", "Prepared", "execute", "merge", "prepare"]

#: Default largest shard: few enough files for any blend, small enough to copy, verify and
#: re-run one shard at a time.
DEFAULT_SHARD_SIZE = 64 * 1024**3

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


@dataclass(frozen=True)
class MergeResult:
    """What a merge wrote."""

    out: str
    shards: int
    sources: int
    bytes: int
    seconds: float


def _no_progress(description: str, total: int) -> Callable[[int], object]:
    return lambda n: None


def prepare(
    blend_path: str | os.PathLike,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    algorithm: str = DEFAULT,
    progress: Progress = _no_progress,
) -> Prepared:
    """Parse the blend, validate every source and plan the shards. Writes nothing."""
    blend = load_blend(blend_path)
    spellings: dict[str, list[str]] = {}
    for entries in blend.splits.values():
        for entry in entries or ():
            names = spellings.setdefault(entry.path, [])
            if entry.prefix not in names:
                names.append(entry.prefix)
    paths = list(spellings)
    infos, checksums = [], []
    step = progress("validate", len(paths))
    for path in paths:
        hasher = new_hasher(algorithm)
        infos.append(read_source_index(path, hasher=hasher).info)
        checksums.append(digest_of(hasher, algorithm))
        step(1)
    plan = plan_repack(infos, shard_size, lambda i: read_source_index(paths[i]).lengths)
    return Prepared(
        blend,
        tuple(infos),
        tuple(tuple(spellings[p]) for p in paths),
        tuple(checksums),
        plan,
        algorithm,
    )


def merge(
    blend_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    algorithm: str = DEFAULT,
    overwrite: bool = False,
    progress: Progress = _no_progress,
) -> MergeResult:
    """Repack the blend at ``blend_path`` into the folder ``out``. See :func:`execute`."""
    prepared = prepare(blend_path, shard_size=shard_size, algorithm=algorithm, progress=progress)
    return execute(prepared, out, overwrite=overwrite, progress=progress)


_OURS_FIXED = {fmt.MANIFEST_FILE, fmt.INDEX_FILE, "cache"}


def _is_ours(name: str) -> bool:
    base = name.split(".tmp", 1)[0]
    return base in _OURS_FIXED or fmt.is_shard_name(base)


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


def execute(
    prepared: Prepared,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: Progress = _no_progress,
) -> MergeResult:
    """Write the repack planned in ``prepared`` into ``out``.

    Shards and index are written as temp files, fsynced and renamed; the manifest comes last.

    Raises:
        OutputExists: ``out`` is not empty and ``overwrite`` is false, or holds foreign files.
        SourceError: a source changed or vanished since it was validated.
    """
    started = time.monotonic()
    out = os.fspath(out)
    _prepare_out(out, overwrite)
    algorithm = prepared.algorithm
    plan = prepared.plan
    advance = progress("merge", plan.total_bytes)
    try:
        bin_checksums = _write_shards(prepared, out, advance)
        index_entry, ranges = _write_index(prepared, out)
    except BaseException:
        # finished shards stay (a later run may reuse them); partial files go
        for name in os.listdir(out):
            if name.endswith(".tmp"):
                os.unlink(os.path.join(out, name))
        raise
    shard_checksums = bin_checksums.pop("shards")
    body = {
        "format": fmt.FORMAT_NAME,
        "version": fmt.FORMAT_VERSION,
        "created_by": f"repack {__version__}",
        "checksum_algorithm": algorithm,
        "alignment": fmt.ALIGNMENT,
        "shard_size": plan.shard_size,
        "index": index_entry,
        "shards": [
            {
                "file": shard.name,
                "dtype": fmt.dtype_from_code(shard.dtype_code).name,
                "dtype_code": shard.dtype_code,
                "size": shard.size,
                "checksum": shard_checksums[shard.number],
            }
            for shard in plan.shards
        ],
        "sources": [
            {
                "id": i,
                "path": info.path,
                "prefixes": list(prepared.prefixes[i]),
                "dtype": info.dtype.name,
                "dtype_code": info.dtype_code,
                "multimodal": info.multimodal,
                "sequences": [ranges[i][0], info.sequence_count],
                "documents": [ranges[i][1], info.document_count],
                "tokens": info.token_count,
                "bin_size": info.bin_size,
                "idx_size": info.idx_size,
                "bin_checksum": bin_checksums["sources"][i],
                "idx_checksum": prepared.idx_checksums[i],
                "segments": [
                    {
                        "shard": seg.shard,
                        "first": seg.first_sequence,
                        "count": seg.sequence_count,
                        "offset": seg.offset,
                        "size": seg.size,
                        "source_offset": seg.source_offset,
                        "checksum": bin_checksums["segments"][(i, seg.first_sequence)],
                    }
                    for seg in plan.segments_by_source[i]
                ],
            }
            for i, info in enumerate(prepared.sources)
        ],
        "blend": prepared.blend.to_json(),
    }
    atomic_write(os.path.join(out, fmt.MANIFEST_FILE), dump_manifest(body, algorithm))
    return MergeResult(
        out,
        len(plan.shards),
        len(prepared.sources),
        plan.total_bytes,
        time.monotonic() - started,
    )


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


def _write_shards(prepared: Prepared, out: str, advance: Callable[[int], object]) -> dict:
    """Copy every segment into its shard; return the checksums computed on the way."""
    algorithm = prepared.algorithm
    plan = prepared.plan
    # no larger than needed: zeroing a 64 MiB buffer costs more than merging a small blend
    buffer = bytearray(max(1, min(CHUNK, max((s.bin_size for s in prepared.sources), default=0))))
    shard_sums: dict[int, str] = {}
    segment_sums: dict[tuple[int, int], str] = {}
    source_sums: dict[int, str] = {}
    spanning: dict[int, object] = {}
    for shard in plan.shards:
        final = os.path.join(out, shard.name)
        tmp = final + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            shard_hasher = new_hasher(algorithm)
            position = 0
            for seg in shard.segments:
                if seg.offset > position:
                    shard_hasher.update(bytes(seg.offset - position))
                segs_of_source = plan.segments_by_source[seg.source]
                seg_hasher = new_hasher(algorithm)
                hashers = [shard_hasher, seg_hasher]
                if len(segs_of_source) > 1:
                    hashers.append(spanning.setdefault(seg.source, new_hasher(algorithm)))
                src = _open_source_bin(prepared.sources[seg.source])
                try:
                    copy_range(
                        src, fd, seg.source_offset, seg.offset, seg.size, hashers, advance, buffer
                    )
                finally:
                    os.close(src)
                segment_sums[(seg.source, seg.first_sequence)] = digest_of(seg_hasher, algorithm)
                if len(segs_of_source) == 1:
                    source_sums[seg.source] = segment_sums[(seg.source, seg.first_sequence)]
                elif seg is segs_of_source[-1]:
                    source_sums[seg.source] = digest_of(spanning.pop(seg.source), algorithm)
                position = seg.offset + seg.size
            os.ftruncate(fd, shard.size)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        shard_sums[shard.number] = digest_of(shard_hasher, algorithm)
    fsync_dir(out)
    return {"shards": shard_sums, "segments": segment_sums, "sources": source_sums}


def _write_index(prepared: Prepared, out: str) -> tuple[dict, list[tuple[int, int]]]:
    """Write ``index.rpx`` one source at a time; return its manifest entry and each source's
    first sequence and first document."""
    sources = prepared.sources
    n_seq = sum(s.sequence_count for s in sources)
    n_doc = sum(s.document_count for s in sources)
    layout = fmt.index_layout(n_seq, n_doc)
    final = os.path.join(out, fmt.INDEX_FILE)
    tmp = final + ".tmp"
    ranges = []
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, layout.size)
        os.pwrite(fd, fmt.pack_index_header(n_seq, n_doc), 0)
        seq, doc = 0, 0
        for i, info in enumerate(sources):
            hasher = new_hasher(prepared.algorithm)
            index = read_source_index(info.path, hasher=hasher)
            if digest_of(hasher, prepared.algorithm) != prepared.idx_checksums[i]:
                raise SourceError(f"{info.path}.idx: changed during the merge")
            _pwrite_array(fd, index.lengths, layout.lengths + 4 * seq)
            _pwrite_array(fd, index.pointers, layout.pointers + 8 * seq)
            if index.modes is not None:
                _pwrite_array(fd, index.modes, layout.modes + seq)
            _pwrite_array(fd, index.documents, layout.documents + 8 * doc)
            ranges.append((seq, doc))
            seq += info.sequence_count
            doc += info.document_count
        os.fsync(fd)
        hasher = new_hasher(prepared.algorithm)
        hash_range(fd, 0, layout.size, [hasher])
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(out)
    entry = {
        "file": fmt.INDEX_FILE,
        "size": layout.size,
        "checksum": digest_of(hasher, prepared.algorithm),
        "sequence_count": n_seq,
        "document_count": n_doc,
    }
    return entry, ranges


def _pwrite_array(fd: int, array: np.ndarray, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(array).view(np.uint8))
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
