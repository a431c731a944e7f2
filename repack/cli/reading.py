"""The commands that read a repack without changing it: ``verify``, ``inspect`` and ``extract``.

This module owns those three commands: ``verify`` recomputes every checksum (exit status 1
on damage), ``inspect`` shows what the repack holds, ``extract`` writes one source back as
Megatron's ``.bin``/``.idx``. Each calls the reader's functions (:mod:`repack.read.verify`,
:mod:`repack.read.summary`, :mod:`repack.read.extract`) and prints the result.
"""

from __future__ import annotations

import sys

import click

from repack.cli.exits import EXIT_CODES, EXIT_DAMAGED, handle_errors
from repack.cli.options import json_option, quiet_option
from repack.cli.output import print_json, table
from repack.progress import Display
from repack.units import format_size, plural

__all__ = ["extract", "inspect", "verify"]


@click.command(epilog=EXIT_CODES)
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
@json_option("Print the report as JSON.")
@quiet_option("No progress bar or log lines.")
@handle_errors
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
    from repack.read.verify import verify as run

    bars = Display(quiet)
    try:
        report = run(out, sources=with_sources, workers=workers, progress=bars)
    finally:
        bars.close()
    if as_json:
        print_json(report.to_json())
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


@click.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@json_option("Print everything as JSON.")
@handle_errors
def inspect(out, as_json) -> None:
    """Show what the repack OUT holds: sources, splits, weights, counts, shards, totals.

    Only the manifest and index are read (structure is checked, checksums are not: use
    `repack verify` for that).
    """
    from repack.doctor.findings import inspect_summary
    from repack.read.reader import Repack
    from repack.read.summary import summarize, superseded_summary

    info = summarize(Repack(out).manifest)
    info["duplicates"] = inspect_summary(out)
    info["superseded"] = superseded_summary(out)
    if as_json:
        print_json(info)
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
    click.echo(table(rows, right={0, 4, 5, 6}))
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


@click.command(epilog=EXIT_CODES)
@click.argument("out", type=click.Path(file_okay=False))
@click.argument("source")
@click.argument("dest_prefix", type=click.Path())
@click.option("--force", is_flag=True, help="Replace existing DEST_PREFIX.bin/.idx.")
@json_option("Print what was written as JSON.")
@quiet_option("No progress bar or log lines.")
@handle_errors
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
    from repack.read.extract import destination
    from repack.read.extract import extract as run

    bars = Display(quiet)
    try:
        entry = run(out, source, dest_prefix, overwrite=force, progress=bars)
    finally:
        bars.close()
    dest = destination(dest_prefix, entry.name)
    if as_json:
        print_json(
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
