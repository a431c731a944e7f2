"""``python -m repack`` runs the command line."""

from repack.cli import main

main()
