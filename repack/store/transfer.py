"""Whole local files to and from a store, streamed (bounded memory): what a writer to object
storage builds in a temp folder (the index, the fingerprint file) goes up with
:func:`upload`; what it needs as a local file (fingerprint parts saved by the tasks) comes
down with :func:`download`."""

from __future__ import annotations

import os

from repack.fileio import BUFFER, io_buffer, read_range
from repack.store.ahead import ordered
from repack.store.base import Stat, Store

__all__ = ["download", "upload"]

#: Bytes per ranged GET of a download.
PIECE = 8 * 1024 * 1024


def upload(store: Store, name: str, path: str) -> Stat:
    """Send the local file ``path`` as the object ``name``, in a streaming write."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with store.writer(name, size_hint=size) as writer:
            buffer = io_buffer(min(BUFFER, max(1, size)))
            done = 0
            while done < size:
                n = min(len(buffer), size - done)
                writer.write(read_range(fd, done, n, buffer))
                done += n
            return writer.commit()
    finally:
        os.close(fd)


def download(store: Store, name: str, path: str, size: int, etag: str | None = None) -> None:
    """Write the object ``name`` (``size`` bytes; pinned to ``etag`` if given) to the local
    file ``path``, in ranged GETs fetched ahead."""
    jobs = (
        (min(PIECE, size - start), lambda s=start: store.read(name, s, min(PIECE, size - s), etag))
        for start in range(0, size, PIECE)
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset = 0
        for data in ordered(jobs, requests=8):
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view, offset = view[n:], offset + n
    finally:
        os.close(fd)
