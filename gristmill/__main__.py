"""`python -m gristmill ARGS`: the `gristmill` command (gristmill/flows/cli.py), for where the console
script is not on PATH."""
import sys

from gristmill.flows.cli import console

sys.exit(console())
