"""The page cache of this node, asked and emptied for the files a replay reads.

A storage benchmark that reads from memory measures memory: mlcommons/storage#371 reported
``direct_fs`` reading the page cache for months. A replay therefore empties the cache of the
files it will read before it starts (:func:`evict`), counts the pages still resident in the
byte ranges it will read (:func:`resident`, ``mincore(2)`` over a fresh mapping), and each
replaying process reports the bytes the kernel fetched for it (:func:`fetched_bytes`,
``/proc/self/io`` ``read_bytes``). A file system that does not count reads there (FUSE
daemons, NFS on older kernels) reports 0, and the report says the figure is not known rather
than calling the replay cached.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable

import numpy as np

__all__ = ["PAGE", "evict", "fetched_bytes", "resident"]

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def evict(paths: Iterable[str]) -> None:
    """Drop this node's cached pages of ``paths`` (``posix_fadvise(DONTNEED)`` after an
    ``fsync``: dirty pages are not dropped, and a file just written has some).

    Pages another process holds mapped and locked, or that it reads meanwhile, stay: that is
    what :func:`resident` is asked afterwards for.
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            try:
                os.fsync(fd)
            except OSError:  # a read-only file system: nothing of it is dirty
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident(path: str, offsets: np.ndarray, sizes: np.ndarray) -> tuple[int, int]:
    """``(resident, pages)``: of the pages of ``path`` that the byte ranges ``offsets`` /
    ``sizes`` touch, how many this node's page cache holds (``mincore`` on a fresh,
    read-only mapping: mapping a file reads none of it)."""
    offsets = np.asarray(offsets, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    keep = sizes > 0
    if not keep.any():
        return 0, 0
    first = offsets[keep] // PAGE
    last = (offsets[keep] + sizes[keep] - 1) // PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        length = os.fstat(fd).st_size
        if length == 0:
            return 0, 0
        mapping = mmap.mmap(fd, length, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        pages = (length + PAGE - 1) // PAGE
        vector = np.zeros(pages, dtype=np.uint8)
        view = np.frombuffer(mapping, dtype=np.uint8)
        try:
            if _libc.mincore(view.ctypes.data, length, vector.ctypes.data) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore: {os.strerror(err)}", path)
        finally:
            del view
    finally:
        mapping.close()
    wanted = np.zeros(pages + 1, dtype=np.int32)  # pages the ranges touch, each once
    np.add.at(wanted, np.minimum(first, pages), 1)
    np.add.at(wanted, np.minimum(last + 1, pages), -1)
    touched = np.cumsum(wanted[:pages]) > 0
    return int(np.count_nonzero(vector[touched] & 1)), int(np.count_nonzero(touched))


def fetched_bytes() -> int | None:
    """Bytes the kernel fetched from storage for this process so far (``read_bytes`` of
    ``/proc/self/io``), or None where the kernel does not say."""
    try:
        with open("/proc/self/io") as stream:
            for line in stream:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
