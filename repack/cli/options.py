"""The options several ``repack`` commands share, defined once, and the parsers of option values.

As pip's ``cli/cmdoptions.py``: the run settings that size a Megatron run's datasets
(``--seq-length``, ``--split``, ``--train-samples``, ``--train-iters``,
``--global-batch-size``, ``--eval-iters``, ``--eval-interval``, ``--fma``/``--no-fma``,
``--mid-level-dataset-surplus``, ``--blend``), which ``repack doctor``, ``trace``, ``prepare``
and ``bench`` take; the loader's (``--micro-batch-size``, ``--data-parallel-size``, the sampler
and the batch-size schedule: :func:`loader_options`) and the mapping of all of them to
Megatron-LM's names (:func:`run_values`), of ``trace`` and ``bench``; ``--keep-superseded`` of
every command that edits a repack; ``--workers`` of ``merge`` and ``add``; ``--json`` and
``--quiet``; and the click callbacks that turn sizes, durations, codecs and splits into
values, with a usage error (exit 2) for a bad one. Options one command alone takes are
defined with that command.
"""

from __future__ import annotations

from collections.abc import Callable

import click

from repack.format.spec import ALIGNMENT
from repack.units import parse_duration, parse_size

__all__ = [
    "blend_option",
    "copy_workers_option",
    "json_option",
    "RUN_FLAGS",
    "keep_superseded_option",
    "loader_options",
    "run_values",
    "seed_option",
    "parse_codec_option",
    "parse_duration_option",
    "parse_memory",
    "parse_size_option",
    "parse_split_option",
    "quiet_option",
    "release_option",
    "run_options",
    "surplus_option",
]


def json_option(help: str) -> Callable:
    """``--json`` (parameter ``as_json``): print the result as JSON, saying what in ``help``."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def copy_workers_option(help: str) -> Callable:
    """``--workers K`` of `merge` and `add`: copy up to K shards at once, in K processes."""
    return click.option(
        "--workers",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        metavar="K",
        help=help,
    )


def quiet_option(help: str) -> Callable:
    """``-q``/``--quiet``: no progress output, saying what else in ``help``."""
    return click.option("-q", "--quiet", is_flag=True, help=help)


def parse_memory(value: str) -> int:
    """A memory size (``2TiB``, ``512MB``, bytes) in bytes; a usage error if it is none."""
    try:
        return parse_size(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def parse_duration_option(ctx, param, value: str) -> float:
    """Callback: a duration (``12h``, ``30m``, ``0``) in seconds."""
    try:
        return parse_duration(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


#: ``--keep-superseded``, of every command that edits a repack.
keep_superseded_option = click.option(
    "--keep-superseded",
    "keep_superseded",
    default=None,
    metavar="DURATION",
    callback=lambda ctx, param, value: (
        None if value is None else parse_duration_option(ctx, param, value)
    ),
    help="Keep the files this edit replaces this long for the readers that opened the repack "
    "before it; the first edit after that (or `repack gc`) deletes them. 12h, 30m, 0 (delete "
    "at once)... Default: 1d on object storage and on folders other machines mount (NFS, "
    "Lustre, GPFS, CephFS, SMB, FUSE...); on a folder only this machine mounts (ext4, xfs, "
    "tmpfs...), deleted at once: open files stay readable there.",
)


def parse_size_option(ctx, param, value: str) -> int:
    """Callback: a shard size in bytes, at least the alignment of a shard's segments."""
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


def parse_codec_option(value: str | None) -> tuple[str, int] | None:
    """``zstd[:LEVEL]`` as (codec, level); None for raw shards."""
    from repack.format.codec import parse_codec

    if value is None:
        return None
    try:
        return parse_codec(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def parse_split_option(ctx, param, value: str) -> str:
    """Callback: Megatron's ``--split`` string, checked as Megatron parses it, unchanged."""
    from repack.model.arithmetic import parse_split

    try:
        parse_split(value)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    return value


def _options(*decorators: Callable) -> Callable:
    """Apply option decorators in the order written (click lists them in --help so)."""

    def apply(command: Callable) -> Callable:
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


def run_options(required: bool) -> Callable:
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
            callback=parse_split_option,
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
        click.option(
            "--fma/--no-fma",
            "fma",
            default=_default_fma,
            show_default="the installed megatron-core's helper's, else this machine's",
            help="The rounding of BlendedDataset's error (weight x sample - drawn) in the "
            "Megatron build of the run: --fma once, as its aarch64 builds (GH200, GB200) "
            "compute it; --no-fma twice, as its x86-64 builds. The order of a blend's samples "
            "differs between the two.",
        ),
    )


def _iterations_to_skip(ctx, param, value: tuple[str, ...]) -> tuple[int, ...]:
    found = []
    for item in value:
        for part in item.replace(",", " ").split():
            try:
                found.append(int(part))
            except ValueError:
                raise click.BadParameter(f"{part!r}: expected iteration numbers") from None
    return tuple(found)


#: The run's values (Megatron-LM's names) -> the click parameter giving each, of the commands
#: that take the run settings and the loader's (`trace`, `bench`).
RUN_FLAGS = {
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


def run_values() -> tuple[dict, set[str]]:
    """The run's values by Megatron-LM's names, from the current command's click parameters of
    :data:`RUN_FLAGS`, and the names typed on the command line (which replace a checkpoint's)."""
    ctx = click.get_current_context()
    params = ctx.params
    values = {name: params[param] for name, param in RUN_FLAGS.items()}
    values["data_sharding"] = not params["no_data_sharding"]
    values["rampup_batch_size"] = params["rampup_batch_size"] or None
    typed = {
        name
        for name, param in RUN_FLAGS.items()
        if ctx.get_parameter_source(param) is not click.core.ParameterSource.DEFAULT
    }
    return values, typed


def loader_options(command: Callable) -> Callable:
    """Megatron-LM's flags that say which samples each rank's loader reads when, shared by
    `trace` and `bench`: the batch sizes, the ranks, the sampler, the batch-size schedule."""
    return _options(
        click.option(
            "--micro-batch-size",
            type=click.IntRange(min=1),
            help="Megatron's --micro-batch-size (required without --checkpoint).",
        ),
        click.option(
            "--data-parallel-size",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Data-parallel ranks (world size / (tensor x pipeline x context parallel)).",
        ),
        click.option(
            "--dataloader-type",
            type=click.Choice(["single", "cyclic", "external"]),
            default="single",
            show_default=True,
            help="Megatron's --dataloader-type (external is refused: the run's own loader "
            "decides).",
        ),
        click.option(
            "--no-data-sharding",
            "no_data_sharding",
            is_flag=True,
            help="Megatron's --no-data-sharding (cyclic loader).",
        ),
        click.option(
            "--iterations-to-skip",
            multiple=True,
            callback=_iterations_to_skip,
            metavar="N[,N...]",
            help="Megatron's --iterations-to-skip, as given to the run (counted from 0 before "
            "Megatron-LM 0.17, from 1 since: see --megatron-release).",
        ),
        click.option(
            "--rampup-batch-size",
            type=int,
            nargs=3,
            metavar="START INCREMENT SAMPLES",
            help="Megatron's --rampup-batch-size (applied by Megatron-LM 0.17 and earlier).",
        ),
        click.option(
            "--step-batch-size-schedule",
            metavar="'THRESHOLD:BS ...'",
            help="Megatron's --step-batch-size-schedule (Megatron-LM 0.18 and later).",
        ),
        click.option(
            "--eval-micro-batch-size", type=click.IntRange(min=1), help="Megatron-LM 0.18+."
        ),
        click.option(
            "--eval-global-batch-size", type=click.IntRange(min=1), help="Megatron-LM 0.18+."
        ),
        click.option("--start-eval-at-iter", type=click.IntRange(min=0), help="Megatron-LM 0.17+."),
    )(command)


def _default_fma() -> bool:
    """``--fma``'s default: the installed megatron-core's helper's rounding, else this
    machine's (:func:`repack.model.rounding.default_fma`)."""
    from repack.model.rounding import default_fma

    return default_fma()


#: ``--mid-level-dataset-surplus``, of `doctor` and `trace`.
surplus_option = click.option(
    "--mid-level-dataset-surplus",
    "surplus",
    type=click.FloatRange(min=0),
    default=0.005,
    show_default=True,
    help="Megatron's --mid-level-dataset-surplus.",
)
#: ``--seed``, of `trace`, `prepare` and `bench`.
seed_option = click.option(
    "--seed", type=int, default=1234, show_default=True, help="Megatron's --seed."
)
#: ``--megatron-release``, of `trace`, `prepare` and `bench` (the doctor's says what it changes
#: in its figures).
release_option = click.option(
    "--megatron-release",
    metavar="X.Y",
    help="The Megatron-LM release of the run [default: the megatron-core installed].",
)
#: ``--blend``, of `doctor` and `trace`: a blend file looked up in a repack.
blend_option = click.option(
    "--blend",
    "blend_file",
    type=click.Path(dir_okay=False),
    help="With a repack: look up this blend file's prefixes in it, as the loader does, "
    "instead of the blend recorded at merge time.",
)
