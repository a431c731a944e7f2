"""Shared fixtures: a generated demo blend, its repack, and writers of small custom sources.

The session-scoped fixtures are shared by every test module; tests must treat their files as
read-only (copy them, or build their own with ``make_source``/``write_blend``, to damage).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from repack.inputs.sources import read_source_index
from repack.merge import merge
from repack.synth import DemoBlend, make_blend, write_prefix

# --- without torch or megatron-core --------------------------------------------------------------

#: What a test module may need that ``pip install -e '.[test]'`` does not install: the user's own
#: torch and Megatron (tests/constraints.txt pins CI's), and what the ecosystem tests import.
OPTIONAL = {
    "torch": "torch",
    "megatron": "megatron-core",
    "transformers": "transformers",
    "boto3": "boto3 (the s3 extra)",
    "multistorageclient": "multi-storage-client (the msc extra)",
}


class _Module(pytest.Module):
    """A test module that cannot be imported for want of an optional package is skipped, by
    the package's name, instead of stopping the collection: ``pip install -e '.[test]' &&
    pytest`` without torch or megatron-core runs every test that needs neither."""

    def _getobj(self):
        try:
            return super()._getobj()
        except self.CollectError as err:
            missing = err.__cause__
            if isinstance(missing, ModuleNotFoundError):
                top = (missing.name or "").split(".")[0]
                if top in OPTIONAL:
                    reason = f"{self.path.name}: needs {OPTIONAL[top]}, not installed"
                    pytest.skip(reason, allow_module_level=True)
            raise


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.name.startswith("test_"):
        return _Module.from_parent(parent, path=module_path)
    return None


#: Sources of the demo blend: enough to be a realistic blend, few enough to stay fast.
DEMO_SOURCES = 300

MakeSource = Callable[..., str]
WriteBlend = Callable[..., Path]


@pytest.fixture(scope="session")
def demo_blend(tmp_path_factory: pytest.TempPathFactory) -> DemoBlend:
    """300 sources: uint16 and int32, multi-sequence documents, 6 multimodal sources, the
    edge cases of ``make_blend`` (empty sequences, an empty document), nested folders, and
    relative plus absolute prefixes in the flat blend."""
    blend = make_blend(
        tmp_path_factory.mktemp("demo"), DEMO_SOURCES, seed=11, multimodal_fraction=0.02
    )
    # the premises the tests rely on; fail loudly if the generator ever changes them
    dtypes = {Path(p + ".idx").read_bytes()[17] for p in blend.prefixes}
    assert dtypes == {4, 8}, dtypes  # int32 and uint16
    widest = max(int(np.diff(read_source_index(p).documents).max()) for p in blend.prefixes)
    assert widest > 1  # some document spans several sequences
    assert len(blend.multimodal) >= 2
    flat = json.loads(blend.flat_json.read_text())
    written = flat[1::2]
    assert any(os.path.isabs(p) for p in written) and not all(os.path.isabs(p) for p in written)
    return blend


@pytest.fixture(scope="session")
def demo_repack(demo_blend: DemoBlend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo blend's flat JSON merged with the default options. Read-only."""
    out = tmp_path_factory.mktemp("demo-repack") / "out"
    merge(demo_blend.flat_json, out)
    return out


@pytest.fixture(scope="session")
def demo_repack_cut(demo_blend: DemoBlend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo blend merged into 8 KiB shards: most sources are cut across shards."""
    out = tmp_path_factory.mktemp("demo-repack-cut") / "out"
    merge(demo_blend.flat_json, out, shard_size=8192)
    return out


@pytest.fixture
def make_source(tmp_path: Path) -> MakeSource:
    """``make_source(name, sequences, dtype=..., documents=..., modes=...)`` writes the
    prefix ``tmp_path/name`` with :func:`repack.synth.write_prefix` and returns it."""

    def make(
        name: str,
        sequences: Sequence[Sequence[int] | np.ndarray],
        *,
        dtype: type | str = np.uint16,
        documents: Sequence[int] | None = None,
        modes: Sequence[int] | None = None,
    ) -> str:
        prefix = str(tmp_path / name)
        write_prefix(
            prefix,
            [np.asarray(s, dtype=np.int64) for s in sequences],
            dtype=dtype,
            document_indices=None if documents is None else np.asarray(documents),
            modes=modes,
        )
        return prefix

    return make


@pytest.fixture
def write_blend(tmp_path: Path) -> WriteBlend:
    """``write_blend(prefixes, name="blend.json", weights=None)`` writes a flat JSON blend
    ``[w1, p1, w2, p2, ...]`` (weights default to 1.0) into ``tmp_path`` and returns it."""

    def write(
        prefixes: Sequence[str],
        name: str = "blend.json",
        weights: Sequence[float] | None = None,
    ) -> Path:
        weights = [1.0] * len(prefixes) if weights is None else list(weights)
        items: list[object] = []
        for weight, prefix in zip(weights, prefixes, strict=True):
            items += [weight, prefix]
        path = tmp_path / name
        path.write_text(json.dumps(items))
        return path

    return write


@pytest.fixture(scope="session")
def megatron_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """Checkpoints written by Megatron-LM's (and Bridge's) own save code, once a session, for
    tests/test_checkpoints.py and tests/test_trace_checkpoint.py (tests/checkpoint_support.py;
    skips or fails there as it says)."""
    from checkpoint_support import write_session_checkpoints

    return write_session_checkpoints(tmp_path_factory)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A SeaweedFS S3 server on 127.0.0.1 for the whole session (tests/s3_support.py);
    skipped where ``weed`` or boto3 is missing, a failure in CI."""
    from s3_support import missing, start_server

    try:
        import boto3  # noqa: F401
    except ImportError:
        missing("boto3 not installed: pip install -e '.[s3]'")
    server = start_server(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server):
    """The S3 server with its admin credentials in the environment; ``s3.new_bucket()``."""
    from s3_support import server_env

    with server_env(s3_server):
        yield s3_server
