"""Examine a blend as Megatron will build it: per-source numbers, problems, resources."""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from repack.doctor import memory as mem
from repack.doctor import resources as res
from repack.doctor.findings import find
from repack.doctor.orders import ORDER_SAMPLES, arithmetic, order_problems, require_rounding
from repack.doctor.problems import ERROR, WARNING, Problem
from repack.inputs.facts import Loaded, Source, dtype_name
from repack.model import arithmetic as mm
from repack.model import blend_draws as blending
from repack.model import release as rel
from repack.model.splits import SPLIT_NAMES, Settings, SplitPlan, plan_splits
from repack.releases import release_name
from repack.units import format_size

__all__ = ["DEFAULT_MAX_EPOCHS", "Problem", "Report", "examine"]

#: Epochs of one source above which the doctor warns. Up to about four epochs of repeated data
#: cost little against fresh data (Muennighoff et al., "Scaling Data-Constrained Language
#: Models", 2023); beyond that the returns fall quickly.
DEFAULT_MAX_EPOCHS = 4.0


@dataclass
class Report:
    """What ``repack doctor`` found.

    Attributes:
        target: The blend file or repack folder examined.
        loaded: The blend and its sources.
        settings: The training settings.
        plans: The splits Megatron builds (only those whose arithmetic could be done).
        problems: Errors first, then warnings.
        resources: Files held per process and per node, and the limits.
        max_epochs: The repetition threshold.
    """

    target: str
    loaded: Loaded
    settings: Settings
    plans: list[SplitPlan]
    problems: list[Problem]
    resources: dict[str, Any]
    max_epochs: float
    skipped: dict[str, str] = field(default_factory=dict)
    #: The duplicate findings (:mod:`repack.doctor.findings`), if looked for.
    duplicates: Any = None
    _rows: list[dict[str, Any]] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """No problem that would stop or hang training."""
        return not any(p.level == ERROR for p in self.problems)

    def rows(self) -> list[dict[str, Any]]:
        """One row per source: counts, and per split its weight and token shares, samples and
        epochs; most repeated first (sources that cannot be read lead). Computed once."""
        if self._rows is None:
            self._rows = self._make_rows()
        return self._rows

    def _make_rows(self) -> list[dict[str, Any]]:
        total_tokens = {plan.name: sum(d.tokens for d in plan.datasets) for plan in self.plans}
        per_source: dict[str, dict[str, Any]] = {}
        for plan in self.plans:
            for d in plan.datasets:
                splits = per_source.setdefault(d.key, {})
                if plan.name in splits:  # named twice: Megatron builds it twice
                    merged = splits[plan.name]
                    merged["planned"] += d.planned
                    merged["drawn"] = _add(merged["drawn"], d.drawn)
                    merged["share"] = _add(merged["share"], d.share)
                    merged["datasets"] += 1
                    continue
                tokens = total_tokens[plan.name]
                splits[plan.name] = {
                    "datasets": 1,
                    "share": d.share,
                    "token_share": d.tokens / tokens if tokens else 0.0,
                    "sequences": [d.begin, d.end],
                    "tokens": d.tokens,
                    "planned": d.planned,
                    "drawn": d.drawn,
                    "num_samples": d.num_samples,
                    "built": d.built,
                    "megatron_epochs": d.epochs,
                }
        rows = []
        seq = self.settings.sequence_length
        for source in self.loaded.sources.values():
            splits = per_source.get(source.key, {})
            for entry in splits.values():
                tokens = entry["tokens"]
                planned = entry["planned"] if entry["drawn"] is None else entry["drawn"]
                entry["epochs"] = (
                    planned * seq / tokens if tokens else (math.inf if planned else 0.0)
                )
            info = source.info
            rows.append(
                {
                    "prefix": source.name,
                    "path": source.key,
                    "error": source.error,
                    "dtype": dtype_name(info) if info else None,
                    "tokens": info.token_count if info else None,
                    "sequences": info.sequence_count if info else None,
                    "documents": info.document_count - 1 if info else None,
                    "splits": splits,
                }
            )
        rows.sort(key=_outlier_key)
        return rows

    def to_json(self, *, groups: bool = False) -> dict[str, Any]:
        """Everything, JSON-able (``groups``: add per-folder totals)."""
        s = self.settings
        data: dict[str, Any] = {
            "target": self.target,
            "kind": "repack" if self.loaded.repack else "blend",
            "blend": {"source": self.loaded.blend.source, "form": self.loaded.blend.form},
            "settings": {
                "sequence_length": s.sequence_length,
                "samples": list(s.sizes),
                "split": None if self.loaded.blend.per_split else s.split,
                "mid_level_dataset_surplus": s.surplus,
                "megatron_core": release_name(s.release),
                "add_extra_token_to_sequence": s.add_extra_token,
                "drop_last_partial_validation_sequence": s.drop_last_partial_validation,
                "max_epochs": self.max_epochs,
            },
            "splits": [
                {
                    "split": p.name,
                    "asked": p.asked,
                    "size": p.size,
                    "blended": p.blended,
                    "weighted": p.weighted,
                    "datasets": len(p.datasets),
                    # always true since the exact blending index (repack.model.blending):
                    # kept for the scripts that read it
                    "exact_draws": True,
                }
                for p in self.plans
            ],
            "blending_arithmetic": arithmetic(s.fma),
            "not_computed": self.skipped,
            "sources": _finite_epochs(self.rows()),
            "problems": [p.to_json() for p in self.problems],
            "resources": self.resources,
            "ok": self.ok,
        }
        if groups:
            data["groups"] = _finite_epochs(self.groups())
        if self.duplicates is not None:
            data["duplicates"] = self.duplicates.to_json()
            self.duplicates.annotate(data["sources"])
        return data

    def groups(self) -> list[dict[str, Any]]:
        """Per-folder totals, most repeated first. A folder is named relative to the folder
        all prefixes share, however the blend spells them (relative or absolute)."""
        seq = self.settings.sequence_length
        rows = self.rows()
        folders = [os.path.dirname(row["path"]) for row in rows]
        common = os.path.commonpath(folders) if folders else ""
        out: dict[str, dict[str, Any]] = {}
        for row, absolute in zip(rows, folders):
            folder = os.path.relpath(absolute, common) if common else absolute
            group = out.setdefault(
                folder,
                {
                    "folder": folder,
                    "sources": 0,
                    "tokens": 0,
                    "documents": 0,
                    "errors": 0,
                    "splits": {},
                },
            )
            group["sources"] += 1
            group["tokens"] += row["tokens"] or 0
            group["documents"] += row["documents"] or 0
            group["errors"] += row["error"] is not None
            for name, entry in row["splits"].items():
                g = group["splits"].setdefault(
                    name,
                    {"share": 0.0, "token_share": 0.0, "tokens": 0, "planned": 0.0, "drawn": 0},
                )
                g["share"] = _add(g["share"], entry["share"])
                g["token_share"] += entry["token_share"]
                g["tokens"] += entry["tokens"]
                g["planned"] += entry["planned"]
                g["drawn"] = _add(g["drawn"], entry["drawn"])
        for group in out.values():
            for g in group["splits"].values():
                tokens = g["tokens"]
                planned = g["planned"] if g["drawn"] is None else g["drawn"]
                g["epochs"] = planned * seq / tokens if tokens else (math.inf if planned else 0.0)
        groups = list(out.values())
        groups.sort(key=lambda g: (-g["errors"], *_outlier_key({**g, "error": None})[1:]))
        return groups


def _add(a: Any, b: Any) -> Any:
    return None if a is None or b is None else a + b


def _outlier_key(row: dict[str, Any]) -> tuple:
    """Unreadable first, then those with a split that never ends, then most epochs."""
    epochs = [entry["epochs"] for entry in row["splits"].values()]
    endless = any(math.isinf(e) for e in epochs)
    top = max((e for e in epochs if math.isfinite(e)), default=0.0)
    return (row["error"] is None, not endless, -top, row.get("prefix") or row.get("folder"))


def _finite_epochs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``rows`` for JSON, which has no infinity: endless epochs become None."""
    out = []
    for row in rows:
        splits = {}
        for name, entry in row["splits"].items():
            epochs = entry["epochs"]
            splits[name] = {**entry, "epochs": epochs if math.isfinite(epochs) else None}
        out.append({**row, "splits": splits})
    return out


def examine(
    loaded: Loaded,
    settings: Settings,
    *,
    target: str,
    max_epochs: float = DEFAULT_MAX_EPOCHS,
    ranks_per_node: int = 8,
    workers: int = 2,
    mmap_bin_files: bool = True,
    limits: res.Limits | None = None,
    duplicates: Any = None,
    progress: Any = None,
    order_samples: int = ORDER_SAMPLES,
) -> Report:
    """Compute what Megatron builds from ``loaded`` with ``settings``, and what is wrong.

    Args:
        loaded: The blend and its sources (:func:`repack.inputs.facts.load`).
        settings: Training settings.
        target: What was examined, for the report.
        max_epochs: Warn about sources consumed more often than this.
        ranks_per_node: Processes per node that build datasets.
        workers: DataLoader workers per rank.
        mmap_bin_files: Megatron's ``mmap_bin_files``.
        limits: This machine's limits (default: :func:`repack.doctor.resources.machine_limits`).
        duplicates: Look for duplicate data with these
            :class:`~repack.doctor.findings.DuplicateOptions` (None: not at all).
        progress: ``progress(description, total)`` for the duplicate analysis.
        order_samples: Compare the orders of x86-64 and aarch64 builds of Megatron
            (``arch-dependent-order``) on this many samples of a split at most.

    Returns:
        The report.

    Raises:
        NotCompiled: ``settings.fma`` where ``repack.model._blending`` was not built.
    """
    blend = loaded.blend
    sources = loaded.sources
    problems: list[Problem] = []
    names = SPLIT_NAMES if blend.per_split else ("all",)
    raw = [blend.splits.get(name) for name in names]

    for source in sources.values():
        if source.error is not None:
            problems.append(Problem(ERROR, "unreadable", source.error, source.name))

    splits_in: list[list[tuple[str, float | None]] | None] = []
    skipped: dict[str, str] = {}
    for name, entries in zip(names, raw):
        if entries is None:
            splits_in.append(None)
            continue
        bad = False
        for entry in entries:
            w = entry.weight
            if w is not None and not (math.isfinite(w) and w > 0):
                bad = True
                where = "" if name == "all" else f" in split {name}"
                problems.append(
                    Problem(
                        ERROR,
                        "bad-weight",
                        f"{entry.prefix}: weight {w}{where} is not a finite number > 0; "
                        "Megatron stops (BlendedDataset asserts every weight > 0, a "
                        "non-finite one makes the sample counts NaN)",
                        entry.prefix,
                        None if name == "all" else name,
                    )
                )
            if sources[entry.path].facts is None:
                bad = True
        if bad:
            skipped[name] = "a source cannot be read or has a bad weight"
        splits_in.append(None if bad else [(e.path, e.weight) for e in entries])
        _duplicates(entries, sources, name, problems)

    plans: list[SplitPlan] = []
    require_rounding(settings.fma)
    facts = {key: s.facts for key, s in sources.items() if s.facts is not None}
    if blend.per_split:
        plans = plan_splits(splits_in, facts, settings, per_split=True)
    elif splits_in[0] is not None:
        plans = plan_splits(splits_in, facts, settings, per_split=False)
    elif "all" in skipped:
        skipped = {name: skipped["all"] for name in SPLIT_NAMES}

    for plan in plans:
        _split_problems(plan, sources, settings, max_epochs, problems)
    problems += order_problems(plans, limit=order_samples)
    _dtype_problems(sources, problems)
    found = None
    if duplicates is not None:
        found = find(loaded, plans, settings, max_epochs, duplicates, problems, progress)

    limits = limits or res.machine_limits()
    resources = _resources(
        loaded,
        settings,
        blend.per_split,
        raw,
        ranks_per_node,
        workers,
        mmap_bin_files,
        limits,
        problems,
    )
    resources["memory"] = _memory(
        loaded, plans, settings, ranks_per_node, workers, limits, problems
    )
    problems.sort(key=lambda p: p.level != ERROR)
    return Report(target, loaded, settings, plans, problems, resources, max_epochs, skipped, found)


def _duplicates(entries, sources: dict[str, Source], name: str, problems: list[Problem]) -> None:
    where = "" if name == "all" else f" of split {name}"
    seen_path: dict[str, Any] = {}
    seen_file: dict[tuple[int, int], Any] = {}
    for entry in entries:
        first = seen_path.get(entry.path)
        identity = sources[entry.path].identity
        if first is None and identity is not None:
            first = seen_file.get(identity)
        if first is not None:
            if first.weight == entry.weight:
                how = "with the same shuffle, so its weight counts twice"
            else:  # stock accepts it: two datasets, one per weight, each drawn by its own
                how = (
                    f"once per weight ({first.weight:g} and {entry.weight:g}, two datasets "
                    "of their own sizes and shuffles), so its share is their sum; unusual"
                )
            problems.append(
                Problem(
                    WARNING,
                    "duplicate",
                    f"{entry.prefix}: the blend{where} names this prefix twice (also as "
                    f"{first.prefix!r}); Megatron builds it twice, {how}, and its files are "
                    "held twice",
                    entry.prefix,
                    None if name == "all" else name,
                )
            )
            continue
        seen_path[entry.path] = entry
        if identity is not None:
            seen_file[identity] = entry


def _split_problems(
    plan: SplitPlan,
    sources: dict[str, Source],
    settings: Settings,
    max_epochs: float,
    problems: list[Problem],
) -> None:
    name = plan.name
    if len(plan.datasets) >= mm.INT16_DATASETS and plan.blended:
        problems.append(
            Problem(
                ERROR,
                "too-many-datasets",
                f"split {name} blends {len(plan.datasets):,} datasets: "
                f"{mm.too_many_datasets()}; blend fewer prefixes",
                None,
                name,
            )
        )
    for d in plan.datasets:
        source = sources[d.key]
        label = source.name
        slice_ = f"sequences [{d.begin:,}, {d.end:,}) of {source.facts.sequences:,}"
        if d.epochs is None:
            problems.append(
                Problem(
                    ERROR,
                    "empty-split",
                    f"{label}: its {name} slice ({slice_}) holds no tokens but "
                    f"{d.num_samples:,} samples are asked of it; stock Megatron hangs forever in "
                    "GPTDataset._get_num_epochs",
                    label,
                    name,
                )
            )
            continue
        if d.tokens == 0 or d.built == 0:
            if plan.blended and not plan.weighted:  # weighs by length, asserts each > 0
                problems.append(
                    Problem(
                        ERROR,
                        "empty-split",
                        f"{label}: its {name} slice ({slice_}) gives no sample; Megatron stops "
                        "(BlendedDataset asserts every dataset length > 0)",
                        label,
                        name,
                    )
                )
            continue
        if d.epochs > mm.INT32_MAX or d.sequences > mm.INT32_MAX:
            problems.append(
                Problem(
                    ERROR,
                    "int32-overflow",
                    f"{label}: its {name} split needs {d.epochs:,} epochs of {d.sequences:,} "
                    "sequences; Megatron passes both as int32 (build_sample_idx, the split's "
                    "index array) and fails or wraps around",
                    label,
                    name,
                )
            )
        elif d.index_dtype == "int64":
            problems.append(
                Problem(
                    WARNING,
                    "int64-index",
                    f"{label}: its {name} document index holds {d.epochs * d.sequences:,} "
                    "entries, past int32: Megatron builds an int64 sample index (twice the "
                    "memory per sample)",
                    label,
                    name,
                )
            )
        repetition = d.repetition(settings.sequence_length)
        if repetition > max_epochs:
            problems.append(
                Problem(
                    WARNING,
                    "repetition",
                    f"{label}: {name} draws {repetition:.1f} epochs of it ({d.samples:,.0f} "
                    f"samples of {settings.sequence_length} tokens from {d.tokens:,} tokens), "
                    f"more than --max-epochs {max_epochs:g}",
                    label,
                    name,
                )
            )
    _draw_problems(plan, sources, settings, problems)
    if not plan.weighted and plan.blended and plan.size is not None and plan.size < plan.asked:
        problems.append(
            Problem(
                WARNING,
                "short-split",
                f"split {name}: the blend has no weights, so Megatron takes one epoch of each "
                f"prefix: {plan.size:,} samples, fewer than the {plan.asked:,} asked; "
                "training runs out of data there",
                None,
                name,
            )
        )


def _draw_problems(
    plan: SplitPlan, sources: dict[str, Source], settings: Settings, problems: list[Problem]
) -> None:
    """An ``over-draw`` error per dataset the split's ``BlendedDataset`` draws beyond its
    length, where stock Megatron raises ``IndexError``."""
    datasets = plan.datasets
    if not plan.blended or any(d.drawn is None for d in datasets):
        return
    found = blending.over_draws([d.drawn for d in datasets], [d.built for d in datasets])
    name = plan.name
    for over in found:
        d = datasets[over.position]
        label = sources[d.key].name
        said = rel.over_draw_text(settings.release, name, over.drawn, over.number, over.available)
        stock = f"stock Megatron stops with IndexError in {said.where}: '{said.text}'"
        if not over.first:
            stock += " (it names the first such dataset; this one comes after)"
        if plan.weighted:
            target = math.ceil(d.planned)
            surplus = blending.surplus_for(over.drawn, target, settings.surplus)
            why = (
                f"the blend's {plan.size:,} samples are the sum of every source's rounded-up "
                f"share of the {plan.asked:,} asked, and this source's {target:,} planned, built "
                f"for {d.num_samples:,}, is drawn {over.drawn:,} times"
            )
            if rel.has_surplus_setting(settings.release):
                fix = (
                    f"raise --mid-level-dataset-surplus to {surplus:g} or more (it is "
                    f"{settings.surplus:g}), or change the weights or the {name} samples "
                    f"asked: {why}"
                )
            else:
                fix = (
                    f"change the weights or the {name} samples asked, or use megatron-core "
                    f"0.13 or later with --mid-level-dataset-surplus {surplus:g} (megatron-core "
                    f"{release_name(settings.release)} builds {rel.FIXED_SURPLUS:g} more, "
                    f"always): {why}"
                )
        else:
            fix = "give the blend weights, or ask fewer samples of the split"
        problems.append(
            Problem(
                ERROR,
                "over-draw",
                f"{label}: the {name} blend draws {over.drawn:,} samples from it, but "
                f"its GPTDataset holds {over.available:,}; {stock}. Fix: {fix}",
                label,
                name,
            )
        )


def _dtype_problems(sources: dict[str, Source], problems: list[Problem]) -> None:
    by_dtype: dict[str, list[str]] = defaultdict(list)
    for source in sources.values():
        if source.info is not None:
            by_dtype[dtype_name(source.info)].append(source.name)
    if len(by_dtype) > 1:
        kinds = ", ".join(
            f"{len(names):,} {dtype} (e.g. {names[0]})" for dtype, names in by_dtype.items()
        )
        problems.append(
            Problem(
                WARNING,
                "mixed-dtypes",
                f"sources of {len(by_dtype)} token dtypes: {kinds}. Megatron reads each prefix "
                "with its own dtype, so training works, but two dtypes usually mean two "
                "tokenizers; check they share one vocabulary (repack keeps each dtype in its "
                "own shards)",
            )
        )


def _built_counts(per_split: bool, raw, split: str | None) -> tuple[int, int, int]:
    """``IndexedDataset`` s, ``GPTDataset`` s and ``BlendedDataset`` s Megatron builds, from
    the blend's structure alone (so also when a source cannot be read)."""
    if per_split:
        built = [entries for entries in raw if entries]
        low_level = sum(len(entries) for entries in built)
        return low_level, low_level, sum(len(entries) > 1 for entries in built)
    entries = raw[0] or ()
    splits = sum(b is not None for b in mm.split_matrix(mm.parse_split(split or "")))
    lone = len(entries) == 1 and entries[0].weight is None
    return len(entries), len(entries) * splits, 0 if lone else splits


def _resources(
    loaded: Loaded,
    settings: Settings,
    per_split: bool,
    raw,
    ranks: int,
    workers: int,
    mmap_bin_files: bool,
    limits: res.Limits,
    problems: list[Problem],
) -> dict[str, Any]:
    low_level, datasets, blended = _built_counts(per_split, raw, settings.split)
    stock = res.stock_held(low_level, datasets, blended, mmap_bin_files, settings.release)
    repacked = res.repack_held(loaded.shards, blended, mmap_bin_files)
    node_stock = res.per_node(stock, ranks, workers)
    node_repack = res.per_node(repacked, ranks, workers)

    def check(value: int, limit: int | None, code: str, what: str) -> None:
        if limit is not None and value > limit:
            problems.append(
                Problem(
                    ERROR,
                    code,
                    f"stock Megatron holds {value:,} {what} per process, more than {limit:,}; "
                    f"{_FAILS[code]} (a repack holds "
                    f"{repacked.fds if code == 'open-files' else repacked.mmaps:,})",
                )
            )

    check(stock.fds, limits.open_files, "open-files", "open files")
    check(stock.mmaps, limits.max_map_count, "map-count", "memory maps")
    check(stock.mmaps, limits.mmap_limit, "mmap-limit", "memory maps")
    return {
        "ranks_per_node": ranks,
        "workers": workers,
        "mmap_bin_files": mmap_bin_files,
        "built": {"indexed_datasets": low_level, "gpt_datasets": datasets, "blended": blended},
        "stock": {
            "per_process": {"mmaps": stock.mmaps, "fds": stock.fds},
            "per_node": {"mmaps": node_stock.mmaps, "fds": node_stock.fds},
        },
        "repack": {
            "shards": loaded.shards,
            "per_process": {"mmaps": repacked.mmaps, "fds": repacked.fds},
            "per_node": {"mmaps": node_repack.mmaps, "fds": node_repack.fds},
        },
        "limits": {
            "open_files": limits.open_files,
            "open_files_hard": limits.open_files_hard,
            "max_map_count": limits.max_map_count,
            "mmap_limit": limits.mmap_limit,
        },
    }


_FAILS = {
    "open-files": "it fails with 'OSError: [Errno 24] Too many open files' under this "
    "machine's ulimit -n",
    "map-count": "mmap fails with ENOMEM past this machine's vm.max_map_count",
    "mmap-limit": "the file system refuses further mmaps past --mmap-limit "
    "(WekaFS: PermissionError)",
}


def _memory(
    loaded: Loaded,
    plans: list[SplitPlan],
    settings: Settings,
    ranks: int,
    workers: int,
    limits: res.Limits,
    problems: list[Problem],
) -> dict[str, Any]:
    """Host memory of the cached masks (:mod:`repack.doctor.memory`): per reading process of
    each split's loader and per node, stock and repacked; a warning where stock's passes the
    node's memory."""
    seq, masks = settings.sequence_length, settings.create_attention_mask
    splits = []
    for plan in plans:
        drawn = sum(1 for d in plan.datasets if d.samples > 0)
        splits.append(mem.predict(plan.name, drawn, seq, masks, settings.release))
    readers = mem.readers_per_node(ranks, workers)
    stock_node = readers * sum(m.stock_per_reader for m in splits)
    repack_node = readers * sum(m.repack_per_reader for m in splits)
    node = limits.node_memory
    if node is not None and stock_node > node and splits:
        top = max(splits, key=lambda m: m.stock_per_reader)
        ways = [] if loaded.repack else ["train from a repack (`repack merge`)"]
        ways.append(
            "create_attention_mask=False (--no-create-attention-mask-in-dataloader) where the "
            "attention kernel builds its own mask"
            if masks
            else "fewer DataLoader workers"
        )
        problems.append(
            Problem(
                WARNING,
                "host-memory",
                f"stock Megatron's data loading would hold about {format_size(stock_node)} of "
                f"cached masks per node, more than its {format_size(node)} (--node-memory): each "
                f"of {readers:,} reading processes ({ranks} ranks x {max(workers, 1)} "
                f"workers) keeps {format_size(top.stock_per_reader)} for the {top.sources:,} "
                f"sources of {top.split} at --seq-length {seq:,}; the repacked classes hold "
                f"{format_size(repack_node)} per node. Ways out: " + "; or ".join(ways),
            )
        )
    return {
        "sequence_length": seq,
        "create_attention_mask": masks,
        "readers_per_node": readers,
        "node_memory": node,
        "splits": [
            {
                "split": m.split,
                "sources": m.sources,
                "stock_per_worker": m.stock_per_reader,
                "repack_per_worker": m.repack_per_reader,
            }
            for m in splits
        ],
        "stock": {
            "per_worker": max((m.stock_per_reader for m in splits), default=0),
            "per_source": mem.mask_bytes_per_source(seq, masks, True),
            "per_node": stock_node,
        },
        "repack": {
            "per_worker": max((m.repack_per_reader for m in splits), default=0),
            "per_source": mem.mask_bytes_per_source(seq, masks, False, settings.release),
            "per_node": repack_node,
        },
    }
