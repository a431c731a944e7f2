"""Progress output: a bar on a terminal, plain lines in a file or a pipe, nothing with --quiet.

The real console script runs with its stderr on a file, on a pipe and on a pseudo-terminal
(of a reported width, and of none); ``$REPACK_PROGRESS_INTERVAL`` makes the plain lines come
without waiting 30 s.
"""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from repack.progress import INTERVAL_VARIABLE, Display, format_duration
from repack.synth import DemoBlend

REPACK = Path(sys.executable).with_name("repack")

# A plain progress line, as a SLURM log shows it.
LINE = re.compile(
    r"repack: (validate|merge|verify) "
    r"(\d+% \([\d.,]+ (B|KiB|MiB|sources)? ?of [\d.,]+ (B|KiB|MiB|sources)\) in [\d.]+ s, "
    r"[\d.,]+ (B|KiB|MiB|GiB|sources)/s, ETA [\d.]+ s"
    r"|done, [\d.,]+ (B|KiB|MiB|sources?) in [\d.]+ s, [\d.,]+ (B|KiB|MiB|GiB|sources)/s)"
)


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != INTERVAL_VARIABLE}
    env.update(extra)
    return env


def merge_args(demo_blend: DemoBlend, out: Path, *extra: str) -> list:
    return [REPACK, "merge", *extra, "--shard-size", "64KiB", demo_blend.flat_json, out]


def test_merge_into_a_log_file_writes_plain_lines(demo_blend: DemoBlend, tmp_path: Path) -> None:
    log = tmp_path / "slurm-1234.out"
    with open(log, "w") as stderr:
        done = subprocess.run(
            merge_args(demo_blend, tmp_path / "out"),
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=environment(**{INTERVAL_VARIABLE: "0"}),
            text=True,
        )
    assert done.returncode == 0, log.read_text()
    text = log.read_text()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert all(LINE.fullmatch(line) for line in lines), text
    # with no interval every increment writes a line: many for both phases, each ending done
    merges = [line for line in lines if line.startswith("repack: merge ")]
    assert len(merges) > 10 and merges[-1].startswith("repack: merge done, ")
    assert "repack: validate done, 300 sources in " in text
    percents = [int(line.split()[2][:-1]) for line in merges[:-1]]
    assert percents == sorted(percents) and percents[-1] < 100


def test_long_interval_writes_last_lines_into_a_pipe(demo_blend: DemoBlend, tmp_path: Path) -> None:
    """A merge well under the interval prints each phase's last line only."""
    done = subprocess.run(
        merge_args(demo_blend, tmp_path / "out"),
        capture_output=True,
        text=True,
        env=environment(**{INTERVAL_VARIABLE: "3600"}),
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "repack: validate done",
        "repack: merge done",
    ], done.stderr
    assert all(LINE.fullmatch(line) for line in lines)


def test_quiet_writes_nothing_into_a_file(demo_blend: DemoBlend, tmp_path: Path) -> None:
    done = subprocess.run(
        merge_args(demo_blend, tmp_path / "out", "--quiet"),
        capture_output=True,
        text=True,
        env=environment(**{INTERVAL_VARIABLE: "0"}),
    )
    assert done.returncode == 0 and done.stderr == ""


def test_a_failing_command_prints_its_error_only(tmp_path: Path, write_blend) -> None:
    """No 'done' line for a phase an error ends: the Error line is the last word."""
    blend = write_blend(["missing/a"])
    done = subprocess.run(
        [REPACK, "merge", blend, tmp_path / "out"],
        capture_output=True,
        text=True,
        env=environment(),
    )
    assert done.returncode == 3
    assert done.stderr.splitlines() == [f"Error: {tmp_path}/missing/a.idx: .idx file not found"]


def test_bad_interval_is_refused(demo_blend: DemoBlend, tmp_path: Path) -> None:
    done = subprocess.run(
        merge_args(demo_blend, tmp_path / "out"),
        capture_output=True,
        text=True,
        env=environment(**{INTERVAL_VARIABLE: "soon"}),
    )
    assert done.returncode == 3
    assert done.stderr == (
        f"Error: ${INTERVAL_VARIABLE} is 'soon'; expected seconds, a number >= 0\n"
    )
    assert not (tmp_path / "out").exists()


def run_on_terminal(args: list, columns: int, rows: int = 24) -> tuple[int, str]:
    """Run ``args`` with stderr on a new pseudo-terminal of ``columns`` x ``rows``; return the
    exit status and what the terminal received."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    try:
        child = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=slave, env=environment(TERM="xterm")
        )
        os.close(slave)
        received = bytearray()
        poll = select.poll()  # not select(): a long test run may hold descriptors past 1024
        poll.register(master, select.POLLIN)
        while True:  # read as it comes, or a full terminal buffer would block the child
            if not poll.poll(60_000):
                child.kill()
                raise AssertionError("no output from the child for 60 s")
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not data:
                break
            received += data
        return child.wait(timeout=60), received.decode("utf-8", "replace")
    finally:
        os.close(master)


def bar_lines(received: str) -> list[str]:
    """The states of the bar the terminal was sent (tqdm redraws each after a '\\r')."""
    states = re.split(r"[\r\n]+", re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", received))
    return [s for s in states if "|" in s]


@pytest.mark.parametrize("columns", [100, 0])
def test_terminal_gets_a_bar(demo_blend: DemoBlend, tmp_path: Path, columns: int) -> None:
    """A bar on a terminal; one that reports 0 columns (tqdm then drew nothing) gets one 80
    columns wide."""
    status, received = run_on_terminal(merge_args(demo_blend, tmp_path / "out"), columns)
    assert status == 0, received
    assert "\r" in received
    bars = bar_lines(received)
    assert any(b.startswith("merge:") for b in bars), received
    assert any(b.startswith("validate:") for b in bars), received
    width = max(len(b) for b in bars)
    assert width == (columns or 80) - 1, bars
    assert "repack: merge" not in received  # no plain lines on a terminal


def test_quiet_draws_no_bar_on_a_terminal(demo_blend: DemoBlend, tmp_path: Path) -> None:
    status, received = run_on_terminal(merge_args(demo_blend, tmp_path / "out", "-q"), 100)
    assert status == 0 and received == ""


# --- the display itself ------------------------------------------------------------------------


def test_lines_mark_every_increment_with_no_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERVAL_VARIABLE, "0")
    stream = io.StringIO()
    display = Display(stream=stream)
    step = display("validate", 4)
    for _ in range(4):
        step(1)
    display.close()
    lines = stream.getvalue().splitlines()
    assert [line.split(" in ")[0] for line in lines] == [
        "repack: validate 25% (1 of 4 sources)",
        "repack: validate 50% (2 of 4 sources)",
        "repack: validate 75% (3 of 4 sources)",
        "repack: validate done, 4 sources",
    ]
    assert all(LINE.fullmatch(line) for line in lines)


def test_lines_wait_for_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a long interval, tenths reached in quick succession print nothing until the end;
    a phase of one source says so in the singular."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "3600")
    stream = io.StringIO()
    display = Display(stream=stream)
    step = display("merge", 1000)
    for _ in range(10):
        step(100)
    step = display("validate", 1)  # the next phase ends the previous one
    step(1)
    display.close()
    assert [line.split(" in ")[0] for line in stream.getvalue().splitlines()] == [
        "repack: merge done, 1000 B",
        "repack: validate done, 1 source",
    ]


def test_quiet_display_prints_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERVAL_VARIABLE, "0")
    stream = io.StringIO()
    display = Display(quiet=True, stream=stream)
    display("merge", 10)(10)
    display.close()
    assert stream.getvalue() == ""


def test_closing_on_an_error_prints_no_last_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERVAL_VARIABLE, "3600")
    stream = io.StringIO()
    display = Display(stream=stream)
    with pytest.raises(ValueError):
        try:
            display("validate", 2)(2)
            raise ValueError("bad source")
        finally:
            display.close()
    assert stream.getvalue() == ""


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0.04, 4.2, 42, 185, 7620)] == [
        "0.0 s",
        "4.2 s",
        "42 s",
        "3m 05s",
        "2h 07m",
    ]
