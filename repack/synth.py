"""Synthetic Megatron data: a standalone ``.bin``/``.idx`` writer and a demo blend generator.

This module writes Megatron-Core ``IndexedDataset`` prefixes (index format ``MMIDIDX``
version 1) without importing Megatron or torch, so the demo runs on machines that have
neither. It is deliberately independent of the rest of repack: the tests prove its output
byte-identical to Megatron-Core's own ``IndexedDatasetBuilder``, which makes it a second,
trusted implementation of the format to test repack's reader and merger against.

Layout written by :func:`write_prefix` (all integers little-endian)::

    prefix.bin  the tokens of every sequence, back to back, in the token dtype
    prefix.idx  b"MMIDIDX\\x00\\x00"          9 bytes, magic
                version                      uint64, always 1
                dtype code                   uint8, see MEGATRON_DTYPE_CODES
                sequence count S             uint64
                document index count D       uint64 (number of documents + 1)
                sequence lengths             S x int32 (tokens, not bytes)
                sequence pointers            S x int64 (byte offsets into prefix.bin)
                document indices             D x int64 (cumulative, starts at 0, ends at S)
                sequence modes               S x int8, multimodal datasets only

Command line: ``python -m repack.synth OUT_DIR [--sources N] [--seed S]`` writes a demo blend
into an empty ``OUT_DIR`` and prints the path of its flat JSON blend.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

__all__ = [
    "MEGATRON_DTYPE_CODES",
    "DemoBlend",
    "main",
    "make_blend",
    "write_prefix",
]

#: Megatron-Core's ``DType`` table: numpy dtype name -> code stored in the ``.idx`` header.
MEGATRON_DTYPE_CODES: dict[str, int] = {
    "uint8": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "float64": 6,
    "float32": 7,
    "uint16": 8,
}

_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
# magic, version, dtype code, sequence count, document index count; no padding.
_INDEX_HEADER = struct.Struct("<9sQBQQ")
_INT32_MAX = np.iinfo(np.int32).max

# Where the demo blend puts its sources: (folder under root, file name pattern). Some names
# carry dots, as real Megatron prefixes often do, to catch code that treats them as suffixes.
_TEXT_LAYOUT: tuple[tuple[str, str, float], ...] = (
    ("data/web", "cc-{:05d}", 0.40),
    ("data/code/py", "github-py-{:04d}_text_document", 0.12),
    ("data/code/cpp", "stack-cpp-{:04d}_text_document", 0.08),
    ("data/books", "pg19-{:04d}", 0.10),
    ("data/wiki/en", "enwiki-20231101.part-{:03d}", 0.12),
    ("data/wiki/de", "dewiki-20231101.part-{:03d}", 0.06),
    ("data/math", "proofs_{:03d}_text_document", 0.12),
)
_MULTIMODAL_LAYOUT = ("data/mm/interleaved", "obelics-{:04d}")
# Vocabulary sizes of common tokenizers; int32 ones exceed uint16 on purpose.
_VOCABS_UINT16 = (32000, 50257, 65024)
_VOCABS_WIDE = (100277, 128256, 151936, 256000)
# Edge-case sources, given to the first sources of a demo blend (see make_blend).
_EDGE_CASES = ("single-sequence", "empty-sequence-inside", "empty-sequence-last", "empty-document")

FLAT_JSON_NAME = "blend.json"
PER_SPLIT_JSON_NAME = "blend_per_split.json"
DATA_ARGS_TXT_NAME = "data_args.txt"


def _dtype_code(dtype: npt.DTypeLike) -> tuple[np.dtype, int]:
    """Return the little-endian numpy dtype and Megatron code for ``dtype``."""
    np_dtype = np.dtype(dtype)
    code = MEGATRON_DTYPE_CODES.get(np_dtype.name)
    if code is None:
        raise ValueError(
            f"dtype {np_dtype} has no Megatron code; expected one of "
            f"{', '.join(MEGATRON_DTYPE_CODES)}"
        )
    return np_dtype.newbyteorder("<"), code


def _cast_exact(values: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """Cast ``values`` to ``dtype``, refusing any value the cast would change.

    Megatron casts silently (a token id of 70000 wraps to 4464 in uint16); synthetic data
    that wraps is a bug in the caller, so it is refused here.
    """
    cast = values.astype(dtype, copy=False)
    if values.size and not np.array_equal(cast, values):
        changed = int(np.flatnonzero(cast != values)[0])
        raise ValueError(
            f"{what} value {values[changed]!r} at position {changed} does not fit "
            f"dtype {dtype.name}"
        )
    return cast


def _atomic_write(path: Path, chunks: Sequence[bytes | np.ndarray]) -> None:
    """Write ``chunks`` to a sibling temp file, then rename it over ``path``.

    No fsync: this is throwaway synthetic data and 300 fsyncs would dominate the run time.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as stream:
            for chunk in chunks:
                stream.write(chunk.data if isinstance(chunk, np.ndarray) else chunk)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_prefix(
    prefix: str | os.PathLike[str],
    sequences: Sequence[npt.ArrayLike],
    *,
    dtype: npt.DTypeLike = np.uint16,
    document_indices: npt.ArrayLike | None = None,
    modes: npt.ArrayLike | None = None,
) -> None:
    """Write ``prefix.bin`` and ``prefix.idx`` exactly as Megatron-Core would.

    The bytes equal those of ``IndexedDatasetBuilder(prefix + ".bin", dtype, multimodal)``
    fed the same sequences (``add_item``/``end_document`` or ``add_document``) and then
    ``finalize(prefix + ".idx")``. ``.bin`` is written first and ``.idx`` last, each
    atomically; missing parent folders are created.

    Args:
        prefix: Path prefix; ``".bin"`` and ``".idx"`` are appended (never substituted for
            a suffix, so prefixes may contain dots).
        sequences: One 1-D integer (or float) array per sequence. Empty sequences are legal.
        dtype: Token dtype, one of the Megatron dtypes (see ``MEGATRON_DTYPE_CODES``).
        document_indices: Megatron's cumulative document boundaries: starts at 0, ends at
            ``len(sequences)``, never decreases (a repeated value is an empty document).
            Defaults to one sequence per document.
        modes: One int8 mode per sequence. When given, the dataset is multimodal and the
            modes are written after the document indices.

    Raises:
        ValueError: If an argument is malformed or a value does not fit its dtype.
    """
    token_dtype, code = _dtype_code(dtype)
    arrays = [np.asarray(sequence) for sequence in sequences]
    if any(array.ndim != 1 for array in arrays):
        raise ValueError("every sequence must be a 1-D array")
    count = len(arrays)

    lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=count)
    if count and lengths.max() > _INT32_MAX:
        raise ValueError(f"a sequence has {lengths.max()} tokens, more than {_INT32_MAX}")
    tokens = np.concatenate(arrays) if count else np.empty(0, dtype=token_dtype)
    tokens = _cast_exact(tokens, token_dtype, "token")

    pointers = np.zeros(count, dtype="<i8")
    np.cumsum(lengths[:-1] * token_dtype.itemsize, out=pointers[1:])

    if document_indices is None:
        documents = np.arange(count + 1, dtype="<i8")
    else:
        documents = np.asarray(document_indices)
        if documents.ndim != 1 or documents.size == 0 or documents.dtype.kind not in "iu":
            raise ValueError("document_indices must be a non-empty 1-D integer array")
        if documents[0] != 0 or documents[-1] != count or np.any(np.diff(documents) < 0):
            raise ValueError(
                f"document_indices must start at 0, end at the sequence count {count} and "
                f"never decrease; got {documents[:3].tolist()}...{documents[-3:].tolist()}"
            )
        documents = documents.astype("<i8")

    chunks: list[bytes | np.ndarray] = [
        _INDEX_HEADER.pack(_INDEX_MAGIC, _INDEX_VERSION, code, count, documents.size),
        lengths.astype("<i4"),
        pointers,
        documents,
    ]
    if modes is not None:
        mode_array = np.asarray(modes)
        if mode_array.shape != (count,):
            raise ValueError(f"modes has shape {mode_array.shape}, expected ({count},)")
        chunks.append(_cast_exact(mode_array, np.dtype(np.int8), "mode"))

    base = os.fspath(prefix)
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(Path(base + ".bin"), [np.ascontiguousarray(tokens)])
    _atomic_write(Path(base + ".idx"), chunks)


@dataclass(frozen=True)
class DemoBlend:
    """What :func:`make_blend` wrote.

    Attributes:
        root: Absolute folder holding everything.
        prefixes: Absolute prefix of every source, in generation order.
        weights: Sampling weight of each source, aligned with ``prefixes``.
        multimodal: Prefixes of the multimodal sources (read with ``multimodal=True``).
        flat_json: ``[w1, "rel/prefix", w2, "/abs/prefix", ...]`` over every source; relative
            prefixes are relative to ``root`` (the folder of the file).
        per_split_json: ``{"train": [...], "valid": [...], "test": [...]}`` with absolute
            prefixes; some prefixes appear in several splits, a few only in ``test``.
        data_args_txt: ``w1 p1 w2 p2 ...`` text (one pair per line) with absolute prefixes,
            for Megatron's ``--data-args-path``.
    """

    root: Path
    prefixes: tuple[str, ...]
    weights: tuple[float, ...]
    multimodal: tuple[str, ...]
    flat_json: Path
    per_split_json: Path
    data_args_txt: Path


def _split_lengths(rng: np.random.Generator, total: int, count: int) -> np.ndarray:
    """Split ``total`` tokens into ``count`` sequences of at least one token each."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=count - 1, replace=False))
    return np.diff(np.concatenate(([0], cuts, [total])))


def _vocab_size(rng: np.random.Generator, dtype: np.dtype) -> int:
    """Pick a plausible vocabulary size whose ids fit ``dtype``."""
    if dtype == np.uint16:
        return int(rng.choice(_VOCABS_UINT16))
    if dtype in (np.int32, np.int64):
        return int(rng.choice(_VOCABS_WIDE))
    if dtype.kind in "iu":
        return min(int(np.iinfo(dtype).max) + 1, 32000)
    return 32000


def _make_source(
    rng: np.random.Generator,
    prefix: str,
    total: int,
    dtype: np.dtype,
    multimodal: bool,
    edge_case: str | None,
) -> None:
    """Generate and write one source of ``total`` tokens."""
    vocab = _vocab_size(rng, dtype)
    tokens = rng.integers(0, vocab, size=total).astype(dtype)
    if vocab > 65536:
        tokens[0] = vocab - 1  # make sure wide sources really need more than uint16

    if edge_case == "single-sequence":
        lengths = np.array([total])
    else:
        mean_length = int(rng.integers(32, 400))
        lengths = _split_lengths(rng, total, max(1, min(total, round(total / mean_length))))
    if edge_case == "empty-sequence-inside":
        lengths = np.insert(lengths, len(lengths) // 2, 0)
    elif edge_case == "empty-sequence-last":
        lengths = np.append(lengths, 0)
    count = len(lengths)

    if edge_case == "single-sequence":
        documents = np.array([0, 1])
    elif rng.random() < 0.5:
        documents = np.arange(count + 1)
    else:  # documents of 1 to 4 sequences
        ends = np.cumsum(rng.integers(1, 5, size=count))
        documents = np.concatenate(([0], ends[ends < count], [count]))
    if edge_case == "empty-document":
        documents = np.insert(documents, len(documents) // 2, documents[len(documents) // 2])

    modes = rng.integers(0, 2, size=count, dtype=np.int8) if multimodal else None
    sequences = np.split(tokens, np.cumsum(lengths)[:-1])
    write_prefix(prefix, sequences, dtype=dtype, document_indices=documents, modes=modes)


def _write_json(path: Path, value: object) -> None:
    text = json.dumps(value, indent=1, sort_keys=True) + "\n"
    _atomic_write(path, [text.encode()])


def make_blend(
    root: str | os.PathLike[str],
    n_sources: int = 300,
    *,
    seed: int = 0,
    tokens_per_source: tuple[int, int] = (200, 4000),
    dtypes: Sequence[npt.DTypeLike] = (np.uint16, np.int32),
    multimodal_fraction: float = 0.02,
    edge_cases: bool = True,
) -> DemoBlend:
    """Generate a realistic synthetic Megatron blend under ``root``.

    Sources land in nested folders (``root/data/web/cc-00017``,
    ``root/data/code/py/github-py-0003_text_document``, ...); some names contain dots. Each
    source picks its token dtype from ``dtypes`` (int32/int64 sources use vocabularies
    beyond 65535 and hold at least one such id), splits its tokens into sequences and
    groups them one or one-to-four per document. ``ceil(multimodal_fraction * n_sources)``
    sources are multimodal (modes 0/1, under ``root/data/mm``). With ``edge_cases``, the
    first sources are, in order: a single-sequence source, one with an empty sequence in
    the middle, one whose last sequence is empty, and one with an empty document (a
    repeated document index). Every source holds at least one token, since Megatron cannot
    memory-map an empty ``.bin``.

    The output is a function of the arguments only (same seed, same bytes, except that the
    blend files spell out absolute paths). Existing files are overwritten.

    Args:
        root: Output folder, created if missing.
        n_sources: Number of sources (prefixes).
        seed: Seed of the random generator.
        tokens_per_source: Inclusive bounds of the token count of a source.
        dtypes: Token dtypes to pick from, uniformly.
        multimodal_fraction: Share of multimodal sources; 0 for none.
        edge_cases: Whether to include the edge-case sources described above.

    Returns:
        The paths of what was written.

    Raises:
        ValueError: If an argument is out of range.
    """
    low, high = tokens_per_source
    if n_sources < 1:
        raise ValueError(f"n_sources must be at least 1, got {n_sources}")
    if not 1 <= low <= high:
        raise ValueError(f"tokens_per_source must satisfy 1 <= low <= high, got {low, high}")
    if not 0.0 <= multimodal_fraction <= 1.0:
        raise ValueError(f"multimodal_fraction must be in [0, 1], got {multimodal_fraction}")
    token_dtypes = [_dtype_code(dtype)[0] for dtype in dtypes]
    if not token_dtypes:
        raise ValueError("dtypes must name at least one dtype")

    root_path = Path(os.path.abspath(root))
    rng = np.random.default_rng(seed)
    n_multimodal = math.ceil(multimodal_fraction * n_sources)
    multimodal_ids = set(rng.choice(n_sources, size=n_multimodal, replace=False).tolist())
    edge_names = _EDGE_CASES if edge_cases else ()
    shares = np.array([share for _, _, share in _TEXT_LAYOUT])
    categories = rng.choice(len(_TEXT_LAYOUT), size=n_sources, p=shares / shares.sum())
    totals = rng.integers(low, high + 1, size=n_sources)
    dtype_ids = rng.integers(0, len(token_dtypes), size=n_sources)
    weights = [float(f"{w:.4g}") for w in rng.uniform(0.05, 3.0, size=n_sources)]

    counters: dict[str, int] = {}
    prefixes: list[str] = []
    for i in range(n_sources):
        multimodal = i in multimodal_ids
        folder, pattern = _MULTIMODAL_LAYOUT if multimodal else _TEXT_LAYOUT[categories[i]][:2]
        number = counters.get(folder, 0)
        counters[folder] = number + 1
        prefix = str(root_path / folder / pattern.format(number))
        edge_case = edge_names[i] if i < len(edge_names) else None
        dtype = token_dtypes[dtype_ids[i]]
        _make_source(rng, prefix, int(totals[i]), dtype, multimodal, edge_case)
        prefixes.append(prefix)

    flat: list[object] = []
    for i, (weight, prefix) in enumerate(zip(weights, prefixes, strict=True)):
        flat += [weight, prefix if i % 3 == 1 else os.path.relpath(prefix, root_path)]

    order = rng.permutation(n_sources).tolist()
    test_only = order[: min(2, n_sources - 1)]
    n_eval = max(1, n_sources // 10)
    valid = sorted(order[len(test_only) : len(test_only) + n_eval]) or [order[0]]
    test = sorted(set(test_only) | set(valid[: (len(valid) + 1) // 2]))
    train = sorted(set(range(n_sources)) - set(test_only))

    def pairs(ids: list[int]) -> list[object]:
        return [item for i in ids for item in (weights[i], prefixes[i])]

    flat_json = root_path / FLAT_JSON_NAME
    per_split_json = root_path / PER_SPLIT_JSON_NAME
    data_args_txt = root_path / DATA_ARGS_TXT_NAME
    _write_json(flat_json, flat)
    _write_json(per_split_json, {"train": pairs(train), "valid": pairs(valid), "test": pairs(test)})
    lines = "".join(f"{w!r} {p}\n" for w, p in zip(weights, prefixes, strict=True))
    _atomic_write(data_args_txt, [lines.encode()])

    return DemoBlend(
        root=root_path,
        prefixes=tuple(prefixes),
        weights=tuple(weights),
        multimodal=tuple(p for i, p in enumerate(prefixes) if i in multimodal_ids),
        flat_json=flat_json,
        per_split_json=per_split_json,
        data_args_txt=data_args_txt,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: generate a demo blend and print the path of its flat JSON blend.

    Args:
        argv: Arguments without the program name; defaults to ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 if ``OUT_DIR`` is not an empty folder.
    """
    parser = argparse.ArgumentParser(
        prog="python -m repack.synth",
        description="Generate a synthetic Megatron blend in OUT_DIR and print the path of "
        "its flat JSON blend.",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="empty or missing output folder")
    parser.add_argument("--sources", type=int, default=300, help="number of sources (300)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (0)")
    args = parser.parse_args(argv)
    if args.sources < 1:
        parser.error(f"--sources must be at least 1, got {args.sources}")

    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        message = f"Error: {out} is not an empty folder; refusing to write a demo blend into it"
        print(message, file=sys.stderr)
        return 2
    blend = make_blend(out, args.sources, seed=args.seed)
    print(blend.flat_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
