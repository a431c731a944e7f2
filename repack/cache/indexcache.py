"""Megatron's per-dataset cached indices, consolidated: one mapped file per build instead of
four files per dataset and split.

Megatron's ``GPTDataset`` caches, per dataset and split, a document index, a sample index and
a shuffle index as three ``.npy`` files (plus a ``-description.txt``) named
``{hash}-GPTDataset-{split}-*``, and maps all three for the life of the process. With tens of
thousands of datasets that is a storm of file creations on a cold start and thousands of mmaps
on every start.

Here the arrays of every dataset a process builds go, the first time a sample is read, into one
*pack* file; a JSON *catalog* maps each dataset's ``{hash}-GPTDataset-{split}`` name to its
arrays in a pack. Arrays come from memory (computed by Megatron's own functions, nothing
written per dataset: :meth:`IndexCache.add_arrays`) or from Megatron's ``.npy`` files when a
stock cache is already there (:meth:`IndexCache.add_stock`). Later runs read the catalog (one
open) and map each pack once, however many datasets it holds; a catalog entry is parsed only
when its dataset asks for it. A record is one string, ``"pack-….rpc 0:<i4:12 64:<i4:9x2
192:<i4:8"`` (the pack, then each array's ``offset:dtype:shape``): tens of thousands of
records decode to strings only, which Python's garbage collector does not walk, and are kept in
columns, a text of names and one of records (:class:`~repack.cache.index_records.Records`).
The catalog also records, in its ``sources`` member, the repack source each dataset was built
from, so that ``repack remove`` can take a source's arrays out of the cache
(:meth:`IndexCache.drop`): one string of ``NAME<tab>SOURCE`` lines, which a warm build decodes
(a copy) but never splits; older catalogs without it are still read.

Memory: the pack is mapped read-only and shared through the page cache like Megatron's own
``.npy`` mmaps; nothing is copied into private memory per rank once the pack is written.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from repack.cache.index_records import (
    ARRAYS,
    Array,
    Arrays,
    Entry,
    PackWriter,
    Records,
    describe,
    npy_header,
    parse_entry,
    record_pack_samples,
    recordable,
    sources_of,
)
from repack.errors import FormatError
from repack.fileio import atomic_write, fsync_dir
from repack.format.gcpause import gc_paused

__all__ = ["CATALOG_FILE", "PACK_PREFIX", "PACK_SUFFIX", "IndexCache"]

logger = logging.getLogger(__name__)

CATALOG_FILE = "repack-index-cache.json"
LOCK_FILE = "repack-index-cache.lock"
CATALOG_FORMAT = "repack-index-cache"
CATALOG_VERSION = 2
#: Catalog versions read: 1 wrote each record as an object of objects and lists.
CATALOG_VERSIONS = (1, 2)
MAX_CATALOG_SIZE = 256 * 1024 * 1024
PACK_PREFIX, PACK_SUFFIX = "pack-", ".rpc"
#: How many datasets' arrays a process keeps views of (IndexCache.recent).
RECENT = 256

_LOCK = threading.Lock()
_CACHES: dict[str, IndexCache] = {}


def _reset_locks_after_fork() -> None:
    # a lock held by another thread at fork time would stay locked forever in the child
    global _LOCK
    _LOCK = threading.Lock()
    for cache in _CACHES.values():
        cache._lock = threading.RLock()


os.register_at_fork(after_in_child=_reset_locks_after_fork)


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
        #: The catalog's records, read once, parsed on each lookup (a few microseconds): kept
        #: as strings, tens of thousands of them give the garbage collector nothing to walk.
        self._catalog: Records | dict[str, Any] | None = None
        self._packs_seen: dict[str, bool] = {}
        #: Each mapped pack as one read-only ``uint8`` array: a dataset's arrays are views
        #: of it (no ``memoryview`` and buffer object of their own per array: 6 objects per
        #: dataset for the garbage collector to walk, 1.6 KiB a dataset, at 30,000 sources).
        self._maps: dict[str, np.ndarray] = {}
        #: Registered, not packed yet: arrays in _fresh, else Megatron's .npy files.
        self._pending: dict[str, Entry] = {}
        self._fresh: dict[str, Arrays] = {}
        #: Could not be packed (folder not writable or lockable): served from where they are.
        self._unpacked: dict[str, Entry] = {}
        #: Names with a complete set of Megatron's own cache files, from one listing.
        self._stock: set[str] | None = None
        #: The repack source (its absolute path) of each registered dataset, when known.
        self._source_of: dict[str, str] = {}
        #: The arrays last served by :meth:`arrays`, by name: at most RECENT of them.
        self._recent: dict[str, Arrays] = {}

    def npy_path(self, name: str, array: str) -> str:
        """Megatron's file name for one cached array of dataset ``name``."""
        return os.path.join(self.folder, f"{name}-{array}.npy")

    def has_stock(self, name: str) -> bool:
        """Whether Megatron's own cache files for ``name`` exist (its cache-hit test).

        Answered from one listing of the folder, taken the first time and again after each
        flush, instead of four stats per dataset.
        """
        with self._lock:
            if self._stock is None:
                self._stock = self._list_stock()
            return name in self._stock

    def _list_stock(self) -> set[str]:
        try:
            files = set(os.listdir(self.folder))
        except FileNotFoundError:
            return set()
        suffix = "-description.txt"
        return {
            f[: -len(suffix)]
            for f in files
            if f.endswith(suffix) and all(f"{f[: -len(suffix)]}-{a}.npy" in files for a in ARRAYS)
        }

    # --- catalog ---------------------------------------------------------------------------

    def _catalog_path(self) -> str:
        return os.path.join(self.folder, CATALOG_FILE)

    def _read_catalog(self) -> tuple[dict[str, Any], str]:
        """The catalog's records, unparsed (a warm build parses only the ones it looks up),
        and its ``sources`` text, unsplit (see :func:`sources_of`)."""
        path = self._catalog_path()
        try:
            with open(path, "rb") as stream:
                if os.fstat(stream.fileno()).st_size > MAX_CATALOG_SIZE:
                    raise FormatError(f"{path}: larger than {MAX_CATALOG_SIZE} bytes")
                data = stream.read()
            with gc_paused():
                raw = json.loads(data)
        except FileNotFoundError:
            return {}, ""
        except RecursionError:
            raise FormatError(f"{path}: nested too deeply") from None
        except ValueError as err:
            raise FormatError(f"{path}: not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise FormatError(f"{path}: not a JSON object")
        if raw.get("format") != CATALOG_FORMAT or raw.get("version") not in CATALOG_VERSIONS:
            raise FormatError(
                f"{path}: format {raw.get('format')!r} version {raw.get('version')!r}, "
                f"expected {CATALOG_FORMAT!r} version {CATALOG_VERSION} (or older)"
            )
        entries = raw.get("entries")
        if not isinstance(entries, dict):
            raise FormatError(f"{path}: 'entries' is not an object")
        sources = raw.get("sources")
        if not isinstance(sources, str):
            sources = ""  # written by an older repack: sources unknown
        return entries, sources

    def _packed_entry(self, name: str) -> Entry | None:
        if self._catalog is None:
            self._catalog = Records.of(self._read_catalog()[0])
        item = self._catalog.get(name)
        if item is None:
            return None
        try:
            return parse_entry(name, item)
        except (KeyError, TypeError, ValueError) as err:
            detail = f"missing {err.args[0]!r}" if isinstance(err, KeyError) else err
            raise FormatError(f"{self._catalog_path()}: entry {name!r}: {detail}") from None

    def _pack_exists(self, pack: str) -> bool:
        seen = self._packs_seen.get(pack)
        if seen is None:
            seen = self._packs_seen[pack] = os.path.isfile(os.path.join(self.folder, pack))
        return seen

    def lookup(self, name: str) -> Entry | None:
        """The entry of dataset ``name``: packed (its pack exists: one stat per pack), or
        registered in this process and not packed yet."""
        with self._lock:
            entry = self._pending.get(name) or self._unpacked.get(name)
            if entry is not None:
                return entry
            entry = self._packed_entry(name)
            if entry is None or not self._pack_exists(entry.pack):
                return None
            return entry

    def sample_count(self, name: str) -> int | None:
        """``lookup(name).sample_count``, or ``None`` where ``lookup`` finds nothing: read
        from a packed record's text without parsing it whole (a warm build asks it of every
        dataset; the record is checked whole when its arrays are read, :meth:`arrays`)."""
        with self._lock:
            if name not in self._pending and name not in self._unpacked:
                catalog = self._catalog
                if catalog is None:
                    catalog = self._catalog = Records.of(self._read_catalog()[0])
                if type(catalog) is Records:
                    found = catalog.pack_samples(name)
                else:
                    found = record_pack_samples(catalog.get(name))
                if found is not None:
                    count, pack = found
                    return count if self._pack_exists(pack) else None
            entry = self.lookup(name)
            return None if entry is None else entry.sample_count

    def is_packed(self, name: str) -> bool:
        """Whether ``name``'s arrays are in a pack on disk."""
        entry = self.lookup(name)
        return entry is not None and entry.pack is not None

    def add_stock(self, name: str, source: str | None = None) -> Entry:
        """Register Megatron's ``.npy`` files of ``name``, to be packed on first use;
        ``source`` is the repack source the dataset reads (its absolute path)."""
        with self._lock:
            arrays = tuple(npy_header(self.npy_path(name, array))[0] for array in ARRAYS)
            entry = self._pending[name] = Entry(name, None, arrays)
            if recordable(source) is not None:
                self._source_of[name] = source
            return entry

    def add_arrays(self, name: str, arrays: Arrays, source: str | None = None) -> Entry:
        """Register the document, sample and shuffle index of ``name``, computed in memory, to
        be packed on first use; nothing is written now. ``source`` is the repack source the
        dataset reads (its absolute path)."""
        with self._lock:
            self._fresh[name] = arrays
            entry = self._pending[name] = Entry(name, None, describe(arrays))
            if recordable(source) is not None:
                self._source_of[name] = source
            return entry

    # --- packing and mapping -----------------------------------------------------------------

    def arrays(self, name: str, source: str | None = None) -> Arrays:
        """The document, sample and shuffle index of ``name``, read-only, from a shared map
        (``source``: the repack source of the dataset, recorded if it gets packed here)."""
        with self._lock:
            entry = self.lookup(name)
            if entry is None and self.has_stock(name):
                # registered in another process (a spawned worker of a parent that read no
                # sample yet), or its pack was deleted: pack Megatron's files now
                entry = self.add_stock(name, source)
            if entry is not None and name in self._pending:
                self.flush()
                entry = self.lookup(name)
            if entry is None:
                raise FormatError(f"{self.folder}: no cached indices for {name}")
            if entry.pack is None:
                # the folder cannot be written: serve them from where they are
                fresh = self._fresh.get(name)
                if fresh is not None:
                    return fresh
                return tuple(
                    np.load(self.npy_path(name, a), mmap_mode="r", allow_pickle=False)
                    for a in ARRAYS
                )
            try:
                return self._from_pack(entry)
            except FileNotFoundError:
                pass
            # a `repack remove` rewrote the pack (under a new name) after this process read
            # the catalog: the same dataset's arrays, if it kept them, are in the new catalog
            self._catalog = None
            self._packs_seen.clear()
            self._recent.clear()
            entry = self.lookup(name)
            if entry is None or entry.pack is None:
                raise FormatError(
                    f"{self.folder}: the cached indices of {name} are gone (a 'repack remove' "
                    "took its source out while this process was reading): restart the job"
                )
            return self._from_pack(entry)

    def recent(self, name: str) -> Arrays | None:
        """``name``'s arrays if :meth:`arrays` served them lately, else ``None``: a loader asks
        for a dataset's arrays at every sample and holds none, so that a process that reads
        from tens of thousands of datasets keeps views of the last :data:`RECENT` only."""
        return self._recent.get(name)

    def _remember(self, name: str, arrays: Arrays) -> Arrays:
        if len(self._recent) >= RECENT:
            self._recent.clear()  # cheaper than an order, and a pass over RECENT remakes it
        self._recent[name] = arrays
        return arrays

    def _from_pack(self, entry: Entry) -> Arrays:
        path = os.path.join(self.folder, entry.pack)
        whole = self._maps.get(entry.pack)
        if whole is None:
            with open(path, "rb") as stream:
                buffer = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
            whole = self._maps[entry.pack] = np.frombuffer(buffer, np.uint8)
        out = []
        for a in entry.arrays:
            if a.offset + a.nbytes > len(whole):
                raise FormatError(
                    f"{path}: {len(whole)} bytes, the catalog places {entry.name}'s arrays up "
                    f"to byte {a.offset + a.nbytes}"
                )
            # a view of the pack's array: its base is that array, not a buffer of its own
            view = whole[a.offset : a.offset + a.nbytes].view(np.dtype(a.dtype))
            out.append(view.reshape(a.shape))
        return self._remember(entry.name, tuple(out))

    def flush(self) -> None:
        """Write every pending dataset's arrays into one new pack and catalog it.

        Safe with other processes sharing the folder: the catalog is updated under an
        exclusive ``flock``, and datasets another process packed meanwhile are reused.
        """
        with self._lock:
            if not self._pending:
                return
            try:
                os.makedirs(self.folder, exist_ok=True)  # as Megatron does before it saves
                lock_fd = os.open(
                    os.path.join(self.folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644
                )
            except OSError as err:
                self._give_up("write", err)
                return
            try:
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX)
                except OSError as err:  # a file system mounted without flock support
                    self._give_up("lock", err)
                    return
                entries, text = self._read_catalog()
                self._catalog = Records.of(entries)
                del entries
                sources = sources_of(text)
                self._packs_seen.clear()
                todo = [
                    e
                    for n, e in sorted(self._pending.items())
                    if (packed := self._packed_entry(n)) is None
                    or not self._pack_exists(packed.pack)
                ]
                learned = {
                    n: s
                    for n, s in self._source_of.items()
                    if n in self._pending and sources.get(n) != s
                }
                if todo or learned:
                    for entry in self._write_pack(todo) if todo else ():
                        self._catalog[entry.name] = entry.to_record()
                    sources.update(learned)
                    self._write_catalog(self._catalog, sources)
                    self._packs_seen.clear()
                self._pending.clear()
                self._fresh.clear()
                self._source_of.clear()
                self._stock = None  # the folder changed: list it again when asked
            finally:
                os.close(lock_fd)

    def _give_up(self, action: str, err: OSError) -> None:
        """Give up packing (the cache folder cannot be written or locked): serve the pending
        datasets from memory or from Megatron's own ``.npy`` files."""
        logger.warning(
            "repack: cannot %s the index cache in %s (%s); keeping the indices %s",
            action,
            self.folder,
            err.strerror,
            "in memory" if self._fresh else "in Megatron's .npy files, mapped one by one",
        )
        self._unpacked.update(self._pending)
        self._pending.clear()
        self._source_of.clear()

    # --- taking sources out (repack remove) ------------------------------------------------

    def drop(self, keep: Callable[[str | None], bool]) -> tuple[list[str], list[str]]:
        """Take out of the cache every dataset whose source ``keep`` refuses: ``keep`` is
        called with the source recorded for the dataset (its absolute path), or ``None`` where
        none is recorded (a catalog written by an older repack), which it should refuse.

        Under the catalog lock: each pack holding a dropped dataset is written anew, under a
        new name, with the datasets it keeps; the catalog is replaced (atomically) without the
        dropped records; then the replaced packs are unlinked, with any pack the catalog does
        not name and the temp files a killed writer left. Records that cannot be parsed, and
        records of a pack that is gone, are dropped too. A process that had mapped an old pack
        keeps reading it; one that had read the old catalog and not yet mapped the pack finds
        the kept datasets in the new catalog (:meth:`arrays`).

        Returns:
            The names of the datasets dropped, and the files deleted.
        """
        with self._lock:
            if not os.path.isdir(self.folder):
                return [], []
            lock_fd = os.open(os.path.join(self.folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
                return self._drop_locked(keep)
            finally:
                os.close(lock_fd)

    def _drop_locked(self, keep: Callable[[str | None], bool]) -> tuple[list[str], list[str]]:
        records, text = self._read_catalog()
        sources = sources_of(text)
        files = set(os.listdir(self.folder))
        packs = {f for f in files if f.startswith(PACK_PREFIX) and f.endswith(PACK_SUFFIX)}
        kept: dict[str, Entry] = {}
        dropped: list[str] = []
        touched: set[str] = set()  # packs holding a dropped dataset's arrays
        for name, item in records.items():
            try:
                entry = parse_entry(name, item)
            except (KeyError, TypeError, ValueError):
                dropped.append(name)
                touched |= packs  # where its arrays are is unknown: rewrite them all
                continue
            if entry.pack in packs and keep(sources.get(name)):
                kept[name] = entry
            else:
                dropped.append(name)
                touched.add(entry.pack)
        by_pack: dict[str, list[Entry]] = {}
        for entry in kept.values():
            by_pack.setdefault(entry.pack, []).append(entry)
        for old in sorted(touched & set(by_pack)):
            for entry in self._rewrite_pack(old, by_pack[old], packs):
                kept[entry.name] = entry
                packs.add(entry.pack)
        named = {entry.pack for entry in kept.values()}
        stale = sorted(
            f
            for f in files
            if (f in packs and f not in named)
            or (f.startswith(PACK_PREFIX) and f"{PACK_SUFFIX}.tmp-" in f)
            or f.startswith(f"{CATALOG_FILE}.tmp-")
        )
        if dropped or set(sources) - set(kept):
            self._write_catalog(
                {name: entry.to_record() for name, entry in kept.items()},
                {name: source for name, source in sources.items() if name in kept},
            )
        for name in stale:
            try:
                os.unlink(os.path.join(self.folder, name))
            except FileNotFoundError:
                pass
        if stale:
            fsync_dir(self.folder)
        self._catalog = None
        self._packs_seen.clear()
        self._recent.clear()
        self._stock = None
        return sorted(dropped), stale

    def _rewrite_pack(self, old: str, entries: list[Entry], taken: set[str]) -> list[Entry]:
        """The arrays of ``entries``, copied from pack ``old`` into a new pack (a name not in
        ``taken``)."""
        salt = 0
        while True:
            digest = hashlib.md5(usedforsecurity=False)
            digest.update(f"{old}\n{salt}\n".encode())
            for entry in entries:
                digest.update(entry.name.encode() + b"\n")
            pack = f"{PACK_PREFIX}{digest.hexdigest()}{PACK_SUFFIX}"
            if pack not in taken:
                break
            salt += 1
        src = os.open(os.path.join(self.folder, old), os.O_RDONLY)
        size = os.fstat(src).st_size

        def fill(writer: PackWriter) -> list[Entry]:
            moved = []
            for entry in entries:
                placed = []
                for a in entry.arrays:
                    if a.offset + a.nbytes > size:
                        raise FormatError(
                            f"{os.path.join(self.folder, old)}: {size} bytes, the catalog "
                            f"places {entry.name}'s arrays up to byte {a.offset + a.nbytes}"
                        )
                    placed.append(Array(writer.copy(src, a.offset, a.nbytes), a.dtype, a.shape))
                moved.append(Entry(entry.name, pack, tuple(placed)))
            return moved

        try:
            return self._new_pack(pack, fill)
        finally:
            os.close(src)

    def _write_pack(self, todo: list[Entry]) -> list[Entry]:
        digest = hashlib.md5(usedforsecurity=False)
        for entry in todo:
            digest.update(entry.name.encode() + b"\n")
        pack = f"{PACK_PREFIX}{digest.hexdigest()}{PACK_SUFFIX}"

        def fill(writer: PackWriter) -> list[Entry]:
            packed = []
            for entry in todo:
                fresh = self._fresh.get(entry.name)
                placed = []
                for array_name, array in zip(ARRAYS, entry.arrays):
                    if fresh is not None:
                        offset = writer.add(fresh[len(placed)])
                    else:
                        path = self.npy_path(entry.name, array_name)
                        src = os.open(path, os.O_RDONLY)
                        try:
                            offset = writer.copy(src, array.offset, array.nbytes)
                        finally:
                            os.close(src)
                    placed.append(Array(offset, array.dtype, array.shape))
                packed.append(Entry(entry.name, pack, tuple(placed)))
            return packed

        return self._new_pack(pack, fill)

    def _new_pack(self, pack: str, fill: Any) -> list[Entry]:
        """Write the pack file ``pack``: ``fill(writer)`` appends the arrays and returns the
        entries; temp file, fsync, rename, fsync of the folder."""
        final = os.path.join(self.folder, pack)
        tmp = f"{final}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            writer = PackWriter(fd)
            packed = fill(writer)
            writer.drain()
            os.ftruncate(fd, max(writer.position, 1))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, final)
        fsync_dir(self.folder)
        return packed

    def _write_catalog(self, records: Records | dict[str, Any], sources: dict[str, str]) -> None:
        records = dict(records.items())
        for name, item in records.items():
            if not isinstance(item, str):  # a version-1 record: rewritten in version 2
                try:
                    records[name] = parse_entry(name, item).to_record()
                except (KeyError, TypeError, ValueError):
                    pass  # damaged: left as it is, still named by the lookup that meets it
        body = {
            "format": CATALOG_FORMAT,
            "version": CATALOG_VERSION,
            "entries": records,
            # which repack source each dataset reads, for `repack remove` (readers of catalog
            # version 2 from before it ignore the member)
            "sources": "".join(
                f"{name}\t{sources[name]}\n" for name in sorted(records) if name in sources
            ),
        }
        # compact: tens of thousands of entries are read back by every warm build
        data = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
        atomic_write(self._catalog_path(), data)
