"""Every policy version the gateway loads is stored with its text (`policy_versions`), so the reports price
each ledger row by the policy that served it rather than whatever file is on disk when the report runs.

The row goes through the ledger's own writer machinery (queue, batches, spool file, replay), so a database
that is down when a policy loads delays the row, never the load: it lands once the database is back.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from datetime import UTC, datetime
from pathlib import Path

from gateway.ledger.models import PolicyVersionRow
from gateway.ledger.record import PolicyVersionRecord
from gateway.ledger.writer import LedgerWriter

log = logging.getLogger("switchyard.policy")

_MAX_TEXT_BYTES = 1 << 20  # the policy loader's own limit (gateway/policy_diagnostics.py)


class PolicyVersionWriter(LedgerWriter):
    """The ledger writer's queue, spool and replay, writing `policy_versions` (insert-if-absent by version)."""

    table = PolicyVersionRow.__table__
    record_type = PolicyVersionRecord
    key_column = "version"

    def __init__(self, database_url: str, spool_path: Path, **kwargs) -> None:
        super().__init__(database_url, spool_path, **kwargs)
        self._seen: set[str] = set()

    async def record(self, policy) -> bool:
        """Queue the live policy's text once per version; False when its text cannot be had (see policy_text)."""
        if not policy.version or policy.version in self._seen:
            return policy.version in self._seen
        text = await asyncio.to_thread(policy_text, policy)
        if text is None:
            log.warning("policy version %s: %s changed before its text was stored; reports will price its rows "
                        "with a fallback policy", policy.version, policy.source)
            return False
        self._seen.add(policy.version)
        self.submit(PolicyVersionRecord(policy.version, datetime.now(UTC), text, policy.source or None))
        return True


def policy_text(policy) -> str | None:
    """The text whose hash is `policy.version`, read back from `policy.source`; None if the file has changed
    since (the next version that loads is stored instead) or cannot be read."""
    try:
        with open(policy.source, "rb") as f:
            data = f.read(_MAX_TEXT_BYTES + 1)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError, TypeError):
        return None
    return text if version_of(text) == policy.version else None


def version_of(text: str) -> str:
    """The policy version of a text: what gateway/policy.py's parse_policy computes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
