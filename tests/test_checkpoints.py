"""repack.checkpoints reads a run's settings from the checkpoints Megatron-LM and Megatron-Bridge
write, and names what is wrong with one it cannot read.

Bad inputs first (any environment with torch): one crafted per error, the exact class asserted,
the file and the cause in the message. The checkpoints that are read are written by the tools' own
save code, below.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from repack.checkpoints import read_checkpoint
from repack.errors import (
    CheckpointError,
    CheckpointMissing,
    CorruptCheckpoint,
    NotACheckpoint,
)

torch = pytest.importorskip("torch")


def expect(error: type[CheckpointError], path: Path, *found: str, iteration=None) -> str:
    """read_checkpoint(path) raises exactly ``error`` with every ``found`` in its message."""
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path, iteration)
    assert type(caught.value) is error, repr(caught.value)
    message = str(caught.value)
    for text in found:
        assert text in message, message
    assert caught.value.path is not None and caught.value.path in message, message
    return message


def legacy(root: Path, iteration: int = 20, state: object = None, tracker: str | None = None):
    """A folder laid out as Megatron's torch format, its rank-0 file holding ``state``."""
    folder = root / f"iter_{iteration:07d}" / "mp_rank_00"
    folder.mkdir(parents=True)
    if state is None:
        state = {"args": argparse.Namespace(seq_length=8, load=None), "iteration": iteration}
    torch.save(state, folder / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(
        str(iteration) if tracker is None else tracker
    )
    return folder / "model_optim_rng.pt"


def test_crafted_checkpoint_reads(tmp_path: Path) -> None:
    """The crafted layout the bad inputs below break is one that reads."""
    legacy(tmp_path)
    settings = read_checkpoint(tmp_path)
    assert settings.values == {"seq_length": 8, "iteration": 20}
    assert settings.source == "Megatron-LM (torch)" and settings.iteration == 20


# --- not a checkpoint -----------------------------------------------------------------------


def test_no_such_folder(tmp_path: Path) -> None:
    expect(NotACheckpoint, tmp_path / "absent", "no such folder")


def test_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    expect(NotACheckpoint, tmp_path / "f", "not a folder")


def test_empty_folder(tmp_path: Path) -> None:
    expect(NotACheckpoint, tmp_path, "no latest_checkpointed_iteration.txt", "neither")


def test_no_tracker_but_iterations(tmp_path: Path) -> None:
    legacy(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    expect(NotACheckpoint, tmp_path, "no latest_checkpointed_iteration.txt", "iterations 20")
    assert read_checkpoint(tmp_path, 20).iteration == 20  # asking for one reads it


def test_iteration_folder_of_neither_format(tmp_path: Path) -> None:
    (tmp_path / "iter_0000020").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    expect(NotACheckpoint, tmp_path, "neither metadata.json and common.pt")


def test_torch_dcp(tmp_path: Path) -> None:
    (tmp_path / "iter_0000020").mkdir()
    (tmp_path / "iter_0000020" / ".metadata").write_bytes(b"x")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    expect(NotACheckpoint, tmp_path, "torch_dcp or fsdp_dtensor", "not read yet")


# --- missing --------------------------------------------------------------------------------


def test_iteration_not_there(tmp_path: Path) -> None:
    legacy(tmp_path)
    expect(
        CheckpointMissing,
        tmp_path,
        "no such folder: no checkpoint of iteration 30",
        "iterations 20",
        iteration=30,
    )


def test_tracker_names_a_missing_iteration(tmp_path: Path) -> None:
    legacy(tmp_path, tracker="40")
    expect(CheckpointMissing, tmp_path, "iteration 40", "names it", "iterations 20")


def test_iteration_folder_of_another_iteration(tmp_path: Path) -> None:
    legacy(tmp_path)
    expect(
        CheckpointMissing,
        tmp_path / "iter_0000020",
        "of iteration 20, not of iteration 10",
        iteration=10,
    )
    assert read_checkpoint(tmp_path / "iter_0000020").iteration == 20


def test_rank0_file_missing(tmp_path: Path) -> None:
    legacy(tmp_path).unlink()
    expect(CheckpointMissing, tmp_path, "no model_optim_rng.pt of rank 0")


def test_common_pt_missing(tmp_path: Path) -> None:
    folder = tmp_path / "iter_0000020"
    folder.mkdir()
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    expect(CheckpointMissing, tmp_path, "common.pt: missing, and no .metadata either")


def test_bridge_train_state_missing(tmp_path: Path) -> None:
    folder = tmp_path / "iter_0000020"
    folder.mkdir()
    (folder / "run_config.yaml").write_text("dataset:\n  seq_length: 8\n")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    expect(CheckpointMissing, tmp_path, "train_state.pt: missing beside run_config.yaml")


# --- unreadable or corrupt ------------------------------------------------------------------


def test_tracker_not_a_number(tmp_path: Path) -> None:
    legacy(tmp_path, tracker="twenty")
    expect(CorruptCheckpoint, tmp_path, "'twenty'", "an iteration number or 'release'")


def test_rank0_file_damaged(tmp_path: Path) -> None:
    file = legacy(tmp_path)
    file.write_bytes(file.read_bytes()[:100])
    expect(CorruptCheckpoint, tmp_path, "not a file written by torch.save")


def test_no_saved_args(tmp_path: Path) -> None:
    legacy(tmp_path, state={"iteration": 20, "model": {}})
    expect(CorruptCheckpoint, tmp_path, "holds no saved arguments ('args' is absent)")


def test_not_a_dict(tmp_path: Path) -> None:
    legacy(tmp_path, state=[1, 2])
    expect(CorruptCheckpoint, tmp_path, "holds a list, not the dict Megatron saves")


def test_iteration_disagrees_with_its_folder(tmp_path: Path) -> None:
    legacy(tmp_path, state={"args": argparse.Namespace(), "iteration": 7})
    expect(CorruptCheckpoint, tmp_path, "holds iteration 7, in the folder of iteration 20")


def test_metadata_json_damaged(tmp_path: Path) -> None:
    folder = tmp_path / "iter_0000020"
    folder.mkdir()
    (folder / "metadata.json").write_text("{not json")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    expect(CorruptCheckpoint, tmp_path, "metadata.json: not JSON")


def bridge(root: Path, config: str, step: int = 20) -> Path:
    folder = root / f"iter_{step:07d}"
    folder.mkdir(parents=True)
    (folder / "run_config.yaml").write_text(config)
    torch.save({"step": torch.tensor(step)}, folder / "train_state.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))
    return folder


def test_bridge_config_not_yaml(tmp_path: Path) -> None:
    bridge(tmp_path, "dataset: [unclosed\n")
    expect(CorruptCheckpoint, tmp_path, "run_config.yaml: not YAML")


def test_bridge_config_without_dataset(tmp_path: Path) -> None:
    bridge(tmp_path, "train:\n  global_batch_size: 8\n")
    expect(CorruptCheckpoint, tmp_path, "no 'dataset' section")


def test_bridge_blend_malformed(tmp_path: Path) -> None:
    bridge(tmp_path, "dataset:\n  blend: [[a, b], [0.5]]\n")
    expect(CorruptCheckpoint, tmp_path, "dataset.blend has 2 prefixes and 1 weights")


def test_bridge_train_state_without_step(tmp_path: Path) -> None:
    folder = bridge(tmp_path, "dataset:\n  seq_length: 8\n")
    torch.save({"consumed_train_samples": torch.tensor(3)}, folder / "train_state.pt")
    expect(CorruptCheckpoint, tmp_path, "no 'step'")


def test_unreadable_tracker(tmp_path: Path) -> None:
    legacy(tmp_path)
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.unlink()
    tracker.mkdir()  # a folder where the file should be: reading it fails
    shutil.rmtree(tmp_path / "iter_0000020")
    expect(CorruptCheckpoint, tmp_path, "cannot read")
