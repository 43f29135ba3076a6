"""`switchyard engine …` subcommands. Imports torch only inside handlers."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="the in-house inference engine", description="The in-house inference engine.")
    p.add_subparsers(dest="engine_command", required=True)
