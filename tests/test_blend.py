"""Tests of repack.inputs.blend_files: every blend form Megatron users have, and one bad input per
error."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from repack.errors import BlendError, InputError
from repack.format.blend import ALL, FORMS, SPLITS, Blend, BlendEntry
from repack.inputs.blend_files import CONFIG_KEYS, MAX_BLEND_BYTES, load_blend, parse_blend_text

FOLDER = "/data/blends"


def parse(text: str, source: str = "blend.json") -> Blend:
    return parse_blend_text(text, source=source, folder=FOLDER)


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def triples(entries: tuple[BlendEntry, ...] | None) -> list[tuple[str, float | None, str]] | None:
    if entries is None:
        return None
    return [(e.prefix, e.weight, e.path) for e in entries]


# -- the forms ------------------------------------------------------------------------------


def test_data_path_weighted_relative_absolute_nested(tmp_path: Path) -> None:
    blend_file = write(
        tmp_path / "conf" / "blends" / "blend.json",
        json.dumps([0.3, "../../data/web/part_0", 0.5, "/abs/books", "2", "sub/./code"]),
    )
    blend = load_blend(blend_file)
    assert blend.source == os.fspath(blend_file)
    assert blend.form == "data-path"
    assert not blend.per_split
    assert list(blend.splits) == [ALL]
    assert triples(blend.splits[ALL]) == [
        ("../../data/web/part_0", 0.3, str(tmp_path / "data" / "web" / "part_0")),
        ("/abs/books", 0.5, "/abs/books"),
        ("sub/./code", 2.0, str(tmp_path / "conf" / "blends" / "sub" / "code")),
    ]
    assert all(type(e.weight) is float for e in blend.splits[ALL])


def test_data_path_numeric_strings_and_stripping() -> None:
    blend = parse('["30", " a/b ", " 7e1 ", "c", "1_0", "~/d"]')
    assert triples(blend.splits[ALL]) == [
        ("a/b", 30.0, "/data/blends/a/b"),
        ("c", 70.0, "/data/blends/c"),
        ("~/d", 10.0, "/data/blends/~/d"),  # "~" is not expanded
    ]


def test_data_path_bare_prefixes() -> None:
    blend = parse('\n  ["a", "/x/../y/b"]\n')
    assert blend.form == "data-path"
    assert triples(blend.splits[ALL]) == [
        ("a", None, "/data/blends/a"),
        ("/x/../y/b", None, "/y/b"),
    ]


def test_weights_are_kept_as_parsed_not_normalized() -> None:
    blend = parse("[3, 'a', 0.1, 'b']".replace("'", '"'))
    assert [e.weight for e in blend.splits[ALL]] == [3.0, 0.1]


def test_data_args_text_form(tmp_path: Path) -> None:
    blend_file = write(
        tmp_path / "blend.txt",
        "0.3 data/a\n\n  0.7\t/abs/b \n 1e-3   \r\n ../c\n",
    )
    blend = load_blend(blend_file)
    assert blend.form == "data-args"
    assert triples(blend.splits[ALL]) == [
        ("data/a", 0.3, str(tmp_path / "data" / "a")),
        ("/abs/b", 0.7, "/abs/b"),
        ("../c", 0.001, str(tmp_path.parent / "c")),
    ]


def test_data_args_bare_prefixes_one_per_line() -> None:
    blend = parse("a\nb/c\n")
    assert blend.form == "data-args"
    assert [e.prefix for e in blend.splits[ALL]] == ["a", "b/c"]
    assert [e.weight for e in blend.splits[ALL]] == [None, None]


def test_data_args_single_prefix() -> None:
    assert triples(parse("only").splits[ALL]) == [("only", None, "/data/blends/only")]


def test_per_split_data_args(tmp_path: Path) -> None:
    content = {"train": [0.25, "t/a", "0.75", "/t/b"], "valid": ["v"], "test": None}
    blend = load_blend(write(tmp_path / "nested" / "split.json", json.dumps(content)))
    assert blend.form == "per-split-data-args"
    assert blend.per_split
    assert list(blend.splits) == list(SPLITS)
    assert triples(blend.splits["train"]) == [
        ("t/a", 0.25, str(tmp_path / "nested" / "t" / "a")),
        ("/t/b", 0.75, "/t/b"),
    ]
    assert triples(blend.splits["valid"]) == [("v", None, str(tmp_path / "nested" / "v"))]
    assert blend.splits["test"] is None


def test_per_split_missing_keys_are_null_and_strings_are_split() -> None:
    blend = parse('{"valid": "0.5 v1\\n 0.5  v2"}')
    assert blend.splits["train"] is None
    assert blend.splits["test"] is None
    assert triples(blend.splits["valid"]) == [
        ("v1", 0.5, "/data/blends/v1"),
        ("v2", 0.5, "/data/blends/v2"),
    ]


def test_mcore_blend() -> None:
    blend = parse('[["a", "/b"], [0.3, "0.7"]]')
    assert blend.form == "mcore-blend"
    assert not blend.per_split
    assert triples(blend.splits[ALL]) == [("a", 0.3, "/data/blends/a"), ("/b", 0.7, "/b")]


def test_mcore_blend_without_weights() -> None:
    blend = parse('[["a", "b"], null]')
    assert [e.weight for e in blend.splits[ALL]] == [None, None]


def test_mcore_blend_per_split(tmp_path: Path) -> None:
    content = {"blend_per_split": [[["t1", "t2"], [1, 3]], None, [["../x"], None]]}
    blend = load_blend(write(tmp_path / "d" / "bridge.json", json.dumps(content)))
    assert blend.form == "mcore-blend-per-split"
    assert blend.per_split
    assert triples(blend.splits["train"]) == [
        ("t1", 1.0, str(tmp_path / "d" / "t1")),
        ("t2", 3.0, str(tmp_path / "d" / "t2")),
    ]
    assert blend.splits["valid"] is None
    assert triples(blend.splits["test"]) == [("../x", None, str(tmp_path / "x"))]


def test_relative_blend_path_gives_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "sub" / "blend.json", '["a"]')
    monkeypatch.chdir(tmp_path)
    blend = load_blend("sub/blend.json")
    assert blend.source == "sub/blend.json"
    assert blend.splits[ALL][0].path == str(tmp_path / "sub" / "a")


def test_same_prefix_twice_with_same_weight_is_kept() -> None:
    blend = parse('[1, "a", 2, "b", 1, "./a"]')
    assert triples(blend.splits[ALL]) == [
        ("a", 1.0, "/data/blends/a"),
        ("b", 2.0, "/data/blends/b"),
        ("./a", 1.0, "/data/blends/a"),
    ]


@pytest.mark.parametrize(
    "text", ['{"train": [1, "a", 2, "b", 3, "./a"]}', '[["a", "x/../a"], [1, 2]]']
)
def test_same_prefix_twice_with_two_weights_is_kept_as_stock_builds_it(text: str) -> None:
    """Megatron builds one dataset per entry, each drawn by its own weight: so does a blend."""
    entries = next(e for e in parse(text).splits.values() if e)
    same = [(e.prefix, e.weight) for e in entries if e.path == "/data/blends/a"]
    assert same in ([("a", 1.0), ("./a", 3.0)], [("a", 1.0), ("x/../a", 2.0)])


def test_same_prefix_in_two_splits_with_different_weights_is_fine() -> None:
    blend = parse('{"train": [1, "a"], "valid": [2, "a"]}')
    assert blend.splits["train"][0].weight == 1.0
    assert blend.splits["valid"][0].weight == 2.0


# -- paths, to_json, from_json --------------------------------------------------------------


def test_paths_unique_in_first_appearance_order() -> None:
    blend = parse('{"test": ["z", "a"], "valid": ["y", "./x"], "train": [1, "x", 2, "b", 1, "x"]}')
    assert blend.paths() == ["/data/blends/" + p for p in ("x", "b", "y", "z", "a")]


@pytest.mark.parametrize(
    "text",
    [
        '[0.3, "a", 0.7, "/b"]',
        "1 a 2 b",
        '{"train": ["a"], "test": [5, "c"]}',
        '[["a", "b"], [1, 2]]',
        '{"blend_per_split": [null, [["v"], null], null]}',
        '{"train": ["a"], "validation": [2, "b"]}',
        '{"dataset": {"blend": [["a"], null]}}',
    ],
)
def test_json_round_trip(text: str) -> None:
    blend = parse(text)
    d = blend.to_json()
    assert json.loads(json.dumps(d)) == d
    assert Blend.from_json(json.loads(json.dumps(d))) == blend
    assert Blend.from_json(d) == blend


def test_to_json_layout() -> None:
    assert parse('{"train": [2, "a"]}').to_json() == {
        "source": "blend.json",
        "form": "per-split-data-args",
        "splits": {
            "train": [{"prefix": "a", "weight": 2.0, "path": "/data/blends/a"}],
            "valid": None,
            "test": None,
        },
    }


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ([], r"expected an object with keys source, form, splits"),
        ({"source": 3, "form": "data-path", "splits": {}}, r"<blend>: .* has source 3"),
        ({"source": "s", "form": "bogus", "splits": {}}, r"s: serialized blend has form"),
        ({"source": "s", "form": "data-path", "splits": {"train": None}}, r"keys all"),
        (
            {"source": "s", "form": "data-path", "splits": {"all": [{"prefix": "a"}]}},
            r"entry 1 of split 'all'",
        ),
    ],
)
def test_from_json_rejects_bad_dicts(d: object, match: str) -> None:
    with pytest.raises(BlendError, match=match):
        Blend.from_json(d)


# -- NeMo and Megatron-Bridge forms ---------------------------------------------------------


def test_forms_and_config_keys_are_named() -> None:
    assert "nemo-paths" in FORMS
    assert CONFIG_KEYS == (
        "dataset.blend_per_split",
        "dataset.blend",
        "dataset.data_path",
        "data.paths",
        "model.data.data_prefix",
    )


def test_nemo_paths_dict(tmp_path: Path) -> None:
    """NeMo 2's ``PreTrainingDataModule(paths={...})``: "validation" is Megatron's "valid"."""
    content = {
        "train": ["30", "web/a", "70", "/books/b"],
        "validation": ["web/v"],
        "test": [1, " t "],
    }
    blend = load_blend(write(tmp_path / "paths.json", json.dumps(content)))
    assert blend.form == "nemo-paths"
    assert blend.per_split
    assert list(blend.splits) == list(SPLITS)
    assert triples(blend.splits["train"]) == [
        ("web/a", 30.0, str(tmp_path / "web" / "a")),
        ("/books/b", 70.0, "/books/b"),
    ]
    assert triples(blend.splits["valid"]) == [("web/v", None, str(tmp_path / "web" / "v"))]
    assert triples(blend.splits["test"]) == [("t", 1.0, str(tmp_path / "t"))]


def test_nemo_paths_missing_and_null_splits() -> None:
    blend = parse('{"validation": ["v"], "test": null}')
    assert blend.form == "nemo-paths"
    assert blend.splits["train"] is None
    assert blend.splits["test"] is None
    assert [e.prefix for e in blend.splits["valid"]] == ["v"]


def test_bridge_config_blend_wins_over_data_path() -> None:
    """Megatron-Bridge's run_config.yaml holds data_path and the blend finalize() made of it,
    next to sections named like splits ("train", "validation")."""
    config = {
        "train": {"train_iters": 10},
        "validation": {"eval_iters": 2},
        "dataset": {
            "_target_": "megatron.bridge.training.config.GPTDatasetConfig",
            "blend": [["a", "b"], [0.3, 0.7]],
            "blend_per_split": None,
            "data_path": ["0.3", "a", "0.7", "b"],
            "split": "9999,8,2",
        },
    }
    blend = parse(json.dumps(config))
    assert blend.form == "mcore-blend"
    assert triples(blend.splits[ALL]) == [
        ("a", 0.3, "/data/blends/a"),
        ("b", 0.7, "/data/blends/b"),
    ]


def test_bridge_config_blend_per_split() -> None:
    blend = parse('{"dataset": {"blend": null, "blend_per_split": [[["a"], null], null, null]}}')
    assert blend.form == "mcore-blend-per-split"
    assert triples(blend.splits["train"]) == [("a", None, "/data/blends/a")]
    assert blend.splits["valid"] is None


def test_bridge_config_unset_blend_per_split_is_skipped() -> None:
    """Megatron-Core ignores a blend_per_split whose splits are all None."""
    blend = parse('{"dataset": {"blend": [["a"], null], "blend_per_split": [null, null, null]}}')
    assert blend.form == "mcore-blend"


def test_bridge_config_data_path_string_is_split_on_whitespace() -> None:
    blend = parse('{"dataset": {"data_path": " 0.3 a\\n0.7  b ", "blend": null}}')
    assert blend.form == "data-path"
    assert [(e.prefix, e.weight) for e in blend.splits[ALL]] == [("a", 0.3), ("b", 0.7)]


@pytest.mark.parametrize(
    ("paths", "form", "found"),
    [
        ('"/d/web"', "data-path", {ALL: [("/d/web", None)]}),  # one path, not split
        ('["30", "a", "70", "b"]', "data-path", {ALL: [("a", 30.0), ("b", 70.0)]}),
        (
            '{"train": ["a"], "validation": ["b"], "test": ["c"]}',
            "nemo-paths",
            {"train": [("a", None)], "valid": [("b", None)], "test": [("c", None)]},
        ),
    ],
)
def test_nemo2_config_data_paths(paths: str, form: str, found: dict) -> None:
    target = "nemo.collections.llm.gpt.data.pre_training.PreTrainingDataModule"
    blend = parse(f'{{"data": {{"_target_": "{target}", "paths": {paths}}}}}')
    assert blend.form == form
    got = {k: [(e.prefix, e.weight) for e in v] for k, v in blend.splits.items() if v}
    assert got == found


def test_nemo1_config_data_prefix() -> None:
    blend = parse('{"model": {"data": {"data_prefix": [0.5, "a", 0.5, "b"]}}}')
    assert blend.form == "data-path"
    assert [e.prefix for e in blend.splits[ALL]] == ["a", "b"]
    blend = parse(
        '{"model": {"data": {"data_prefix": {"train": [1.0, "a"], "validation": ["b"]}}}}'
    )
    assert blend.form == "nemo-paths"
    assert [e.prefix for e in blend.splits["valid"]] == ["b"]


YAML_BRIDGE = """\
dataset:
  _target_: megatron.bridge.training.config.GPTDatasetConfig
  blend:
  - - /lustre/tok/web-00000
    - data/books/pg19-0000
  - - 0.3
    - 0.7
  data_path: null
  split: 9999,8,2
train:
  train_iters: 100
validation:
  eval_iters: 32
"""

YAML_NEMO1 = """\
model:
  data:
    data_prefix:
      train: [.5, data/web/cc-00000, "0.5", 2024-01-01]
      validation: [data/web/cc-00001]
      test: [data/web/cc-00002]
    splits_string: 900,50,50
"""


def test_yaml_bridge_run_config() -> None:
    blend = parse(YAML_BRIDGE, "run_config.yaml")
    assert blend.form == "mcore-blend"
    assert triples(blend.splits[ALL]) == [
        ("/lustre/tok/web-00000", 0.3, "/lustre/tok/web-00000"),
        ("data/books/pg19-0000", 0.7, "/data/blends/data/books/pg19-0000"),
    ]


def test_yaml_nemo1_config_dates_stay_strings() -> None:
    blend = parse(YAML_NEMO1, "megatron_gpt_config.YML")
    assert blend.form == "nemo-paths"
    assert [(e.prefix, e.weight) for e in blend.splits["train"]] == [
        ("data/web/cc-00000", 0.5),
        ("2024-01-01", 0.5),
    ]
    assert [e.prefix for e in blend.splits["valid"]] == ["data/web/cc-00001"]


@pytest.mark.parametrize(
    ("text", "form"),
    [
        ("- 0.3\n- a\n- '0.7'\n- b\n", "data-path"),
        ("[[a, b], null]", "mcore-blend"),
        ("train: [a]\nvalid: 1 b\n", "per-split-data-args"),
        ("train: [a]\nvalidation: [b]\n", "nemo-paths"),
        ("blend_per_split: [[[a], [1]], null, null]", "mcore-blend-per-split"),
    ],
)
def test_yaml_holds_every_json_form(text: str, form: str) -> None:
    blend = parse(text, "blend.yaml")
    assert blend.form == form
    as_json = parse(json.dumps(parse_yaml(text)))
    assert (blend.form, blend.splits) == (as_json.form, as_json.splits)


def parse_yaml(text: str) -> object:
    import yaml

    return yaml.safe_load(text)


def test_yaml_without_pyyaml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now raises ImportError
    with pytest.raises(
        BlendError, match=r"^b\.yaml: reading a YAML blend file needs PyYAML, which is not"
    ):
        parse("[a]", "b.yaml")
    assert parse('["a"]', "b.json").form == "data-path"  # JSON needs no PyYAML


@pytest.mark.parametrize(
    ("source", "text", "match"),
    [
        # NeMo paths dict
        (
            "b.json",
            '{"train": ["a"], "validation": "v"}',
            r"^b\.json: split 'validation' is \"v\", a string; NeMo hands it to Megatron's "
            r"get_blend_from_list, which reads a string letter by letter: write a list$",
        ),
        ("b.json", '{"validation": 3}', r"split 'validation' is 3; expected a list or null$"),
        (
            "b.json",
            '{"train": ["a"], "valid": ["b"], "validation": ["b"]}',
            r'NeMo paths dict has key "valid"; expected only "train", "validation", "test"',
        ),
        ("b.json", '{"validation": ["b"], "tset": null}', r'NeMo paths dict has key "tset"'),
        ("b.json", '{"train": ["a"], "validation": []}', r"split 'validation' is an empty list"),
        ("b.json", '{"validation": null}', r"blend is empty: every split is null"),
        ("b.json", '{"validation": [1, "a", 2]}', r"list of split 'validation' has 3 items"),
        # training configs
        (
            "b.json",
            '{"dataset": {"split": "1,1,1", "blend": null}}',
            r"^b\.json: training config holds no blend: expected one of "
            r"dataset\.blend_per_split, dataset\.blend, dataset\.data_path, data\.paths or "
            r"model\.data\.data_prefix$",
        ),
        ("b.json", '{"model": {"data": 3}}', r"training config holds no blend"),
        (
            "b.json",
            '{"dataset": {"blend": [["a"], null], "blend_per_split": [null, [["b"], null], null]}}',
            r"holds a blend at both dataset\.blend_per_split and dataset\.blend; keep one "
            r"\(Megatron-Core refuses blend with blend_per_split\)$",
        ),
        (
            "b.json",
            '{"dataset": {"data_path": ["a"]}, "data": {"paths": ["a"]}}',
            r"holds a blend at both dataset\.data_path and data\.paths; keep one$",
        ),
        (
            "b.json",
            '{"dataset": {"blend": [["a"], [-1]]}}',
            r"^b\.json: dataset\.blend: weight 1 is -1; weights must be finite numbers > 0$",
        ),
        (
            "b.json",
            '{"dataset": {"blend_per_split": [[["a"], null], null]}}',
            r"^b\.json: dataset\.blend_per_split: blend_per_split is a list of 2 items",
        ),
        ("b.json", '{"dataset": {"data_path": " "}}', r"dataset\.data_path: blend is empty"),
        (
            "b.json",
            '{"dataset": {"data_path": {"train": ["a"]}}}',
            r"^b\.json: dataset\.data_path: value is an object; expected a list of prefixes",
        ),
        (
            "b.json",
            '{"model": {"data": {"data_prefix": "???"}}}',
            r'^b\.json: model\.data\.data_prefix: value is "\?\?\?", a string; NeMo hands it',
        ),
        (
            "b.json",
            '{"data": {"paths": {"train": ["a"], "valid": ["b"]}}}',
            r'^b\.json: data\.paths: NeMo paths dict has key "valid"',
        ),
        (
            "b.json",
            '{"dataset": {"blend": [["${oc.env:DATA}/a"], null]}}',
            r'prefix 1 is "\$\{oc\.env:DATA\}/a", an OmegaConf interpolation, which repack',
        ),
        ("b.json", '{"data": {"paths": 3}}', r"data\.paths: value is 3; expected a list"),
        # YAML
        ("b.yaml", "", r"^b\.yaml: YAML content is null; expected a list"),
        ("b.yml", "just text", r'YAML content is "just text"; expected a list'),
        ("b.yaml", "[a, b", r"^b\.yaml: malformed YAML at line 1, column 6: expected ',' or ']'"),
        (
            "b.yaml",
            "- a\n- b\n---\n- c\n",
            r"at line 3, column 1: expected a single document in the stream, but found another",
        ),
        (
            "b.yaml",
            "train: [a]\nvalid: [b]\ntrain: [c]\n",
            r'^b\.yaml: YAML mapping has key "train" twice \(line 3\); give each key once$',
        ),
        ("b.yaml", "- yes\n- a\n", r"prefix 1 \(line 1\) is true; prefixes must be non-empty"),
        ("b.yaml", "- 0.3\n- a\n- b\n", r'item 3 \(line 3\) is "b", a prefix with no weight'),
        ("b.yaml", "[.inf, a]", r"weight 1 \(line 1\) is Infinity; weights must be finite"),
        ("b.yaml", "[!!binary aGk=, a]", r"prefix 1 \(line 1\) is \"b'hi'\"; prefixes must be"),
        ("b.yaml", "- ${DATA}/web\n", r'prefix 1 \(line 1\) is "\$\{DATA\}/web", an OmegaConf'),
        ("b.yaml", "[" * 100_000, r"malformed YAML: lists or mappings nested too deeply"),
    ],
)
def test_bad_ecosystem_content(source: str, text: str, match: str) -> None:
    with pytest.raises(BlendError, match=match) as info:
        parse(text, source)
    message = str(info.value)
    assert message.startswith(f"{source}: ")
    assert "\n" not in message


# -- errors: reading the file ---------------------------------------------------------------


def test_error_is_an_input_error(tmp_path: Path) -> None:
    assert issubclass(BlendError, InputError)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(BlendError, match=r"nope\.json: cannot read blend file: No such file"):
        load_blend(tmp_path / "nope.json")


def test_permission_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blend_file = write(tmp_path / "secret.json", '["a"]')
    blend_file.chmod(0)
    if os.access(blend_file, os.R_OK):  # running as root: make open() refuse instead
        real_open = open

        def refusing_open(file, *args, **kwargs):
            if os.fspath(file) == os.fspath(blend_file):
                raise PermissionError(13, "Permission denied", os.fspath(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr("builtins.open", refusing_open)
    with pytest.raises(
        BlendError, match=r"secret\.json: cannot read blend file: Permission denied"
    ):
        load_blend(blend_file)


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(BlendError, match=r"cannot read blend file: it is a directory"):
        load_blend(tmp_path)


def test_not_utf8(tmp_path: Path) -> None:
    blend_file = write(tmp_path / "latin1.txt", "1 caf\xe9".encode("latin-1"))
    with pytest.raises(
        BlendError, match=r"latin1\.txt: blend file is not UTF-8 text: byte 5 is 0xe9"
    ):
        load_blend(blend_file)


def test_too_large_refused_before_reading(tmp_path: Path) -> None:
    blend_file = tmp_path / "huge.txt"
    with open(blend_file, "wb") as f:
        f.truncate(MAX_BLEND_BYTES + 1)  # sparse: costs no disk and no time
    with pytest.raises(
        BlendError, match=rf"huge\.txt: blend file is {MAX_BLEND_BYTES + 1} bytes, larger than"
    ):
        load_blend(blend_file)


def test_byte_order_mark(tmp_path: Path) -> None:
    blend_file = write(tmp_path / "bom.json", b'\xef\xbb\xbf["a"]')
    with pytest.raises(BlendError, match=r"bom\.json: blend file starts with a UTF-8 byte order"):
        load_blend(blend_file)


# -- errors: content ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "match"),
    [
        # malformed JSON, with line and column
        ('[\n  0.3, "a",\n  0.7 "b"\n]', r"malformed JSON at line 3, column 7: Expecting ','"),
        ('  {"train": }', r"malformed JSON at line 1, column 13: Expecting value"),
        ('["a"] trailing', r"malformed JSON at line 1, column 7: Extra data"),
        ("[" * 100_000, r"malformed JSON: lists or objects nested too deeply"),
        # JSON of an unexpected type
        ("3", r"JSON content is 3; expected a list .* or an object"),
        ('"a/b"', r'JSON content is "a/b"; expected a list'),
        ("null", r"JSON content is null; expected"),
        # empty blends and empty lists
        ("[]", r"blend is empty: the list holds no prefix"),
        (" \n\t\n", r"blend is empty: the file holds no prefix"),
        ("{}", r"blend is empty: every split is null"),
        ('{"train": null, "valid": null, "test": null}', r"blend is empty: every split is null"),
        ('{"blend_per_split": [null, null, null]}', r"blend is empty: every split is null"),
        ("[[], null]", r"blend is empty: the list holds no prefix"),
        ('{"train": ["a"], "valid": []}', r"split 'valid' is an empty list; write null"),
        ('{"train": ["a"], "test": "  "}', r"split 'test' is an empty string; write null"),
        ('{"blend_per_split": [[["a"], null], [[], null], null]}', r"split 'valid' is an empty"),
        # weights
        (
            '{"train": [1, "a", 2, "b", -0.5, "c"]}',
            r"^blend\.json: weight 3 of split 'train' is -0\.5; "
            r"weights must be finite numbers > 0$",
        ),
        ('[0, "a"]', r"weight 1 is 0; weights must be finite numbers > 0"),
        ('["-0.0", "a"]', r'weight 1 is "-0\.0"; weights must be'),
        ('[NaN, "a"]', r"weight 1 is NaN; weights must be finite"),
        ('["nan", "a"]', r'weight 1 is "nan"; weights must be finite'),
        ('[1e400, "a"]', r"weight 1 is Infinity; weights must be finite"),
        ('["inf", "a", 1, "b"]', r'weight 1 is "inf"; weights must be finite'),
        ("[1" + "0" * 5000 + ', "a"]', r"weight 1 is Infinity; weights must be finite"),
        ('[1, "a", true, "b"]', r"weight 2 is true; weights must be .*a bool is not a number"),
        ('[1, "a", null, "b"]', r"weight 2 is null; weights must be finite numbers > 0"),
        ('[true, "a"]', r"prefix 1 is true; prefixes must be non-empty strings.*bool"),
        ('[["a"], [false]]', r"weight 1 is false; .*a bool is not a number"),
        ('[["a", "b"], [1, "x"]]', r'weight 2 is "x"; weights must be finite numbers > 0'),
        ("0.5 a\n-1 b\n", r"^blend\.json: weight 2 \(line 2\) is -1; weights must be finite"),
        # prefixes
        ('[1, ""]', r'prefix 1 is ""; prefixes must be non-empty strings'),
        ('["a", "  "]', r'prefix 2 is "  "; prefixes must be non-empty strings'),
        ('["a", ["b"]]', r"prefix 2 is a list of 1 item; prefixes must be non-empty strings"),
        ('["a", {"b": 1}]', r"prefix 2 is an object; prefixes must be non-empty strings"),
        ('[["a", 3], null]', r"prefix 2 is 3; prefixes must be non-empty strings"),
        ('[["a", " b"], null]', r'prefix 2 is " b"; Megatron-Core uses prefixes verbatim'),
        # neither all prefixes nor weight/prefix pairs
        (
            '[0.3, "a", "b"]',
            r'list has 3 items, an odd number, and item 3 is "b", a prefix with no ',
        ),
        ('[0.3, "a", 0.7]', r"odd number, and item 3 is 0\.7, a weight with no prefix after it"),
        ('[0.3, "a", 0.7, 0.2, "b"]', r"odd number, and item 4 is 0\.2, a weight, where a prefix"),
        ('[0.3, "a", "b", 0.2, "c"]', r'5 items, an odd number, and item 3 is "b", a prefix with'),
        ('["a", "b", "0.3"]', r'list has 3 items, an odd number, and item 3 is "0\.3", a weight'),
        ('["0.3", "a", "b", "c"]', r'item 3 is "b" where a weight is expected; a list is either'),
        ('["a", "0.3", "b", "c"]', r'item 1 is "a" where a weight is expected'),
        ('[0.3, "a", 0.7, 0.2]', r"item 4 is 0\.2, a weight, where a prefix is expected"),
        ('[0.3, "a", 0.7, "5"]', r'item 4 is "5", a weight, where a prefix is expected'),
        ("0.3 a\n0.7\n", r"odd number, and item 3 \(line 2\) is 0\.7, a weight with no prefix"),
        ('{"test": "1 a b c"}', r"item 3 of split 'test' is b where a weight is expected"),
        # Megatron-Core form structure
        ('[["a", "b"], [1]]', r"2 prefixes but 1 weight; Megatron-Core needs one weight per"),
        ('[["a"], [1, 2]]', r"1 prefix but 2 weights"),
        ('[["a"]]', r"Megatron-Core blend is a list of 1 item; expected \[prefixes, weights or"),
        ('[["a"], null, null]', r"Megatron-Core blend is a list of 3 items"),
        ('[["a"], 0.5]', r"weights are 0\.5; expected a list of numbers or null"),
        ('{"blend_per_split": [null, "a", null]}', r"blend of split 'valid' is \"a\"; expected"),
        ('{"blend_per_split": [[3, null], null, null]}', r"prefixes of split 'train' are 3"),
        ('{"blend_per_split": [null, null]}', r"blend_per_split is a list of 2 items; expected"),
        ('{"blend_per_split": [[["a"], [1, 2]], null, null]}', r"weights of split 'train'"),
        # object keys
        ('{"train": ["a"], "vaild": ["b"]}', r'per-split blend has key "vaild"; expected only'),
        ('{"blend_per_split": [null, null, null], "train": ["a"]}', r'has key "train"; expected'),
        ('{"train": ["a"], "train": ["b"]}', r'JSON object has key "train" twice'),
        ('{"train": 3}', r"split 'train' is 3; expected a list, a string .* or null"),
    ],
)
def test_bad_content(text: str, match: str) -> None:
    with pytest.raises(BlendError, match=match) as info:
        parse(text)
    message = str(info.value)
    assert message.startswith("blend.json: ")
    assert "\n" not in message


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            '[\n  0.3, "a",\n  0.5, "b",\n  "c"\n]\n',
            r'item 5 \(line 4\) is "c", a prefix with no weight before it',
        ),
        ('{"train": [1, "a",\n 2, "b", 3]}', r"item 5 \(line 2\) of split 'train' is 3, a weight"),
        ('[["a",\n  "b",\n  " c"],\n [1, 2, 3]]', r'prefix 3 \(line 3\) is " c"; Megatron-Core'),
        ('[["a", "b"],\n [1,\n  -2]]', r"weight 2 \(line 3\) is -2; weights must be finite"),
        ('[0.3, "a", "b"]', r'and item 3 is "b", a prefix'),  # one line: no line number
    ],
)
def test_json_errors_name_the_line_of_the_item(text: str, match: str) -> None:
    with pytest.raises(BlendError, match=match):
        parse(text)


def test_long_values_are_shortened_in_messages() -> None:
    with pytest.raises(BlendError) as info:
        parse(json.dumps([1, "a", -1, "b" * 1000]))
    assert len(str(info.value)) < 200
    with pytest.raises(BlendError) as info:
        parse(json.dumps(["x" * 1000, 0.5]))
    assert re.search(r'item 1 is "x+\.\.\. where a weight', str(info.value))


# -- the README's examples ------------------------------------------------------------------


def test_readme_blend_examples_parse_and_cover_every_form() -> None:
    """Every example of the README's "Blend files" section is a valid blend, and every form
    has an example."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Blend files\n") : readme.index("## Commands\n")]
    blocks = re.findall(r"^```(\w+)\n(.*?)^```$", section, re.M | re.S)
    suffix = {"json": "json", "yaml": "yaml", "text": "txt"}
    assert [lang for lang, _ in blocks if lang not in suffix] == []
    forms = [parse(body, f"blend.{suffix[lang]}").form for lang, body in blocks]
    assert set(forms) == set(FORMS)
    assert len(blocks) >= len(FORMS) + 1  # and the config example
