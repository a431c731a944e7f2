"""A training run's data settings as its checkpoint holds them: the Megatron-LM arguments
read (:data:`KEYS`), the :class:`RunSettings` that hold them, and what a reader of them should
know (:func:`notes_on`), whichever tool wrote the checkpoint (:mod:`repack.trace.checkpoints`,
:mod:`repack.trace.bridge_checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from repack.trace import torchfile

__all__ = ["KEYS", "RunSettings", "notes_on", "plain"]

#: The Megatron-LM arguments read (those a checkpoint holds), in this order.
KEYS = (
    # the blend
    "data_path",
    "train_data_path",
    "valid_data_path",
    "test_data_path",
    "data_args_path",
    "per_split_data_args_path",
    "split",
    "data_cache_path",
    "mmap_bin_files",
    "mock_data",
    # the datasets' indices
    "seq_length",
    "seed",
    "mid_level_dataset_surplus",
    # batches and ranks
    "global_batch_size",
    "micro_batch_size",
    "rampup_batch_size",
    "step_batch_size_schedule",
    "decrease_batch_size_if_needed",
    "data_parallel_size",
    "world_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "dataloader_type",
    "data_sharding",
    # how long, and evaluation
    "train_samples",
    "train_iters",
    "eval_interval",
    "eval_iters",
    "eval_global_batch_size",
    "eval_micro_batch_size",
    "full_validation",
    "multiple_validation_sets",
    "skip_train",
    # iterations skipped, phases
    "iterations_to_skip",
    "phase_transition_iterations",
    "override_ckpt_iteration",
    # what a trace cannot reproduce (it refuses them)
    "hybrid_context_parallel",
    "sft",
    "fim_data",
    # progress at the checkpoint
    "iteration",
    "consumed_train_samples",
    "skipped_train_samples",
    "consumed_valid_samples",
    # the tokenizer (for showing text)
    "tokenizer_type",
    "tokenizer_model",
)

#: Keys only recent Megatron-LM releases have: their absence is no loss (the option did not
#: exist), and the notes say so.
_NEWER_KEYS = frozenset(
    {
        "step_batch_size_schedule",
        "phase_transition_iterations",
        "override_ckpt_iteration",
        "eval_global_batch_size",
        "eval_micro_batch_size",
        "full_validation",
        "multiple_validation_sets",
        "hybrid_context_parallel",
    }
)

_LAST_LAUNCH = (
    "the saved arguments describe only the last launch (the one that wrote iteration {it}); "
    "earlier launches of the run may have used other settings (batch size, blend, iterations to "
    "skip): trace their iterations with their own flags"
)


@dataclass(frozen=True)
class RunSettings:
    """A training run's data settings as its checkpoint holds them.

    Attributes:
        values: By Megatron-LM argument name (``args.<name>``, :data:`KEYS`): what the checkpoint
            holds of them, nothing else (a key absent was not saved).
        iteration: The iteration of the checkpoint read (for a ``release`` checkpoint, the
            one it saved, if any).
        source: What wrote it and in which format: ``"Megatron-LM (torch)"``,
            ``"Megatron-LM (torch_dist)"`` or ``"Megatron-Bridge (torch_dist)"``.
        notes: What a reader of these values should know: that saved arguments describe only
            the last launch, the values absent, the counters that disagree.
        path: The checkpoint folder read (``DIR/iter_NNNNNNN``).
    """

    values: dict[str, Any]
    iteration: int | None
    source: str
    notes: list[str] = field(default_factory=list)
    path: str = ""


def plain(value: Any) -> Any:
    """``value`` as plain Python: NumPy scalars and arrays to numbers and lists, tuples to
    lists, an :class:`repack.trace.torchfile.Opaque` to its value's text."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, torchfile.Opaque):
        return repr(value)
    return value


def notes_on(values: dict[str, Any], iteration: int | None, bridge: bool = False) -> list[str]:
    notes = [_LAST_LAUNCH.format(it="release" if iteration is None else iteration)]
    absent = [k for k in KEYS if k not in values]
    newer = [k for k in absent if k in _NEWER_KEYS]
    other = [k for k in absent if k not in _NEWER_KEYS]
    if other:
        notes.append(f"not in the checkpoint: {', '.join(other)}")
    if newer:
        why = (
            "Megatron-Bridge has no such option"
            if bridge
            else "later Megatron-LM releases' options"
        )
        notes.append(f"not in the checkpoint ({why}): {', '.join(newer)}")
    consumed = values.get("consumed_train_samples")
    batch = values.get("global_batch_size")
    if (
        isinstance(consumed, int)
        and isinstance(batch, int)
        and isinstance(iteration, int)
        and not values.get("rampup_batch_size")
        and not values.get("step_batch_size_schedule")
        and consumed != iteration * batch
    ):
        notes.append(
            f"consumed_train_samples is {consumed:,}, not iteration {iteration:,} x "
            f"global_batch_size {batch:,} = {iteration * batch:,}: earlier launches used "
            "another batch size (or a ramp-up, or --override-ckpt-iteration)"
        )
    for key in ("data_args_path", "per_split_data_args_path"):
        if values.get(key):
            notes.append(
                f"{key} names a file ({values[key]}) read at launch: the checkpoint keeps its "
                "name, not its content, which may have changed since"
            )
    if values.get("override_ckpt_iteration") is not None:
        notes.append(
            f"the launch that saved was started with --override-ckpt-iteration "
            f"{values['override_ckpt_iteration']}: its data restarted at that iteration's "
            "samples, not where the checkpoint it loaded stopped"
        )
    return notes
