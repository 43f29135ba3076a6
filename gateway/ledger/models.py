"""The ledger schema, defined once: SQLAlchemy tables that Alembic migrations create.

Every column an analyst filters on is typed; nothing of interest hides in JSON.
"""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Boolean, DateTime, Float, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class RequestRow(Base):
    """One row per request that reached the gateway (served, failed, closed or rejected)."""

    __tablename__ = "requests"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    api_key_id: Mapped[str | None] = mapped_column(String(64))
    team: Mapped[str | None] = mapped_column(String(128))
    endpoint: Mapped[str] = mapped_column(String(32), nullable=False, default="chat.completions")
    requested_model: Mapped[str] = mapped_column(String(256), nullable=False)
    route: Mapped[str | None] = mapped_column(String(256))
    backend: Mapped[str | None] = mapped_column(String(128))
    served_model: Mapped[str | None] = mapped_column(String(256))
    stream: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    cached_prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    input_cost_usd: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    output_cost_usd: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    cost_usd: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    cost_basis: Mapped[str | None] = mapped_column(String(32))  # api_price | gpu_amortized
    gpu_seconds: Mapped[float | None] = mapped_column(Float)
    counterfactual_cost_usd: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(32), nullable=False)  # ok | error | client_closed | rejected
    error_type: Mapped[str | None] = mapped_column(String(64))
    http_status: Mapped[int | None] = mapped_column(Integer)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    policy_version: Mapped[str | None] = mapped_column(String(64))
    price_table_version: Mapped[str | None] = mapped_column(String(64))
    difficulty: Mapped[float | None] = mapped_column(Float)
    threshold: Mapped[float | None] = mapped_column(Float)
    route_reason: Mapped[str | None] = mapped_column(String(64))
    prompt_text: Mapped[str | None] = mapped_column(Text)  # only when the policy opts in
    completion_text: Mapped[str | None] = mapped_column(Text)  # only when the policy opts in
    # Buy-versus-host attribution (migration 0003)
    device_hour_usd: Mapped[float | None] = mapped_column(Float)  # engine rows: hourly price, all devices
    device_kind: Mapped[str | None] = mapped_column(String(16))  # engine rows: gpu | cpu
    utilisation: Mapped[float | None] = mapped_column(Float)  # engine rows: busy fraction amortised at
    cost_note: Mapped[str | None] = mapped_column(String(64))  # why the cost is $0 or estimated
    cache_savings_usd: Mapped[float | None] = mapped_column(Float)  # API rows: what the cached rate saved
    # Stable chargeback (migration 0005): device-seconds at the list rate, whatever the utilisation
    busy_cost_usd: Mapped[float | None] = mapped_column(Float)  # engine rows: gpu_seconds × device_hour_usd / 3600
    # Engine fleets (migration 0006): the replica that served, its position in the backend's api_bases
    replica: Mapped[str | None] = mapped_column(String(128))
    # KV tiering (migration 0007): prompt tokens an engine restored from host memory / disk (also in cached_*)
    kv_restored_host_tokens: Mapped[int | None] = mapped_column(Integer)
    kv_restored_disk_tokens: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (
        Index("ix_requests_created_at", "created_at"),
        Index("ix_requests_team_created_at", "team", "created_at"),
        Index("ix_requests_backend_created_at", "backend", "created_at"),
        Index("ix_requests_api_key_id", "api_key_id"),
    )


class ApiKey(Base):
    """A client key. Only its SHA-256 hash is stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # public id, e.g. "key_3f9a…"
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    team: Mapped[str] = mapped_column(String(128), nullable=False)
    budget_usd: Mapped[float | None] = mapped_column(Float)
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)
    is_admin: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    revoked: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    # Key lifecycle (migration 0004)
    routes: Mapped[str | None] = mapped_column(Text)  # JSON array of allowed route names; NULL: every route
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    rotated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # secret last replaced
    updated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # limits or routes last changed


class ShadowEvalRow(Base):
    """One shadow evaluation: a served request mirrored to the other of easy/hard, both answers judged.

    Written only for routes with a `shadow:` setting, which is an explicit opt-in to storing prompts:
    `switchyard router retrain --from-ledger` trains the difficulty model on these rows.
    """

    __tablename__ = "shadow_evals"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)  # the request mirrored
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    route: Mapped[str] = mapped_column(String(256), nullable=False)
    endpoint: Mapped[str] = mapped_column(String(32), nullable=False)
    prompt_text: Mapped[str] = mapped_column(Text, nullable=False)  # flattened, for people
    messages_json: Mapped[str | None] = mapped_column(Text)  # chat: the messages as sent, for retraining
    easy_backend: Mapped[str] = mapped_column(String(128), nullable=False)
    hard_backend: Mapped[str] = mapped_column(String(128), nullable=False)
    served_backend: Mapped[str] = mapped_column(String(128), nullable=False)
    weak_answer: Mapped[str | None] = mapped_column(Text)
    strong_answer: Mapped[str | None] = mapped_column(Text)
    weak_correct: Mapped[bool] = mapped_column(Boolean, nullable=False)
    strong_correct: Mapped[bool] = mapped_column(Boolean, nullable=False)
    judge: Mapped[str] = mapped_column(String(128), nullable=False)  # exact | a backend name
    difficulty: Mapped[float | None] = mapped_column(Float)
    threshold: Mapped[float | None] = mapped_column(Float)
    model_version: Mapped[str | None] = mapped_column(String(64))
    policy_version: Mapped[str | None] = mapped_column(String(64))

    __table_args__ = (Index("ix_shadow_evals_route_created_at", "route", "created_at"),)


class EngineUptimeRow(Base):
    """One engine's measured up and busy seconds over one interval, written by the gateway's load monitor.

    Paid device time is up time (an engine is paid for while it runs, busy or not); busy time is the
    engine's own forward-pass counter. The difference is the cost of idle, which the reports show as its
    own line instead of hiding it in per-request prices.
    """

    __tablename__ = "engine_uptime"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    interval_id: Mapped[str] = mapped_column(String(200), unique=True, nullable=False)  # backend|start|instance
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)  # interval start
    backend: Mapped[str] = mapped_column(String(128), nullable=False)
    seconds: Mapped[float] = mapped_column(Float, nullable=False)
    busy_seconds: Mapped[float] = mapped_column(Float, nullable=False)
    device_hour_usd: Mapped[float] = mapped_column(Float, nullable=False)
    devices: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    device_kind: Mapped[str] = mapped_column(String(16), nullable=False, default="gpu")

    __table_args__ = (Index("ix_engine_uptime_backend_created_at", "backend", "created_at"),)


class PolicyVersionRow(Base):
    """The text of each policy version the gateway loaded, so reports price each ledger row by the policy
    that served it (`requests.policy_version`). Written once per version (insert-if-absent)."""

    __tablename__ = "policy_versions"

    version: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 of the text, 16 hex digits
    loaded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)  # first load seen
    source: Mapped[str | None] = mapped_column(String(1024))  # the file it was read from
    text: Mapped[str] = mapped_column(Text, nullable=False)
