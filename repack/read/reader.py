"""Open a repack folder once per process and read from it.

:func:`open_repack` returns the process-wide :class:`Repack` for a folder and backend: every
source view in the process shares its one mapping of the index and one mapping (``mmap``
backend) or file descriptor (``pread`` backend) per shard, opened when the repack is: a
process reads the repack it opened, even if a ``repack remove`` replaces and unlinks shards
meanwhile.

Opening checks the structure (manifest self-checksum and schema, index header against the
manifest, file sizes, every source's lengths against its byte size) and that every file is a
regular file inside the folder (no symbolic link leading out of it); full data checksums are
``repack verify``'s job.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import mmap
import os
import stat
import threading
from collections.abc import Iterator

import numpy as np

from repack.errors import FormatError, ObjectMissing
from repack.format import spec as fmt
from repack.format.codec import CompressedShard
from repack.format.manifest import Manifest, SourceEntry
from repack.read.readahead import ReadAhead, settings
from repack.store import Store, open_store
from repack.store.base import Handle
from repack.store.objects import RemoteShard

__all__ = ["BACKENDS", "Repack", "open_repack"]

BACKENDS = ("mmap", "pread")

# madvise advice for shard mappings (None where the platform lacks it)
_MADV_RANDOM = getattr(mmap, "MADV_RANDOM", None)
_MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)
#: A repack whose shards hold more than this fraction of the machine's RAM is read page by page
#: (see Repack._exact_reads); a smaller one with the kernel's read-around.
EXACT_READS_ABOVE_RAM_FRACTION = 1 / 8


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


_LOCK = threading.Lock()
#: Times a repack is opened anew when its manifest was replaced while it was being opened.
_OPEN_ATTEMPTS = 3
_OPEN: dict[tuple[str, str], Repack] = {}


#: Set to ``0`` to keep the garbage collector as it is in processes forked from one that has a
#: repack open (see _after_fork_in_child).
FORK_GC_FREEZE_ENV = "REPACK_FORK_GC_FREEZE"


def _after_fork_in_child() -> None:
    """In a forked child (a DataLoader worker) of a process that has a repack open.

    A lock held by another thread at fork time would stay locked forever in the child: every
    lock is new. The open repacks themselves stay valid: mappings and descriptors survive
    fork, and the pread backend has no shared file offset.

    Its shards are read page by page (:meth:`Repack._reads_page_by_page`): siblings faulting
    at random into the same shards each made the kernel read up to ``read_ahead_kb`` around
    every fault.

    The objects inherited from the parent are frozen (``gc.freeze()``, what Python's
    documentation advises before a fork without exec): a full collection in the child would
    otherwise walk, and so copy, every page of the parent's heap (the ~400,000 objects of
    torch and Megatron), 0.45-0.66 s per DataLoader worker at 1,000 sources here, set off by
    the parent's collector state rather than by the worker's work. Objects the child makes are
    collected as before; ``REPACK_FORK_GC_FREEZE=0`` turns this off.
    """
    global _LOCK
    _LOCK = threading.Lock()
    for repack in _OPEN.values():
        repack._lock = threading.Lock()
        repack.read_page_by_page()
    if _OPEN and os.environ.get(FORK_GC_FREEZE_ENV, "1") != "0":
        gc.freeze()


#: Set to ``0`` to keep the C heap's free pages in a process that has a repack open when it
#: forks (see _before_fork).
FORK_TRIM_ENV = "REPACK_FORK_TRIM"


def _before_fork() -> None:
    """In a process that has a repack open, before it forks (a DataLoader worker): the C heap's
    free pages go back to the system (glibc's ``malloc_trim(0)``, a few milliseconds), so that
    the child does not start with them. A build of tens of thousands of datasets leaves about
    1.5 KiB a source free in the heap (Megatron's per-dataset descriptions and their JSON, freed
    after it: the allocator keeps the pages), which every worker would otherwise inherit and
    count. A C library without ``malloc_trim`` keeps them; ``REPACK_FORK_TRIM=0`` too."""
    if _OPEN and os.environ.get(FORK_TRIM_ENV, "1") != "0":
        release_free_heap()


def release_free_heap() -> None:
    """The C heap's free pages back to the system (glibc's ``malloc_trim(0)``); nothing where
    the C library has none. For memory freed once that would otherwise stay resident: glibc
    keeps freed blocks below its trim threshold, which it raises to twice the largest mapped
    block freed (a build of thousands of sources frees blocks of several MiB)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` where the C library has none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def open_repack(path: str | os.PathLike, backend: str = "mmap") -> Repack:
    """The process-wide open :class:`Repack` of folder ``path`` with ``backend``.

    Raises:
        FormatError: the folder is not a complete, structurally sound repack.
        ChecksumMismatch: the manifest is damaged.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend is {backend!r}, expected one of {BACKENDS}")
    given = (os.fspath(path), backend)
    repack = _OPEN.get(given)  # no stat per view: every source of a blend asks for it
    if repack is not None:
        return repack
    store = open_store(given[0])
    key = (store.identity, backend)
    with _LOCK:
        repack = _OPEN.get(key)
        if repack is None:
            repack = _OPEN[key] = Repack(key[0], backend)
        _OPEN[given] = repack
        return repack


class Repack:
    """An open repack folder. Prefer :func:`open_repack`, which shares instances."""

    def __init__(self, path: str, backend: str = "mmap", *, check: bool = True) -> None:
        #: Where the repack lives (:func:`repack.store.open_store`): a local folder, or
        #: object storage, whose shards are read with ranged GETs and whose index is mapped
        #: from the node-local cache (:mod:`repack.store.objects`).
        self.store: Store = open_store(path)
        self.path = self.store.location
        self.backend = backend
        self.store.check_inside(fmt.MANIFEST_FILE)
        self.manifest: Manifest = self._load_manifest()
        self._lock = threading.Lock()
        self._shards: dict[int, object] = {}
        self._exact_reads = self._reads_page_by_page()
        #: The bounded range cache and read-ahead of the loader (object storage only, None
        #: when ``REPACK_READ_CACHE=0``): :mod:`repack.read.readahead`.
        self.read_ahead: ReadAhead | None = None
        if self.store.caches_reads:
            limit, ahead = settings()
            if limit:
                self.read_ahead = ReadAhead(self._read_remote, limit, ahead)
        #: Why the index could not be mapped; only ever set with ``check=False``.
        self.index_error: FormatError | None = None
        if check:
            for attempt in range(_OPEN_ATTEMPTS):
                try:
                    self._map_index()
                    self.check_structure()
                    break
                except FormatError:
                    # an add or a remove may have replaced the manifest and unlinked files it
                    # named between our reading it and opening them: read the new one
                    self.close()
                    fresh = self._load_manifest()
                    if attempt + 1 == _OPEN_ATTEMPTS or fresh.checksum == self.manifest.checksum:
                        raise
                    self.manifest = fresh
        else:
            try:
                self._map_index()
            except FormatError as err:
                self.index_error = err

    @property
    def local_folder(self) -> str:
        """A local folder of this repack for what a reader writes (Megatron's index caches):
        the repack folder itself, or for object storage the node-local cache folder of this
        version (:func:`repack.store.objects.cache_folder`)."""
        return self.store.node_folder(self.manifest.checksum)

    def _load_manifest(self) -> Manifest:
        return self.store.manifest()

    # --- index -------------------------------------------------------------------------------

    def _index_copy(self) -> str:
        """The local file of the index: in the folder, or the node-local cached copy."""
        manifest = self.manifest
        try:
            return self.store.local_copy(
                manifest.index_file,
                manifest.index_size,
                manifest.index_checksum,
                manifest.algorithm,
                manifest.checksum,
            )
        except ObjectMissing as err:
            # missing is damage; a store that cannot be read (credentials, network, a
            # missing bucket) is not, and its StoreError says so as it is
            url = self.store.url(manifest.index_file)
            raise FormatError(f"{url}: cannot fetch the index: {err}", location=url) from None

    def _map_index(self) -> None:
        manifest = self.manifest
        index_path = self.store.url(manifest.index_file)
        self.store.check_inside(manifest.index_file)
        with _open_checked(self._index_copy(), manifest.index_size, index_path) as stream:
            if manifest.index_size < fmt.INDEX_HEADER_SIZE:
                raise FormatError(f"{index_path}: shorter than its header", location=index_path)
            buffer = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
        magic, version, flags, n_seq, n_doc = fmt.unpack_index_header(
            buffer[: fmt.INDEX_HEADER_SIZE]
        )
        if magic != fmt.INDEX_MAGIC:
            raise FormatError(
                f"{index_path}: bad magic {magic!r}, expected {fmt.INDEX_MAGIC!r}",
                location=index_path,
            )
        if version != fmt.FORMAT_VERSION or flags:
            raise FormatError(
                f"{index_path}: index version {version} flags {flags}, this release reads "
                f"version {fmt.FORMAT_VERSION} flags 0",
                location=index_path,
            )
        if (n_seq, n_doc) != (manifest.sequence_count, manifest.document_count):
            raise FormatError(
                f"{index_path}: header counts {n_seq} sequences and {n_doc} documents, the "
                f"manifest {manifest.sequence_count} and {manifest.document_count}",
                location=index_path,
            )
        layout = fmt.index_layout(n_seq, n_doc)
        if layout.size != manifest.index_size:
            raise FormatError(
                f"{index_path}: {manifest.index_size} bytes, expected {layout.size}",
                location=index_path,
            )
        self._index_buffer = buffer
        self.lengths = np.frombuffer(buffer, "<i4", n_seq, layout.lengths)
        self.pointers = np.frombuffer(buffer, "<i8", n_seq, layout.pointers)
        self.modes = np.frombuffer(buffer, np.int8, n_seq, layout.modes)
        self.documents = np.frombuffer(buffer, "<i8", n_doc, layout.documents)
        # the same bytes, indexed as Python integers: what a sample read takes one of (a
        # memoryview item is a fifth of a numpy scalar and its int())
        self.length_values = _python_ints(self.lengths)
        self.pointer_values = _python_ints(self.pointers)

    def check_structure(self) -> None:
        """Cheap, vectorized consistency checks of index against manifest; then every shard
        there, a regular file of its size (its version kept: on object storage every later
        read is pinned to it), and open (:meth:`_pin_shards`)."""
        self._check_sources()
        self._etags: dict[int, str] = {}
        for shard in self.manifest.shards:
            url = self.store.url(shard.file)
            self.store.check_inside(shard.file)
            try:
                found = self.store.stat(shard.file)
            except OSError as err:
                raise FormatError(
                    f"{url}: cannot stat shard: {err.strerror}", location=url
                ) from None
            if found is None:
                raise FormatError(f"{url}: cannot stat shard: not found", location=url)
            if found.size != shard.file_size:
                raise FormatError(
                    f"{url}: {found.size} bytes, the manifest says {shard.file_size}",
                    location=url,
                )
            self._etags[shard.number] = found.etag
        self._pin_shards()

    def _pin_shards(self) -> None:
        """Open (or map) every shard now, not on first read, so that this repack is read as it
        was when opened even if a ``repack remove`` replaces and unlinks some of its files: an
        open descriptor or a mapping keeps an unlinked file readable."""
        with self._lock:
            for shard in self.manifest.shards:
                if shard.number not in self._shards:
                    self._shards[shard.number] = self._open_shard(shard.number)

    def _check_sources(self) -> None:
        """Every source's tokens in the index agree with the manifest, and its document
        indices run from 0 to its sequence count: from the manifest's columns, a block of
        sources at a time (no entry made per source)."""
        manifest = self.manifest
        table = manifest.source_table
        if not len(table):
            return
        starts, counts = table.sequence_start, table.sequence_count
        found = np.empty(len(table), dtype=np.int64)
        i = 0
        while i < len(table):
            # the sources whose sequences start in the next block (at least one): their
            # lengths summed in int64, a block at a time (never a copy of all of them)
            j = max(i + 1, int(np.searchsorted(starts, starts[i] + _CHECK_BLOCK, "left")))
            low, high = int(starts[i]), int(starts[j - 1] + counts[j - 1])
            if j == i + 1:
                found[i] = self.lengths[low:high].sum(dtype=np.int64)
            else:
                sums = np.concatenate(([0], np.cumsum(self.lengths[low:high], dtype=np.int64)))
                found[i:j] = sums[starts[i:j] + counts[i:j] - low] - sums[starts[i:j] - low]
            i = j
        sizes = _itemsizes(table.dtype_code)
        index_path = os.path.join(self.path, manifest.index_file)
        bad = np.flatnonzero((found != table.token_count) | (found * sizes != table.bin_size))
        if len(bad):
            source = table[int(bad[0])]
            raise FormatError(
                f"{index_path}: source {source.name!r} has {int(found[bad[0]])} tokens in the "
                f"index, the manifest says {source.token_count}",
                location=index_path,
            )
        first = self.documents[table.document_start]
        last = self.documents[table.document_start + table.document_count - 1]
        bad = np.flatnonzero((first != 0) | (last != counts))
        if len(bad):
            k = int(bad[0])
            source = table[k]
            raise FormatError(
                f"{index_path}: document indices of {source.name!r} run from "
                f"{int(first[k])} to {int(last[k])}, expected 0 to {source.sequence_count}",
                location=index_path,
            )

    # --- shards ------------------------------------------------------------------------------

    def _reads_page_by_page(self) -> bool:
        """Whether the mmap backend reads only the pages a sample needs.

        On a page fault the kernel reads up to the device's ``read_ahead_kb`` around the
        faulting page (128 KiB by default, 8 MiB on the benchmark machine). When the data is
        larger than a fair share of the page cache, those neighbours are evicted before a
        random sample ever needs them: reading only a sample's pages (``MADV_RANDOM``, then
        ``MADV_WILLNEED`` on them) read twice as many samples per second from a cold cache at
        10,000 sources (3.3 GB) here. Data that fits in an eighth of RAM is read whole over an
        epoch anyway, and the read-around fetches it in a few large requests instead of one
        per sample (scripts/bench_loader.py --cold-reads, docs/benchmarks.md). That is for the
        process that opens the repack; its forked children (DataLoader workers) read page by
        page whatever the size (:func:`_after_fork_in_child`).
        """
        if _MADV_RANDOM is None or _MADV_WILLNEED is None:
            return False
        data = sum(shard.file_size for shard in self.manifest.shards)
        return data > _ram_bytes() * EXACT_READS_ABOVE_RAM_FRACTION

    def read_page_by_page(self) -> None:
        """Read only the pages a sample needs from now on (mmap backend), in this process: a
        forked DataLoader worker, one of several reading the same shards at random."""
        if self.backend != "mmap" or self._exact_reads:
            return
        if _MADV_RANDOM is None or _MADV_WILLNEED is None:
            return
        self._exact_reads = True
        for handle in self._shards.values():
            if isinstance(handle, mmap.mmap):
                handle.madvise(_MADV_RANDOM)  # this process's mapping; the parent's keeps its own

    def remote_raw(self, number: int) -> bool:
        """Whether shard ``number`` is a raw (uncompressed) shard on object storage, whose
        byte ranges :attr:`read_ahead` can fetch."""
        return self.store.caches_reads and self.manifest.shards[number].codec is None

    def shard_path(self, number: int) -> str:
        """Path (or URL) of shard ``number``."""
        return self.store.url(self.manifest.shards[number].file)

    def _shard(self, number: int) -> object:
        handle = self._shards.get(number)
        if handle is None:
            with self._lock:
                handle = self._shards.get(number)
                if handle is None:
                    handle = self._open_shard(number)
                    self._shards[number] = handle
        return handle

    def _open_shard(self, number: int) -> object:
        path = self.shard_path(number)
        entry = self.manifest.shards[number]
        size = entry.size
        self.store.check_inside(entry.file)
        etag = getattr(self, "_etags", {}).get(number)
        try:
            handle = self.store.open(entry.file, entry.file_size, etag)
        except OSError as err:
            raise FormatError(f"{path}: cannot open: {err.strerror}") from None
        except ObjectMissing:
            raise FormatError(f"{path}: cannot open: not found", location=path) from None
        if entry.codec is not None:
            # one handle whatever the backend: frames are decompressed on read
            return CompressedShard(path, entry.size, handle)
        if handle.fileno() is None:  # object storage: ranged reads, pinned to the version
            return handle
        # a local file: read with pread, or mapped
        if handle.size != size:
            handle.close()
            raise FormatError(f"{path}: size changed to other than {size} bytes")
        if self.backend == "pread":
            return handle.detach()
        try:
            if size == 0:
                return b""
            mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        finally:
            handle.close()
        if self._exact_reads:
            # no read-around on a page fault: read() asks for the exact pages instead
            mapping.madvise(_MADV_RANDOM)
        return mapping

    def _read_remote(self, shard: int, offset: int, size: int) -> bytes:
        """Bytes of a raw shard on object storage (what :class:`ReadAhead` fetches)."""
        return self._shard(shard).read(offset, size)

    def read(self, shard: int, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` items of ``dtype`` at byte ``offset`` of shard ``shard``.

        The ``mmap`` backend returns a read-only view of the mapping; ``pread`` a new array.
        """
        handle = self._shard(shard)
        kind = type(handle)
        # a local raw shard first, by its exact type: every sample read takes this path, and
        # the isinstance checks below cost ~0.1 us each (ABCs), frombuffer's keywords ~0.3 us
        if kind is mmap.mmap:
            if self._exact_reads and count:
                # one read of the pages the caller is about to touch, started now, instead of
                # one synchronous fault per page (the mapping is MADV_RANDOM); ~1 us when the
                # pages are cached already
                start = offset - offset % mmap.PAGESIZE
                size = count * np.dtype(dtype).itemsize
                handle.madvise(_MADV_WILLNEED, start, offset + size - start)
            return np.frombuffer(handle, dtype, count, offset)
        if kind is not int:  # (the pread backend's descriptor)
            if isinstance(handle, RemoteShard):
                size = count * np.dtype(dtype).itemsize
                data = None
                if self.read_ahead is not None and size:
                    data = self.read_ahead.get(shard, offset, size)
                if data is None:
                    data = handle.read(offset, size)
                return np.frombuffer(data, dtype=dtype, count=count)
            if isinstance(handle, CompressedShard):
                data = handle.read(offset, count * np.dtype(dtype).itemsize)
                return np.frombuffer(data, dtype=dtype, count=count)
            if self.backend == "mmap":  # an empty shard (b"")
                return np.frombuffer(handle, dtype, count, offset)
        out = np.empty(count, dtype=dtype)
        view = memoryview(out.view(np.uint8))
        done = 0
        while done < len(view):
            n = os.preadv(handle, [view[done:]], offset + done)
            if n == 0:
                raise FormatError(f"{self.shard_path(shard)}: ends before byte {offset + done}")
            done += n
        return out

    def shard_handle(self, number: int) -> Handle:
        """A read handle of the logical bytes of shard ``number`` (the caller closes it): the
        stored file's own where it is raw (a local one's descriptor, for ``copy_file_range``;
        ranged reads pinned to its ETag on object storage), decompressed frame by frame
        where it is compressed."""
        entry = self.manifest.shards[number]
        if entry.codec is not None:
            return _Frames(self, number)
        self.store.check_inside(entry.file)
        etag = getattr(self, "_etags", {}).get(number)
        return self.store.open(entry.file, entry.file_size, etag)

    def read_bytes(self, shard: int, offset: int, size: int) -> bytes | memoryview:
        """The logical bytes ``[offset, offset + size)`` of shard ``shard`` (decompressed if
        the shard is stored compressed)."""
        return memoryview(self.read(shard, offset, size, np.dtype(np.uint8)))

    def close(self) -> None:
        """Release the shard handles (the index mapping stays while arrays refer to it)."""
        with self._lock:
            for handle in self._shards.values():
                if isinstance(handle, int):
                    os.close(handle)
                elif isinstance(handle, CompressedShard):
                    handle.close()
                elif isinstance(handle, mmap.mmap):
                    try:
                        handle.close()
                    except BufferError:
                        pass
            self._shards.clear()

    # --- per-source views of the index ------------------------------------------------------

    def source_arrays(
        self, source: SourceEntry
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """The source's lengths, pointers, document indices and modes (None when plain),
        exactly as in its original ``.idx`` file (zero-copy views)."""
        seq = slice(source.sequence_start, source.sequence_start + source.sequence_count)
        doc = slice(source.document_start, source.document_start + source.document_count)
        modes = self.modes[seq] if source.multimodal else None
        return self.lengths[seq], self.pointers[seq], self.documents[doc], modes

    def source_idx_chunks(self, source: SourceEntry) -> Iterator[bytes | memoryview]:
        """The bytes of the source's original ``.idx`` file, in order."""
        lengths, pointers, documents, modes = self.source_arrays(source)
        yield fmt.megatron_idx_header(
            source.dtype_code, source.sequence_count, source.document_count
        )
        for array in (lengths, pointers, documents) + ((modes,) if modes is not None else ()):
            yield memoryview(np.ascontiguousarray(array).view(np.uint8))


def _python_ints(array: np.ndarray) -> memoryview | np.ndarray:
    """``array`` indexed as Python integers: a memoryview of it where the machine's byte
    order lets one read its items, else the array itself."""
    view = memoryview(array)
    return view if view.format in ("i", "l", "q") else array


#: Sequences whose lengths a structure check sums at a time (32 MiB of int64).
_CHECK_BLOCK = 1 << 22


def _itemsizes(codes: np.ndarray) -> np.ndarray:
    """The token size of each Megatron dtype code in ``codes`` (codes the manifest checked)."""
    lookup = np.zeros(max(fmt.DTYPES) + 1, dtype=np.int64)
    for code, dtype in fmt.DTYPES.items():
        lookup[code] = dtype.itemsize
    return lookup[codes]


class _open_checked:
    """Open ``path`` for reading and check its size, as a context manager (``name``: how
    messages name it, when ``path`` is a local copy of an object)."""

    def __init__(self, path: str, size: int, name: str | None = None) -> None:
        self.path, self.size = path, size
        self.name = name or path

    def __enter__(self):
        try:
            # O_NONBLOCK: a FIFO in place of a file must be refused, not waited on
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as err:
            raise FormatError(
                f"{self.name}: cannot open: {err.strerror}", location=self.name
            ) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise FormatError(f"{self.name}: not a regular file", location=self.name)
        if st.st_size != self.size:
            os.close(fd)
            raise FormatError(
                f"{self.name}: {st.st_size} bytes, the manifest says {self.size}",
                location=self.name,
            )
        os.set_blocking(fd, True)
        self.stream = os.fdopen(fd, "rb")
        return self.stream

    def __exit__(self, *exc) -> None:
        self.stream.close()


class _Frames(Handle):
    """The logical bytes of a compressed shard of an open repack, read through its frames."""

    def __init__(self, repack: Repack, number: int) -> None:
        self._repack, self._number = repack, number
        self.size = repack.manifest.shards[number].size
        self.path = repack.shard_path(number)

    def read(self, offset: int, size: int) -> bytes:
        return bytes(self._repack.read_bytes(self._number, offset, size))

    def scan(self, offset: int, size: int) -> Iterator[memoryview]:
        for start in range(offset, offset + size, _SCAN):
            yield self._repack.read_bytes(self._number, start, min(_SCAN, offset + size - start))

    def close(self) -> None:
        return None


#: Logical bytes per piece of a compressed shard's scan.
_SCAN = 1024 * 1024
