"""The ``repack`` command line. Thin: it parses options, calls the library, prints results.

Results go to stdout (``--json`` for machines); progress bars and errors go to stderr. A
:class:`~repack.errors.RepackError` becomes one ``Error: ...`` line and its exit status; so does
every other exception (an unexpected one is reported as a bug, status ``EXIT_INTERNAL``): none
reaches click, which would print a traceback or, for EOFError, KeyboardInterrupt and
click.Abort, a bare ``Aborted!``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from importlib.util import find_spec
from typing import NoReturn

import click

from repack import __version__, interrupt
from repack.checksum import ALGORITHMS, DEFAULT
from repack.errors import RepackError
from repack.format import ALIGNMENT
from repack.progress import Display
from repack.units import format_duration, format_size, parse_duration, parse_size, plural

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


def _handle_errors(command: Callable) -> Callable:
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
            _print_json({"error": _error_json(message, status, path, err)})
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


class _Group(click.Group):
    """The ``repack`` group: an exception that no command translated (one raised while its
    options are parsed, or by a command without ``_handle_errors``) is translated here."""

    def invoke(self, ctx: click.Context):
        def stopping(signum: int) -> str:  # the line, should the command not stop in time
            return _interrupted(signum, f"{ctx.command_path} {ctx.invoked_subcommand or ''}")

        with interrupt.handle_signals(stopping):  # SIGINT, SIGTERM: Interrupted
            try:
                return super().invoke(ctx)
            except BaseException as err:
                _exit_for(err, f"{ctx.command_path} {ctx.invoked_subcommand or ''}".rstrip(), {})


def _memory(value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def _duration(ctx, param, value: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


#: ``--keep-superseded``, of every command that edits a repack.
_keep_superseded = click.option(
    "--keep-superseded",
    "keep_superseded",
    default="1d",
    show_default=True,
    metavar="DURATION",
    callback=_duration,
    help="On object storage: keep the objects this edit replaces this long for the readers "
    "that opened the repack before it; the first edit after that (or `repack gc`) deletes "
    "them. 12h, 30m, 0... (In a folder they are deleted at once: open files stay readable.)",
)


def _superseded_note(collected, out: str) -> str | None:
    """What an edit on object storage did with what it replaced, in one line (None: nothing
    to say, as in a folder)."""
    from repack.generations import utc

    said = []
    if collected.kept is not None:
        kept = collected.kept
        said.append(
            f"kept the {plural(len(kept.objects), 'replaced object')} "
            f"({format_size(kept.size)}) for readers that opened the repack before: they are "
            f"deleted by the first edit after {utc(kept.at + collected.keep)}, or by "
            f"`repack gc {out} --older-than 0`"
        )
    if collected.deleted:
        n = sum(len(g.objects) for g in collected.deleted)
        said.append(
            f"deleted {plural(n, 'superseded object')} ({format_size(collected.deleted_bytes)}) "
            f"of {plural(len(collected.deleted), 'earlier edit')}"
            + (": readers that opened the repack before fail" if collected.keep == 0 else "")
        )
    return "; ".join(said) or None


def _size(ctx, param, value: str) -> int:
    try:
        size = parse_size(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    if size < ALIGNMENT:
        raise click.BadParameter(
            f"{value!r} is {size} bytes; a shard holds at least {ALIGNMENT} bytes "
            "(the alignment of its segments)"
        )
    return size


def _codec(value: str | None) -> tuple[str, int] | None:
    from repack.codec import parse_codec

    if value is None:
        return None
    try:
        return parse_codec(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def _print_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def _table(rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


@click.group(
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(
    __version__,
    prog_name="repack",
    # whether repack/_hashes.c and repack/_blending.c were built (setup.py): document
    # fingerprints 10-20x faster, Megatron's blending index in O(log sources) a sample
    message="%(prog)s, version %(version)s; document hashing: "
    + ("compiled" if find_spec("repack._hashes") else "Python (repack._hashes not built)")
    + "; blending index: "
    + ("compiled" if find_spec("repack._blending") else "Python (repack._blending not built)"),
)
def main() -> None:
    """Consolidate a Megatron-LM training blend into a few shards, losslessly.

    A blend of hundreds of tokenized Megatron prefixes (X.bin + X.idx) makes every training
    process open hundreds of files and mmaps. `repack merge` copies them once into a few large
    shards with one combined index and a per-source table; training then opens only those.

    \b
    Typical use:
      repack merge blend.json /lustre/me/blend.repack     # consolidate
      repack verify /lustre/me/blend.repack               # prove it intact
      repack inspect /lustre/me/blend.repack              # what is in it
      repack extract /lustre/me/blend.repack data/web/cc-00017 /tmp/cc-00017

    A repack may also live in object storage: OUT as s3://BUCKET/KEY or msc://PROFILE/PATH
    (pip install 'megatron-repack[s3]'; docs/objstore.md).

    Run `repack COMMAND --help` for details of each command.
    """


def _slurm_task() -> tuple[int, int] | None:
    """(task, tasks) of a SLURM array job, if this runs in one."""
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    if task is None:
        return None

    def number(name: str, default: str | None = None) -> int:
        value = os.environ.get(name, default)
        try:
            return int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise click.UsageError(
                f"${name} is {value!r}, expected an integer; pass --task I --tasks N"
            ) from None

    first = number("SLURM_ARRAY_TASK_MIN", "0")
    step = max(1, number("SLURM_ARRAY_TASK_STEP", "1"))
    if "SLURM_ARRAY_TASK_COUNT" in os.environ:
        count = number("SLURM_ARRAY_TASK_COUNT")
    else:
        count = (number("SLURM_ARRAY_TASK_MAX") - first) // step + 1
    array_id = number("SLURM_ARRAY_TASK_ID")
    task, rest = divmod(array_id - first, step)
    if rest or not 0 <= task < count:
        # an index list such as --array=1,5,7: its ids do not number the tasks 0..N-1
        raise click.UsageError(
            f"SLURM array task id {array_id} is not one of {count} evenly spaced ids from "
            f"{first} by {step}; submit the array as --array=0-{count - 1}, or pass "
            "--task I --tasks N"
        )
    return task, count


def _print_result(result, as_json: bool, verb: str) -> None:
    if as_json:
        _print_json(
            {
                "out": result.out,
                "shards": result.shards,
                "sources": result.sources,
                "bytes": result.bytes,
                "seconds": round(result.seconds, 3),
                "resumed_shards": result.resumed_shards,
            }
        )
        return
    rate = result.bytes / result.seconds if result.seconds > 0 else 0
    done = result.resumed_shards
    were = "was" if done == 1 else "were"
    resumed = f"; {plural(done, 'shard')} {were} already done" if done else ""
    click.echo(
        f"{verb} {plural(result.sources, 'source')} ({format_size(result.bytes)}) into "
        f"{plural(result.shards, 'shard')} in {result.out} in {result.seconds:.1f} s "
        f"({format_size(rate)}/s){resumed}"
    )


@main.command(epilog=EXIT_CODES)
@click.argument("paths", nargs=-1, required=True, metavar="[BLEND] OUT")
@click.option(
    "--shard-size",
    default="64GiB",
    show_default=True,
    callback=_size,
    metavar="SIZE",
    help="Largest shard file (64GiB, 500MB, bytes...). Sources never straddle shards unless "
    "larger than a whole shard; a sequence never does.",
)
@click.option(
    "--checksum",
    type=click.Choice(ALGORITHMS),
    default=DEFAULT,
    show_default=True,
    help="Checksum algorithm; sha256 is cryptographic but about 10x slower.",
)
@click.option(
    "--compress",
    "compress",
    metavar="zstd[:LEVEL]",
    callback=lambda c, p, v: _codec(v),
    help="Store shards as independently decompressible zstd frames (level 3 by default). "
    "Smaller to store and ship; the loader decompresses on read. Raw is the default.",
)
@click.option(
    "--no-fingerprints",
    is_flag=True,
    help="Do not store document fingerprints (a 64-bit hash of every document, from which "
    "`repack doctor` reports duplicates without reading tokens).",
)
@click.option("--force", is_flag=True, help="Replace a repack (or an unfinished merge) in OUT.")
@click.option("--dry-run", is_flag=True, help="Validate the sources and print the plan only.")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="K",
    help="Copy up to K shards at once, in K processes.",
)
@click.option(
    "--plan-only",
    is_flag=True,
    help="Validate, plan and write the index into OUT; copy nothing. Then run the tasks.",
)
@click.option(
    "--task",
    type=click.IntRange(min=0),
    metavar="I",
    help="With OUT only: copy the shards of task I (shard k when k % N == I). Defaults to "
    "$SLURM_ARRAY_TASK_ID in a SLURM array job.",
)
@click.option(
    "--tasks",
    type=click.IntRange(min=1),
    metavar="N",
    help="With --task: the number of tasks. Defaults to the array size in a SLURM array job.",
)
@click.option(
    "--finalize", is_flag=True, help="With OUT only: write the manifest when every shard is done."
)
@click.option(
    "--resume",
    is_flag=True,
    help="With OUT only: finish an interrupted merge (all remaining tasks, then finalize).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output or notes.")
@_handle_errors
def merge(
    paths,
    shard_size,
    checksum,
    compress,
    no_fingerprints,
    force,
    dry_run,
    workers,
    plan_only,
    task,
    tasks,
    finalize,
    resume,
    as_json,
    quiet,
) -> None:
    """Consolidate every source of BLEND into the repack folder OUT.

    BLEND is a blend file in any form Megatron users have: a JSON `--data-path` list
    ([0.3, "path/a", 0.7, "path/b"] or bare prefixes), a JSON per-split object
    ({"train": [...], "valid": [...], "test": [...]}), a `--data-args-path` text file
    (w1 p1 w2 p2 ...), the Megatron-Core config forms [[prefixes], [weights]] and
    {"blend_per_split": [...]}, NeMo's paths dict ({"train": ..., "validation": ...}), or a
    whole NeMo or Megatron-Bridge training config (JSON, or YAML with PyYAML) holding one.
    Relative prefixes resolve against BLEND's folder.

    Every source is validated before anything is written. Sources of different token dtypes
    go to different shards (values are never converted). The manifest is written last and
    atomically: an interrupted merge leaves no folder that looks complete, and running the
    same command again resumes it, skipping the shards already done.

    A merge can be split over many machines sharing the file system: `--plan-only` once, then
    `repack merge OUT --task I --tasks N` for every I (any order, any node; a SLURM array job
    sets I and N), then `repack merge OUT --finalize`.

    \b
    Examples:
      repack merge blend.json out/
      repack merge --shard-size 16GiB --dry-run per_split.json out/
      repack merge --workers 4 blend.json out/
      repack merge --plan-only blend.json out/ && repack merge out/ --task 0 --tasks 2 \\
        && repack merge out/ --task 1 --tasks 2 && repack merge out/ --finalize
    """
    from repack import merge as m

    bars = Display(quiet)
    try:
        if len(paths) == 2:
            if task is not None or tasks is not None or finalize or resume:
                raise click.UsageError("--task, --tasks, --finalize and --resume take OUT only")
            blend, out = paths
            prepared = m.prepare(
                blend,
                shard_size=shard_size,
                algorithm=checksum,
                codec=compress,
                fingerprints=not no_fingerprints,
                progress=bars,
            )
            if dry_run:
                bars.close()
                _print_plan(prepared.describe(), as_json)
                return
            if plan_only:
                prepared, state = m.plan_merge(prepared, out, overwrite=force)
                bars.close()
                n_sources, n_shards = len(prepared.sources), len(prepared.plan.shards)
                if as_json:
                    _print_json(
                        {"out": out, "state": state, "sources": n_sources, "shards": n_shards}
                    )
                elif state == "complete":
                    click.echo(f"{out} already holds this merge, finished; nothing to do")
                else:
                    click.echo(
                        f"{'plan already in' if state == 'resumed' else 'planned'} {out}: "
                        f"{plural(n_sources, 'source')}, {plural(n_shards, 'shard')}; now run "
                        f"'repack merge {out} --task I --tasks N', then --finalize"
                    )
                return
            result = m.execute(prepared, out, overwrite=force, workers=workers, progress=bars)
            bars.close()
            _print_result(result, as_json, "merged")
            return
        if len(paths) != 1:
            raise click.UsageError("expected BLEND OUT, or OUT with --task, --finalize or --resume")
        (out,) = paths
        if dry_run or plan_only:
            raise click.UsageError("--dry-run and --plan-only need BLEND OUT")
        if finalize:
            result = m.finalize(out, progress=bars)
            bars.close()
            _print_result(result, as_json, "finalized")
            return
        if resume:
            result = m.resume(out, workers=workers, progress=bars)
            bars.close()
            _print_result(result, as_json, "merged")
            return
        if task is None and tasks is None:
            slurm = _slurm_task()
            if slurm is None:
                raise click.UsageError("OUT alone needs --task I --tasks N, --finalize or --resume")
            task, tasks = slurm
        if task is None or tasks is None:
            raise click.UsageError("--task and --tasks go together")
        copied, skipped = m.run_task(out, task, tasks, workers=workers, progress=bars)
        bars.close()
        if as_json:
            _print_json(
                {"out": out, "task": task, "tasks": tasks, "copied": copied, "skipped": skipped}
            )
        else:
            click.echo(
                f"task {task} of {tasks}: copied {plural(copied, 'shard')}, {skipped} already done"
            )
    finally:
        bars.close()


def _print_plan(plan: dict, as_json: bool) -> None:
    if as_json:
        _print_json(plan)
        return
    rows = [["shard", "dtype", "size", "sources"]]
    for shard in plan["shards"]:
        rows.append(
            [shard["file"], shard["dtype"], format_size(shard["size"]), str(len(shard["sources"]))]
        )
    click.echo(_table(rows, right={2, 3}))
    click.echo(
        f"dry run: {plural(plan['sources'], 'source')}, {format_size(plan['total_bytes'])} "
        f"into {plural(len(plan['shards']), 'shard')}; nothing written"
    )


@main.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@click.argument("blend", type=click.Path(dir_okay=False))
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="K",
    help="Copy up to K new shards at once, in K processes.",
)
@_keep_superseded
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output or notes.")
@_handle_errors
def add(out, blend, workers, keep_superseded, as_json, quiet) -> None:
    """Add the sources of BLEND that the repack OUT does not hold yet.

    New sources go to new shards: existing shards are not rewritten. The manifest is replaced
    atomically, so readers see the old repack or the new one, never a mix. Sources already in
    the repack are skipped (an error if their content changed).

    \b
    Example:
      repack add out/ more_sources.json
    """
    from repack.append import add as run

    bars = Display(quiet)
    try:
        result = run(out, blend, workers=workers, keep_superseded=keep_superseded, progress=bars)
    finally:
        bars.close()
    _print_result(result, as_json, "added")


@main.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@click.argument("sources", nargs=-1, metavar="SOURCE...")
@click.option(
    "--blend",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Also remove every source this blend file names.",
)
@click.option(
    "--dry-run", is_flag=True, help="Show which shards would be rewritten; change nothing."
)
@_keep_superseded
@click.option(
    "--now",
    is_flag=True,
    help="On object storage: delete the replaced shards, and every superseded object kept "
    "from earlier edits, at once (a take-down). Readers that opened the repack before then "
    "fail, and their error names this remove.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output or notes.")
@_handle_errors
def remove(out, sources, blend, dry_run, keep_superseded, now, as_json, quiet) -> None:
    """Remove SOURCE... from the repack OUT: their bytes leave every file of OUT.

    SOURCE is a prefix as written in the blend, or its absolute path. Each shard holding a
    removed source is rewritten, under a new name, without it; shards that keep nothing are
    dropped; other shards are not touched. The manifest is replaced atomically: readers see
    the old repack or the new one, and a process that opened the repack before keeps reading
    it. In a folder the old shards are deleted at once (open files stay readable); on object
    storage they are kept for --keep-superseded (a day), then deleted by the next edit or by
    `repack gc`; --now deletes them at once. Killed at any point, OUT is a complete repack,
    old or new; run the command again to finish.

    \b
    Examples:
      repack remove out/ data/web/cc-00017
      repack remove --dry-run out/ --blend withdrawn.json
      repack remove --now s3://datasets/web.repack data/web/cc-00017   # a take-down
    """
    from repack.remove import remove as run

    bars = Display(quiet)
    try:
        result = run(
            out,
            sources,
            blend=blend,
            dry_run=dry_run,
            keep_superseded=0.0 if now else keep_superseded,
            now=now,
            progress=bars,
        )
    finally:
        bars.close()
    if as_json:
        _print_json({**result.to_json(), "dry_run": dry_run})
        return
    info = result.plan.describe()
    if dry_run:
        rows = [["shard", "becomes", "keeps", "removes"]]
        for shard in info["rewritten"]:
            rows.append(
                [
                    shard["file"],
                    shard["new_file"] or "(dropped)",
                    format_size(shard["kept_bytes"]),
                    format_size(shard["removed_bytes"]),
                ]
            )
        if len(rows) > 1:
            click.echo(_table(rows, right={2, 3}))
        click.echo(
            f"dry run: would remove {plural(len(info['removed']), 'source')} "
            f"({format_size(info['removed_bytes'])}), rewrite "
            f"{plural(len(info['rewritten']), 'shard')} "
            f"({format_size(info['bytes_to_write'])} to write) and leave "
            f"{info['untouched_shards']} untouched; nothing written"
        )
        return
    if info["already_removed"]:
        click.echo(
            f"{plural(len(info['already_removed']), 'source')} already removed by an "
            "interrupted run, "
            "which is now finished"
        )
    if info["removed"]:
        dropped = sum(1 for s in info["rewritten"] if s["new_file"] is None)
        click.echo(
            f"removed {plural(len(info['removed']), 'source')} "
            f"({format_size(info['removed_bytes'])}) from {out}: rewrote "
            f"{plural(len(info['rewritten']) - dropped, 'shard')} "
            f"({format_size(info['bytes_to_write'])}), dropped {dropped}; "
            f"{plural(info['remaining_sources'], 'source')} "
            f"{'remains' if info['remaining_sources'] == 1 else 'remain'} ({result.seconds:.1f} s)"
        )
    note = _superseded_note(result.superseded, out)
    if note:
        click.echo(note)


@main.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--sources",
    "with_sources",
    is_flag=True,
    help="Also re-read the original prefixes, where they still exist, and prove them "
    "byte-identical to what the repack holds.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    metavar="K",
    help="Hash up to K shards at once, in threads; the report is the same for any K. "
    "[default: the number of CPUs, at most 4]",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or log lines.")
@_handle_errors
def verify(out, with_sources, workers, as_json, quiet) -> None:
    """Recompute every checksum of the repack OUT and report any damage.

    Checks the manifest, the index (and each source's entries in it against its original
    .idx), every shard, and each source's bytes in the shards against its original .bin.
    Each problem names the damaged file and the sources it affects. Exits 0 only when
    everything holds, 1 when a file is damaged or missing; a repack that cannot be read at
    all (credentials, an endpoint that does not answer, a missing bucket) is an Error line
    and exit 3, not damage.

    \b
    Examples:
      repack verify out/
      repack verify --sources --json out/ > report.json
    """
    from repack.verify import verify as run

    bars = Display(quiet)
    try:
        report = run(out, sources=with_sources, workers=workers, progress=bars)
    finally:
        bars.close()
    if as_json:
        _print_json(report.to_json())
    else:
        for problem in report.problems:
            click.echo(f"FAIL {problem}")
        summary = (
            f"{plural(report.files, 'file')}, {format_size(report.bytes)}, "
            f"{plural(report.sources, 'source')}"
        )
        if with_sources:
            compared = plural(report.originals_compared, "original")
            summary += f"; {compared} compared byte for byte" + (
                f", {len(report.originals_missing)} no longer "
                f"{'exists' if len(report.originals_missing) == 1 else 'exist'}"
                if report.originals_missing
                else ""
            )
        n = len(report.problems)
        verdict = "OK" if report.ok else f"DAMAGED ({plural(n, 'problem')})"
        click.echo(f"{verdict}: {summary}")
    if not report.ok:
        sys.exit(EXIT_DAMAGED)


@main.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@_keep_superseded
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress output.")
@_handle_errors
def fingerprint(out, keep_superseded, as_json, quiet) -> None:
    """Add document fingerprints to the repack OUT, reading its shards.

    For a repack written without them (by repack 0.1.0, or `merge --no-fingerprints`), or
    whose fingerprint file is damaged: every document of every source is hashed (XXH3-64 of
    its tokens) into a new fingerprint file, then the manifest is replaced atomically.
    `repack doctor` then reports duplicate data without reading tokens.

    \b
    Example:
      repack fingerprint out/
    """
    from repack.merge.fingerprint_file import fingerprint as run

    bars = Display(quiet)
    try:
        member = run(out, keep_superseded=keep_superseded, progress=bars)
    finally:
        bars.close()
    if as_json:
        _print_json({"out": out, **member})
    else:
        click.echo(
            f"wrote {member['file']}: {member['documents']:,} documents of "
            f"{member['sources']:,} sources"
        )


@main.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--older-than",
    default="1d",
    show_default=True,
    metavar="DURATION",
    callback=_duration,
    help="Delete what was superseded at least this long ago: 12h, 30m, 0 (all of it, now).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_handle_errors
def gc(out, older_than, as_json) -> None:
    """Delete the objects earlier edits of the repack OUT replaced, and what killed edits left.

    On object storage, `add`, `remove` and `fingerprint` do not delete the objects they
    replace: readers that opened the repack before the edit keep reading them. The first edit
    after their grace period (--keep-superseded, a day) deletes them; this deletes those
    superseded at least --older-than ago, now. A reader still reading one then fails, its
    error naming the edit. `repack inspect OUT` lists what is kept. In a folder, edits delete
    what they replace at once (open files stay readable), and this removes only what killed
    edits left.

    \b
    Examples:
      repack gc s3://datasets/web.repack                 # what is older than a day
      repack gc s3://datasets/web.repack --older-than 0  # everything superseded, now
    """
    from repack.generations import utc
    from repack.merge.edit import gc as run
    from repack.store import open_store

    done = run(out, older_than)
    if as_json:
        _print_json({"out": out, "older_than_seconds": older_than, **done.to_json()})
        return
    if open_store(out).deleted_stays_readable:
        click.echo(
            f"nothing superseded: {out} is a folder, whose edits delete what they replace at "
            "once (open files stay readable)"
        )
        return
    n = sum(len(g.objects) for g in done.deleted)
    line = (
        f"deleted {plural(n, 'superseded object')} ({format_size(done.deleted_bytes)}) of "
        f"{plural(len(done.deleted), 'edit')}"
    )
    if done.pending:
        kept = sum(g.size for g in done.pending)
        line += (
            f"; kept {plural(sum(len(g.objects) for g in done.pending), 'object')} "
            f"({format_size(kept)}) superseded less than {format_duration(older_than)} ago (the "
            f"oldest, by `repack {done.pending[0].edit}` at {utc(done.pending[0].at)})"
        )
    click.echo(line)
    for key in done.damaged:
        click.echo(f"warning: {key}: not a readable record of superseded objects; left alone")


@main.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
@_handle_errors
def inspect(out, as_json) -> None:
    """Show what the repack OUT holds: sources, splits, weights, counts, shards, totals.

    Only the manifest and index are read (structure is checked, checksums are not: use
    `repack verify` for that).
    """
    from repack.doctor.findings import inspect_summary
    from repack.reader import Repack
    from repack.summary import summarize, superseded_summary

    info = summarize(Repack(out).manifest)
    info["duplicates"] = inspect_summary(out)
    info["superseded"] = superseded_summary(out)
    if as_json:
        _print_json(info)
        return
    rows = [["id", "prefix", "splits", "dtype", "tokens", "sequences", "documents", "shard"]]
    for s in info["sources"]:
        splits = ",".join(
            u["split"] + ("" if u["weight"] is None else f":{u['weight']:g}") for u in s["splits"]
        )
        dtype = s["dtype"] + ("+mm" if s["multimodal"] else "")
        shards = ",".join(str(n) for n in s["shards"])
        rows.append(
            [
                str(s["id"]),
                s["prefix"],
                splits,
                dtype,
                f"{s['tokens']:,}",
                f"{s['sequences']:,}",
                f"{s['documents']:,}",
                shards,
            ]
        )
    click.echo(_table(rows, right={0, 4, 5, 6}))
    d = info["duplicates"]
    click.echo("")
    if not d["available"]:
        click.echo(f"duplicates: {d['reason']}")
    else:
        click.echo(
            f"duplicates (exact, from fingerprints): {d['repeated_documents']:,} of "
            f"{d['nonempty_documents']:,} documents repeat another in their source "
            f"({d['repeated_tokens']:,} tokens); {d['identical_sources']:,} identical sources; "
            f"{d['source_pairs_sharing']:,} pairs of sources share documents"
        )
        for problem in d["problems"]:
            click.echo(f"  [{problem['code']}] {problem['message']}")
    for g in info["superseded"]:
        if g["deleted_at"] is None:
            click.echo(
                f"superseded by `repack {g['edit']}` at {g['at_utc']}: "
                f"{plural(len(g['objects']), 'object')} ({format_size(g['bytes'])}) kept for "
                f"readers of the older version (`repack gc {out}` deletes them)"
            )
    t = info["totals"]
    added = "".join(f", added {b['source']} ({b['form']})" for b in info["appended"])
    click.echo(
        f"\ntotal: {plural(t['sources'], 'source')}, "
        f"{plural(t['tokens'], 'token', grouped=True)}, "
        f"{plural(t['sequences'], 'sequence', grouped=True)}, "
        f"{plural(t['documents'], 'document', grouped=True)} in {plural(t['shards'], 'shard')}, "
        f"{format_size(t['bytes'])}; blend {info['blend']['source']} ({info['blend']['form']})"
        f"{added}"
    )


@main.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@click.argument("source")
@click.argument("dest_prefix", type=click.Path())
@click.option("--force", is_flag=True, help="Replace existing DEST_PREFIX.bin/.idx.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or log lines.")
@_handle_errors
def extract(out, source, dest_prefix, force, as_json, quiet) -> None:
    """Write SOURCE of the repack OUT to DEST_PREFIX.bin/.idx, byte-identical to the original.

    SOURCE is the prefix exactly as written in the blend, or its absolute path. A
    DEST_PREFIX that is a folder (one that exists, or any path ending in /) means the
    source's base name in that folder. Both files are checked against the checksums of the
    originals recorded at merge time before they are renamed into place.

    \b
    Examples:
      repack extract out/ data/web/cc-00017 restored/cc-00017
      repack extract out/ data/web/cc-00017 restored/     # restored/cc-00017.bin, .idx
    """
    from repack.extract import destination
    from repack.extract import extract as run

    bars = Display(quiet)
    try:
        entry = run(out, source, dest_prefix, overwrite=force, progress=bars)
    finally:
        bars.close()
    dest = destination(dest_prefix, entry.name)
    if as_json:
        _print_json(
            {
                "source": entry.name,
                "bin": f"{dest}.bin",
                "idx": f"{dest}.idx",
                "bin_size": entry.bin_size,
                "idx_size": entry.idx_size,
            }
        )
        return
    click.echo(f"wrote {dest}.bin ({format_size(entry.bin_size)}) and {dest}.idx for {entry.name}")


def _release(value: str | None) -> tuple[int, int] | None:
    from repack.releases import release_of

    if value is None:
        return None
    if not re.fullmatch(r"\s*\d+\.\d+(\.\d+)?\s*", value):
        raise click.BadParameter(f"{value!r}: expected a release such as 0.12 or 0.16.1")
    return release_of(value)


def _split(ctx, param, value: str) -> str:
    from repack.model.arithmetic import parse_split

    try:
        parse_split(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    return value


def _samples(ctx, param, value: str | None) -> tuple[int, int, int] | None:
    if value is None:
        return None
    parts = value.split(",")
    try:
        numbers = tuple(int(part) for part in parts)
    except ValueError:
        numbers = ()
    if len(numbers) != 3 or min(numbers) < 0:
        raise click.BadParameter(f"{value!r}: expected TRAIN,VALID,TEST, three integers >= 0")
    return numbers  # type: ignore[return-value]


DOCTOR_EXIT = """\b
Exit status: 0 nothing would stop or hang training (warnings may be shown);
1 a problem would stop or hang training; 2 usage error; 3 bad input (the message says
which file and why)."""


def _options(*decorators: Callable) -> Callable:
    """Apply option decorators in the order written (click lists them in --help so)."""

    def apply(command: Callable) -> Callable:
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


def _run_options(required: bool) -> Callable:
    """Megatron-LM's flags that size a run's datasets, shared by `doctor` and `trace`
    (``--seq-length`` required unless a checkpoint may give it)."""
    return _options(
        click.option(
            "--seq-length",
            type=click.IntRange(min=2),
            required=required,
            help="Megatron's --seq-length.",
        ),
        click.option(
            "--split",
            default="969, 30, 1",
            show_default=True,
            callback=_split,
            help="Megatron's --split, for a flat blend (the default is Megatron-LM's own); "
            "per-split blends ignore it, as Megatron does.",
        ),
        click.option(
            "--train-samples", type=click.IntRange(min=0), help="Megatron's --train-samples."
        ),
        click.option("--train-iters", type=click.IntRange(min=0), help="Megatron's --train-iters."),
        click.option(
            "--global-batch-size",
            type=click.IntRange(min=1),
            help="Megatron's --global-batch-size.",
        ),
        click.option(
            "--eval-iters",
            type=click.IntRange(min=0),
            default=100,
            show_default=True,
            help="Megatron's --eval-iters.",
        ),
        click.option(
            "--eval-interval",
            type=click.IntRange(min=1),
            default=1000,
            show_default=True,
            help="Megatron's --eval-interval.",
        ),
    )


_RUN_OPTIONS = _run_options(required=True)


_SURPLUS_OPTION = click.option(
    "--mid-level-dataset-surplus",
    "surplus",
    type=click.FloatRange(min=0),
    default=0.005,
    show_default=True,
    help="Megatron's --mid-level-dataset-surplus.",
)
_BLEND_OPTION = click.option(
    "--blend",
    "blend_file",
    type=click.Path(dir_okay=False),
    help="With a repack: look up this blend file's prefixes in it, as the loader does, "
    "instead of the blend recorded at merge time.",
)


@main.command(epilog=DOCTOR_EXIT)
@click.argument("target", metavar="[BLEND_OR_REPACK]", type=click.Path(), required=False)
@_RUN_OPTIONS
@click.option(
    "--samples",
    callback=_samples,
    metavar="TRAIN,VALID,TEST",
    help="The samples asked of each split, as given to Megatron-Core's "
    "BlendedMegatronDatasetBuilder (Megatron-Bridge, NeMo); instead of the options above.",
)
@_SURPLUS_OPTION
@_BLEND_OPTION
@click.option(
    "--phases",
    "phases_file",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="A phase schedule (JSON: global_batch_size, and per phase its blend and "
    "start_iteration, as Megatron-LM's --phase-transition-iterations): show, per phase and "
    "source, the documents an earlier phase already trained on, stock and with repack's "
    "continuation. BLEND_OR_REPACK is then the repack holding the phases' sources, or left out "
    "(the blends' prefixes are read).",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0),
    help="Megatron's --seed (with --phases; default: the schedule's seed, else Megatron's "
    "1234; a phase may set its own).",
)
@click.option(
    "--max-retrain",
    type=click.FloatRange(min=0, max=1),
    default=0.10,
    show_default=True,
    help="phase-retrain (with --phases): warn when a phase's share of documents trained before "
    "passes the share expected of a draw regardless of the earlier phases by more than this.",
)
@click.option(
    "--max-epochs",
    type=click.FloatRange(min=0),
    default=4.0,
    show_default=True,
    help="Warn about a source drawn for more epochs than this.",
)
@click.option(
    "--ranks-per-node",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Ranks per node that build datasets.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="DataLoader workers per rank (Megatron's --num-workers).",
)
@click.option("--no-mmap-bin-files", is_flag=True, help="Megatron's --no-mmap-bin-files.")
@click.option(
    "--no-create-attention-mask-in-dataloader",
    "no_attention_mask",
    is_flag=True,
    help="Megatron-LM's flag (create_attention_mask=False): the DataLoader builds no attention "
    "mask, the attention kernel does.",
)
@click.option(
    "--node-memory",
    callback=lambda c, p, v: None if v is None else _memory(v),
    metavar="SIZE",
    help="A training node's memory (e.g. 2TiB), to check the cached masks of stock Megatron's "
    "DataLoader workers against [default: this machine's].",
)
@click.option(
    "--mmap-limit",
    type=click.IntRange(min=1),
    metavar="N",
    help="The file system's ceiling on memory maps per process, if it has one (WekaFS).",
)
@click.option(
    "--duplicates",
    "read_tokens",
    is_flag=True,
    help="Look for duplicate data by reading every source's tokens (a plain blend, or a repack "
    "without fingerprints); a repack with fingerprints is checked without this, reading none.",
)
@click.option(
    "--max-repeated-share",
    type=click.FloatRange(min=0, max=1),
    default=0.01,
    show_default=True,
    help="repeated-documents: warn when more than this share of a source's tokens are in "
    "repeats of another of its documents (of --min-duplicate-tokens or more).",
)
@click.option(
    "--max-shared-share",
    type=click.FloatRange(min=0, max=1),
    default=0.01,
    show_default=True,
    help="shared-documents: warn when more than this share of a source's tokens are in "
    "documents (of --min-duplicate-tokens or more) also in one other source.",
)
@click.option(
    "--min-duplicate-tokens",
    type=click.IntRange(min=1),
    default=32,  # repack.doctor.duplicates.DEFAULT_MIN_TOKENS (tests/test_duplicates.py)
    show_default=True,
    metavar="N",
    help="repeated-documents and shared-documents count only documents of at least N tokens: "
    "identical tiny documents are in every corpus, and shared by chance.",
)
@click.option(
    "--max-split-overlap",
    type=click.FloatRange(min=0, max=1),
    default=0.0,
    show_default=True,
    help="split-overlap: warn when more than this share of a source's valid or test "
    "documents are also in train (0: any).",
)
@click.option(
    "--duplicates-memory",
    default="1GiB",
    show_default=True,
    callback=lambda c, p, v: _memory(v),
    metavar="SIZE",
    help="Memory for the duplicate analysis (e.g. 1GiB): 16 bytes per document in memory; "
    "beyond, the fingerprints go to a temporary file (8 bytes each), analysed in partitions "
    "when those do not fit.",
)
@click.option("--group-by-folder", is_flag=True, help="One row per folder of prefixes.")
@click.option(
    "--top",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Show this many sources (or folders), the most repeated first; 0 for all.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Draw the mix into FILE (.png or .svg): weight share against token share, and "
    "epochs, per source or folder. Needs matplotlib (pip install 'megatron-repack[plot]').",
)
@click.option(
    "--megatron-release",
    callback=lambda c, p, v: _release(v),
    metavar="X.Y",
    help="The megatron-core release the run builds with: the figures follow its arithmetic "
    "where releases differ [default: the megatron-core installed, else the newest].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or log lines.")
@_handle_errors
def doctor(
    target,
    seq_length,
    phases_file,
    seed,
    max_retrain,
    split,
    train_samples,
    train_iters,
    global_batch_size,
    eval_iters,
    eval_interval,
    samples,
    surplus,
    blend_file,
    max_epochs,
    ranks_per_node,
    workers,
    no_mmap_bin_files,
    no_attention_mask,
    node_memory,
    mmap_limit,
    read_tokens,
    max_repeated_share,
    max_shared_share,
    min_duplicate_tokens,
    max_split_overlap,
    duplicates_memory,
    group_by_folder,
    top,
    plot,
    megatron_release,
    as_json,
    quiet,
) -> None:
    """Show what Megatron will do with a blend before a training job finds out.

    BLEND_OR_REPACK is a blend file (any form `repack merge` reads) or a repack folder (its
    recorded blend, or --blend). Only index data is read (.idx files, or the repack's manifest
    and index), never tokens.

    Computed as megatron-core computes it (split rounding, per-dataset samples with the 0.5 %
    surplus, epochs): per source, its tokens and documents, its weight share against its token
    share, the samples drawn from it in each split and the epochs that means, most repeated
    first. Then the problems, one line each: a split slice with no tokens (stock Megatron hangs
    forever), unreadable files, bad weights, too many datasets for the int16 blend index,
    int32 overflows, limits of this machine; warnings for repetition above --max-epochs,
    duplicate prefixes, mixed token dtypes. Then the files stock Megatron holds per process and
    per node, and what a repack holds instead; and the host memory of the masks stock's
    DataLoader workers cache, one set per source in every worker (a warning when a node's
    would pass --node-memory), against the repacked classes' one set per process.

    Duplicate data (exact copies): on a repack, from its document fingerprints, at once;
    on a plain blend with --duplicates, by reading the tokens. Sources that are byte-identical
    copies (identical-sources), documents repeated within a source (repeated-documents) or
    shared across sources (shared-documents), valid/test documents also in train
    (split-overlap), the unique tokens per split, and --max-epochs judged on the most-seen
    document.

    The samples per split are Megatron-LM's: --train-samples, or --train-iters times
    --global-batch-size; validation (--train-iters // --eval-interval + 1) x --eval-iters
    batches; test --eval-iters batches. Or give them with --samples.

    \b
    Examples:
      repack doctor blend.json --seq-length 4096 --split 99,1,0 \\
        --train-iters 100000 --global-batch-size 512
      repack doctor out/ --seq-length 4096 --samples 51200000,512000,51200 --json
      repack doctor per_split.json --seq-length 8192 --train-samples 1000000 \\
        --global-batch-size 256 --group-by-folder --plot mix.png
      repack doctor out/ --phases phases.json --seq-length 4096 --train-samples 51200000

    With --phases FILE, a run in phases (Megatron-LM's --phase-transition-iterations, one
    launch per phase, each on its own blend): per phase and source, the samples drawn, the
    documents they train on, how many an earlier phase already trained on (and their tokens),
    the share expected of a draw regardless of the earlier phases, and the same with repack's
    continuation (REPACK_PHASES, REPACK_PHASE); a phase-retrain warning past --max-retrain.
    """
    if phases_file is not None:
        _refuse_unused_with_phases(click.get_current_context())
        _doctor_phases(
            target,
            phases_file,
            seq_length=seq_length,
            split=split,
            surplus=surplus,
            release=megatron_release,
            seed=seed,
            train_samples=train_samples,
            train_iters=train_iters,
            global_batch_size=global_batch_size,
            max_retrain=max_retrain,
            top=top,
            as_json=as_json,
            quiet=quiet,
        )
        return
    if target is None:
        raise click.UsageError("missing BLEND_OR_REPACK (it may be left out only with --phases)")
    from repack.doctor import DuplicateOptions, Settings
    from repack.doctor import doctor as run
    from repack.doctor.duplicates import Options
    from repack.doctor.render import render
    from repack.model.arithmetic import training_samples
    from repack.model.splits import installed

    if samples is None:
        if global_batch_size is None or (train_samples is None) == (train_iters is None):
            raise click.UsageError(
                "give --train-samples or --train-iters, with --global-batch-size (or --samples)"
            )
        samples = training_samples(
            global_batch_size=global_batch_size,
            train_samples=train_samples,
            train_iters=train_iters,
            eval_iters=eval_iters,
            eval_interval=eval_interval,
        )
    elif train_samples is not None or train_iters is not None:
        raise click.UsageError("--samples replaces --train-samples and --train-iters")
    if plot is not None:
        from repack.doctor.plot import check_available

        check_available()
    settings = Settings(
        sequence_length=seq_length,
        sizes=tuple(samples),
        split=split,
        surplus=surplus,
        create_attention_mask=not no_attention_mask,
        release=megatron_release or installed(),
    )
    bars = Display(quiet)
    try:
        report = run(
            target,
            settings,
            blend=blend_file,
            max_epochs=max_epochs,
            ranks_per_node=ranks_per_node,
            workers=workers,
            mmap_bin_files=not no_mmap_bin_files,
            mmap_limit=mmap_limit,
            node_memory=node_memory,
            duplicates=DuplicateOptions(
                Options(
                    max_repeated_share,
                    max_shared_share,
                    max_split_overlap,
                    duplicates_memory,
                    min_tokens=min_duplicate_tokens,
                ),
                read_tokens=read_tokens,
            ),
            progress=bars,
        )
    finally:
        bars.close()
    if plot is not None:
        from repack.doctor.plot import plot_mix

        plot_mix(report, plot, group_by_folder=group_by_folder)
        click.echo(f"wrote the plot of the mix to {plot}", err=True)
    if as_json:
        data = report.to_json(groups=group_by_folder)
        if plot is not None:
            data["plot"] = os.fspath(plot)
        # one line: json's C encoder, 4x faster than an indented dump at 10,000 sources
        click.echo(json.dumps(data, sort_keys=True))
    else:
        click.echo(render(report, top=top, group_by_folder=group_by_folder))
    if not report.ok:
        sys.exit(EXIT_DAMAGED)


#: The options of `repack doctor` that `--phases` uses; it refuses the others.
_PHASES_OPTIONS = frozenset(
    {
        "target", "phases_file", "seq_length", "split", "train_samples", "train_iters",
        "global_batch_size", "surplus", "seed", "max_retrain", "top", "megatron_release",
        "as_json", "quiet",
    }
)  # fmt: skip
#: Why, for the options a user is likeliest to expect to work with --phases.
_NOT_WITH_PHASES = {
    "samples": "give --train-samples or --train-iters: each phase's samples follow from the "
    "schedule's iterations",
    "blend_file": "each phase's blend is the schedule's",
    "plot": "the phase report has no plot",
    "node_memory": "the phase report has no memory figure",
}


def _refuse_unused_with_phases(ctx: click.Context) -> None:
    """A usage error for the first option given that `doctor --phases` does not use."""
    from click.core import ParameterSource

    for param in ctx.command.params:
        if param.name in _PHASES_OPTIONS or not isinstance(param, click.Option):
            continue
        if ctx.get_parameter_source(param.name) in (ParameterSource.DEFAULT, None):
            continue
        why = _NOT_WITH_PHASES.get(param.name, "the phase report does not use it")
        raise click.UsageError(f"{param.opts[0]} does not apply with --phases: {why}")


def _doctor_phases(target, phases_file, *, train_samples, train_iters, global_batch_size, **kw):
    """``repack doctor [REPACK] --phases FILE``: parse, run, print."""
    from repack.model.splits import Settings, installed
    from repack.phases.report import examine_phases, render_phases
    from repack.phases.schedule import load_schedule
    from repack.store import names_folder

    if target is not None and not names_folder(target):
        raise click.UsageError(
            "with --phases, BLEND_OR_REPACK is the repack holding the phases' sources (or left "
            f"out, to read the blends' prefixes); {target} is not a folder"
        )
    schedule = load_schedule(phases_file)
    batch = schedule.global_batch_size
    if global_batch_size is not None and global_batch_size != batch:
        raise click.UsageError(
            f"--global-batch-size {global_batch_size} differs from {phases_file}'s "
            f"global_batch_size {batch}"
        )
    if train_samples is not None and train_iters is not None:
        raise click.UsageError("give --train-samples or --train-iters, not both")
    settings = Settings(
        sequence_length=kw["seq_length"],
        sizes=(0, 0, 0),
        split=kw["split"],
        surplus=kw["surplus"],
        release=kw["release"] or installed(),
    )
    bars = Display(kw["quiet"])
    try:
        report = examine_phases(
            target,
            phases_file,
            settings,
            train_samples=train_samples,
            train_iters=train_iters,
            seed=kw["seed"],
            max_retrain=kw["max_retrain"],
            progress=bars,
        )
    finally:
        bars.close()
    if kw["as_json"]:
        click.echo(json.dumps(report.to_json(), sort_keys=True))
    else:
        click.echo(render_phases(report, top=kw["top"]))


def _iterations_to_skip(ctx, param, value: tuple[str, ...]) -> tuple[int, ...]:
    found = []
    for item in value:
        for part in item.replace(",", " ").split():
            try:
                found.append(int(part))
            except ValueError:
                raise click.BadParameter(f"{part!r}: expected iteration numbers") from None
    return tuple(found)


def _iteration_range(ctx, param, value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    first, sep, last = value.partition(":")
    try:
        found = (int(first), int(last if sep else first))
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected FIRST:LAST, two iteration numbers") from None
    if found[0] < 1 or found[1] < found[0]:
        raise click.BadParameter(f"{value!r}: expected 1 <= FIRST <= LAST")
    return found


def _document(ctx, param, value: str | None) -> tuple[str, int] | None:
    if value is None:
        return None
    source, sep, number = value.rpartition(":")
    if not sep or not source or not number.isdigit():
        raise click.BadParameter(f"{value!r}: expected SOURCE:DOC (a prefix, a document number)")
    return source, int(number)


#: trace's values (Megatron-LM's names) -> the click parameter giving each.
_TRACE_FLAGS = {
    "seq_length": "seq_length",
    "split": "split",
    "seed": "seed",
    "global_batch_size": "global_batch_size",
    "micro_batch_size": "micro_batch_size",
    "data_parallel_size": "data_parallel_size",
    "train_samples": "train_samples",
    "train_iters": "train_iters",
    "eval_interval": "eval_interval",
    "eval_iters": "eval_iters",
    "eval_micro_batch_size": "eval_micro_batch_size",
    "eval_global_batch_size": "eval_global_batch_size",
    "start_eval_at_iter": "start_eval_at_iter",
    "mid_level_dataset_surplus": "surplus",
    "dataloader_type": "dataloader_type",
    "data_sharding": "no_data_sharding",
    "iterations_to_skip": "iterations_to_skip",
    "rampup_batch_size": "rampup_batch_size",
    "step_batch_size_schedule": "step_batch_size_schedule",
    "data_cache_path": "data_cache_path",
}


@main.command(epilog=EXIT_CODES)
@click.argument("target", metavar="[BLEND_OR_REPACK]", type=click.Path(), required=False)
@click.option(
    "--iteration",
    "iteration",
    type=click.IntRange(min=1),
    help="The samples of this iteration (as Megatron-LM logs it, from 1).",
)
@click.option(
    "--iterations",
    callback=_iteration_range,
    metavar="FIRST:LAST",
    help="The samples of these iterations, both included.",
)
@click.option(
    "--document",
    callback=_document,
    metavar="SOURCE:DOC",
    help="Every read of document DOC (a sequence of the .idx) of SOURCE (a prefix as the blend "
    "names it, or its path).",
)
@click.option("--source", help="Every sample read from SOURCE.")
@click.option(
    "--checkpoint",
    type=click.Path(),
    metavar="DIR",
    help="The run's checkpoint folder (Megatron-LM's --save, or Megatron-Bridge's; or one "
    "iter_NNNNNNN folder): its saved arguments are the run's settings, and its blend the "
    "BLEND_OR_REPACK's default; the flags typed here replace them.",
)
@_run_options(required=False)
@_SURPLUS_OPTION
@_BLEND_OPTION
@click.option("--seed", type=int, default=1234, show_default=True, help="Megatron's --seed.")
@click.option(
    "--micro-batch-size",
    type=click.IntRange(min=1),
    help="Megatron's --micro-batch-size (required without --checkpoint).",
)
@click.option(
    "--data-parallel-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Data-parallel ranks (world size / (tensor x pipeline x context parallel)).",
)
@click.option(
    "--dataloader-type",
    type=click.Choice(["single", "cyclic", "external"]),
    default="single",
    show_default=True,
    help="Megatron's --dataloader-type (external is refused: the run's own loader decides).",
)
@click.option(
    "--no-data-sharding",
    "no_data_sharding",
    is_flag=True,
    help="Megatron's --no-data-sharding (cyclic loader).",
)
@click.option(
    "--iterations-to-skip",
    multiple=True,
    callback=_iterations_to_skip,
    metavar="N[,N...]",
    help="Megatron's --iterations-to-skip, as given to the run (counted from 0 before "
    "Megatron-LM 0.17, from 1 since: see --megatron-release).",
)
@click.option(
    "--rampup-batch-size",
    type=int,
    nargs=3,
    metavar="START INCREMENT SAMPLES",
    help="Megatron's --rampup-batch-size (applied by Megatron-LM 0.17 and earlier).",
)
@click.option(
    "--step-batch-size-schedule",
    metavar="'THRESHOLD:BS ...'",
    help="Megatron's --step-batch-size-schedule (Megatron-LM 0.18 and later).",
)
@click.option("--eval-micro-batch-size", type=click.IntRange(min=1), help="Megatron-LM 0.18+.")
@click.option("--eval-global-batch-size", type=click.IntRange(min=1), help="Megatron-LM 0.18+.")
@click.option("--start-eval-at-iter", type=click.IntRange(min=0), help="Megatron-LM 0.17+.")
@click.option(
    "--data-cache-path",
    type=click.Path(file_okay=False),
    help="Megatron's --data-cache-path: its cached indices are read when they match, and what "
    "is built goes there (a repack's default: its own cache folder).",
)
@click.option(
    "--megatron-release",
    metavar="X.Y",
    help="The Megatron-LM release of the run [default: the megatron-core installed].",
)
@click.option("--tokens", is_flag=True, help="Add each sample's token ids (seq-length + 1).")
@click.option(
    "--tokenizer",
    type=click.Path(file_okay=False, exists=True),
    metavar="DIR",
    help="A local Hugging Face tokenizer folder: add each sample's text (needs transformers; "
    "nothing is downloaded).",
)
@click.option(
    "--phases",
    "phases_file",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="A run in blend phases (Megatron-LM's --phase-transition-iterations): the phase "
    "schedule (as for doctor --phases). BLEND_OR_REPACK is then the repack holding the phases' "
    "sources, or left out to read each phase's blend; needs --train-samples.",
)
@click.option(
    "--continued",
    is_flag=True,
    help="With --phases and a repack: the run used repack's continuation (REPACK_PHASES, "
    "REPACK_PHASE): each phase's train split is built as it built it.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines or notes on stderr.")
@_handle_errors
def trace(
    target,
    iteration,
    iterations,
    document,
    source,
    checkpoint,
    seq_length,
    split,
    train_samples,
    train_iters,
    global_batch_size,
    eval_iters,
    eval_interval,
    surplus,
    blend_file,
    seed,
    micro_batch_size,
    data_parallel_size,
    dataloader_type,
    no_data_sharding,
    iterations_to_skip,
    rampup_batch_size,
    step_batch_size_schedule,
    eval_micro_batch_size,
    eval_global_batch_size,
    start_eval_at_iter,
    data_cache_path,
    megatron_release,
    tokens,
    tokenizer,
    phases_file,
    continued,
    as_json,
    quiet,
) -> None:
    """Name the data a Megatron run read at an iteration, or where it read a document.

    BLEND_OR_REPACK is what the run trained on: a blend file (any form `repack merge` reads) or
    a repack. The run's datasets are built with the megatron-core installed, as the run built
    them (its cached indices are used when --data-cache-path holds them), and Megatron-LM's
    samplers and batch-size schedule are followed: the answer is exact, to the token.

    --iteration N (or --iterations A:B): for every sample of the iteration, the data-parallel
    rank, micro-batch and row, the index in the split's BlendedDataset, the source, the sample
    of that source's dataset and the documents (sequences of the source's .idx) with the token
    ranges it holds (the last range ends with the extra token Megatron reads as the last
    label); and the validation samples of the evaluation run after that iteration, if any.

    --document SOURCE:DOC: every iteration, rank, micro-batch and row whose sample holds tokens
    of the document (repeats in later epochs included), and the evaluations that read it.
    --source SOURCE: every sample read from that source.

    --checkpoint DIR reads the run's settings from its checkpoint (the arguments Megatron-LM
    saved, or Megatron-Bridge's run_config.yaml), the blend it names included; flags typed
    replace them. The saved arguments describe the last launch only: the notes on stderr say
    so, and what else the checkpoint does not tell.

    --phases FILE: a run in blend phases (Megatron-LM's --phase-transition-iterations, one
    launch per phase; the schedule file as for `repack doctor --phases`). Each phase's datasets
    are built as its launch built them (its blend, its samples, its seed), its loader starting at
    the phase's first sample; iterations and evaluations are the run's, each record says its
    "phase". BLEND_OR_REPACK is the repack holding the phases' sources (each phase's blend
    looked up in it), or left out to read each blend's prefixes. --continued: the run used
    repack's continuation (REPACK_PHASES, REPACK_PHASE), which trace reads from no environment.
    With --checkpoint, its phase_transition_iterations must be the schedule's, and the blend it
    names (the last launch's) is not used.

    Refused, as not answerable exactly: --dataloader-type external, hybrid context
    parallel, SFT and packed datasets; with --phases, a batch-size ramp or schedule.

    \b
    Examples:
      repack trace blend.json --iteration 1200 --seq-length 4096 --split 99,1,0 \\
        --train-iters 100000 --global-batch-size 512 --micro-batch-size 2 \\
        --data-parallel-size 64
      repack trace out/ --iterations 1200:1201 --seq-length 4096 --train-iters 100000 \\
        --global-batch-size 512 --micro-batch-size 2 --data-parallel-size 64 --json
      repack trace out/ --document data/web/cc-00000:4711 --seq-length 4096 \\
        --train-iters 100000 --global-batch-size 512 --micro-batch-size 2 --json
      repack trace --checkpoint ckpts/ --iteration 1200
      repack trace out/ --checkpoint ckpts/iter_0002000 --iteration 1200 \\
        --data-parallel-size 64
      repack trace out/ --phases phases.json --iterations 89999:90001 --seq-length 4096 \\
        --train-samples 51200000 --micro-batch-size 2 --data-parallel-size 64 --json
    """
    from repack.trace.run import trace as run
    from repack.trace.table import render

    asked = [x for x in (iteration, iterations, document, source) if x is not None]
    if len(asked) != 1:
        raise click.UsageError("give one of --iteration, --iterations, --document, --source")
    if iteration is not None:
        iterations = (iteration, iteration)
    if checkpoint is None:
        for name, value in (("--seq-length", seq_length), ("--micro-batch-size", micro_batch_size)):
            if value is None:
                raise click.UsageError(f"Missing option '{name}' (or give --checkpoint).")
        if target is None and phases_file is None:
            raise click.UsageError("Missing argument 'BLEND_OR_REPACK' (or give --checkpoint).")
    if continued and (phases_file is None or target is None):
        raise click.UsageError(
            "--continued goes with --phases FILE and the repack holding the phases' sources"
        )
    values = {
        "seq_length": seq_length,
        "split": split,
        "seed": seed,
        "global_batch_size": global_batch_size,
        "micro_batch_size": micro_batch_size,
        "data_parallel_size": data_parallel_size,
        "train_samples": train_samples,
        "train_iters": train_iters,
        "eval_interval": eval_interval,
        "eval_iters": eval_iters,
        "eval_micro_batch_size": eval_micro_batch_size,
        "eval_global_batch_size": eval_global_batch_size,
        "start_eval_at_iter": start_eval_at_iter,
        "mid_level_dataset_surplus": surplus,
        "dataloader_type": dataloader_type,
        "data_sharding": not no_data_sharding,
        "iterations_to_skip": iterations_to_skip,
        "rampup_batch_size": rampup_batch_size or None,
        "step_batch_size_schedule": step_batch_size_schedule,
        "data_cache_path": data_cache_path,
    }
    ctx = click.get_current_context()
    typed = {
        name
        for name, param in _TRACE_FLAGS.items()
        if ctx.get_parameter_source(param) is not click.core.ParameterSource.DEFAULT
    }
    answer = run(
        target,
        values,
        typed=typed,
        checkpoint=checkpoint,
        release=megatron_release,
        blend_file=blend_file,
        iterations=iterations,
        document=document,
        source=source,
        tokens=tokens,
        tokenizer=tokenizer,
        say=None if quiet else (lambda line: click.echo(f"repack: {line}", err=True)),
        phases=phases_file,
        continued=continued,
    )
    if as_json:
        click.echo(json.dumps(answer.to_json(), sort_keys=True))
    else:
        click.echo(render(answer))


if __name__ == "__main__":  # pragma: no cover
    main()
