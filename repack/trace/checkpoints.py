"""A training run's data settings, read from its checkpoint (Megatron-LM or Megatron-Bridge).

``repack trace --checkpoint DIR`` needs the flags that decide which sample each rank reads at
each iteration: the blend, split, seed, sequence length, batch sizes, data-parallel size, the
iterations skipped... A run's checkpoint holds them; :func:`read_checkpoint` reads them into a
:class:`~repack.trace.run_settings.RunSettings` keyed by Megatron-LM's argument names
(``args.<name>``), whichever tool wrote the checkpoint.

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
Its fields are given Megatron-LM's names (:mod:`repack.trace.bridge_checkpoint`), its ``blend`` and
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
from pathlib import Path
from typing import Any

from repack.errors import CheckpointMissing, CorruptCheckpoint, NotACheckpoint
from repack.trace import torchfile
from repack.trace.bridge_checkpoint import bridge_step, read_bridge
from repack.trace.run_settings import KEYS, RunSettings, notes_on, plain

__all__ = [
    "BRIDGE_TRACKER",
    "TRACKER",
    "read_checkpoint",
]

#: The file naming a checkpoint folder's latest iteration (Megatron-LM and Megatron-Bridge).
TRACKER = "latest_checkpointed_iteration.txt"

#: Megatron-Bridge's own record of the latest iteration (its ``train_state.pt``, copied).
BRIDGE_TRACKER = "latest_train_state.pt"

#: The largest tracker file read (it holds a number).
_MAX_TRACKER_BYTES = 1024

_ITER_FOLDER = re.compile(r"iter_(\d{7,})")


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
        settings = read_bridge(folder, found)
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
        found = bridge_step(bridge_tracker)  # Megatron-Bridge before 0.2 wrote only this
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
    iteration = plain(saved) if saved is not None else found
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
    values = {key: plain(saved_args[key]) for key in KEYS if key in saved_args}
    values["iteration"] = iteration
    notes = notes_on(values, iteration)
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
