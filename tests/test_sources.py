"""One crafted bad input per error of repack.inputs.sources.read_source_index.

Each test starts from a valid prefix written by repack.synth.write_prefix, breaks one thing,
and asserts the exact error class and that the message names the file, the value found and
the value expected.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from repack.errors import (
    BadMagic,
    CorruptIndex,
    SizeMismatch,
    SourceError,
    SourceMissing,
    TruncatedFile,
    UnknownDType,
    UnsupportedVersion,
)
from repack.format import spec as fmt
from repack.inputs.sources import inspect_source, read_source_index
from repack.merge import merge
from repack.read.verify import verify

HEADER = fmt.MEGATRON_HEADER_SIZE
# three sequences of 2, 3, 1 tokens in two documents: [0, 2, 3]
SEQUENCES = [[1, 2], [3, 4, 5], [6]]
DOCUMENTS = [0, 2, 3]
LENGTHS_AT = HEADER
POINTERS_AT = HEADER + 4 * 3
DOCUMENTS_AT = POINTERS_AT + 8 * 3


@pytest.fixture
def prefix(make_source) -> str:
    return make_source("src/good.part-1", SEQUENCES, documents=DOCUMENTS)


def patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as stream:
        stream.seek(offset)
        stream.write(data)


def expect(error: type[SourceError], prefix: str, *found: str) -> str:
    """read_source_index(prefix) raises exactly ``error`` with every ``found`` in its message."""
    with pytest.raises(SourceError) as caught:
        read_source_index(prefix)
    assert type(caught.value) is error, repr(caught.value)
    message = str(caught.value)
    for text in found:
        assert text in message, message
    return message


def test_valid_prefix_reads(prefix: str) -> None:
    index = read_source_index(prefix)
    info = index.info
    assert (info.sequence_count, info.document_count, info.token_count) == (3, 3, 6)
    assert (info.bin_size, info.idx_size, info.multimodal) == (12, 34 + 36 + 24, False)
    assert index.lengths.tolist() == [2, 3, 1]
    assert index.pointers.tolist() == [0, 4, 10]
    assert index.documents.tolist() == DOCUMENTS
    assert index.modes is None
    assert inspect_source(prefix) == info


def test_multimodal_is_recognized_by_size(make_source) -> None:
    prefix = make_source("mm", SEQUENCES, modes=[1, 0, 1])
    index = read_source_index(prefix)
    assert index.info.multimodal and index.modes.tolist() == [1, 0, 1]


def test_missing_bin(prefix: str) -> None:
    os.unlink(prefix + ".bin")
    expect(SourceMissing, prefix, f"{prefix}.bin", "not found")


def test_missing_idx(prefix: str) -> None:
    os.unlink(prefix + ".idx")
    expect(SourceMissing, prefix, f"{prefix}.idx", "not found")


def test_idx_is_a_directory(prefix: str) -> None:
    os.unlink(prefix + ".idx")
    os.mkdir(prefix + ".idx")
    expect(SourceMissing, prefix, f"{prefix}.idx", "directory")


def test_bad_magic(prefix: str) -> None:
    patch(prefix + ".idx", 0, b"NOTANIDX\x00")
    expect(BadMagic, prefix, f"{prefix}.idx", "b'NOTANIDX\\x00'", repr(fmt.MEGATRON_MAGIC))


def test_bad_magic_in_a_short_file(prefix: str) -> None:
    Path(prefix + ".idx").write_bytes(b"PK\x03\x04")
    expect(BadMagic, prefix, f"{prefix}.idx", "b'PK\\x03\\x04'")


def test_unsupported_version(prefix: str) -> None:
    patch(prefix + ".idx", 9, struct.pack("<Q", 2))
    expect(UnsupportedVersion, prefix, f"{prefix}.idx", "version 2", "version 1")


@pytest.mark.parametrize("code", [0, 9, 255])
def test_unknown_dtype_code(prefix: str, code: int) -> None:
    patch(prefix + ".idx", 17, bytes([code]))
    message = expect(UnknownDType, prefix, f"{prefix}.idx", f"dtype code {code}")
    assert str(sorted(fmt.DTYPES)) in message


def test_truncated_header(prefix: str) -> None:
    data = Path(prefix + ".idx").read_bytes()
    Path(prefix + ".idx").write_bytes(data[:20])
    expect(TruncatedFile, prefix, f"{prefix}.idx", "20 bytes", f"{HEADER}-byte header")


def test_truncated_arrays(prefix: str) -> None:
    data = Path(prefix + ".idx").read_bytes()
    Path(prefix + ".idx").write_bytes(data[:-1])
    expect(
        TruncatedFile,
        prefix,
        f"{prefix}.idx",
        "3 sequences and 3 document indices",
        f"need {len(data)} bytes",
        f"the file has {len(data) - 1}",
    )


def test_trailing_bytes(prefix: str) -> None:
    data = Path(prefix + ".idx").read_bytes()
    Path(prefix + ".idx").write_bytes(data + b"\x00")
    expect(
        CorruptIndex,
        prefix,
        f"{prefix}.idx",
        f"{len(data) + 1} bytes",
        f"expected {len(data)} (plain) or {len(data) + 3} (multimodal)",
    )


def test_huge_counts_are_refused_before_allocating(prefix: str) -> None:
    patch(prefix + ".idx", 18, struct.pack("<Q", 2**40))
    expect(TruncatedFile, prefix, f"{prefix}.idx", f"{2**40} sequences")


@pytest.mark.parametrize("delta", [-1, 1, 2])
def test_bin_size_differs_from_lengths(prefix: str, delta: int) -> None:
    data = Path(prefix + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(data[:delta] if delta < 0 else data + b"\x00" * delta)
    expect(
        SizeMismatch,
        prefix,
        f"{prefix}.bin",
        f"{12 + delta} bytes",
        "expected 12",
        "6 tokens x 2 bytes of uint16",
    )


def test_negative_length(prefix: str) -> None:
    patch(prefix + ".idx", LENGTHS_AT + 4, struct.pack("<i", -3))
    expect(CorruptIndex, prefix, f"{prefix}.idx", "sequence 1", "negative length -3")


def test_pointer_inconsistent_with_lengths(prefix: str) -> None:
    patch(prefix + ".idx", POINTERS_AT + 8 * 2, struct.pack("<q", 8))
    expect(CorruptIndex, prefix, f"{prefix}.idx", "pointer of sequence 2 is 8", "expected 10")


def test_first_pointer_not_zero(prefix: str) -> None:
    patch(prefix + ".idx", POINTERS_AT, struct.pack("<q", 2))
    expect(CorruptIndex, prefix, f"{prefix}.idx", "pointer of sequence 0 is 2", "expected 0")


def test_documents_not_starting_at_zero(prefix: str) -> None:
    patch(prefix + ".idx", DOCUMENTS_AT, struct.pack("<q", 1))
    expect(CorruptIndex, prefix, f"{prefix}.idx", "start at 1", "expected 0")


def test_documents_decreasing(prefix: str) -> None:
    patch(prefix + ".idx", DOCUMENTS_AT + 8, struct.pack("<q", 4))
    expect(
        CorruptIndex,
        prefix,
        f"{prefix}.idx",
        "document index 2 is 3",
        "smaller than the previous 4",
    )


def test_documents_not_ending_at_sequence_count(prefix: str) -> None:
    patch(prefix + ".idx", DOCUMENTS_AT + 16, struct.pack("<q", 2))
    expect(CorruptIndex, prefix, f"{prefix}.idx", "end at 2", "sequence count 3")


def test_no_document_indices(make_source) -> None:
    prefix = make_source("empty", [])
    data = bytearray(Path(prefix + ".idx").read_bytes())
    data[26:34] = struct.pack("<Q", 0)  # document count 0
    Path(prefix + ".idx").write_bytes(bytes(data[:HEADER]))
    expect(CorruptIndex, prefix, f"{prefix}.idx", "no document indices", "at least [0]")


def test_dots_in_prefix_are_not_suffixes(prefix: str) -> None:
    # "good.part-1" must be read as good.part-1.idx, never good.idx
    assert read_source_index(prefix).info.path == prefix
    assert not os.path.exists(prefix.rsplit(".", 1)[0] + ".idx")


# --- a bad source anywhere in the blend: nothing is written ---------------------------------


def bad_blend(make_source, write_blend, tmp_path: Path) -> tuple[Path, str]:
    good = [make_source(f"ok/{i}", [[i, i + 1]] * 3) for i in range(5)]
    bad = make_source("bad", SEQUENCES, documents=DOCUMENTS)
    patch(bad + ".idx", DOCUMENTS_AT, struct.pack("<q", 1))
    return write_blend([*good[:3], bad, *good[3:]]), bad


def test_merge_with_a_bad_source_creates_nothing(make_source, write_blend, tmp_path: Path):
    blend, bad = bad_blend(make_source, write_blend, tmp_path)
    out = tmp_path / "out"
    with pytest.raises(CorruptIndex, match=re.escape(f"{bad}.idx")):
        merge(blend, out)
    assert not out.exists()


def test_forced_merge_with_a_bad_source_keeps_the_old_repack(
    make_source, write_blend, tmp_path: Path
) -> None:
    good = write_blend([make_source("old", [[1, 2, 3]])], name="old.json")
    out = tmp_path / "out"
    merge(good, out)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    blend, _ = bad_blend(make_source, write_blend, tmp_path)
    with pytest.raises(CorruptIndex):
        merge(blend, out, overwrite=True)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert verify(out).ok


def test_source_changed_between_validation_and_copy(
    make_source, write_blend, tmp_path: Path
) -> None:
    """A source that changes after validation aborts the merge before the manifest."""
    from repack.merge import execute, prepare

    prefix = make_source("moving", [np.arange(10)])
    prepared = prepare(write_blend([prefix]))
    with open(prefix + ".bin", "ab") as stream:
        stream.write(b"\x00\x00")
    out = tmp_path / "out"
    with pytest.raises(SourceError, match=re.escape(f"{prefix}.bin: changed during the merge")):
        execute(prepared, out)
    assert not (out / fmt.MANIFEST_FILE).exists()
    assert not [name for name in os.listdir(out) if ".tmp" in name]
