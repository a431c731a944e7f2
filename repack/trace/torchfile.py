"""Read a file written by ``torch.save`` without torch, without running code from it.

A training checkpoint holds what the run's settings are read from (Megatron-LM's ``args``, an
``argparse.Namespace``; Megatron-Bridge's ``train_state.pt``), pickled by ``torch.save``.
``torch.load(weights_only=False)`` would import every class the pickle names (Megatron's enums,
so Megatron must be installed) and call whatever the pickle says, and it reads every tensor of a
legacy ``model_optim_rng.pt`` (gigabytes) to get at a few bytes of settings.
:func:`load` reads the same files with a restricted unpickler instead:

* the file is torch's zip format (torch 1.6 and later: ``ARCHIVE/data.pkl``, each storage in
  ``ARCHIVE/data/KEY``, ``ARCHIVE/byteorder``); the older tar/pickle format is refused;
* a global the pickle names resolves to a real object only if it is inert data: the builtin
  containers, ``collections.OrderedDict``, ``argparse.Namespace``; torch's tensor rebuild
  functions, storage types and ``copyreg``'s helpers are replaced by functions of this module;
* any other global (a Megatron enum, ``torch.bfloat16``, a function) becomes an
  :class:`Opaque` class named after it: calling it, or building an instance of it, records its
  arguments and state and runs nothing;
* a tensor of at most :data:`TENSOR_ELEMENTS` elements becomes a NumPy array (a 0-d tensor such
  as Bridge's ``step`` a NumPy scalar) read from its storage; a larger one (model weights,
  optimizer state) becomes a :class:`TensorStub` (dtype and shape) and its bytes are not read.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import io
import math
import os
import pickle
import zipfile
from typing import Any

import numpy as np

from repack.errors import CorruptCheckpoint

__all__ = [
    "MAX_PICKLE_BYTES",
    "dcp_object",
    "load_pickle",
    "STORAGE_ELEMENTS",
    "TENSOR_ELEMENTS",
    "Opaque",
    "TensorStub",
    "load",
]

#: The largest ``data.pkl`` read (the pickle of a legacy checkpoint of a large model names every
#: tensor of the model and its optimizer: a few megabytes).
MAX_PICKLE_BYTES = 512 << 20

#: Tensors of at most this many elements are read; larger ones are described, not read.
TENSOR_ELEMENTS = 4096

#: ... and their storage of at most this many (a small view of a large storage is not read).
STORAGE_ELEMENTS = 1 << 16

#: ``torch.<Name>Storage`` → the NumPy dtype of its elements (None: no NumPy equivalent).
_STORAGE_DTYPES: dict[str, str | None] = {
    "DoubleStorage": "<f8",
    "FloatStorage": "<f4",
    "HalfStorage": "<f2",
    "LongStorage": "<i8",
    "IntStorage": "<i4",
    "ShortStorage": "<i2",
    "CharStorage": "i1",
    "ByteStorage": "u1",
    "BoolStorage": "?",
    "ComplexDoubleStorage": "<c16",
    "ComplexFloatStorage": "<c8",
    "UntypedStorage": "u1",
    "BFloat16Storage": None,
}

#: Globals that are plain data and resolve to themselves.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    **{
        ("builtins", t.__name__): t
        for t in (
            set,
            frozenset,
            slice,
            complex,
            bytearray,
            bytes,
            list,
            dict,
            tuple,
            int,
            float,
            str,
            bool,
            object,
        )
    },
}


class _OpaqueType(type):
    def __repr__(cls) -> str:
        return f"<{cls.qualname}>"


class Opaque(metaclass=_OpaqueType):
    """Stands for an object of a class this reader does not import. Subclasses are made per
    global (:func:`_opaque`), named after it in :attr:`qualname`; an instance keeps what the
    pickle gave to build it (``args``, ``kwargs``, ``state``, ``items``) and runs nothing."""

    qualname = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        self = object.__new__(cls)
        self.args, self.kwargs, self.state, self.items = args, kwargs, None, []
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    # a pickled list or dict subclass is filled through these
    def append(self, item: Any) -> None:
        self.items.append(item)

    def extend(self, items: Any) -> None:
        self.items.extend(items)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items.append((key, value))

    @property
    def value(self) -> Any:
        """The first argument it was built with (an enum member's value), or None."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>" if self.args else f"<{self.qualname}>"


_OPAQUE: dict[str, type[Opaque]] = {}


def _opaque(qualname: str) -> type[Opaque]:
    if qualname not in _OPAQUE:
        _OPAQUE[qualname] = _OpaqueType(
            qualname.rpartition(".")[2], (Opaque,), {"qualname": qualname}
        )
    return _OPAQUE[qualname]


class TensorStub:
    """A tensor too large to read here: its dtype (NumPy's name, or torch's storage name) and
    shape."""

    def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape

    def __repr__(self) -> str:
        return f"TensorStub({self.dtype}, {self.shape})"


class _Storage:
    """A storage the pickle refers to: where its bytes are and their dtype."""

    def __init__(self, reader: _Reader, key: str, dtype: str | None, name: str, numel: int):
        self.reader, self.key, self.dtype, self.name, self.numel = reader, key, dtype, name, numel


class _StorageType:
    def __init__(self, name: str) -> None:
        self.name, self.dtype = name, _STORAGE_DTYPES.get(name)


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    """``copyreg._reconstructor`` (protocol 0 and 1) for the classes allowed here."""
    if isinstance(cls, type) and issubclass(cls, Opaque):
        obj = cls()
    elif cls is argparse.Namespace:
        obj = argparse.Namespace()
    else:
        obj = _opaque("copyreg._reconstructor")(cls, base, state)
    if state is not None and not isinstance(obj, Opaque):
        obj.__dict__.update(state)
    return obj


def _newobj(cls: Any, *args: Any) -> Any:
    if isinstance(cls, type) and (issubclass(cls, Opaque) or cls is argparse.Namespace):
        return cls.__new__(cls, *args)
    return _opaque("copyreg.__newobj__")(cls, *args)


class _Reader:
    def __init__(self, path: str, archive: zipfile.ZipFile, root: str) -> None:
        self.path, self.archive, self.root = path, archive, root
        self.byteorder = "little"
        name = f"{root}/byteorder"
        if name in archive.NameToInfo:
            self.byteorder = archive.read(name).decode("ascii", "replace").strip()
            if self.byteorder not in ("little", "big"):
                raise CorruptCheckpoint(
                    f"{path}: unknown byte order {self.byteorder!r} in {name}", path=path
                )

    def tensor(
        self, storage: Any, offset: int, size: tuple, stride: tuple, *_rest: Any
    ) -> np.ndarray | np.generic | TensorStub:
        if not isinstance(storage, _Storage):
            return _opaque("torch._utils._rebuild_tensor_v2")(storage, offset, size, stride)
        shape = tuple(int(n) for n in size)
        numel = math.prod(shape)
        if storage.dtype is None or numel > TENSOR_ELEMENTS:
            return TensorStub(storage.dtype or storage.name, shape)
        dtype = np.dtype(storage.dtype)
        if self.byteorder == "big":
            dtype = dtype.newbyteorder(">")
        if storage.numel > STORAGE_ELEMENTS:  # a small view of a large storage: not read
            return TensorStub(dtype.str, shape)
        name = f"{self.root}/data/{storage.key}"
        try:
            info = self.archive.getinfo(name)
        except KeyError:
            raise CorruptCheckpoint(
                f"{self.path}: the storage {name} a tensor refers to is missing", path=self.path
            ) from None
        if info.file_size != storage.numel * dtype.itemsize:
            raise CorruptCheckpoint(
                f"{self.path}: the storage {name} holds {info.file_size} bytes, its pickle says "
                f"{storage.numel} elements of {dtype.itemsize} bytes",
                path=self.path,
            )
        data = np.frombuffer(self.archive.read(name), dtype=dtype)
        if numel == 0:
            array = np.zeros(shape, dtype)
        else:
            last = int(offset) + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
            if offset < 0 or last >= data.size or any(s < 0 for s in stride):
                raise CorruptCheckpoint(
                    f"{self.path}: a tensor of shape {shape} at offset {offset} reads past the "
                    f"{data.size} elements of its storage {name}",
                    path=self.path,
                )
            array = np.lib.stride_tricks.as_strided(
                data[int(offset) :],
                shape=shape,
                strides=tuple(int(s) * dtype.itemsize for s in stride),
            ).copy()
        return array[()] if array.ndim == 0 else array


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, reader: _Reader | None) -> None:
        super().__init__(file)
        self.reader = reader

    def find_class(self, module: str, name: str) -> Any:
        # protocol 2 names Python 2's modules (torch.save writes protocol 2): what pickle's own
        # find_class maps, mapped alike
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name.endswith("Storage"):
            return _StorageType(name)
        if module == "torch.storage" and name in ("UntypedStorage", "TypedStorage"):
            return _StorageType("UntypedStorage")
        if (
            module == "torch._utils"
            and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3")
            and self.reader is not None
        ):
            return self.reader.tensor
        if module == "torch._utils" and name in (
            "_rebuild_parameter",
            "_rebuild_parameter_with_state",
        ):
            return lambda data, *_: data
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return lambda func, _type, args, _state: func(*args)
        if module == "copyreg" and name == "_reconstructor":
            return _reconstructor
        if module == "copyreg" and name == "__newobj__":
            return _newobj
        return _opaque(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and self.reader is not None
        ):
            _, kind, key, _location, numel = pid
            return _Storage(self.reader, str(key), kind.dtype, kind.name, int(numel))
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r:.80}")


def load(path: str | os.PathLike, *, source: bytes | None = None, name: str = "") -> Any:
    """The object ``torch.save`` wrote to ``path``, read as this module's docstring says.

    Args:
        path: The file; or, with ``source``, the file that holds those bytes (for messages).
        source: The bytes of a ``torch.save`` output held inside another file (a distributed
            checkpoint's object), read instead of ``path``.
        name: What in ``path`` the bytes are, for messages (``"common_state/shard_0_1"``).

    Raises:
        CorruptCheckpoint: the file cannot be read, is not torch's zip format, or its pickle is
            damaged (the message names the file and the cause).
    """
    path = os.fspath(path)
    where = f"{path} ({name})" if name else path
    try:
        archive = zipfile.ZipFile(path if source is None else io.BytesIO(source))
    except OSError as err:
        raise CorruptCheckpoint(f"{path}: cannot read: {err.strerror or err}", path=path) from None
    except zipfile.BadZipFile as err:
        raise CorruptCheckpoint(
            f"{where}: not a file written by torch.save (torch 1.6 or later: a zip archive): {err}",
            path=path,
        ) from None
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise CorruptCheckpoint(
                f"{where}: a zip archive without torch's ARCHIVE/data.pkl: not written by "
                "torch.save",
                path=path,
            )
        info = archive.getinfo(pickles[0])
        if info.file_size > MAX_PICKLE_BYTES:
            raise CorruptCheckpoint(
                f"{where}: {pickles[0]} is {info.file_size:,} bytes, more than the "
                f"{MAX_PICKLE_BYTES:,} read",
                path=path,
            )
        try:
            data = archive.read(info)
            reader = _Reader(where, archive, pickles[0].partition("/")[0])
            return _Unpickler(io.BytesIO(data), reader).load()
        except CorruptCheckpoint:
            raise
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
            raise CorruptCheckpoint(
                f"{where}: cannot read {pickles[0]}: {err}", path=path
            ) from None
        except Exception as err:  # a damaged pickle raises about anything
            raise CorruptCheckpoint(
                f"{where}: damaged pickle in {pickles[0]}: {type(err).__name__}: {err}", path=path
            ) from None


def load_pickle(path: str | os.PathLike, max_bytes: int = MAX_PICKLE_BYTES) -> Any:
    """A plain pickle file (not a zip: what ``torch.distributed.checkpoint`` writes as
    ``.metadata``), read with the same restrictions as :func:`load`; it may hold no tensor."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise CorruptCheckpoint(f"{path}: cannot read: {err.strerror or err}", path=path) from None
    if len(data) > max_bytes:
        raise CorruptCheckpoint(f"{path}: larger than the {max_bytes:,} bytes read", path=path)
    try:
        return _Unpickler(io.BytesIO(data), None).load()
    except Exception as err:  # a damaged pickle raises about anything
        raise CorruptCheckpoint(
            f"{path}: damaged pickle: {type(err).__name__}: {err}", path=path
        ) from None


def dcp_object(folder: str | os.PathLike, key: str) -> Any | None:
    """The object stored under ``key`` in the ``torch.distributed.checkpoint`` folder
    ``folder`` (its ``.metadata`` says which file holds it and where; the bytes there are a
    ``torch.save`` output), or None if the checkpoint has no such object.

    Raises:
        CorruptCheckpoint: ``.metadata`` or the data file cannot be read or is damaged.
    """
    folder = os.fspath(folder)
    metadata_path = os.path.join(folder, ".metadata")
    metadata = load_pickle(metadata_path)
    state = metadata.state if isinstance(metadata, Opaque) else None
    storage = state.get("storage_data") if isinstance(state, dict) else None
    if not isinstance(storage, dict):
        raise CorruptCheckpoint(
            f"{metadata_path}: no storage_data: not torch.distributed.checkpoint's Metadata",
            path=metadata_path,
        )
    info = None
    for index, where in storage.items():
        fields = getattr(index, "state", None)
        if isinstance(fields, dict) and fields.get("fqn") == key:
            info = getattr(where, "state", None)
            break
    else:
        return None
    relative = info.get("relative_path") if isinstance(info, dict) else None
    offset = info.get("offset") if isinstance(info, dict) else None
    length = info.get("length") if isinstance(info, dict) else None
    if (
        not isinstance(relative, str)
        or os.sep in relative
        or relative in ("", ".", "..")
        or not isinstance(offset, int)
        or not isinstance(length, int)
        or offset < 0
        or not 0 < length <= MAX_PICKLE_BYTES
    ):
        raise CorruptCheckpoint(
            f"{metadata_path}: the place of {key} is not a file, offset and length: {info!r:.200}",
            path=metadata_path,
        )
    if info.get("transform_descriptors"):
        raise CorruptCheckpoint(
            f"{metadata_path}: {key} is stored transformed ({info['transform_descriptors']}): "
            "not read",
            path=metadata_path,
        )
    data_path = os.path.join(folder, relative)
    try:
        with open(data_path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
    except OSError as err:
        raise CorruptCheckpoint(
            f"{data_path}: cannot read: {err.strerror or err}", path=data_path
        ) from None
    if len(data) != length:
        raise CorruptCheckpoint(
            f"{data_path}: ends at {offset + len(data):,} bytes, before {key}'s "
            f"{offset:,}+{length:,}",
            path=data_path,
        )
    return load(data_path, source=data, name=key)
