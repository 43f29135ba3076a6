"""The `switchyard` command. Each package owns its subcommands; this file only wires them.

Handlers import their modules lazily so `switchyard --help` is fast and the gateway's
commands never import torch.
"""
from __future__ import annotations

import argparse
import sys

from gateway import settings


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the gateway (and any embedded engine)",
                       description="Run the OpenAI-compatible gateway.")
    p.add_argument("--policy", default=None, help="policy YAML (default: policies/default.yaml)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--database-url", default=None,
                   help="sqlite:///… or postgresql://… (env SWITCHYARD_DATABASE_URL; default SQLite under ./data/)")
    p.add_argument("--log-level", default="info")

    def run(args: argparse.Namespace) -> int:
        from gateway.serve import serve

        return serve(args)

    p.set_defaults(func=run)


def _add_keys(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="manage API keys", description="Manage client API keys.")
    ksub = p.add_subparsers(dest="keys_command", required=True)
    c = ksub.add_parser("create", help="create a key; prints it as the last line",
                        description="Create a client key. Only its hash is stored; the key is printed once.")
    c.add_argument("--team", required=True)
    c.add_argument("--budget-usd", type=float, default=None)
    c.add_argument("--rpm", type=int, default=None, help="requests per minute")
    c.add_argument("--tpm", type=int, default=None, help="tokens per minute")
    c.add_argument("--database-url", default=None)

    def run(args: argparse.Namespace) -> int:
        from gateway.keys import cli_create

        return cli_create(args)

    c.set_defaults(func=run)


def _add_policy(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("policy", help="work with policy files", description="Work with policy YAML files.")
    psub = p.add_subparsers(dest="policy_command", required=True)
    c = psub.add_parser("check", help="validate a policy file", description="Validate a policy YAML file.")
    c.add_argument("file")

    def run(args: argparse.Namespace) -> int:
        from gateway.policy import cli_check

        return cli_check(args)

    c.set_defaults(func=run)


def _add_db(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("db", help="ledger database", description="Manage the ledger database.")
    dsub = p.add_subparsers(dest="db_command", required=True)
    c = dsub.add_parser("upgrade", help="apply migrations", description="Apply Alembic migrations (to head).")
    c.add_argument("--database-url", default=None)

    def run(args: argparse.Namespace) -> int:
        from gateway.db import cli_upgrade

        return cli_upgrade(args)

    c.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description="Cost-aware model router and gateway.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_keys(sub)
    _add_policy(sub)
    _add_db(sub)
    # Other packages register their own groups; their modules import heavy deps lazily.
    from hosted.cli import register as register_engine
    from router.cli import register as register_router

    register_engine(sub)
    register_router(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    settings.load_dotenv_defaults()
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
