"""What goes into a repack or a run: a blend and the facts of its sources
(:mod:`repack.inputs.facts`: each source's sequences, documents, tokens and dtype, read from its
``.idx`` or from a repack's index), read alike for the doctor, the phases' replay and the
loader's continuation.

(The blend files' reader and the sources' validation, ``repack.blend`` and ``repack.sources``,
join this package in the layout's next step: docs/architecture.md.)
"""
