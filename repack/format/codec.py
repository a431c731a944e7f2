"""Compressed shards: independently decompressible zstd frames and a frame table.

A compressed shard stores the bytes of the raw shard (its *logical* bytes, which every offset in
the manifest and index refers to) cut into blocks of ``block_size`` bytes, each compressed as
its own zstd frame, followed by a footer::

    frame 0 | frame 1 | ... | frame n-1 | table: u64[n + 1] | trailer (32 bytes)

``table[i]`` is the byte offset of frame ``i`` in the file, ``table[n]`` the end of the last
frame. The trailer is ``RPKZSTD\\0``, then u64 block size, u64 block count ``n``, u64 logical
size, all little-endian. Reading any byte range decompresses only the blocks it overlaps:
a sample costs at most ``ceil(length / block_size) + 1`` block decompressions.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import zstandard

from repack.errors import FormatError

__all__ = [
    "BLOCK_SIZE",
    "CODECS",
    "CompressedShard",
    "FrameWriter",
    "compress_file",
    "parse_codec",
]

CODECS = ("zstd",)
#: Logical bytes per frame: small enough that a random sample decompresses little, large
#: enough for a good ratio.
BLOCK_SIZE = 64 * 1024
TRAILER_MAGIC = b"RPKZSTD\x00"
_TRAILER = struct.Struct("<8sQQQ")
#: Blocks of decompressed data kept per reader thread (sequential and nearby reads hit).
CACHED_BLOCKS = 4


def parse_codec(text: str) -> tuple[str, int]:
    """Parse ``zstd`` or ``zstd:LEVEL`` into (codec, level).

    Raises:
        ValueError: not a known codec or level.
    """
    name, _, level = text.partition(":")
    if name not in CODECS:
        raise ValueError(f"{text!r}: unknown codec; known: {', '.join(CODECS)}[:LEVEL]")
    if not level:
        return name, 3
    if not level.lstrip("-").isdigit() or not -7 <= int(level) <= 22:
        raise ValueError(f"{text!r}: zstd level must be an integer from -7 to 22")
    return name, int(level)


def compress_file(
    src: str,
    dst: str,
    level: int,
    *,
    block_size: int = BLOCK_SIZE,
    progress: Callable[[int], object] | None = None,
) -> int:
    """Compress the file ``src`` into a compressed shard at ``dst`` (fsynced). Returns its size.

    Blocks are compressed on all cores (zstd's own threads are not used: each block is a
    separate frame, so they are compressed in parallel by a thread pool).
    """
    from concurrent.futures import ThreadPoolExecutor

    size = os.stat(src).st_size
    count = -(-size // block_size)
    compressors = threading.local()

    def compress(index: int) -> bytes:
        compressor = getattr(compressors, "c", None)
        if compressor is None:
            # each frame carries its own content checksum: a damaged frame fails to decode
            compressor = compressors.c = zstandard.ZstdCompressor(
                level=level, write_content_size=True, write_checksum=True
            )
        with open(src, "rb") as stream:
            stream.seek(index * block_size)
            return compressor.compress(stream.read(block_size))

    table = np.zeros(count + 1, dtype="<u8")
    with open(dst, "wb") as out, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        position = 0
        window = 4 * (os.cpu_count() or 1)
        for start in range(0, count, window):
            blocks = list(pool.map(compress, range(start, min(count, start + window))))
            for n, frame in enumerate(blocks):
                table[start + n] = position
                out.write(frame)
                position += len(frame)
                if progress:
                    progress(min(block_size, size - (start + n) * block_size))
        table[count] = position
        out.write(table.tobytes())
        out.write(_TRAILER.pack(TRAILER_MAGIC, block_size, count, size))
        out.flush()
        os.fsync(out.fileno())
        return out.tell()


class FrameWriter:
    """Compress logical bytes into a compressed shard as they are written, for a stream with
    no file behind it (an upload): the same frames, table and trailer as
    :func:`compress_file` writes, byte for byte, one frame at a time.

    ``out(data)`` receives every byte of the compressed shard in order; :meth:`finish` writes
    the last frame, the table and the trailer and returns the compressed size.
    """

    def __init__(self, out: Callable[[bytes], object], level: int, block_size: int = BLOCK_SIZE):
        self._out = out
        self.block_size = block_size
        self._compressor = zstandard.ZstdCompressor(
            level=level, write_content_size=True, write_checksum=True
        )
        self._block = bytearray()
        self._table: list[int] = []
        self.size = 0
        self.logical_size = 0

    def write(self, data: bytes | memoryview) -> None:
        """Add logical bytes."""
        self._block += data
        self.logical_size += len(data)
        while len(self._block) >= self.block_size:
            self._frame(bytes(self._block[: self.block_size]))
            del self._block[: self.block_size]

    def _frame(self, raw: bytes) -> None:
        self._table.append(self.size)
        self._emit(self._compressor.compress(raw))

    def _emit(self, data: bytes) -> None:
        self._out(data)
        self.size += len(data)

    def finish(self) -> int:
        """Write what is left, the frame table and the trailer; the compressed size."""
        if self._block:
            self._frame(bytes(self._block))
            self._block = bytearray()
        count = len(self._table)
        self._emit(np.array([*self._table, self.size], dtype="<u8").tobytes())
        self._emit(_TRAILER.pack(TRAILER_MAGIC, self.block_size, count, self.logical_size))
        return self.size


class CompressedShard:
    """Random access to the logical bytes of a compressed shard, through one descriptor.

    Thread-safe; each thread keeps its own small cache of decompressed blocks.
    """

    def __init__(self, path: str, logical_size: int, file=None) -> None:
        """Open the compressed shard at ``path``, or read it from ``file`` (a read handle of
        a store, :class:`~repack.store.base.Handle`: its ``size`` and ``pread(size, offset)``;
        ``path`` then only names it; :meth:`close` closes it)."""
        self.path = path
        self._file = file
        if file is None:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._pread = lambda size, offset: os.pread(self.fd, size, offset)
            self._file_size = lambda: os.fstat(self.fd).st_size
        else:
            self.fd = None
            self._pread = file.pread
            self._file_size = lambda: file.size
        try:
            self._read_footer(logical_size)
        except BaseException:
            self.close()
            raise
        self._local = threading.local()

    def _read_footer(self, logical_size: int) -> None:
        size = self._file_size()
        if size < _TRAILER.size:
            raise FormatError(f"{self.path}: {size} bytes, too short for a compressed shard")
        magic, block_size, count, logical = _TRAILER.unpack(
            self._pread(_TRAILER.size, size - _TRAILER.size)
        )
        if magic != TRAILER_MAGIC:
            raise FormatError(f"{self.path}: bad trailer {magic!r}, expected {TRAILER_MAGIC!r}")
        if logical != logical_size or block_size == 0 or count != -(-logical // block_size):
            raise FormatError(
                f"{self.path}: trailer says {logical} bytes in {count} blocks of {block_size}, "
                f"the manifest {logical_size} bytes"
            )
        table_size = 8 * (count + 1)
        if table_size > size - _TRAILER.size:
            raise FormatError(f"{self.path}: frame table larger than the file")
        table = np.frombuffer(
            self._pread(table_size, size - _TRAILER.size - table_size), dtype="<u8"
        )
        if table[-1] != size - _TRAILER.size - table_size or (
            count and np.any(np.diff(table) <= 0)
        ):
            raise FormatError(f"{self.path}: frame table inconsistent with the file size")
        self.block_size = int(block_size)
        self.count = int(count)
        self.logical_size = int(logical)
        self.table = table.astype(np.int64)

    def _block(self, index: int) -> bytes:
        cache = getattr(self._local, "cache", None)
        if cache is None:
            cache = self._local.cache = OrderedDict()
            self._local.decompressor = zstandard.ZstdDecompressor()
        block = cache.get(index)
        if block is not None:
            cache.move_to_end(index)
            return block
        start, end = int(self.table[index]), int(self.table[index + 1])
        frame = self._pread(end - start, start)
        expected = min(self.block_size, self.logical_size - index * self.block_size)
        try:
            block = self._local.decompressor.decompress(frame, max_output_size=expected)
        except zstandard.ZstdError as err:
            raise FormatError(f"{self.path}: frame {index} does not decompress: {err}") from None
        if len(block) != expected:
            raise FormatError(
                f"{self.path}: frame {index} holds {len(block)} bytes, expected {expected}"
            )
        cache[index] = block
        if len(cache) > CACHED_BLOCKS:
            cache.popitem(last=False)
        return block

    def read(self, offset: int, size: int) -> bytes:
        """The logical bytes ``[offset, offset + size)``."""
        if offset < 0 or offset + size > self.logical_size:
            raise FormatError(
                f"{self.path}: read of {size} bytes at {offset} past the logical size "
                f"{self.logical_size}"
            )
        if size == 0:
            return b""
        first, last = offset // self.block_size, (offset + size - 1) // self.block_size
        skip = offset - first * self.block_size
        if first == last:
            return self._block(first)[skip : skip + size]
        parts = [self._block(i) for i in range(first, last + 1)]
        return b"".join(parts)[skip : skip + size]

    def close(self) -> None:
        """Close the descriptor, or the ``file`` it reads from."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._file is not None:
            self._file.close()
            self._file = None
