"""Process-wide settings read from the environment, with the project's defaults."""
from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_POLICY = PROJECT_ROOT / "policies" / "default.yaml"


def data_dir() -> Path:
    """Where SQLite files, the ledger spool and other local state live (./data by default)."""
    return Path(os.environ.get("SWITCHYARD_DATA_DIR", "data"))


def database_url(cli_value: str | None = None) -> str:
    """CLI flag, then SWITCHYARD_DATABASE_URL, then a SQLite file under ./data/."""
    if cli_value:
        return cli_value
    env = os.environ.get("SWITCHYARD_DATABASE_URL")
    if env:
        return env
    return f"sqlite:///{data_dir() / 'switchyard.db'}"


def redis_url(cli_value: str | None = None) -> str | None:
    """CLI flag, then SWITCHYARD_REDIS_URL; None: budgets and rate limits are this process's own. A URL that is
    not redis://, rediss:// or unix:// is a ValueError (one line)."""
    url = cli_value or os.environ.get("SWITCHYARD_REDIS_URL") or None
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"the Redis URL must start with redis://, rediss:// or unix://, not {url.split(':')[0]!r}")
    return url


def master_key() -> str | None:
    return os.environ.get("SWITCHYARD_MASTER_KEY") or None


DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # 8 MiB


def max_body_bytes() -> int:
    """The largest request body the gateway reads (SWITCHYARD_MAX_BODY_BYTES, default 8 MiB): larger is a 413."""
    raw = os.environ.get("SWITCHYARD_MAX_BODY_BYTES")
    if not raw:
        return DEFAULT_MAX_BODY_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"SWITCHYARD_MAX_BODY_BYTES must be a whole number of bytes, not {raw!r}") from None
    if value < 1:
        raise ValueError("SWITCHYARD_MAX_BODY_BYTES must be at least 1")
    return value
