"""``repack trace --checkpoint DIR`` gives the answer the same flags typed give.

* Checkpoints written by Megatron-LM's own save code (tests/checkpoint_child.py, as in
  tests/test_checkpoints.py: the megatron-core 0.17+ wheels, Python 3.12 here), and by
  Megatron-Bridge's where ``REPACK_TEST_BRIDGE`` is set (CI's 0.19 run), over a real blend:
  ``--checkpoint`` alone, and with a flag typed over it, equals the flags typed, for iterations
  (one after a skipped iteration, one with an evaluation) and a reverse query.
* Main suite (no Megatron save code): a checkpoint folder laid out as Megatron-LM's ``torch``
  format, its arguments a ``torch.save``'d ``argparse.Namespace``: the same comparison, and each
  bad checkpoint one ``Error:`` line, exit 3, nothing on stdout.
"""

from __future__ import annotations

import json
import os

import pytest
from checkpoint_support import write_blend, write_torch_checkpoint
from click.testing import CliRunner

from repack.cli import main

torch = pytest.importorskip("torch")


def _run(*args: str):
    return CliRunner().invoke(main, ["trace", *args], catch_exceptions=False)


def _answer(*args: str) -> dict:
    result = _run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _same(from_checkpoint: dict, typed: dict) -> None:
    """Equal but for the notes, which start with the checkpoint's (the last launch's)."""
    notes, typed_notes = from_checkpoint.pop("notes"), typed.pop("notes")
    assert "launch" in notes[0] and "wrote iteration" in notes[0], notes
    assert notes[len(notes) - len(typed_notes) :] == typed_notes, notes
    assert from_checkpoint == typed


def _flags(values: dict) -> list[str]:
    """Megatron-LM's flags for ``values`` (Megatron's names, as a checkpoint saves them)."""
    args: list[str] = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list):
            args += [flag, ",".join(map(str, value))]
        else:
            args += [flag, str(value)]
    return args


# --- main suite: a checkpoint laid out as Megatron-LM's torch format -----------------------

#: A run's data arguments, as Megatron-LM's ``args`` hold them (``data_path`` added per test).
RUN = {
    "seq_length": 16,
    "split": "90,5,5",
    "seed": 99,
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "data_parallel_size": 2,
    "train_iters": 12,
    "eval_interval": 4,
    "eval_iters": 1,
    "dataloader_type": "single",
    "iterations_to_skip": [5],
    "mid_level_dataset_surplus": 0.005,
}


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    data_path = write_blend(root)
    return root, data_path


@pytest.mark.megatron
@pytest.mark.once
def test_a_saved_namespace_gives_the_flags_answer(blend, tmp_path):
    root, data_path = blend
    ckpt = tmp_path / "ckpt"  # a resumed launch's: --load and --save the same folder
    write_torch_checkpoint(ckpt, {**RUN, "data_path": data_path, "load": str(ckpt)})
    typed = [str(root / "blend.txt"), *_flags(RUN)]
    for ask in (["--iterations", "5:6"], ["--iteration", "8"]):  # 6 after a skip, 8 an eval
        _same(_answer("--checkpoint", str(ckpt), *ask), _answer(*typed, *ask))
    first = _answer(*typed, "--iteration", "2")["samples"][0]
    document = ["--document", f"{first['source']}:{first['documents'][0]['document']}"]
    _same(_answer("--checkpoint", str(ckpt), *document), _answer(*typed, *document))
    # a flag typed replaces the saved value; the blend given replaces the checkpoint's
    over = ["--data-parallel-size", "4", "--iteration", "3"]
    _same(
        _answer(str(root / "blend.txt"), "--checkpoint", str(ckpt), *over),
        _answer(*_flags({**RUN, "data_parallel_size": 4}), str(root / "blend.txt"), *over[2:]),
    )
    # the blend named by a data-args file, read when the file is there
    args = {**RUN, "data_path": None, "data_args_path": str(root / "blend.txt"), "load": None}
    named = write_torch_checkpoint(tmp_path / "named", args)
    _same(
        _answer("--checkpoint", str(named), "--iteration", "8"), _answer(*typed, "--iteration", "8")
    )
    # the notes on stderr, as progress is; the table leaves them out
    result = _run("--checkpoint", str(ckpt), "--iteration", "1")
    assert result.exit_code == 0, result.output
    assert "repack: note: the saved arguments describe only the last launch" in result.stderr
    assert "describe only the last launch" not in result.stdout


def _error(*args: str) -> str:
    result = _run(*args)
    assert result.exit_code == 3, result.output
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and result.stderr.splitlines()[-1] == errors[0], result.stderr
    return errors[0]


@pytest.mark.once
def test_bad_checkpoints_are_one_error_line(tmp_path):
    run = {**RUN, "data_path": ["/nowhere/a"], "load": None}
    # not a checkpoint
    assert "no such folder" in _error("--checkpoint", str(tmp_path / "none"), "--iteration", "1")
    # the tracker names no iteration
    bad = write_torch_checkpoint(tmp_path / "tracker", run)
    (bad / "latest_checkpointed_iteration.txt").write_text("twelve")
    message = _error("--checkpoint", str(bad), "--iteration", "1")
    assert "latest_checkpointed_iteration.txt" in message, message
    # the saved args are not a Namespace
    folder = tmp_path / "args" / "iter_0000012" / "mp_rank_00"
    folder.mkdir(parents=True)
    torch.save({"args": [1, 2], "iteration": 12}, folder / "model_optim_rng.pt")
    (tmp_path / "args" / "latest_checkpointed_iteration.txt").write_text("12")
    assert "model_optim_rng.pt" in _error(
        "--checkpoint", str(tmp_path / "args"), "--iteration", "1"
    )
    # a blend named by a data-args file no longer there
    gone = {**run, "data_path": None, "data_args_path": str(tmp_path / "gone.txt")}
    message = _error(
        "--checkpoint", str(write_torch_checkpoint(tmp_path / "gone", gone)), "--iteration", "1"
    )
    assert "data_args_path" in message and "gone.txt, which is not there" in message, message
    # no blend at all, and no BLEND_OR_REPACK
    blendless = write_torch_checkpoint(tmp_path / "blendless", {**run, "data_path": None})
    assert "names no blend" in _error("--checkpoint", str(blendless), "--iteration", "1")
    # what trace refuses, saved
    sft = write_torch_checkpoint(tmp_path / "sft", {**run, "sft": True})
    assert "SFT datasets" in _error("--checkpoint", str(sft), "--iteration", "1")
    # mock data names no blend: refused as such, not as a missing blend
    mock = write_torch_checkpoint(tmp_path / "mock", {**run, "data_path": None, "mock_data": True})
    assert "mock data is generated" in _error("--checkpoint", str(mock), "--iteration", "1")
    # a saved value Megatron-LM would refuse, named as a flag
    odd = write_torch_checkpoint(tmp_path / "odd", {**run, "global_batch_size": 6})
    assert "not divisible" in _error("--checkpoint", str(odd), "--iteration", "1")


@pytest.mark.once
def test_without_checkpoint_the_flags_stay_required(tmp_path):
    result = _run(str(tmp_path), "--iteration", "1", "--micro-batch-size", "1")
    assert result.exit_code == 2 and "Missing option '--seq-length'" in result.output
    result = _run("--iteration", "1", "--seq-length", "8", "--micro-batch-size", "1")
    assert result.exit_code == 2 and "Missing argument 'BLEND_OR_REPACK'" in result.output


# --- checkpoints written by Megatron-LM's own save code --------------------------------------


@pytest.fixture
def saved(megatron_checkpoints):
    """tests/checkpoint_child.py's Megatron-LM checkpoints, over the session's real blend
    (tests/checkpoint_support.py)."""
    return megatron_checkpoints.root, megatron_checkpoints.out


#: checkpoint_child.py's launch (its data flags), typed.
CHILD = {
    "seq_length": 32,
    "split": "90,5,5",
    "seed": 4321,
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "train_iters": 100,
    "eval_interval": 10,
    "eval_iters": 2,
    "dataloader_type": "cyclic",
    "iterations_to_skip": [3, 7],
    "mid_level_dataset_surplus": 0.01,
}


@pytest.mark.megatron
@pytest.mark.parametrize(
    "folder",
    ["megatron-torch", "megatron-dist", pytest.param("bridge", marks=pytest.mark.bridge)],
)
def test_a_checkpoint_gives_the_flags_answer(saved, folder, tmp_path):
    root, out = saved
    if folder == "bridge" and not (out / folder).is_dir():
        if os.environ.get("REPACK_TEST_BRIDGE"):
            pytest.fail("REPACK_TEST_BRIDGE is set but no Bridge checkpoint was written")
        pytest.skip("REPACK_TEST_BRIDGE is not set (Megatron-Bridge 0.6.2 imports on 0.19 only)")
    ckpt = str(out / folder)
    cache = ["--data-cache-path", str(tmp_path / "cache")]  # the saved one, replaced
    typed = [str(root / "blend.txt"), *_flags(CHILD), *cache]
    for ask in (["--iteration", "4"], ["--iterations", "8:10"]):  # after skips; an evaluation
        _same(_answer("--checkpoint", ckpt, *ask, *cache), _answer(*typed, *ask))
    first = _answer(*typed, "--iteration", "2")["samples"][0]
    document = ["--document", f"{first['source']}:{first['documents'][0]['document']}"]
    _same(_answer("--checkpoint", ckpt, *document, *cache), _answer(*typed, *document))
    over = ["--data-parallel-size", "2", "--iteration", "12"]
    _same(_answer("--checkpoint", ckpt, *over, *cache), _answer(*typed, *over))
