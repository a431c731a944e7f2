"""``repack merge``: consolidate a blend into a repack, at once or as tasks over many machines.

This module owns the command and its modes: BLEND OUT (with ``--dry-run`` or ``--plan-only``),
and OUT alone with ``--task I --tasks N`` (defaults from a SLURM array job's environment),
``--finalize`` or ``--resume``. Each mode calls one function of :mod:`repack.merge` and prints
its result.
"""

from __future__ import annotations

import os

import click

from repack.checksum import ALGORITHMS, DEFAULT
from repack.cli.exits import EXIT_CODES, handle_errors
from repack.cli.options import (
    copy_workers_option,
    json_option,
    parse_codec_option,
    parse_size_option,
    quiet_option,
)
from repack.cli.output import print_json, print_result, table
from repack.progress import Display
from repack.units import format_size, plural

__all__ = ["merge"]


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


@click.command(epilog=EXIT_CODES)
@click.argument("paths", nargs=-1, required=True, metavar="[BLEND] OUT")
@click.option(
    "--shard-size",
    default="64GiB",
    show_default=True,
    callback=parse_size_option,
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
    callback=lambda c, p, v: parse_codec_option(v),
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
@copy_workers_option("Copy up to K shards at once, in K processes.")
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
@json_option("Print the result as JSON.")
@quiet_option("No progress output or notes.")
@handle_errors
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
                    print_json(
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
            print_result(result, as_json, "merged")
            return
        if len(paths) != 1:
            raise click.UsageError("expected BLEND OUT, or OUT with --task, --finalize or --resume")
        (out,) = paths
        if dry_run or plan_only:
            raise click.UsageError("--dry-run and --plan-only need BLEND OUT")
        if finalize:
            result = m.finalize(out, progress=bars)
            bars.close()
            print_result(result, as_json, "finalized")
            return
        if resume:
            result = m.resume(out, workers=workers, progress=bars)
            bars.close()
            print_result(result, as_json, "merged")
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
            print_json(
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
        print_json(plan)
        return
    rows = [["shard", "dtype", "size", "sources"]]
    for shard in plan["shards"]:
        rows.append(
            [shard["file"], shard["dtype"], format_size(shard["size"]), str(len(shard["sources"]))]
        )
    click.echo(table(rows, right={2, 3}))
    click.echo(
        f"dry run: {plural(plan['sources'], 'source')}, {format_size(plan['total_bytes'])} "
        f"into {plural(len(plan['shards']), 'shard')}; nothing written"
    )
