"""Bad inputs, end to end through the real command line: the error contract, case by case.

The contract, for every case of the tables below: exactly one line on stderr, ``Error: ...``,
that names the file at fault and the cause (the value found and the one expected, where there
is one); the documented exit status (2 usage, 3 bad input or refused, 1 damage); nothing on
stdout; no traceback; and the output folder left without a manifest and without temp files.

test_sources.py, test_blend.py and test_cli.py check most of these errors at the library
level, one by one; this module runs every one of them through the command line. Cases that
need another process (dropped privileges, a file size limit, a full file system) run the
console entry point in a subprocess.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from figures import record_figures

from repack.cli import main
from repack.errors import FormatError as FormatError_
from repack.errors import RepackError
from repack.format import spec as fmt
from repack.inputs.blend_files import MAX_BLEND_BYTES
from repack.merge import merge
from repack.read.views import SourceDataset
from repack.synth import write_prefix

USAGE, INPUT, DAMAGED = 2, 3, 1
HEADER = fmt.MEGATRON_HEADER_SIZE


# --- a small valid blend that each case breaks in one way ------------------------------------


@dataclass
class World:
    """A valid blend of three sources under ``root``; ``out`` does not exist yet."""

    root: Path
    blend: Path
    a: str  # uint16, 3 sequences [2, 3, 1 tokens], documents [0, 2, 3]
    b: str  # int32, 2 sequences
    c: str  # uint16, multimodal, 2 sequences in 1 document
    out: Path

    def write_blend(self, text: str, name: str = "blend.json") -> Path:
        path = self.root / name
        path.write_text(text)
        return path


def make_world(root: Path) -> World:
    write_prefix(root / "data/a", [[1, 2], [3, 4, 5], [6]], document_indices=[0, 2, 3])
    write_prefix(root / "data/b", [[70000, 1], [2, 3, 4]], dtype=np.int32)
    write_prefix(root / "data/mm/c", [[9, 9], [8]], document_indices=[0, 2], modes=[1, 0])
    blend = root / "blend.json"
    blend.write_text('[0.5, "data/a", 0.3, "data/b", 0.2, "data/mm/c"]')
    return World(
        root,
        blend,
        str(root / "data/a"),
        str(root / "data/b"),
        str(root / "data/mm/c"),
        root / "out",
    )


@pytest.fixture
def world(tmp_path: Path) -> World:
    return make_world(tmp_path)


def patch(path: str | Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as stream:
        stream.seek(offset)
        stream.write(data)


def at_pointers(n_seq: int) -> int:
    return HEADER + 4 * n_seq


def at_documents(n_seq: int) -> int:
    return HEADER + 12 * n_seq


# --- the contract ----------------------------------------------------------------------------


def leftovers(out: Path) -> list[str]:
    """Files under ``out`` that must not be there after a failed command: a manifest (which
    would make the folder look complete) and temp files."""
    found = []
    for folder, _, files in os.walk(out):
        for name in files:
            if name == fmt.MANIFEST_FILE or ".tmp" in name:
                found.append(os.path.relpath(os.path.join(folder, name), out))
    return found


def check_contract(
    code: int, stdout: str, stderr: str, expected: int, needles: tuple[str, ...], out: Path | None
) -> str:
    """Assert the error contract; return the error line."""
    assert "Traceback" not in stdout + stderr, stderr
    assert code == expected, f"exit status {code}, expected {expected}: {stderr}"
    assert stdout == ""
    lines = stderr.splitlines()
    errors = [line for line in lines if line.startswith("Error: ")]
    assert len(errors) == 1, stderr
    line = errors[0]
    if expected == USAGE:
        # click shows the usage before the error; the error line is the last one
        assert lines[-1] == line, stderr
    else:
        assert lines == [line], stderr
    assert len(line) < 600, line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    if out is not None:
        assert leftovers(out) == []
    return line


def run_cli(args: list[str], env: dict[str, str] | None = None):
    result = CliRunner().invoke(main, args, env=env)
    if result.exception is not None:  # a crash, not a deliberate exit
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.stdout, result.stderr


# --- merge: one case per bad input -----------------------------------------------------------

Case = Callable[[World], tuple[list[str], int, tuple[str, ...]]]
MERGE_CASES: dict[str, Case] = {}


def case(name: str) -> Callable[[Case], Case]:
    def register(function: Case) -> Case:
        assert name not in MERGE_CASES
        MERGE_CASES[name] = function
        return function

    return register


def merge_args(w: World, blend: Path | None = None) -> list[str]:
    return ["merge", "-q", str(blend or w.blend), str(w.out)]


# sources: files missing or unreadable


@case("missing .bin")
def _(w: World):
    os.unlink(w.b + ".bin")
    return merge_args(w), INPUT, (f"{w.b}.bin", "not found")


@case("missing .idx")
def _(w: World):
    os.unlink(w.a + ".idx")
    return merge_args(w), INPUT, (f"{w.a}.idx", "not found")


@case(".idx is a directory")
def _(w: World):
    os.unlink(w.a + ".idx")
    os.mkdir(w.a + ".idx")
    return merge_args(w), INPUT, (f"{w.a}.idx", "is a directory", "expected the .idx file")


@case(".bin is a directory")
def _(w: World):
    os.unlink(w.c + ".bin")
    os.mkdir(w.c + ".bin")
    return merge_args(w), INPUT, (f"{w.c}.bin", "is a directory", "expected the .bin file")


@case(".idx is a FIFO")
def _(w: World):
    os.unlink(w.a + ".idx")
    os.mkfifo(w.a + ".idx")  # opening it for reading would wait for a writer forever
    return merge_args(w), INPUT, (f"{w.a}.idx", "not a regular file")


@case(".bin is a dangling symlink")
def _(w: World):
    os.unlink(w.b + ".bin")
    os.symlink(w.root / "nowhere.bin", w.b + ".bin")
    return merge_args(w), INPUT, (f"{w.b}.bin", "not found")


# sources: the .idx header


@case("bad magic")
def _(w: World):
    patch(w.a + ".idx", 0, b"MMIDIDY")
    return merge_args(w), INPUT, (f"{w.a}.idx", "bad magic b'MMIDIDY", repr(fmt.MEGATRON_MAGIC))


@case("not an index at all (short file)")
def _(w: World):
    Path(w.a + ".idx").write_bytes(b"PK\x03\x04")
    return merge_args(w), INPUT, (f"{w.a}.idx", "bad magic b'PK\\x03\\x04'")


@case("version 2")
def _(w: World):
    patch(w.a + ".idx", 9, struct.pack("<Q", 2))
    return merge_args(w), INPUT, (f"{w.a}.idx", "MMIDIDX version 2", "only version 1")


@case("version 2**64-1")
def _(w: World):
    patch(w.b + ".idx", 9, b"\xff" * 8)
    return merge_args(w), INPUT, (f"{w.b}.idx", f"version {2**64 - 1}", "only version 1")


@case("unknown dtype code 0")
def _(w: World):
    patch(w.a + ".idx", 17, b"\x00")
    return merge_args(w), INPUT, (f"{w.a}.idx", "unknown dtype code 0", "[1, 2, 3, 4, 5, 6, 7, 8]")


@case("unknown dtype code 9")
def _(w: World):
    patch(w.c + ".idx", 17, b"\x09")
    return merge_args(w), INPUT, (f"{w.c}.idx", "unknown dtype code 9")


@case("header shorter than 34 bytes")
def _(w: World):
    data = Path(w.a + ".idx").read_bytes()
    Path(w.a + ".idx").write_bytes(data[:20])
    return merge_args(w), INPUT, (f"{w.a}.idx", "20 bytes", "34-byte header")


@case(".idx truncated: counts larger than the file")
def _(w: World):
    patch(w.a + ".idx", 18, struct.pack("<Q", 8))  # 8 sequences claimed, 3 stored
    size = os.path.getsize(w.a + ".idx")
    need = fmt.megatron_idx_size(8, 3, multimodal=False)
    return (
        merge_args(w),
        INPUT,
        (
            f"{w.a}.idx",
            "8 sequences and 3 document indices",
            f"need {need} bytes",
            f"the file has {size}",
        ),
    )


@case(".idx cut short")
def _(w: World):
    data = Path(w.b + ".idx").read_bytes()
    Path(w.b + ".idx").write_bytes(data[:-5])
    return merge_args(w), INPUT, (f"{w.b}.idx", f"need {len(data)} bytes", f"has {len(data) - 5}")


@case(".idx header claims 2**60 sequences")
def _(w: World):
    patch(w.a + ".idx", 18, struct.pack("<Q", 2**60))
    return merge_args(w), INPUT, (f"{w.a}.idx", f"{2**60} sequences", "the file has")


@case(".idx header claims 2**64-1 document indices")
def _(w: World):
    patch(w.a + ".idx", 26, b"\xff" * 8)
    return merge_args(w), INPUT, (f"{w.a}.idx", f"{2**64 - 1} document indices")


@case(".idx with trailing bytes")
def _(w: World):
    size = os.path.getsize(w.a + ".idx")
    with open(w.a + ".idx", "ab") as stream:
        stream.write(b"\x00" * 7)
    return (
        merge_args(w),
        INPUT,
        (
            f"{w.a}.idx",
            f"{size + 7} bytes",
            f"expected {size} (plain) or {size + 3} (multimodal)",
        ),
    )


# sources: .bin size and index arrays


@case(".bin one byte short")
def _(w: World):
    data = Path(w.a + ".bin").read_bytes()
    Path(w.a + ".bin").write_bytes(data[:-1])
    return (
        merge_args(w),
        INPUT,
        (
            f"{w.a}.bin",
            "11 bytes",
            "expected 12",
            "6 tokens x 2 bytes of uint16",
        ),
    )


@case(".bin with an extra token")
def _(w: World):
    with open(w.b + ".bin", "ab") as stream:
        stream.write(b"\x00" * 4)
    return merge_args(w), INPUT, (f"{w.b}.bin", "24 bytes", "expected 20", "5 tokens x 4 bytes")


@case("empty .bin for a non-empty index")
def _(w: World):
    Path(w.c + ".bin").write_bytes(b"")
    return merge_args(w), INPUT, (f"{w.c}.bin", "0 bytes", "expected 6")


@case("negative sequence length")
def _(w: World):
    patch(w.a + ".idx", HEADER + 4, struct.pack("<i", -1))
    return merge_args(w), INPUT, (f"{w.a}.idx", "sequence 1 has negative length -1")


@case("pointer inconsistent with lengths")
def _(w: World):
    patch(w.a + ".idx", at_pointers(3) + 16, struct.pack("<q", 6))
    return merge_args(w), INPUT, (f"{w.a}.idx", "pointer of sequence 2 is 6", "expected 10")


@case("pointers of an int32 source counted in tokens, not bytes")
def _(w: World):
    patch(w.b + ".idx", at_pointers(2) + 8, struct.pack("<q", 2))
    return merge_args(w), INPUT, (f"{w.b}.idx", "pointer of sequence 1 is 2", "expected 8")


@case("document indices not starting at 0")
def _(w: World):
    patch(w.a + ".idx", at_documents(3), struct.pack("<q", 1))
    return merge_args(w), INPUT, (f"{w.a}.idx", "document indices start at 1", "expected 0")


@case("document indices decreasing")
def _(w: World):
    patch(w.a + ".idx", at_documents(3) + 8, struct.pack("<q", 4))
    return (
        merge_args(w),
        INPUT,
        (
            f"{w.a}.idx",
            "document index 2 is 3",
            "smaller than the previous 4",
        ),
    )


@case("document indices not ending at the sequence count")
def _(w: World):
    patch(w.a + ".idx", at_documents(3) + 16, struct.pack("<q", 2))
    return merge_args(w), INPUT, (f"{w.a}.idx", "end at 2", "expected the sequence count 3")


@case("document indices ending past the sequence count")
def _(w: World):
    patch(w.c + ".idx", at_documents(2) + 8, struct.pack("<q", 5))
    return merge_args(w), INPUT, (f"{w.c}.idx", "end at 5", "sequence count 2")


# the blend file


for _label, _weight, _shown in [
    ("weight 0", "0", "weight 1 is 0"),
    ("weight negative", "-0.5", "weight 1 is -0.5"),
    ("weight NaN", "NaN", "weight 1 is NaN"),
    ("weight infinite", "1e999", "weight 1 is Infinity"),
    ("weight a non-numeric string", '"heavy"', 'item 1 is "heavy" where a weight is expected'),
    ("weight a bool", "true", "weight 1 is true; weights must be finite numbers > 0 (a bool"),
    ("weight null", "null", "weight 1 is null"),
]:

    def _weight_case(w: World, weight: str = _weight, shown: str = _shown):
        blend = w.write_blend(f'[{weight}, "data/a", 0.5, "data/b"]')
        return merge_args(w, blend), INPUT, (str(blend), shown)

    case(_label)(_weight_case)


@case("weight not finite in the text form")
def _(w: World):
    blend = w.write_blend("0.5 data/a\ninf data/b\n", name="data_args.txt")
    return merge_args(w, blend), INPUT, (str(blend), "weight 2 (line 2) is inf")


@case("odd list: neither all prefixes nor weight/prefix pairs")
def _(w: World):
    blend = w.write_blend('[0.5, "data/a", "data/b"]')
    return (
        merge_args(w, blend),
        INPUT,
        (
            str(blend),
            'list has 3 items, an odd number, and item 3 is "data/b", a prefix with no weight',
        ),
    )


@case("even list mixing weights and bare prefixes")
def _(w: World):
    blend = w.write_blend('["0.5", "data/a", "data/b", "data/mm/c"]')
    return merge_args(w, blend), INPUT, (str(blend), 'item 3 is "data/b" where a weight is')


@case("empty blend: empty list")
def _(w: World):
    blend = w.write_blend("[]")
    return merge_args(w, blend), INPUT, (str(blend), "blend is empty")


@case("empty blend: every split null")
def _(w: World):
    blend = w.write_blend('{"train": null, "valid": null}')
    return merge_args(w, blend), INPUT, (str(blend), "blend is empty: every split is null")


@case("empty blend: blank text file")
def _(w: World):
    blend = w.write_blend("\n  \n", name="data_args.txt")
    return merge_args(w, blend), INPUT, (str(blend), "blend is empty: the file holds no prefix")


@case("malformed JSON")
def _(w: World):
    blend = w.write_blend('[0.5, "data/a",\n 0.5 "data/b"]')
    return merge_args(w, blend), INPUT, (str(blend), "malformed JSON at line 2, column 6")


@case("JSON nested too deeply")
def _(w: World):
    blend = w.write_blend("[" * 100_000)
    return merge_args(w, blend), INPUT, (str(blend), "nested too deeply")


@case("duplicate JSON key")
def _(w: World):
    blend = w.write_blend('{"train": ["data/a"], "train": ["data/b"]}')
    return merge_args(w, blend), INPUT, (str(blend), 'key "train" twice')


@case("blend file missing")
def _(w: World):
    return (
        merge_args(w, w.root / "nope.json"),
        INPUT,
        (
            str(w.root / "nope.json"),
            "cannot read blend file: No such file",
        ),
    )


@case("blend file is a directory")
def _(w: World):
    (w.root / "blend.d").mkdir()
    return (
        merge_args(w, w.root / "blend.d"),
        INPUT,
        (
            str(w.root / "blend.d"),
            "it is a directory",
        ),
    )


@case("blend file is a FIFO")
def _(w: World):
    os.mkfifo(w.root / "blend.fifo")
    return merge_args(w, w.root / "blend.fifo"), INPUT, ("blend.fifo", "not a regular file")


@case("blend file not UTF-8")
def _(w: World):
    blend = w.root / "latin1.txt"
    blend.write_bytes(b"1 caf\xe9")
    return merge_args(w, blend), INPUT, (str(blend), "not UTF-8 text: byte 5 is 0xe9")


@case("blend file larger than 64 MiB")
def _(w: World):
    blend = w.root / "huge.json"
    with open(blend, "wb") as stream:
        stream.truncate(MAX_BLEND_BYTES + 1)  # sparse: no disk, no time
    return merge_args(w, blend), INPUT, (str(blend), f"{MAX_BLEND_BYTES + 1} bytes, larger than")


@case("prefix of the blend that exists nowhere")
def _(w: World):
    blend = w.write_blend('[1, "data/a", 1, "data/zzz"]')
    return merge_args(w, blend), INPUT, (str(w.root / "data/zzz.idx"), "not found")


# the output folder


@case("OUT not empty")
def _(w: World):
    w.out.mkdir()
    (w.out / "precious.txt").write_text("keep")
    # no "--force" hint: --force would refuse a file repack did not write
    hint = "folder is not empty: it holds 1 file repack did not write (precious.txt); choose an"
    return merge_args(w), INPUT, (str(w.out), hint)


@case("OUT not empty, --force, foreign files")
def _(w: World):
    w.out.mkdir()
    (w.out / "precious.txt").write_text("keep")
    args = ["merge", "-q", "--force", str(w.blend), str(w.out)]
    return args, INPUT, (str(w.out), "holds 1 file repack did not write (precious.txt); --force")


@case("OUT is a file")
def _(w: World):
    w.out.write_text("a file")
    return merge_args(w), INPUT, (str(w.out), "exists and is not a folder")


@case("OUT is a source folder")
def _(w: World):
    w.out = w.root / "data"
    return (
        merge_args(w),
        INPUT,
        (
            str(w.out),
            f"the output folder is {w.root / 'data'}",
            "holds sources of the blend",
        ),
    )


@case("OUT contains a source folder")
def _(w: World):
    w.out = w.root
    return (
        merge_args(w),
        INPUT,
        (
            str(w.out),
            "the output folder contains",
            "holds sources of the blend",
        ),
    )


@case("OUT reaches a source folder through a symlink")
def _(w: World):
    os.symlink(w.root / "data" / "mm", w.root / "link")
    w.out = w.root / "link"
    return merge_args(w), INPUT, (str(w.out), "the output folder is", "data/mm")


@case("OUT below a file")
def _(w: World):
    (w.root / "plain").write_text("x")
    w.out = w.root / "plain" / "out"
    return merge_args(w), INPUT, (str(w.root / "plain"), "Not a directory")


# usage errors


@case("usage: --shard-size not a size")
def _(w: World):
    args = ["merge", "--shard-size", "12 parsecs", str(w.blend), str(w.out)]
    return args, USAGE, ("Invalid value for '--shard-size'", "12 parsecs")


@case("usage: --shard-size below 4096")
def _(w: World):
    args = ["merge", "--shard-size", "4095", str(w.blend), str(w.out)]
    return args, USAGE, ("'4095' is 4095 bytes", "at least 4096")


@case("usage: unknown checksum")
def _(w: World):
    args = ["merge", "--checksum", "md5", str(w.blend), str(w.out)]
    return args, USAGE, ("Invalid value for '--checksum'", "'md5'")


@case("usage: unknown option")
def _(w: World):
    return ["merge", "--fast", str(w.blend), str(w.out)], USAGE, ("No such option '--fast'",)


@case("usage: no argument")
def _(w: World):
    return ["merge"], USAGE, ("Missing argument",)


@case("usage: OUT alone without a task")
def _(w: World):
    return ["merge", str(w.out)], USAGE, ("OUT alone needs --task I --tasks N",)


@case("usage: three paths")
def _(w: World):
    args = ["merge", str(w.blend), str(w.out), str(w.out)]
    return args, USAGE, ("expected BLEND OUT",)


# reading commands on something that is no (intact) repack


def _merged(w: World) -> Path:
    merge(w.blend, w.out)
    return w.out


@case("inspect: folder without a manifest")
def _(w: World):
    w.out.mkdir()
    return ["inspect", str(w.out)], INPUT, (str(w.out / "manifest.json"), "not found")


@case("inspect: manifest.json is a directory")
def _(w: World):
    (w.out / "manifest.json").mkdir(parents=True)
    return ["inspect", str(w.out)], INPUT, (str(w.out / "manifest.json"), "not a regular file")


@case("inspect: manifest.json larger than 256 MiB")
def _(w: World):
    out = _merged(w)
    os.truncate(out / "manifest.json", fmt.MAX_MANIFEST_SIZE + 1)  # sparse
    return (
        ["inspect", str(out)],
        INPUT,
        (
            str(out / "manifest.json"),
            f"{fmt.MAX_MANIFEST_SIZE + 1} bytes, larger than",
        ),
    )


@case("inspect: damaged manifest")
def _(w: World):
    out = _merged(w)
    data = bytearray((out / "manifest.json").read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / "manifest.json").write_bytes(bytes(data))
    return ["inspect", str(out)], DAMAGED, (str(out / "manifest.json"), "stored checksum")


@case("inspect: index.rpx truncated")
def _(w: World):
    out = _merged(w)
    size = os.path.getsize(out / "index.rpx")
    os.truncate(out / "index.rpx", size - 8)
    return (
        ["inspect", str(out)],
        INPUT,
        (
            str(out / "index.rpx"),
            f"{size - 8} bytes, the manifest says {size}",
        ),
    )


@case("inspect: shard is a symlink out of the folder")
def _(w: World):
    out = _merged(w)
    shutil.move(out / "shard-00000.bin", w.root / "elsewhere.bin")
    os.symlink(w.root / "elsewhere.bin", out / "shard-00000.bin")
    return (
        ["inspect", str(out)],
        INPUT,
        (
            str(out / "shard-00000.bin"),
            "symbolic link to",
            "outside the repack folder",
        ),
    )


@case("verify: no such folder")
def _(w: World):
    return ["verify", str(w.out)], INPUT, (str(w.out), "no such folder")


@case("extract: unknown source")
def _(w: World):
    out = _merged(w)
    args = ["extract", "-q", str(out), "data/zzz", str(w.root / "restored")]
    return args, INPUT, (str(out), "no source 'data/zzz'")


@case("extract: destination exists")
def _(w: World):
    out = _merged(w)
    (w.root / "restored.bin").write_text("mine")
    args = ["extract", "-q", str(out), "data/a", str(w.root / "restored")]
    return args, INPUT, (str(w.root / "restored.bin"), "exists", "--force")


@case("finalize: damaged work file index.json")
def _(w: World):
    assert run_cli(["merge", "-q", "--plan-only", str(w.blend), str(w.out)])[0] == 0
    assert run_cli(["merge", "-q", str(w.out), "--task", "0", "--tasks", "1"])[0] == 0
    (w.out / ".work" / "index.json").write_text('{"file": ')
    return ["merge", "-q", str(w.out), "--finalize"], INPUT, ("index.json",)


@case("finalize: plan nested too deeply")
def _(w: World):
    assert run_cli(["merge", "-q", "--plan-only", str(w.blend), str(w.out)])[0] == 0
    (w.out / ".work" / "plan.json").write_text("[" * 100_000)
    return ["merge", "-q", str(w.out), "--finalize"], INPUT, ("plan.json",)


#: Cases that do not hold the contract yet, and the change each needs.
KNOWN_GAPS: dict[str, str] = {}  # case name -> reason, for a gap not yet closed


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[name]))
        if name in KNOWN_GAPS
        else name
        for name in MERGE_CASES
    ],
)
def test_bad_input_gives_one_error_line(name: str, tmp_path: Path) -> None:
    w = make_world(tmp_path)
    args, expected, needles = MERGE_CASES[name](w)
    before = sorted(os.listdir(w.out)) if w.out.is_dir() else None
    manifest_before = (w.out / fmt.MANIFEST_FILE).exists()
    code, stdout, stderr = run_cli(args)
    writes = args[0] == "merge"
    out = w.out if writes and not manifest_before else None
    check_contract(code, stdout, stderr, expected, needles, out)
    if writes and "--finalize" not in args:  # a refused merge leaves OUT as it was, or absent
        assert (sorted(os.listdir(w.out)) if w.out.is_dir() else None) == before


def test_slurm_variables_that_are_not_numbers_are_a_usage_error(world: World) -> None:
    code, stdout, stderr = run_cli(
        ["merge", str(world.out)], env={"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MAX": "x"}
    )
    check_contract(code, stdout, stderr, USAGE, ("$SLURM_ARRAY_TASK_MAX is 'x'",), None)


def test_table_size() -> None:
    """The figures docs/reliability.md quotes: how many bad inputs go through the CLI."""
    groups = {"usage": 0, "inspect": 0, "verify": 0, "extract": 0, "finalize": 0}
    for name in MERGE_CASES:
        head = name.split(":")[0]
        if head in groups:
            groups[head] += 1
    merge_cases = len(MERGE_CASES) - sum(groups.values())
    assert merge_cases >= 50
    record_figures(
        "bad_inputs_cli",
        {
            "merge_cases_in_process": merge_cases,
            "merge_cases_in_a_subprocess": len(SUBPROCESS_CASES) + 3 + 1,  # + disk full, ENOSPC
            "usage_cases": groups["usage"],
            "reading_command_cases": groups["inspect"] + groups["verify"] + groups["extract"],
        },
    )


# --- cases that need another process ---------------------------------------------------------


def run_console(
    args: list[str], *, preexec: Callable[[], None] | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "repack", *args],
        capture_output=True,
        text=True,
        preexec_fn=preexec,
        cwd=cwd,
        timeout=120,
    )


_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH, _PR_CAPBSET_DROP = 1, 2, 24


def drop_file_capabilities() -> None:
    """Run the child as root without the capabilities that let root ignore file modes, so that
    a mode of 000 refuses it as it refuses everyone else (dropped from the bounding set before
    exec, they are gone from the new program)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.fixture(scope="module")
def unprivileged(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], None] | None:
    """How to run a child that file modes apply to: as ourselves when not root, as root
    without its file capabilities otherwise. Skips where that cannot be arranged."""
    if os.geteuid() != 0:
        return None
    secret = tmp_path_factory.mktemp("probe") / "probe"
    secret.write_text("x")
    secret.chmod(0)
    try:
        probe = subprocess.run(
            [sys.executable, "-c", f"open({str(secret)!r}).read()"],
            preexec_fn=drop_file_capabilities,
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"cannot drop root's file capabilities: {err}")
    finally:
        secret.unlink()
    if "PermissionError" not in probe.stderr:
        pytest.skip(f"root still reads a file of mode 000 here: {probe.stderr[-200:]!r}")
    return drop_file_capabilities


SUBPROCESS_CASES = {
    "unreadable blend file": "blend",
    "unreadable .idx": "idx",
    "unreadable .bin": "bin",
    "OUT in a folder we may not write": "out",
}


@pytest.mark.parametrize("what", list(SUBPROCESS_CASES.values()), ids=list(SUBPROCESS_CASES))
def test_permission_denied(tmp_path: Path, what: str, unprivileged) -> None:
    preexec = unprivileged
    w = make_world(tmp_path)
    out = w.out
    if what == "blend":
        w.blend.chmod(0)
        culprit = str(w.blend)
    elif what == "idx":
        os.chmod(w.b + ".idx", 0)
        culprit = w.b + ".idx"
    elif what == "bin":
        os.chmod(w.c + ".bin", 0)
        culprit = w.c + ".bin"
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        out = locked / "out"
        culprit = str(out)
    result = run_console(["merge", "-q", str(w.blend), str(out)], preexec=preexec)
    check_contract(
        result.returncode,
        result.stdout,
        result.stderr,
        INPUT,
        (culprit, "Permission denied"),
        out,
    )


def limit_file_size(limit: int) -> Callable[[], None]:
    def preexec() -> None:
        # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


@pytest.fixture(scope="module")
def disk_blend(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """A blend of 12 sources and the sizes of what its merge writes into 8 KiB shards."""
    from repack.synth import make_blend

    root = tmp_path_factory.mktemp("disk-full")
    blend = make_blend(root / "src", 12, seed=4, tokens_per_source=(300, 1500))
    reference = root / "reference"
    merge(blend.flat_json, reference, shard_size=8192)
    sizes = {
        "shard": max(os.path.getsize(p) for p in reference.glob("shard-*.bin")),
        "index": os.path.getsize(reference / fmt.INDEX_FILE),
        "manifest": os.path.getsize(reference / fmt.MANIFEST_FILE),
    }
    return blend.flat_json, sizes


@pytest.mark.parametrize("fails_on", ["index", "shard", "manifest"])
def test_disk_full_leaves_no_manifest_and_no_temp_file(
    disk_blend: tuple[Path, dict[str, int]], tmp_path: Path, fails_on: str
) -> None:
    """A file size limit (RLIMIT_FSIZE) makes the first write past it fail with EFBIG, as a
    full disk fails with ENOSPC; the limit is chosen so that the index, a shard or the
    manifest is the first file that does not fit."""
    blend, sizes = disk_blend
    assert sizes["index"] < sizes["shard"] < sizes["manifest"]  # premise of the limits
    limit = {
        "index": sizes["index"] // 2,
        "shard": (sizes["index"] + sizes["shard"]) // 2,
        "manifest": (sizes["shard"] + sizes["manifest"]) // 2,
    }[fails_on]
    out = tmp_path / "out"
    result = run_console(
        ["merge", "-q", "--shard-size", "8KiB", str(blend), str(out)],
        preexec=limit_file_size(limit),
    )
    line = check_contract(
        result.returncode, result.stdout, result.stderr, INPUT, ("cannot write",), out
    )
    assert "File too large" in line and str(out) in line


def test_full_file_system(disk_blend: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
    """A real ENOSPC: a 96 KiB tmpfs, where the merge needs about twice that."""
    blend, _ = disk_blend
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        out = mount_point / "out"
        result = run_console(["merge", "-q", "--shard-size", "8KiB", str(blend), str(out)])
        line = check_contract(
            result.returncode,
            result.stdout,
            result.stderr,
            INPUT,
            ("cannot write: No space left on device",),
            out,
        )
        assert str(out) in line
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


# --- sources mixing plain and multimodal -----------------------------------------------------


def test_plain_and_multimodal_sources_merge_together(world: World) -> None:
    """Modes are stored per sequence, so a blend may mix plain and multimodal sources; the
    loader refuses to read a plain source as multimodal."""
    code, _, stderr = run_cli(merge_args(world))
    assert code == 0, stderr
    mm = SourceDataset(str(world.out), "data/mm/c", multimodal=True)
    tokens, mode = mm[0]
    assert tokens.tolist() == [9, 9] and mode == 1
    plain = SourceDataset(str(world.out), "data/a")
    assert plain[1].tolist() == [3, 4, 5]
    with pytest.raises(RepackError, match=r"data/a: asked for as multimodal, but the source has"):
        SourceDataset(str(world.out), "data/a", multimodal=True)
    with pytest.raises(AttributeError, match="not a multimodal source"):
        _ = plain.sequence_modes


def test_the_unbroken_world_merges(world: World) -> None:
    """Premise of every case: before it is broken, the world's blend merges and verifies."""
    assert run_cli(merge_args(world))[0] == 0
    assert run_cli(["verify", "-q", str(world.out)])[0] == 0


# --- a repack is data, never code ------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parent.parent / "repack"
UNSAFE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "joblib",
    "marshal",
    "shelve",
}


def test_the_package_never_unpickles_or_evaluates() -> None:
    """No module of repack imports a deserializer of code, calls eval/exec, or loads a .npy
    without allow_pickle=False (Megatron's own cache code passes allow_pickle=True; ours
    must not)."""
    import ast

    problems = []
    loads = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(PACKAGE)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                names = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            if names & UNSAFE_MODULES and not (path.name == "torchfile.py" and names == {"pickle"}):
                problems.append(f"{where}: imports {sorted(names & UNSAFE_MODULES)}")
            if not isinstance(node, ast.Call):
                continue
            function = ast.unparse(node.func)
            if function in ("eval", "exec", "compile", "__import__"):
                problems.append(f"{where}: calls {function}")
            if function.endswith(("torch.load", "yaml.load", "yaml.unsafe_load")):
                problems.append(f"{where}: calls {function}")
            if function in ("np.load", "numpy.load") or function.endswith(
                ("format.read_array", ".read_array")
            ):
                loads += 1
                keywords = {k.arg: k.value for k in node.keywords}
                safe = keywords.get("allow_pickle")
                if not (isinstance(safe, ast.Constant) and safe.value is False):
                    problems.append(f"{where}: {function} without allow_pickle=False")
    assert loads >= 1  # premise: the scan sees the index cache's np.load
    assert problems == []


def test_the_one_unpickler_resolves_no_global_by_import() -> None:
    """``repack/trace/torchfile.py`` reads a training checkpoint's ``torch.save`` files (not a
    repack), the one module allowed ``pickle``: only through a ``pickle.Unpickler`` subclass
    whose ``find_class`` never calls the base one (which imports what the pickle names), and
    never ``pickle.load``/``loads`` (tests/test_torchfile.py runs a pickle that would call
    ``os.system`` through it)."""
    import ast

    tree = ast.parse((PACKAGE / "trace" / "torchfile.py").read_text())
    uses = {
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "pickle"
    }
    assert uses <= {"pickle.Unpickler", "pickle.UnpicklingError"}, uses
    (unpickler,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and "pickle.Unpickler" in map(ast.unparse, node.bases)
    ]
    methods = {node.name: node for node in unpickler.body if isinstance(node, ast.FunctionDef)}
    assert "find_class" in methods
    calls = {
        ast.unparse(n.func) for n in ast.walk(methods["find_class"]) if isinstance(n, ast.Call)
    }
    assert not any("super" in call or "import" in call for call in calls), calls


@pytest.fixture
def small_repack(world: World) -> Path:
    merge(world.blend, world.out)
    return world.out


def rewrite_manifest(out: Path, change: Callable[[dict], None]) -> None:
    from repack.format.manifest import dump_manifest

    raw = json.loads((out / fmt.MANIFEST_FILE).read_bytes())
    algorithm = raw.pop("checksum").split(":")[0]
    change(raw)
    (out / fmt.MANIFEST_FILE).write_bytes(dump_manifest(raw, algorithm))


@pytest.mark.parametrize(
    "name",
    [
        "..",
        ".",
        "",
        "/etc/passwd",
        "../shard-00000.bin",
        "sub/shard-00000.bin",
        "shard-00000.bin\\..",
        "shard-00000.bin\x00",
        "shard-00000.bin/",
        "shard-0.bin",
        "shard-00000.bin.tmp",
        " shard-00000.bin",
    ],
)
@pytest.mark.parametrize("member", ["shard", "index"])
def test_file_names_in_the_manifest_must_be_plain_names_in_the_folder(
    small_repack: Path, member: str, name: str
) -> None:
    from repack.read.reader import Repack

    def change(raw: dict) -> None:
        if member == "shard":
            raw["shards"][0]["file"] = name
        else:
            raw["index"]["file"] = name.replace("shard-00000.bin", "index.rpx")

    rewrite_manifest(small_repack, change)
    with pytest.raises(RepackError, match=r"manifest\.json: invalid manifest: (shards\[0\]|index)"):
        Repack(str(small_repack))


def move_out_and_link(out: Path, name: str, elsewhere: Path) -> None:
    shutil.move(out / name, elsewhere)
    os.symlink(elsewhere, out / name)


@pytest.mark.parametrize("name", [fmt.MANIFEST_FILE, fmt.INDEX_FILE, "shard-00000.bin"])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_symlink_leading_out_of_the_folder_is_refused(
    small_repack: Path, tmp_path: Path, name: str, backend: str
) -> None:
    from repack.errors import UnsafePath
    from repack.read.reader import Repack

    move_out_and_link(small_repack, name, tmp_path / "elsewhere")
    with pytest.raises(UnsafePath, match=rf"{name}: is a symbolic link to .*elsewhere, outside"):
        Repack(str(small_repack), backend)


def test_a_symlink_inside_the_folder_is_accepted(small_repack: Path) -> None:
    from repack.read.reader import Repack

    (small_repack / "store").mkdir()
    move_out_and_link(small_repack, "shard-00001.bin", small_repack / "store" / "s1")
    repack = Repack(str(small_repack), "pread")
    assert repack.read(1, 0, 2, np.dtype(np.int32)).tolist() == [70000, 1]


def test_a_folder_reached_through_a_symlink_is_fine(small_repack: Path, tmp_path: Path) -> None:
    from repack.read.reader import Repack

    os.symlink(small_repack, tmp_path / "alias")
    assert len(Repack(str(tmp_path / "alias")).manifest.sources) == 3


def test_verify_reports_a_shard_linked_from_outside(small_repack: Path, tmp_path: Path) -> None:
    from repack.read.verify import verify

    move_out_and_link(small_repack, "shard-00000.bin", tmp_path / "elsewhere")
    assert not verify(small_repack).ok


def test_verify_reports_an_index_linked_from_outside(small_repack: Path, tmp_path: Path) -> None:
    from repack.read.verify import verify

    move_out_and_link(small_repack, fmt.INDEX_FILE, tmp_path / "elsewhere")
    report = verify(small_repack)
    assert [p.file for p in report.problems] == [fmt.INDEX_FILE]
    assert "symbolic link" in report.problems[0].message


# sizes and counts are checked before anything is allocated for them


def raises_without_allocating(error: type[BaseException], match: str, function, *args) -> None:
    """``function(*args)`` raises ``error`` matching ``match`` while allocating under 4 MiB at
    its peak (numpy reports its allocations to tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(error, match=match):
            function(*args)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"peak allocation {peak} bytes"


@pytest.mark.parametrize("field", ["sequences", "documents"])
def test_idx_header_claiming_2_60_entries_is_refused_without_allocating(
    world: World, field: str
) -> None:
    from repack.errors import TruncatedFile
    from repack.inputs.sources import read_source_index

    patch(world.a + ".idx", 18 if field == "sequences" else 26, struct.pack("<Q", 2**60))
    raises_without_allocating(
        TruncatedFile, f"{2**60} (sequences|document indices)", read_source_index, world.a
    )


def test_index_header_claiming_2_60_sequences_is_refused_without_allocating(
    small_repack: Path,
) -> None:
    """Even with a manifest edited to agree: the index file is not the size such counts
    need."""
    from repack.read.reader import Repack

    huge = 2**60
    patch(small_repack / fmt.INDEX_FILE, 16, struct.pack("<Q", huge))

    def agree(raw: dict) -> None:
        raw["index"]["sequence_count"] = huge
        last = raw["sources"][-1]
        extra = huge - sum(s["sequences"][1] for s in raw["sources"])
        last["sequences"][1] += extra
        last["segments"][-1]["count"] += extra
        last["idx_size"] = fmt.megatron_idx_size(
            last["sequences"][1], last["documents"][1], last["multimodal"]
        )

    raises_without_allocating(FormatError_, r"index\.rpx: header counts", Repack, str(small_repack))
    rewrite_manifest(small_repack, agree)
    # the manifest refuses an idx_size past int64 (its sources are int64 columns) before the
    # index's size is compared with the counts
    raises_without_allocating(
        FormatError_,
        r"index\.rpx: \d+ bytes, expected \d{19}|idx_size is \d{19,}, expected an integer from 0",
        Repack,
        str(small_repack),
    )


def test_manifest_larger_than_256_mib_is_refused_before_reading(small_repack: Path) -> None:
    from repack.read.reader import Repack

    os.truncate(small_repack / fmt.MANIFEST_FILE, fmt.MAX_MANIFEST_SIZE + 1)  # sparse
    raises_without_allocating(FormatError_, "larger than the", Repack, str(small_repack))


def test_blend_larger_than_64_mib_is_refused_before_reading(tmp_path: Path) -> None:
    from repack.errors import BlendError
    from repack.inputs.blend_files import load_blend

    with open(tmp_path / "blend.json", "wb") as stream:
        stream.truncate(MAX_BLEND_BYTES + 1)
    raises_without_allocating(BlendError, "larger than", load_blend, tmp_path / "blend.json")


def test_index_cache_catalog_larger_than_256_mib_is_refused_before_reading(
    tmp_path: Path,
) -> None:
    from repack.cache.indexcache import CATALOG_FILE, MAX_CATALOG_SIZE, IndexCache

    with open(tmp_path / CATALOG_FILE, "wb") as stream:
        stream.truncate(MAX_CATALOG_SIZE + 1)
    raises_without_allocating(FormatError_, "larger than", IndexCache(str(tmp_path)).lookup, "any")


def test_manifest_nested_too_deeply_is_a_format_error(small_repack: Path) -> None:
    """A manifest with a valid self-checksum whose JSON nests 100 000 deep."""
    from repack.checksum import digest_of, new_hasher
    from repack.read.reader import Repack

    placeholder = "xxh3-128:" + "0" * 32
    data = '{"checksum": "' + placeholder + '", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    hasher = new_hasher("xxh3-128")
    hasher.update(data.encode())
    data = data.replace(placeholder, digest_of(hasher, "xxh3-128"), 1)
    (small_repack / fmt.MANIFEST_FILE).write_text(data)
    with pytest.raises(FormatError_, match="nested too deeply"):
        Repack(str(small_repack))


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("version",), True, "format version True is not supported"),
        (("alignment",), 4096.0, "alignment is 4096.0, expected 4096"),
        (("sources", 1, "id"), 1.0, r"sources\[1\]\.id is 1\.0, expected 1"),
        (("shard_size",), "64GiB", "shard_size is '64GiB', expected an integer from 4096"),
        (("blend", "splits", "all", 0, "weight"), -0.5, "has weight -0.5; expected a finite"),
    ],
)
def test_manifest_values_of_the_wrong_type_are_refused(
    small_repack: Path, path: tuple, value: object, message: str
) -> None:
    from repack.read.reader import Repack

    def change(raw: dict) -> None:
        target = raw
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    rewrite_manifest(small_repack, change)
    with pytest.raises(FormatError_, match=message):
        Repack(str(small_repack))
