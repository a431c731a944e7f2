"""``repack prepare``: build a run's cached indices before the job.

This module owns the command and the flags only it takes (``--tokenizer-identifiers``,
``--workers``); the run settings it shares with ``repack doctor`` and ``repack trace`` come
from :mod:`repack.cli.options`. It parses, runs :func:`repack.trace.prepare.prepare` and
prints what was built.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import click

from repack.cli.exits import EXIT_CODES, handle_errors
from repack.cli.options import (
    blend_option,
    json_option,
    quiet_option,
    release_option,
    run_options,
    seed_option,
    surplus_option,
)
from repack.cli.output import print_json

__all__ = ["prepare"]

#: prepare's values (Megatron-LM's names) -> the click parameter giving each.
_FLAGS = {
    "seq_length": "seq_length",
    "split": "split",
    "seed": "seed",
    "global_batch_size": "global_batch_size",
    "train_samples": "train_samples",
    "train_iters": "train_iters",
    "eval_interval": "eval_interval",
    "eval_iters": "eval_iters",
    "mid_level_dataset_surplus": "surplus",
    "data_cache_path": "data_cache_path",
    "eval_global_batch_size": "eval_global_batch_size",
    "start_eval_at_iter": "start_eval_at_iter",
}


def _identifiers(ctx, param, value: str | None) -> OrderedDict | None:
    if value is None:
        return None
    try:
        found = json.loads(value, object_pairs_hook=OrderedDict)
    except ValueError as err:
        raise click.BadParameter(f"not JSON ({err})") from None
    if not isinstance(found, dict):
        raise click.BadParameter("expected a JSON object, the tokenizer's unique_identifiers")
    return found


@click.command(epilog=EXIT_CODES)
@click.argument("target", metavar="REPACK", type=click.Path())
@click.option(
    "--checkpoint",
    type=click.Path(),
    metavar="DIR",
    help="A checkpoint of the run (Megatron-LM's --save, or Megatron-Bridge's; or one "
    "iter_NNNNNNN folder): its saved arguments are the run's settings; the flags typed here "
    "replace them.",
)
@run_options(required=False)
@surplus_option
@blend_option
@seed_option
@click.option(
    "--eval-global-batch-size",
    type=click.IntRange(min=1),
    help="Megatron-LM 0.18+ (default --global-batch-size): the validation split's samples.",
)
@click.option(
    "--start-eval-at-iter",
    type=click.IntRange(min=0),
    help="Megatron-LM 0.17+: the validation split's samples.",
)
@click.option(
    "--data-cache-path",
    type=click.Path(file_okay=False),
    help="Megatron's --data-cache-path, as the job will give it [default: the repack's own "
    "cache, OUT/cache/GPTDataset_indices, where the job caches without it].",
)
@click.option(
    "--tokenizer-identifiers",
    "tokenizer",
    callback=_identifiers,
    metavar="JSON",
    help="The job's tokenizer's unique_identifiers, as JSON in their order (they enter every "
    "cache name; print them in the job's environment with "
    "json.dumps(tokenizer.unique_identifiers)) [default: those an earlier job recorded in "
    "the cache folder, else repack's placeholder, which no job's tokenizer has].",
)
@release_option
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Build the per-source indices in N processes (the blending indices last, in this one).",
)
@json_option("Print what was built as JSON.")
@quiet_option("No progress bar or log lines.")
@handle_errors
def prepare(
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
    eval_global_batch_size,
    start_eval_at_iter,
    data_cache_path,
    tokenizer,
    megatron_release,
    workers,
    as_json,
    quiet,
) -> None:
    """Build a run's cached indices before the job, so that its ranks build none.

    REPACK is the repack the run reads. Every split's per-source indices (one pack and a
    catalog) and every split's blending index (BlendedDataset's files) are built with the
    megatron-core installed, as the job's BlendedMegatronDatasetBuilder with repack's class
    builds them, into the folder the job will cache in: --data-cache-path as the job gives it,
    else the repack's own cache. The job then finds every file and writes none.

    Give the job's settings, with Megatron-LM's flag names, or --checkpoint. Megatron names
    each cached file by a hash of its dataset's description: the prefix as the blend names it,
    the samples asked of it (from --train-iters or --train-samples, --global-batch-size,
    --eval-iters, --eval-interval, the weights and --mid-level-dataset-surplus), --seed,
    --seq-length, --split (the string as given) and the tokenizer's identifiers
    (--tokenizer-identifiers). Another value of any of them, and the job builds its own.

    Running it again builds nothing ("nothing to build: N files already there").

    \b
    Examples:
      repack prepare /lustre/me/blend.repack --seq-length 4096 --split 99,1,0 \\
        --train-iters 100000 --global-batch-size 512 --workers 8
      repack prepare /lustre/me/blend.repack --checkpoint ckpts/ --data-cache-path /scratch/idx
    """
    from repack.progress import Display
    from repack.trace.prepare import prepare as run
    from repack.units import format_size, plural

    if checkpoint is None and seq_length is None:
        raise click.UsageError("Missing option '--seq-length' (or give --checkpoint).")
    values = {
        "seq_length": seq_length,
        "split": split,
        "seed": seed,
        "global_batch_size": global_batch_size,
        "train_samples": train_samples,
        "train_iters": train_iters,
        "eval_interval": eval_interval,
        "eval_iters": eval_iters,
        "mid_level_dataset_surplus": surplus,
        "data_cache_path": data_cache_path,
        "eval_global_batch_size": eval_global_batch_size,
        "start_eval_at_iter": start_eval_at_iter,
    }
    ctx = click.get_current_context()
    typed = {
        name
        for name, param in _FLAGS.items()
        if ctx.get_parameter_source(param) is not click.core.ParameterSource.DEFAULT
    }
    bars = Display(quiet)
    try:
        done = run(
            target,
            values,
            typed=typed,
            checkpoint=checkpoint,
            release=megatron_release,
            blend_file=blend_file,
            tokenizer=tokenizer,
            fma=fma,
            workers=workers,
            progress=bars,
            say=None if quiet else (lambda line: click.echo(f"repack: {line}", err=True)),
        )
    finally:
        bars.close()
    if as_json:
        print_json(done.to_json())
    elif not done.files:
        click.echo(
            f"nothing to build: {plural(done.present, 'file')} already there in {done.folder} "
            f"({plural(done.datasets, 'dataset', grouped=True)})"
        )
    else:
        click.echo(
            f"built the indices of {plural(done.datasets, 'dataset', grouped=True)} into "
            f"{done.folder}: {plural(len(done.files), 'file')}, {format_size(done.bytes)} in "
            f"{done.seconds:.1f} s"
        )
