"""Checkpoints written by Megatron's own save code, for the tests that read them
(tests/test_checkpoints.py, tests/test_trace_checkpoint.py): tests/checkpoint_child.py runs
Megatron-LM's ``save_checkpoint`` (and Megatron-Bridge's, with ``REPACK_TEST_BRIDGE``) in a
child process; here is how it is started, and when it must be able to run. The child runs once
a test session, over a real blend, for both files (the ``megatron_checkpoints`` fixture of
tests/conftest.py): each run of Megatron's save code costs some 20 s."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def release() -> tuple[int, int] | None:
    """The (major, minor) of the megatron-core imported, or None."""
    try:
        from repack.megatron import MEGATRON_VERSION
    except Exception:  # no megatron-core
        return None
    parts = MEGATRON_VERSION.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) if len(parts) >= 2 and parts[1].isdigit() else None


def _name(found: tuple[int, int] | None) -> str:
    return "megatron-core (none)" if found is None else f"megatron-core {found[0]}.{found[1]}"


def require_save_code() -> None:
    """Skip before megatron-core 0.17 (no ``megatron/training`` in the wheel); fail from 0.17
    on when it does not import, and when ``REPACK_TEST_BRIDGE`` asks for a Bridge that does
    not import."""
    found = release()
    if found is None or importlib.util.find_spec("megatron.training") is None:
        if found is not None and found >= (0, 17):
            pytest.fail(f"{_name(found)} ships megatron/training, but it cannot be imported")
        pytest.skip(f"{_name(found)} has no megatron/training (the wheels have it from 0.17)")
    if bridge() and importlib.util.find_spec("megatron.bridge") is None:
        pytest.fail("REPACK_TEST_BRIDGE is set but megatron.bridge is not importable")


def bridge() -> bool:
    """Whether Bridge's checkpoint is written too (CI's 0.19 run: Bridge 0.6.2 imports there)."""
    return bool(os.environ.get("REPACK_TEST_BRIDGE"))


def write_checkpoints(out: Path, data: dict | None = None) -> None:
    """Run tests/checkpoint_child.py into ``out``; ``data`` replaces its blend and cache folder
    (``CHECKPOINT_DATA``)."""
    from repack.trace.run_settings import KEYS

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(TESTS), *(p for p in sys.path if p)]),
        CHECKPOINT_KEYS=json.dumps(KEYS),
    )
    if data is not None:
        env["CHECKPOINT_DATA"] = json.dumps(data)
    command = [sys.executable, str(TESTS / "checkpoint_child.py"), str(out)]
    if bridge():
        command.append("--bridge")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@dataclass(frozen=True)
class Written:
    """What :func:`write_session_checkpoints` wrote.

    Attributes:
        root: The blend's folder (``blend.txt``: its ``--data-path`` in the data-args form).
        data_path: The launches' ``--data-path`` (weights and prefixes of real sources).
        cache: Their ``--data-cache-path``.
        out: checkpoint_child.py's folder (``megatron-torch``, ``megatron-dcp``, ...).
        expected: Its ``expected.json``.
    """

    root: Path
    data_path: list[str]
    cache: str
    out: Path
    expected: dict


def write_torch_checkpoint(root: Path, args: dict, iteration: int = 12) -> Path:
    """``root`` as Megatron-LM's --save folder of a torch-format checkpoint saving ``args``
    (an ``argparse.Namespace``, as Megatron-LM saves them), for the tests without Megatron's
    save code."""
    import argparse

    import torch

    folder = root / f"iter_{iteration:07d}" / "mp_rank_00"
    folder.mkdir(parents=True)
    state = {"args": argparse.Namespace(**args), "iteration": iteration}
    torch.save(state, folder / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return root


def write_blend(root: Path) -> list[str]:
    """Three small sources in ``root`` and ``root/blend.txt``, their ``--data-path`` in the
    data-args form; returns that ``--data-path`` (weights and prefixes)."""
    from megatron_support import init_process_group, weights_for, write_sources

    init_process_group()
    prefixes = write_sources(root, 3, sequences=(24, 40), tokens=(3, 60))
    data_path = [x for w, p in zip(weights_for(prefixes, seed=2), prefixes) for x in (str(w), p)]
    (root / "blend.txt").write_text(" ".join(data_path))
    return data_path


def write_session_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Written:
    """tests/checkpoint_child.py's checkpoints over three real sources (which
    tests/test_trace_checkpoint.py traces): the ``megatron_checkpoints`` fixture."""
    require_save_code()
    root = tmp_path_factory.mktemp("checkpoint-blend")
    data_path = write_blend(root)
    out = tmp_path_factory.mktemp("checkpoints")
    cache = str(out / "saved-cache")
    write_checkpoints(out, {"data_path": data_path, "data_cache_path": cache})
    expected = json.loads((out / "expected.json").read_text())
    return Written(root, data_path, cache, out, expected)
