"""The doctor's picture of a mix: weight share against token share, and epochs.

Two panels, one point per source (or folder): left, each source's weight share (x) against its
token share (y), log-log, so that the diagonal is "sampled as often as its size says" and the
distance from it is the over- or under-sampling; right, the epochs of each source in the
training split, sorted, with the ``--max-epochs`` line. Points are small and translucent, so
1,000 sources stay readable; the outliers are labelled.

Needs matplotlib (``pip install 'megatron-repack[plot]'``); the rest of repack does not.
"""

from __future__ import annotations

import math
import os
from typing import Any

from repack.doctor.core import Report
from repack.errors import InputError

__all__ = ["check_available", "plot_mix"]

_LABELS = 6


def check_available() -> None:
    """Raise a clear error when matplotlib is missing.

    Raises:
        InputError: matplotlib cannot be imported.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError(
            "--plot needs matplotlib, which is not installed: pip install 'megatron-repack[plot]'"
        ) from None


def _points(report: Report, group_by_folder: bool) -> tuple[str, list[dict[str, Any]]]:
    names = [plan.name for plan in report.plans]
    split = "train" if "train" in names else (names[0] if names else None)
    items = report.groups() if group_by_folder else report.rows()
    points = []
    for item in items:
        entry = item["splits"].get(split) if split else None
        if not entry:
            continue
        label = item["folder"] if group_by_folder else item["prefix"]
        points.append(
            {
                "label": label,
                "share": entry["share"],
                "token_share": entry["token_share"],
                "epochs": entry["epochs"],
            }
        )
    return split or "-", points


def plot_mix(
    report: Report, path: str | os.PathLike[str], *, group_by_folder: bool = False
) -> None:
    """Draw the mix of ``report`` into ``path`` (format from its suffix: ``.png`` or ``.svg``).

    Raises:
        InputError: matplotlib is missing, or the suffix is neither ``.png`` nor ``.svg``.
    """
    check_available()
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".png", ".svg"):
        raise InputError(f"{path}: --plot writes .png or .svg files, not {suffix or 'no suffix'!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    split, points = _points(report, group_by_folder)
    what = "folders" if group_by_folder else "sources"
    finite = [p for p in points if p["epochs"] is not None and math.isfinite(p["epochs"])]
    stuck = len(points) - len(finite)
    ranked = sorted(finite, key=lambda p: -p["epochs"])
    marked = ranked[:_LABELS]
    fig = plt.figure(figsize=(12, 6.6), dpi=100)
    grid = fig.add_gridspec(2, 2, height_ratios=[5, 1.2])
    left, right = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    notes = fig.add_subplot(grid[1, :])
    notes.axis("off")
    fig.suptitle(
        f"{os.path.basename(report.target)}: {len(points):,} {what}, split {split}, "
        f"--seq-length {report.settings.sequence_length}",
        fontsize=11,
    )
    many = len(points) > 100
    size, alpha = (6, 0.45) if many else (16, 0.8)

    weighted = [p for p in finite if p["share"] and p["token_share"]]
    if weighted:
        xs = [p["share"] for p in weighted]
        ys = [p["token_share"] for p in weighted]
        colors = [p["epochs"] for p in weighted]
        dots = left.scatter(
            xs, ys, c=colors, s=size, alpha=alpha, cmap="viridis", norm=_norm(colors), lw=0
        )
        fig.colorbar(dots, ax=left, label=f"epochs drawn in {split}")
        low = min(min(xs), min(ys)) / 2
        high = max(max(xs), max(ys)) * 2
        left.plot([low, high], [low, high], color="0.5", lw=0.8, ls="--", label="weight = tokens")
        left.set_xscale("log")
        left.set_yscale("log")
        left.set_xlim(low, high)
        left.set_ylim(low, high)
        for number, p in enumerate(marked, 1):
            if p["share"] and p["token_share"]:
                _mark(left, number, p["share"], p["token_share"], (-36, 8 + 12 * number))
        left.legend(loc="upper left", fontsize=8)
    else:
        why = "no weights: Megatron weighs by size" if finite else "no split could be computed"
        left.text(0.5, 0.5, why, ha="center", va="center")
    left.set_xlabel("weight share (of the split's samples)")
    left.set_ylabel("token share (of the split's tokens)")
    left.set_title("below the diagonal: drawn more often than its size", fontsize=9)

    ys = [p["epochs"] for p in ranked]
    if ranked:
        right.plot(range(1, len(ys) + 1), ys, marker="o", ms=2 if many else 4, lw=0.8)
        positive = [y for y in ys if y > 0]
        if positive and max(positive) > 20 * min(positive):
            right.set_yscale("log")
        for number, p in enumerate(marked, 1):
            _mark(right, number, ys.index(p["epochs"]) + 1, p["epochs"], (45, 4 - 12 * number))
    right.axhline(report.max_epochs, color="tab:red", lw=0.8, ls="--")
    right.text(
        len(ys) or 1,
        report.max_epochs,
        f"--max-epochs {report.max_epochs:g} ",
        color="tab:red",
        fontsize=8,
        ha="right",
        va="bottom",
    )
    right.set_xlabel(f"{what}, most repeated first")
    right.set_ylabel(f"epochs drawn in {split}")
    title = f"epochs per {what[:-1]}"
    if stuck:
        title += f"; {stuck} more with no tokens (Megatron hangs)"
    right.set_title(title, fontsize=9)
    for axis in (left, right):
        axis.grid(True, which="major", color="0.9", lw=0.6)
    lines = [
        f"{number}  {_short(p['label'], 70)}: {p['epochs']:.1f} epochs, weight "
        f"{_pct(p['share'])} vs tokens {_pct(p['token_share'])}"
        for number, p in enumerate(marked, 1)
    ]
    notes.text(
        0.01,
        1.0,
        "\n".join(lines),
        va="top",
        ha="left",
        fontsize=8,
        family="monospace",
        transform=notes.transAxes,
    )
    fig.tight_layout()
    fig.savefig(path, format=suffix[1:])
    plt.close(fig)


def _mark(axis, number: int, x: float, y: float, offset: tuple[int, int]) -> None:
    """Number a point; labels are fanned out by ``offset`` points so that neighbours stay
    readable."""
    axis.annotate(
        str(number),
        (x, y),
        xytext=offset,
        textcoords="offset points",
        fontsize=8,
        color="tab:red",
        weight="bold",
        arrowprops={"arrowstyle": "-", "color": "tab:red", "lw": 0.6},
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _norm(values: list[float]):
    from matplotlib.colors import LogNorm, Normalize

    low, high = min(values), max(values)
    if low > 0 and high / low > 20:
        return LogNorm(low, high)
    return Normalize(low, high if high > low else low + 1)


def _short(label: str, width: int = 28) -> str:
    return label if len(label) <= width else "…" + label[-(width - 1) :]
