"""Named checksum algorithms. A stored checksum reads ``ALGORITHM:HEXDIGEST``.

``xxh3-128`` is the default: it hashes at memory speed (about 18 GB/s on one core here,
against 0.75 GB/s for BLAKE2b), which keeps ``repack verify`` at disk speed. It detects
accidental damage, not tampering; ``sha256`` is there for users who need a cryptographic hash.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import xxhash

__all__ = ["ALGORITHMS", "DEFAULT", "Hasher", "digest_of", "new_hasher", "split_checksum"]

DEFAULT = "xxh3-128"
ALGORITHMS = ("xxh3-128", "sha256")


class Hasher(Protocol):
    """What repack needs of a hash object."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hash object for ``algorithm`` (one of ``ALGORITHMS``)."""
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def digest_of(hasher: Hasher, algorithm: str) -> str:
    """The stored form ``ALGORITHM:HEXDIGEST`` of a finished hash."""
    return f"{algorithm}:{hasher.hexdigest()}"


def split_checksum(checksum: str) -> tuple[str, str]:
    """Split a stored checksum into (algorithm, hex digest); ValueError when malformed."""
    algorithm, sep, digest = checksum.partition(":")
    if not sep or algorithm not in ALGORITHMS or not digest:
        raise ValueError(f"malformed checksum {checksum!r}")
    return algorithm, digest
