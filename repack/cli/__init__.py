"""The ``repack`` command line: one module per command family, thin over the library.

This package owns the commands and nothing the library does: each command parses its options,
calls one library function and prints the result (stdout, ``--json`` for machines), while
progress and notes go to stderr. :mod:`~repack.cli.app` holds the group, :mod:`~repack.cli.options`
the options several commands share (pip's ``cmdoptions`` pattern), :mod:`~repack.cli.exits`
the translation of every exception into one ``Error:`` line and an exit status,
:mod:`~repack.cli.output` the shared shapes of output; :mod:`~repack.cli.merging`,
:mod:`~repack.cli.editing`, :mod:`~repack.cli.reading`, :mod:`~repack.cli.diagnosis`,
:mod:`~repack.cli.tracing`, :mod:`~repack.cli.preparing` and :mod:`~repack.cli.benching` the
commands. Only :func:`main`, the console entry point
(``repack = "repack.cli:main"``), is exported here.
"""

from repack.cli.app import main

__all__ = ["main"]
