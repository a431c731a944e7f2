"""A run's phases, one after the other: what each draws from each source, and which documents
it trains on that an earlier phase trained on.

:func:`replay` plans every phase's training split as Megatron builds it
(:func:`repack.model.splits.plan_splits`: the ``GPTDataset`` sizes, epochs and the
``BlendedDataset``'s draws per source), builds each drawn source's indices
(:mod:`repack.model.gpt_indices`: stock's, or the continuation's) and counts, per source and
sequence, the phases that trained on it. The doctor runs it twice (stock, and continued); the
loader runs it, continued, up to the phase it builds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from repack.model.gpt_indices import Draw, continued_indices, drawn_documents, stock_indices
from repack.model.splits import DatasetPlan, Settings, plan_splits

if TYPE_CHECKING:  # the doctor's reading of a blend; the loader's continuation passes its own
    from repack.inputs.facts import Loaded

__all__ = ["PhaseDraws", "SourceDraws", "replay", "source_draw", "train_plan"]

#: How the phases' sources are told apart: a repack's source id, else the .idx file's identity.
Identity = object


@dataclass(frozen=True)
class SourceDraws:
    """One source in one phase.

    Attributes:
        key: Its absolute path; ``name``: as the phase's blend writes it.
        samples: Samples the phase's ``BlendedDataset`` draws from it.
        documents: Documents its drawn samples train on.
        before: Of those, documents an earlier phase trained on.
        before_tokens: Their tokens.
        samples_before: Drawn samples with a token in such a document.
        slice_documents: Documents (with tokens) of its training slice.
        seen: Of those, documents an earlier phase trained on.
        unseen_samples: The continuation's samples all in never-trained documents (it hands
            them out first); ``None`` for stock's order.
        epochs: Epochs of its document index in the phase.
    """

    key: str
    name: str
    samples: int
    documents: int
    before: int
    before_tokens: int
    samples_before: int
    slice_documents: int
    seen: int
    unseen_samples: int | None
    epochs: int

    @property
    def expected(self) -> float:
        """The share of its trained documents expected trained before had the phase drawn
        documents regardless of the earlier phases (another seed): the share of its slice
        trained before."""
        return self.seen / self.slice_documents if self.slice_documents else 0.0

    @property
    def exhausted(self) -> bool:
        """Whether the continuation runs out of never-trained documents (and starts over)."""
        return self.unseen_samples is not None and self.samples > self.unseen_samples


@dataclass(frozen=True)
class PhaseDraws:
    """One phase: its number, start, samples asked, and its sources."""

    phase: int
    start_iteration: int
    samples: int
    seed: int
    sources: tuple[SourceDraws, ...]


def train_plan(loaded: Loaded, settings: Settings) -> list[DatasetPlan]:
    """The training split's datasets Megatron builds from ``loaded``'s blend (none when the
    blend has no training split)."""
    blend = loaded.blend
    facts = {key: s.facts for key, s in loaded.sources.items() if s.facts is not None}
    if blend.per_split:
        names = ("train", "valid", "test")
        splits = [blend.splits.get(name) for name in names]
        entries = [None if e is None else [(x.path, x.weight) for x in e] for e in splits]
        plans = plan_splits(entries, facts, settings, per_split=True)
    else:
        entries = [[(x.path, x.weight) for x in blend.splits["all"]]]
        plans = plan_splits(entries, facts, settings, per_split=False)
    for plan in plans:
        if plan.name == "train":
            return list(plan.datasets)
    return []


def _drawn(plan: DatasetPlan, asked: int) -> int:
    if plan.built is None:
        return 0
    n = plan.drawn if plan.drawn is not None else asked  # a lone dataset: the phase's samples
    return min(int(n), int(plan.built))  # past its length, Megatron stops (an over-draw)


def source_draw(
    plan: DatasetPlan,
    lengths: np.ndarray,
    drawn: int,
    seed: int,
    settings: Settings,
    counts: np.ndarray | None,
    continued: bool,
) -> tuple[Draw, int | None]:
    """The documents ``drawn`` samples of one source's dataset train on: with stock's indices,
    or (``continued``, and an earlier phase trained on some of its slice) the continuation's.

    Returns:
        The :class:`Draw`, and the continuation's never-trained samples (``None`` for stock).
    """
    extra = int(settings.add_extra_token)
    length = settings.sequence_length
    earlier = counts is not None and bool(np.any(counts[plan.begin : plan.end]))
    if continued and earlier:
        document_index, shuffle, unseen = continued_indices(
            plan.begin, plan.end, plan.epochs, plan.built, lengths, counts, seed, length
        )
    else:
        document_index, shuffle = stock_indices(
            plan.begin,
            plan.end,
            plan.epochs,
            plan.num_samples,
            plan.built,
            plan.tokens,
            seed,
            length,
            extra,
        )
        unseen = None
    return drawn_documents(document_index, shuffle, lengths, length, drawn, counts), unseen


def replay(
    phases: Sequence[tuple[int, int, int, int]],
    loads: Callable[[int], Loaded],
    settings: Settings,
    *,
    continued: bool,
    identity: Callable[[Loaded, str], Identity] | None = None,
) -> tuple[list[PhaseDraws], dict[Identity, np.ndarray]]:
    """Run the phases in order.

    Args:
        phases: ``(number, start_iteration, samples, seed)`` of each phase, in order.
        loads: The blend of phase ``number``, read (:func:`repack.inputs.facts.load`).
        settings: The run's settings (``sizes`` is replaced by each phase's samples).
        continued: Order every source as the continuation does (else as stock does).
        identity: What tells a source apart across the phases' blends (default: the
            source's ``identity``, else its key).

    Returns:
        Each phase's draws, and per source the phases that trained on each of its sequences
        (after the last phase given).
    """
    counts: dict[Identity, np.ndarray] = {}
    results = []
    for number, start, samples, seed in phases:
        loaded = loads(number)
        phase_settings = Settings(
            sequence_length=settings.sequence_length,
            sizes=(samples, 0, 0),
            split=settings.split,
            surplus=settings.surplus,
            add_extra_token=settings.add_extra_token,
            release=settings.release,
            fma=settings.fma,
        )
        trained: list[tuple[Identity, np.ndarray, int]] = []
        rows = []
        for plan in train_plan(loaded, phase_settings):
            source = loaded.sources[plan.key]
            lengths = np.asarray(source.facts.lengths)
            ident = (
                identity(loaded, plan.key)
                if identity
                else (source.identity if source.identity is not None else plan.key)
            )
            before = counts.get(ident)
            drawn = _drawn(plan, samples)
            if drawn == 0:
                draw, unseen = Draw(np.zeros(0, dtype=np.int64), 0), None
            else:
                draw, unseen = source_draw(plan, lengths, drawn, seed, settings, before, continued)
            docs = draw.documents
            slice_lengths = lengths[plan.begin : plan.end]
            nonempty = slice_lengths > 0
            if before is None:
                old = np.zeros(len(docs), dtype=bool)
                seen = 0
            else:
                old = before[docs] > 0
                seen = int(np.count_nonzero((before[plan.begin : plan.end] > 0) & nonempty))
            rows.append(
                SourceDraws(
                    key=plan.key,
                    name=source.name,
                    samples=drawn,
                    documents=len(docs),
                    before=int(np.count_nonzero(old)),
                    before_tokens=int(lengths[docs[old]].sum(dtype=np.int64)),
                    samples_before=draw.before,
                    slice_documents=int(np.count_nonzero(nonempty)),
                    seen=seen,
                    unseen_samples=unseen,
                    epochs=int(plan.epochs or 0),
                )
            )
            trained.append((ident, docs, len(lengths)))
        # a phase's training counts for the next phases only (a source named twice in one
        # phase is two datasets of the same phase)
        for ident, _, sequences in trained:
            if ident not in counts:
                counts[ident] = np.zeros(sequences, dtype=np.int32)
        marked: dict[Identity, np.ndarray] = {}
        for ident, docs, _ in trained:
            marked[ident] = np.union1d(marked.get(ident, docs), docs)
        for ident, docs in marked.items():
            counts[ident][docs] += 1
        results.append(PhaseDraws(number, start, samples, seed, tuple(rows)))
    return results, counts
