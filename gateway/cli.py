"""The `switchyard` command. Each package owns its subcommands; this file only wires them.

The gateway's own handlers live in gateway/cli_handlers.py and are imported only when their command
runs, so `switchyard --help` is fast and the gateway's commands never import torch. The router's group
gets what it needs of the gateway by injection (router/ never imports the gateway): the policy writer
behind `router calibrate --write`, and `router retrain`, added here because it reads the ledger.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from gateway import listen_address


def _lazy(module: str, name: str) -> Callable:
    """`module.name`, imported when first called rather than when the parser is built."""
    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return call


def _command(sub: argparse._SubParsersAction, group: str, command: str, handler: str, *, group_help: str,
             group_description: str, help: str, description: str) -> argparse.ArgumentParser:
    """`switchyard GROUP COMMAND`, run by gateway.cli_handlers.HANDLER; returns the command's parser."""
    p = sub.add_parser(group, help=group_help, description=group_description)
    gsub = p.add_subparsers(dest=f"{group}_command", required=True)
    c = gsub.add_parser(command, help=help, description=description)
    c.set_defaults(func=_lazy("gateway.cli_handlers", handler))
    return c


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the gateway (and any embedded engine)",
                       description="Run the OpenAI-compatible gateway.")
    p.add_argument("--policy", default=None, help="policy YAML (default: policies/default.yaml)")
    p.add_argument("--host", default="127.0.0.1", type=listen_address.host_arg,
                   help="address to listen on: an IP (0.0.0.0 for every interface) or a hostname")
    p.add_argument("--port", type=listen_address.port_arg, default=8000, help="1-65535 (default 8000)")
    p.add_argument("--database-url", default=None,
                   help="sqlite:///… or postgresql://… (env SWITCHYARD_DATABASE_URL; default SQLite under ./data/)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="redis://… shared by every gateway replica: one budget and one RPM/TPM window per key "
                        "across them (env SWITCHYARD_REDIS_URL; default: this process's own)")
    p.add_argument("--workers", type=_workers_arg, default=1, metavar="N",
                   help="gateway processes on this port (default 1); N>1 needs --redis-url")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_lazy("gateway.serve", "serve"))


def _workers_arg(text: str) -> int:
    try:
        workers = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 64, not {text!r}") from None
    if not 1 <= workers <= 64:
        raise argparse.ArgumentTypeError(f"must be from 1 to 64, not {workers}")
    return workers


def _add_keys(sub: argparse._SubParsersAction) -> None:
    """`switchyard keys create | list | update | rotate | revoke` (handlers: gateway/keys_cli.py)."""
    p = sub.add_parser("keys", help="manage API keys",
                       description="Manage client API keys: only hashes are stored; a key is named by its id "
                                   "(key_…) or its plaintext. Gateways on the database apply changes within ~1 s.")
    ksub = p.add_subparsers(dest="keys_command", required=True)

    def command(name: str, help: str, description: str, *, key_arg: bool = False) -> argparse.ArgumentParser:
        c = ksub.add_parser(name, help=help, description=description)
        if key_arg:
            c.add_argument("key", metavar="KEY_OR_ID", help="the key's id (key_…) or the key itself")
        c.add_argument("--database-url", default=None,
                       help="(default: $SWITCHYARD_DATABASE_URL, else sqlite:///data/switchyard.db)")
        if key_arg:  # a change to a live key: announced to the gateway replicas sharing this Redis
            c.add_argument("--redis-url", default=None, metavar="URL",
                           help="the gateways' shared Redis: every replica drops the key's cached entry at once "
                                "(default: $SWITCHYARD_REDIS_URL; without it they reread it within ~1 s)")
        c.set_defaults(func=_lazy("gateway.keys_cli", f"keys_{name}"))
        return c

    def limits(c: argparse.ArgumentParser, clear: str) -> None:
        c.add_argument("--budget-usd", default=None, metavar="X", help=f"spend limit in USD, above 0{clear}")
        c.add_argument("--rpm", default=None, metavar="N", help=f"requests per minute{clear}")
        c.add_argument("--tpm", default=None, metavar="N", help=f"tokens per minute{clear}")

    c = command("create", "create a key; prints it as the last line",
                "Create a client key. Only its hash is stored; the key is printed once.")
    c.add_argument("--team", required=True)
    limits(c, "")
    c.add_argument("--routes", default=None, metavar="R,…", help="the only routes the key may use (default: all)")
    c.add_argument("--admin", action="store_true", help="an admin key (the /admin API and the dashboard)")
    c = command("list", "list keys (never hashes or plaintexts)",
                "List keys: id, team, budget, rpm, tpm, routes, admin, revoked, created.")
    c.add_argument("--all", action="store_true", help="include revoked keys")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c = command("update", "change a key's limits or routes",
                "Change a live key's limits or allowed routes; the others stay as they are.", key_arg=True)
    limits(c, "; 'none' removes the limit")
    routes = c.add_mutually_exclusive_group()
    routes.add_argument("--routes", default=None, metavar="R,…", help="the only routes the key may use")
    routes.add_argument("--all-routes", action="store_true", help="let the key use every route")
    command("rotate", "give a key a new secret; prints it as the last line",
            "Replace a live key's secret: same id, settings, spend and budget; the old secret stops working.",
            key_arg=True)
    command("revoke", "revoke a key", "Revoke a key: every gateway on the database refuses it within ~1 s.",
            key_arg=True)


def _add_policy(sub: argparse._SubParsersAction) -> None:
    c = _command(sub, "policy", "check", "policy_check", group_help="work with policy files",
                 group_description="Work with policy YAML files.", help="validate a policy file",
                 description="Validate a policy YAML file.")
    c.add_argument("file")


def _add_db(sub: argparse._SubParsersAction) -> None:
    c = _command(sub, "db", "upgrade", "db_upgrade", group_help="ledger database",
                 group_description="Manage the ledger database.", help="apply migrations",
                 description="Apply Alembic migrations (to head).")
    c.add_argument("--database-url", default=None)


def _add_router(sub: argparse._SubParsersAction) -> None:
    from router.cli import guard, register
    from router.retrain import DEFAULT_MIN_ROWS

    rsub = register(sub, policy_writer=_lazy("gateway.policy_edit", "write_route"))
    # Learning from the gateway's shadow evaluations: the labelled set comes from the ledger.
    r = rsub.add_parser("retrain", help="retrain on the gateway's shadow evaluations; keep the better model",
                        description="Train a new difficulty model on the shadow_evals table, compare it with the "
                                    "current one on a stratified held-out part (APGR, CPT(50%)), and replace "
                                    "the current model file (or write --out) only if the new one is better.")
    r.add_argument("--from-ledger", action="store_true", help="read labels from the ledger's shadow_evals table")
    r.add_argument("--database-url", default=None,
                   help="ledger database (default: $SWITCHYARD_DATABASE_URL, else sqlite:///data/switchyard.db)")
    r.add_argument("--route", default=None, help="only this route's rows (default: all)")
    r.add_argument("--model", default=None, metavar="CURRENT",
                   help="the current model file, replaced if the new model is better (default: the default model)")
    r.add_argument("--out", default=None, metavar="PATH", help="write the better model here instead")
    r.add_argument("--min-rows", type=int, default=DEFAULT_MIN_ROWS,
                   help=f"refuse with fewer labelled rows (default {DEFAULT_MIN_ROWS})")
    r.add_argument("--holdout", type=float, default=0.3, help="share held out for the comparison (default 0.3)")
    r.add_argument("--min-gain", type=float, default=0.0, help="APGR the new model must gain to replace (default 0)")
    r.add_argument("--seed", type=int, default=0, help="seed of the held-out split (default 0)")
    r.set_defaults(func=guard(_lazy("gateway.cli_handlers", "router_retrain")))


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="buy-versus-host reports from the ledger",
                       description="Buy versus host: the workbook, capacity planning and the optimisation ladder.")
    rsub = p.add_subparsers(dest="report_command", required=True)

    def window(c: argparse.ArgumentParser) -> None:
        c.add_argument("--since", default=None, metavar="DATE", help="first day (UTC, inclusive; or ISO time)")
        c.add_argument("--until", default=None, metavar="DATE", help="last day (UTC, inclusive; or ISO time)")
        c.add_argument("--database-url", default=None,
                       help="ledger database (default: $SWITCHYARD_DATABASE_URL, else sqlite:///data/switchyard.db)")
        c.add_argument("--policy", default=None,
                       help="policy YAML for prices. spreadsheet: a labelled what-if (default: each row by the policy "
                            "version that served it, as the gateway stored it); capacity, ladder: the engine's price "
                            "(default: the newest policy stored in the ledger, else policies/default.yaml)")

    c = rsub.add_parser("spreadsheet", help="write the buy-versus-host workbook (or CSV files)",
                        description="Build a workbook with live formulas from the ledger: Traffic, Prices, "
                                    "In-house, Decision and Ladder sheets.")
    c.add_argument("--out", required=True, metavar="FILE", help="FILE.xlsx (or a directory with --format csv)")
    c.add_argument("--format", choices=("xlsx", "csv"), default="xlsx")
    c.add_argument("--team", default=None, help="only this team's requests (engine time allocated by its share)")
    window(c)
    c.add_argument("--bench", default=None, metavar="FILE",
                   help="engine benchmark JSON for the Ladder sheet (default: bench/results/cheaper_model.json)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(func=_lazy("gateway.reports.workbook", "run"))

    c = rsub.add_parser("capacity", help="devices needed for a token rate (Little's Law in tokens)",
                        description="Plan capacity in tokens per second from measured engine throughput curves, "
                                    "with the roofline floor for decode on common accelerators.")
    target = c.add_mutually_exclusive_group(required=True)
    target.add_argument("--target-tokens-per-s", type=float, default=None, metavar="N",
                        help="output tokens per second to serve")
    target.add_argument("--from-ledger", action="store_true", help="the ledger's busiest hour's token rate")
    c.add_argument("--p95-ttft-ms", type=float, default=None, metavar="T",
                   help="time-to-first-token p95 target (default 2000 ms, interactive chat)")
    c.add_argument("--target-utilisation", type=float, default=0.6, metavar="U",
                   help="busy fraction to plan devices at (default 0.6)")
    c.add_argument("--curve", default=None, metavar="FILE",
                   help="throughput curve JSON (default: the packaged copy of bench/results/engine_curve.json)")
    c.add_argument("--backend", default=None, help="engine backend whose price to use (default: the first)")
    c.add_argument("--device-hour-usd", type=float, default=None, metavar="USD",
                   help="hourly price of one device of the machine the curve was measured on (default: from the "
                        "policy: cpu_hour_usd for a CPU curve, gpu_hour_usd for a GPU curve)")
    c.add_argument("--json", action="store_true", help="print JSON instead of tables")
    window(c)
    c.set_defaults(func=_lazy("gateway.reports.capacity", "run"))

    c = rsub.add_parser("ladder", help="$/Mtok at each optimisation that stacks",
                        description="One request at a time → continuous batching → prefix cache → quantization "
                                    "→ speculative decoding: $/Mtok at each rung, from the engine benchmarks.")
    c.add_argument("--bench", default=None, metavar="FILE",
                   help="engine benchmark JSON with a stack section (default: the packaged copy of "
                        "bench/results/cheaper_model.json)")
    c.add_argument("--backend", default=None, help="engine backend whose price to use (default: the first)")
    c.add_argument("--device-hour-usd", type=float, default=None, metavar="USD",
                   help="hourly price of the machine the benchmark ran on (default: from the policy: "
                        "cpu_hour_usd for a CPU benchmark, gpu_hour_usd for a GPU one)")
    c.add_argument("--utilisation", type=float, default=None, metavar="U",
                   help="utilisation to price at (default: measured from the ledger)")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    window(c)
    c.set_defaults(func=_lazy("gateway.cli_handlers", "report_ladder"))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for `argv` (default sys.argv[1:]). The engine's group is built only when the command is
    `switchyard engine …`: hosted's parsers import torch (distill's divergences), and the gateway never does,
    so `switchyard keys …` runs on a gateway-only install and does not pay ~2 CPU-s for torch."""
    parser = argparse.ArgumentParser(prog="switchyard", description="Cost-aware model router and gateway.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_keys(sub)
    _add_policy(sub)
    _add_db(sub)
    _add_report(sub)
    _add_engine(sub, _command_word(sys.argv[1:] if argv is None else argv) == "engine")
    _add_router(sub)
    return parser


_ENGINE_HELP = "the in-house inference engine"


def _command_word(argv: list[str]) -> str | None:
    """The subcommand named in `argv` (its first word that is not an option)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _add_engine(sub: argparse._SubParsersAction, full: bool) -> None:
    """`switchyard engine …` from hosted/cli.py when it is the command; otherwise a placeholder (listed in
    `switchyard --help`) so that building the parser imports nothing of hosted/."""
    if full:
        from hosted.cli import register as register_engine

        register_engine(sub)
    else:
        sub.add_parser("engine", help=_ENGINE_HELP, description=_ENGINE_HELP, add_help=False)


def engine_serve_parser() -> argparse.ArgumentParser:
    """`switchyard engine serve`'s own parser (hosted/engine_args.py: argparse only, no torch): the command embedded
    engines run, which gateway/engine_args.py checks a policy's `engine_args` against (this module dispatches
    `engine …`, so it is the gateway's one way to the engine's command line)."""
    from hosted.engine_args import serve_parser

    return serve_parser()


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
