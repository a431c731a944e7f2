"""The doctor's duplicate findings: run the analysis of :mod:`repack.doctor.duplicates` over a
blend as Megatron builds it, and turn its figures into problems (``identical-sources``,
``repeated-documents``, ``shared-documents``, ``split-overlap``, and ``repetition`` judged on
the most-seen document), JSON and text lines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from repack.doctor.documents import (
    DEFAULT_READERS,
    fingerprint_status,
    iter_documents,
    reloader,
)
from repack.doctor.duplicates import Analysis, Options
from repack.doctor.problems import WARNING, Problem
from repack.doctor.repeats import Result, SourceMeta, per_source, share
from repack.doctor.repeats import summarize as summarize_result
from repack.inputs.facts import Loaded
from repack.model.splits import Settings, SplitPlan

__all__ = ["DEFAULT_DUPLICATES", "DuplicateOptions", "Duplicates", "find", "lines"]

_THRESHOLDS = Options()


@dataclass(frozen=True)
class DuplicateOptions:
    """How the doctor looks for duplicates.

    Attributes:
        thresholds: The problems' thresholds and the memory bound.
        read_tokens: Read the tokens where there are no fingerprints (a plain blend, a repack
            written without them): ``repack doctor --duplicates``.
        readers: Sources read at once when reading tokens.
    """

    thresholds: Options = _THRESHOLDS
    read_tokens: bool = False
    readers: int = DEFAULT_READERS


#: Fingerprints of a repack only; nothing read.
DEFAULT_DUPLICATES = DuplicateOptions()


@dataclass
class Duplicates:
    """The duplicate part of a doctor report."""

    #: Where the fingerprints came from: ``"fingerprints"``, ``"tokens"``, or None if none.
    origin: str | None
    #: Why there is no analysis, when there is none.
    reason: str | None = None
    result: Result | None = None
    drawn: dict[str, float] = field(default_factory=dict)
    options: Options = _THRESHOLDS

    def to_json(self) -> dict[str, Any]:
        """The report's ``duplicates`` member."""
        data: dict[str, Any] = {
            "available": self.result is not None,
            "origin": self.origin,
            "reason": self.reason,
            "thresholds": {
                "max_repeated_share": self.options.max_repeated,
                "max_shared_share": self.options.max_shared,
                "max_split_overlap": self.options.max_overlap,
                "min_duplicate_tokens": self.options.min_tokens,
            },
        }
        if self.result is not None:
            r = self.result
            data.update(summarize_result(r))
            data["splits"] = {
                split: {
                    "unique_tokens": r.unique_tokens.get(split, 0),
                    "tokens": r.split_tokens.get(split, 0),
                    "drawn_tokens": self.drawn.get(split, 0.0),
                }
                for split in sorted(r.split_tokens)
            }
        return data

    def annotate(self, rows: list[dict[str, Any]]) -> None:
        """Add ``duplicates`` to each JSON source row (by path; None without an analysis)."""
        if self.result is None:
            for row in rows:
                row["duplicates"] = None
            return
        position = {meta.key: i for i, meta in enumerate(self.result.sources)}
        for row in rows:
            i = position.get(row.get("path"))
            row["duplicates"] = None if i is None else per_source(self.result, i)


def find(
    loaded: Loaded,
    plans: list[SplitPlan],
    settings: Settings,
    max_epochs: float,
    options: DuplicateOptions,
    problems: list[Problem],
    progress: Callable[[str, int], Callable[[int], object]] | None = None,
) -> Duplicates:
    """Analyse the duplicates of ``loaded`` as the ``plans`` draw it; add the problems found
    to ``problems``."""
    status = fingerprint_status(loaded)
    has_fingerprints = status is not None and not isinstance(status, str)
    if not has_fingerprints and not options.read_tokens:
        reason = (
            status
            if isinstance(status, str)
            else "not looked for: --duplicates reads the tokens (a repack's fingerprints need none)"
        )
        return Duplicates(None, reason, options=options.thresholds)
    sources = [s for s in loaded.sources.values() if s.info is not None]
    metas = _metas(sources, plans, settings)
    total = sum(s.info.document_count - 1 for s in sources)
    # a repack's fingerprints are read again from their mapped file, not copied
    stored = status.hashes if has_fingerprints else None
    analysis = Analysis(metas, total, options.thresholds, stored=stored)
    if progress is None:
        advance = None
    elif has_fingerprints:
        advance = progress("duplicates", total)
    else:
        advance = progress("duplicates", sum(s.info.bin_size for s in sources))
    try:
        for i, documents in iter_documents(
            loaded,
            sources,
            read_tokens=True,
            readers=options.readers,
            advance=advance,
            fingerprints=status if has_fingerprints else None,
        ):
            analysis.add(i, *documents)
    except BaseException:
        analysis.close()  # its temporary file, if it made one
        raise
    result = analysis.finish(reloader(loaded, sources))
    drawn = {
        plan.name: sum(d.planned for d in plan.datasets) * settings.sequence_length
        for plan in plans
    }
    origin = "fingerprints" if has_fingerprints else "tokens"
    found = Duplicates(origin, None, result, drawn, options.thresholds)
    _problems(found, plans, settings, max_epochs, problems)
    return found


def _metas(sources, plans: list[SplitPlan], settings: Settings) -> list[SourceMeta]:
    splits: dict[str, dict[str, list]] = {s.key: {} for s in sources}
    for plan in plans:
        for d in plan.datasets:
            if d.key not in splits:
                continue
            entry = splits[d.key].setdefault(plan.name, [d.begin, d.end, 0.0])
            entry[2] += d.repetition(settings.sequence_length) if d.tokens else 0.0
    return [
        SourceMeta(
            s.key,
            s.name,
            s.info.dtype_code,
            tuple((name, b, e, epochs) for name, (b, e, epochs) in splits[s.key].items()),
        )
        for s in sources
    ]


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _problems(
    found: Duplicates,
    plans: list[SplitPlan],
    settings: Settings,
    max_epochs: float,
    problems: list[Problem],
) -> None:
    r, o = found.result, found.options
    names = [m.name for m in r.sources]
    for later, first in sorted(r.identical.items()):
        problems.append(
            Problem(
                WARNING,
                "identical-sources",
                f"{names[later]}: a byte-identical copy of {names[first]} "
                f"({r.documents[later]:,} documents, {r.tokens[later]:,} tokens): its "
                "documents are drawn as often as both weights together say",
                names[later],
            )
        )
    shortest = f"of {r.min_tokens:,}+ tokens"
    for i, name in enumerate(names):
        # by tokens, over documents of at least min_tokens (Options.min_tokens)
        tokens = int(r.tokens[i])
        repeated_tokens = int(r.long_repeated_tokens[i])
        if share(repeated_tokens, tokens) > o.max_repeated:
            problems.append(
                Problem(
                    WARNING,
                    "repeated-documents",
                    f"{name}: {repeated_tokens:,} of its {tokens:,} tokens "
                    f"({_pct(share(repeated_tokens, tokens))}) are repeats: "
                    f"{r.long_repeated_documents[i]:,} of its {r.long_documents[i]:,} documents "
                    f"{shortest} repeat another of its documents; the most repeated is there "
                    f"{r.long_max_copies[i]:,} times",
                    name,
                )
            )
    done = set()
    drawn_in = [{split for split, *_ in m.splits} for m in r.sources]
    for (a, b), figures in sorted(r.pairs.items()):
        if (b, a) in done:
            continue
        done.add((a, b))
        if drawn_in[a] and drawn_in[b] and not drawn_in[a] & drawn_in[b]:
            continue  # in different splits: split-overlap says it
        docs, tokens = figures[2:]
        back = r.pairs.get((b, a), [0, 0, 0, 0])[2:]
        share_a = share(tokens, int(r.tokens[a]))
        share_b = share(back[1], int(r.tokens[b]))
        if max(share_a, share_b) <= o.max_shared:
            continue
        if share_b > share_a:  # name the source most of which is elsewhere
            a, b, docs, tokens, share_a, share_b, back = (
                b, a, back[0], back[1], share_b, share_a, [docs, tokens]
            )  # fmt: skip
        problems.append(
            Problem(
                WARNING,
                "shared-documents",
                f"{names[a]}: {tokens:,} of its {r.tokens[a]:,} tokens ({_pct(share_a)}) are "
                f"in {docs:,} of its {r.long_documents[a]:,} documents {shortest} that are "
                f"also in {names[b]} ({back[1]:,} tokens, {_pct(share_b)} of it)",
                names[a],
            )
        )
    for split, values in r.overlap.items():
        for i in range(len(names)):
            docs = int(values[i, 0])
            total = r.split_documents.get((split, i), 0)
            if docs == 0 or share(docs, total) <= o.max_overlap:
                continue
            partner = r.overlap_partner.get((split, i))
            also = f" (e.g. in {names[partner]})" if partner is not None else ""
            problems.append(
                Problem(
                    WARNING,
                    "split-overlap",
                    f"{names[i]}: {docs:,} of its {total:,} {split} documents "
                    f"({_pct(share(docs, total))}, {values[i, 1]:,} tokens) are also in "
                    f"train{also}: {split} measures data the model trains on",
                    names[i],
                    split,
                )
            )
    _repetition(found, plans, settings, max_epochs, problems)


def _repetition(found, plans, settings: Settings, max_epochs: float, problems) -> None:
    """Judge ``--max-epochs`` on the most-seen document: a document present 8 times in a
    source drawn for 2 epochs is seen 16 times."""
    r = found.result
    position = {m.key: i for i, m in enumerate(r.sources)}
    where = {(p.source, p.split): k for k, p in enumerate(problems) if p.code == "repetition"}
    for plan in plans:
        effective = r.effective.get(plan.name)
        if effective is None:
            continue
        seen_keys = set()
        for d in plan.datasets:
            i = position.get(d.key)
            if i is None or d.key in seen_keys or not d.tokens:
                continue
            seen_keys.add(d.key)
            epochs = r.sources[i].splits
            drawn = sum(e for s, _, _, e in epochs if s == plan.name)
            seen = float(effective[i])
            if seen <= max_epochs or seen <= drawn * (1 + 1e-9):
                continue
            name = r.sources[i].name
            message = (
                f"{name}: {plan.name} draws {drawn:.1f} epochs of it, and its documents "
                f"repeat (up to {r.max_copies[i]:,} copies in it"
                + (", some also in other sources" if r.shared_documents[i] else "")
                + f"): its most-seen document is seen {seen:.1f} times, more than "
                f"--max-epochs {max_epochs:g}"
            )
            problem = Problem(WARNING, "repetition", message, name, plan.name)
            k = where.get((name, plan.name))
            if k is None:
                problems.append(problem)
            else:
                problems[k] = problem


def lines(found: Duplicates | None) -> list[str]:
    """The report's text section on duplicates."""
    if found is None:
        return []
    if found.result is None:
        return [f"Duplicates: {found.reason}", ""]
    r = found.result
    s = summarize_result(r)
    origin = "fingerprints" if found.origin == "fingerprints" else "tokens read"
    out = [
        f"Duplicates (exact, from {origin}): {s['repeated_documents']:,} of "
        f"{s['nonempty_documents']:,} documents repeat another in their source "
        f"({_pct(s['repeated_share'])}, {s['repeated_tokens']:,} tokens); "
        f"{s['identical_sources']:,} identical sources; {s['source_pairs_sharing']:,} pairs "
        "of sources share documents"
    ]
    for split in sorted(r.split_tokens, key=["train", "valid", "test"].index):
        unique = r.unique_tokens.get(split, 0)
        drawn = found.drawn.get(split, 0.0)
        ratio = f" ({drawn / unique:.2f}x the unique tokens)" if unique else ""
        out.append(
            f"  {split}: {unique:,} unique tokens in its {r.split_tokens[split]:,} tokens; "
            f"draws {drawn:,.0f} tokens{ratio}"
        )
    out.append("")
    return out


def inspect_summary(folder: str) -> dict[str, Any]:
    """What ``repack inspect`` shows of the repack's duplicates: the totals from its
    fingerprints (nothing read but them) and the problems the doctor would name, splits
    aside; or why there are none."""
    from repack.inputs.facts import load

    loaded = load(folder)
    problems: list[Problem] = []
    # nothing drawn: no rounding to ask the installed megatron-core's helper about
    settings = Settings(sequence_length=2, sizes=(0, 0, 0), fma=False)
    found = find(loaded, [], settings, float("inf"), DEFAULT_DUPLICATES, problems)
    data = found.to_json()
    del data["thresholds"]
    data.pop("splits", None)
    data["problems"] = [p.to_json() for p in problems]
    return data
