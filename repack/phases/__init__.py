"""Blend phases (Megatron-LM's ``--phase-transition-iterations``): what each phase trains on
again, and the opt-in continuation that has each phase draw every source's documents no
earlier phase trained on first.

Modules: :mod:`~repack.phases.schedule` (the phase schedule file),
:mod:`~repack.model.gpt_indices` (one dataset's indices, stock's and the continuation's, and the
documents its drawn samples train on; pure numpy), :mod:`~repack.phases.replay` (the phases
in order), :mod:`~repack.doctor.phase_report` (``repack doctor --phases``). The loader side is in
:mod:`repack.megatron` (``REPACK_PHASES``, ``REPACK_PHASE``).
"""

from __future__ import annotations

from repack.phases.schedule import Phase, Schedule, load_schedule

__all__ = ["Phase", "Schedule", "load_schedule"]
