"""Which policy prices which ledger rows: the one that served them, or an explicit what-if.

Every ledger row records the version of the policy that served it, and the gateway stores each version's text
when it loads it (`policy_versions`, gateway/ledger/policy_versions.py). A report prices each row by its own
version's policy; `--policy FILE` replaces them all, and is then labelled a what-if everywhere the report
prints. Rows whose version has no stored text (served before the gateway stored policies, or a text that no
longer validates) are priced with the fallback (`--policy`, else the packaged default) and labelled so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from gateway.policy import Policy, PolicyError, load_policy, parse_policy


@dataclass(frozen=True, slots=True)
class VersionUse:
    """One policy version's share of the window."""

    version: str | None
    rows: int
    first: datetime | None
    last: datetime | None
    stored: bool  # its text is in policy_versions (and still validates)


@dataclass(slots=True)
class ServedPolicies:
    """version → the policy its rows are priced with; `latest` makes the window-wide choices (the reference
    API of all-API, the price of an engine with no rows): the newest version that served the window."""

    fallback: Policy
    fallback_source: str
    policies: dict[str | None, Policy] = field(default_factory=dict)
    uses: list[VersionUse] = field(default_factory=list)
    what_if: bool = False
    problems: list[str] = field(default_factory=list)  # stored texts that could not be used, and why

    @classmethod
    def single(cls, policy: Policy, *, what_if: bool = False) -> ServedPolicies:
        """Every row priced with `policy` (the dashboard prices with the live policy)."""
        return cls(policy, policy.source or "the live policy", what_if=what_if)

    def for_version(self, version: str | None) -> Policy:
        return self.fallback if self.what_if else self.policies.get(version, self.fallback)

    @property
    def latest(self) -> Policy:
        if not self.what_if:
            for use in reversed(self.uses):
                if use.version in self.policies:
                    return self.policies[use.version]
        return self.fallback

    @property
    def served_versions(self) -> list[VersionUse]:
        return [u for u in self.uses if u.version]

    @property
    def spans_several(self) -> bool:
        return len(self.served_versions) > 1

    @property
    def fallback_rows(self) -> int:
        """Rows priced with the fallback for want of their own policy (0 in a what-if: all are, on purpose)."""
        return 0 if self.what_if else sum(u.rows for u in self.uses if u.version not in self.policies)

    def label(self) -> str:
        """One line: which policy priced the report."""
        if self.what_if:
            return (f"WHAT-IF: every row priced with {self.fallback_source} (version {self.fallback.version}), "
                    "not with the policies that served them")
        stored = [u for u in self.served_versions if u.stored]
        if not stored:
            return (f"no stored policy for the window's rows: priced with {self.fallback_source} "
                    f"(version {self.fallback.version}) as a fallback")
        if len(stored) == 1 and not self.spans_several:
            return f"the policy that served the rows (version {stored[0].version})"
        return f"each row by the policy version that served it ({len(self.served_versions)} versions in the window)"

    def lines(self) -> list[str]:
        """Every label a report prints about its prices: the source, the versions, the fallbacks."""
        out = [f"prices: {self.label()}"]
        if self.spans_several:
            for u in self.served_versions:
                how = "" if u.stored or self.what_if else f" (no stored text: priced with {self.fallback_source})"
                out.append(f"  policy version {u.version}: {u.rows:,} rows, {_t(u.first)} to {_t(u.last)}{how}")
        if self.what_if and self.served_versions:
            served = ", ".join(u.version or "" for u in self.served_versions)
            out.append(f"  (the rows were served by policy version{'s' if self.spans_several else ''} {served})")
        elif self.fallback_rows and self.served_versions and not self.spans_several:
            out.append(f"  {self.fallback_rows:,} rows have no stored policy text: priced with "
                       f"{self.fallback_source} (version {self.fallback.version})")
        # (fallback rows with no served version at all: label() already names the fallback)
        unversioned = sum(u.rows for u in self.uses if not u.version)
        if unversioned and not self.what_if:
            out.append(f"  {unversioned:,} rows record no policy version (rejected before routing): priced with "
                       f"{self.fallback_source}")
        out += [f"  {p}" for p in self.problems]
        return out


def _t(value: datetime | None) -> str:
    return f"{value:%Y-%m-%d %H:%M}" if value else "?"


def resolve(ledger, window, what_if: str | Path | None, default: str | Path) -> ServedPolicies:
    """The policies a report prices with: the stored versions that served `window`, or `what_if` for all.

    Raises PolicyError only for a `what_if` file that does not load, or a default that is needed (a row
    without its own policy) and does not load."""
    uses_raw = ledger.policy_versions(window)
    if what_if is not None:
        policy = load_policy(what_if)
        uses = [VersionUse(u["version"], u["rows"], u["first"], u["last"], False) for u in uses_raw]
        return ServedPolicies(policy, str(what_if), uses=uses, what_if=True)
    texts = ledger.policy_texts([u["version"] for u in uses_raw if u["version"]])
    policies: dict[str | None, Policy] = {}
    problems: list[str] = []
    for version, (text, source) in texts.items():
        try:
            policies[version] = parse_policy(text, f"stored policy version {version} (from {source or '?'})")
        except PolicyError as e:
            first = str(e).splitlines()[0] if str(e) else "invalid"
            problems.append(f"stored policy version {version} no longer validates ({first}): its rows are priced "
                            "with the fallback")
    uses = [VersionUse(u["version"], u["rows"], u["first"], u["last"], u["version"] in policies) for u in uses_raw]
    try:
        fallback, source = load_policy(default), str(default)
    except PolicyError:
        if not policies or any(u.version not in policies for u in uses):
            raise  # some rows need it
        newest = next(u.version for u in reversed(uses) if u.version in policies)
        fallback, source = policies[newest], f"stored policy version {newest}"
    return ServedPolicies(fallback, source, policies, uses, problems=problems)
