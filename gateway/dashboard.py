"""The admin dashboard: `/dashboard` (one HTML page drawn with plotly.js) and its JSON under `/dashboard/api/…`.

Every number comes from gateway/reports/figures.py (`Ledger`) and gateway/reports/decision.py, priced as the
reports price (each row by the policy version that served it: gateway/reports/served_policy.py), so the page
says what `switchyard report spreadsheet` and its CSV files say over the same window.

Admin keys only: the JSON endpoints and plotly.js take `Authorization: Bearer <key>`; the page itself also
takes `?key=` (a browser cannot send a header when it navigates), and its script sends that key as a Bearer
header, never in a JSON URL.

plotly.js is served by the gateway from the installed `plotly` Python package: no CDN, works offline.

The report queries are sync SQLAlchemy: they run in a thread (`asyncio.to_thread`) against ONE `Ledger`
(a sync engine) per app, opened on first use from the app's database URL; `close(app)` disposes it at
shutdown.
"""
from __future__ import annotations

import asyncio
import functools
import gzip
import hashlib
import importlib.resources
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy as sa
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import settings
from gateway.policy import PolicyError
from gateway.reports.decision import DecisionInputs, decide, standing
from gateway.reports.figures import Ledger, ReportError, Window
from gateway.reports.served_policy import ServedPolicies, resolve
from openai_wire import APIError
from openai_wire.responses import error_response

_PAGE = Path(__file__).with_name("dashboard_page.html")
_PLOTLY_CACHE = "private, max-age=31536000, immutable"  # the page asks for it with ?v=<plotly version>


# --------------------------------------------------------------------------------------------- the ledger


@dataclass(slots=True)
class _State:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ledger: Ledger | None = None


def _state(app: Any) -> _State:
    state = getattr(app.state, "dashboard", None)
    if state is None:  # no await between the check and the set: one per app
        state = app.state.dashboard = _State()
    return state


async def _ledger(request: Request) -> Ledger:
    state = _state(request.app)
    if state.ledger is None:
        async with state.lock:
            if state.ledger is None:
                state.ledger = await asyncio.to_thread(Ledger.open, request.app.state.config.database_url)
    return state.ledger


def close(app: Any) -> None:
    """Dispose the dashboard's sync engine (call from the app's lifespan, at shutdown)."""
    state = getattr(app.state, "dashboard", None)
    if state is not None and state.ledger is not None:
        state.ledger.close()
        state.ledger = None


# --------------------------------------------------------------------------------------------- requests


async def _check_admin(request: Request, *, query_key: bool = False) -> None:
    header = request.headers.get("authorization")
    if not header and query_key and request.query_params.get("key"):
        header = "Bearer " + request.query_params["key"]
    await request.app.state.services.auth.authenticate_admin(header, "The dashboard")


def _window(request: Request) -> Window:
    q = request.query_params
    since, until, team = q.get("since"), q.get("until"), (q.get("team") or "").strip() or None
    try:
        window = Window.parse(since, until, team)
    except ReportError as exc:
        text = str(exc)
        param = "since" if text.startswith("--since") else "until"
        raise APIError(400, text.replace("--since", "since", 1).replace("--until", "until", 1),
                       type="invalid_request_error", param=param, code="invalid_date") from None
    if window.since is not None and window.until is not None and window.since >= window.until:
        raise APIError(400, f"since ({since}) must be before until ({until}).", type="invalid_request_error",
                       param="since", code="invalid_date")
    return window


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json",
                    headers={"Cache-Control": "no-store"})


Query = Callable[[Ledger, Window, Any, Request], dict[str, Any]]


def _endpoint(query: Query) -> Callable[[Request], Any]:
    """An admin-only JSON endpoint over the window in ?since=&until=&team=, its SQL run in a thread."""

    @functools.wraps(query)
    async def handler(request: Request) -> Response:
        try:
            await _check_admin(request)
            window = _window(request)
            ledger = await _ledger(request)
            policy = request.app.state.services.policy_store.current
            payload = await asyncio.to_thread(query, ledger, window, policy, request)
        except (ReportError, sa.exc.SQLAlchemyError) as exc:
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return error_response(APIError(503, f"The ledger cannot be read: {message}", type="api_error",
                                           code="ledger_unavailable"))
        return _json({"window": _describe(window), **payload})

    return handler


def _describe(w: Window) -> dict[str, Any]:
    return {"since": _iso(w.since), "until": _iso(w.until), "team": w.team, "text": w.describe()}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


# --------------------------------------------------------------------------------------------- the figures


def _served(ledger: Ledger, w: Window, live: Any) -> ServedPolicies:
    """The policies `switchyard report` prices the window with (each row by the version that served it, the
    packaged default for rows without a stored text), so the page and the report agree on the same window.
    Only where that default does not load (an install without it) does the live policy's file stand in."""
    for default in (settings.DEFAULT_POLICY, getattr(live, "source", None)):
        if default:
            try:
                return resolve(ledger, w, None, default)
            except PolicyError:
                continue
    return ServedPolicies.single(live)


def _decision(ledger: Ledger, w: Window, policy: Any):
    inputs = DecisionInputs.from_ledger(ledger, w, _served(ledger, w, policy))
    return inputs, decide(inputs)


def _summary(ledger: Ledger, w: Window, policy: Any, request: Request) -> dict[str, Any]:
    s = ledger.summary(w)
    engines = ledger.engines(w)
    inputs = DecisionInputs.from_figures(s, engines, ledger.api_backends_by_version(w),  # not from_ledger: no re-query
                                         _served(ledger, w, policy))
    result = decide(inputs)
    idle = sum(e.idle_usd for e in engines if e.has_uptime)
    return {
        "first": _iso(s.first), "last": _iso(s.last), "days": s.days, "requests": s.requests,
        "window_start": _iso(s.window_start), "window_end": _iso(s.window_end),
        "prompt_tokens": s.prompt_tokens, "cached_prompt_tokens": s.cached_prompt_tokens,
        "completion_tokens": s.completion_tokens, "tokens": s.prompt_tokens + s.completion_tokens,
        "spend_usd": s.spend_usd, "api_spend_usd": s.api_spend_usd, "in_house_charged_usd": s.in_house_charged_usd,
        "counterfactual_usd": s.counterfactual_usd,
        "realised_savings_usd": s.realised_savings_usd,
        "paid_usd": sum(e.paid_usd for e in engines), "idle_usd": idle if any(e.has_uptime for e in engines) else None,
        "up_hours": inputs.up_hours, "busy_hours": inputs.busy_hours,
        "utilisation": inputs.utilisation,
        "break_even_utilisation": result.break_even_utilisation,
        "cheaper": result.cheaper,
        "standing": standing(result, inputs.utilisation),
        "monthly": {"all_api_usd": result.all_api_usd, "all_hosted_usd": result.all_hosted_usd,
                    "current_mix_usd": result.current_mix_usd, "idle_usd": result.idle_usd},
        "break_even_daily_tokens": result.break_even_daily_tokens,
        "capacity_daily_tokens": result.capacity_daily_tokens,
        "reference_api": inputs.reference.backend if inputs.reference else None,
        "pricing": inputs.pricing,
        "notes": inputs.notes,
        "engines": [{"backend": e.backend, "utilisation": e.utilisation, "idle_usd": e.idle_usd if e.has_uptime else None,
                     "paid_usd": e.paid_usd, "has_uptime": e.has_uptime} for e in engines],
    }


def _spend(ledger: Ledger, w: Window, policy: Any, request: Request) -> dict[str, Any]:
    return {"rows": ledger.spend_daily(w)}


_SIDES = {"gpu_amortized": "in-house", "api_price": "API"}


def _share(ledger: Ledger, w: Window, policy: Any, request: Request) -> dict[str, Any]:
    sides: dict[str, dict[str, float]] = {}
    for r in ledger.spend_daily(w):
        side = sides.setdefault(_SIDES.get(r["cost_basis"], "other"), {"spend_usd": 0.0, "tokens": 0, "requests": 0})
        side["spend_usd"] += r["spend_usd"]
        side["tokens"] += r["tokens"]
        side["requests"] += r["requests"]
    order = ["in-house", "API", "other"]
    return {"sides": [{"side": name, **sides[name]} for name in order if name in sides]}


def _utilisation(ledger: Ledger, w: Window, policy: Any, request: Request) -> dict[str, Any]:
    rows = ledger.busy_by_hour(w)
    _, result = _decision(ledger, w, policy)
    return {"rows": [{"hour": r.hour, "backend": r.backend, "up_seconds": r.up_seconds,
                      "busy_seconds": r.busy_seconds, "utilisation": r.utilisation} for r in rows],
            "break_even_utilisation": result.break_even_utilisation, "cheaper": result.cheaper}


def _idle(ledger: Ledger, w: Window, policy: Any, request: Request) -> dict[str, Any]:
    return {"rows": ledger.idle_daily(w)}


def _top(ledger: Ledger, w: Window, policy: Any, request: Request) -> dict[str, Any]:
    text = request.query_params.get("limit") or "10"
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise APIError(400, f"limit {text!r} must be a whole number from 1 to 100.", param="limit",
                       code="invalid_limit")
    limit = int(text)
    return {"teams": ledger.top(w, "team", limit), "routes": ledger.top(w, "route", limit)}


def _decisions(ledger: Ledger, w: Window, policy: Any, request: Request) -> dict[str, Any]:
    return {"rows": ledger.decisions(w)}


def _savings(ledger: Ledger, w: Window, policy: Any, request: Request) -> dict[str, Any]:
    """In-house rows' API alternative minus what those rows were charged, per day and engine (rows on
    routes without an API alternative are left out rather than counted as a loss)."""
    rows = [{"day": r["day"], "backend": r["backend"], "counterfactual_usd": r["counterfactual_usd"],
             "charged_usd": r["counterfactual_charged_usd"],
             "savings_usd": r["counterfactual_usd"] - r["counterfactual_charged_usd"]}
            for r in ledger.spend_daily(w) if r["cost_basis"] == "gpu_amortized"]
    return {"rows": rows, "total_usd": sum(r["savings_usd"] for r in rows)}


# --------------------------------------------------------------------------------------------- the page


async def page(request: Request) -> Response:
    await _check_admin(request, query_key=True)
    html = _page_html().replace("__PLOTLY_VERSION__", _plotly()[0])
    return Response(html, media_type="text/html; charset=utf-8",
                    headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer",
                             "X-Content-Type-Options": "nosniff"})


@functools.cache
def _page_html() -> str:
    return _PAGE.read_text(encoding="utf-8")


@functools.cache
def _plotly() -> tuple[str, bytes, bytes, str]:
    """(version, plotly.min.js, its gzip, etag), read once from the installed plotly package."""
    from importlib.metadata import version

    data = (importlib.resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    return version("plotly"), data, gzip.compress(data, 6), '"' + hashlib.sha256(data).hexdigest()[:16] + '"'


async def plotly_js(request: Request) -> Response:
    await _check_admin(request)
    _, data, packed, etag = await asyncio.to_thread(_plotly)
    headers = {"Cache-Control": _PLOTLY_CACHE, "ETag": etag, "Vary": "Accept-Encoding, Authorization",
               "X-Content-Type-Options": "nosniff"}
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    if "gzip" in request.headers.get("accept-encoding", ""):
        return Response(packed, media_type="text/javascript", headers={**headers, "Content-Encoding": "gzip"})
    return Response(data, media_type="text/javascript", headers=headers)


def routes() -> list[Route]:
    api = {"summary": _summary, "spend": _spend, "share": _share, "utilisation": _utilisation, "idle": _idle,
           "top": _top, "decisions": _decisions, "savings": _savings}
    return [Route("/dashboard", page, methods=["GET"]),
            Route("/dashboard/plotly.min.js", plotly_js, methods=["GET"]),
            *(Route(f"/dashboard/api/{name}", _endpoint(query), methods=["GET"]) for name, query in api.items())]
