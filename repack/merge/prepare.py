"""Step 1 of a merge, writing nothing: parse the blend, validate its sources, plan the shards.

:class:`Prepared` is the result, and what the other steps work from: it is saved as
``OUT/.work/plan.json`` (:meth:`Prepared.to_json`) so that tasks on other machines and a
resumed run find the very same plan.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

from repack.checksum import DEFAULT, digest_of, new_hasher
from repack.errors import BadSources, InputError, SourceError
from repack.format import spec as fmt
from repack.format.blend import Blend
from repack.inputs.blend_files import load_blend
from repack.inputs.plan import Plan, PlannedSegment, PlannedShard, plan_repack
from repack.inputs.sources import SourceIndex, SourceInfo, read_source_index
from repack.progress import Progress, no_progress
from repack.store.prefixes import read_each

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "MergeResult",
    "Prepared",
    "blend_spellings",
    "prepare",
    "validate_sources",
]

#: Default largest shard: few enough files for any blend, small enough to copy, verify and
#: re-run one shard at a time.
DEFAULT_SHARD_SIZE = 64 * 1024**3
PLAN_FORMAT = "repack-plan"


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
    #: Whether the tasks compute document fingerprints (repack/read/fingerprints.py).
    fingerprints: bool = True

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
            "fingerprints": self.fingerprints,
            "blend": self.blend.to_json(),
            "shard_size": self.plan.shard_size,
            "sources": [
                {**_info_json(info), "prefixes": list(names), "idx_checksum": checksum}
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
        sources = tuple(SourceInfo(**{k: s[k] for k in fields if k in s}) for s in data["sources"])
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
            data.get("fingerprints", True),
        )


def _info_json(info: SourceInfo) -> dict:
    """A source's facts as the plan saves them (``bin_etag`` only for a source on object
    storage: a plan of local sources reads as before)."""
    data = asdict(info)
    if data.get("bin_etag") is None:
        data.pop("bin_etag", None)
    return data


@dataclass(frozen=True)
class MergeResult:
    """What a merge, an add or a remove wrote."""

    out: str
    shards: int
    sources: int
    bytes: int
    seconds: float
    resumed_shards: int = 0


def blend_spellings(blend: Blend) -> dict[str, list[str]]:
    """Each source path of the blend and how the blend writes it, in first-appearance order."""
    spellings: dict[str, list[str]] = {}
    for entries in blend.splits.values():
        for entry in entries or ():
            names = spellings.setdefault(entry.path, [])
            if entry.prefix not in names:
                names.append(entry.prefix)
    return spellings


def validate_sources(
    paths: Sequence[str],
    algorithm: str,
    progress: Progress = no_progress,
    *,
    earlier: Sequence[InputError] = (),
    checked: int = 0,
    blend: str | os.PathLike | None = None,
) -> tuple[list[SourceInfo], list[str]]:
    """Read and check every source prefix of ``paths``.

    Every source is read, bad ones too: one run names them all.

    Args:
        paths: The source prefixes.
        algorithm: The checksum algorithm of the ``.idx`` checksums.
        progress: Progress reporter factory.
        earlier: Errors the caller found in other sources of the same blend, reported first.
        checked: How many other sources the caller checked (for the count of the message).
        blend: The blend file the sources come from, named in the message.

    Returns:
        Each source's :class:`~repack.inputs.sources.SourceInfo`, and the checksum of its ``.idx``.

    Raises:
        SourceError: a prefix breaks a rule of docs/format.md section 1 (the subclass says
            which); :class:`~repack.errors.BadSources` when several do, naming each.
    """
    infos, checksums = [], []
    errors: list[InputError] = list(earlier)
    step = progress("validate", len(paths))
    for found in read_indexes(paths, algorithm):
        if isinstance(found, SourceError):
            errors.append(found)
        else:
            infos.append(found[0].info)
            checksums.append(found[1])
        step(1)
    if errors:
        raise BadSources.of(
            errors, len(paths) + checked, None if blend is None else os.fspath(blend)
        )
    return infos, checksums


def _read_hashed(algorithm: str, path: str) -> tuple[SourceIndex, str]:
    hasher = new_hasher(algorithm)
    index = read_source_index(path, hasher=hasher)
    return index, digest_of(hasher, algorithm)


def _lengths(path: str, info: SourceInfo):
    """The sequence lengths of a validated source, to plan its cut (on object storage, from
    the ``.idx`` bytes kept since its validation, if they are)."""
    return read_source_index(path, known=info).lengths


def read_indexes(
    paths: Sequence[str], algorithm: str
) -> Iterator[tuple[SourceIndex, str] | SourceError]:
    """Each source of ``paths`` read and validated
    (:func:`~repack.inputs.sources.read_source_index`)
    with the checksum of its ``.idx``, or its SourceError, in order; sources on object
    storage fetched several at once (:func:`~repack.store.prefixes.read_each`).

    Raises:
        StoreError: the server of a source refused (credentials) or could not be reached.
    """
    return read_each(functools.partial(_read_hashed, algorithm), paths)


def prepare(
    blend_path: str | os.PathLike,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    algorithm: str = DEFAULT,
    codec: tuple[str, int] | None = None,
    fingerprints: bool = True,
    progress: Progress = no_progress,
) -> Prepared:
    """Parse the blend, validate every source and plan the shards. Writes nothing.

    ``codec`` = ``("zstd", level)`` stores the shards compressed (:mod:`repack.format.codec`);
    ``fingerprints=False`` writes no document fingerprints (:mod:`repack.read.fingerprints`)."""
    blend = load_blend(blend_path)
    spellings = blend_spellings(blend)
    paths = list(spellings)
    infos, checksums = validate_sources(paths, algorithm, progress, blend=blend_path)
    plan = plan_repack(infos, shard_size, lambda i: _lengths(paths[i], infos[i]))
    return Prepared(
        blend,
        tuple(infos),
        tuple(tuple(spellings[p]) for p in paths),
        tuple(checksums),
        plan,
        algorithm,
        codec,
        fingerprints,
    )
