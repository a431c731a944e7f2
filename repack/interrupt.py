"""SIGINT and SIGTERM: how a command that is told to stop stops.

SIGINT is ^C at a terminal (sent to the whole foreground process group); SIGTERM is what
``kill``, ``scancel``, and SLURM at a job's time limit or on preemption send (SLURM sends it to
every process of the job step). Both must stop ``merge``, ``add``, ``remove`` and ``verify``
within a second, whatever ``--workers`` is, with one ``Error:`` line and no traceback.

One place turns a signal into an exception: the command line runs every command inside
:func:`handle_signals`, whose handler raises :class:`Interrupted` in the main thread. From there
it is an ordinary exception: whatever started worker processes or threads stops them on its
way out (every ``except BaseException`` / ``finally`` of the write path), and the command line
prints the one line and exits ``128 + signal`` (130 for SIGINT, 143 for SIGTERM). Only the
first signal raises; later ones, while the command stops, are ignored.

The helpers for code that starts processes or threads:

* :func:`deferred` postpones the exception over a block that must not be cut in the middle
  (starting worker processes), and blocks both signals in the calling thread meanwhile, so
  that a process started there begins its life with them blocked (no ``KeyboardInterrupt``
  traceback from a child still importing modules);
* :func:`ignore_in_worker` is the first thing a worker process runs: SIGINT ignored (its
  parent stops it), SIGTERM left to its default action (the worker ends at once, silently),
  then both unblocked;
* :func:`block_in_thread` is the first thing a helper thread runs: the signals then reach
  the main thread only, which is the one that stops everything.

Library code does not install handlers itself: a program using the library gets Python's
``KeyboardInterrupt`` on ^C, which every step treats the same way (:class:`Interrupted` is a
``KeyboardInterrupt``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

__all__ = [
    "DEADLINE",
    "SIGNALS",
    "STUCK_REPORT",
    "Interrupted",
    "announce",
    "at_signal",
    "block_in_thread",
    "deferred",
    "end_now",
    "handle_signals",
    "ignore_in_worker",
    "pause",
    "received",
    "result_of",
]

#: The signals that stop a command.
SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: Seconds a command has, after the signal that stops it, to print its line: past them it is
#: ended with that line (``os._exit``), whatever it is stuck in. A safety net: every step stops
#: within a second.
DEADLINE = 5.0
#: An environment variable naming a file: when a safety net ends a command (:func:`end_now`),
#: the stack of every thread is written there first. Never set in normal use: a command that
#: needs the net is a bug, and the tests (tests/test_signals.py) set it to find where it hung.
STUCK_REPORT = "REPACK_STUCK_REPORT"
_HAVE_SIGMASK = hasattr(signal, "pthread_sigmask")


class Interrupted(KeyboardInterrupt):
    """A command was told to stop by a signal.

    A ``KeyboardInterrupt`` (a ``BaseException``): no ``except Exception`` swallows it, and
    code that stops its threads and processes on ^C does the same for SIGTERM.
    """

    def __init__(self, signum: int = signal.SIGINT) -> None:
        self.signum = int(signum)
        super().__init__(self.name)

    @property
    def name(self) -> str:
        """``SIGINT`` or ``SIGTERM``."""
        return signal_name(self.signum)

    @property
    def exit_code(self) -> int:
        """The shell's status of a process ended by the signal: 128 + its number."""
        return 128 + self.signum


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, and so on."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _State:
    def __init__(self) -> None:
        #: The first signal received while the handlers were installed.
        self.received: int | None = None
        #: Whether :class:`Interrupted` was raised for it.
        self.raised = False
        #: Depth of :func:`deferred` blocks.
        self.deferring = 0
        #: The command's line for a signal, printed by the deadline if the command has not.
        self.message: Callable[[int], str] | None = None
        #: Whether the command printed its line (:func:`announce`).
        self.announced = False
        #: Set by the handler: the deadline's thread starts counting.
        self.signalled = threading.Event()
        #: Set when the block of :func:`handle_signals` ends: the deadline is called off (what
        #: may hang after it, the command line's :func:`repack.cli._exit_soon` bounds).
        self.done = threading.Event()
        #: Run by the handler at the signal, before anything else (:func:`at_signal`).
        self.callbacks: list[Callable[[], object]] = []


_state: _State | None = None


def received() -> int | None:
    """The signal that told the running command to stop, if one did (None outside
    :func:`handle_signals`)."""
    return _state.received if _state is not None else None


def _handler(signum: int, frame) -> None:
    state = _state
    if state is None or state.received is not None:
        return  # already stopping: the first signal decides
    state.received = signum
    state.signalled.set()  # no lock the main thread could hold: only the deadline waits on it
    for callback in state.callbacks:
        callback()
    if state.deferring:
        return  # raised when the deferred block ends
    state.raised = True
    raise Interrupted(signum)


def announce() -> None:
    """The command printed its line for the signal that stops it."""
    if _state is not None:
        _state.announced = True


def _deadline(state: _State) -> None:
    """The deadline's thread: once a signal came, give the block of :func:`handle_signals`
    :data:`DEADLINE` seconds to end, then print the command's line (if it has not) and end the
    process with the signal's status."""
    block_in_thread()
    state.signalled.wait()
    signum = state.received
    if signum is None:
        return  # the command ended without a signal
    if state.done.wait(DEADLINE):
        return  # the command stopped in time
    if not state.announced and state.message is not None:
        with contextlib.suppress(Exception):
            os.write(2, f"Error: {state.message(signum)}\n".encode())
    end_now(128 + signum, f"{DEADLINE:g} s after {signal_name(signum)}")


def end_now(status: int, why: str) -> None:
    """End the process at once with ``status`` (``os._exit``: no clean-up, no waiting for
    threads), first writing every thread's stack to the file named by :data:`STUCK_REPORT`
    if it is set."""
    report = os.environ.get(STUCK_REPORT)
    if report:
        with contextlib.suppress(Exception), open(report, "a") as stream:
            stream.write(f"repack pid {os.getpid()} ended by its safety net ({why}):\n")
            stream.flush()
            faulthandler.dump_traceback(stream, all_threads=True)
    os._exit(status)


@contextlib.contextmanager
def handle_signals(message: Callable[[int], str] | None = None) -> Iterator[None]:
    """Turn SIGINT and SIGTERM into :class:`Interrupted` in the main thread for the block.

    Outside the main thread (where Python cannot install handlers) it does nothing. When the
    block ends without a signal the previous handlers come back; after a signal both stay
    ignored, since the process is then on its way out.
    """
    global _state
    if threading.current_thread() is not threading.main_thread() or _state is not None:
        yield
        return
    _state = state = _State()
    state.message = message
    watch = threading.Thread(target=_deadline, args=(state,), name="repack-deadline", daemon=True)
    watch.start()
    previous = {signum: signal.signal(signum, _handler) for signum in SIGNALS}
    try:
        yield
    finally:
        stopping = state.received is not None
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_IGN if stopping else handler)
        _state = None
        state.done.set()
        state.signalled.set()  # the deadline's thread ends


@contextlib.contextmanager
def at_signal(callback: Callable[[], object]) -> Iterator[None]:
    """Run ``callback`` in the signal handler itself, at the signal, while the block runs:
    what must happen at once even when the main thread defers the exception (telling worker
    processes to stop through a shared flag). It must take no lock and raise nothing."""
    state = _state
    if state is None:
        yield
        return
    state.callbacks.append(callback)
    try:
        yield
    finally:
        state.callbacks.remove(callback)


@contextlib.contextmanager
def deferred(mask: bool = True) -> Iterator[None]:
    """Postpone :class:`Interrupted` to the end of the block.

    With ``mask`` (the default) SIGINT and SIGTERM are also blocked in this thread meanwhile:
    processes started in the block inherit the mask. Without it the handler still runs at the
    signal (the :func:`at_signal` callbacks run at once) and only the exception waits; outside
    :func:`handle_signals`, where Python's own handler would raise ``KeyboardInterrupt``
    anywhere, the signals are blocked all the same."""
    state = _state
    if state is not None:
        state.deferring += 1
    old = None
    if _HAVE_SIGMASK and (mask or state is None):
        old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a blocked signal arrives here
        if state is not None:
            state.deferring -= 1
            if not state.deferring and state.received is not None and not state.raised:
                state.raised = True
                raise Interrupted(state.received)


#: Seconds a wait for a future lasts at most with the signals deferred (:func:`result_of`).
_SLICE = 0.2


def result_of(future: concurrent.futures.Future):
    """``future.result()``, where a signal can cut the main thread only between waits.

    A future's wait holds its lock (``threading.Condition``); :class:`Interrupted` raised
    there by the handler may leave it held, and the pool's own thread, setting the result or
    cancelling on shutdown, then waits for it for good (seen: a merge that after ^C ended only
    by its safety net). In the main thread the wait is therefore made in slices of
    ``_SLICE`` seconds with the signals deferred, so that a signal is raised at most that
    much later, outside the lock. Other threads get no signal: a plain ``result()``.
    """
    if threading.current_thread() is not threading.main_thread():
        return future.result()
    while True:
        with deferred(mask=False):
            try:
                return future.result(timeout=_SLICE)
            except concurrent.futures.TimeoutError:
                pass


def pause(seconds: float) -> None:
    """Sleep ``seconds`` (a wait before a retry): cut short in a helper thread when a signal
    stops the command, which then raises :class:`Interrupted` there too (its request is not
    tried again); in the main thread the handler raises it, as in any sleep."""
    state = _state
    if state is None or threading.current_thread() is threading.main_thread():
        time.sleep(seconds)
        return
    if state.signalled.wait(seconds) and state.received is not None:
        raise Interrupted(state.received)


def ignore_in_worker() -> None:
    """In a worker process: ignore SIGINT, take SIGTERM's default action (end at once), then
    unblock both (a parent's :func:`deferred` started the process with them blocked)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # discards a ^C that came during start-up
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _HAVE_SIGMASK:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def block_in_thread() -> None:
    """In a helper thread: block SIGINT and SIGTERM, so that they reach the main thread."""
    if _HAVE_SIGMASK:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
