"""What the ``repack`` commands print: JSON documents, aligned tables, a merge's result line.

This module owns the shapes of output that several commands share: ``--json`` documents
(indented, sorted keys), the plain-text tables of ``merge --dry-run``, ``remove --dry-run``
and ``inspect``, and the one line (or JSON object) that ``merge``, ``merge --finalize``,
``merge --resume`` and ``add`` print for a result. Results go to stdout; nothing here writes
to stderr.
"""

from __future__ import annotations

import json

import click

from repack.units import format_size, plural

__all__ = ["print_json", "print_result", "table"]


def print_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def table(rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def print_result(result, as_json: bool, verb: str) -> None:
    if as_json:
        print_json(
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
