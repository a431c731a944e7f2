"""What a ``repack`` command's failure becomes: one ``Error:`` line and an exit status.

This module owns the exit statuses (and the ``Exit status`` epilog every command shows), the
wrapper every command body runs in (:func:`handle_errors`), the group class that translates
what no command did (:class:`ErrorGroup`), and the routing of the library's log records to
``note:`` lines on stderr. A :class:`~repack.errors.RepackError` becomes one ``Error: ...`` line
and its exit status; so does every other exception (an unexpected one is reported as a bug,
status ``EXIT_INTERNAL``): none reaches click, which would print a traceback or, for EOFError,
KeyboardInterrupt and click.Abort, a bare ``Aborted!``. Under ``--json`` the error is also
printed on stdout, as JSON.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import NoReturn

import click

from repack import __version__, interrupt
from repack.cli.output import print_json
from repack.errors import RepackError

__all__ = [
    "EXIT_CODES",
    "EXIT_DAMAGED",
    "EXIT_INPUT",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "ErrorGroup",
    "handle_errors",
]

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE, EXIT_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
#: Stopped by SIGTERM (kill, scancel, SLURM's time limit): 128 + 15, as the shell reports it.
EXIT_TERMINATED = 143
#: An exception repack did not expect: a bug (the ``EX_SOFTWARE`` of sysexits.h).
EXIT_INTERNAL = 70

EXIT_CODES = """\b
Exit status: 0 success; 1 verification found damage; 2 usage error;
3 bad input, refused, or unreadable (credentials, network, a missing bucket; the message
says which file and why); 130 interrupted (SIGINT, ^C); 143 terminated (SIGTERM);
70 internal error (a bug in repack: please report the Error line)."""


_WRITE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def _target(params: dict) -> str | None:
    """The output of a command, from its parameters: DEST_PREFIX, else OUT."""
    if params.get("dest_prefix"):
        return str(params["dest_prefix"])
    if params.get("out"):
        return str(params["out"])
    paths = params.get("paths")
    return str(paths[-1]) if paths else None


def handle_errors(command: Callable) -> Callable:
    """Turn every exception of a command into one ``Error:`` line and an exit status."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            with _notes(quiet=bool(kwargs.get("quiet"))):
                return command(*args, **kwargs)
        except BaseException as err:
            _exit_for(err, click.get_current_context().command_path, kwargs)

    return wrapper


class _NoteFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"note: {record.getMessage()}"


@contextlib.contextmanager
def _notes(quiet: bool):
    """What the library logs (a lock taken over from a killed writer, a cache it could not
    write) goes to stderr as ``note: ...`` lines while a command runs; ``--quiet`` silences
    them (errors are never silenced)."""
    logger = logging.getLogger("repack")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_NoteFormatter())
    handler.setLevel(logging.CRITICAL + 1 if quiet else logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _exit_for(err: BaseException, command: str, params: Mapping) -> NoReturn:
    """Print one ``Error:`` line for ``err``, raised running ``command`` with ``params``, and
    exit with its status (under ``--json``, also the error as JSON on stdout). click's own
    exceptions (usage errors, ``--help``, exits) and ``SystemExit`` are raised again, for
    click."""
    if isinstance(err, (click.ClickException, click.exceptions.Exit, SystemExit)):
        raise err
    signum = interrupt.received()  # a signal decides, whatever it made fail on the way
    if signum is not None or isinstance(err, (KeyboardInterrupt, click.Abort)):
        signum = signum or getattr(err, "signum", signal.SIGINT)
        if interrupt.received() is not None:
            interrupt.announce()  # the line is printed: the deadline need not print it
            _exit_soon(128 + signum)
        _fail(_interrupted(signum, command), 128 + signum, params, None, err)
    if isinstance(err, RepackError):
        _fail(str(err), err.exit_code, params, err.path, err)
    if isinstance(err, BrokenPipeError):
        # stdout closed early (`repack inspect out | head`): not an error
        sys.stderr.close()
        sys.exit(EXIT_OK)
    if isinstance(err, OSError):
        # an error of a write through a descriptor (a full disk) carries no file name:
        # name what the command was writing
        name = err.filename or _target(params)
        where = f"{name}: " if name else ""
        what = "cannot write: " if err.errno in _WRITE_ERRNOS else ""
        _fail(f"{where}{what}{err.strerror or err}", EXIT_INPUT, params, name, err)
    if not isinstance(err, Exception):  # GeneratorExit and the like: not ours to translate
        raise err
    target = _target(params)
    cause = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    _fail(
        f"{command}{f' {target}' if target else ''}: internal error, {cause} "
        f"(at {_where(err)}); this is a bug in repack {__version__}, please report it",
        EXIT_INTERNAL,
        params,
        target,
        err,
    )


def _fail(
    message: str, status: int, params: Mapping, path: str | None, err: BaseException
) -> NoReturn:
    """Exit with ``status`` after ``Error: message`` on stderr, and under ``--json`` the error
    as a JSON object on stdout (:func:`_error_json`)."""
    if params.get("as_json"):
        try:
            print_json({"error": _error_json(message, status, path, err)})
        except OSError:
            pass  # stdout is gone too: the Error line still says it
    click.echo(f"Error: {message}", err=True)
    sys.exit(status)


def _error_json(message: str, status: int, path: str | None, err: BaseException) -> dict:
    """``{"message", "status", "path", "type"}``, and for several bad sources ``"errors"``:
    one such object (without status) per source."""
    data = {
        "message": message,
        "status": status,
        "path": None if path is None else os.fsdecode(path),
        "type": type(err).__name__,
    }
    for each in getattr(err, "errors", None) or ():
        data.setdefault("errors", []).append(
            {"message": str(each), "path": each.path, "type": type(each).__name__}
        )
    return data


def _exit_soon(status: int, after: float = 2.0) -> None:
    """End the process ``after`` seconds from now at the latest: what the interpreter waits
    for at exit (the threads of a process pool whose workers a SIGTERM killed) must not keep
    an interrupted command alive. The normal exit comes first, but for that."""
    timer = threading.Timer(after, interrupt.end_now, (status, f"{after:g} s after its Error line"))
    timer.daemon = True
    timer.start()


def _interrupted(signum: int, command: str) -> str:
    """The message of a command stopped by ``signum``: what a rerun does."""
    name = interrupt.signal_name(signum)
    verb = command.rsplit(" ", 1)[-1]
    if verb in ("merge", "add", "remove"):
        return f"interrupted ({name}) — rerun the same command to resume"
    if verb == "verify":
        return f"interrupted ({name}) — nothing was changed; rerun the same command to verify"
    return f"interrupted ({name})"


def _where(err: BaseException) -> str:
    """``file:line`` where ``err`` was raised: the innermost frame in repack's code if there
    is one (else the innermost), the file relative to the package's parent folder."""
    frames = traceback.extract_tb(err.__traceback__)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # repack/
    ours = [f for f in frames if os.path.abspath(f.filename).startswith(package + os.sep)]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return "an unknown place"
    name = (
        os.path.relpath(frame.filename, os.path.dirname(package))
        if ours
        else os.path.basename(frame.filename)
    )
    return f"{name}:{frame.lineno}"


class ErrorGroup(click.Group):
    """The ``repack`` group: an exception that no command translated (one raised while its
    options are parsed, or by a command without ``handle_errors``) is translated here."""

    def invoke(self, ctx: click.Context):
        def stopping(signum: int) -> str:  # the line, should the command not stop in time
            return _interrupted(signum, f"{ctx.command_path} {ctx.invoked_subcommand or ''}")

        with interrupt.handle_signals(stopping):  # SIGINT, SIGTERM: Interrupted
            try:
                return super().invoke(ctx)
            except BaseException as err:
                _exit_for(err, f"{ctx.command_path} {ctx.invoked_subcommand or ''}".rstrip(), {})
