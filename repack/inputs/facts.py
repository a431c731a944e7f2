"""Read what the doctor needs of a blend's sources: ``.idx`` files or a repack's index.

Only index data is read (the ``.idx`` files, or a repack's manifest and combined index); the
``.bin`` files are only stat'ed for their size. A source that cannot be read is kept, with the
reason, so that every problem of a blend is reported at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from repack.errors import BlendError, SourceError
from repack.format import spec as fmt
from repack.format.blend import Blend
from repack.inputs.blend_files import load_blend
from repack.inputs.plan import plan_repack
from repack.inputs.sources import SourceInfo, read_source_index
from repack.model.splits import Facts
from repack.store.prefixes import file_identity, read_each

__all__ = ["Loaded", "Source", "load"]

Progress = Callable[[str, int], Callable[[int], object]]


@dataclass(frozen=True)
class Source:
    """One prefix of the blend, read.

    Attributes:
        key: Its absolute path (the blend entries' ``path``).
        name: The prefix as the blend first writes it.
        info: Its validated facts, or ``None`` when it cannot be read.
        facts: What the split arithmetic needs, or ``None``.
        error: Why it cannot be read.
        identity: ``(device, inode)`` of its ``.idx``, to find one file named twice.
    """

    key: str
    name: str
    info: SourceInfo | None
    facts: Facts | None
    error: str | None = None
    identity: tuple[int, int] | None = None


@dataclass(frozen=True)
class Loaded:
    """A blend and its sources.

    Attributes:
        blend: The blend (weights as written, even bad ones).
        sources: Every prefix, by key, in blend order.
        repack: The repack folder the sources were read from, or ``None`` for ``.idx`` files.
        shards: Shards that hold the blend's sources (of the repack, or of a repack made with
            the default 64 GiB shards).
        opened: The repack, opened (:class:`~repack.read.reader.Repack`), or ``None``.
    """

    blend: Blend
    sources: dict[str, Source]
    repack: str | None
    shards: int
    opened: Any = field(default=None, compare=False, repr=False)

    def open_repack(self):
        """The repack, opened once (its index is read and checked once)."""
        if self.opened is not None:
            return self.opened
        from repack.read.reader import Repack

        return Repack(self.repack)


def _no_progress(description: str, total: int) -> Callable[[int], object]:
    return lambda n: None


def load(
    target: str | os.PathLike[str],
    *,
    blend: str | os.PathLike[str] | None = None,
    shard_size: int = 64 << 30,
    progress: Progress | None = None,
) -> Loaded:
    """Read a blend file's prefixes (local files, or objects: ``s3://``, ``msc://``), or a
    repack folder's sources.

    Args:
        target: A blend file, or a repack folder (its recorded blend is used).
        blend: With a repack: a blend file whose prefixes are looked up in the repack, as
            ``RepackedGPTDataset`` does, instead of the recorded blend.
        shard_size: For a blend file, the shard size of the repack it is compared with.
        progress: ``progress(description, total)`` returns a callback fed counts.

    Raises:
        BlendError: The blend file is not a blend.
        FormatError, ChecksumMismatch: The repack is damaged.
        UnknownSource: A prefix of ``blend`` is not in the repack.
    """
    from repack.store import names_folder, open_store

    progress = progress or _no_progress
    # a folder, or a prefix on object storage (a blend file there is not read yet)
    if names_folder(target):
        return _load_repack(open_store(target).location, blend, progress)
    target = os.fspath(target)
    if blend is not None:
        raise BlendError(f"{target}: not a repack folder; --blend goes with a repack")
    parsed = load_blend(target, strict_weights=False)
    paths = parsed.paths()
    names = _names(parsed)
    update = progress("validate", len(paths))
    sources: dict[str, Source] = {}
    lengths = {}
    # sources on object storage (s3://, msc://) are fetched several at once
    for path, index in zip(paths, read_each(read_source_index, paths)):
        if isinstance(index, SourceError):
            sources[path] = Source(path, names[path], None, None, str(index))
        else:
            identity = file_identity(path + ".idx")  # (an object is named by its URL)
            # a copy: the view would keep the whole .idx (pointers, documents) in memory
            lengths[path] = np.array(index.lengths)
            facts = Facts.from_lengths(lengths[path])
            sources[path] = Source(path, names[path], index.info, facts, None, identity)
        update(1)
    readable = [s for s in sources.values() if s.info is not None]
    plan = plan_repack([s.info for s in readable], shard_size, lambda i: lengths[readable[i].key])
    return Loaded(parsed, sources, None, len(plan.shards))


def _names(blend: Blend) -> dict[str, str]:
    names: dict[str, str] = {}
    for entries in blend.splits.values():
        for entry in entries or ():
            names.setdefault(entry.path, entry.prefix)
    return names


def _load_repack(folder: str, blend_file, progress: Progress) -> Loaded:
    from repack.errors import UnknownSource
    from repack.read.reader import Repack

    repack = Repack(folder)
    manifest = repack.manifest
    if blend_file is None:
        blend = manifest.blend
        found = {entry_path: manifest.find_source(entry_path) for entry_path in blend.paths()}
    else:
        blend = load_blend(blend_file, strict_weights=False)
        found = {}
        for entries in blend.splits.values():
            for entry in entries or ():
                source = manifest.find_source(entry.prefix) or manifest.find_source(entry.path)
                if source is None:
                    raise UnknownSource(
                        f"{blend_file}: prefix {entry.prefix!r} is not in the repack {folder}"
                    )
                found[entry.path] = source
    names = _names(blend)
    sources: dict[str, Source] = {}
    shards: set[int] = set()
    update = progress("validate", len(found))
    for path, entry in found.items():
        if entry is None:  # the recorded blend names every source: a damaged manifest
            raise UnknownSource(f"{folder}: source {path!r} of the recorded blend is missing")
        lengths = repack.source_arrays(entry)[0]
        info = SourceInfo(
            path=entry.path,
            dtype_code=entry.dtype_code,
            sequence_count=entry.sequence_count,
            document_count=entry.document_count,
            multimodal=entry.multimodal,
            bin_size=entry.bin_size,
            idx_size=entry.idx_size,
            token_count=entry.token_count,
        )
        # the repack's source id tells two names of one source apart from two sources
        identity = (-1, entry.id)
        sources[path] = Source(path, names[path], info, Facts.from_lengths(lengths), None, identity)
        shards.update(segment.shard for segment in entry.segments)
        update(1)
    return Loaded(blend, sources, folder, len(shards), repack)


_DTYPE_NAMES = {code: dtype.name for code, dtype in fmt.DTYPES.items()}


def dtype_name(info: SourceInfo) -> str:
    """The token dtype's name."""
    return _DTYPE_NAMES[info.dtype_code]
