"""The doctor's report as text: settings, sources (or folders), problems, resources, verdict."""

from __future__ import annotations

import math
from typing import Any

from repack.doctor.core import Report
from repack.doctor.findings import lines as duplicate_lines
from repack.doctor.orders import arithmetic_line
from repack.doctor.problems import ERROR
from repack.releases import release_name
from repack.units import format_size, plural

__all__ = ["render"]


def _table(rows: list[list[str]], left: int = 1) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _epochs(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "never"
    return f"{value:.2f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def render(report: Report, *, top: int = 20, group_by_folder: bool = False) -> str:
    """The report as lines of text.

    Args:
        report: The report.
        top: Show this many sources (or folders), the most repeated first; 0 for all.
        group_by_folder: One row per folder of prefixes instead of one per source.
    """
    loaded, s = report.loaded, report.settings
    blend = loaded.blend
    readable = [x for x in loaded.sources.values() if x.info is not None]
    tokens = sum(x.info.token_count for x in readable)
    kind = f"repack {loaded.repack}, " if loaded.repack else ""
    out = [
        f"{report.target}: {kind}{blend.form} blend, "
        f"{plural(len(loaded.sources), 'source', grouped=True)}, "
        f"{plural(tokens, 'token', grouped=True)}",
        f"Megatron: --seq-length {s.sequence_length}"
        + ("" if blend.per_split else f", --split {s.split}")
        + "; samples asked: "
        + ", ".join(f"{n} {v:,}" for n, v in zip(("train", "valid", "test"), s.sizes))
        + f"; as megatron-core {release_name(s.release)} builds",
    ]
    for plan in report.plans:
        what = (
            f"BlendedDataset of {plural(len(plan.datasets), 'GPTDataset', grouped=True)}"
            if plan.blended
            else "one GPTDataset"
        )
        samples = "? samples" if plan.size is None else plural(plan.size, "sample", grouped=True)
        out.append(f"  {plan.name}: {what}, {samples}")
    for name, why in report.skipped.items():
        out.append(f"  {name}: not computed: {why}")
    out.append(arithmetic_line(s.fma))
    names = [plan.name for plan in report.plans]
    out.append("")
    items = report.groups() if group_by_folder else report.rows()
    shown = items if top <= 0 else items[:top]
    label = "folders" if group_by_folder else "sources"
    more = "" if len(shown) == len(items) else f" ({len(shown)} of {len(items):,}; --top 0: all)"
    out.append(f"{label.capitalize()}, most repeated first{more}:")
    first = names[0] if names else None
    head = [label[:-1], "tokens", "documents"]
    if not group_by_folder:
        head.insert(1, "dtype")
    head += [f"{first} weight", f"{first} tokens"] if first else []
    for name in names:
        head += [f"{name} samples", f"{name} epochs"]
    rows = [head]
    for item in shown:
        splits: dict[str, Any] = item["splits"]
        main = splits.get(first, {}) if first else {}
        if group_by_folder:
            row = [item["folder"], f"{item['tokens']:,}", f"{item['documents']:,}"]
        elif item["error"] is not None:
            row = [item["prefix"], "?", "?", "?"]
        else:
            row = [item["prefix"], item["dtype"], f"{item['tokens']:,}", f"{item['documents']:,}"]
        if first:
            row += [_pct(main.get("share")), _pct(main.get("token_share"))]
        for name in names:
            entry = splits.get(name)
            if entry:
                drawn = entry["planned"] if entry.get("drawn") is None else entry["drawn"]
                row += [_count(drawn), _epochs(entry["epochs"])]
            else:
                row += ["-", "-"]
        rows.append(row)
    out += _table(rows)
    out.append("")
    out += duplicate_lines(report.duplicates)
    errors = [p for p in report.problems if p.level == ERROR]
    warnings = [p for p in report.problems if p.level != ERROR]
    if report.problems:
        out.append(f"Problems ({_n(len(errors), 'error')}, {_n(len(warnings), 'warning')}):")
        by_code: dict[str, list] = {}
        for p in report.problems:
            by_code.setdefault(p.code, []).append(p)
        for code, found in by_code.items():
            for p in found if top <= 0 else found[:top]:
                out.append(f"{'ERROR' if p.level == ERROR else 'WARNING'} [{code}] {p.message}")
            if 0 < top < len(found):
                out.append(f"... and {len(found) - top:,} more [{code}] (--top 0 or --json: all)")
        out.append("")
    r = report.resources
    out.append(
        f"Files held ({r['ranks_per_node']} ranks per node, {r['workers']} DataLoader workers "
        f"each, mmap_bin_files={r['mmap_bin_files']}):"
    )
    stock, repack = r["stock"], r["repack"]
    rows = [
        ["", "mmaps/process", "fds/process", "mmaps/node", "fds/node"],
        ["stock Megatron"]
        + [f"{stock[w][k]:,}" for w in ("per_process", "per_node") for k in ("mmaps", "fds")],
        [f"repack ({plural(repack['shards'], 'shard')})"]
        + [f"{repack[w][k]:,}" for w in ("per_process", "per_node") for k in ("mmaps", "fds")],
    ]
    out += ["  " + line for line in _table(rows)]
    lim = r["limits"]

    def show(v: int | None) -> str:
        return "unlimited" if v is None else f"{v:,}"

    out.append(
        f"  this machine: ulimit -n {show(lim['open_files'])} (hard "
        f"{show(lim['open_files_hard'])}), vm.max_map_count {show(lim['max_map_count'])}"
        + (f", --mmap-limit {lim['mmap_limit']:,}" if lim["mmap_limit"] else "")
    )
    out.append("")
    out += memory_lines(r.get("memory"))
    if report.ok:
        extra = f" ({_n(len(warnings), 'warning')})" if warnings else ""
        out.append(f"OK: nothing found that would stop or hang training{extra}")
    else:
        out.append(f"FAIL: {_n(len(errors), 'problem')} would stop or hang training")
    return "\n".join(out)


def memory_lines(memory: dict | None) -> list[str]:
    """The host memory of the cached masks: per worker of each split's loader and per node."""
    if not memory or not memory["splits"]:
        return []
    masks = "on" if memory["create_attention_mask"] else "off"
    out = [
        f"Host memory of cached masks (--seq-length {memory['sequence_length']:,}, attention "
        f"masks {masks}, {memory['readers_per_node']:,} reading processes per node per loader):"
    ]
    rows = [["", "sources drawn", "stock/worker", "repack/worker"]]
    for m in memory["splits"]:
        rows.append(
            [
                m["split"],
                f"{m['sources']:,}",
                format_size(m["stock_per_worker"]),
                format_size(m["repack_per_worker"]),
            ]
        )
    stock, repack = memory["stock"], memory["repack"]
    rows.append(["per node", "", format_size(stock["per_node"]), format_size(repack["per_node"])])
    out += ["  " + line for line in _table(rows)]
    node = memory["node_memory"]
    own = repack.get("per_source", 0)
    out.append(
        f"  stock keeps {format_size(stock['per_source'])} per source in every worker; the "
        "repacked classes one set per process"
        + (f" and {format_size(own)} per source (a loss mask each)" if own else "")
        + (f"; node memory {format_size(node)} (--node-memory)" if node else "")
    )
    out.append("")
    return out
