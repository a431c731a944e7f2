"""Megatron's dataset descriptions: ``json.dumps(identifiers, indent=4, default=...)``, the same
text, without the pure-Python encoder's generators.

Every ``MegatronDataset.__init__`` describes its ``unique_identifiers`` so, and hashes the text
(MD5) into its cache files' names; ``BlendedDataset.__init__`` does it for the list of all its
datasets' identifiers (megatron/core/datasets/megatron_dataset.py, blended_dataset.py, the same
call in every release from 0.12 to Megatron-LM main). With ``indent`` set, Python's ``json``
encodes in Python, a generator per container and a ``yield`` per token: at 30,000 sources the
descriptions were half of a warm build. :func:`dumps` is that encoder's output, built with one
``join`` per container: the checks in the order of ``json.encoder._make_iterencode`` (``str``,
``None``, ``True``, ``False``, ``int``, ``float``, list or tuple, dict, else ``default``), its
separators (``","`` and ``": "`` with an indent), its number and key conversions. Whatever it
does not take as the encoder does (a circular structure, a key ``json`` refuses, a ``default``
that raises) is handed to ``json.dumps`` itself, which gives the answer or the error.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterable
from json.encoder import INFINITY
from json.encoder import encode_basestring_ascii as _string
from typing import Any

__all__ = ["INDENT", "dumps", "items"]

#: What ``indent=4`` puts before an item, per level.
INDENT = "    "
#: The longest list or tuple a memo keeps (a config's ``split_matrix``, not the list of a
#: blend's 30,000 datasets).
_REMEMBERED_LENGTH = 64


def dumps(
    obj: Any, default: Callable[[Any], Any], memo: dict[Any, tuple[Any, str]] | None = None
) -> str:
    """``json.dumps(obj, indent=4, default=default)``, the same text.

    Args:
        memo: Where to keep the text of every list or tuple of up to 64 items and of every
            value ``default`` stands in for, by identity, for later calls to write again
            (Megatron's builder describes 30,000 datasets of one config: its ``split_matrix``
            and tokenizer, 30,000 times). Give one only over calls between which none of those
            values changes (one build, see :mod:`repack.megatron.buildhook`). Its keys are
            ids; a caller may keep texts of its own in it under keys of another type, and
            put a value's text under its id, written at the top level (``(value, text)``) or
            at the level whose line break is ``level`` (``(value, text, level)``).
    """
    try:
        return _encode(obj, default, "\n", memo)
    except Exception:  # json says what it is, or encodes it (see the module)
        return json.dumps(obj, indent=4, default=default)


def _encode(o: Any, default: Callable[[Any], Any], newline: str, memo: dict | None) -> str:
    """``o`` at the level whose line break (with its indent) is ``newline``."""
    scalar = _SCALARS.get(type(o))
    if scalar is not None:
        return scalar(o)
    kind = type(o)
    if kind is not list and kind is not tuple and kind is not dict and kind is not OrderedDict:
        return _encode_other(o, default, newline, memo)
    if memo is not None and id(o) in memo:  # (a dict only where the caller put its text)
        return _remembered(o, newline, memo, str)
    if not o:
        return "[]" if kind is list or kind is tuple else "{}"
    inner = newline + INDENT
    if kind is list or kind is tuple:
        if memo is not None and len(o) <= _REMEMBERED_LENGTH:
            return _remembered(o, newline, memo, lambda: _encode(o, default, "\n", None))
        items = [
            scalar(value)
            if (scalar := _SCALARS.get(type(value)))
            else _encode(value, default, inner, memo)
            for value in o
        ]  # the scalars' encoders called here: a blend's weights are 30,000 floats
        return "[" + inner + ("," + inner).join(items) + newline + "]"
    return "{" + inner + _items(o.items(), default, inner, memo) + newline + "}"


def items(
    pairs: Iterable[tuple[Any, Any]], default: Callable[[Any], Any], memo: dict | None
) -> str:
    """The text of ``pairs``, items of a top-level object (each after a line break and one
    :data:`INDENT`, joined by ``","``); raises what the encoder meets (:func:`dumps` says it
    as json does)."""
    return _items(pairs, default, "\n" + INDENT, memo)


def _items(pairs: Iterable[tuple[Any, Any]], default: Callable, newline: str, memo) -> str:
    """``"key": value`` of each pair at the level of ``newline``, joined."""
    parts = []
    for key, value in pairs:
        scalar = _SCALARS.get(type(value))
        text = scalar(value) if scalar is not None else _encode(value, default, newline, memo)
        parts.append((_string(key) if type(key) is str else _key(key)) + ": " + text)
    return ("," + newline).join(parts)


def _encode_other(o: Any, default: Callable[[Any], Any], newline: str, memo: dict | None) -> str:
    """``o`` of a type :func:`_encode` does not dispatch on: a subclass of one ``json`` takes
    (in json's order of checks), else what ``default`` makes of it."""
    if isinstance(o, str):
        return _string(o)
    if isinstance(o, int):  # True and False are bool's own: _SCALARS
        return int.__repr__(o)
    if isinstance(o, float):
        return _float(o)
    if isinstance(o, (list, tuple)):
        return _encode(list(o), default, newline, memo)
    if isinstance(o, dict):
        return _encode(dict(o.items()), default, newline, memo)
    if memo is None:
        return _encode(default(o), default, newline, None)
    return _remembered(o, newline, memo, lambda: _encode(default(o), default, "\n", memo))


def _remembered(o: Any, newline: str, memo: dict, encode: Callable[[], str]) -> str:
    """``o``'s text from ``memo`` (``encode()`` the first time), indented at ``newline``'s
    level: a text written at the top level is written one level down with every line break
    followed by one more indent (a string holds no raw line break: json escapes it). A caller's
    entry ``(o, text, level)`` holds a text written at the level whose line break is ``level``:
    as it is there, else first taken back to the top level."""
    held = memo.get(id(o))
    if held is None:
        held = memo[id(o)] = (o, encode())  # o held: its id stays its own
    text = held[1]
    if len(held) > 2:
        if held[2] == newline:
            return text
        text = text.replace(held[2], "\n")  # every line break there is followed by its indent
    return text if newline == "\n" else text.replace("\n", newline)


def _float(o: float) -> str:
    """``json.encoder``'s ``floatstr`` with ``allow_nan``."""
    if o != o:
        return "NaN"
    if o == INFINITY:
        return "Infinity"
    if o == -INFINITY:
        return "-Infinity"
    return float.__repr__(o)


def _key(key: Any) -> str:
    """A dict key as ``_iterencode_dict`` writes it (other keys: ``TypeError``, as json's)."""
    if isinstance(key, str):
        return _string(key)
    if isinstance(key, float):
        return _string(_float(key))
    if key is True:
        return '"true"'
    if key is False:
        return '"false"'
    if key is None:
        return '"null"'
    if isinstance(key, int):
        return _string(int.__repr__(key))
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


#: Encoders of the exact types json writes as they are (its checks: ``o is None``, ``o is True``,
#: ``o is False`` come before ``int``, so a bool is never written as a number).
_SCALARS: dict[type, Callable[[Any], str]] = {
    str: _string,
    int: int.__repr__,
    float: _float,
    bool: lambda o: "true" if o else "false",
    type(None): lambda o: "null",
}
