"""The progress hook every long command of the library takes, its silent default, and the
command line's display of it.

The library never draws anything itself: it calls ``progress(description, total)`` once per
phase and the returned callable with each increment. The command line passes a
:class:`Display`, which draws a tqdm bar when stderr is a terminal and writes a plain line now
and then when stderr is a file or a pipe (a SLURM log): no carriage returns, no escape codes.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from repack.errors import InputError
from repack.units import format_size, plural

__all__ = [
    "DEFAULT_INTERVAL",
    "INTERVAL_VARIABLE",
    "Display",
    "Progress",
    "format_duration",
    "no_progress",
]

Progress = Callable[[str, int], Callable[[int], object]]
"""``progress(description, total)`` returns a callable that takes increments."""

#: Seconds between two plain progress lines at most (when stderr is not a terminal).
DEFAULT_INTERVAL = 30.0

#: The environment variable that overrides :data:`DEFAULT_INTERVAL` (seconds, >= 0).
INTERVAL_VARIABLE = "REPACK_PROGRESS_INTERVAL"

# A plain line also marks every tenth of a phase, but no sooner than this share of the
# interval after the previous line (1 s by default): a phase of a second prints only its
# last line, and a failing one nothing but its error.
_STEP_SPACING = 1 / 30

# Columns of a terminal that reports none (a serial console, some containers' pty).
_FALLBACK_COLUMNS = 80


def no_progress(description: str, total: int) -> Callable[[int], object]:
    """A progress hook that reports nothing."""
    return _ignore


def _ignore(n: int) -> None:
    pass


def format_duration(seconds: float) -> str:
    """``4.2 s``, ``42 s``, ``3m 05s``, ``2h 07m``: a duration for a progress line."""
    if seconds < 9.95:
        return f"{max(0.0, seconds):.1f} s"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def _interval() -> float:
    value = os.environ.get(INTERVAL_VARIABLE)
    if value is None or value == "":
        return DEFAULT_INTERVAL
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise InputError(f"${INTERVAL_VARIABLE} is {value!r}; expected seconds, a number >= 0")
    return seconds


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _shape(stream: TextIO) -> tuple[int, int | None]:
    """(columns, rows) for a bar on ``stream``; a terminal reporting 0 columns gets 80."""
    try:
        columns, rows = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        columns, rows = 0, 0
    # one column less than the terminal's, as tqdm does: the cursor must not wrap
    return (columns if columns > 0 else _FALLBACK_COLUMNS) - 1, rows - 1 if rows > 1 else None


#: Phases counted in things, not bytes: what each counts.
_COUNTED = {
    "validate": ("source", "sources"),
    "prepare": ("source", "sources"),
    "replay": ("micro-batch", "micro-batches"),
}


class Display:
    """The progress hook of the command line: a bar, plain lines, or nothing.

    A bar (tqdm) when ``stream`` is a terminal, as wide as the terminal (80 columns when it
    reports 0); when it is a file or a pipe, a plain line every :data:`DEFAULT_INTERVAL`
    seconds (``$REPACK_PROGRESS_INTERVAL``) and at every tenth of a phase (no sooner than a
    thirtieth of that interval after the previous line: 1 s), with done/total, rate and ETA,
    and a last line when the phase completes; nothing when ``quiet``. Increments may come from
    several threads.

    Call :meth:`close` when the command ends: a phase's last line is written then, unless an
    exception is on its way out (the error line is then the last word).
    """

    def __init__(self, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.quiet = quiet
        self.terminal = not quiet and _is_terminal(self.stream)
        self.interval = DEFAULT_INTERVAL if quiet or self.terminal else _interval()
        self._phases: list = []

    def __call__(self, description: str, total: int) -> Callable[[int], object]:
        self._end(failed=False)  # a new phase: the previous one is complete
        if self.quiet:
            return _ignore
        unit = _COUNTED.get(description)
        if self.terminal:
            phase: _Bar | _Lines = _Bar(self.stream, description, total, unit)
        else:
            phase = _Lines(self.stream, description, total, unit, self.interval)
        self._phases.append(phase)
        return phase.update

    def close(self) -> None:
        """End the current phase (a bar vanishes; plain lines get their last one)."""
        self._end(failed=sys.exc_info()[0] is not None)  # in a finally: is an error leaving?

    def _end(self, failed: bool) -> None:
        for phase in self._phases:
            phase.close(failed)
        self._phases.clear()


class _Bar:
    def __init__(
        self, stream: TextIO, description: str, total: int, unit: tuple[str, str] | None
    ) -> None:
        from tqdm import tqdm  # here: importing it takes longer than verifying a small repack

        columns, rows = _shape(stream)
        self.bar = tqdm(
            total=total,
            desc=description,
            unit="B" if unit is None else f" {unit[1]}",
            unit_scale=unit is None,
            unit_divisor=1024,
            file=stream,
            leave=False,
            ncols=columns,
            nrows=rows,
        )
        # tqdm's own dynamic_ncols takes a terminal's 0 columns as -1 and draws nothing: ask
        # the terminal at each refresh (it may be resized), with our fallback
        self.bar.dynamic_ncols = _shape
        self.lock = threading.Lock()

    def update(self, n: int) -> None:
        with self.lock:
            self.bar.update(n)

    def close(self, failed: bool) -> None:
        self.bar.close()


class _Lines:
    """Plain progress lines for one phase, for a log file or a pipe."""

    def __init__(
        self,
        stream: TextIO,
        description: str,
        total: int,
        unit: tuple[str, str] | None,
        interval: float,
    ) -> None:
        self.stream = stream
        self.description = description
        self.total = total
        #: What the phase counts, one and many (``None``: bytes).
        self.unit = unit
        self.in_bytes = unit is None
        self.interval = interval
        self.done = 0
        self.started = self.last = time.monotonic()
        self.step = 0  # the last tenth of the phase a line was written for
        self.lock = threading.Lock()

    def _amount(self, n: float) -> str:
        return format_size(n) if self.in_bytes else str(int(n))

    def _rate(self, elapsed: float) -> str:
        rate = self.done / elapsed if elapsed > 0 else 0.0
        if self.in_bytes:
            return f"{format_size(rate)}/s"
        return f"{rate:.{1 if rate < 100 else 0}f} {self.unit[1]}/s"

    def update(self, n: int) -> None:
        with self.lock:
            self.done += n
            if self.total <= 0 or self.done >= self.total:
                return  # the last line says it, at close
            now = time.monotonic()
            since = now - self.last
            step = self.done * 10 // self.total
            if since < self.interval and (
                step <= self.step or since < self.interval * _STEP_SPACING
            ):
                return
            self.step, self.last = step, now
            elapsed = now - self.started
            rate = self.done / elapsed if elapsed > 0 else 0.0
            eta = format_duration((self.total - self.done) / rate) if rate > 0 else "unknown"
            of = self._amount(self.total) if self.in_bytes else plural(self.total, *self.unit)
            self._write(
                f"{self.done * 100 // self.total}% ({self._amount(self.done)} of {of}) in "
                f"{format_duration(elapsed)}, "
                f"{self._rate(elapsed)}, ETA {eta}"
            )

    def close(self, failed: bool) -> None:
        with self.lock:
            if failed or self.total <= 0:
                return
            # closed with no error on its way: the phase is complete, whatever the increments
            # added up to (a merge counts the bytes it copies, not the shards' padding)
            self.done = self.total
            elapsed = time.monotonic() - self.started
            what = format_size(self.done) if self.in_bytes else plural(self.done, *self.unit)
            self._write(f"done, {what} in {format_duration(elapsed)}, {self._rate(elapsed)}")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(f"repack: {self.description} {text}\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed log must not stop the work
