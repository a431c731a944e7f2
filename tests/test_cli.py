"""The command line through click's CliRunner, plus a few real runs of the console script.

Every failure must be one ``Error: ...`` line on stderr with its exit status, never a
traceback.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner, Result

from repack import __version__
from repack.cli import main
from repack.format.manifest import load_manifest

REPACK = Path(sys.executable).with_name("repack")
COMMANDS = ["merge", "verify", "inspect", "extract"]


def run(*args: str | Path) -> Result:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output
    if result.exception is not None:  # a crash, not a deliberate exit
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def assert_one_line_error(
    result: Result, exit_code: int, *needles: str, as_json: bool = False
) -> str:
    """One ``Error:`` line on stderr; stdout empty, or under ``--json`` the same error as
    JSON."""
    assert result.exit_code == exit_code, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]
    if as_json:
        error = json.loads(result.stdout)["error"]
        assert error["message"] == lines[0].removeprefix("Error: ")
        assert error["status"] == exit_code
    else:
        assert result.stdout == ""
    return lines[0]


@pytest.fixture
def blend(make_source, write_blend, tmp_path: Path) -> Path:
    """Three sources: uint16, int32 and a multimodal one."""
    rng = np.random.default_rng(0)
    prefixes = [
        make_source("data/a", [rng.integers(0, 50000, n) for n in (5, 0, 9)]),
        make_source("data/b", [rng.integers(0, 10**6, n) for n in (3, 4)], dtype=np.int32),
        make_source("data/mm/c", [[1, 2], [3]], modes=[0, 1], documents=[0, 2]),
    ]
    return write_blend([os.path.relpath(p, tmp_path) for p in prefixes])


# --- merge ----------------------------------------------------------------------------------


def test_merge_prints_summary_and_writes_folder(blend: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run("merge", "-q", blend, out)
    assert result.exit_code == 0
    assert result.stdout.startswith(f"merged 3 sources (62 B) into 2 shards in {out} in ")
    assert result.stderr == ""  # -q: no progress bars
    assert sorted(os.listdir(out)) == [
        "fingerprints.rpf",
        "index.rpx",
        "manifest.json",
        "shard-00000.bin",
        "shard-00001.bin",
    ]
    assert [s.name for s in load_manifest(out).sources] == ["data/a", "data/b", "data/mm/c"]


def test_counts_of_one_are_singular(make_source, write_blend, tmp_path: Path) -> None:
    blend = write_blend([make_source("one", [[1, 2, 3]])])
    out = tmp_path / "out"
    merged = run("merge", "-q", blend, out)
    assert merged.stdout.startswith(f"merged 1 source (6 B) into 1 shard in {out} in ")
    assert run("merge", "-q", "--dry-run", blend, tmp_path / "o2").stdout.endswith(
        "dry run: 1 source, 6 B into 1 shard; nothing written\n"
    )
    verified = run("verify", "-q", out).stdout
    assert verified.startswith("OK: 4 files, ") and verified.endswith(", 1 source\n")
    total = run("inspect", out).stdout.splitlines()[-1]
    assert total.startswith("total: 1 source, 3 tokens, 1 sequence, 1 document in 1 shard, ")
    (out / "precious.txt").write_text("keep")
    line = assert_one_line_error(run("merge", "-q", "--force", blend, out), 3)
    assert "holds 1 file repack did not write (precious.txt)" in line


def test_merge_json(blend: Path, tmp_path: Path) -> None:
    result = run("merge", "-q", "--json", blend, tmp_path / "out")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert {k: data[k] for k in ("out", "shards", "sources", "bytes")} == {
        "out": str(tmp_path / "out"),
        "shards": 2,
        "sources": 3,
        "bytes": (14 + 3) * 2 + 7 * 4,
    }


def test_dry_run_writes_nothing_and_lists_shards(blend: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run("merge", "--dry-run", blend, out)
    assert result.exit_code == 0
    assert not out.exists()
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["shard", "dtype", "size", "sources"]
    assert lines[1].split() == ["shard-00000.bin", "uint16", "4.0", "KiB", "2"]
    assert lines[2].split() == ["shard-00001.bin", "int32", "28", "B", "1"]
    assert lines[-1] == "dry run: 3 sources, 62 B into 2 shards; nothing written"


def test_dry_run_json(blend: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run("merge", "-q", "--dry-run", "--json", "--shard-size", "4KiB", blend, out)
    assert result.exit_code == 0
    assert not out.exists()
    plan = json.loads(result.stdout)
    assert plan["shard_size"] == 4096 and plan["sources"] == 3
    # data/mm/c does not fit behind data/a's 28 bytes once aligned to 4096
    assert [(s["file"], s["dtype"], s["sources"]) for s in plan["shards"]] == [
        ("shard-00000.bin", "uint16", ["data/a"]),
        ("shard-00001.bin", "uint16", ["data/mm/c"]),
        ("shard-00002.bin", "int32", ["data/b"]),
    ]


def test_merge_into_non_empty_folder_fails(blend: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    result = run("merge", "-q", blend, out)
    line = assert_one_line_error(result, 3, str(out), "not empty", "precious.txt")
    assert "--force" not in line  # which would refuse too: the hint names what is there
    assert run("merge", "-q", "--force", blend, out).exit_code == 3
    assert os.listdir(out) == ["precious.txt"]


def test_merge_over_a_repack_needs_force(
    blend: Path, make_source, write_blend, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert run("merge", "-q", blend, out).exit_code == 0
    before = (out / "manifest.json").read_bytes()
    # the same merge again finds it complete and writes nothing
    again = run("merge", "-q", blend, out)
    assert again.exit_code == 0 and "already done" in again.output
    # another blend is refused
    other = write_blend([make_source("other", [[7, 8, 9]])], name="other.json")
    assert_one_line_error(
        run("merge", "-q", other, out),
        3,
        f"{out}: folder is not empty: it holds a repack; ",
        "--force",
    )
    assert (out / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("litter", [[".DS_Store"], ["Thumbs.db", "._shard-00000.bin"]])
def test_file_manager_litter_counts_as_empty(blend: Path, tmp_path: Path, litter) -> None:
    """What Finder or Explorer drop into a folder they show does not make it "not empty"; it
    is left alone, and the repack reads and verifies with it there."""
    out = tmp_path / "out"
    out.mkdir()
    for name in litter:
        (out / name).write_bytes(b"\x00\x01")
    result = run("merge", "-q", blend, out)
    assert result.exit_code == 0, result.output
    assert set(litter) <= set(os.listdir(out))
    assert run("verify", "-q", out).exit_code == 0
    assert run("merge", "-q", "--force", blend, out).exit_code == 0  # not foreign either
    assert set(litter) <= set(os.listdir(out))


def test_force_replaces_a_previous_repack(
    blend: Path, make_source, write_blend, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert run("merge", "-q", blend, out).exit_code == 0
    assert len(os.listdir(out)) == 5  # manifest, index, fingerprints, 2 shards
    other = write_blend([make_source("other", [[7, 8, 9]])], name="other.json")
    result = run("merge", "-q", "--force", other, out)
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(out)) == [
        "fingerprints.rpf",
        "index.rpx",
        "manifest.json",
        "shard-00000.bin",
    ]  # the previous repack's files replaced, none left over
    assert [s.name for s in load_manifest(out).sources] == [str(tmp_path / "other")]
    assert run("verify", "-q", out).exit_code == 0


def test_force_refuses_a_folder_with_foreign_files(blend: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("merge", "-q", blend, out).exit_code == 0
    (out / "notes.txt").write_text("mine")
    result = run("merge", "-q", "--force", blend, out)
    assert_one_line_error(result, 3, str(out), "notes.txt", "--force replaces a repack only")
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "manifest.json").exists()


def test_malformed_json_blend(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[1.0, "a", ')
    result = run("merge", "-q", bad, tmp_path / "out")
    assert_one_line_error(result, 3, str(bad))
    assert not (tmp_path / "out").exists()


def test_missing_bin(blend: Path, tmp_path: Path) -> None:
    missing = tmp_path / "data" / "b.bin"
    missing.unlink()
    result = run("merge", "-q", blend, tmp_path / "out")
    assert_one_line_error(result, 3, str(missing), "not found")
    assert not (tmp_path / "out").exists()


def test_three_typos_are_one_error_listing_three_sources(blend: Path, tmp_path: Path) -> None:
    """Every bad source in one run: each with its file and cause, in the blend's order."""
    typos = tmp_path / "typos.json"
    typos.write_text(json.dumps([1, "data/ax", 1, "data/b", 1, "data/bee", 1, "data/mm/cc"]))
    for as_json in (False, True):
        result = run("merge", *(["--json"] * as_json), typos, tmp_path / "out")
        assert result.exit_code == 3
        assert result.stderr.splitlines() == [
            f"Error: {typos}: 3 of 4 sources cannot be used; nothing was written:",
            f"  {tmp_path}/data/ax.idx: .idx file not found",
            f"  {tmp_path}/data/bee.idx: .idx file not found",
            f"  {tmp_path}/data/mm/cc.idx: .idx file not found",
        ]
        if as_json:
            error = json.loads(result.stdout)["error"]
            assert (error["status"], error["type"]) == (3, "BadSources")
            assert error["path"] == str(typos)
            assert [(e["path"], e["type"]) for e in error["errors"]] == [
                (f"{tmp_path}/data/{name}.idx", "SourceMissing") for name in ("ax", "bee", "mm/cc")
            ]
        else:
            assert result.stdout == ""
        assert not (tmp_path / "out").exists()


def test_bad_sources_of_every_kind_in_one_error(blend: Path, tmp_path: Path) -> None:
    (tmp_path / "data" / "b.bin").unlink()
    (tmp_path / "data" / "mm" / "c.idx").write_bytes(b"NOTANIDX" + bytes(40))
    result = run("merge", "-q", blend, tmp_path / "out")
    lines = result.stderr.splitlines()
    assert result.exit_code == 3 and len(lines) == 3, result.stderr
    assert lines[0] == f"Error: {blend}: 2 of 3 sources cannot be used; nothing was written:"
    assert lines[1] == f"  {tmp_path}/data/b.bin: .bin file not found"
    assert lines[2].startswith(f"  {tmp_path}/data/mm/c.idx: bad magic ")


def test_many_bad_sources_list_the_first_twenty(write_blend, tmp_path: Path) -> None:
    blend = write_blend([f"gone/{i:02d}" for i in range(23)])
    result = run("merge", "-q", blend, tmp_path / "out")
    lines = result.stderr.splitlines()
    assert result.exit_code == 3 and len(lines) == 22, result.stderr
    assert lines[0] == f"Error: {blend}: 23 of 23 sources cannot be used; nothing was written:"
    assert lines[1] == f"  {tmp_path}/gone/00.idx: .idx file not found"
    assert lines[20] == f"  {tmp_path}/gone/19.idx: .idx file not found"
    assert lines[21] == "  and 3 more"


@pytest.mark.parametrize("size", ["abc", "12 parsecs", "-5", "0", "4095", "1KiB"])
def test_bad_shard_size_is_a_usage_error(blend: Path, tmp_path: Path, size: str) -> None:
    result = run("merge", "--shard-size", size, blend, tmp_path / "out")
    assert result.exit_code == 2
    assert "Invalid value for '--shard-size'" in result.stderr
    assert not (tmp_path / "out").exists()


def test_smallest_shard_size_is_accepted(blend: Path, tmp_path: Path) -> None:
    result = run("merge", "-q", "--json", "--shard-size", "4096", blend, tmp_path / "out")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["shards"] == 3


# --- inspect, extract, verify ---------------------------------------------------------------


@pytest.fixture
def repack(blend: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    assert run("merge", "-q", blend, out).exit_code == 0
    return out


def test_inspect_table_and_totals(repack: Path, blend: Path) -> None:
    result = run("inspect", repack)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "id",
        "prefix",
        "splits",
        "dtype",
        "tokens",
        "sequences",
        "documents",
        "shard",
    ]
    assert lines[1].split() == ["0", "data/a", "all:1", "uint16", "14", "3", "3", "0"]
    assert lines[3].split() == ["2", "data/mm/c", "all:1", "uint16+mm", "3", "2", "1", "0"]
    assert lines[-1] == (
        "total: 3 sources, 24 tokens, 7 sequences, 6 documents in 2 shards, 4.0 KiB; "
        f"blend {blend} (data-path)"
    )


def test_inspect_json(repack: Path) -> None:
    result = run("inspect", "--json", repack)
    assert result.exit_code == 0
    info = json.loads(result.stdout)
    assert info["totals"] == {
        "sources": 3,
        "shards": 2,
        "tokens": 24,
        "sequences": 7,
        "documents": 6,
        "bytes": 4096 + 6 + 28,
    }
    assert [s["multimodal"] for s in info["sources"]] == [False, False, True]


def test_inspect_of_a_folder_that_is_no_repack(tmp_path: Path) -> None:
    assert_one_line_error(run("inspect", tmp_path), 3, "manifest.json", "not found")


def test_an_interrupted_merge_suggests_resume(blend: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("merge", "-q", "--plan-only", blend, out).exit_code == 0  # as if killed after
    hint = f"it holds an unfinished merge; run 'repack merge {out} --resume' to finish it"
    assert_one_line_error(run("inspect", out), 3, "manifest.json: not found", hint)
    result = run("verify", "-q", out)
    assert result.exit_code == 1
    assert result.stdout.startswith("FAIL manifest.json: not found; ") and hint in result.stdout
    # a folder that is no merge at all gets no such hint
    assert "--resume" not in run("inspect", tmp_path).stderr
    assert run("merge", "-q", out, "--resume").exit_code == 0
    assert run("verify", "-q", out).exit_code == 0


def test_extract(repack: Path, tmp_path: Path) -> None:
    result = run("extract", "-q", repack, "data/b", tmp_path / "restored" / "b")
    assert result.exit_code == 0
    assert "for data/b" in result.stdout
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(tmp_path / f"data/b{ext}", tmp_path / f"restored/b{ext}", False)
    again = run("extract", "-q", repack, "data/b", tmp_path / "restored" / "b")
    assert_one_line_error(again, 3, "b.bin", "exists", "--force")
    assert run("extract", "-q", "--force", repack, "data/b", tmp_path / "restored/b").exit_code == 0


@pytest.mark.parametrize("existing", [True, False])
def test_extract_into_a_folder_names_the_files_after_the_source(
    repack: Path, tmp_path: Path, existing: bool
) -> None:
    """An existing folder, or a path ending in '/', is where the files go, named after the
    source (they used to be the hidden restored/.bin and restored/.idx)."""
    folder = tmp_path / "restored"
    if existing:
        folder.mkdir()
    dest = f"{folder}{'' if existing else os.sep}"
    result = run("extract", "-q", repack, "data/mm/c", dest)
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(folder)) == ["c.bin", "c.idx"]
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(tmp_path / f"data/mm/c{ext}", folder / f"c{ext}", False)
    assert result.stdout == f"wrote {folder}/c.bin (6 B) and {folder}/c.idx for data/mm/c\n"


def test_extract_json(repack: Path, tmp_path: Path) -> None:
    result = run("extract", "-q", "--json", repack, "data/b", tmp_path / "r" / "b")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "source": "data/b",
        "bin": f"{tmp_path}/r/b.bin",
        "idx": f"{tmp_path}/r/b.idx",
        "bin_size": os.path.getsize(tmp_path / "data/b.bin"),
        "idx_size": os.path.getsize(tmp_path / "data/b.idx"),
    }
    again = run("extract", "-q", "--json", repack, "data/b", tmp_path / "r" / "b")
    line = assert_one_line_error(again, 3, "b.bin", "exists", as_json=True)
    assert json.loads(again.stdout)["error"]["path"] == f"{tmp_path}/r/b.bin"
    assert line == f"Error: {tmp_path}/r/b.bin: exists; pass --force to replace it"


def test_extract_unknown_source(repack: Path, tmp_path: Path) -> None:
    result = run("extract", "-q", repack, "data/zzz", tmp_path / "z")
    assert_one_line_error(result, 3, "no source 'data/zzz'", "data/a")
    assert not (tmp_path / "z.bin").exists()


def test_verify_ok(repack: Path) -> None:
    result = run("verify", "-q", repack)
    assert result.exit_code == 0
    assert result.stdout.startswith("OK: 5 files, ")  # manifest, index, fingerprints, 2 shards


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help(command: str | None) -> None:
    args = ["--help"] if command is None else [command, "--help"]
    result = run(*args)
    assert result.exit_code == 0
    assert result.stdout.startswith("Usage: ")
    if command is None:
        for name in COMMANDS:
            assert f"  {name}" in result.stdout
    else:
        assert "Exit status:" in result.stdout
    assert "%%" not in result.stdout  # click does not %-format help (argparse does)


def test_doctor_and_trace_share_one_fma_option(monkeypatch) -> None:
    """--fma/--no-fma is one of the run settings defined once (repack/cli/options.py): the same
    option in both commands, its default the installed helper's rounding, asked when a command
    runs (not when repack is imported)."""
    from repack.cli.app import main as group
    from repack.model import rounding

    options = {
        name: next(p for p in group.commands[name].params if p.name == "fma")
        for name in ("doctor", "trace")
    }
    doctor, trace = options["doctor"], options["trace"]
    assert doctor.opts == trace.opts == ["--fma"] and doctor.secondary_opts == ["--no-fma"]
    assert doctor.help == trace.help and doctor.show_default == trace.show_default
    for value in (True, False):
        monkeypatch.setattr(rounding, "default_fma", lambda value=value: value)
        assert doctor.get_default(click.Context(group.commands["doctor"]), call=True) is value
    for name in ("doctor", "trace"):
        shown = " ".join(run(name, "--help").stdout.split())
        assert "--fma / --no-fma" in shown and "aarch64 builds (GH200, GB200)" in shown


def test_merge_help_shows_the_task_rule() -> None:
    assert "(shard k when k % N == I)" in " ".join(run("merge", "--help").stdout.split())


# --- unexpected errors: one Error line, never a traceback or a bare "Aborted!" ----------------


def command_args(command: str, repack: Path, tmp_path: Path, make_source, write_blend) -> list:
    """Arguments of ``command`` that get it past its checks into the library."""
    if command == "merge":
        return ["merge", "-q", write_blend([make_source("m/x", [[1, 2, 3]])], "m.json"), repack]
    if command == "add":
        return ["add", "-q", repack, write_blend([make_source("n/y", [[4, 5]])], "n.json")]
    if command == "extract":
        return ["extract", "-q", repack, "data/a", tmp_path / "restored"]
    return [command, repack]


@pytest.mark.parametrize(
    ("error", "status", "text"),
    [
        (
            ValueError("something unforeseen"),
            70,
            "internal error, ValueError: something unforeseen",
        ),
        # the classes click itself would print as a bare "Aborted!"
        (EOFError("file ends 3 bytes early"), 70, "internal error, EOFError: file ends 3 bytes"),
        (RuntimeError(), 70, "internal error, RuntimeError (at "),
        (KeyboardInterrupt(), 130, "interrupted"),
        (click.Abort(), 130, "interrupted"),
    ],
    ids=["ValueError", "EOFError", "empty-message", "KeyboardInterrupt", "Abort"],
)
@pytest.mark.parametrize(
    ("command", "as_json"),
    [(c, False) for c in [*COMMANDS, "add"]]
    + [(c, True) for c in ["merge", "verify", "inspect", "add"]],
)
def test_unexpected_error_is_one_error_line(
    command: str,
    as_json: bool,
    error: BaseException,
    status: int,
    text: str,
    repack: Path,
    tmp_path: Path,
    make_source,
    write_blend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fail(*args, **kwargs):
        raise error

    # a call each command makes from inside the library: progress bars (inspect has none)
    if command == "inspect":
        monkeypatch.setattr("repack.read.summary.summarize", fail)
    else:
        monkeypatch.setattr("repack.progress.Display.__call__", fail)
    args = command_args(command, repack, tmp_path, make_source, write_blend)
    result = run(*args, *(["--json"] * as_json))
    line = assert_one_line_error(result, status, text, as_json=as_json)
    assert "Aborted" not in result.output
    if status == 70:
        target = args[-1] if command in ("merge", "extract") else repack
        assert line.startswith(f"Error: main {command} {target}: internal error, ")
        assert line.endswith(f"; this is a bug in repack {__version__}, please report it")
        # where it was raised: the test's fail(), called from repack's code
        assert re.search(r"\(at repack/[a-z/]+\.py:\d+\)", line), line


def test_error_outside_a_command_body_is_one_error_line(
    blend: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raised while options are parsed, or by a command without ``_handle_errors``: the
    group translates it."""

    def fail(value):
        raise TypeError("unforeseen")

    monkeypatch.setattr("repack.format.codec.parse_codec", fail)
    result = run("merge", "--compress", "zstd", blend, tmp_path / "out")
    line = assert_one_line_error(result, 70, "internal error, TypeError: unforeseen")
    assert line.startswith("Error: main merge: internal error, TypeError: unforeseen (at ")
    assert not (tmp_path / "out").exists()

    def crash() -> None:
        raise EOFError

    monkeypatch.setitem(main.commands, "crash", click.Command("crash", callback=crash))
    result = run("crash")
    assert_one_line_error(result, 70, "Error: main crash: internal error, EOFError (at ")
    assert "Aborted" not in result.output
    # click's own exits still pass: usage errors and --help
    assert run("crash", "--bogus").exit_code == 2
    assert run("crash", "--help").exit_code == 0


def test_unexpected_error_in_a_real_process(repack: Path) -> None:
    """The console entry point in a process of its own: EOFError (the class that made click
    print a bare 'Aborted!' for `verify --sources` on compressed shards) from inside verify."""
    code = (
        "import sys, repack.read.verify\n"
        "def fail(*args, **kwargs):\n"
        "    raise EOFError('file ends 1223 bytes before offset 64558')\n"
        "repack.read.verify.verify = fail\n"
        "from repack.cli import main\n"
        "sys.argv[0] = 'repack'\n"
        "main()\n"
    )
    for extra in ([], ["--json"]):
        done = subprocess.run(
            [sys.executable, "-c", code, "verify", "--sources", *extra, str(repack)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 70, done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1, done.stderr
        if extra:  # --json: the same error on stdout, as JSON
            error = json.loads(done.stdout)["error"]
            assert error["message"] == lines[0].removeprefix("Error: ")
            assert (error["status"], error["type"]) == (70, "EOFError")
        else:
            assert done.stdout == ""
        assert re.fullmatch(
            rf"Error: repack verify {re.escape(str(repack))}: internal error, EOFError: file ends "
            r"1223 bytes before offset 64558 \(at repack/cli/reading\.py:\d+\); this is a bug in "
            rf"repack {re.escape(__version__)}, please report it",
            lines[0],
        ), lines[0]


# --- the real console script ----------------------------------------------------------------


def test_console_script_merge_and_verify(blend: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    merged = subprocess.run(
        [REPACK, "merge", "--json", blend, out], capture_output=True, text=True, check=False
    )
    assert merged.returncode == 0, merged.stderr
    assert json.loads(merged.stdout)["sources"] == 3
    assert "Traceback" not in merged.stderr
    again = subprocess.run(  # other options: another repack, refused
        [REPACK, "merge", "--shard-size", "8192", blend, out], capture_output=True, text=True
    )
    assert again.returncode == 3
    errors = [line for line in again.stderr.splitlines() if "Error" in line]
    assert errors == [again.stderr.splitlines()[-1]]  # after the progress bar's lines
    assert errors[0].startswith(f"Error: {out}: folder is not empty")
    assert "Traceback" not in again.stderr
    verified = subprocess.run(
        [sys.executable, "-m", "repack", "verify", "-q", out], capture_output=True, text=True
    )
    assert verified.returncode == 0 and verified.stdout.startswith("OK: ")
