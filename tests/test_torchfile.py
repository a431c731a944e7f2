"""repack.trace.torchfile reads what torch.save writes, without torch and without running its code.

Files are written by the real ``torch.save``; what :func:`repack.trace.torchfile.load` gives is
compared with ``torch.load`` of the same file. Then one crafted bad input per cause of
:class:`~repack.errors.CorruptCheckpoint`.
"""

from __future__ import annotations

import argparse
import enum
import io
import os
import pickle
import sys
import types
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from repack.errors import CorruptCheckpoint
from repack.trace import torchfile

torch = pytest.importorskip("torch")


class Backend(enum.Enum):  # stands for a Megatron enum (AttnBackend) in a saved Namespace
    flash = 1
    auto = 5


def _module_of(cls: type, name: str) -> types.ModuleType:
    """Put ``cls`` in a module of its own, importable while saving, removed before loading."""
    module = types.ModuleType(name)
    setattr(module, cls.__name__, cls)
    cls.__module__ = name
    sys.modules[name] = module
    return module


@pytest.fixture
def saved(tmp_path: Path):
    """A dict as Megatron saves: args (a Namespace with an enum from a module that is gone at
    load time, a torch dtype, a function), the iteration, model weights, small tensors."""
    _module_of(Backend, "megatron_stand_in_enums")
    args = argparse.Namespace(
        seq_length=128,
        data_path=["0.3", "a", "0.7", "b"],
        split="99,1,0",
        rampup_batch_size=None,
        iterations_to_skip=[3, 5],
        attention_backend=Backend.auto,
        params_dtype=torch.bfloat16,
        join=os.path.join,
    )
    state = {
        "args": args,
        "iteration": 7,
        "checkpoint_version": 3.0,
        "model": OrderedDict(weight=torch.randn(300, 300), bias=torch.arange(5)),
        "step": torch.tensor(9, dtype=torch.int64),
        "flops": torch.tensor(1.5, dtype=torch.float64),
        "flag": torch.tensor(True),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "view": torch.arange(100)[10:20:2],
        "nested": {"set": {1, 2}, "tuple": (1, "x"), "none": None},
    }
    path = tmp_path / "model_optim_rng.pt"
    torch.save(state, path)
    del sys.modules["megatron_stand_in_enums"]
    return path


def test_reads_what_torch_load_reads(saved: Path) -> None:
    got = torchfile.load(saved)
    sys.modules["megatron_stand_in_enums"] = types.SimpleNamespace(Backend=Backend)
    try:
        want = torch.load(saved, weights_only=False)
    finally:
        del sys.modules["megatron_stand_in_enums"]
    plain = ("seq_length", "data_path", "split", "rampup_batch_size", "iterations_to_skip")
    for key in plain:
        assert getattr(got["args"], key) == getattr(want["args"], key), key
    assert got["iteration"] == want["iteration"] == 7
    assert got["checkpoint_version"] == 3.0
    assert got["nested"] == want["nested"]
    # small tensors: values, dtypes and shapes as torch reads them
    for key in ("step", "flops", "flag", "view"):
        assert np.array_equal(np.asarray(got[key]), want[key].numpy()), key
        assert np.asarray(got[key]).dtype == want[key].numpy().dtype, key
    assert isinstance(got["step"], np.int64) and got["step"] == 9
    assert np.array_equal(got["model"]["bias"], np.arange(5))
    # large tensors and dtypes without a NumPy equivalent are described, not read
    assert isinstance(got["model"]["weight"], torchfile.TensorStub)
    assert got["model"]["weight"].shape == (300, 300)
    assert got["model"]["weight"].dtype == "<f4"
    assert isinstance(got["bf16"], torchfile.TensorStub) and got["bf16"].shape == (3,)


def test_unknown_classes_become_opaque(saved: Path) -> None:
    args = torchfile.load(saved)["args"]
    backend = args.attention_backend
    assert isinstance(backend, torchfile.Opaque)
    assert backend.qualname == "megatron_stand_in_enums.Backend" and backend.value == 5
    assert args.params_dtype.qualname == "torch.bfloat16"
    assert args.join.qualname in ("posixpath.join", "ntpath.join")


def test_runs_nothing_from_the_file(tmp_path: Path) -> None:
    """A pickle whose loading would run a command: the command becomes an Opaque call."""
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    torch.save({"args": Exploit()}, path)
    got = torchfile.load(path)
    assert isinstance(got["args"], torchfile.Opaque)
    assert got["args"].args == (f"touch {marker}",)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the check can see it: torch.load does run it
    assert marker.exists()


def test_the_pickle_alone_is_read(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights' storage is never read: only data.pkl and the small storages."""
    read = []
    real = zipfile.ZipFile.read

    def spy(self, name, pwd=None):
        read.append(name if isinstance(name, str) else name.filename)
        return real(self, name, pwd)

    monkeypatch.setattr(zipfile.ZipFile, "read", spy)
    torchfile.load(saved)
    with zipfile.ZipFile(saved) as archive:
        sizes = {n: archive.getinfo(n).file_size for n in archive.namelist()}
    assert any(n.endswith("/data.pkl") for n in read)
    largest = max((n for n in sizes if "/data/" in n), key=sizes.get)
    assert sizes[largest] == 300 * 300 * 4
    assert largest not in read
    assert sum(sizes[n] for n in read) < 20_000


# --- one crafted bad input per cause ---------------------------------------------------------


def expect(path: Path, *found: str) -> str:
    with pytest.raises(CorruptCheckpoint) as caught:
        torchfile.load(path)
    message = str(caught.value)
    assert str(path) in message and caught.value.path == str(path)
    for text in found:
        assert text in message, message
    return message


def test_missing_file(tmp_path: Path) -> None:
    expect(tmp_path / "absent.pt", "cannot read", "No such file")


def test_not_a_zip(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    with open(path, "wb") as f:
        torch.save({"a": 1}, f, _use_new_zipfile_serialization=False)  # torch < 1.6's format
    expect(path, "not a file written by torch.save")


def test_zip_without_pickle(tmp_path: Path) -> None:
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/readme.txt", "hello")
    expect(path, "without torch's ARCHIVE/data.pkl")


def test_truncated(saved: Path) -> None:
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2])
    expect(saved, "not a file written by torch.save")


def _rewrite(path: Path, change) -> None:
    """Rewrite the zip at ``path``, ``change(name, data)`` giving each member's new bytes
    (None: left out)."""
    with zipfile.ZipFile(path) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members:
            new = change(name, data)
            if new is not None:
                archive.writestr(name, new)


def test_damaged_pickle(saved: Path) -> None:
    _rewrite(saved, lambda n, d: d[: len(d) // 3] if n.endswith("data.pkl") else d)
    expect(saved, "damaged pickle in", "data.pkl")


def test_storage_missing(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    torch.save({"step": torch.tensor(3)}, path)
    _rewrite(path, lambda n, d: None if "/data/" in n else d)
    expect(path, "a tensor refers to is missing")


def test_storage_of_wrong_size(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    torch.save({"step": torch.tensor(3)}, path)
    _rewrite(path, lambda n, d: d[:4] if "/data/" in n else d)
    expect(path, "holds 4 bytes, its pickle says 1 elements of 8 bytes")


def test_tensor_past_its_storage(tmp_path: Path) -> None:
    """A tensor whose offset and shape read past its storage (offset 5 of 4 elements)."""
    storage = object()

    class Tensor:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v2, (storage, 5, (4,), (1,), False, OrderedDict()))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.LongStorage, "0", "cpu", 4) if obj is storage else None

    data = io.BytesIO()
    Pickler(data, protocol=2).dump({"t": Tensor()})
    path = tmp_path / "state.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", data.getvalue())
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/data/0", np.arange(4, dtype="<i8").tobytes())
    expect(path, "reads past the 4 elements of its storage")
    # the same file with offset 0 reads
    data = io.BytesIO()
    Tensor.__reduce__ = lambda self: (
        torch._utils._rebuild_tensor_v2,
        (storage, 0, (4,), (1,), False, OrderedDict()),
    )
    Pickler(data, protocol=2).dump({"t": Tensor()})
    _rewrite(path, lambda n, d: data.getvalue() if n.endswith("data.pkl") else d)
    assert torchfile.load(path)["t"].tolist() == [0, 1, 2, 3]
