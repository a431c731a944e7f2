"""XXH3-64 (seed 0, the default secret) of many short byte strings at once, with numpy.

The fingerprint of a document is the XXH3-64 of its token bytes (docs/format.md 2.11). For
short documents the cost of hashing them one Python call at a time is the call, not the bytes
(about 0.2 µs each, idle): :func:`xxh3_64_many` computes the hashes of every string of up to
:data:`MAX_LENGTH` bytes of a buffer in a few dozen array operations, bit for bit the values
of ``xxhash.xxh3_64_intdigest`` (``tests/test_fingerprints.py`` checks every length 0 to 256
against it). The algorithm is the reference implementation's ``XXH3_len_0to16_64b``,
``XXH3_len_17to128_64b`` and ``XXH3_len_129to240_64b`` (xxHash 0.8, BSD-2-Clause), with the
128-bit products done on 32-bit halves; longer strings are for xxhash itself.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAX_LENGTH", "xxh3_64_many"]

#: The longest string :func:`xxh3_64_many` hashes (XXH3's "mid-size" bound).
MAX_LENGTH = 240

# the first 136 bytes of XXH3's default secret (XXH3_kSecret): all that strings of up to
# 240 bytes read of it
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3"
)

_U = np.uint64
_PRIME64_1 = _U(0x9E3779B185EBCA87)
_PRIME64_2 = _U(0xC2B2AE3D27D4EB4F)
_PRIME64_3 = _U(0x165667B19E3779F9)
_PRIME_MX1 = _U(0x165667919E3779F9)
_PRIME_MX2 = _U(0x9FB21C651E98DF25)
_LOW32 = _U(0xFFFFFFFF)


def _secret64(offset: int) -> np.uint64:
    return _U(int.from_bytes(_SECRET[offset : offset + 8], "little"))


def _secret32(offset: int) -> int:
    return int.from_bytes(_SECRET[offset : offset + 4], "little")


def _xxh64_avalanche(h: np.ndarray) -> np.ndarray:
    h ^= h >> _U(33)
    h *= _PRIME64_2
    h ^= h >> _U(29)
    h *= _PRIME64_3
    h ^= h >> _U(32)
    return h


def _xxh3_avalanche(h: np.ndarray) -> np.ndarray:
    h ^= h >> _U(37)
    h *= _PRIME_MX1
    h ^= h >> _U(32)
    return h


def _mul128_fold64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The low 64 bits of ``a * b`` (as 128-bit) xor its high 64 bits."""
    a0, a1 = a & _LOW32, a >> _U(32)
    b0, b1 = b & _LOW32, b >> _U(32)
    lo_lo = a0 * b0
    hi_lo = a1 * b0
    lo_hi = a0 * b1
    hi_hi = a1 * b1
    cross = (lo_lo >> _U(32)) + (hi_lo & _LOW32) + lo_hi
    upper = (hi_lo >> _U(32)) + (cross >> _U(32)) + hi_hi
    lower = (cross << _U(32)) | (lo_lo & _LOW32)
    return lower ^ upper


class _Reader:
    """Little-endian words at any byte offset of a buffer (unaligned, strided views)."""

    def __init__(self, data: np.ndarray) -> None:
        self.bytes = data
        size = len(data)
        self.u64 = np.ndarray((size - 7,), "<u8", buffer=data, strides=(1,)) if size >= 8 else None
        self.u32 = np.ndarray((size - 3,), "<u4", buffer=data, strides=(1,)) if size >= 4 else None

    def mix16(self, at: np.ndarray, secret: int) -> np.ndarray:
        lo = self.u64[at] ^ _secret64(secret)
        hi = self.u64[at + 8] ^ _secret64(secret + 8)
        return _mul128_fold64(lo, hi)


def xxh3_64_many(data, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``xxhash.xxh3_64_intdigest(data[s : s + n])`` for each ``s, n`` of ``starts, lengths``
    (every ``n`` at most :data:`MAX_LENGTH`, every string inside ``data``), as uint64."""
    data = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    starts = np.asarray(starts, np.int64)
    lengths = np.asarray(lengths, np.int64)
    out = np.empty(len(starts), np.uint64)
    if not len(starts):
        return out
    shortest, longest = int(lengths.min()), int(lengths.max())
    if longest > MAX_LENGTH:
        raise ValueError(f"a string longer than {MAX_LENGTH} bytes")
    read = _Reader(data)
    size = lengths.astype(np.uint64)
    for lo, hi, kernel in _KERNELS:
        if hi < shortest or lo > longest:
            continue
        if lo <= shortest and longest <= hi:  # all of one length class
            out[:] = kernel(read, starts, lengths, size)
            break
        pick = np.flatnonzero((lengths >= lo) & (lengths <= hi))
        if len(pick):
            out[pick] = kernel(read, starts[pick], lengths[pick], size[pick])
    return out


def _len0(read: _Reader, at, length, size) -> np.ndarray:
    return _xxh64_avalanche(np.full(len(at), _secret64(56) ^ _secret64(64), np.uint64))


def _len1to3(read: _Reader, at, length, size) -> np.ndarray:
    b = read.bytes
    c1 = b[at].astype(np.uint64)
    c2 = b[at + (length >> 1)].astype(np.uint64)
    c3 = b[at + length - 1].astype(np.uint64)
    combined = (c1 << _U(16)) | (c2 << _U(24)) | c3 | (size << _U(8))
    return _xxh64_avalanche(combined ^ _U(_secret32(0) ^ _secret32(4)))


def _len4to8(read: _Reader, at, length, size) -> np.ndarray:
    first = read.u32[at].astype(np.uint64)
    last = read.u32[at + length - 4].astype(np.uint64)
    h = (last + (first << _U(32))) ^ (_secret64(8) ^ _secret64(16))
    # XXH3_rrmxmx
    h ^= ((h << _U(49)) | (h >> _U(15))) ^ ((h << _U(24)) | (h >> _U(40)))
    h *= _PRIME_MX2
    h ^= (h >> _U(35)) + size
    h *= _PRIME_MX2
    h ^= h >> _U(28)
    return h


def _len9to16(read: _Reader, at, length, size) -> np.ndarray:
    lo = read.u64[at] ^ (_secret64(24) ^ _secret64(32))
    hi = read.u64[at + length - 8] ^ (_secret64(40) ^ _secret64(48))
    acc = size + lo.byteswap() + hi + _mul128_fold64(lo, hi)
    return _xxh3_avalanche(acc)


def _len17to128(read: _Reader, at, length, size) -> np.ndarray:
    acc = size * _PRIME64_1
    acc += read.mix16(at, 0)
    acc += read.mix16(at + length - 16, 16)
    for bound, k in ((32, 1), (64, 2), (96, 3)):
        more = np.flatnonzero(length > bound)
        if not len(more):
            break
        a, n = at[more], length[more]
        acc[more] += read.mix16(a + 16 * k, 32 * k) + read.mix16(a + n - 16 * (k + 1), 32 * k + 16)
    return _xxh3_avalanche(acc)


def _len129to240(read: _Reader, at, length, size) -> np.ndarray:
    acc = size * _PRIME64_1
    for i in range(8):
        acc += read.mix16(at + 16 * i, 16 * i)
    acc = _xxh3_avalanche(acc)
    acc += read.mix16(at + length - 16, 136 - 17)
    rounds = length // 16
    for i in range(8, MAX_LENGTH // 16):
        more = np.flatnonzero(rounds > i)
        if not len(more):
            break
        acc[more] += read.mix16(at[more] + 16 * i, 16 * (i - 8) + 3)
    return _xxh3_avalanche(acc)


_KERNELS = (
    (0, 0, _len0),
    (1, 3, _len1to3),
    (4, 8, _len4to8),
    (9, 16, _len9to16),
    (17, 128, _len17to128),
    (129, MAX_LENGTH, _len129to240),
)
