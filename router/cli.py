"""`switchyard router …` subcommands."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="the difficulty router", description="Train, evaluate and calibrate the router.")
    p.add_subparsers(dest="router_command", required=True)
