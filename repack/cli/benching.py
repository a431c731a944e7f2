"""``repack bench``: can this storage feed this run?

This module owns the command and the flags only it takes (which ranks and workers, which
iterations, the step time, the cache, ``--prefixes``, ``--output``, ``--merge-results``,
``--plot``); the run settings and the loader's it shares with ``repack trace`` come from
:mod:`repack.cli.options`. It parses, runs :func:`repack.bench.run.bench` and prints the report
(:mod:`repack.bench.report`).
"""

from __future__ import annotations

import json

import click

from repack.cli.exits import EXIT_CODES, handle_errors
from repack.cli.options import (
    blend_option,
    json_option,
    loader_options,
    quiet_option,
    release_option,
    run_options,
    run_values,
    seed_option,
    surplus_option,
)
from repack.cli.output import print_json

__all__ = ["bench"]


def _ranks(ctx, param, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    found: list[int] = []
    for part in value.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        try:
            found.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
        except ValueError:
            raise click.BadParameter(f"{value!r}: expected ranks as 0-7 or 0,2,4") from None
    if not found or min(found) < 0:
        raise click.BadParameter(f"{value!r}: expected ranks as 0-7 or 0,2,4")
    return tuple(sorted(set(found)))


@click.command(epilog=EXIT_CODES)
@click.argument("target", metavar="[REPACK]", type=click.Path(), required=False)
@click.option(
    "--checkpoint",
    type=click.Path(),
    metavar="DIR",
    help="A checkpoint of the run: its saved arguments are the run's settings; the flags typed "
    "here replace them.",
)
@run_options(required=False)
@surplus_option
@blend_option
@seed_option
@loader_options
@click.option(
    "--data-cache-path",
    type=click.Path(file_okay=False),
    help="Megatron's --data-cache-path: the run's cached indices are read from there.",
)
@release_option
@click.option(
    "--ranks",
    callback=_ranks,
    metavar="LIST",
    help="The data-parallel ranks this node hosts, as 0-7 or 8,9,10 [default: the first 8, one "
    "node's].",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="DataLoader workers per rank (Megatron's --num-workers).",
)
@click.option(
    "--prefetch-factor",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Batches each worker keeps asked for ahead (the DataLoader's prefetch_factor).",
)
@click.option(
    "--from-iteration",
    "first",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="The first iteration replayed (the loaders start there, as a job resumed there does).",
)
@click.option(
    "--iterations",
    "count",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Iterations replayed.",
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=0, min_open=True),
    help="Stop after this long (at an iteration's end), whatever --iterations says.",
)
@click.option(
    "--step-time",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Seconds the run trains per iteration: the loaders must have each iteration's data by "
    "then.",
)
@click.option(
    "--tokens-per-second",
    type=click.FloatRange(min=0, min_open=True),
    help="The whole run's training throughput: a step time of global batch x seq length / this.",
)
@click.option(
    "--flat-out",
    is_flag=True,
    help="No step time: each batch is asked for as soon as there is room (the storage's "
    "capacity for this pattern).",
)
@click.option(
    "--warm",
    is_flag=True,
    help="Do not empty the page cache first: measure the cached case, on purpose.",
)
@click.option(
    "--no-mmap-bin-files",
    "no_mmap",
    is_flag=True,
    help="Megatron's --no-mmap-bin-files: the loader reads the data with file reads (pread), "
    "not through mappings [default: the checkpoint's, else mapped].",
)
@click.option(
    "--prefixes",
    type=click.Path(dir_okay=False, exists=True),
    metavar="BLEND",
    help="Also replay the same samples from the original prefixes of this blend file "
    "(stock's layout: one .bin and .idx per source), and compare.",
)
@click.option(
    "--output",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Write this node's raw result here (for --merge-results).",
)
@click.option(
    "--merge-results",
    "merge",
    is_flag=True,
    help="Report the results FILES of several nodes as one run: repack bench --merge-results "
    "node*.json.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    metavar="FILE.png",
    help="Draw the read time per iteration of every rank and the step time (needs matplotlib).",
)
@json_option("Print the figures as JSON.")
@quiet_option("No progress bar or lines on stderr.")
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False), required=False)
@handle_errors
def bench(
    target,
    checkpoint,
    seq_length,
    split,
    train_samples,
    train_iters,
    global_batch_size,
    eval_iters,
    eval_interval,
    fma,
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
    ranks,
    workers,
    prefetch_factor,
    first,
    count,
    seconds,
    step_time,
    tokens_per_second,
    flat_out,
    warm,
    no_mmap,
    prefixes,
    output,
    merge,
    plot,
    as_json,
    quiet,
    files,
) -> None:
    """Replay a Megatron run's reads on this node's storage: can it feed the run?

    REPACK is the repack the run reads (a folder, or s3:// / msc://), or a blend file to
    replay stock's layout alone. The run's datasets are built as `repack trace` builds them,
    and its samplers followed: the reads are the loader's own, the same shards, offsets and
    lengths, for iterations --from-iteration to +--iterations, of the data-parallel ranks this
    node hosts (--ranks), each from --workers DataLoader worker processes that keep
    --prefetch-factor batches asked for ahead, as torch's DataLoader does.

    Storage, not memory: before the replay the files' pages are dropped from this node's page
    cache (posix_fadvise DONTNEED), and the report counts the pages still resident (mincore)
    and the bytes the processes fetched (/proc/PID/io). A replay that finds its data cached
    says so and reports no storage figure; --warm measures the cached case on purpose. Object
    storage is read with the loader's ranged GETs and read-ahead.

    The step time (--step-time, or --tokens-per-second for the whole run) is what the loaders
    must keep up with: the report gives the stall share, the iterations in which a rank waited
    for its data, and achieved against needed samples/s, tokens/s, MiB/s and requests/s.
    --flat-out asks for every batch as soon as there is room: the storage's capacity for the
    run's pattern.

    Several nodes: run the same command on each, with its --ranks and --output FILE (a SLURM
    array, or srun --ntasks-per-node 1); then `repack bench --merge-results FILE...`.

    \b
    Examples:
      repack bench /lustre/me/blend.repack --seq-length 4096 --train-iters 100000 \\
        --global-batch-size 512 --micro-batch-size 2 --data-parallel-size 64 \\
        --step-time 1.5 --workers 2
      repack bench out/ --checkpoint ckpts/ --prefixes blend.json --flat-out --json
      srun --ntasks-per-node 1 sh -c 'repack bench out/ --checkpoint ckpts/ --step-time 1.5 \\
        --ranks $((SLURM_NODEID*8))-$((SLURM_NODEID*8+7)) --output bench-$SLURM_NODEID.json'
      repack bench --merge-results bench-*.json
    """
    from repack.bench.report import figures, merge_results, plot_result, render

    if merge:
        paths = ([target] if target else []) + list(files)
        if not paths:
            raise click.UsageError("--merge-results needs the result FILES of the nodes")
        results = [merge_results(paths)]
    else:
        if files:
            raise click.UsageError(f"unexpected extra argument {files[0]!r}")
        if checkpoint is None:
            for name, value in (
                ("--seq-length", seq_length),
                ("--micro-batch-size", micro_batch_size),
            ):
                if value is None:
                    raise click.UsageError(f"Missing option '{name}' (or give --checkpoint).")
            if target is None:
                raise click.UsageError("Missing argument 'REPACK' (or give --checkpoint).")
        if flat_out and (step_time is not None or tokens_per_second is not None):
            raise click.UsageError("--flat-out has no step time: drop --step-time")
        if not flat_out and step_time is None and tokens_per_second is None:
            raise click.UsageError(
                "give the run's --step-time (or --tokens-per-second), or --flat-out"
            )
        if plot is not None:
            from repack.doctor.plot import check_available

            check_available()
        values, typed = run_values()
        if no_mmap:
            values["mmap_bin_files"] = False
            typed.add("mmap_bin_files")
        from repack.bench.run import bench as run
        from repack.progress import Display

        bars = Display(quiet)
        try:
            results = run(
                target,
                values,
                typed=typed,
                checkpoint=checkpoint,
                release=megatron_release,
                blend_file=blend_file,
                fma=fma,
                ranks=ranks,
                workers=workers,
                first=first,
                iterations=count,
                seconds=seconds,
                step_time=step_time,
                tokens_per_second=tokens_per_second,
                prefetch_factor=prefetch_factor,
                warm=warm,
                prefixes=prefixes,
                progress=bars,
                say=None if quiet else (lambda line: click.echo(f"repack: {line}", err=True)),
            )
        finally:
            bars.close()
        if output is not None:
            with open(output, "w") as stream:
                json.dump(results[0], stream)
    computed = [(result, figures(result)) for result in results]
    if plot is not None:
        plot_result(plot, results[0])
    if as_json:
        print_json([f for _, f in computed] if len(computed) > 1 else computed[0][1])
    else:
        click.echo(render(computed))
