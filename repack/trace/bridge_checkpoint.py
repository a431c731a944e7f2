"""Megatron-Bridge's checkpoints: ``iter_NNNNNNN/run_config.yaml`` (its whole
``ConfigContainer``) and ``train_state.pt``, read into Megatron-LM's argument names
(:data:`BRIDGE_FIELDS`), its inline ``blend`` and ``blend_per_split`` turned into Megatron-LM's
``data_path`` form. :mod:`repack.trace.checkpoints` finds the folder and calls
:func:`read_bridge`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from repack.errors import CheckpointMissing, CorruptCheckpoint, MissingExtra
from repack.trace import torchfile
from repack.trace.run_settings import KEYS, RunSettings, notes_on, plain

__all__ = ["BRIDGE_FIELDS", "bridge_step", "read_bridge"]

#: Megatron-Bridge's ``run_config.yaml`` fields (section, name) → Megatron-LM's argument name,
#: the first not null of each list winning (null if all there are): ``validation`` before the
#: ``train`` fields Bridge deprecated for it. The blend (``dataset.blend``, ``blend_per_split``,
#: ``data_path``) and the dataset's kind are read apart (:func:`_bridge_blend`).
BRIDGE_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "split": (("dataset", "split"),),
    "data_cache_path": (("dataset", "path_to_cache"),),
    "mmap_bin_files": (("dataset", "mmap_bin_files"),),
    "seq_length": (("dataset", "seq_length"), ("dataset", "sequence_length")),
    "seed": (("dataset", "random_seed"),),
    "mid_level_dataset_surplus": (("dataset", "mid_level_dataset_surplus"),),
    "dataloader_type": (("dataset", "dataloader_type"),),
    "data_sharding": (("dataset", "data_sharding"),),
    "global_batch_size": (("train", "global_batch_size"),),
    "micro_batch_size": (("train", "micro_batch_size"),),
    "rampup_batch_size": (("train", "rampup_batch_size"),),
    "step_batch_size_schedule": (("train", "step_batch_size_schedule"),),
    "decrease_batch_size_if_needed": (("train", "decrease_batch_size_if_needed"),),
    "data_parallel_size": (("dataset", "data_parallel_size"), ("", "data_parallel_size")),
    "tensor_model_parallel_size": (("model", "tensor_model_parallel_size"),),
    "pipeline_model_parallel_size": (("model", "pipeline_model_parallel_size"),),
    "context_parallel_size": (("model", "context_parallel_size"),),
    "hybrid_context_parallel": (
        ("model", "hybrid_context_parallel"),
        ("dataset", "hybrid_context_parallel"),
    ),
    "mock_data": (("dataset", "mock"),),
    "train_samples": (("train", "train_samples"),),
    "train_iters": (("train", "train_iters"),),
    "eval_interval": (("validation", "eval_interval"), ("train", "eval_interval")),
    "eval_iters": (("validation", "eval_iters"), ("train", "eval_iters")),
    "eval_global_batch_size": (("validation", "eval_global_batch_size"),),
    "eval_micro_batch_size": (("validation", "eval_micro_batch_size"),),
    "full_validation": (("validation", "full_validation"),),
    "multiple_validation_sets": (("validation", "multiple_validation_sets"),),
    "skip_train": (("validation", "skip_train"), ("train", "skip_train")),
    "iterations_to_skip": (("train", "iterations_to_skip"),),
    "tokenizer_type": (("tokenizer", "tokenizer_type"),),
    "tokenizer_model": (("tokenizer", "tokenizer_model"),),
}

#: The train-state counters Bridge saves, by Megatron-LM argument name.
_TRAIN_STATE = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")

#: The largest ``run_config.yaml`` read (a whole ConfigContainer: tens of kilobytes; a blend of
#: tens of thousands of prefixes: some megabytes).
_MAX_CONFIG_BYTES = 256 << 20


def read_bridge(folder: Path, found: int | None) -> RunSettings:
    config_file = folder / "run_config.yaml"
    config = _load_yaml(config_file)
    state_file = folder / "train_state.pt"
    if not state_file.is_file():
        raise CheckpointMissing(
            f"{state_file}: missing beside run_config.yaml (Megatron-Bridge writes both): the "
            "save did not finish, or the folder was cut",
            path=str(state_file),
        )
    state = torchfile.load(state_file)
    iteration = bridge_step(state_file, state)
    if found is not None and iteration != found:
        raise CorruptCheckpoint(
            f"{state_file}: holds step {iteration}, in the folder of iteration {found}",
            path=str(state_file),
        )
    values: dict[str, Any] = {}
    notes: list[str] = []
    for key, places in BRIDGE_FIELDS.items():
        for section, name in places:  # the first not null; null if all that are there are
            part = config if not section else config.get(section)
            if isinstance(part, Mapping) and name in part:
                if part[name] is not None or key not in values:
                    values[key] = plain(part[name])
                if part[name] is not None:
                    break
    blend = _bridge_blend(config["dataset"], config_file, notes)
    values.update({k: v for k, v in blend.items() if v is not None or k not in values})
    values["iteration"] = iteration
    for key in _TRAIN_STATE:
        if key in state:
            values[key] = plain(state[key])
    values = {key: values[key] for key in KEYS if key in values}
    rng = config.get("rng")
    notes = notes_on(values, iteration, bridge=True) + notes
    if isinstance(rng, Mapping) and rng.get("seed") not in (None, values.get("seed")):
        notes.append(
            f"seed is the dataset's (dataset.random_seed {values.get('seed')}), which orders "
            f"the samples; the model's rng.seed is {rng['seed']}"
        )
    checkpoint = config.get("checkpoint")
    if isinstance(checkpoint, Mapping) and not (
        checkpoint.get("load") or checkpoint.get("pretrained_checkpoint")
    ):
        notes[0] = (
            f"the launch that wrote iteration {iteration} loaded no checkpoint (no "
            "checkpoint.load): its settings are the run's from iteration 0"
        )
    fmt = checkpoint.get("ckpt_format") if isinstance(checkpoint, Mapping) else None
    source = f"Megatron-Bridge ({fmt})" if isinstance(fmt, str) else "Megatron-Bridge"
    return RunSettings(values, iteration, source, notes, str(folder))


def bridge_step(state_file: Path, state: Any = None) -> int:
    """The ``step`` of Megatron-Bridge's ``TrainState`` saved in ``state_file`` (read unless
    ``state`` is given)."""
    if state is None:
        state = torchfile.load(state_file)
    if not isinstance(state, Mapping) or "step" not in state:
        raise CorruptCheckpoint(
            f"{state_file}: no 'step': not Megatron-Bridge's TrainState", path=str(state_file)
        )
    step = plain(state["step"])
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CorruptCheckpoint(
            f"{state_file}: step is {step!r}, not an iteration number", path=str(state_file)
        )
    return step


def _load_yaml(config_file: Path) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:
        raise MissingExtra(
            f"{config_file}: reading Megatron-Bridge's run_config.yaml needs PyYAML: pip "
            "install 'megatron-repack[yaml]'",
            path=str(config_file),
        ) from None
    try:
        with open(config_file, "rb") as f:
            raw = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise CorruptCheckpoint(
            f"{config_file}: cannot read: {err.strerror or err}", path=str(config_file)
        ) from None
    if len(raw) > _MAX_CONFIG_BYTES:
        raise CorruptCheckpoint(
            f"{config_file}: larger than the {_MAX_CONFIG_BYTES:,} bytes read",
            path=str(config_file),
        )
    try:
        config = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise CorruptCheckpoint(
            f"{config_file}: not YAML: {' '.join(str(err).split())}", path=str(config_file)
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("dataset"), dict):
        raise CorruptCheckpoint(
            f"{config_file}: no 'dataset' section: not Megatron-Bridge's ConfigContainer",
            path=str(config_file),
        )
    return config


#: Megatron-LM's ways of naming a blend, all of which Bridge's inline blend stands for.
_BLEND_KEYS = (
    "data_path",
    "train_data_path",
    "valid_data_path",
    "test_data_path",
    "data_args_path",
    "per_split_data_args_path",
)

#: Megatron-Bridge dataset config classes (the end of their ``_target_``) that are not plain
#: GPT pretraining data, and the Megatron-LM argument that says so.
_BRIDGE_KINDS = {
    "MockGPTDatasetConfig": ("mock_data", True),
    "GPTFIMDatasetConfig": ("fim_data", True),
    "EnergonDatasetConfig": ("dataloader_type", "external"),
}


def _bridge_blend(dataset: Any, config_file: Path, notes: list[str]) -> dict[str, Any]:
    """The blend of Bridge's ``dataset`` section in Megatron-LM's form: ``blend`` (``[prefixes,
    weights]``) as ``data_path`` (``["w1", "p1", ...]``, or bare prefixes without weights),
    ``blend_per_split`` as ``train_data_path``, ``valid_data_path`` and ``test_data_path``;
    ``data_path`` as given when there is no ``blend``. Also what kind of dataset it is."""
    # the blend is inline: Megatron-LM's other ways of giving it were not used
    values: dict[str, Any] = dict.fromkeys(_BLEND_KEYS)
    target = str(dataset.get("_target_") or "")
    kind = target.rpartition(".")[2]
    if kind in _BRIDGE_KINDS:
        key, value = _BRIDGE_KINDS[kind]
        values[key] = value
    elif kind and kind != "GPTDatasetConfig":
        values["sft"] = True
        notes.append(f"the dataset is a {target}, not GPT pretraining data: sft is set to say so")
    if kind in ("GPTDatasetConfig", *_BRIDGE_KINDS):
        values.setdefault("fim_data", False)
        values.setdefault("sft", False)
    blend = dataset.get("blend")
    per_split = dataset.get("blend_per_split")
    if blend is not None:
        values["data_path"] = _data_path(blend, config_file, "dataset.blend")
    elif dataset.get("data_path") is not None:
        given = dataset["data_path"]
        values["data_path"] = given.split() if isinstance(given, str) else plain(given)
    if per_split is not None:
        if not isinstance(per_split, list) or len(per_split) != 3:
            raise CorruptCheckpoint(
                f"{config_file}: dataset.blend_per_split is not a list of three (train, valid, "
                "test)",
                path=str(config_file),
            )
        for split, item in zip(("train", "valid", "test"), per_split, strict=True):
            if item is not None:
                values[f"{split}_data_path"] = _data_path(
                    item, config_file, f"dataset.blend_per_split ({split})"
                )
    return values


def _data_path(blend: Any, config_file: Path, where: str) -> list[str]:
    """Megatron-Core's ``(prefixes, weights)`` as Megatron-LM's ``--data-path`` list."""
    if (
        not isinstance(blend, list)
        or len(blend) != 2
        or not isinstance(blend[0], list)
        or not (blend[1] is None or isinstance(blend[1], list))
        or not all(isinstance(p, str) for p in blend[0])
    ):
        raise CorruptCheckpoint(
            f"{config_file}: {where} is not Megatron-Core's [prefixes, weights]",
            path=str(config_file),
        )
    prefixes, weights = blend
    if weights is None:
        return list(prefixes)
    if len(weights) != len(prefixes) or not all(
        isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights
    ):
        raise CorruptCheckpoint(
            f"{config_file}: {where} has {len(prefixes)} prefixes and {len(weights)} weights, "
            "or a weight that is not a number",
            path=str(config_file),
        )
    return [item for w, p in zip(weights, prefixes, strict=True) for item in (repr(float(w)), p)]
