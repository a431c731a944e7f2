"""The manifest of a repack folder: build, serialize, load and validate it.

The manifest is a JSON object whose first member is ``checksum``: the checksum of the file's
own bytes with that member's hex digest replaced by ASCII zeros. A single flipped byte anywhere
in the file is therefore detected on load.
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat
from typing import Any

import numpy as np
import xxhash

from repack.checksum import ALGORITHMS, digest_of, new_hasher, split_checksum
from repack.errors import BlendError, ChecksumMismatch, FormatError
from repack.format import spec as fmt
from repack.format.blend import Blend
from repack.format.gcpause import gc_paused
from repack.format.sources import (
    SEGMENT_FIELDS,
    EntryTable,
    SegmentEntry,
    SourceEntry,
    SourceTable,
)

__all__ = [
    "Manifest",
    "ShardEntry",
    "SourceEntry",
    "SegmentEntry",
    "dump_manifest",
    "load_manifest",
    "parse_manifest",
]


@dataclass(frozen=True, slots=True)
class ShardEntry:
    """One shard file."""

    number: int
    file: str
    dtype_code: int
    size: int
    checksum: str
    #: ``None`` for a raw shard; else how the file is compressed (``size`` and ``checksum``
    #: then describe the logical, uncompressed bytes, ``stored_*`` the file).
    codec: str | None = None
    stored_size: int | None = None
    stored_checksum: str | None = None
    #: Informative members of a compressed shard: the zstd level and the frame size used.
    level: int | None = None
    block_size: int | None = None

    @property
    def file_size(self) -> int:
        """Size of the file on disk."""
        return self.size if self.codec is None else self.stored_size

    @property
    def dtype(self) -> np.dtype:
        """Numpy dtype of the tokens."""
        return fmt.dtype_from_code(self.dtype_code)

    def to_json(self) -> dict[str, Any]:
        """The manifest member this entry is parsed from (``shards[n]``)."""
        data: dict[str, Any] = {
            "file": self.file,
            "dtype": self.dtype.name,
            "dtype_code": self.dtype_code,
            "size": self.size,
            "checksum": self.checksum,
        }
        if self.codec is not None:
            data.update(
                codec=self.codec,
                stored_size=self.stored_size,
                stored_checksum=self.stored_checksum,
            )
            for name in ("level", "block_size"):
                if getattr(self, name) is not None:
                    data[name] = getattr(self, name)
        return data


@dataclass(frozen=True)
class Manifest:
    """A parsed, structurally validated manifest."""

    checksum: str
    algorithm: str
    created_by: str
    index_file: str
    index_size: int
    index_checksum: str
    sequence_count: int
    document_count: int
    shards: tuple[ShardEntry, ...]
    #: A :class:`~repack.format.sources.SourceTable` where parsed (entries made when asked
    #: for), or a tuple of entries where built by a writer.
    sources: Sequence[SourceEntry]
    blend: Blend
    #: The top-level members as read, in order; those :meth:`to_json` rebuilds from the
    #: entries (``_REBUILT``) are ``None`` here, so that the raw JSON of every source is not
    #: kept twice.
    raw: dict
    #: Blends added later with ``repack add``, in order.
    appended: tuple[Blend, ...] = ()
    #: The shard size limit the merge used (informative; ``repack add`` plans with it).
    shard_size: int | None = None

    @property
    def blends(self) -> tuple[Blend, ...]:
        """The blend merged first, then every appended one."""
        return (self.blend, *self.appended)

    def index_json(self) -> dict[str, Any]:
        """The ``index`` member."""
        return {
            "file": self.index_file,
            "size": self.index_size,
            "checksum": self.index_checksum,
            "sequence_count": self.sequence_count,
            "document_count": self.document_count,
        }

    def to_json(self) -> dict[str, Any]:
        """The body :func:`dump_manifest` serializes back into this manifest's bytes: every
        member rebuilt from the entries, members this release does not know kept as read."""
        body = {key: value for key, value in self.raw.items() if key != "checksum"}
        body.update(
            index=self.index_json(),
            shards=[shard.to_json() for shard in self.shards],
            sources=[source.to_json() for source in self.sources],
            blend=self.blend.to_json(),
        )
        if self.appended or "appended" in body:
            body["appended"] = [blend.to_json() for blend in self.appended]
        return body

    def find_source(self, prefix: str) -> SourceEntry | None:
        """The source written as ``prefix`` in the blend, or whose absolute path it is."""
        found = self.find_source_id(prefix)
        return None if found is None else self.sources[found]

    def find_source_id(self, prefix: str) -> int | None:
        """The id of :meth:`find_source`'s source: a loader resolves every prefix of a blend of
        tens of thousands through this (:meth:`~repack.format.sources.SourceTable.find`)."""
        return self.source_table.find(prefix)

    @functools.cached_property
    def source_table(self) -> SourceTable:
        """The sources in columns (:mod:`repack.format.sources`)."""
        if isinstance(self.sources, SourceTable):
            return self.sources
        return SourceTable.of(self.sources)


def dump_manifest(body: dict[str, Any], algorithm: str) -> bytes:
    """Serialize ``body`` deterministically, with the self-checksum as first member."""
    placeholder = f"{algorithm}:{'0' * len(new_hasher(algorithm).hexdigest())}"
    text = json.dumps({"checksum": placeholder}, separators=(",", ": "))[:-1]
    rest = json.dumps(body, indent=1, sort_keys=True, allow_nan=False)
    data = (text + ",\n" + rest[1:] + "\n").encode()
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return data.replace(placeholder.encode(), digest_of(hasher, algorithm).encode(), 1)


def load_manifest(folder: str | os.PathLike) -> Manifest:
    """Read, checksum and validate ``folder/manifest.json``.

    Raises:
        FormatError: missing, oversized, unparsable or structurally invalid manifest.
        ChecksumMismatch: the manifest's bytes do not match its own checksum.
    """
    path = os.path.join(os.fspath(folder), fmt.MANIFEST_FILE)
    try:
        # O_NONBLOCK: a FIFO named manifest.json must be refused, not waited on
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        folder = os.fspath(folder)
        unfinished = os.path.isdir(os.path.join(folder, fmt.WORK_DIR))
        raise FormatError(
            f"{path}: not found; {folder} is not a complete repack (the manifest is written "
            "last)"
            + (
                f": it holds an unfinished merge; run 'repack merge {folder} --resume' to finish it"
                if unfinished
                else ""
            ),
            path=path,
        ) from None
    except OSError as err:
        raise FormatError(f"{path}: cannot read: {err.strerror}", path=path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > fmt.MAX_MANIFEST_SIZE:
        os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{path}: not a regular file", path=path)
        raise FormatError(
            f"{path}: {st.st_size} bytes, larger than the {fmt.MAX_MANIFEST_SIZE}-byte limit",
            path=path,
        )
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as stream:
        try:
            # read(n) allocates n bytes up front: ask for what fstat saw, plus one byte to
            # notice growth, then at most up to the limit
            data = stream.read(st.st_size + 1)
            if len(data) > st.st_size:
                data += stream.read(fmt.MAX_MANIFEST_SIZE + 1 - len(data))
        except OSError as err:
            raise FormatError(f"{path}: cannot read: {err.strerror}", path=path) from None
    if len(data) > fmt.MAX_MANIFEST_SIZE:
        raise FormatError(f"{path}: larger than the {fmt.MAX_MANIFEST_SIZE}-byte limit", path=path)
    # The same bytes parse to the same (immutable) Manifest: a loader that checks a repack and
    # then opens it, or opens it with both backends, parses it once, whatever path (a symlink,
    # its target) names the file.
    # Kept: the bytes' digest, not the bytes (800 bytes a source, in every DataLoader worker);
    # XXH3-128, which tells changed bytes apart as well as BLAKE2b did at a twentieth of the
    # time (2 against 55 ms for the 24 MB of 30,000 sources).
    file = (st.st_dev, st.st_ino)
    seen = (len(data), xxhash.xxh3_128_digest(data))
    last = _LAST_PARSED.get(file)
    if last is not None and last[0] == seen:
        return last[1]
    manifest = parse_manifest(data, path)
    if len(_LAST_PARSED) >= 4:
        _LAST_PARSED.clear()
    _LAST_PARSED[file] = (seen, manifest)
    return manifest


#: The length and digest of the last bytes parsed per manifest file (device, inode), with what
#: they parsed to (see load_manifest).
_LAST_PARSED: dict[tuple[int, int], tuple[tuple[int, bytes], Manifest]] = {}


#: Top-level members that Manifest.to_json rebuilds from the parsed entries.
_REBUILT = frozenset({"index", "shards", "sources", "blend", "appended"})

_CHECKSUM_MEMBER = re.compile(rb'^\{"checksum": "([^"]*)"')


def parse_manifest(data: bytes, path: str) -> Manifest:
    """Check the self-checksum of manifest bytes, then parse and validate them."""
    match = _CHECKSUM_MEMBER.match(data)
    if not match:
        raise FormatError(
            f"{path}: does not start with its checksum member; not a repack manifest", path=path
        )
    stored = match.group(1).decode("ascii", "replace")
    try:
        algorithm, digest = split_checksum(stored)
    except ValueError:
        raise FormatError(f"{path}: malformed checksum {stored!r}", path=path) from None
    placeholder = f"{algorithm}:{'0' * len(digest)}".encode()
    hasher = new_hasher(algorithm)
    # in three pieces, the rest as a view: not two copies of tens of MB (20 ms at 30,000 sources)
    hasher.update(data[: match.start(1)])
    hasher.update(placeholder)
    hasher.update(memoryview(data)[match.end(1) :])
    computed = digest_of(hasher, algorithm)
    if computed != stored:
        raise ChecksumMismatch(f"{path}: stored checksum {stored}, computed {computed}", path=path)
    with gc_paused():  # the raw JSON is freed before any collection sees it
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as err:
            raise FormatError(f"{path}: not valid JSON: {err}", path=path) from None
        except RecursionError:
            raise FormatError(f"{path}: not valid JSON: nested too deeply", path=path) from None
        try:
            manifest = _build(raw, stored)
        except (KeyError, TypeError, ValueError) as err:
            raise FormatError(f"{path}: invalid manifest: {_describe(err)}", path=path) from None
        # freed here, not on return: the collector counts the objects made and not yet freed.
        # Back with the raw JSON still held, it found a collection due at once (in a process
        # that imported torch and Megatron, a full one: 0.17 s at 30,000 sources); freed first,
        # the count is back where it was, and none is due
        del raw
    return manifest


def _describe(err: Exception) -> str:
    if isinstance(err, KeyError):
        return f"missing member {err.args[0]!r}"
    return str(err)


#: The largest integer a manifest may hold: its sources are kept in int64 columns.
_INT_MAX = 2**63 - 1


# ``what`` and ``member`` name the value in a message (joined only then: a manifest of tens of
# thousands of sources checks hundreds of thousands of values)


# Each of _int, _str and _checksum has a whole-column twin for the sources' bulk path
# (_int_column, _str_column, _checksum_column, below): a change to a rule goes to both.


def _int(value: Any, what: str, member: str = "", minimum: int = 0) -> int:
    if type(value) is not int or not minimum <= value <= _INT_MAX:
        raise ValueError(
            f"{what}{member} is {value!r}, expected an integer from {minimum} to 2**63-1"
        )
    return value


def _str(value: Any, what: str, member: str = "") -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what}{member} is {value!r}, expected a string")
    return value


def _file_name(value: Any, what: str) -> str:
    """A file name that stays inside the repack folder."""
    name = _str(value, what)
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{what} is {name!r}, expected a plain file name inside the folder")
    return name


def _index_file(value: Any) -> str:
    name = _file_name(value, "index.file")
    if not fmt.is_index_name(name):
        raise ValueError(f"index.file is {name!r}, expected {fmt.INDEX_FILE!r} or index-N.rpx")
    return name


def _checksum(value: Any, what: str, algorithm: str, member: str = "") -> str:
    if type(value) is str and len(value) > len(algorithm) + 1 and value.startswith(algorithm + ":"):
        return value  # the common case, without a split
    text = _str(value, what, member)
    got, _ = split_checksum(text)
    if got != algorithm:
        raise ValueError(f"{what}{member} uses {got}, expected {algorithm}")
    return text


def _blend(value: Any, sources: SourceTable | None = None) -> Blend:
    """The blend a manifest records, its entries in columns (:class:`EntryTable`, made from
    :meth:`Blend.json_columns`' lists: no entry per source; the texts equal to ``sources``'
    paths or prefixes are theirs)."""
    try:
        source, form, columns = Blend.json_columns(value)
    except BlendError as err:
        raise ValueError(f"blend: {err}") from None
    like = () if sources is None else (sources.prefixes, sources.path)
    splits = {
        name: None if split is None else EntryTable.of_columns(*split, like)
        for name, split in columns.items()
    }
    return Blend(source=source, form=form, splits=splits)


def _build(raw: Any, checksum: str) -> Manifest:
    if not isinstance(raw, dict):
        raise ValueError("top level is not an object")
    if raw.get("format") != fmt.FORMAT_NAME:
        raise ValueError(f"format is {raw.get('format')!r}, expected {fmt.FORMAT_NAME!r}")
    version = raw.get("version")
    if type(version) is not int or version != fmt.FORMAT_VERSION:
        raise ValueError(
            f"format version {version!r} is not supported by this release "
            f"(reads version {fmt.FORMAT_VERSION}); upgrade repack"
        )
    algorithm = raw["checksum_algorithm"]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"checksum_algorithm is {algorithm!r}, expected one of {ALGORITHMS}")
    if split_checksum(checksum)[0] != algorithm:
        raise ValueError(f"the manifest's own checksum is not {algorithm}")
    if type(raw["alignment"]) is not int or raw["alignment"] != fmt.ALIGNMENT:
        raise ValueError(f"alignment is {raw['alignment']!r}, expected {fmt.ALIGNMENT}")
    if "shard_size" in raw:  # informative, but `repack add` plans its new shards with it
        _int(raw["shard_size"], "shard_size", minimum=fmt.ALIGNMENT)
    index = raw["index"]
    shards = []
    files: dict[str, int] = {}
    for n, shard in enumerate(raw["shards"]):
        code = _int(shard["dtype_code"], f"shards[{n}].dtype_code", minimum=1)
        if code not in fmt.DTYPES:
            raise ValueError(f"shards[{n}].dtype_code is {code}, not a Megatron dtype code")
        codec = shard.get("codec")
        if codec is not None and codec not in fmt.CODEC_SUFFIXES:
            raise ValueError(
                f"shards[{n}].codec is {codec!r}; this release reads raw shards and "
                f"{', '.join(fmt.CODEC_SUFFIXES)}"
            )
        name = _file_name(shard["file"], f"shards[{n}].file")
        if not fmt.is_shard_name(name) or name != fmt.shard_name(fmt.shard_number(name), codec):
            raise ValueError(
                f"shards[{n}].file is {name!r}, expected a shard name such as "
                f"{fmt.shard_name(n, codec)!r}"
            )
        if name in files:
            raise ValueError(f"shards[{n}].file is {name!r}, the file of shards[{files[name]}]")
        files[name] = n
        stored = {}
        if codec is not None:
            stored = {
                "level": shard.get("level"),
                "block_size": shard.get("block_size"),
                "codec": codec,
                "stored_size": _int(shard["stored_size"], f"shards[{n}].stored_size"),
                "stored_checksum": _checksum(
                    shard["stored_checksum"], f"shards[{n}].stored_checksum", algorithm
                ),
            }
        shards.append(
            ShardEntry(
                n,
                name,
                code,
                _int(shard["size"], f"shards[{n}].size"),
                _checksum(shard["checksum"], f"shards[{n}].checksum", algorithm),
                **stored,
            )
        )
    sequence_count = _int(index["sequence_count"], "index.sequence_count")
    document_count = _int(index["document_count"], "index.document_count")
    sources, next_sequence, next_document = _sources(raw["sources"], shards, algorithm)
    if next_sequence != sequence_count or next_document != document_count:
        raise ValueError("sources do not cover the index exactly")
    return Manifest(
        checksum=checksum,
        algorithm=algorithm,
        created_by=_str(raw.get("created_by", ""), "created_by"),
        index_file=_index_file(index["file"]),
        index_size=_int(index["size"], "index.size"),
        index_checksum=_checksum(index["checksum"], "index.checksum", algorithm),
        sequence_count=sequence_count,
        document_count=document_count,
        shards=tuple(shards),
        sources=sources,
        blend=_blend(raw["blend"], sources),
        raw={key: None if key in _REBUILT else value for key, value in raw.items()},
        appended=tuple(_blend(b, sources) for b in raw.get("appended", [])),
        shard_size=raw.get("shard_size"),
    )


# --- the sources: checked in bulk, else row by row ------------------------------------------
#
# Two paths, one result. The row loop (_sources_by_row) is the definition of a valid source:
# it checks each value as it reads it and names the first bad one. Run on every source of a
# repack of tens of thousands, it is most of the time a loader takes to open one (every
# training process and DataLoader worker pays it), so _sources_in_bulk runs first: it gathers
# each field of every source and segment into one list and checks whole columns at once (types
# with set(map(type, ...)), arithmetic with numpy). It only accepts: where any of its checks
# fails, or the JSON has a shape it does not expect, it gives up and the row loop runs from the
# start, which refuses with the precise message (or accepts what the bulk checks are stricter
# about). Each bulk check is the row loop's rule for a whole column, or stricter, never looser;
# both paths build the table through the same builder from the same values.


def _sources(
    raw_sources: Any, shards: list[ShardEntry], algorithm: str
) -> tuple[SourceTable, int, int]:
    """The sources' table, and the sequence and document counts they cover."""
    found = _sources_in_bulk(raw_sources, shards, algorithm)
    return _sources_by_row(raw_sources, shards, algorithm) if found is None else found


def _sources_by_row(
    raw_sources: Any, shards: list[ShardEntry], algorithm: str
) -> tuple[SourceTable, int, int]:
    """The reference checks, source by source: raises ValueError (KeyError, TypeError) naming
    the first value that breaks a rule."""
    sources = SourceTable.builder()
    next_sequence = next_document = 0
    for n, src in enumerate(raw_sources):
        what = f"sources[{n}]"
        if type(src["id"]) is not int or src["id"] != n:
            raise ValueError(f"{what}.id is {src['id']!r}, expected {n}")
        code = _int(src["dtype_code"], what, ".dtype_code", 1)
        if code not in fmt.DTYPES:
            raise ValueError(f"{what}.dtype_code is {code}, not a Megatron dtype code")
        seq_start, seq_count = (_int(v, what, ".sequences") for v in src["sequences"])
        doc_start, doc_count = (_int(v, what, ".documents") for v in src["documents"])
        if seq_start != next_sequence or doc_start != next_document or doc_count < 1:
            raise ValueError(f"{what}: sequence/document ranges are not contiguous")
        next_sequence, next_document = seq_start + seq_count, doc_start + doc_count
        prefixes = [_str(p, what, ".prefixes") for p in src["prefixes"]]
        if not prefixes:
            raise ValueError(f"{what}.prefixes is empty")
        bin_size = _int(src["bin_size"], what, ".bin_size")
        segments = []
        covered = first = 0
        for k, seg in enumerate(src["segments"]):
            sw = f"{what}.segments[{k}]"
            shard = _int(seg["shard"], sw, ".shard")
            if shard >= len(shards) or shards[shard].dtype_code != code:
                raise ValueError(f"{sw}.shard is {shard}, not a shard of dtype code {code}")
            entry = (
                shard,
                _int(seg["first"], sw, ".first"),
                _int(seg["count"], sw, ".count"),
                _int(seg["offset"], sw, ".offset"),
                _int(seg["size"], sw, ".size"),
                _int(seg["source_offset"], sw, ".source_offset"),
                _checksum(seg["checksum"], sw, algorithm, ".checksum"),
            )
            _, seg_first, seg_count, offset, size, source_offset, _ = entry
            if seg_first != first or source_offset != covered:
                raise ValueError(
                    f"{sw} does not continue the source where {k and 'the previous '}segment ends"
                )
            if offset % fmt.ALIGNMENT:
                raise ValueError(f"{sw}.offset {offset} is not a multiple of {fmt.ALIGNMENT}")
            if offset + size > shards[shard].size:
                raise ValueError(f"{sw} ends past the end of {shards[shard].file}")
            covered += size
            first += seg_count
            segments.append(entry)
        if covered != bin_size or not segments:
            raise ValueError(f"{what}: segments cover {covered} bytes, expected {bin_size}")
        if first != seq_count:
            raise ValueError(f"{what}: segments cover a different number of sequences")
        multimodal = src["multimodal"]
        if not isinstance(multimodal, bool):
            raise ValueError(f"{what}.multimodal is {multimodal!r}, expected true or false")
        idx_size = _int(src["idx_size"], what, ".idx_size")
        if idx_size != fmt.megatron_idx_size(seq_count, doc_count, multimodal):
            raise ValueError(f"{what}.idx_size is {idx_size}, which disagrees with its counts")
        # SOURCE_FIELDS' order; columns, no entry made
        sources.add_row(
            (code, multimodal, seq_start, seq_count, doc_start, doc_count,
             _int(src["tokens"], what, ".tokens"), bin_size, idx_size),
            (
                _str(src["path"], what, ".path"),
                _checksum(src["bin_checksum"], what, algorithm, ".bin_checksum"),
                _checksum(src["idx_checksum"], what, algorithm, ".idx_checksum"),
            ),
            prefixes,
            segments,
        )  # fmt: skip
    return sources.table(), next_sequence, next_document


class _NotInBulk(Exception):
    """A bulk check failed: the row loop is to name the bad value."""


def _require(condition: Any) -> None:
    if not condition:
        raise _NotInBulk


def _sources_in_bulk(
    raw_sources: Any, shards: list[ShardEntry], algorithm: str
) -> tuple[SourceTable, int, int] | None:
    """What :func:`_sources_by_row` returns, checked column by column; ``None`` where any check
    fails (or a member is missing or of another shape): the row loop then decides."""
    if type(raw_sources) is not list or not raw_sources:
        return None
    try:
        return _bulk_columns(raw_sources, shards, algorithm)
    except (_NotInBulk, LookupError, TypeError, ValueError, OverflowError, AttributeError):
        return None


def _int_column(values: list[Any], minimum: int = 0) -> np.ndarray:
    """:func:`_int`'s rule on a whole column: each value exactly an ``int`` (not a bool), from
    ``minimum`` to 2**63-1 (past int64, ``np.array`` raises OverflowError)."""
    _require(set(map(type, values)) == {int})
    column = np.array(values, np.int64)
    _require(column.min() >= minimum)
    return column


def _str_column(values: list[Any]) -> None:
    """:func:`_str`'s rule on a whole column (JSON makes no subclass of ``str``)."""
    _require(set(map(type, values)) == {str})


def _checksum_column(values: list[Any], algorithm: str) -> None:
    """:func:`_checksum`'s common case on a whole column: each value a ``str`` that starts with
    ``algorithm:`` and goes on past it."""
    prefix = algorithm + ":"
    # str.startswith refuses (TypeError) a value that is not a str
    _require(all(map(str.startswith, values, repeat(prefix))))
    _require(min(map(len, values)) > len(prefix))


def _lists(values: list[Any]) -> list[int]:
    """Each value a JSON array; their lengths."""
    _require(set(map(type, values)) == {list})
    return list(map(len, values))


def _ends(counts: np.ndarray) -> np.ndarray:
    """Where each run of ``counts`` (each from 0 to 2**63-1) ends, counting from 0; refused
    past 2**63-1 (the first sum that passes it wraps negative)."""
    ends = np.cumsum(counts)
    _require(ends.min() >= 0)
    return ends


def _bulk_columns(
    raw_sources: list[Any], shards: list[ShardEntry], algorithm: str
) -> tuple[SourceTable, int, int]:
    n = len(raw_sources)
    # sources[n].id is n
    ids = [src["id"] for src in raw_sources]
    _require(set(map(type, ids)) == {int} and ids == list(range(n)))
    code = _int_column([src["dtype_code"] for src in raw_sources], 1)
    _require(np.isin(code, list(fmt.DTYPES)).all())
    # sequences and documents: [start, count] pairs (unpacked as the row loop unpacks them),
    # contiguous from 0, at least one document
    pairs = [src["sequences"] for src in raw_sources]
    seq_start = _int_column([start for start, _ in pairs])
    seq_count = _int_column([count for _, count in pairs])
    pairs = [src["documents"] for src in raw_sources]
    doc_start = _int_column([start for start, _ in pairs])
    doc_count = _int_column([count for _, count in pairs])
    seq_end, doc_end = _ends(seq_count), _ends(doc_count)
    _require(np.array_equal(seq_start, seq_end - seq_count))
    _require(np.array_equal(doc_start, doc_end - doc_count))
    _require(doc_count.min() >= 1)
    # prefixes: a non-empty array of strings
    prefix_lists = [src["prefixes"] for src in raw_sources]
    _require(min(_lists(prefix_lists)) >= 1)
    prefixes = [prefix for some in prefix_lists for prefix in some]
    _str_column(prefixes)
    bin_size = _int_column([src["bin_size"] for src in raw_sources])
    # segments: a non-empty array per source, in one column each over every source
    segment_lists = [src["segments"] for src in raw_sources]
    segment_count = np.array(_lists(segment_lists), np.int64)
    _require(segment_count.min() >= 1)
    segments = [segment for some in segment_lists for segment in some]
    seg = {name: _int_column([s[name] for s in segments]) for name in SEGMENT_FIELDS}
    shard, first, count, offset, size, source_offset = seg.values()
    segment_checksums = [s["checksum"] for s in segments]
    _checksum_column(segment_checksums, algorithm)
    # each segment in a shard of its source's dtype code
    owner = np.repeat(np.arange(n), segment_count)
    _require(shard.max() < len(shards))
    shard_code = np.array([s.dtype_code for s in shards], np.int64)[shard]
    _require(np.array_equal(shard_code, code[owner]))
    # each continues its source where the previous one ends (the first at 0): its first
    # sequence and source offset are the counts and sizes of the source's segments before it
    segment_end = _ends(segment_count)
    segment_start = segment_end - segment_count
    count_end, size_end = _ends(count), _ends(size)
    count_before, size_before = count_end - count, size_end - size
    _require(np.array_equal(first, count_before - count_before[segment_start][owner]))
    _require(np.array_equal(source_offset, size_before - size_before[segment_start][owner]))
    # aligned, and within the shard's size (without the sum that could pass int64)
    _require(not (offset % fmt.ALIGNMENT).any())
    shard_size = np.array([s.size for s in shards], np.int64)[shard]
    _require((size <= shard_size).all() and (offset <= shard_size - size).all())
    # together they cover the source's bytes and sequences
    last = segment_end - 1
    _require(np.array_equal(size_end[last] - size_before[segment_start], bin_size))
    _require(np.array_equal(count_end[last] - count_before[segment_start], seq_count))
    multimodal = [src["multimodal"] for src in raw_sources]
    _require(set(map(type, multimodal)) == {bool})
    multimodal = np.array(multimodal)
    idx_size = _int_column([src["idx_size"] for src in raw_sources])
    # fmt.megatron_idx_size on the columns, where it cannot pass int64 (34 + 21 * 2**58 < 2**63)
    _require(seq_count.max() < 2**58 and doc_count.max() < 2**58)
    expected = np.where(
        multimodal,
        fmt.megatron_idx_size(seq_count, doc_count, True),
        fmt.megatron_idx_size(seq_count, doc_count, False),
    )
    _require(np.array_equal(idx_size, expected))
    tokens = _int_column([src["tokens"] for src in raw_sources])
    paths = [src["path"] for src in raw_sources]
    _str_column(paths)
    bin_checksums = [src["bin_checksum"] for src in raw_sources]
    _checksum_column(bin_checksums, algorithm)
    idx_checksums = [src["idx_checksum"] for src in raw_sources]
    _checksum_column(idx_checksums, algorithm)
    # every rule holds: the columns the row loop would have built, from the same values
    sources = SourceTable.builder()
    columns = {
        "dtype_code": code,
        "multimodal": multimodal,
        "sequence_start": seq_start,
        "sequence_count": seq_count,
        "document_start": doc_start,
        "document_count": doc_count,
        "token_count": tokens,
        "bin_size": bin_size,
        "idx_size": idx_size,
        **{f"segment_{name}": seg[name] for name in SEGMENT_FIELDS},
        "segment_checksum": segment_checksums,
        "path": paths,
        "bin_checksum": bin_checksums,
        "idx_checksum": idx_checksums,
        "prefixes": prefixes,
    }
    sources.add_columns(
        columns,
        list(accumulate(map(len, prefix_lists))),
        segment_end.tolist(),
    )
    return sources.table(), int(seq_end[-1]), int(doc_end[-1])
