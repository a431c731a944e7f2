"""A run's settings, by Megatron-LM's argument names, and what ``trace`` derives from them.

:meth:`TraceSettings.from_values` takes a dict keyed as Megatron-LM's ``args`` are
(``seq_length``, ``global_batch_size``, ``iterations_to_skip``...): the command line's flags
fill it, and so can the arguments a run's checkpoint saved. Everything that decides which
sample an iteration reads is here; what ``trace`` cannot reproduce exactly is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from repack.errors import InputError
from repack.releases import release_of

if TYPE_CHECKING:
    from repack.format.blend import Blend
    from repack.trace.run_settings import RunSettings

__all__ = [
    "DEFAULTS",
    "TraceSettings",
    "UnsupportedRun",
    "checkpoint_blend",
    "release_of",
    "with_checkpoint",
]


class UnsupportedRun(InputError):
    """A run whose samples ``trace`` cannot name exactly (an external loader, hybrid context
    parallel's re-balancing, packed or SFT datasets, ...)."""


#: Megatron-LM's defaults for the arguments trace reads.
DEFAULTS: dict[str, Any] = {
    "seq_length": None,
    "split": "969, 30, 1",
    "seed": 1234,
    "global_batch_size": None,
    "micro_batch_size": None,
    "data_parallel_size": 1,
    "train_samples": None,
    "train_iters": None,
    "eval_interval": 1000,
    "eval_iters": 100,
    "eval_micro_batch_size": None,
    "eval_global_batch_size": None,
    "start_eval_at_iter": None,
    "mid_level_dataset_surplus": 0.005,
    "dataloader_type": "single",
    "data_sharding": True,
    "iterations_to_skip": (),
    "rampup_batch_size": None,
    "step_batch_size_schedule": None,
    "data_cache_path": None,
    "mmap_bin_files": True,
}

#: Arguments whose non-default value trace refuses, and why.
REFUSED: dict[str, str] = {
    "hybrid_context_parallel": "hybrid context parallel re-balances each global batch's "
    "samples across ranks at run time",
    "sft": "SFT datasets (packed conversations) are not the GPTDataset trace rebuilds",
    "mock_data": "mock data is generated, not read from the blend",
    "full_validation": "--full-validation reads the whole validation set with its own sampler",
    "skip_train": "--skip-train trains nothing",
    "decrease_batch_size_if_needed": "--decrease-batch-size-if-needed is not reproduced",
    "phase_transition_iterations": "the run is in blend phases "
    "(--phase-transition-iterations): give --phases FILE, its phase schedule",
    "multiple_validation_sets": "multiple validation sets are not traced",
}


#: Pairs of arguments Megatron-LM takes one of: a flag typed replaces the checkpoint's other.
_EITHER = (
    ("train_samples", "train_iters"),
    ("global_batch_size", "step_batch_size_schedule"),
)


def with_checkpoint(
    saved: dict[str, Any], flags: dict[str, Any], typed: set[str] | frozenset[str]
) -> dict[str, Any]:
    """A run's arguments: what its checkpoint saved, the flags typed over them.

    Args:
        saved: :attr:`repack.trace.run_settings.RunSettings.values` (Megatron-LM's names).
        flags: Every argument the command line holds, typed or defaulted (Megatron-LM's names).
        typed: The names in ``flags`` given on the command line: they replace the saved
            values; the others only fill what the checkpoint does not hold.
    """
    names = set(DEFAULTS) | set(REFUSED)
    merged = {k: saved[k] for k in names if k in saved}
    if merged.get("data_parallel_size") is None and saved.get("world_size"):
        model = 1
        for key in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
        ):
            model *= int(saved.get(key) or 1)
        merged["data_parallel_size"] = int(saved["world_size"]) // model
    for one, other in _EITHER:
        for a, b in ((one, other), (other, one)):
            if a in typed and b not in typed:
                merged.pop(b, None)
    for key, value in flags.items():
        if key in typed or merged.get(key) is None:
            merged[key] = value
    return merged


def checkpoint_blend(run: RunSettings) -> Blend | None:
    """The blend a run's checkpoint names (``data_path``, the per-split paths, or the file
    ``data_args_path`` / ``per_split_data_args_path`` names), or None if it names none.

    Relative prefixes resolve against the working directory, as Megatron-LM resolved them
    against its own.

    Raises:
        InputError: the blend is named by a file that is not there.
        BlendError: the blend saved is not one Megatron-LM reads.
    """
    import json
    import os

    from repack.inputs.blend_files import load_blend, parse_blend_text

    v = run.values
    where = run.path or "the checkpoint"
    for key in ("data_args_path", "per_split_data_args_path"):
        if v.get(key):
            if not os.path.isfile(v[key]):
                raise InputError(
                    f"{where}: the run read its blend from {key} {v[key]}, which is not there: "
                    "give the blend (BLEND_OR_REPACK) or put the file back"
                )
            return load_blend(v[key])
    if v.get("data_path"):
        data: Any = [str(x) for x in v["data_path"]]
        key = "data_path"
    elif any(v.get(f"{split}_data_path") for split in ("train", "valid", "test")):
        data = {s: v.get(f"{s}_data_path") or None for s in ("train", "valid", "test")}
        key = "train_data_path, valid_data_path, test_data_path"
    else:
        return None
    return parse_blend_text(json.dumps(data), source=f"{where} ({key})", folder=os.getcwd())


@dataclass(frozen=True)
class TraceSettings:
    """What decides which samples an iteration reads.

    Attributes:
        values: Every argument, Megatron-LM's name -> value (defaults filled in).
        release: ``(major, minor)`` of the Megatron-LM release the run trained with.
        train_iters: Iterations of the run (``update_train_iters``).
        sizes: Samples asked of train, valid and test.
    """

    values: dict[str, Any]
    release: tuple[int, int]
    train_iters: int
    sizes: tuple[int, int, int]
    skipped: frozenset[int] = field(default=frozenset())

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)

    @classmethod
    def from_values(cls, values: dict[str, Any], release: tuple[int, int]) -> TraceSettings:
        """Check and complete a run's arguments, as Megatron-LM's ``validate_args`` would.

        Raises:
            UnsupportedRun: something trace cannot reproduce exactly.
            InputError: arguments Megatron-LM itself would refuse.
        """
        from repack.model.arithmetic import training_samples
        from repack.trace.batches import Schedule, parse_step_schedule

        merged = {**DEFAULTS, **{k: v for k, v in values.items() if v is not None}}
        for name, why in REFUSED.items():
            if merged.get(name):
                raise UnsupportedRun(f"repack trace cannot name this run's samples exactly: {why}")
        if merged["dataloader_type"] == "external":
            raise UnsupportedRun(
                "repack trace cannot name the samples of --dataloader-type external: the run "
                "brings its own data loader and sampler"
            )
        if merged["dataloader_type"] not in ("single", "cyclic"):
            raise InputError(f"--dataloader-type {merged['dataloader_type']!r}: not Megatron's")
        for name in ("seq_length", "micro_batch_size"):
            if not merged[name]:
                raise InputError(f"--{name.replace('_', '-')} is needed")
        mbs, dp = int(merged["micro_batch_size"]), int(merged["data_parallel_size"])
        steps = None
        if merged["step_batch_size_schedule"] is not None:
            if release < (0, 18):
                raise InputError(
                    "--step-batch-size-schedule exists from Megatron-LM 0.18 on; the run's "
                    f"release is {release[0]}.{release[1]} (see --megatron-release)"
                )
            if values.get("global_batch_size") is not None:
                raise InputError(
                    "Cannot specify both --step-batch-size-schedule and --global-batch-size "
                    "(Megatron-LM refuses it)"
                )
            try:
                steps = tuple(
                    parse_step_schedule(merged["step_batch_size_schedule"], merged["seq_length"])
                )
            except ValueError as err:
                raise InputError(f"--step-batch-size-schedule: {err}") from None
        rampup = merged["rampup_batch_size"]
        if rampup is not None:
            rampup = tuple(int(x) for x in rampup)
            if len(rampup) != 3:
                raise InputError("--rampup-batch-size takes three numbers: START INCREMENT SAMPLES")
            if release >= (0, 18):
                rampup = None  # deprecated and ignored by Megatron-LM 0.18 and later
            elif merged["train_samples"] is None:
                raise InputError(
                    "--rampup-batch-size needs --train-samples (Megatron-LM refuses "
                    "--train-iters with it)"
                )
        if merged["global_batch_size"] is None:
            merged["global_batch_size"] = mbs * dp  # Megatron-LM's default
        gbs = int(merged["global_batch_size"])
        schedule = Schedule(mbs, dp, gbs, rampup, steps)
        try:
            schedule.check()
        except ValueError as err:
            raise InputError(str(err)) from None
        if (merged["train_samples"] is None) == (merged["train_iters"] is None):
            raise InputError("give one of --train-samples and --train-iters")
        if merged["train_iters"] is not None:
            train_iters = int(merged["train_iters"])
        else:
            train_iters = schedule.iterations_for(int(merged["train_samples"]), release)
        if release >= (0, 18):
            if merged["eval_global_batch_size"] is None:
                merged["eval_global_batch_size"] = gbs
            if merged["eval_micro_batch_size"] is None:
                merged["eval_micro_batch_size"] = mbs
        else:
            for name in ("eval_global_batch_size", "eval_micro_batch_size"):
                if merged[name] is not None:
                    raise InputError(
                        f"--{name.replace('_', '-')} exists from Megatron-LM 0.18 on; the run's "
                        f"release is {release[0]}.{release[1]}"
                    )
            merged["eval_global_batch_size"], merged["eval_micro_batch_size"] = gbs, mbs
            if merged["start_eval_at_iter"] is not None and release < (0, 17):
                raise InputError("--start-eval-at-iter is not in this Megatron-LM release")
        egbs, emb = int(merged["eval_global_batch_size"]), int(merged["eval_micro_batch_size"])
        if egbs % (emb * dp):
            raise InputError(
                f"eval global batch size {egbs} is not divisible by eval micro batch size {emb} "
                f"times data-parallel size {dp}"
            )
        train, valid, test = training_samples(
            global_batch_size=gbs,
            train_iters=train_iters,
            eval_iters=int(merged["eval_iters"]),
            eval_interval=int(merged["eval_interval"]),
            eval_global_batch_size=egbs,
            start_eval_at_iter=merged["start_eval_at_iter"],
        )
        if merged["train_samples"] is not None:
            train = int(merged["train_samples"])
        skip = {int(i) for i in merged["iterations_to_skip"] or ()}
        if release < (0, 17):  # `iteration in args.iterations_to_skip`, before counting it
            skip = {i + 1 for i in skip}
        return cls(
            values=merged,
            release=release,
            train_iters=train_iters,
            sizes=(train, valid, test),
            skipped=frozenset(skip),
        )

    @property
    def schedule(self):
        from repack.trace.batches import Schedule, parse_step_schedule

        v = self.values
        steps = None
        if v["step_batch_size_schedule"] is not None:
            steps = tuple(parse_step_schedule(v["step_batch_size_schedule"], v["seq_length"]))
        rampup = v["rampup_batch_size"]
        if rampup is not None and self.release < (0, 18):
            rampup = tuple(int(x) for x in rampup)
        else:
            rampup = None
        return Schedule(
            int(v["micro_batch_size"]),
            int(v["data_parallel_size"]),
            int(v["global_batch_size"]),
            rampup,  # type: ignore[arg-type]
            steps,
        )

    def eval_points(self) -> list[int]:
        """The iterations after which an evaluation reads the validation set, in order: every
        ``eval_interval`` (from ``--start-eval-at-iter``), then once more after the last."""
        v = self.values
        if not v["eval_iters"]:
            return []
        interval = int(v["eval_interval"])
        start = v["start_eval_at_iter"]
        points = [
            i
            for i in range(interval, self.train_iters + 1, interval)
            if start is None or i >= start
        ]
        return [*points, self.train_iters]
