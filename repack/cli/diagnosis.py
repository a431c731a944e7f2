"""``repack doctor``: what Megatron will do with a blend, before a training job finds out.

This module owns the command and its own flags (the duplicate analysis, the machine's limits,
the plot, ``--phases``); the run settings it shares with ``repack trace`` come from
:mod:`repack.cli.options`. It parses, runs :func:`repack.doctor.doctor` (or, with ``--phases``,
:func:`repack.doctor.phase_report.examine_phases`) and prints the report; exit status 1 when a
problem would stop or hang training.
"""

from __future__ import annotations

import json
import os
import re
import sys

import click

from repack.cli.exits import EXIT_DAMAGED, handle_errors
from repack.cli.options import (
    blend_option,
    json_option,
    parse_memory,
    quiet_option,
    run_options,
    surplus_option,
)
from repack.progress import Display

__all__ = ["DOCTOR_EXIT", "doctor"]


def _release(value: str | None) -> tuple[int, int] | None:
    from repack.releases import release_of

    if value is None:
        return None
    if not re.fullmatch(r"\s*\d+\.\d+(\.\d+)?\s*", value):
        raise click.BadParameter(f"{value!r}: expected a release such as 0.12 or 0.16.1")
    return release_of(value)


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


@click.command(epilog=DOCTOR_EXIT)
@click.argument("target", metavar="[BLEND_OR_REPACK]", type=click.Path(), required=False)
@run_options(required=True)
@click.option(
    "--samples",
    callback=_samples,
    metavar="TRAIN,VALID,TEST",
    help="The samples asked of each split, as given to Megatron-Core's "
    "BlendedMegatronDatasetBuilder (Megatron-Bridge, NeMo); instead of the options above.",
)
@surplus_option
@blend_option
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
    "1234; a phase may set its own); without --phases, for the prepared-cache check only "
    "(default 1234).",
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
    callback=lambda c, p, v: None if v is None else parse_memory(v),
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
    default=32,  # repack.doctor.repeats.DEFAULT_MIN_TOKENS (tests/test_duplicates.py)
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
    callback=lambda c, p, v: parse_memory(v),
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
    "--data-cache-path",
    type=click.Path(file_okay=False),
    help="The job's --data-cache-path: warn (prepared-cache) when it holds indices of this "
    "blend prepared for another seed, sequence length or split and none for these [default: a "
    "repack folder's own cache].",
)
@click.option(
    "--megatron-release",
    callback=lambda c, p, v: _release(v),
    metavar="X.Y",
    help="The megatron-core release the run builds with: the figures follow its arithmetic "
    "where releases differ [default: the megatron-core installed, else the newest].",
)
@json_option("Print the report as JSON.")
@quiet_option("No progress bar or log lines.")
@handle_errors
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
    fma,
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
    data_cache_path,
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
    duplicate prefixes, mixed token dtypes, a blend whose order differs between Megatron's
    x86-64 and aarch64 builds (which round the blending error twice and once: --fma says
    which the draws follow). Then the files stock Megatron holds per process and
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
            fma=fma,
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
        fma=fma,
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
            data_cache_path=data_cache_path,
            seed=1234 if seed is None else seed,
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
        "fma", "as_json", "quiet",
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
    from repack.doctor.phase_report import examine_phases, render_phases
    from repack.model.splits import Settings, installed
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
        fma=kw["fma"],
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
