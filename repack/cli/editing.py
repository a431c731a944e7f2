"""The commands that edit a repack in place: ``add``, ``remove``, ``fingerprint`` and ``gc``.

This module owns those four commands and the line that says what an edit on object storage
did with the objects it replaced (kept for earlier readers, or deleted). Each calls one
function of the writers (:mod:`repack.merge.append`, :mod:`repack.merge.remove`,
:mod:`repack.merge.fingerprint_file`, :mod:`repack.merge.edit`) and prints its result.
"""

from __future__ import annotations

import click

from repack.cli.exits import EXIT_CODES, handle_errors
from repack.cli.options import (
    copy_workers_option,
    json_option,
    keep_superseded_option,
    parse_duration_option,
    quiet_option,
)
from repack.cli.output import print_json, print_result, table
from repack.progress import Display
from repack.units import format_duration, format_size, plural

__all__ = ["add", "fingerprint", "gc", "remove"]


def _superseded_note(collected, out: str) -> str | None:
    """What an edit on object storage or a shared folder did with what it replaced, in one
    line (None: nothing to say, as in a folder only this machine mounts)."""
    from repack.store import open_store
    from repack.store.generations import utc

    noun = "file" if open_store(out).local else "object"
    said = []
    if collected.kept is not None:
        kept = collected.kept
        said.append(
            f"kept the {plural(len(kept.objects), f'replaced {noun}')} "
            f"({format_size(kept.size)}) for readers that opened the repack before: they are "
            f"deleted by the first edit after {utc(kept.at + collected.keep)}, or by "
            f"`repack gc {out} --older-than 0`"
        )
    if collected.deleted:
        n = sum(len(g.objects) for g in collected.deleted)
        said.append(
            f"deleted {plural(n, f'superseded {noun}')} ({format_size(collected.deleted_bytes)}) "
            f"of {plural(len(collected.deleted), 'earlier edit')}"
            + (": readers that opened the repack before fail" if collected.keep == 0 else "")
        )
    return "; ".join(said) or None


@click.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@click.argument("blend", type=click.Path(dir_okay=False))
@copy_workers_option("Copy up to K new shards at once, in K processes.")
@keep_superseded_option
@json_option("Print the result as JSON.")
@quiet_option("No progress output or notes.")
@handle_errors
def add(out, blend, workers, keep_superseded, as_json, quiet) -> None:
    """Add the sources of BLEND that the repack OUT does not hold yet.

    New sources go to new shards: existing shards are not rewritten. The manifest is replaced
    atomically, so readers see the old repack or the new one, never a mix. Sources already in
    the repack are skipped (an error if their content changed).

    \b
    Example:
      repack add out/ more_sources.json
    """
    from repack.merge.append import add as run

    bars = Display(quiet)
    try:
        result = run(out, blend, workers=workers, keep_superseded=keep_superseded, progress=bars)
    finally:
        bars.close()
    print_result(result, as_json, "added")


@click.command(epilog=EXIT_CODES)
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
@keep_superseded_option
@click.option(
    "--now",
    is_flag=True,
    help="Delete the replaced shards, and every superseded file kept from earlier edits, at "
    "once, on any store (a take-down). Readers that opened the repack before then "
    "fail, and their error names this remove.",
)
@json_option("Print the result as JSON.")
@quiet_option("No progress output or notes.")
@handle_errors
def remove(out, sources, blend, dry_run, keep_superseded, now, as_json, quiet) -> None:
    """Remove SOURCE... from the repack OUT: their bytes leave every file of OUT.

    SOURCE is a prefix as written in the blend, or its absolute path. Each shard holding a
    removed source is rewritten, under a new name, without it; shards that keep nothing are
    dropped; other shards are not touched. The manifest is replaced atomically: readers see
    the old repack or the new one, and a process that opened the repack before keeps reading
    it. On object storage and on a folder other machines mount (NFS, Lustre, FUSE...) the old
    shards are kept for --keep-superseded (a day), then deleted by the next edit or by
    `repack gc`; in a folder only this machine mounts they are deleted at once (open files
    stay readable); --now deletes them, and every earlier generation kept, at once. Killed
    at any point, OUT is a complete repack, old or new; run the command again to finish.

    \b
    Examples:
      repack remove out/ data/web/cc-00017
      repack remove --dry-run out/ --blend withdrawn.json
      repack remove --now s3://datasets/web.repack data/web/cc-00017   # a take-down
    """
    from repack.merge.remove import remove as run

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
        print_json({**result.to_json(), "dry_run": dry_run})
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
            click.echo(table(rows, right={2, 3}))
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


@click.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@keep_superseded_option
@json_option("Print the result as JSON.")
@quiet_option("No progress output.")
@handle_errors
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
        print_json({"out": out, **member})
    else:
        click.echo(
            f"wrote {member['file']}: {member['documents']:,} documents of "
            f"{member['sources']:,} sources"
        )


@click.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@click.option(
    "--older-than",
    default="1d",
    show_default=True,
    metavar="DURATION",
    callback=parse_duration_option,
    help="Delete what was superseded at least this long ago: 12h, 30m, 0 (all of it, now).",
)
@json_option("Print the result as JSON.")
@handle_errors
def gc(out, older_than, as_json) -> None:
    """Delete the objects earlier edits of the repack OUT replaced, and what killed edits left.

    On object storage and on folders other machines mount (NFS, Lustre, GPFS, CephFS, SMB,
    FUSE...), `add`, `remove` and `fingerprint` do not delete the files they replace: readers
    that opened the repack before the edit keep reading them. The first edit after their
    grace period (--keep-superseded, a day) deletes them; this deletes those superseded at
    least --older-than ago, now. A reader still reading one then fails, its error naming the
    edit. `repack inspect OUT` lists what is kept. In a folder only this machine mounts,
    edits delete what they replace at once (open files stay readable), and this removes only
    what killed edits left (and what an edit given --keep-superseded kept).

    \b
    Examples:
      repack gc s3://datasets/web.repack                 # what is older than a day
      repack gc s3://datasets/web.repack --older-than 0  # everything superseded, now
    """
    from repack.merge.edit import gc as run
    from repack.store import open_store
    from repack.store.generations import utc

    done = run(out, older_than)
    if as_json:
        print_json({"out": out, "older_than_seconds": older_than, **done.to_json()})
        return
    if not done.deleted and not done.pending and open_store(out).deleted_stays_readable:
        click.echo(
            f"nothing superseded: {out} is a folder only this machine mounts, whose edits "
            "delete what they replace at once (open files stay readable)"
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
