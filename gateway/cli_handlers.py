"""The handlers of the gateway's own `switchyard` subcommands: read the parsed flags, call the domain
module, print, return the exit code. gateway/cli.py builds the parser and imports this lazily; each
handler imports what it needs lazily too, so one command does not pay for another's dependencies.
"""
from __future__ import annotations

import argparse
import sys


def policy_check(args: argparse.Namespace) -> int:
    """`switchyard policy check FILE`: print a summary and exit 0, or print every problem and exit 1."""
    from gateway.policy import PolicyError, load_policy
    from gateway.policy_warnings import policy_warnings

    try:
        policy = load_policy(args.file)
    except PolicyError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    print(f"OK: {len(policy.routes)} routes, {len(policy.backends)} backends, version {policy.version}")
    for warning in policy_warnings(policy):
        print(f"warning: {warning}")
    return 0


def db_upgrade(args: argparse.Namespace) -> int:
    """`switchyard db upgrade [--database-url URL]`."""
    from gateway import db, settings

    url = settings.database_url(getattr(args, "database_url", None))
    try:
        db.upgrade(url)
    except Exception as exc:  # noqa: BLE001 - report any failure as a clear CLI error
        print(f"switchyard db upgrade: failed on {db.redact_url(url)}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    print(f"database {db.redact_url(url)} is at revision {db.current_revision(url)} (head)")
    return 0


def router_retrain(args: argparse.Namespace) -> int:
    """`switchyard router retrain --from-ledger …`: the router's retrain on the ledger's shadow evaluations."""
    from gateway import settings
    from gateway.shadow_labels import load_shadow_set
    from router.cli import retrain_from
    from router.dataset import DataError

    if not args.from_ledger:
        raise DataError("retrain reads the gateway's shadow evaluations: pass --from-ledger")
    url = settings.database_url(args.database_url)
    return retrain_from(args, lambda: load_shadow_set(url, args.route))


def report_ladder(args: argparse.Namespace) -> int:
    """`switchyard report ladder`: the benchmark's rungs priced at the ledger's measured utilisation."""
    from gateway import db, settings
    from gateway.reports import ladder
    from gateway.reports.figures import Ledger, ReportError, Window, window_caveat

    measured = None
    if args.utilisation is None:
        try:
            window = Window.parse(args.since, args.until)
            url = settings.database_url(args.database_url)
            if db.sqlite_file_missing(url):  # opening it would leave an empty ledger file behind
                raise ReportError(f"no ledger at {db.redact_url(url)}")
            with Ledger.open(url) as ledger:
                engines = [e for e in ledger.engines(window)
                           if e.has_uptime and (args.backend is None or e.backend == args.backend)]
                short = window_caveat(ledger.summary(window)) if engines else None
            if short:  # the measured utilisation of part of a day
                print(f"note: {short}", file=sys.stderr)
        except ReportError as exc:
            print(f"note: no measured utilisation ({exc}); pricing at 100% only", file=sys.stderr)
            engines = []
        up = sum(e.up_seconds for e in engines)
        measured = sum(e.busy_seconds for e in engines) / up if up > 0 else None
    return ladder.run(args, measured_utilisation=measured)
