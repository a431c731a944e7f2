"""``python -m repack.cli`` runs the command line, as the ``repack`` command does."""

from repack.cli import main

main()
