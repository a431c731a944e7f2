"""Stand-ins for the packages Megatron-Bridge imports at import time and this machine lacks.

``transformer_engine``
    Bridge imports it in model code (``megatron/bridge/peft/lora_layers.py``, the model bridges
    and providers, ``training/comm_overlap.py``), even when only the data path or the
    checkpointing is used, and Transformer Engine does not install without CUDA. Nothing in the
    stand-in can be called (:class:`TransformerEngineStandIn` raises), and every attribute looked
    up on it is recorded in :data:`LOOKED_UP`.
``modelopt`` (NVIDIA ModelOpt)
    ``megatron/bridge/training/checkpointing.py`` imports ``save_sharded_modelopt_state``,
    ``save_modelopt_state`` and ``restore_modelopt_state`` from ``modelopt.torch.opt.plugins``
    and calls the first at every save. ModelOpt's own function returns at once for a model
    ModelOpt never converted (its first line: ``if not
    mto.ModeloptStateManager.is_converted(model[0]): return``), which a model built by the test
    never is: the stand-in's save functions return likewise, recording each call in
    :data:`CALLED`; ``restore_modelopt_state`` raises. ModelOpt is not installed in CI's Python
    3.12 environment (Bridge is installed without its dependencies).

The stand-ins are served only to imports made by ``megatron.bridge`` modules (megatron-core
keeps seeing no Transformer Engine, as on any machine without it); :func:`install` puts them in
place, once per process. Nothing else is stubbed.
"""

from __future__ import annotations

import builtins
import types

__all__ = [
    "CALLED",
    "LOOKED_UP",
    "ModelOptUsed",
    "TransformerEngineStandIn",
    "TransformerEngineUsed",
    "install",
    "uninstall",
]


class TransformerEngineUsed(ImportError):
    """Something called the Transformer Engine stand-in, or imported what it does not have.
    An ``ImportError``, as a missing Transformer Engine would raise."""


class ModelOptUsed(ImportError):
    """Bridge imported or called a part of ModelOpt the stand-in does not have."""


#: Every attribute path looked up on the Transformer Engine stand-in, in order.
LOOKED_UP: list[str] = []

#: Every call of a ModelOpt stand-in function: (name, its arguments).
CALLED: list[tuple[str, tuple]] = []


class TransformerEngineStandIn(types.ModuleType):
    """``transformer_engine`` and ``transformer_engine.pytorch`` for Bridge's imports: every
    attribute is another stand-in (type annotations such as ``te.ops.Sequential`` evaluate at
    import time); calling anything raises."""

    def __init__(self, name: str) -> None:
        super().__init__(name)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__") and name != "__version__":
            raise AttributeError(name)  # what import machinery and inspect ask for
        path = f"{self.__name__}.{name}"
        LOOKED_UP.append(path)
        return TransformerEngineStandIn(path)

    def __call__(self, *args, **kwargs):
        raise TransformerEngineUsed(f"{self.__name__}() called: Transformer Engine is a stand-in")


_STAND_INS = {"transformer_engine": TransformerEngineStandIn("transformer_engine")}
_STAND_INS["transformer_engine.pytorch"] = _STAND_INS["transformer_engine"].__dict__.setdefault(
    "pytorch", TransformerEngineStandIn("transformer_engine.pytorch")
)


def _unconverted_save(name: str):
    def save(model, *args, **kwargs):
        """What ModelOpt does for a model it never converted: nothing."""
        CALLED.append((name, (model, *args)))

    save.__name__ = name
    return save


def _restore(*args, **kwargs):
    raise ModelOptUsed("restore_modelopt_state() called: ModelOpt is a stand-in")


_MODELOPT_PLUGINS = types.ModuleType("modelopt.torch.opt.plugins")
_MODELOPT_PLUGINS.save_sharded_modelopt_state = _unconverted_save("save_sharded_modelopt_state")
_MODELOPT_PLUGINS.save_modelopt_state = _unconverted_save("save_modelopt_state")
_MODELOPT_PLUGINS.restore_modelopt_state = _restore

_real_import = builtins.__import__


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    if level == 0 and importer.startswith("megatron.bridge."):
        top = name.split(".")[0]
        if top == "transformer_engine":
            if name not in _STAND_INS:
                raise TransformerEngineUsed(
                    f"{importer} imports {name}: Transformer Engine is a stand-in"
                )
            return _STAND_INS[name] if fromlist else _STAND_INS["transformer_engine"]
        if top == "modelopt":
            if name != "modelopt.torch.opt.plugins" or not fromlist:
                raise ModelOptUsed(f"{importer} imports {name}: ModelOpt is a stand-in")
            return _MODELOPT_PLUGINS
    return _real_import(name, globals, locals, fromlist, level)


def install() -> None:
    """Serve the stand-ins to ``megatron.bridge``'s imports from now on."""
    builtins.__import__ = _import


def uninstall() -> None:
    """Back to the real import (when Bridge turned out not to import)."""
    builtins.__import__ = _real_import
