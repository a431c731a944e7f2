#!/usr/bin/env python3
"""The choices behind repack's copy and hash paths (repack/fileio.py), measured side by side.

On one file in the page cache (``--size``, default 1 GiB, written once, kept in ``--data``):

* **pread buffers**: ``os.preadv`` of the whole file into a 1 MiB buffer that starts 16
  bytes past a page boundary (where glibc puts a ``bytearray`` it maps fresh, as it does for
  large ones until a large block has been freed), one that is page-aligned, and an
  ``io_buffer`` (64 bytes past a page boundary);
* **hash buffers**: pread + xxh3-128 of the whole file, 1 MiB and 64 MiB per read;
* **write pieces**: copying the file by pread/pwrite (the path taken where
  ``copy_file_range`` is refused) in pieces of 128 KiB and of 1 MiB, no fsync;
* **copy + hash**: ``copy_range`` with xxh3-128 hashers, the read-back hashed in line and
  by a ``HashFeeder`` thread, and ``copy_file_range`` alone (no hash) for reference;
* **durable copy**: ``copy_range`` then ``fsync``, with and without ``start_writeback``
  after each chunk, each run started once the disk is idle (as in ``bench_merge.py``).

Every variant runs ``--repeat`` times, in rotated order; the script prints median seconds,
GiB/s and each median's ratio to the first variant of its group.

Usage::

    python scripts/bench_io.py --data /tmp/repack-bench-io --repeat 7
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import repack.fileio
from repack.checksum import new_hasher
from repack.fileio import BUFFER, HashFeeder, copy_range, io_buffer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_merge import machine_facts, wait_until_idle

MIB = 1024 * 1024
#: The group whose runs write to disk: each starts once the disk is idle (untimed wait).
DURABLE = "copy_range + fsync"


def page_aligned(size: int, offset: int = 0) -> memoryview:
    """``size`` bytes starting ``offset`` bytes past a page boundary."""
    return memoryview(mmap.mmap(-1, size + offset))[offset : offset + size]


def read_all(fd: int, size: int, buffer) -> None:
    view = memoryview(buffer)
    offset = 0
    while offset < size:
        offset += os.preadv(fd, [view[: min(len(view), size - offset)]], offset)


def read_and_hash(fd: int, size: int, buffer: memoryview) -> None:
    hasher = new_hasher("xxh3-128")
    offset = 0
    while offset < size:
        n = os.preadv(fd, [buffer[: min(len(buffer), size - offset)]], offset)
        hasher.update(buffer[:n])
        offset += n


def copy_pieces(src: int, dst: int, size: int, piece: int) -> None:
    buffer = io_buffer(piece)
    offset = 0
    while offset < size:
        n = os.preadv(src, [buffer[: min(piece, size - offset)]], offset)
        written = 0
        while written < n:
            written += os.pwrite(dst, buffer[written:n], offset + written)
        offset += n


def timed(function: Callable[[], object]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("/tmp/repack-bench-io"))
    parser.add_argument("--size", type=int, default=1024, help="MiB (default 1024)")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)

    args.data.mkdir(parents=True, exist_ok=True)
    machine_facts(args.data)  # finds the disk wait_until_idle watches
    source = args.data / "source.bin"
    size = args.size * MIB
    if not source.exists() or source.stat().st_size != size:
        with open(source, "wb") as stream:
            for _ in range(args.size):
                stream.write(os.urandom(MIB))
    target = args.data / "target.bin"
    src = os.open(source, os.O_RDONLY)
    read_all(src, size, io_buffer(BUFFER))  # into the page cache

    def copy(hash_mode: str | None) -> Callable[[], None]:
        def run() -> None:
            dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                hashers = [new_hasher("xxh3-128")] if hash_mode else []
                if hash_mode == "thread":
                    with HashFeeder() as feeder:
                        copy_range(src, dst, 0, 0, size, hashers, feeder=feeder)
                else:
                    copy_range(src, dst, 0, 0, size, hashers)
            finally:
                os.close(dst)

        return run

    def durable_copy(writeback: bool) -> Callable[[], None]:
        def run() -> None:
            original = repack.fileio.start_writeback
            if not writeback:
                repack.fileio.start_writeback = lambda fd, offset, size: None
            dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                copy_range(src, dst, 0, 0, size)
                os.fsync(dst)
            finally:
                os.close(dst)
                repack.fileio.start_writeback = original

        return run

    def pieces(piece: int) -> Callable[[], None]:
        def run() -> None:
            dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                copy_pieces(src, dst, size, piece)
            finally:
                os.close(dst)

        return run

    groups: dict[str, dict[str, Callable[[], object]]] = {
        "pread into a 1 MiB buffer": {
            "page + 16 (a fresh large bytearray)": functools.partial(
                read_all, src, size, page_aligned(BUFFER, 16)
            ),
            "page-aligned": functools.partial(read_all, src, size, page_aligned(BUFFER)),
            "io_buffer (page + 64)": functools.partial(read_all, src, size, io_buffer(BUFFER)),
        },
        "pread + xxh3-128": {
            "reads of 1 MiB": functools.partial(read_and_hash, src, size, io_buffer(BUFFER)),
            "reads of 64 MiB": functools.partial(read_and_hash, src, size, io_buffer(64 * MIB)),
        },
        "pread/pwrite copy (no fsync)": {
            "pieces 128 KiB": pieces(128 * 1024),
            "pieces 1 MiB": pieces(MIB),
        },
        "copy_range (no fsync)": {
            "xxh3 in line": copy("inline"),
            "xxh3 in a HashFeeder": copy("thread"),
            "no hash": copy(None),
        },
        DURABLE: {
            "start_writeback off": durable_copy(False),
            "start_writeback on": durable_copy(True),
        },
    }
    print(f"file: {args.size} MiB in the page cache; medians of {args.repeat} runs\n")
    print("| group | variant | median (s) | GiB/s | vs first |")
    print("| --- | --- | ---: | ---: | ---: |")
    for group, variants in groups.items():
        names = list(variants)
        runs: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.repeat):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                if group == DURABLE:
                    os.sync()
                    wait_until_idle()
                runs[name].append(timed(variants[name]))
        first = statistics.median(runs[names[0]])
        for name in names:
            m = statistics.median(runs[name])
            print(f"| {group} | {name} | {m:.3f} | {size / m / 2**30:.2f} | {m / first:.2f} |")
    os.close(src)
    target.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
