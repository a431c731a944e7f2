"""``repack trace``: the data a Megatron run read at an iteration, or where it read a document.

This module owns the command, the flags only it takes (the question: ``--iteration``,
``--iterations``, ``--document``, ``--source``; the loader's and the schedule's settings;
``--checkpoint``, ``--phases``) and their parsers; the run settings it shares with
``repack doctor`` come from :mod:`repack.cli.options`. It parses, runs
:func:`repack.trace.run.trace` and prints the answer.
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

__all__ = ["trace"]


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


@click.command(epilog=EXIT_CODES)
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
@run_options(required=False)
@surplus_option
@blend_option
@seed_option
@loader_options
@click.option(
    "--data-cache-path",
    type=click.Path(file_okay=False),
    help="Megatron's --data-cache-path: its cached indices are read when they match, and what "
    "is built goes there (a repack's default: its own cache folder).",
)
@release_option
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
@json_option("Print the answer as JSON.")
@quiet_option("No progress lines or notes on stderr.")
@handle_errors
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

    --fma / --no-fma: the run's Megatron rounds BlendedDataset's error once (its aarch64
    builds: GH200, GB200) or twice (its x86-64 builds), and the two draw another order; the
    default is this machine's megatron-core's. To trace a run of aarch64 nodes from an x86-64
    machine, give --fma (a warning says the order is the other machine's).

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
    values, typed = run_values()
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
        fma=fma,
    )
    if as_json:
        click.echo(json.dumps(answer.to_json(), sort_keys=True))
    else:
        click.echo(render(answer))
