"""`/dashboard` on the real gateway (`switchyard serve` on 127.0.0.1), read by headless Chromium.

The ledger is seeded directly (two weeks of an engine and two APIs); every number a chart drew is checked
against hand-written SQL over the seeded rows. The screenshot it saves is docs/dashboard.png.
"""
from __future__ import annotations

import math
import os
import random
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import sqlalchemy as sa

from gateway import db
from gateway.ledger.models import EngineUptimeRow, PolicyVersionRow, RequestRow
from gateway.ledger.policy_versions import version_of
from gateway.ledger.record import LedgerRecord, PolicyVersionRecord, UptimeRecord
from tests.e2e.conftest import free_port, run_cli, wait_http

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "dashboard.png"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                    reason=f"{CHROMIUM} is missing: run `make system-tools`")
MASTER = "sk-test-dashboard-master"
CHARTS = ["spend", "share", "savings", "utilisation", "idle", "decisions", "teams", "routes"]

# Only API backends (never called: the rows are seeded), so the gateway starts fast; the first route's
# backend is the reference API of the decision.
POLICY = """\
backends:
  gpt-4o:
    kind: litellm
    model: openai/gpt-4o
    api_base: http://127.0.0.1:9/v1
  gpt-4o-mini:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: http://127.0.0.1:9/v1
routes:
  code:
    strategy: fixed
    backend: gpt-4o
  chat-mini:
    strategy: fixed
    backend: gpt-4o-mini
"""

ENGINE, ENGINE_HOUR_USD, TOKENS_PER_BUSY_S = "llama-8b", 0.9, 250.0
API_PRICES = {"gpt-4o": (2.5e-6, 1.25e-6, 10e-6), "gpt-4o-mini": (0.15e-6, 0.075e-6, 0.6e-6)}  # in, cached, out
TEAMS = {"search": 0.34, "support": 0.24, "analytics": 0.2, "research": 0.13, "growth": 0.09}
START = datetime(2025, 3, 3, tzinfo=UTC)  # a Monday
DAYS = 14


# --------------------------------------------------------------------------------------------- seed data


def _utilisation(at: datetime, rng: random.Random) -> float:
    """Busy share of an engine serving office traffic: busier on weekday working hours (UTC)."""
    hour = at.hour + at.minute / 60
    day = 0.66 * math.exp(-((hour - 13.5) / 3.6) ** 2)
    if at.weekday() >= 5:
        day *= 0.45
    return min(0.97, max(0.02, 0.18 + day + rng.gauss(0, 0.05)))


def _api_cost(backend: str, prompt: int, cached: int, completion: int) -> tuple[float, float, float]:
    p_in, p_cached, p_out = API_PRICES[backend]
    input_usd = (prompt - cached) * p_in + cached * p_cached
    return input_usd, completion * p_out, cached * (p_in - p_cached)


def seed(url: str) -> None:
    rng = random.Random(11)
    teams, weights = list(TEAMS), list(TEAMS.values())
    uptime, requests = [], []
    n = 0
    version = version_of(POLICY)  # the rows were served by POLICY, whose text the gateway stored

    def request(at: datetime, **fields) -> None:
        nonlocal n
        n += 1
        requests.append(LedgerRecord(request_id=f"req-{n}", created_at=at, team=rng.choices(teams, weights)[0],
                                     api_key_id="key_seed", policy_version=version, **fields).to_row())

    for hour_index in range(DAYS * 24):
        hour = START + timedelta(hours=hour_index)
        down = hour_index // 24 == 4 and 2 <= hour.hour < 6  # the engine was down for four hours one night
        busy_hour = 0.0
        u_hour = 0.0
        if not down:
            for m in range(0, 60, 5):
                at = hour + timedelta(minutes=m)
                u = _utilisation(at, rng)
                busy_hour += 300 * u
                uptime.append(UptimeRecord(interval_id=f"{ENGINE}|{at.isoformat()}|seed", created_at=at, backend=ENGINE,
                                           seconds=300.0, busy_seconds=300 * u, device_hour_usd=ENGINE_HOUR_USD).to_row())
            u_hour = busy_hour / 3600
            tokens_left = busy_hour * TOKENS_PER_BUSY_S
            while tokens_left > 500:
                prompt = min(int(tokens_left * 0.88), rng.randint(4000, 11000))
                completion = max(20, int(prompt * rng.uniform(0.08, 0.18)))
                tokens_left -= prompt + completion
                seconds = (prompt + completion) / TOKENS_PER_BUSY_S
                cost = seconds * ENGINE_HOUR_USD / 3600 / u_hour
                route, reason = rng.choices([("auto", "difficulty_easy"), ("auto", "idle_relaxed"),
                                             ("summarize", "fixed")], [0.55, 0.1, 0.35])[0]
                request(hour + timedelta(seconds=rng.uniform(0, 3599)), requested_model=route, route=route,
                        backend=ENGINE, served_model="llama-3.1-8b-instruct", prompt_tokens=prompt,
                        completion_tokens=completion, cost_usd=cost, input_cost_usd=cost, cost_basis="gpu_amortized",
                        gpu_seconds=seconds, utilisation=u_hour, device_hour_usd=ENGINE_HOUR_USD, device_kind="gpu",
                        counterfactual_cost_usd=prompt * 2.5e-6 + completion * 10e-6, route_reason=reason)
        office = _utilisation(hour + timedelta(minutes=30), rng)
        for backend, per_hour, choices in (
                ("gpt-4o", 14, [(("auto", "difficulty_hard"), 0.5), (("auto", "spillover"), 0.08),
                                (("code", "fixed"), 0.36), (("auto", "fallback"), 0.06)]),
                ("gpt-4o-mini", 22, [(("chat-mini", "fixed"), 0.95), (("chat-mini", "fallback"), 0.05)])):
            for _ in range(max(0, int(rng.gauss(per_hour * office * 1.6, 2)))):
                (route, reason), = rng.choices([c for c, _ in choices], [w for _, w in choices])
                if down and route == "auto" and reason != "fallback":
                    reason = "fallback"
                prompt = rng.randint(600, 4000)
                cached = int(prompt * rng.choice([0, 0, 0.3, 0.6]))
                completion = rng.randint(80, 900)
                input_usd, output_usd, saved = _api_cost(backend, prompt, cached, completion)
                request(hour + timedelta(seconds=rng.uniform(0, 3599)), requested_model=route, route=route,
                        backend=backend, served_model=f"openai/{backend}", prompt_tokens=prompt,
                        cached_prompt_tokens=cached, completion_tokens=completion, input_cost_usd=input_usd,
                        output_cost_usd=output_usd, cost_usd=input_usd + output_usd, cost_basis="api_price",
                        route_reason=reason, cache_savings_usd=saved, price_table_version="seed")
    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(RequestRow.__table__.insert(), requests)
            conn.execute(EngineUptimeRow.__table__.insert(), uptime)
            conn.execute(PolicyVersionRow.__table__.insert(),
                         PolicyVersionRecord(version, START, POLICY, "policy.yaml").to_row())
    finally:
        engine.dispose()


def sql(url: str, text: str) -> list[tuple]:
    engine = sa.create_engine(db.sync_url(url))
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(text))]
    finally:
        engine.dispose()


# --------------------------------------------------------------------------------------------- the gateway


@dataclass
class Served:
    root: str
    url: str  # the ledger


@pytest.fixture(scope="module")
def processes() -> Iterator[list[subprocess.Popen]]:
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        process.send_signal(signal.SIGINT)
    for process in processes:
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def _serve(tmp: Path, processes: list[subprocess.Popen], seed: Callable[[str], None] | None = None,
           policy: str = POLICY) -> Served:
    """`switchyard serve` over a fresh SQLite ledger that `seed(url)` fills first, with `policy` live."""
    tmp.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{tmp / 'ledger.db'}"
    db.upgrade(url)
    if seed is not None:
        seed(url)
    (tmp / "policy.yaml").write_text(policy)
    port = free_port()
    env = {**os.environ, "SWITCHYARD_MASTER_KEY": MASTER, "SWITCHYARD_DATA_DIR": str(tmp / "data")}
    env.pop("SWITCHYARD_DATABASE_URL", None)
    log = open(tmp / "gateway.log", "w")  # noqa: SIM115 - closed with the process
    processes.append(subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--policy", str(tmp / "policy.yaml"), "--port", str(port),
         "--database-url", url], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp))
    root = f"http://127.0.0.1:{port}"
    try:
        wait_http(root + "/health", timeout=120)
    except TimeoutError:
        raise AssertionError((tmp / "gateway.log").read_text()) from None
    return Served(root, url)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory, processes) -> Served:
    return _serve(tmp_path_factory.mktemp("seeded"), processes, seed)


@pytest.fixture(scope="module")
def empty(tmp_path_factory, processes) -> Served:
    return _serve(tmp_path_factory.mktemp("empty"), processes)


# --------------------------------------------------------------------------------------------- the browser


@dataclass
class Loaded:
    charts: dict[str, list[dict]]
    texts: dict[str, str]
    tiles: dict[str, str]
    console_errors: list[str]
    remote: list[str]
    ticks: dict[str, dict[str, list[str]]]  # chart -> axis ('x', 'y', 'y2') -> the tick labels drawn
    hovers: dict[str, list[str]]  # chart -> the hover label of each trace's first point (with hover=True)
    notes: list[str]
    window: str
    marks: dict[str, int]  # chart -> the bars and markers plotly drew (SVG `.point`s)


# Plotly draws every tick label as SVG text (lines as tspans): read them as the reader sees them.
_TICKS_JS = """(ids) => Object.fromEntries(ids.map((id) => {
    const div = document.getElementById('chart-' + id);
    const read = (cls) => Array.from(div.querySelectorAll('.' + cls + 'tick text'), (t) => {
        const lines = t.querySelectorAll('tspan.line');
        return lines.length ? Array.from(lines, (l) => l.textContent).join('\\n') : t.textContent;
    });
    return [id, {x: read('x'), y: read('y'), y2: read('y2')}];
}))"""

# Hover each trace's first point through plotly's own Fx.hover and read the label it draws.
_HOVER_JS = """(ids) => Object.fromEntries(ids.map((id) => {
    const div = document.getElementById('chart-' + id);
    return [id, Array.from(div.data || [], (t, i) => {
        Plotly.Fx.hover(div, [{curveNumber: i, pointNumber: 0}]);
        const text = Array.from(div.querySelectorAll('.hoverlayer .hovertext'), (h) => h.textContent).join(' | ');
        Plotly.Fx.unhover(div);
        return text;
    })];
}))"""


def _load(root: str, query: str = "", screenshot: Path | None = None, hover: bool = False) -> Loaded:
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    remote: list[str] = []

    def local(url: str) -> bool:
        parsed = urlparse(url.removeprefix("blob:"))
        return parsed.scheme == "data" or parsed.hostname == "127.0.0.1"

    def route(r) -> None:
        if local(r.request.url):
            r.continue_()
        else:
            remote.append(r.request.url)
            r.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: None if local(r.url) else remote.append(r.url))
            page.route("**/*", route)
            page.goto(f"{root}/dashboard?key={MASTER}{query}")
            page.wait_for_selector("body[data-state=ready], body[data-state=error]", timeout=60_000)
            state = page.evaluate("document.body.dataset.state")
            assert state == "ready", page.inner_text("#error")
            charts = page.evaluate("""(ids) => Object.fromEntries(ids.map((id) => {
                const div = document.getElementById('chart-' + id);
                return [id, Array.from(div.data || [], (t) => ({name: t.name, type: t.type, mode: t.mode || null,
                    x: Array.from(t.x || []), y: Array.from(t.y || []),
                    labels: Array.from(t.labels || []), values: Array.from(t.values || []),
                    dash: t.line && t.line.dash || null}))];
            }))""", CHARTS)
            texts = page.evaluate("""(ids) => Object.fromEntries(ids.map((id) => {
                const div = document.getElementById('chart-' + id);
                return [id, div.dataset.rendered + '|' + div.textContent];
            }))""", CHARTS)
            tiles = page.evaluate("""() => Object.fromEntries(Array.from(document.querySelectorAll('.tile'),
                (t) => [t.id.replace('tile-', ''), t.innerText]))""")
            ticks = page.evaluate(_TICKS_JS, CHARTS)
            notes = page.evaluate("() => Array.from(document.querySelectorAll('#notes li'), (li) => li.textContent)")
            window = page.inner_text("#window")
            marks = page.evaluate("""(ids) => Object.fromEntries(ids.map((id) =>
                [id, document.querySelectorAll('#chart-' + id + ' .point').length]))""", CHARTS)
            if screenshot is not None:
                page.wait_for_timeout(300)
                page.screenshot(path=str(screenshot), full_page=True)
            hovers = page.evaluate(_HOVER_JS, CHARTS) if hover else {}
            if hover:  # a pie's hover is its slices' own mouse events, not Fx.hover's
                hovers["share"] = []
                for piece in page.query_selector_all("#chart-share g.slice"):
                    piece.dispatch_event("mouseover")
                    hovers["share"].append(" | ".join(page.locator("#chart-share .hoverlayer .hovertext")
                                                      .all_text_contents()))
                    piece.dispatch_event("mouseout")
        finally:
            browser.close()
    return Loaded(charts, texts, tiles, errors, remote, ticks, hovers, notes, window, marks)


def _series(traces: list[dict]) -> dict[tuple[str, str], float]:
    return {(t["name"], x): y for t in traces for x, y in zip(t["x"], t["y"], strict=True)}


def _close(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for k, v in expected.items():
        assert actual[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


# --------------------------------------------------------------------------------------------- tests


@needs_chromium
def test_the_page_draws_the_ledger_numbers(seeded):
    page = _load(seeded.root, screenshot=SCREENSHOT)
    assert page.console_errors == []
    assert page.remote == []
    assert all(text.startswith("data|") for text in page.texts.values()), page.texts
    url = seeded.url

    spend = sql(url, "SELECT SUBSTR(created_at, 1, 10), backend, SUM(cost_usd) FROM requests "
                     "WHERE backend IS NOT NULL GROUP BY 1, 2")
    _close(_series(page.charts["spend"]), {(b, d): v for d, b, v in spend})
    assert {t["name"] for t in page.charts["spend"]} == {ENGINE, "gpt-4o", "gpt-4o-mini"}

    util = sql(url, "SELECT SUBSTR(created_at, 1, 13), backend, SUM(busy_seconds) / SUM(seconds) "
                    "FROM engine_uptime GROUP BY 1, 2")
    lines = [t for t in page.charts["utilisation"] if t["dash"] != "dash"]
    drawn = _series(lines)
    gaps = {k for k, v in drawn.items() if v is None}  # the line breaks where the engine had no uptime
    assert gaps == {(ENGINE, "2025-03-07 02:00:00")}
    _close({k: v for k, v in drawn.items() if k not in gaps}, {(b, h + ":00"): v for h, b, v in util})
    assert len(util) == DAYS * 24 - 4  # four hours down
    (break_even,) = [t for t in page.charts["utilisation"] if t["dash"] == "dash"]
    summary = httpx.get(seeded.root + "/dashboard/api/summary", headers={"Authorization": f"Bearer {MASTER}"}).json()
    assert break_even["y"] == [summary["break_even_utilisation"]] * 2
    assert 0 < summary["break_even_utilisation"] < 1

    idle = sql(url, "SELECT SUBSTR(created_at, 1, 10), backend, "
                    "SUM((seconds - busy_seconds) * device_hour_usd) / 3600.0 FROM engine_uptime GROUP BY 1, 2")
    _close(_series(page.charts["idle"]), {(b, d): v for d, b, v in idle})

    teams = sql(url, "SELECT team, SUM(cost_usd) FROM requests WHERE team IS NOT NULL GROUP BY team "
                     "ORDER BY SUM(cost_usd) DESC")
    (bars,) = page.charts["teams"]
    assert bars["y"][-1] == teams[0][0] == "search"  # the biggest is drawn on top (last)
    _close(dict(zip(bars["y"], bars["x"], strict=True)), dict(teams))

    routes = dict(sql(url, "SELECT route, SUM(cost_usd) FROM requests WHERE route IS NOT NULL GROUP BY route"))
    (bars,) = page.charts["routes"]
    _close(dict(zip(bars["y"], bars["x"], strict=True)), routes)

    reasons = sql(url, "SELECT backend, route_reason, COUNT(*) FROM requests GROUP BY 1, 2")
    assert _series(page.charts["decisions"]) == {(b, r): n for b, r, n in reasons}

    savings = sql(url, "SELECT SUBSTR(created_at, 1, 10), backend, SUM(counterfactual_cost_usd) - SUM(cost_usd) "
                       "FROM requests WHERE cost_basis = 'gpu_amortized' AND counterfactual_cost_usd IS NOT NULL "
                       "GROUP BY 1, 2")
    bars = [t for t in page.charts["savings"] if t["type"] == "bar"]
    _close(_series(bars), {(b, d): v for d, b, v in savings})

    share = {side: (s, t) for side, s, t in sql(url, """
        SELECT CASE cost_basis WHEN 'gpu_amortized' THEN 'in-house' ELSE 'API' END, SUM(cost_usd),
               SUM(prompt_tokens + completion_tokens) FROM requests WHERE backend IS NOT NULL GROUP BY 1""")}
    spend_pie, token_pie = page.charts["share"]
    _close(dict(zip(spend_pie["labels"], spend_pie["values"], strict=True)), {k: v[0] for k, v in share.items()})
    assert dict(zip(token_pie["labels"], token_pie["values"], strict=True)) == {k: v[1] for k, v in share.items()}

    (total,), = sql(url, "SELECT SUM(cost_usd) FROM requests")
    assert f"${total:,.2f}" in page.tiles["spend"]
    (busy, up), = sql(url, "SELECT SUM(busy_seconds), SUM(seconds) FROM engine_uptime")
    assert f"{busy / up * 100:.1f}%" in page.tiles["utilisation"]
    verdict = "hosting is cheaper" if busy / up > summary["break_even_utilisation"] else "the API is cheaper"
    assert verdict in page.tiles["break-even"] and summary["cheaper"] in verdict
    (idle_usd,), = sql(url, "SELECT SUM((seconds - busy_seconds) * device_hour_usd) / 3600.0 FROM engine_uptime")
    assert f"${idle_usd:,.2f}" in page.tiles["idle"]
    assert SCREENSHOT.stat().st_size > 50_000

    # Two weeks read in days: whole-day ticks on every time axis (the first with its year), never a time of day.
    for name in ("spend", "idle", "savings", "utilisation"):
        labels = page.ticks[name]["x"]
        assert 3 <= len(labels) <= 15, (name, labels)
        assert all(re.fullmatch(r"(Mar|Apr) \d{1,2}(\n2025)?", t) for t in labels), (name, labels)


@needs_chromium
def test_the_team_filter_and_dates_requery(seeded):
    page = _load(seeded.root, "&team=research&since=2025-03-10&until=2025-03-11")
    assert page.console_errors == [] and page.remote == []
    spend = sql(seeded.url, "SELECT SUBSTR(created_at, 1, 10), backend, SUM(cost_usd) FROM requests "
                            "WHERE backend IS NOT NULL AND team = 'research' AND created_at >= '2025-03-10' "
                            "AND created_at < '2025-03-12' GROUP BY 1, 2")
    _close(_series(page.charts["spend"]), {(b, d): v for d, b, v in spend})
    assert {d for d, _, _ in spend} == {"2025-03-10", "2025-03-11"}
    assert [t["y"] for t in page.charts["teams"]] == [["research"]]
    assert "· ledger 2025-03-10 to 2025-03-11 ·" in page.window  # the uptime ends at 00:00, exclusive: not 03-12


@needs_chromium
def test_an_empty_ledger_says_no_data_everywhere(empty):
    page = _load(empty.root)
    assert page.console_errors == [] and page.remote == []
    for name, text in page.texts.items():
        assert text.startswith("empty|") and "no data" in text, name
        assert page.charts[name] == [], name
    assert "$0.00" in page.tiles["spend"]


def test_only_admin_keys_open_the_dashboard(empty):
    root = empty.root
    created = run_cli("keys", "create", "--team", "search", "--database-url", empty.url)
    assert created.returncode == 0, created.stderr
    user_key = created.stdout.strip().splitlines()[-1]
    urls = [f"{root}/dashboard", f"{root}/dashboard/plotly.min.js",
            *(f"{root}/dashboard/api/{n}" for n in
              ("summary", "spend", "share", "utilisation", "idle", "top", "decisions", "savings"))]
    for url in urls:
        missing = httpx.get(url)
        assert missing.status_code == 401, url
        assert missing.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url, headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        forbidden = httpx.get(url, headers={"Authorization": f"Bearer {user_key}"})
        assert forbidden.status_code == 403, url
        assert forbidden.json()["error"]["code"] == "admin_key_required"
        assert httpx.get(url, headers={"Authorization": f"Bearer {MASTER}"}).status_code == 200, url
    assert httpx.get(f"{root}/dashboard?key={user_key}").status_code == 403
    assert httpx.get(f"{root}/dashboard/api/summary?key={MASTER}").status_code == 401  # the key only as a header
    page = httpx.get(f"{root}/dashboard?key={MASTER}")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "https://" not in page.text and "cdn" not in page.text.lower()


def test_bad_dates_are_a_400_naming_the_parameter(empty):
    auth = {"Authorization": f"Bearer {MASTER}"}
    bad = httpx.get(f"{empty.root}/dashboard/api/spend?since=last-tuesday", headers=auth)
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "since" and "'last-tuesday' is not a date" in error["message"]
    assert httpx.get(f"{empty.root}/dashboard/api/idle?until=2025-13-01", headers=auth).json()["error"]["param"] == "until"
    backwards = httpx.get(f"{empty.root}/dashboard/api/summary?since=2025-03-10&until=2025-03-01", headers=auth)
    assert backwards.status_code == 400 and "before" in backwards.json()["error"]["message"]
    assert httpx.get(f"{empty.root}/dashboard/api/top?limit=0", headers=auth).status_code == 400
    good = httpx.get(f"{empty.root}/dashboard/api/spend?since=2025-03-01&until=2025-03-10&team=x", headers=auth)
    assert good.status_code == 200 and good.json()["rows"] == []


def test_plotly_is_served_from_the_installed_package_with_a_long_cache(empty):
    import importlib.resources

    expected = (importlib.resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    response = httpx.get(f"{empty.root}/dashboard/plotly.min.js", headers={"Authorization": f"Bearer {MASTER}"})
    assert response.status_code == 200 and response.content == expected
    assert "max-age=31536000" in response.headers["cache-control"]
    assert "javascript" in response.headers["content-type"]
    again = httpx.get(f"{empty.root}/dashboard/plotly.min.js",
                      headers={"Authorization": f"Bearer {MASTER}", "If-None-Match": response.headers["etag"]})
    assert again.status_code == 304
