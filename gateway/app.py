"""The Starlette application: routes, and the lifespan that owns every long-lived part."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import (
    admin_keys,
    dashboard,
    db,
    errors,
    metrics,
    model_cards,
    openapi,
    pricing,
    proxy,
    settings,
    stage_profile,
)
from gateway import health as backend_health
from gateway.auth import Authenticator
from gateway.backend_pool import BackendPool
from gateway.backends.resilience import BreakerRegistry
from gateway.budgets import BudgetBook
from gateway.embedded import EmbeddedEngines
from gateway.engine_load import EngineLoadMonitor
from gateway.hot_path import HotPathApp
from gateway.http_edge import RECORD_KEY, RequestIdMiddleware
from gateway.ledger.models import RequestRow
from gateway.ledger.policy_versions import PolicyVersionWriter
from gateway.ledger.record import ENDPOINT_NAMES, LedgerRecord
from gateway.ledger.writer import LedgerWriter, ShadowEvalWriter, UptimeWriter
from gateway.migrate_later import migrate_when_reachable
from gateway.policy import Policy
from gateway.policy_store import PolicyStore
from gateway.ratelimit import RateLimiter
from gateway.routing import RoutingRuntime
from gateway.shadow.runner import ShadowRunner
from gateway.shared_policy import SharedPolicy
from gateway.shared_state import SharedBudgetBook, SharedRateLimiter, SharedState
from gateway.stage_profile import StageProfileMiddleware
from gateway.tasks import cancel_and_wait
from gateway.uptime import UptimeRecorder
from openai_wire import APIError
from openai_wire.responses import error_response

log = logging.getLogger("switchyard.gateway")


@dataclass(slots=True)
class GatewayConfig:
    policy_path: Path
    database_url: str
    data_dir: Path
    master_key: str | None = None
    wait_for_engines_s: float = 120.0  # at start, how long to wait for embedded engines to be healthy
    # serve found the database unreachable: migrate it in the background once it answers (gateway/migrate_later.py)
    migrate_when_reachable: bool = False
    # ... and once it is migrated, run this (serve: make the first admin key that start-up could not)
    on_database_ready: Callable[[], Awaitable[None]] | None = None
    banner: str | None = None  # printed once startup is complete (the first-start key and snippet)
    # Larger request bodies get a 413 before they are parsed (env SWITCHYARD_MAX_BODY_BYTES; default 8 MiB).
    max_body_bytes: int = field(default_factory=settings.max_body_bytes)
    # Replicas share budgets and RPM/TPM windows through this Redis (gateway/shared_state.py); None: this process's own
    redis_url: str | None = None


@dataclass(slots=True)
class Gateway:
    """Every long-lived part, built once in the lifespan (`app.state.gw`): the request path's `services`
    (all the request path gets) and what only the app itself uses."""

    config: GatewayConfig
    db_engine: AsyncEngine
    embedded: EmbeddedEngines
    routing: RoutingRuntime  # difficulty models and engine load (services hold both for the request path)
    services: proxy.Services
    uptime_writer: UptimeWriter  # engine_uptime rows (the recorder inside routing.load feeds it)
    policy_versions: PolicyVersionWriter | None = None  # each loaded policy's text, for the reports
    shared_state: SharedState | None = None  # with --redis-url: the replicas' shared budgets and limits
    started_at: float = field(default_factory=time.time)


async def _spent_by_key(engine: AsyncEngine, key_id: str) -> float:
    async with engine.connect() as conn:
        result = await conn.execute(
            select(func.coalesce(func.sum(RequestRow.cost_usd), 0.0)).where(RequestRow.api_key_id == key_id))
        return float(result.scalar_one())


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette):
    config: GatewayConfig = app.state.config
    gw = await _start(config)
    app.state.gw = gw
    app.state.services = gw.services
    migrator = asyncio.create_task(migrate_when_reachable(config.database_url, then=config.on_database_ready),
                                   name="migrate-later") \
        if config.migrate_when_reachable else None
    # Serve at once: API routes answer while embedded engines start (their routes fall back, or answer 503 with
    # Retry-After, until each is healthy); the banner waits for them, so its snippet works when pasted.
    announcer = asyncio.create_task(_announce_when_ready(app, gw), name="engines-ready")
    app.state.startup_wait = announcer
    lag_watcher = asyncio.create_task(metrics.watch_loop_lag())
    try:
        yield
    finally:
        await cancel_and_wait(announcer)
        await cancel_and_wait(lag_watcher)
        await cancel_and_wait(migrator)
        # uvicorn has stopped accepting and drained in-flight requests: flush everything they logged.
        await _stop(gw)
        dashboard.close(app)


def interrupt_startup(app: Starlette) -> None:
    """A shutdown signal arrived (serve's signal handler calls this): stop waiting for embedded engines, so the
    banner is not printed by a gateway that is stopping (uvicorn itself already serves, and stops as usual)."""
    app.state.startup_interrupted = True
    waiting: asyncio.Task | None = getattr(app.state, "startup_wait", None)
    if waiting is not None and not waiting.done():
        waiting.get_loop().call_soon_threadsafe(waiting.cancel)  # safe from a signal handler


async def _announce_when_ready(app: Starlette, gw: Gateway) -> None:
    """Wait (bounded) for embedded engines to be healthy, then print the banner; the gateway serves meanwhile."""
    embedded, banner = gw.embedded, gw.config.banner
    if embedded.processes():
        log.info("serving; embedded engines starting: %s (their routes fall back, or answer 503 with Retry-After, "
                 "until each is healthy)", ", ".join(embedded.processes()))
        ready = await embedded.wait_ready(gw.config.wait_for_engines_s)
        for name, ok in ready.items():
            if not ok:
                log.error("embedded engine %s is not healthy after %.0f s; its routes use fallbacks (or answer 503) "
                          "until it is: see its last exit in /health and the log", name, gw.config.wait_for_engines_s)
    if banner and not getattr(app.state, "startup_interrupted", False):
        print(banner, flush=True)


async def _start(config: GatewayConfig) -> Gateway:
    """Build every part and apply the live policy (embedded engines start; the gateway serves meanwhile). Nothing
    here needs the database: writers connect lazily and spool, the key cache answers 503 for keys it cannot
    check."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    # The price map loads with litellm (seconds): do it now, never on a request's first accounting.
    await asyncio.to_thread(pricing.price_table_version)
    db_engine = db.create_engine(config.database_url)
    writer = LedgerWriter(config.database_url, config.data_dir / "ledger-spool.jsonl")
    await writer.start()
    policy_store = PolicyStore(config.policy_path)
    await policy_store.start()
    embedded = EmbeddedEngines(config.data_dir / "logs")
    pool = BackendPool(embedded)
    uptime_writer = UptimeWriter(config.database_url, config.data_dir / "uptime-spool.jsonl")
    await uptime_writer.start()
    policy_versions = PolicyVersionWriter(config.database_url, config.data_dir / "policy-versions-spool.jsonl")
    await policy_versions.start()
    breakers, limiter = BreakerRegistry(), RateLimiter()
    routing = RoutingRuntime(load=EngineLoadMonitor(uptime=UptimeRecorder(uptime_writer.submit)))
    auth = Authenticator(db_engine, config.master_key)
    budgets = BudgetBook(lambda key_id: _spent_by_key(db_engine, key_id))
    shared_state = None
    if config.redis_url:
        shared_state = SharedState(config.redis_url, lambda key_id: _spent_by_key(db_engine, key_id))
        await shared_state.start()
        limiter, budgets = SharedRateLimiter(shared_state), SharedBudgetBook(shared_state)
        shared_state.on_key_change(auth.forget)  # another replica revoked, updated or rotated it
    shadow = ShadowRunner(pool, breakers, writer,
                          ShadowEvalWriter(config.database_url, config.data_dir / "shadow-spool.jsonl"))
    await shadow.start()
    services = proxy.Services(auth=auth, policy_store=policy_store, models=routing.models, load=routing.load,
                              limiter=limiter, budgets=budgets, pool=pool, breakers=breakers, ledger=writer,
                              shadow=shadow, max_body_bytes=config.max_body_bytes)
    gw = Gateway(config=config, db_engine=db_engine, embedded=embedded, routing=routing, services=services,
                 uptime_writer=uptime_writer, policy_versions=policy_versions, shared_state=shared_state)
    await _apply_policy(gw, policy_store.current)

    async def on_change(policy: Policy) -> None:
        await _apply_policy(gw, policy)

    policy_store.on_change(on_change)
    if shared_state is not None:
        await SharedPolicy(shared_state, policy_store).start()  # one live policy for every replica
    return gw


async def _stop(gw: Gateway) -> None:
    """Release every part within _STOP_S whatever is broken (a database that never answers, a spool that cannot be
    written, an engine that ignores SIGTERM): the parts that wait on something close at once, each bounded by
    what is left of one deadline. What a writer could not write is spooled (replayed at the next start), or
    counted and logged as lost."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _STOP_S
    services = gw.services
    await services.policy_store.stop()
    shadow_closed: asyncio.Future | None = None
    if services.shadow is not None:
        # Its queued jobs use the pool and the ledger writer: they get a short drain before those close; its
        # own writer then closes (bounded) beside the others.
        services.shadow.drain_timeout_s = min(services.shadow.drain_timeout_s, _SHADOW_DRAIN_S)
        shadow_closed = asyncio.ensure_future(services.shadow.aclose())
        await asyncio.wait({shadow_closed}, timeout=_SHADOW_DRAIN_S)
    await gw.routing.aclose()  # queues each engine's open uptime interval
    await services.auth.aclose()
    if gw.shared_state is not None:
        await gw.shared_state.aclose()  # its settles still queued go to Redis (bounded), it leaves the replica set
    writers_s = max(1.0, deadline - loop.time() - _AFTER_WRITERS_S)
    writers = [services.ledger, gw.uptime_writer, *([gw.policy_versions] if gw.policy_versions else [])]
    closing = [services.pool.aclose(), *(writer.close(timeout_s=writers_s) for writer in writers),
               *([shadow_closed] if shadow_closed is not None else [])]
    for result in await asyncio.gather(*closing, return_exceptions=True):
        if isinstance(result, BaseException):
            log.error("shutdown: closing a part failed: %s", result, exc_info=result)
    with contextlib.suppress(Exception, TimeoutError):
        await asyncio.wait_for(gw.db_engine.dispose(), max(0.5, deadline - loop.time()))


_STOP_S = 12.0  # after uvicorn's drain of in-flight requests (serve.py's DRAIN_S): 12 + 12 s < 30 s in every state
_SHADOW_DRAIN_S = 3.0
_AFTER_WRITERS_S = 2.5  # what a writer's close takes past its timeout (spooling, disposing), then our dispose


async def _apply_policy(gw: Gateway, policy: Policy) -> None:
    if gw.policy_versions is not None and gw.services.policy_store.origin == "file":
        # its text, so reports price its rows by it (spooled if the DB is down); one adopted from another replica
        # was stored by that replica
        await gw.policy_versions.record(policy)
    await gw.services.pool.sync(policy)
    await gw.routing.apply(policy, gw.services.pool)  # loads (or trains) difficulty models in a thread, off requests
    metrics.POLICY_INFO.clear()
    metrics.POLICY_INFO.labels(policy.version).set(1)
    log.info("policy %s live: %d routes, %d backends", policy.version, len(policy.routes), len(policy.backends))


async def chat_completions(request: Request) -> Response:
    return await proxy.handle(request.app.state.services, request, "chat")


async def completions(request: Request) -> Response:
    return await proxy.handle(request.app.state.services, request, "completions")


async def embeddings(request: Request) -> Response:
    return await proxy.handle(request.app.state.services, request, "embeddings")


async def responses(request: Request) -> Response:
    return await proxy.handle(request.app.state.services, request, "responses")


async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gw
    key = await gw.services.auth.authenticate(request.headers.get("authorization"))
    created, policy = int(gw.started_at), gw.services.policy_store.current
    data = [model_cards.entry(name, route, policy, created)
            for name, route in policy.routes.items() if key.allows(name)]  # a key lists what it may use
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


async def retrieve_model(request: Request) -> Response:
    """`client.models.retrieve(ID)`: a route of the live policy as an OpenAI model object, or 404."""
    gw: Gateway = request.app.state.gw
    key = await gw.services.auth.authenticate(request.headers.get("authorization"))
    name = request.path_params["model"]
    routes = [route for route in gw.services.policy_store.current.routes if key.allows(route)]
    if name not in routes:
        raise errors.model_not_found(name, routes)
    policy = gw.services.policy_store.current
    body = model_cards.entry(name, policy.routes[name], policy, int(gw.started_at))
    return Response(orjson.dumps(body), media_type="application/json")


def _backend_states(gw: Gateway) -> dict[str, str]:
    services = gw.services
    return backend_health.backend_states(services.policy_store.current, services.breakers, services.load,
                                         gw.embedded)


def _announcing(route: Route) -> Route:
    """An admin route that changes a key (PATCH, DELETE, rotate), wrapped so that, once it succeeded, every replica
    sharing this Redis drops the key from its cache at once (gateway/shared_state.py). Other routes as they are."""
    if "key_id" not in route.param_convertors or route.methods & {"PATCH", "DELETE", "POST"} == set():
        return route
    handler = route.endpoint

    async def announced(request: Request) -> Response:
        response = await handler(request)
        shared = request.app.state.gw.shared_state
        if shared is not None and response.status_code < 300:
            await shared.announce_key_change(request.path_params["key_id"])
        return response

    return Route(route.path, announced, methods=[m for m in route.methods if m != "HEAD"], name=route.name)


async def health(request: Request) -> Response:
    """Always 200 while the gateway serves (load balancers decide); `status` is `degraded` when some route
    has no live backend, and `backends` says which is up, down or circuit_open (gateway/health.py)."""
    gw: Gateway = request.app.state.gw
    services = gw.services
    ledger = services.ledger
    policy = services.policy_store.current
    states = _backend_states(gw)
    unserved = backend_health.unserved_routes(policy, states)
    ledger_health = ledger.health()  # `degraded` while rows only reach the spool: its depth and age
    shared = gw.shared_state.health() if gw.shared_state is not None else {"backend": "local", "status": "local"}
    degraded = bool(unserved) or ledger_health["status"] != "ok" or shared["status"] == "local_fallback"
    return JSONResponse({"status": "degraded" if degraded else "ok", "policy_version": policy.version,
                         "policy": services.policy_store.status(),  # the file's state, last reload error
                         "backends": states, "unserved_routes": unserved,
                         "engines": backend_health.engine_details(gw.embedded, policy),  # state, last exit
                         "ledger_queue": ledger.queue_depth, "database": ledger.db_available,
                         "ledger": ledger_health, "shared_state": shared})


async def prometheus(request: Request) -> Response:
    services: proxy.Services = request.app.state.services
    for name, state in services.breakers.states().items():
        metrics.BREAKER_STATE.labels(name).set(state)
    metrics.BACKEND_UP.clear()  # backends a reload removed disappear
    for name, up in _backend_states(request.app.state.gw).items():
        metrics.BACKEND_UP.labels(name).set(1 if up == "up" else 0)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def stage_profile_summary(request: Request) -> Response:
    """GET /admin/stage-profile (master or admin key; only with SWITCHYARD_STAGE_PROFILE=1): per-route stage times;
    `?reset=1` clears them after reading (gateway/stage_profile.py)."""
    gw: Gateway = request.app.state.gw
    await gw.services.auth.authenticate_admin(request.headers.get("authorization"), "The stage profile")
    summary = stage_profile.STORE.summary()
    if request.query_params.get("reset") in ("1", "true"):
        stage_profile.STORE.reset()
    return JSONResponse(summary)


_HOT_HANDLERS = {"/v1/chat/completions": chat_completions, "/v1/completions": completions,
                 "/v1/embeddings": embeddings, "/v1/responses": responses}


def create_app(config: GatewayConfig) -> Any:
    """The gateway's ASGI app: the Starlette app below, with the four POST endpoints clients call dispatched
    straight to their handlers (gateway/hot_path.py); `.state` and the rest are the Starlette app's."""
    def edge(app: Any) -> Any:
        # Every response, errors included, has an x-request-id; an unexpected error is an OpenAI 500, with a row.
        return RequestIdMiddleware(app, on_error=_record_unexpected)

    app = Starlette(
        routes=[
            *(Route(path, handler, methods=["POST"]) for path, handler in _HOT_HANDLERS.items()),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/openapi.json", openapi.serve_document, methods=["GET"]),
            *dashboard.routes(),
            *(_announcing(route) for route in admin_keys.routes()),
            *([Route("/admin/stage-profile", stage_profile_summary, methods=["GET"])] if stage_profile.ENABLED
              else []),
        ],
        lifespan=_lifespan,
        # the one place an APIError becomes a response (the hot path uses the same handler)
        exception_handlers={APIError: errors.answer, 404: _not_found, 405: _method_not_allowed},
        middleware=[Middleware(edge)],
    )
    app.state.config = config
    served: Any = HotPathApp(app, _HOT_HANDLERS, edge)
    return StageProfileMiddleware(served) if stage_profile.ENABLED else served


_LEDGER_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                     "/v1/embeddings": "embeddings", "/v1/responses": "responses"}


def _record_unexpected(scope: dict, request_id: str, exc: BaseException, started: float) -> None:
    """The ledger row of a /v1 request that an unexpected error ended (the 500 itself is http_edge's): what the
    request path had filled in so far (key, team, model, route), status error / internal. A row the request
    path already queued under this id wins (inserts skip a request_id that is there)."""
    endpoint = _LEDGER_ENDPOINTS.get(scope.get("path", ""))
    services = getattr(scope["app"].state, "services", None)
    if endpoint is None or scope.get("method") != "POST" or services is None:
        return
    so_far: LedgerRecord | None = scope.get(RECORD_KEY)
    record = dataclasses.replace(so_far) if so_far is not None else LedgerRecord(
        request_id=request_id, created_at=datetime.now(UTC), endpoint=ENDPOINT_NAMES[endpoint])
    disconnected = isinstance(exc, ClientDisconnect)
    record.status = "client_closed" if disconnected else "error"
    record.error_type = "client_closed" if disconnected else "internal"
    record.http_status = 499 if disconnected else 500
    record.latency_ms = (time.perf_counter() - started) * 1000
    metrics.REQUESTS.labels(record.route or "none", record.backend or "none", record.status).inc()
    services.ledger.submit(record)


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(APIError(404, f"Unknown endpoint {request.method} {request.url.path}.",
                                   type="invalid_request_error", code="unknown_url"))


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(APIError(405, f"Method {request.method} is not allowed on {request.url.path}.",
                                   type="invalid_request_error", code="method_not_allowed"))
