"""Which policy prices `report capacity` and `report ladder`: `--policy FILE`, else the policy the gateway
stored in the ledger, else the default policy — and a label saying which.

From the ledger: the newest version in `policy_versions` (gateway/ledger/policy_versions.py: the gateway
stores each policy it loads), i.e. the policy the gateway runs now, which is what a plan for more capacity
is priced by (`report spreadsheet` prices past rows by the version that served each instead:
served_policy.py). A ledger that is missing, unmigrated or unreachable is not an error here: these reports plan
from benchmark figures, so they fall back to the default policy and say why. A SQLite ledger file that does
not exist is not opened (opening it would create an empty one in the user's directory). An installed wheel
ships no policies/ directory: with nothing stored and no --policy, the policy is None and a CPU benchmark is
priced at a stated rate (machine_price.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gateway import db
from gateway.policy import Policy, PolicyError, load_policy, parse_policy


class ReportPolicyError(ValueError):
    """A `--policy` file, or the default policy, that does not load."""


@dataclass(frozen=True, slots=True)
class ReportPolicy:
    policy: Policy | None  # None: no --policy, nothing stored and no default installed (a wheel ships none)
    label: str  # where it came from and why, for the output
    source: str  # "flag", "ledger", "default" or "none"
    name: str = ""  # short, for price bases: "policies/default.yaml", "stored policy version 1a2b…"


def _stored(url: str) -> tuple[Policy, str, str] | str:
    """(policy, version, label) of the newest stored policy that still validates, or why there is none."""
    import sqlalchemy as sa

    from gateway.db import redact_url
    from gateway.reports.figures import Ledger, ReportError

    where = redact_url(url)
    if db.sqlite_file_missing(url):
        return f"no ledger at {where}"
    try:
        ledger = Ledger.open(url)
    except ReportError as e:
        return str(e).split(" (run ")[0]
    skipped: list[str] = []
    try:
        with ledger, ledger.engine.connect() as conn:
            for version, text, source, loaded_at in conn.execute(sa.text(
                    "SELECT version, text, source, loaded_at FROM policy_versions ORDER BY loaded_at DESC")):
                try:
                    policy = parse_policy(text, f"stored policy version {version}")
                except PolicyError:
                    skipped.append(version)  # a text an older gateway accepted and this one does not
                    continue
                return policy, version, (
                    f"policy version {version}, the newest stored in the ledger at {where} (loaded {loaded_at} from "
                    f"{source or '?'}" + (f"; newer {', '.join(skipped)} no longer validate" if skipped else "") + ")")
    except sa.exc.SQLAlchemyError as e:
        return f"cannot read policy_versions at {where} ({type(e).__name__})"
    return f"no stored policy in the ledger at {where}" + (
        f" ({', '.join(skipped)} no longer validate)" if skipped else "")


def report_policy(policy_path: str | Path | None, database_url: str | None = None) -> ReportPolicy:
    """The policy a capacity or ladder report prices with, and its label."""
    from gateway import settings

    if policy_path:
        try:
            return ReportPolicy(load_policy(policy_path), f"{policy_path} (--policy)", "flag", str(policy_path))
        except PolicyError as e:
            raise ReportPolicyError(f"cannot load the policy: {str(e).splitlines()[0]}") from None
    found = _stored(settings.database_url(database_url))
    if not isinstance(found, str):
        return ReportPolicy(found[0], found[2], "ledger", f"stored policy version {found[1]}")
    default = settings.DEFAULT_POLICY
    if not Path(default).is_file():  # an installed wheel: policies/ lies in the checkout only
        return ReportPolicy(None, f"no policy: {found}, and no default policy at {default} (pass --policy FILE)",
                            "none", "no policy")
    try:
        policy = load_policy(default)
    except PolicyError as e:
        raise ReportPolicyError(f"no policy to price with: {found}, and the default policy {default} does not "
                                f"load ({str(e).splitlines()[0]}); pass --policy FILE") from None
    return ReportPolicy(policy, f"the default policy {default} ({found}; --policy FILE to choose another)",
                        "default", "the default policy")
