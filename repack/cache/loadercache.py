"""The loader's cache inside a repack, ``OUT/cache/``, after ``repack remove``: nothing of a
removed source stays in it.

With ``path_to_cache`` unset, the loader (:mod:`repack.megatron`) keeps Megatron's cached
indices in ``OUT/cache/``: the GPT datasets' arrays in packs with a catalog
(:mod:`repack.cache.indexcache`, in ``OUT/cache/GPTDataset_indices``), and Megatron's own files —
``{hash}-…-description.txt`` and ``.npy`` arrays, per dataset — for the masked datasets (BERT,
T5) and with ``REPACK_NPY_CACHE=1``. Index arrays hold no tokens, but they are derived from a
source (its documents and their lengths), and a take-down wants them gone too.

:func:`prune` keeps only what datasets of the remaining sources need: a packed dataset stays
when the catalog records a remaining source for it, Megatron's files of a dataset stay when
its description names a remaining source. Everything else goes, including what cannot be
attributed to a source (catalogs written by older repack builds, unreadable descriptions,
stray files): it is a cache, rebuilt on the next run when needed. Datasets of the remaining
sources keep their entries, so a build that asks for them again is still a cache hit.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from repack.cache.indexcache import CATALOG_FILE, PACK_PREFIX, PACK_SUFFIX, IndexCache
from repack.errors import FormatError, InputError
from repack.fileio import fsync_dir
from repack.format.manifest import SourceEntry

__all__ = ["CACHE_DIR", "CachePruned", "prune"]

#: The loader's cache folder inside a repack (``path_to_cache`` unset).
CACHE_DIR = "cache"
#: Megatron's per-dataset cache files start with the MD5 of the dataset's description.
_DATASET_FILE = re.compile(r"^(?P<hash>[0-9a-f]{32})-")
_DESCRIPTION_SUFFIX = "-description.txt"
#: Descriptions are a few hundred bytes; anything much larger is not one.
_MAX_DESCRIPTION = 1024 * 1024


@dataclass(frozen=True)
class CachePruned:
    """What :func:`prune` took out of ``OUT/cache``."""

    #: Datasets whose cached indices were dropped (packed ones and Megatron's own files).
    datasets: int = 0
    #: Files deleted.
    files: int = 0

    def __add__(self, other: CachePruned) -> CachePruned:
        return CachePruned(self.datasets + other.datasets, self.files + other.files)


def prune(out: str | os.PathLike, sources: Iterable[SourceEntry]) -> CachePruned:
    """Drop from ``out/cache`` the cached indices of every dataset that does not read one of
    ``sources`` (the sources that stay in the repack).

    Packs are rewritten under the catalog's lock and replaced atomically
    (:meth:`IndexCache.drop`); Megatron's own files of a dropped dataset are unlinked.

    Raises:
        InputError: the cache cannot be cleaned (a damaged catalog, a folder that cannot be
            written or locked); the message says to delete the folder.
    """
    root = os.path.join(os.fspath(out), CACHE_DIR)
    if not os.path.isdir(root):
        return CachePruned()
    sources = list(sources)
    paths = {os.path.normpath(s.path) for s in sources}
    prefixes = {prefix for s in sources for prefix in s.prefixes}

    def keeps_path(path: str | None) -> bool:
        return isinstance(path, str) and os.path.normpath(path) in paths

    def keeps_prefix(prefix: object) -> bool:
        # as the loader resolves it: as written in a blend, or the same absolute path
        # (a relative prefix not written so resolved against a working folder unknown here)
        if not isinstance(prefix, str):
            return False
        return prefix in prefixes or (os.path.isabs(prefix) and keeps_path(prefix))

    done = CachePruned()
    for folder, folders, files in os.walk(root):
        folders.sort()
        try:
            if CATALOG_FILE in files or any(
                f.startswith(PACK_PREFIX) and PACK_SUFFIX in f for f in files
            ):
                dropped, deleted = IndexCache.for_folder(folder).drop(keeps_path)
                done += CachePruned(len(dropped), len(deleted))
            done += _prune_megatron_files(folder, keeps_prefix)
        except (OSError, FormatError) as err:
            cause = err.strerror if isinstance(err, OSError) and err.strerror else err
            raise InputError(
                f"{folder}: cannot take the removed sources out of the loader's cache "
                f"({cause}); delete {root} (it is rebuilt when needed) and run again"
            ) from None
    return done


def _prune_megatron_files(folder: str, keeps_prefix) -> CachePruned:
    """Unlink Megatron's files (``{hash}-…``) of each dataset whose description does not name
    a source that stays; files of a dataset without a readable description go too."""
    groups: dict[str, list[str]] = {}
    for name in sorted(os.listdir(folder)):
        match = _DATASET_FILE.match(name)
        if match and os.path.isfile(os.path.join(folder, name)):
            groups.setdefault(match["hash"], []).append(name)
    datasets = files = 0
    for names in groups.values():
        descriptions = [n for n in names if n.endswith(_DESCRIPTION_SUFFIX)]
        if len(descriptions) == 1 and keeps_prefix(
            _described_path(os.path.join(folder, descriptions[0]))
        ):
            continue
        datasets += 1
        for name in names:
            try:
                os.unlink(os.path.join(folder, name))
                files += 1
            except FileNotFoundError:
                pass
    if files:
        fsync_dir(folder)
    return CachePruned(datasets, files)


def _described_path(path: str) -> object:
    """The ``dataset_path`` of a Megatron dataset description, or ``None``."""
    try:
        with open(path, "rb") as stream:
            data = stream.read(_MAX_DESCRIPTION + 1)
        if len(data) > _MAX_DESCRIPTION:
            return None
        description = json.loads(data)
    except (OSError, ValueError, RecursionError):
        return None
    return description.get("dataset_path") if isinstance(description, dict) else None
