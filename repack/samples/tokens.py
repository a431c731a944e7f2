"""Where :class:`repack.samples.GPTSamples` reads a prefix's sequences: a source of a repack
(a folder, ``s3://``, ``msc://``), or a Megatron ``X.bin``/``X.idx`` pair on a file system.

Each reader answers what ``GPTDataset`` asks of an ``IndexedDataset``: ``sequence_lengths``
and ``get(sequence, offset, length)``. A repack's sources are views of the one repack a
process opens (:class:`repack.read.views.SourceDataset`: no file or map per source); a prefix pair
is read like Megatron's ``IndexedDataset``, its ``.bin`` mapped (or read with ``pread``) when
first read.
"""

from __future__ import annotations

import os

import numpy as np

from repack.errors import InputError
from repack.format import spec as fmt
from repack.inputs.sources import read_source_index
from repack.store import is_url

__all__ = ["PrefixFiles", "open_prefixes", "open_repack_sources"]


class PrefixFiles:
    """One Megatron prefix on a file system, read like ``IndexedDataset``.

    Args:
        prefix: The prefix (``X`` of ``X.bin`` and ``X.idx``), as the blend writes it.
        mmap: Map the ``.bin`` (Megatron's default), else read it with ``pread``.

    Raises:
        SourceError: the ``.idx`` is missing or damaged (one line, naming the file).
    """

    def __init__(self, prefix: str, mmap: bool = True) -> None:
        index = read_source_index(prefix)
        self.prefix = prefix
        self.sequence_lengths = index.lengths
        self._pointers = index.pointers
        self._dtype = np.dtype(fmt.DTYPES[index.info.dtype_code])
        self._mmap = mmap
        self._bin: np.ndarray | int | None = None

    def _open(self) -> np.ndarray | int:
        if self._bin is None:
            path = self.prefix + ".bin"
            if self._mmap:
                self._bin = np.memmap(path, dtype=np.uint8, mode="r")
            else:
                self._bin = os.open(path, os.O_RDONLY)
        return self._bin

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """``length`` tokens (default: to the end) of sequence ``idx`` from token ``offset``."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        start = int(self._pointers[idx]) + offset * self._dtype.itemsize
        size = length * self._dtype.itemsize
        data = self._open()
        if isinstance(data, int):
            raw = os.pread(data, size, start)
            return np.frombuffer(raw, dtype=self._dtype, count=length)
        return data[start : start + size].view(self._dtype)

    def __getstate__(self) -> tuple[str, bool]:
        return (self.prefix, self._mmap)

    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def __del__(self) -> None:
        found = getattr(self, "_bin", None)  # unset where the .idx could not be read
        if isinstance(found, int):
            os.close(found)


def open_prefixes(prefixes: list[str], mmap: bool) -> dict[str, PrefixFiles]:
    """A reader per distinct prefix.

    Raises:
        InputError: a prefix on object storage (a plain blend is read from a file system;
            ``repack merge`` it to read it from object storage).
    """
    readers: dict[str, PrefixFiles] = {}
    for prefix in prefixes:
        if prefix in readers:
            continue
        if is_url(prefix):  # the store's rule for a location that is no path
            raise InputError(
                f"{prefix}: a plain blend's prefixes are read from a file system; "
                "'repack merge' the blend into s3:// or msc:// and read the repack"
            )
        readers[prefix] = PrefixFiles(prefix, mmap)
    return readers


def open_repack_sources(location: str, prefixes: list[str], mmap: bool) -> dict[str, object]:
    """A view per distinct prefix of the repack at ``location``
    (:class:`repack.read.views.SourceDataset`, whose ``sequence_lengths`` and ``get`` are
    ``IndexedDataset``'s).

    Raises:
        UnknownSource: a prefix is not in the repack.
    """
    from repack.read.views import SourceDataset

    views: dict[str, object] = {}
    for prefix in prefixes:
        if prefix not in views:
            views[prefix] = SourceDataset(location, prefix, mmap=mmap)
    return views
