"""A training run's data settings, read from its checkpoint (Megatron-LM or Megatron-Bridge).

``repack trace --checkpoint DIR`` needs the flags that decide which sample each rank reads at
each iteration: the blend, split, seed, sequence length, batch sizes, data-parallel size, the
iterations skipped... A run's checkpoint holds them; :func:`read_checkpoint` reads them into a
:class:`RunSettings` keyed by Megatron-LM's argument names (``args.<name>``), whichever tool
wrote the checkpoint.

Megatron-LM (``megatron/training/checkpointing.py``) writes
``DIR/latest_checkpointed_iteration.txt`` (an iteration number, or ``release``) and one folder
per checkpoint, ``DIR/iter_NNNNNNN`` (or ``DIR/release``), in one of two formats:

``torch`` (legacy)
    ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per model-parallel rank, each a ``torch.save``
    dict with ``args`` (the ``argparse.Namespace`` of the launch that saved it, with the counters
    ``consumed_train_samples``, ``skipped_train_samples``, ``consumed_valid_samples``) and
    ``iteration``. The rank-0 file is read (Megatron's ``find_checkpoint_rank_0`` order).
``torch_dist``
    Megatron-Core's distributed checkpoint: ``metadata.json`` (its backend) and ``common.pt``,
    the ``torch.save`` of what every rank shares, ``args`` and ``iteration`` among it.

Megatron-Bridge (``megatron/bridge/training/checkpointing.py``) writes the same tracker and
``iter_NNNNNNN`` folders (``torch_dist`` without ``args``), plus, in each, ``run_config.yaml``
(its whole ``ConfigContainer``) and ``train_state.pt`` (``step``, ``consumed_train_samples``,
``skipped_train_samples``, ``consumed_valid_samples``...; also as ``DIR/latest_train_state.pt``).
Its fields are given Megatron-LM's names (:data:`BRIDGE_FIELDS`), its ``blend`` and
``blend_per_split`` turned into Megatron-LM's ``data_path`` form.

The ``torch.save`` files are read by :mod:`repack.trace.torchfile`: without torch or Megatron,
running nothing from the file, reading only the pickle and the few small tensors it needs.
"""

from __future__ import annotations

import json
import os
import re
from argparse import Namespace
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from repack.errors import CheckpointMissing, CorruptCheckpoint, MissingExtra, NotACheckpoint
from repack.trace import torchfile

__all__ = [
    "BRIDGE_FIELDS",
    "BRIDGE_TRACKER",
    "KEYS",
    "TRACKER",
    "RunSettings",
    "read_checkpoint",
]

#: The file naming a checkpoint folder's latest iteration (Megatron-LM and Megatron-Bridge).
TRACKER = "latest_checkpointed_iteration.txt"

#: Megatron-Bridge's own record of the latest iteration (its ``train_state.pt``, copied).
BRIDGE_TRACKER = "latest_train_state.pt"

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

#: The largest tracker file read (it holds a number).
_MAX_TRACKER_BYTES = 1024

_ITER_FOLDER = re.compile(r"iter_(\d{7,})")

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


def read_checkpoint(path: str | os.PathLike, iteration: int | None = None) -> RunSettings:
    """Read a training run's settings from its checkpoint folder.

    Args:
        path: A checkpoint folder as given to ``--save`` / ``--load`` (holding
            ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN`` folders), or one
            iteration's folder (``.../iter_NNNNNNN``).
        iteration: The checkpointed iteration to read; default the latest (the tracker file's).

    Returns:
        The settings, by Megatron-LM argument name.

    Raises:
        NotACheckpoint: ``path`` is not a checkpoint folder of Megatron-LM or Megatron-Bridge.
        CheckpointMissing: the iteration asked for, or a file its format needs, is not there.
        CorruptCheckpoint: a file cannot be read or does not hold what its writer writes.
    """
    root = Path(path)
    if not root.is_dir():
        raise NotACheckpoint(
            f"{root}: {'not a folder' if root.exists() else 'no such folder'}: a checkpoint "
            "is the folder given to Megatron's --save",
            path=str(root),
        )
    folder, found = _iteration_folder(root, iteration)
    if (folder / "run_config.yaml").is_file():
        settings = _read_bridge(folder, found)
    else:
        settings = _read_megatron(folder, found)
    return settings


# --- where the iteration is -----------------------------------------------------------------


def _iteration_folder(root: Path, iteration: int | None) -> tuple[Path, int | None]:
    """The folder of the checkpointed iteration asked for and its number (None: ``release``)."""
    if _is_iteration_folder(root):
        match = _ITER_FOLDER.fullmatch(root.name)
        found = int(match.group(1)) if match else None
        if iteration is not None and found != iteration:
            raise CheckpointMissing(
                f"{root}: the checkpoint of iteration {found if found is not None else 'release'}"
                f", not of iteration {iteration}: give the run's checkpoint folder "
                f"({root.parent}) to read another",
                path=str(root),
            )
        return root, found
    tracker = root / TRACKER
    bridge_tracker = root / BRIDGE_TRACKER
    named_by = tracker
    if iteration is None and not tracker.exists() and bridge_tracker.exists():
        found = _bridge_step(bridge_tracker)  # Megatron-Bridge before 0.2 wrote only this
        named_by = bridge_tracker
    elif iteration is None:
        if not tracker.exists():
            present = _iterations_present(root)
            hint = (
                f"; it has {_list_iterations(present)}: ask for one"
                if present
                else ": neither a Megatron-LM nor a Megatron-Bridge checkpoint folder"
            )
            raise NotACheckpoint(f"{root}: no {TRACKER}{hint}", path=str(root))
        found = _read_tracker(tracker)
    else:
        found = iteration
    folder = root / ("release" if found is None else f"iter_{found:07d}")
    if not folder.is_dir():
        present = _iterations_present(root)
        said = f" ({named_by} names it)" if iteration is None else ""
        raise CheckpointMissing(
            f"{folder}: no such folder: no checkpoint of iteration "
            f"{'release' if found is None else found}{said}; {root} has "
            + (_list_iterations(present) if present else "none"),
            path=str(folder),
        )
    return folder, found


def _is_iteration_folder(folder: Path) -> bool:
    if not (_ITER_FOLDER.fullmatch(folder.name) or folder.name == "release"):
        return False
    return any(
        (folder / name).exists()
        for name in ("metadata.json", "common.pt", "run_config.yaml", ".metadata")
    ) or any(child.name.startswith("mp_rank_") for child in folder.iterdir())


def _read_tracker(tracker: Path) -> int | None:
    try:
        with open(tracker, "rb") as f:
            raw = f.read(_MAX_TRACKER_BYTES + 1)
    except OSError as err:
        raise CorruptCheckpoint(
            f"{tracker}: cannot read: {err.strerror or err}", path=str(tracker)
        ) from None
    text = raw.decode("utf-8", "replace").strip()
    if text == "release":
        return None
    if len(raw) > _MAX_TRACKER_BYTES or not re.fullmatch(r"\d+", text):
        raise CorruptCheckpoint(
            f"{tracker}: holds {text[:40]!r}, expected an iteration number or 'release' "
            "(what Megatron writes)",
            path=str(tracker),
        )
    return int(text)


def _iterations_present(root: Path) -> list[int]:
    try:
        names = [child.name for child in root.iterdir() if child.is_dir()]
    except OSError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _ITER_FOLDER.fullmatch(n)))


def _list_iterations(present: list[int]) -> str:
    shown = ", ".join(str(i) for i in present[-5:])
    return f"iterations {'..., ' if len(present) > 5 else ''}{shown}"


# --- Megatron-LM ---------------------------------------------------------------------------


def _read_megatron(folder: Path, found: int | None) -> RunSettings:
    metadata = folder / "metadata.json"
    if metadata.is_file():
        fmt = _dist_backend(metadata)
        state, file = _common_state(folder, metadata)
    else:
        file = _rank0_file(folder)
        if file.name == ".metadata":  # torch_dcp or fsdp_dtensor: args and iteration objects
            state = {key: torchfile.dcp_object(folder, key) for key in ("args", "iteration")}
            state = {key: value for key, value in state.items() if value is not None}
            saved_format = getattr(state.get("args"), "ckpt_format", None)
            fmt = saved_format if saved_format in ("torch_dcp", "fsdp_dtensor") else "torch_dcp"
        else:
            state, fmt = torchfile.load(file), "torch"
    if not isinstance(state, Mapping):
        raise CorruptCheckpoint(
            f"{file}: holds a {type(state).__name__}, not the dict Megatron saves", path=str(file)
        )
    args = state.get("args")
    if not isinstance(args, Namespace):
        raise CorruptCheckpoint(
            f"{file}: holds no saved arguments ('args' is "
            f"{'absent' if args is None else type(args).__name__}): a checkpoint converted from "
            "another format, or saved without them, cannot give the run's settings",
            path=str(file),
        )
    saved = state.get("iteration", state.get("total_iters"))
    iteration = _plain(saved) if saved is not None else found
    if iteration is not None and (not isinstance(iteration, int) or isinstance(iteration, bool)):
        raise CorruptCheckpoint(
            f"{file}: iteration is {iteration!r}, not an iteration number", path=str(file)
        )
    if found is not None and iteration != found:
        raise CorruptCheckpoint(
            f"{file}: holds iteration {iteration}, in the folder of iteration {found}",
            path=str(file),
        )
    saved_args = vars(args)
    values = {key: _plain(saved_args[key]) for key in KEYS if key in saved_args}
    values["iteration"] = iteration
    notes = _notes(values, iteration)
    if getattr(args, "load", None) is None and "load" in vars(args):
        notes[0] = (
            f"the launch that wrote iteration {iteration} loaded no checkpoint (no --load): "
            "its arguments are the run's from iteration 0"
        )
    return RunSettings(values, iteration, f"Megatron-LM ({fmt})", notes, str(folder))


#: Where megatron-core 0.19 and later keep a distributed checkpoint's common state (``args``,
#: ``iteration``...): a ``ShardedObject`` of this key inside the torch.distributed.checkpoint
#: files (``dist_checkpointing.serialization.load_common_state_dict``), a ``torch.save`` of
#: ``[state]``. Earlier releases wrote ``common.pt``.
_COMMON_STATE_KEY = "common_state/shard_0_1"


def _common_state(folder: Path, metadata: Path) -> tuple[Any, Path]:
    """A distributed checkpoint's common state dict, and the file it was read from."""
    common = folder / "common.pt"
    if common.is_file():
        return torchfile.load(common), common
    if not (folder / ".metadata").is_file():
        raise CheckpointMissing(
            f"{common}: missing, and no .metadata either: a distributed checkpoint "
            f"({metadata.name}) keeps the saved arguments in one of them; the save did not "
            "finish, or the folder was cut",
            path=str(common),
        )
    stored = torchfile.dcp_object(folder, _COMMON_STATE_KEY)
    if stored is None:
        raise CheckpointMissing(
            f"{folder / '.metadata'}: no {_COMMON_STATE_KEY}, where megatron-core keeps the "
            "saved arguments (and no common.pt, where releases before 0.19 kept them)",
            path=str(folder / ".metadata"),
        )
    if not (isinstance(stored, list) and len(stored) == 1):
        raise CorruptCheckpoint(
            f"{folder / '.metadata'}: {_COMMON_STATE_KEY} holds a {type(stored).__name__}, not "
            "the one-item list megatron-core saves",
            path=str(folder / ".metadata"),
        )
    return stored[0], folder / ".metadata"


def _dist_backend(metadata: Path) -> str:
    try:
        with open(metadata, "rb") as f:
            raw = f.read(1 << 20)
        config = json.loads(raw)
    except OSError as err:
        raise CorruptCheckpoint(
            f"{metadata}: cannot read: {err.strerror or err}", path=str(metadata)
        ) from None
    except ValueError as err:
        raise CorruptCheckpoint(f"{metadata}: not JSON: {err}", path=str(metadata)) from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if not isinstance(backend, str):
        raise CorruptCheckpoint(
            f"{metadata}: no 'sharded_backend' (Megatron-Core's distributed checkpoint "
            "metadata names it)",
            path=str(metadata),
        )
    return backend


def _rank0_file(folder: Path) -> Path:
    """Tensor- and pipeline-parallel rank 0's ``model_optim_rng.pt``, in the order Megatron's
    ``find_checkpoint_rank_0`` looks (no pipeline or expert parallelism first); or, for a
    ``torch_dcp`` / ``fsdp_dtensor`` checkpoint, its ``.metadata`` (Megatron's
    ``_get_checkpoint_format`` tells the formats apart in this order)."""
    for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        candidate = folder / name / "model_optim_rng.pt"
        if candidate.is_file():
            return candidate
    has_ranks = any(child.name.startswith("mp_rank_") for child in folder.iterdir())
    if not has_ranks and (folder / ".metadata").is_file():
        return folder / ".metadata"
    if has_ranks:
        raise CheckpointMissing(
            f"{folder}: no model_optim_rng.pt of rank 0 (mp_rank_00/, mp_rank_00_000/ or "
            "mp_rank_00_000_000/): the save did not finish, or the folder was cut",
            path=str(folder),
        )
    raise NotACheckpoint(
        f"{folder}: neither metadata.json (torch_dist), mp_rank_00/model_optim_rng.pt (torch) "
        "nor .metadata (torch_dcp, fsdp_dtensor): not a Megatron checkpoint",
        path=str(folder),
    )


# --- Megatron-Bridge -------------------------------------------------------------------------

#: Megatron-Bridge's ``run_config.yaml`` fields (section, name) → Megatron-LM's argument name,
#: the first not null of each list winning (null if all there are): ``validation`` before the
#: ``train`` fields Bridge deprecated for it. The blend (``dataset.blend``, ``blend_per_split``,
#: ``data_path``) and the dataset's kind are read apart (:func:`_bridge_blend`).
BRIDGE_FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    "split": (("dataset", "split"),),
    "data_cache_path": (("dataset", "path_to_cache"),),
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


def _read_bridge(folder: Path, found: int | None) -> RunSettings:
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
    iteration = _bridge_step(state_file, state)
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
                    values[key] = _plain(part[name])
                if part[name] is not None:
                    break
    blend = _bridge_blend(config["dataset"], config_file, notes)
    values.update({k: v for k, v in blend.items() if v is not None or k not in values})
    values["iteration"] = iteration
    for key in _TRAIN_STATE:
        if key in state:
            values[key] = _plain(state[key])
    values = {key: values[key] for key in KEYS if key in values}
    rng = config.get("rng")
    notes = _notes(values, iteration, bridge=True) + notes
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


def _bridge_step(state_file: Path, state: Any = None) -> int:
    """The ``step`` of Megatron-Bridge's ``TrainState`` saved in ``state_file`` (read unless
    ``state`` is given)."""
    if state is None:
        state = torchfile.load(state_file)
    if not isinstance(state, Mapping) or "step" not in state:
        raise CorruptCheckpoint(
            f"{state_file}: no 'step': not Megatron-Bridge's TrainState", path=str(state_file)
        )
    step = _plain(state["step"])
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
        values["data_path"] = given.split() if isinstance(given, str) else _plain(given)
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


# --- values and notes -------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """``value`` as plain Python: NumPy scalars and arrays to numbers and lists, tuples to
    lists, an :class:`repack.trace.torchfile.Opaque` to its value's text."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, torchfile.Opaque):
        return repr(value)
    return value


def _notes(values: dict[str, Any], iteration: int | None, bridge: bool = False) -> list[str]:
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
