"""repack.trace.checkpoints reads a run's settings from the checkpoints Megatron-LM and
Megatron-Bridge write, and names what is wrong with one it cannot read.

Bad inputs first (any environment with torch): one crafted per error, the exact class asserted,
the file and the cause in the message. The checkpoints that are read are written by the tools' own
save code, below.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest
from checkpoint_support import release

from repack.errors import (
    CheckpointError,
    CheckpointMissing,
    CorruptCheckpoint,
    NotACheckpoint,
)
from repack.trace.checkpoints import read_checkpoint

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


def test_notes(tmp_path: Path) -> None:
    """What the notes say of crafted arguments: a resumed launch, counters another batch size
    explains, a blend named by a file, --override-ckpt-iteration, the options absent."""
    args = argparse.Namespace(
        load=str(tmp_path),
        global_batch_size=8,
        consumed_train_samples=400,
        data_args_path="/blends/args.txt",
        override_ckpt_iteration=10,
    )
    legacy(tmp_path, state={"args": args, "iteration": 20})
    notes = read_checkpoint(tmp_path).notes
    assert notes[0].startswith("the saved arguments describe only the last launch")
    expected = [
        "consumed_train_samples is 400, not iteration 20 x global_batch_size 8 = 160",
        "data_args_path names a file (/blends/args.txt) read at launch",
        "--override-ckpt-iteration 10",
        "not in the checkpoint: data_path,",
        "not in the checkpoint (later Megatron-LM releases' options): step_batch_size_schedule,",
    ]
    for text in expected:
        assert any(text in note for note in notes), (text, notes)
    # the same counters, explained by the saved batch size: no note on them
    args.consumed_train_samples = 160
    shutil.rmtree(tmp_path / "iter_0000020")
    legacy(tmp_path, state={"args": args, "iteration": 20})
    assert not any("consumed_train_samples is" in note for note in read_checkpoint(tmp_path).notes)


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
    expect(NotACheckpoint, tmp_path, "neither metadata.json (torch_dist)")


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


def test_dcp_metadata_damaged(tmp_path: Path) -> None:
    (tmp_path / "iter_0000020").mkdir()
    (tmp_path / "iter_0000020" / ".metadata").write_bytes(b"x")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    expect(CorruptCheckpoint, tmp_path, ".metadata: damaged pickle")


def test_iteration_not_a_number(tmp_path: Path) -> None:
    legacy(tmp_path, state={"args": argparse.Namespace(), "iteration": "twenty"})
    expect(CorruptCheckpoint, tmp_path, "iteration is 'twenty', not an iteration number")


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


def test_docs_name_what_is_read() -> None:
    """docs/megatron.md's "Settings from a checkpoint" names keys and sources that exist."""
    from repack.trace.run_settings import KEYS

    text = (Path(__file__).parent.parent / "docs" / "megatron.md").read_text()
    section = text.split("## Settings from a checkpoint", 1)[1].split("\n## ", 1)[0]
    listed = section.split("names (", 1)[1].split("...", 1)[0]
    names = re.findall(r"`(\w+)`", listed)
    assert len(names) > 10 and set(names) <= set(KEYS), set(names) - set(KEYS)
    for source in (
        "Megatron-LM (torch)",
        "Megatron-LM (torch_dist)",
        "Megatron-Bridge (torch_dist)",
    ):
        assert f"`{source}`" in section


def test_unreadable_tracker(tmp_path: Path) -> None:
    legacy(tmp_path)
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.unlink()
    tracker.mkdir()  # a folder where the file should be: reading it fails
    shutil.rmtree(tmp_path / "iter_0000020")
    expect(CorruptCheckpoint, tmp_path, "cannot read")


# --- checkpoints written by Megatron-LM's and Megatron-Bridge's own save code ---------------
#
# tests/checkpoint_child.py runs the tools' save_checkpoint in a child process (what it writes,
# and the three CUDA calls replaced on a machine without a GPU, are in its docstring) and writes
# expected.json: the values of Megatron's own ``args`` (Bridge: its ConfigContainer and
# TrainState) at each save. Megatron-LM's save code (megatron/training/) ships in the
# megatron-core wheels from 0.17 on: there these tests must run (a missing megatron.training
# fails them); on older releases they skip. Megatron-Bridge 0.6.2 imports on megatron-core 0.19
# only: its tests run where REPACK_TEST_BRIDGE is set (CI's 0.19 run), and fail there if it
# cannot be imported. Releases up to 0.18 write a torch_dist checkpoint's arguments to
# common.pt; 0.19 into the checkpoint's own files (.metadata, __0_0.distcp): both are read.


@pytest.fixture
def written(megatron_checkpoints) -> tuple[Path, dict]:
    """The checkpoints tests/checkpoint_child.py writes, and its expected.json."""
    return megatron_checkpoints.out, megatron_checkpoints.expected


@pytest.fixture
def flags(megatron_checkpoints) -> dict:
    """:data:`FLAGS`, with the blend and cache folder the checkpoints were written with."""
    return {
        **FLAGS,
        "data_path": megatron_checkpoints.data_path,
        "data_cache_path": megatron_checkpoints.cache,
    }


#: The data flags checkpoint_child.py gives Megatron-LM (and the same settings to Bridge); the
#: blend and cache folder are the session's (:func:`flags`).
FLAGS = {
    "split": "90,5,5",
    "seed": 4321,
    "seq_length": 32,
    "mid_level_dataset_surplus": 0.01,
    "dataloader_type": "cyclic",
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "data_parallel_size": 1,
    "train_iters": 100,
    "eval_interval": 10,
    "eval_iters": 2,
    "iterations_to_skip": [3, 7],
    "rampup_batch_size": None,
    "train_samples": None,
}


def _check_megatron(settings, expected: dict, iteration: int, flags: dict) -> None:
    assert settings.iteration == iteration
    want = {**expected, "iteration": iteration}
    assert settings.values == want  # every key Megatron's own args have, equal
    for key, value in flags.items():
        assert settings.values[key] == value, key


@pytest.mark.megatron
def test_megatron_lm_torch(written, flags) -> None:
    out, expected = written
    settings = read_checkpoint(out / "megatron-torch")
    assert settings.source == "Megatron-LM (torch)"
    assert settings.path == str(out / "megatron-torch" / "iter_0000020")
    _check_megatron(settings, expected["megatron-torch/20"], 20, flags)
    assert settings.values["consumed_train_samples"] == 160
    assert settings.values["skipped_train_samples"] == 16
    assert "loaded no checkpoint (no --load)" in settings.notes[0]
    assert not any("consumed_train_samples is" in note for note in settings.notes)


@pytest.mark.megatron
def test_megatron_lm_torch_dcp(written, flags, tmp_path: Path) -> None:
    out, expected = written
    settings = read_checkpoint(out / "megatron-dcp")
    assert settings.source == "Megatron-LM (torch_dcp)"
    _check_megatron(settings, expected["megatron-dcp/20"], 20, flags)
    # the data file cut short: the arguments' bytes are not all there
    copy = tmp_path / "cut"
    shutil.copytree(out / "megatron-dcp", copy)
    data = copy / "iter_0000020" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    expect(CorruptCheckpoint, copy, "__0_0.distcp: ends at 1,000 bytes, before args'")


@pytest.mark.megatron
def test_megatron_lm_torch_dist(written, flags) -> None:
    out, expected = written
    folder = out / "megatron-dist"
    latest = read_checkpoint(folder)
    assert latest.source == "Megatron-LM (torch_dist)"
    _check_megatron(latest, expected["megatron-dist/30"], 30, flags)
    assert "describe only the last launch" in latest.notes[0]
    # 20 iterations of 16 samples, then 10 of 8: the saved batch size does not explain it
    assert latest.values["consumed_train_samples"] == 400
    assert any(
        "consumed_train_samples is 400, not iteration 30 x global_batch_size 8 = 240" in note
        for note in latest.notes
    ), latest.notes
    for settings in (read_checkpoint(folder, 20), read_checkpoint(folder / "iter_0000020")):
        _check_megatron(settings, expected["megatron-dist/20"], 20, flags)
    found = release()
    common = folder / "iter_0000020" / "common.pt"
    assert common.is_file() == (found < (0, 19)), found  # both layouts are read


@pytest.mark.megatron
@pytest.mark.bridge
def test_megatron_bridge(written, flags) -> None:
    import os

    out, expected = written
    if "bridge/20" not in expected:
        if os.environ.get("REPACK_TEST_BRIDGE"):
            pytest.fail("REPACK_TEST_BRIDGE is set but no Bridge checkpoint was written")
        pytest.skip("REPACK_TEST_BRIDGE is not set (Megatron-Bridge 0.6.2 imports on 0.19 only)")
    bridge = expected["bridge/20"]
    settings = read_checkpoint(out / "bridge")
    assert settings.source == "Megatron-Bridge (torch_dist)" and settings.iteration == 20
    values = settings.values
    # Bridge's fields under Megatron-LM's names, its blend in --data-path form
    prefixes, weights = bridge["blend"]
    assert values["data_path"] == [x for w, p in zip(weights, prefixes) for x in (str(w), p)]
    assert values["train_data_path"] is values["per_split_data_args_path"] is None
    renamed = {
        "split": "split",
        "seq_length": "seq_length",
        "seed": "random_seed",
        "data_cache_path": "path_to_cache",
        "dataloader_type": "dataloader_type",
        "data_sharding": "data_sharding",
        "mid_level_dataset_surplus": "mid_level_dataset_surplus",
        "data_parallel_size": "data_parallel_size",
        "global_batch_size": "global_batch_size",
        "micro_batch_size": "micro_batch_size",
        "train_iters": "train_iters",
        "iterations_to_skip": "iterations_to_skip",
        "eval_interval": "eval_interval",
        "eval_iters": "eval_iters",
        "consumed_train_samples": "consumed_train_samples",
        "skipped_train_samples": "skipped_train_samples",
        "consumed_valid_samples": "consumed_valid_samples",
    }
    for key, field in renamed.items():
        assert values[key] == bridge[field], key
    assert (values["mock_data"], values["fim_data"], values["sft"]) == (False, False, False)
    # the same run's settings as Megatron-LM's flags give them
    for key, value in flags.items():
        assert values[key] == value, key
    megatron = expected["megatron-torch/20"]
    shared = set(values) & set(megatron) - {"iteration"}
    assert {k: values[k] for k in shared} == {k: megatron[k] for k in shared}
    assert any(f"model's rng.seed is {bridge['rng_seed']}" in note for note in settings.notes)
    # Megatron-Bridge before 0.2 wrote no latest_checkpointed_iteration.txt: its own
    # latest_train_state.pt names the iteration
    (out / "bridge" / "latest_checkpointed_iteration.txt").unlink()
    assert read_checkpoint(out / "bridge").values == values
    # what Bridge's save called of the stand-ins: ModelOpt's save, which returns at once for a
    # model ModelOpt never converted (tests/bridge_support.py)
    assert expected["modelopt_called"] == ["save_sharded_modelopt_state"]
