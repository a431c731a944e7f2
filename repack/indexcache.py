"""Megatron's per-dataset cached indices, consolidated: one mapped file instead of three
``.npy`` mmaps per dataset and split.

Megatron's ``GPTDataset`` caches, per dataset and split, a document index, a sample index and
a shuffle index as three ``.npy`` files named ``{hash}-GPTDataset-{split}-*.npy`` and maps all
three for the life of the process. With hundreds of datasets that alone is thousands of mmaps.

Here the arrays of every dataset a process builds are copied, the first time, into one *pack*
file; a JSON *catalog* maps each dataset's ``{hash}-GPTDataset-{split}`` name to its arrays in
a pack. Later runs read the catalog (one open), and map each pack once, however many datasets
it holds. The ``.npy`` files keep Megatron's names and content, so a cache written by stock
Megatron is used as is, and stock Megatron can still use the cache written here.

Memory: the pack is mapped read-only and shared through the page cache like Megatron's own
``.npy`` mmaps; nothing is copied into private memory per rank.
"""

from __future__ import annotations

import fcntl
import gc
import hashlib
import json
import logging
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

from repack.errors import FormatError
from repack.fileio import atomic_write, copy_range, fsync_dir
from repack.format import ARRAY_ALIGNMENT, align_up

__all__ = ["ARRAYS", "CATALOG_FILE", "IndexCache"]

logger = logging.getLogger(__name__)

ARRAYS = ("document_index", "sample_index", "shuffle_index")
CATALOG_FILE = "repack-index-cache.json"
LOCK_FILE = "repack-index-cache.lock"
CATALOG_FORMAT = "repack-index-cache"
CATALOG_VERSION = 1
MAX_CATALOG_SIZE = 256 * 1024 * 1024

_LOCK = threading.Lock()
_CACHES: dict[str, IndexCache] = {}


def _reset_locks_after_fork() -> None:
    # a lock held by another thread at fork time would stay locked forever in the child
    global _LOCK
    _LOCK = threading.Lock()
    for cache in _CACHES.values():
        cache._lock = threading.RLock()


os.register_at_fork(after_in_child=_reset_locks_after_fork)


@dataclass(frozen=True)
class _Array:
    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Entry:
    """Where one dataset's three arrays are: a pack (``pack`` set) or stock ``.npy`` files."""

    name: str
    pack: str | None
    arrays: tuple[_Array, _Array, _Array]

    @property
    def sample_count(self) -> int:
        """Number of samples: rows of the sample index minus one."""
        return self.arrays[1].shape[0] - 1


def _npy_header(path: str) -> tuple[_Array, int]:
    """Read the header of a ``.npy`` file: its array description and file size."""
    with open(path, "rb") as stream:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        if fortran or dtype.hasobject:
            raise FormatError(f"{path}: not a plain C-order numeric array")
        offset = stream.tell()
        size = os.fstat(stream.fileno()).st_size
    if offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != size:
        raise FormatError(f"{path}: {size} bytes, not what its header describes")
    return _Array(offset, dtype.str, tuple(int(n) for n in shape)), size


class IndexCache:
    """The consolidated index cache of one folder, shared by the whole process."""

    @classmethod
    def for_folder(cls, folder: str) -> IndexCache:
        """The process-wide instance for ``folder``."""
        cache = _CACHES.get(folder)  # no stat per dataset
        if cache is not None:
            return cache
        key = os.path.realpath(folder)
        with _LOCK:
            cache = _CACHES.get(key)
            if cache is None:
                cache = _CACHES[key] = cls(key)
            _CACHES[folder] = cache
            return cache

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._lock = threading.RLock()
        self._catalog: dict[str, Entry] | None = None
        self._packs_seen: dict[str, bool] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._pending: dict[str, Entry] = {}

    def npy_path(self, name: str, array: str) -> str:
        """Megatron's file name for one cached array of dataset ``name``."""
        return os.path.join(self.folder, f"{name}-{array}.npy")

    def has_stock(self, name: str) -> bool:
        """Whether Megatron's own cache files for ``name`` exist (its cache-hit test)."""
        paths = [os.path.join(self.folder, f"{name}-description.txt")]
        paths += [self.npy_path(name, array) for array in ARRAYS]
        return all(map(os.path.isfile, paths))

    # --- catalog ---------------------------------------------------------------------------

    def _read_catalog(self) -> dict[str, Entry]:
        path = os.path.join(self.folder, CATALOG_FILE)
        try:
            with open(path, "rb") as stream:
                if os.fstat(stream.fileno()).st_size > MAX_CATALOG_SIZE:
                    raise FormatError(f"{path}: larger than {MAX_CATALOG_SIZE} bytes")
                data = stream.read()
            # many small objects: a full collection of a torch-sized heap would cost more
            # than the parse itself
            collecting = gc.isenabled()
            gc.disable()
            try:
                raw = json.loads(data)
            finally:
                if collecting:
                    gc.enable()
        except FileNotFoundError:
            return {}
        except RecursionError:
            raise FormatError(f"{path}: nested too deeply") from None
        except ValueError as err:
            raise FormatError(f"{path}: not valid JSON: {err}") from None
        if raw.get("format") != CATALOG_FORMAT or raw.get("version") != CATALOG_VERSION:
            raise FormatError(
                f"{path}: format {raw.get('format')!r} version {raw.get('version')!r}, "
                f"expected {CATALOG_FORMAT!r} version {CATALOG_VERSION}"
            )
        entries = {}
        for name, item in raw["entries"].items():
            pack = item["pack"]
            if "/" in pack or pack in ("", ".", ".."):
                raise FormatError(f"{path}: pack {pack!r} is not a plain file name")
            arrays = tuple(
                _Array(a["offset"], np.dtype(a["dtype"]).str, tuple(a["shape"]))
                for a in (item[n] for n in ARRAYS)
            )
            entries[name] = Entry(name, pack, arrays)
        return entries

    def _catalog_entries(self) -> dict[str, Entry]:
        if self._catalog is None:
            self._catalog = self._read_catalog()
        return self._catalog

    def lookup(self, name: str) -> Entry | None:
        """The packed entry for dataset ``name``, if a pack holds it (one stat per pack)."""
        with self._lock:
            entry = self._catalog_entries().get(name) or self._pending.get(name)
            if entry is None or entry.pack is None:
                return entry
            seen = self._packs_seen.get(entry.pack)
            if seen is None:
                seen = os.path.isfile(os.path.join(self.folder, entry.pack))
                self._packs_seen[entry.pack] = seen
            return entry if seen else None

    def add_stock(self, name: str) -> Entry:
        """Register Megatron's ``.npy`` files of ``name``, to be packed on first use."""
        with self._lock:
            arrays = tuple(_npy_header(self.npy_path(name, array))[0] for array in ARRAYS)
            entry = Entry(name, None, arrays)
            self._pending[name] = entry
            return entry

    # --- packing and mapping -----------------------------------------------------------------

    def arrays(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The document, sample and shuffle index of ``name``, read-only, from a shared map."""
        with self._lock:
            if self.lookup(name) is None and self.has_stock(name):
                # registered in another process (a spawned worker of a parent that read no
                # sample yet), or its pack was deleted: pack Megatron's files now
                self.add_stock(name)
            if name in self._pending:
                self.flush()
            entry = self.lookup(name)
            if entry is None:
                raise FormatError(f"{self.folder}: no cached indices for {name}")
            if entry.pack is None:
                # The folder is not writable: map Megatron's files as Megatron does.
                return tuple(
                    np.load(self.npy_path(name, a), mmap_mode="r", allow_pickle=False)
                    for a in ARRAYS
                )
            buffer = self._maps.get(entry.pack)
            if buffer is None:
                with open(os.path.join(self.folder, entry.pack), "rb") as stream:
                    buffer = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
                self._maps[entry.pack] = buffer
            return tuple(
                np.frombuffer(
                    buffer, np.dtype(a.dtype), int(np.prod(a.shape, dtype=np.int64)), a.offset
                ).reshape(a.shape)
                for a in entry.arrays
            )

    def flush(self) -> None:
        """Copy every pending dataset's ``.npy`` arrays into one new pack and catalog it.

        Safe with other processes sharing the folder: the catalog is updated under an
        exclusive ``flock``, and datasets another process packed meanwhile are reused.
        """
        with self._lock:
            if not self._pending:
                return
            try:
                lock_fd = os.open(
                    os.path.join(self.folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644
                )
            except OSError as err:
                self._map_one_by_one("write", err)
                return
            try:
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX)
                except OSError as err:  # a file system mounted without flock support
                    self._map_one_by_one("lock", err)
                    return
                catalog = self._read_catalog()
                todo = [
                    e
                    for n, e in sorted(self._pending.items())
                    if n not in catalog
                    or not os.path.isfile(os.path.join(self.folder, catalog[n].pack))
                ]
                if todo:
                    packed = self._write_pack(todo)
                    catalog.update(packed)
                    self._write_catalog(catalog)
                self._catalog = catalog
                self._packs_seen.clear()
                self._pending.clear()
            finally:
                os.close(lock_fd)

    def _map_one_by_one(self, action: str, err: OSError) -> None:
        """Give up packing (the cache folder cannot be written or locked): serve the pending
        datasets from Megatron's own ``.npy`` files."""
        logger.warning(
            "repack: cannot %s the index cache in %s (%s); mapping Megatron's "
            ".npy files one by one instead",
            action,
            self.folder,
            err.strerror,
        )
        self._catalog = {**self._catalog_entries(), **self._pending}
        self._pending.clear()

    def _write_pack(self, todo: list[Entry]) -> dict[str, Entry]:
        digest = hashlib.md5(usedforsecurity=False)
        for entry in todo:
            digest.update(entry.name.encode() + b"\n")
        pack = f"pack-{digest.hexdigest()}.rpc"
        final = os.path.join(self.folder, pack)
        tmp = f"{final}.tmp-{os.getpid()}"
        packed = {}
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            position = 0
            for entry in todo:
                placed = []
                for array_name in ARRAYS:
                    path = self.npy_path(entry.name, array_name)
                    header, size = _npy_header(path)
                    position = align_up(position, ARRAY_ALIGNMENT)
                    src = os.open(path, os.O_RDONLY)
                    try:
                        copy_range(src, fd, header.offset, position, size - header.offset)
                    finally:
                        os.close(src)
                    placed.append(_Array(position, header.dtype, header.shape))
                    position += size - header.offset
                packed[entry.name] = Entry(entry.name, pack, tuple(placed))
            os.ftruncate(fd, max(position, 1))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        fsync_dir(self.folder)
        return packed

    def _write_catalog(self, catalog: dict[str, Entry]) -> None:
        body = {
            "format": CATALOG_FORMAT,
            "version": CATALOG_VERSION,
            "entries": {
                name: {
                    "pack": entry.pack,
                    **{
                        array_name: {
                            "offset": a.offset,
                            "dtype": a.dtype,
                            "shape": list(a.shape),
                        }
                        for array_name, a in zip(ARRAYS, entry.arrays)
                    },
                }
                for name, entry in sorted(catalog.items())
            },
        }
        data = json.dumps(body, indent=1, sort_keys=True).encode()
        atomic_write(os.path.join(self.folder, CATALOG_FILE), data)
