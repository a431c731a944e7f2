"""``repack trace``'s table: one line per sample (or per read of a document)."""

from __future__ import annotations

from typing import Any

from repack.trace.query import Answer

__all__ = ["render"]

_MAX_DOCUMENTS = 6


def _documents(record: dict[str, Any]) -> str:
    parts = [f"{d['document']}[{d['start']}:{d['end']}]" for d in record["documents"]]
    if len(parts) > _MAX_DOCUMENTS:
        parts = [*parts[: _MAX_DOCUMENTS - 1], f"... {len(parts) - _MAX_DOCUMENTS + 1} more"]
    return " ".join(parts)


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return lines


def _samples(records: list[dict[str, Any]], evaluation: bool) -> list[str]:
    header = ["iteration", "rank", "microbatch", "row", "index", "source", "sample", "documents"]
    phased = bool(records) and "phase" in records[0]
    if evaluation:
        header.insert(1, "eval")
    if phased:
        header.insert(0, "phase")
    blank = [""] * (len(header) - 3)
    rows = []
    for r in records:
        row = [str(r[k]) for k in ("iteration", "rank", "microbatch", "row", "index")]
        row += [r["source"], str(r["sample"]), _documents(r)]
        if evaluation:
            row.insert(1, str(r["evaluation"]))
        if phased:
            row.insert(0, str(r["phase"]))
        rows.append(row)
        if "text" in r:
            rows.append([*blank, "text:", repr(r["text"]), ""])
        if "tokens" in r:
            rows.append([*blank, "tokens:", " ".join(map(str, r["tokens"])), ""])
    return _table(rows, header)


def _occurrences(records: list[dict[str, Any]], evaluation: bool) -> list[str]:
    header = ["iteration", "rank", "microbatch", "row", "index", "tokens"]
    phased = bool(records) and "phase" in records[0]
    if evaluation:
        header.insert(1, "eval")
    if phased:
        header.insert(0, "phase")
    rows = []
    for r in records:
        row = [str(r[k]) for k in ("iteration", "rank", "microbatch", "row", "index")]
        row.append(f"[{r['start']}:{r['end']}]")
        if evaluation:
            row.insert(1, str(r["evaluation"]))
        if phased:
            row.insert(0, str(r["phase"]))
        rows.append(row)
    return _table(rows, header)


def render(answer: Answer) -> str:
    """The answer as text: training, then the evaluations, then the notes."""
    lines: list[str] = []
    arithmetic = answer.header.get("blending_arithmetic")
    if arithmetic is not None:
        lines.append(f"blending arithmetic: {arithmetic['description']}")
    lines += answer.summary
    show = _samples if answer.kind == "samples" else _occurrences
    what = "samples" if answer.kind == "samples" else "reads"
    lines.append(f"training: {len(answer.train):,} {what}")
    if answer.train:
        lines += show(answer.train, False)
    if answer.validation or answer.header.get("evaluations"):
        lines.append("")
        lines.append(f"validation: {len(answer.validation):,} {what}")
        if answer.validation:
            lines += show(answer.validation, True)
    if answer.skipped:
        lines.append("")
        shown = ", ".join(map(str, answer.skipped))
        lines.append(f"skipped iterations (read, not trained on): {shown}")
    for note in answer.notes[answer.said :]:
        lines.append(f"note: {note}")
    return "\n".join(lines)
