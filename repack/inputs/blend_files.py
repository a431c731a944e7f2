"""Parse Megatron blend files: which dataset prefixes to read, and with which weights.

Megatron, NeMo and Megatron-Bridge users keep a training blend in one of these forms.
:func:`load_blend` reads any of them, auto-detected, into one
:class:`~repack.format.blend.Blend`:

``data-path``
    A JSON list as given to ``--data-path`` (or NeMo's ``paths``, Megatron-Bridge's
    ``data_path``): weight/prefix pairs ``[0.3, "a", 0.7, "b"]`` (weights as numbers or numeric
    strings such as ``"0.3"``) or bare prefixes ``["a", "b"]``.
``per-split-data-args``
    A JSON object as read from ``--per-split-data-args-path``:
    ``{"train": [...], "valid": [...], "test": [...]}``. Each value is a list as above, a string
    of whitespace-separated items (Megatron splits those) or ``null``; a missing key means
    ``null``.
``nemo-paths``
    NeMo's per-split ``paths`` dict (``PreTrainingDataModule(paths=...)`` in NeMo 2,
    ``model.data.data_prefix`` in NeMo 1): ``{"train": [...], "validation": [...], "test":
    [...]}``, told apart by its ``validation`` key, which is Megatron's ``valid`` split. Each
    value is a list as above or ``null``; a missing key means ``null``. A string value is
    refused: NeMo hands each value to Megatron's ``get_blend_from_list``, which would read a
    string letter by letter.
``data-args``
    Plain text as read from ``--data-args-path``: whitespace-separated ``w1 p1 w2 p2 ...`` or bare
    prefixes, any mix of spaces and newlines.
``mcore-blend``
    Megatron-Core's ``BlendedMegatronDatasetConfig.blend`` as Megatron-Bridge and NeMo configs
    write it: ``[["a", "b"], [0.3, 0.7]]``, the weights possibly ``null``.
``mcore-blend-per-split``
    ``{"blend_per_split": [train, valid, test]}``, each item an ``mcore-blend`` or ``null``.

A JSON (or YAML) object may also be a whole training config that holds the blend under one of
the keys its tool reads (see :data:`CONFIG_KEYS`): Megatron-Bridge's ``dataset.blend_per_split``,
``dataset.blend`` or ``dataset.data_path`` (its ``run_config.yaml`` and override files), NeMo 2's
``data.paths`` and NeMo 1's ``model.data.data_prefix``. The blend is then read with that tool's
rules and recorded with the form of its value; other keys of the config are ignored.

Detection: a file named ``*.yaml`` or ``*.yml`` is YAML (it needs PyYAML, an optional
dependency: NeMo and Megatron-Bridge images have it) and holds any of the JSON forms or a
config. Otherwise the file is JSON if it parses as JSON. A file that starts with ``[`` or ``{``
but does not parse is malformed JSON; anything else is the ``data-args`` text form.

We follow Megatron's reading (``get_blend_from_list`` strips prefixes, weights go through
``float()``) but refuse what Megatron lets through by accident or crashes on:

* a list is either all prefixes or weight/prefix pairs. Megatron treats any odd-length list as
  bare prefixes (so ``[0.3, "a", "b"]`` becomes three prefixes, the first named ``0.3``), and
  its check that an even-length list does not mix the two only looks at the items after the
  first non-number, so ``["0.3", "a", "b", "c"]`` also becomes four prefixes;
* weights must be finite numbers > 0; ``true`` is not a number (Python's ``float(True)`` is 1);
* prefixes must be non-empty strings; in the Megatron-Core forms, which Megatron does not strip,
  they must also carry no surrounding whitespace; in a YAML file or a config, a prefix holding an
  OmegaConf interpolation ``${...}`` is refused (repack does not resolve them);
* an empty list, an empty blend, and duplicated JSON or YAML keys are errors.

One dataset given twice in a split is kept twice, with its weights (Megatron builds it twice,
one dataset per entry; ``repack doctor`` warns of it); a repack stores it once.

Weights are kept as parsed, not normalized. Relative prefixes resolve against the folder of the
blend file (not the working directory Megatron would use); ``~`` is not expanded.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Sequence
from typing import Any, NoReturn

from repack.errors import BlendError
from repack.format.blend import (
    ALL,
    SPLITS,
    Blend,
    BlendEntry,
    counted,
    show_value,
)

__all__ = [
    "CONFIG_KEYS",
    "MAX_BLEND_BYTES",
    "load_blend",
    "parse_blend_text",
]

#: Where the training configs of NeMo and Megatron-Bridge hold the blend, in the order a config
#: holding several is read (see the module docstring).
CONFIG_KEYS = (
    "dataset.blend_per_split",
    "dataset.blend",
    "dataset.data_path",
    "data.paths",
    "model.data.data_prefix",
)

#: Blend files larger than this are refused before reading.
MAX_BLEND_BYTES = 64 * 1024 * 1024

# The top-level keys of a config holding the blend (the first key of each of CONFIG_KEYS).
_CONFIG_SECTIONS = frozenset(key.split(".")[0] for key in CONFIG_KEYS)

# NeMo's name of Megatron's "valid" split.
_NEMO_VALID = "validation"

_YAML_SUFFIXES = (".yaml", ".yml")

# Why a string is refused where NeMo reads a list.
_NEMO_STRING = (
    "NeMo hands it to Megatron's get_blend_from_list, which reads a string letter by letter: "
    "write a list"
)


def load_blend(path: str | os.PathLike[str], *, strict_weights: bool = True) -> Blend:
    """Read and parse a blend file in any of the supported forms.

    Args:
        path: The blend file. Relative prefixes inside it resolve against its folder.
        strict_weights: Refuse weights that are numbers but not finite and > 0 (the default).
            ``False`` keeps them as parsed, for ``repack doctor`` to report them all at once.

    Returns:
        The parsed blend; ``source`` is ``path`` as given.

    Raises:
        BlendError: The file cannot be read, is larger than :data:`MAX_BLEND_BYTES`, is not
            UTF-8, its content is not a valid blend, or it is YAML and PyYAML is missing.
    """
    source = os.fspath(path)
    try:
        st = os.stat(source)
    except OSError as e:
        raise BlendError(f"{source}: cannot read blend file: {e.strerror or e}", path=source) from e
    if stat.S_ISDIR(st.st_mode):
        raise BlendError(f"{source}: cannot read blend file: it is a directory", path=source)
    if not stat.S_ISREG(st.st_mode):
        raise BlendError(f"{source}: cannot read blend file: not a regular file", path=source)
    too_big = (
        f"{source}: blend file is larger than {MAX_BLEND_BYTES} bytes (64 MiB); "
        "a blend file is a short list of prefixes"
    )
    if st.st_size > MAX_BLEND_BYTES:
        raise BlendError(
            too_big.replace("larger than", f"{st.st_size} bytes, larger than"), path=source
        )
    try:
        with open(source, "rb") as f:
            # read(n) allocates n bytes up front: ask for what stat saw, plus one byte to
            # notice growth, then at most up to the limit
            data = f.read(st.st_size + 1)
            if len(data) > st.st_size:
                data += f.read(MAX_BLEND_BYTES + 1 - len(data))
    except OSError as e:
        raise BlendError(f"{source}: cannot read blend file: {e.strerror or e}", path=source) from e
    if len(data) > MAX_BLEND_BYTES:
        raise BlendError(too_big, path=source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BlendError(
            f"{source}: blend file is not UTF-8 text: byte {e.start} is 0x{data[e.start]:02x}",
            path=source,
        ) from e
    folder = os.path.dirname(os.path.abspath(source))
    return parse_blend_text(text, source=source, folder=folder, strict_weights=strict_weights)


def parse_blend_text(text: str, *, source: str, folder: str, strict_weights: bool = True) -> Blend:
    """Parse the content of a blend file, auto-detecting its form. Does no I/O.

    Args:
        text: The content of the blend file.
        source: The blend file's name, used in :attr:`Blend.source` and in error messages; a
            name ending in ``.yaml`` or ``.yml`` (any case) makes ``text`` YAML.
        folder: The folder relative prefixes resolve against (made absolute if it is not).
        strict_weights: As for :func:`load_blend`.

    Returns:
        The parsed blend.

    Raises:
        BlendError: The content is not a valid blend, or it is YAML and PyYAML is missing.
    """
    return _Parser(source, os.path.abspath(folder), strict_weights).parse(text)


def _as_weight(value: Any) -> float | None:
    """Return the weight a list item stands for (Megatron's ``float()``), or None if none.

    Numbers and numeric strings are weights; bools, which Python's ``float()`` takes, are not.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    if isinstance(value, float):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _parse_int(digits: str) -> int | float:
    # Python refuses to convert integers of more than 4300 digits; such a weight is infinite
    # anyway, and turning it into a float lets the weight check say so.
    return int(digits) if len(digits) <= 1000 else float(digits)


def _config_keys() -> str:
    return ", ".join(CONFIG_KEYS[:-1]) + " or " + CONFIG_KEYS[-1]


def _yaml_loader(parser: _Parser) -> type:
    """A PyYAML safe loader that refuses duplicate keys and reads timestamps as strings."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int, float, bool, type(None))):
                    continue  # unhashable or exotic: PyYAML says so itself
                if key in seen:
                    parser.fail(
                        f"YAML mapping has key {show_value(key)} twice (line "
                        f"{key_node.start_mark.line + 1}); give each key once"
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    def construct_yaml_seq(self: Any, node: Any) -> Any:
        # as SafeLoader's, noting the line of each item for the messages
        data: list[Any] = []
        parser.lines[id(data)] = (data, [item.start_mark.line + 1 for item in node.value])
        yield data
        data.extend(self.construct_sequence(node))

    Loader.add_constructor("tag:yaml.org,2002:seq", construct_yaml_seq)
    # a prefix such as 2024-01-01 stays the string it is, not a date
    Loader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str)
    return Loader


class _Parser:
    """Parse one blend file; holds what every error message needs."""

    def __init__(self, source: str, folder: str, strict_weights: bool = True) -> None:
        self.source = source
        self.folder = folder
        self.strict_weights = strict_weights
        # the config key the blend is read from (e.g. "dataset.blend"), named in messages
        self.key: str | None = None
        # whether the file is YAML or a config, where "${...}" is an interpolation
        self.templated = False
        # id of each list of a YAML file (or of a JSON file being read again to name the line
        # of an error): (the list, the line of each of its items)
        self.lines: dict[int, tuple[list[Any], list[int]]] = {}

    def fail(self, what: str) -> NoReturn:
        where = self.source if self.key is None else f"{self.source}: {self.key}"
        raise BlendError(f"{where}: {what}", path=self.source)

    # -- detection ------------------------------------------------------------------------

    def parse(self, text: str) -> Blend:
        if text.startswith("\ufeff"):
            self.fail(
                "blend file starts with a UTF-8 byte order mark, which Megatron does not "
                "accept; save it without one"
            )
        if self.source.lower().endswith(_YAML_SUFFIXES):
            self.templated = True
            return self._value(self._yaml(text), "YAML")
        looks_json = text.lstrip()[:1] in ("[", "{")
        try:
            data = json.loads(text, object_pairs_hook=self._object, parse_int=_parse_int)
        except json.JSONDecodeError as e:
            if looks_json:
                self.fail(f"malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}")
            return self._data_args(text)
        except RecursionError:
            self.fail("malformed JSON: lists or objects nested too deeply")
        try:
            return self._value(data, "JSON")
        except BlendError:
            # json's C parser tells no positions: read the file again, slowly, noting the line
            # of every list item, and fail again, now naming the line (only on this path)
            located = self._json_with_lines(text) if "\n" in text.strip() else None
            if located is None:  # (a line number says nothing in a file of one line)
                raise
            self.key, self.templated = None, False
            return self._value(located, "JSON")

    def _json_with_lines(self, text: str) -> Any:
        """``text`` parsed as :meth:`parse` does, with the line of each item of each list in
        :attr:`lines`; None if that fails (it parsed once already, so only on exhaustion)."""
        import bisect
        import json.decoder
        import json.scanner

        newlines = [i for i, char in enumerate(text) if char == "\n"]

        def parse_array(s_and_end: tuple[str, int], scan_once: Any) -> tuple[list[Any], int]:
            starts: list[int] = []

            def scan(string: str, end: int) -> Any:
                starts.append(end)  # where a direct item of this list begins
                return scan_once(string, end)

            values, end = json.decoder.JSONArray(s_and_end, scan)
            lines = [bisect.bisect_left(newlines, start) + 1 for start in starts[: len(values)]]
            self.lines[id(values)] = (values, lines)
            return values, end

        decoder = json.JSONDecoder(object_pairs_hook=self._object, parse_int=_parse_int)
        decoder.parse_array = parse_array  # type: ignore[attr-defined]
        decoder.scan_once = json.scanner.py_make_scanner(decoder)  # type: ignore[attr-defined]
        try:
            return decoder.decode(text)
        except (ValueError, RecursionError):
            return None

    def _value(self, data: Any, syntax: str) -> Blend:
        """Read the parsed content of a JSON or YAML blend file."""
        if isinstance(data, list):
            if data and isinstance(data[0], list):
                return self._blend("mcore-blend", {ALL: self._mcore(data, None)})
            return self._blend("data-path", {ALL: self._flat(data, None)})
        if isinstance(data, dict):
            # a config has sections (Megatron-Bridge's include "train" and "validation");
            # the values of a per-split blend are never objects
            if any(isinstance(data.get(key), dict) for key in _CONFIG_SECTIONS):
                return self._config(data)
            if "blend_per_split" in data:
                return self._mcore_per_split(data)
            if _NEMO_VALID in data:
                return self._nemo_paths(data)
            return self._per_split_data_args(data)
        self.fail(
            f"{syntax} content is {show_value(data)}; expected a list (--data-path or "
            "Megatron-Core blend) or an object (per-split blend or training config)"
        )

    def _yaml(self, text: str) -> Any:
        try:
            import yaml
        except ImportError:
            self.fail(
                "reading a YAML blend file needs PyYAML, which is not installed: "
                "pip install pyyaml (or 'megatron-repack[yaml]'), or write the blend as JSON"
            )
        # what yaml.safe_load does, with a SafeLoader subclass of ours: no Python objects
        loader = _yaml_loader(self)(text)
        try:
            return loader.get_single_data()
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            at = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
            what = e.problem or e.context or "unknown problem"
            if what.startswith("but ") and e.context:  # "but found another document"
                what = f"{e.context}, {what}"
            self.fail(f"malformed YAML{at}: {what}")
        except yaml.YAMLError as e:
            self.fail(f"malformed YAML: {str(e).splitlines()[0]}")
        except RecursionError:
            self.fail("malformed YAML: lists or mappings nested too deeply")
        finally:
            loader.dispose()

    def _object(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in pairs:
            if key in obj:
                self.fail(f"JSON object has key {show_value(key)} twice; give each key once")
            obj[key] = value
        return obj

    def _blend(self, form: str, splits: dict[str, tuple[BlendEntry, ...] | None]) -> Blend:
        if all(entries is None for entries in splits.values()):
            self.fail("blend is empty: every split is null; expected at least one prefix")
        return Blend(source=self.source, form=form, splits=splits)

    # -- the forms ------------------------------------------------------------------------

    def _data_args(self, text: str) -> Blend:
        items: list[str] = []
        lines: list[int] = []
        # str.splitlines breaks on a subset of what str.split (Megatron's tokenizer) treats as
        # whitespace, so the items are exactly Megatron's; we only add line numbers.
        for lineno, line in enumerate(text.splitlines(), 1):
            words = line.split()
            items.extend(words)
            lines.extend([lineno] * len(words))
        if not items:
            self.fail("blend is empty: the file holds no prefix")
        return self._blend("data-args", {ALL: self._flat(items, None, lines=lines, raw=True)})

    def _per_split_data_args(self, data: dict[str, Any]) -> Blend:
        for key in data:
            if key not in SPLITS:
                self.fail(
                    f"per-split blend has key {show_value(key)}; expected only "
                    '"train", "valid", "test" ("validation" for NeMo), or "blend_per_split" '
                    "alone, or a training config holding the blend under "
                    f"{_config_keys()}"
                )
        splits: dict[str, tuple[BlendEntry, ...] | None] = {}
        for name in SPLITS:
            value = data.get(name)
            if value is None:
                splits[name] = None
            elif isinstance(value, list):
                splits[name] = self._flat(value, name)
            elif isinstance(value, str):
                # Megatron splits a string value on whitespace, like the data-args text form.
                if not value.split():
                    self._empty(name, "an empty string")
                splits[name] = self._flat(value.split(), name, raw=True)
            else:
                self.fail(
                    f"split {name!r} is {show_value(value)}; expected a list, a string of "
                    "whitespace-separated items, or null"
                )
        return self._blend("per-split-data-args", splits)

    def _nemo_paths(self, data: dict[str, Any]) -> Blend:
        """NeMo's ``paths`` dict: ``{"train": ..., "validation": ..., "test": ...}``.

        NeMo's ``PreTrainingDataModule`` (``nemo/collections/llm/gpt/data/pre_training.py``)
        builds ``blend_per_split`` from ``get_blend_from_list(paths[key])`` for the keys
        ``train``, ``validation``, ``test``, in that order.
        """
        names = {"train": "train", _NEMO_VALID: "valid", "test": "test"}
        for key in data:
            if key not in names:
                self.fail(
                    f"NeMo paths dict has key {show_value(key)}; expected only "
                    '"train", "validation", "test" (Megatron names the validation split '
                    '"valid"; a blend uses one name or the other)'
                )
        splits: dict[str, tuple[BlendEntry, ...] | None] = {}
        for key, name in names.items():
            value = data.get(key)
            if value is None:
                splits[name] = None
            elif isinstance(value, list):
                splits[name] = self._flat(value, key)
            elif isinstance(value, str):
                self.fail(f"split {key!r} is {show_value(value)}, a string; {_NEMO_STRING}")
            else:
                self.fail(f"split {key!r} is {show_value(value)}; expected a list or null")
        return self._blend("nemo-paths", splits)

    def _config(self, data: dict[str, Any]) -> Blend:
        """A NeMo or Megatron-Bridge training config holding the blend under a known key."""
        found: dict[str, Any] = {}
        for key in CONFIG_KEYS:
            value: Any = data
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if value is not None:
                found[key] = value
        # Megatron-Core reads blend_per_split only if one of its splits is set
        per_split = found.get("dataset.blend_per_split")
        if isinstance(per_split, list) and all(item is None for item in per_split):
            del found["dataset.blend_per_split"]
        # Megatron-Bridge converts data_path to blend only when blend is None (and keeps
        # data_path: its run_config.yaml holds both)
        if "dataset.blend" in found:
            found.pop("dataset.data_path", None)
        if not found:
            self.fail(f"training config holds no blend: expected one of {_config_keys()}")
        if len(found) > 1:
            first, second = list(found)[:2]
            why = " (Megatron-Core refuses blend with blend_per_split)" * (first == CONFIG_KEYS[0])
            self.fail(f"training config holds a blend at both {first} and {second}; keep one{why}")
        ((key, value),) = found.items()
        self.key = key
        self.templated = True
        if key == "dataset.blend_per_split":
            return self._mcore_splits(value)
        if key == "dataset.blend":
            return self._blend("mcore-blend", {ALL: self._mcore(value, None)})
        if key == "dataset.data_path" and isinstance(value, str):
            # Megatron-Bridge's GPTDatasetConfig.finalize splits a string on whitespace
            if not value.split():
                self.fail("blend is empty: the string holds no prefix")
            return self._blend("data-path", {ALL: self._flat(value.split(), None, raw=True)})
        if key == "data.paths" and isinstance(value, str):
            # NeMo 2's PreTrainingDataModule makes a single path a list of one
            return self._blend("data-path", {ALL: self._flat([value], None)})
        if isinstance(value, dict) and key != "dataset.data_path":
            return self._nemo_paths(value)
        if isinstance(value, str):  # NeMo 1's data_prefix
            self.fail(f"value is {show_value(value)}, a string; {_NEMO_STRING}")
        if not isinstance(value, list):
            self.fail(
                f"value is {show_value(value)}; expected a list of prefixes or weight/prefix pairs"
            )
        return self._blend("data-path", {ALL: self._flat(value, None)})

    def _mcore_per_split(self, data: dict[str, Any]) -> Blend:
        if len(data) != 1:
            extra = next(key for key in data if key != "blend_per_split")
            self.fail(
                f"Megatron-Core per-split blend has key {show_value(extra)}; expected only "
                '"blend_per_split"'
            )
        return self._mcore_splits(data["blend_per_split"])

    def _mcore_splits(self, value: Any) -> Blend:
        if not isinstance(value, list) or len(value) != len(SPLITS):
            self.fail(
                f"blend_per_split is {show_value(value)}; expected a list of 3 blends "
                "(train, valid, test), each [prefixes, weights or null] or null"
            )
        splits = {
            name: None if item is None else self._mcore(item, name)
            for name, item in zip(SPLITS, value)
        }
        return self._blend("mcore-blend-per-split", splits)

    # -- lists ----------------------------------------------------------------------------

    def _empty(self, split: str | None, what: str = "an empty list") -> NoReturn:
        if split is None:
            self.fail("blend is empty: the list holds no prefix")
        self.fail(f"split {split!r} is {what}; write null for a split without data")

    def _flat(
        self,
        items: Sequence[Any],
        split: str | None,
        *,
        lines: Sequence[int] | None = None,
        raw: bool = False,
    ) -> tuple[BlendEntry, ...]:
        """Parse a Megatron ``--data-path`` list: weight/prefix pairs or bare prefixes."""
        where = "" if split is None else f" of split {split!r}"

        def name(kind: str, number: int, index: int) -> str:
            line = f" (line {lines[index]})" if lines else ""
            return f"{kind} {number}{line}"

        def label(kind: str, number: int, index: int) -> str:
            return name(kind, number, index) + where

        def show(value: Any) -> str:
            return show_value(value, raw)

        if lines is None:
            lines = self._item_lines(items)
        if not items:
            self._empty(split)
        rule = "a list is either all prefixes or weight/prefix pairs"
        weights = [_as_weight(item) for item in items]
        found: list[tuple[str, float | None, str]] = []
        if all(w is None for w in weights):
            for i, item in enumerate(items):
                prefix = self._prefix(item, label("prefix", i + 1, i), show, strip=True)
                found.append((prefix, None, name("prefix", i + 1, i)))
            return self._entries(found)
        odd = f"list{where} has {len(items)} items, an odd number, and " * (len(items) % 2)
        if odd and weights[0] is None:
            # bare prefixes, meant: the item that is wrong is the first weight among them
            first = next(i for i, w in enumerate(weights) if w is not None)
            self.fail(
                f"{odd}{label('item', first + 1, first)} is {show(items[first])}, a weight; {rule}"
            )
        # weight/prefix pairs, meant: the item that is wrong is the first one out of step
        unweighted = ", a prefix with no weight before it" if odd else " where a weight is expected"
        for i in range(0, len(items), 2):
            number = i // 2 + 1
            weight, item = weights[i], items[i]
            if weight is None:
                if isinstance(item, str):
                    self.fail(f"{odd}{label('item', i + 1, i)} is {show(item)}{unweighted}; {rule}")
                self._check_weight(None, item, label("weight", number, i), show)
            if i + 1 == len(items):
                self.fail(
                    f"{odd}{label('item', i + 1, i)} is {show(item)}, a weight with no prefix "
                    f"after it; {rule}"
                )
            prefix_item = items[i + 1]
            if weights[i + 1] is not None:
                self.fail(
                    f"{odd}{label('item', i + 2, i + 1)} is {show(prefix_item)}, a weight, where a "
                    f"prefix is expected; {rule}"
                )
            prefix = self._prefix(prefix_item, label("prefix", number, i + 1), show, strip=True)
            self._check_weight(weight, item, label("weight", number, i), show)
            found.append((prefix, weight, name("prefix", number, i + 1)))
        return self._entries(found)

    def _item_lines(self, items: Any) -> list[int] | None:
        """The line of each item of the list ``items``, where known (see :attr:`lines`)."""
        known = self.lines.get(id(items))
        return known[1] if known is not None and known[0] is items else None

    def _mcore(self, value: Any, split: str | None) -> tuple[BlendEntry, ...]:
        """Parse a Megatron-Core blend: ``[prefixes, weights or null]``."""
        where = "" if split is None else f" of split {split!r}"
        name = "Megatron-Core blend" if split is None else f"blend{where}"
        if not isinstance(value, list) or len(value) != 2:
            self.fail(f"{name} is {show_value(value)}; expected [prefixes, weights or null]")
        prefixes, weights = value
        if not isinstance(prefixes, list):
            self.fail(
                f"prefixes{where} are {show_value(prefixes)}; expected a list of prefix strings"
            )
        if not prefixes:
            self._empty(split)
        if weights is not None and not isinstance(weights, list):
            self.fail(
                f"weights{where} are {show_value(weights)}; expected a list of numbers or null"
            )
        if weights is not None and len(weights) != len(prefixes):
            self.fail(
                f"{counted(len(prefixes), 'prefix', 'prefixes')} but "
                f"{counted(len(weights), 'weight', 'weights')}{where}; "
                "Megatron-Core needs one weight per prefix"
            )
        found: list[tuple[str, float | None, str]] = []
        prefix_lines, weight_lines = self._item_lines(prefixes), self._item_lines(weights)

        def line(lines: list[int] | None, i: int) -> str:
            return f" (line {lines[i]})" if lines else ""

        for i, item in enumerate(prefixes):
            label = f"prefix {i + 1}{line(prefix_lines, i)}{where}"
            prefix = self._prefix(item, label, show_value, strip=False)
            weight = None
            if weights is not None:
                weight = _as_weight(weights[i])
                label = f"weight {i + 1}{line(weight_lines, i)}{where}"
                self._check_weight(weight, weights[i], label, show_value)
            found.append((prefix, weight, f"prefix {i + 1}"))
        return self._entries(found)

    # -- items ----------------------------------------------------------------------------

    def _prefix(self, item: Any, label: str, show: Any, *, strip: bool) -> str:
        if not isinstance(item, str) or not item.strip():
            extra = " (and a bool is not a weight)" if isinstance(item, bool) else ""
            self.fail(f"{label} is {show(item)}; prefixes must be non-empty strings{extra}")
        if self.templated and "${" in item:
            self.fail(
                f"{label} is {show(item)}, an OmegaConf interpolation, which repack does not "
                "resolve; write the prefix itself"
            )
        if strip:
            return item.strip()  # as Megatron's get_blend_from_list does
        if item != item.strip():
            self.fail(
                f"{label} is {show(item)}; Megatron-Core uses prefixes verbatim, so remove "
                "the surrounding whitespace"
            )
        return item

    def _check_weight(self, weight: float | None, item: Any, label: str, show: Any) -> None:
        if weight is not None and not self.strict_weights:
            return  # a number: kept as parsed, for the caller to judge
        if weight is None or not math.isfinite(weight) or weight <= 0:
            extra = " (a bool is not a number)" if isinstance(item, bool) else ""
            self.fail(f"{label} is {show(item)}; weights must be finite numbers > 0{extra}")

    def _entries(self, found: list[tuple[str, float | None, str]]) -> tuple[BlendEntry, ...]:
        """Resolve prefixes to paths. One path given twice is kept twice, each with its weight
        (stock Megatron builds one dataset per entry).

        Args:
            found: ``(prefix, weight, name)`` per dataset, ``name`` like ``"prefix 3"``.
        """
        entries: list[BlendEntry] = []
        for prefix, weight, _name in found:
            # a URL (s3://b/p, as Megatron main accepts) is kept as written, never joined to
            # the blend's folder
            url = re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", prefix)
            path = prefix if url else os.path.normpath(os.path.join(self.folder, prefix))
            entries.append(BlendEntry(prefix=prefix, weight=weight, path=path))
        return tuple(entries)
