"""The workbook's sheets as Python rows: every cell holds its value (computed here, with figures.py and
decision.py) and, where the sheet should stay live, the Excel formula that computes the same value from
other cells. gateway/reports/workbook.py renders the same rows to an .xlsx (formulas) or CSV files
(values), so the two formats never differ in content.

Build order follows the references: Prices → In-house → Decision → Ladder (formulas name cells that
already have an address); Traffic and Notes stand alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any

from gateway.reports import decision as dec
from gateway.reports.figures import (
    HOURS_PER_MONTH,
    UTILISATION_LEVELS,
    EngineRow,
    HourRow,
    Summary,
    TrafficRow,
)

NA = "n/a"
NO_UPTIME = "no uptime recorded"
DEFAULT_UTILISATION = 0.5  # the Decision sheet's utilisation cell when none was measured

# Number formats
USD = '"$"#,##0.00'
USD_MTOK = '"$"#,##0.0000'
USD_HOUR = '"$"#,##0.00##'
INT = "#,##0"
DEC = "#,##0.00"
PCT = "0.0%"
DAY = "yyyy-mm-dd"
X = '0.00"×"'


@dataclass(slots=True)
class Cell:
    value: Any = None  # what CSV writes and what the formula evaluates to
    formula: str | None = None  # "=…" written to the workbook instead of the value
    fmt: str | None = None
    input: bool = False  # an editable input: distinct fill and an "edit me" note
    note: str | None = None
    bold: bool = False


def _c(value: Any = None, formula: str | None = None, fmt: str | None = None, **kw: Any) -> Cell:
    return Cell(value, formula, fmt, **kw)


def col_letter(col: int) -> str:
    out = ""
    while col:
        col, rem = divmod(col - 1, 26)
        out = chr(65 + rem) + out
    return out


@dataclass(slots=True)
class Table:
    csv: str  # file stem: traffic, prices, …
    first: int  # its header's row (1-based)
    last: int


@dataclass
class Sheet:
    title: str
    rows: list[list[Cell]] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    freeze: str | None = "A2"
    widths: dict[int, float] = field(default_factory=dict)
    wrap: set[int] = field(default_factory=set)  # columns of prose: wrapped within their width, rows grow

    @property
    def next_row(self) -> int:
        return len(self.rows) + 1

    def add(self, cells: list[Cell | Any]) -> int:
        self.rows.append([c if isinstance(c, Cell) else Cell(c) for c in cells])
        return len(self.rows)

    def header(self, labels: list[str]) -> int:
        return self.add([Cell(x, bold=True) for x in labels])

    def table(self, csv: str, first: int) -> None:
        self.tables.append(Table(csv, first, len(self.rows)))

    def ref(self, row: int, col: int, *, sheet: bool = True) -> str:
        """An absolute reference, sheet-qualified: 'In-house'!$C$5."""
        cell = f"${col_letter(col)}${row}"
        return f"'{self.title}'!{cell}" if sheet else cell

    def csv_rows(self, table: Table) -> list[list[Any]]:
        return [[c.value for c in row] for row in self.rows[table.first - 1:table.last]]


def _num(v: float | None) -> Any:
    return NA if v is None else v


def _excel_day(day: str) -> date | str:
    try:
        return date.fromisoformat(day)
    except (TypeError, ValueError):
        return day


# --------------------------------------------------------------------------------------------- Traffic

TRAFFIC_HEAD = ["day", "route", "backend", "cost basis", "requests", "prompt tokens", "cached prompt tokens",
                "completion tokens", "spend USD", "API alternative USD"]


def traffic_sheet(rows: list[TrafficRow]) -> Sheet:
    s = Sheet("Traffic", widths={1: 12})
    first = s.header(TRAFFIC_HEAD)
    for r in rows:
        s.add([_c(_excel_day(r.day), fmt=DAY), r.route, r.backend, r.cost_basis, _c(r.requests, fmt=INT),
               _c(r.prompt_tokens, fmt=INT), _c(r.cached_prompt_tokens, fmt=INT), _c(r.completion_tokens, fmt=INT),
               _c(r.spend_usd, fmt=USD), _c(r.counterfactual_usd, fmt=USD)])
    totals = [sum(r.requests for r in rows), sum(r.prompt_tokens for r in rows),
              sum(r.cached_prompt_tokens for r in rows), sum(r.completion_tokens for r in rows),
              sum(r.spend_usd for r in rows), sum(r.counterfactual_usd for r in rows)]
    cells: list[Cell] = [Cell("total", bold=True), Cell(), Cell(), Cell()]
    for i, v in enumerate(totals):
        col = 5 + i
        formula = f"=SUM({col_letter(col)}{first + 1}:{col_letter(col)}{s.next_row - 1})" if rows else None
        cells.append(_c(v, formula, USD if i >= 4 else INT, bold=True))
    s.add(cells)
    s.table("traffic", first)
    return s


# --------------------------------------------------------------------------------------------- Prices


@dataclass
class PriceCells:
    """Where each price input lives, for the other sheets' formulas."""

    api: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # backend → input, cached, output refs
    engine: dict[str, str] = field(default_factory=dict)  # backend → device $/hour ref
    engine_value: dict[str, float] = field(default_factory=dict)
    decision_engines: list[str] = field(default_factory=list)  # whose $/hour the Decision sheet sums
    first_engine: str | None = None


EDIT_ME = "edit me: the other sheets recompute from this price"


def prices_sheet(policy, api_rows, engines: list[EngineRow], price_table_version,
                 traffic: list[dec.ApiTraffic] | None = None) -> tuple[Sheet, PriceCells]:
    """`policy`: the newest policy that served the window; `traffic`: the Decision's API traffic, each priced by
    the policy version that served it (a backend priced differently by two versions gets a row for each)."""
    from gateway.pricing import device_count, device_hour_usd, device_kind

    s = Sheet("Prices", widths={6: 24, 7: 40}, wrap={6, 7})
    cells = PriceCells()
    prices = dec.api_prices(policy)
    served = {a.name: a for a in traffic or []}
    prices.update({name: a.price for name, a in served.items() if a.price is not None})
    ledger_api = {r.backend: r for r in api_rows}
    first = s.header(["API backend", "model", "input $/Mtok", "cached input $/Mtok", "output $/Mtok",
                      "price-table version", "status"])
    names = list(prices) + [n for n in served if n not in prices] + [
        b for b in ledger_api if b not in prices and b not in served]
    for name in names:
        a = served.get(name)
        backend = a.backend if a is not None else name
        p, lr = prices.get(name), ledger_api.get(backend)
        spec = policy.backends.get(backend)
        model = p.model if p else (spec.model if spec is not None else (lr.served_model if lr else None))
        version = (lr.price_table_version if lr and lr.price_table_version else price_table_version())
        if p is not None:
            status = "priced" + (f" by policy version {', '.join(a.policy_versions)}" if a and a.policy_versions
                                 else "")
            vals = (p.input_per_mtok, p.cached_per_mtok, p.output_per_mtok)
        else:
            status = ("unpriced: not in the policy" if spec is None else "unpriced: no price in litellm's map or "
                      "the policy") + " (its tokens count at $0; type prices here to include them)"
            vals = (None, None, None)
        row = s.next_row
        s.add([name, model] + [_c(v, fmt=USD_MTOK, input=True, note=EDIT_ME) for v in vals] + [version, status])
        cells.api[name] = tuple(s.ref(row, c) for c in (3, 4, 5))
    s.table("prices", first)
    s.add([])
    head = s.header(["engine backend", "device kind", "device $/hour (whole engine)", "devices", "price source",
                     "in the Decision sheet's total"])
    by_name = {e.backend: e for e in engines}
    policy_engines = [n for n, b in policy.backends.items() if b.kind == "engine"]
    in_decision = list(by_name) if engines else policy_engines
    for name in policy_engines + [n for n in by_name if n not in policy_engines]:
        e, spec = by_name.get(name), policy.backends.get(name)
        if e is not None:
            price = e.device_hour_usd or 0.0
            source = "ledger (latest recorded)" if e.device_hour_usd is not None else "ledger: no price recorded"
            kind, devices = e.device_kind, e.devices
        else:
            price, source = device_hour_usd(spec), "policy"
            kind, devices = device_kind(spec), device_count(spec)
        row = s.next_row
        s.add([name, kind, _c(price, fmt=USD_HOUR, input=True, note=EDIT_ME), _c(devices, fmt=INT), source,
               "yes" if name in in_decision else "no (no traffic or uptime in the window)"])
        cells.engine[name] = s.ref(row, 3)
        cells.engine_value[name] = price
    s.table("engine_prices", head)
    cells.decision_engines = in_decision
    cells.first_engine = next(iter(cells.engine), None)
    return s, cells


# --------------------------------------------------------------------------------------------- In-house

ENGINE_HEAD = ["engine backend", "device kind", "devices", "requests", "prompt tokens", "cached prompt tokens",
               "completion tokens", "tokens", "up (paid) s", "busy s", "measured utilisation",
               "throughput s (busy time behind the tokens)", "tokens/s (engine)", "tokens/s per device",
               "charged USD (ledger rows)", "paid USD", "busy USD", "cost of idle USD", "$/Mtok paid",
               "$/Mtok @ measured utilisation"] + [f"$/Mtok @ {u:.0%}" for u in UTILISATION_LEVELS] + [
               "charged at list rate USD (busy_cost_usd)", "paid not charged at list rate USD (idle, allocated)"]


@dataclass
class EngineCells:
    tokens: list[str] = field(default_factory=list)
    throughput_s: list[str] = field(default_factory=list)
    up_s: list[str] = field(default_factory=list)
    busy_s: list[str] = field(default_factory=list)
    prices: list[str] = field(default_factory=list)  # each engine's $/hour cell (Prices sheet), same order
    has_uptime: bool = False


def _mtok_formula(price: str, tps: str, util: str) -> str:
    return (f'=IF(AND(ISNUMBER({tps}),N({tps})>0,N({price})>0,ISNUMBER({util}),N({util})>0),'
            f'{price}/({tps}*3600*{util})*1000000,"{NA}")')


def in_house_sheet(engines: list[EngineRow], hours: list[HourRow], prices: PriceCells) -> tuple[Sheet, EngineCells]:
    s = Sheet("In-house")
    out = EngineCells()
    first = s.header(ENGINE_HEAD)
    for e in engines:
        r = s.next_row
        a = {name: f"{col_letter(i + 1)}{r}" for i, name in enumerate(
            ["backend", "kind", "devices", "requests", "prompt", "cached", "completion", "tokens", "up", "busy",
             "util", "tput", "tps", "tpsd", "charged", "paid", "busyusd", "idle", "mtok"])}
        price = prices.engine[e.backend]
        up = e.has_uptime
        tps = e.tokens_per_s
        row: list[Cell] = [
            Cell(e.backend), Cell(e.device_kind), _c(e.devices, fmt=INT), _c(e.requests, fmt=INT),
            _c(e.prompt_tokens, fmt=INT), _c(e.cached_prompt_tokens, fmt=INT), _c(e.completion_tokens, fmt=INT),
            _c(e.tokens, f"={a['prompt']}+{a['completion']}", INT),
            _c(e.up_seconds, fmt=DEC) if up else Cell(NO_UPTIME),
            _c(e.busy_seconds, fmt=DEC) if up else Cell(NO_UPTIME),
            _c(_num(e.utilisation), f'=IF(N({a["up"]})>0,N({a["busy"]})/{a["up"]},"{NA}")', PCT),
            _c(e.throughput_seconds, fmt=DEC),
            _c(_num(tps), f'=IF(N({a["tput"]})>0,{a["tokens"]}/{a["tput"]},"{NA}")', DEC),
            _c(_num(e.tokens_per_device_s), f'=IF(ISNUMBER({a["tps"]}),{a["tps"]}/MAX({a["devices"]},1),"{NA}")',
               DEC),
            _c(e.charged_usd, fmt=USD),
            _c(e.paid_usd, fmt=USD) if up else Cell(NO_UPTIME),
            _c(e.busy_usd, fmt=USD) if up else Cell(NO_UPTIME),
            _c(e.idle_usd, f"={a['paid']}-{a['busyusd']}", USD, bold=True) if up else Cell(NO_UPTIME),
            _c(_num(e.usd_per_mtok_measured),
               f'=IF(AND(ISNUMBER({a["paid"]}),{a["tokens"]}>0),{a["paid"]}/{a["tokens"]}*1000000,"{NA}")', USD_MTOK),
        ]
        u = e.utilisation
        row.append(_c(_num(e.usd_per_mtok_at(u) if u is not None else None),
                      _mtok_formula(price, a["tps"], a["util"]), USD_MTOK))
        for lvl in UTILISATION_LEVELS:
            row.append(_c(_num(e.usd_per_mtok_at(lvl)), _mtok_formula(price, a["tps"], repr(lvl)), USD_MTOK))
        row.append(_c(e.busy_list_usd, fmt=USD))
        list_ref = f"{col_letter(len(row))}{r}"
        row.append(_c(e.unallocated_usd, f"={a['paid']}-{list_ref}", USD) if up else Cell(NO_UPTIME))
        s.add(row)
        out.tokens.append(s.ref(r, 8))
        out.throughput_s.append(s.ref(r, 12))
        out.up_s.append(s.ref(r, 9))
        out.busy_s.append(s.ref(r, 10))
        out.prices.append(price)
        out.has_uptime = out.has_uptime or up
    s.table("in_house", first)
    s.add([])
    s.add([Cell("cost of idle = paid device-hours not spent on requests: (up − busy) seconds at the engine's "
                "hourly price; $/Mtok = device $/hour (Prices sheet) / (tokens/s × 3600 × utilisation) × 1e6",
                bold=False)])
    s.add([Cell("chargeback: 'charged at list rate' is each request's device seconds × the engine's $/hour "
                "(busy_cost_usd: the same request always costs the same); 'charged USD' divides that by the "
                "utilisation of its moment; the paid time not charged at list rate (idle and unattributed "
                "work) is allocated to teams in proportion to their device seconds", bold=False)])
    s.add([])
    _tiering_table(s, engines, prices)
    s.add([])
    hfirst = s.header(["hour (UTC)", "engine backend", "up s", "busy s", "utilisation"])
    for h in hours:
        r = s.next_row
        s.add([h.hour + ":00", h.backend, _c(h.up_seconds, fmt=DEC), _c(h.busy_seconds, fmt=DEC),
               _c("" if h.utilisation is None else h.utilisation, f'=IF(C{r}>0,D{r}/C{r},"")', PCT)])
    s.table("busy_by_hour", hfirst)
    return s, out


TIERING_HEAD = ["KV tiering: engine", "restored from host", "restored from disk", "restored tokens",
                "prefill tokens", "prefill s (TTFT)", "prefill tokens/s", "device s saved", "USD saved (list rate)"]


def _tiering_table(s: Sheet, engines: list[EngineRow], prices: PriceCells) -> None:
    """What KV tiering saved per engine: tokens restored instead of recomputed, and the device time (and its
    price) that prefilling them would have taken at the engine's measured prefill rate."""
    first = s.header(TIERING_HEAD)
    for e in engines:
        r = s.next_row
        b, c, d, pt, ps, tps, sec = (f"{col_letter(i)}{r}" for i in range(2, 9))
        price, rate = prices.engine[e.backend], prices.engine_value.get(e.backend, 0.0)
        saved = e.tiering_saved_seconds
        s.add([Cell(e.backend), _c(e.restored_host_tokens, fmt=INT), _c(e.restored_disk_tokens, fmt=INT),
               _c(e.restored_tokens, f"={b}+{c}", INT), _c(e.prefill_tokens, fmt=INT),
               _c(e.prefill_seconds, fmt=DEC),
               _c(_num(e.prefill_tps), f'=IF(N({ps})>0,{pt}/{ps},"{NA}")', DEC),
               _c(_num(saved), f'=IF(AND(ISNUMBER({tps}),N({tps})>0),{d}/{tps},"{NA}")', DEC),
               _c(_num(None if saved is None else saved * rate / 3600.0),
                  f'=IF(ISNUMBER({sec}),{sec}*N({price})/3600,"{NA}")', USD, bold=True)])
    s.table("kv_tiering", first)
    s.add([])
    s.add([Cell("KV tiering: restored tokens (kv_restored_*_tokens, also counted cached) were not recomputed; "
                "device s saved = restored / prefill tokens/s, measured on rows that restored nothing (computed "
                "prompt tokens / TTFT, which holds queueing: an upper bound on the saving)", bold=False)])


# --------------------------------------------------------------------------------------------- Decision


@dataclass
class DecisionCells:
    utilisation: str = ""
    utilisation_value: float = DEFAULT_UTILISATION
    result: dec.DecisionResult | None = None
    rows: dict[str, str] = field(default_factory=dict)  # key → the value cell's address


def _sum(refs: list[str]) -> str:
    return f"SUM({','.join(refs)})" if refs else "0"


def decision_sheet(x: dec.DecisionInputs, prices: PriceCells, eng: EngineCells) -> tuple[Sheet, DecisionCells]:
    s = Sheet("Decision", widths={3: 64}, wrap={3})
    out = DecisionCells()
    measured = x.utilisation
    u = measured if measured is not None else DEFAULT_UTILISATION
    res = dec.decide(x, utilisation=u)
    out.result, out.utilisation_value = res, u
    first = s.header(["line", "value", "what it means"])
    ref: dict[str, str] = {}

    def line(key: str, label: str, value: Any, formula: str | None, fmt: str | None, why: str, **kw: Any) -> None:
        r = s.next_row
        ref[key] = f"$B${r}"
        s.add([Cell(label, bold=kw.pop("bold", False)), _c(value, formula, fmt, **kw), Cell(why)])

    def r_(key: str) -> str:
        return ref[key]

    s.add([Cell("INPUTS", bold=True)])
    line("wh", "window hours", x.window_hours, None, DEC,
         "hours the ledger window covers: first to last request or engine-uptime interval, one window for "
         "traffic and paid engine time (at least a minute)" + (f". {x.window_note}" if x.window_note else ""),
         bold=x.window_note is not None)
    line("m", "monthly scale", x.monthly_scale, f"=IF({r_('wh')}>0,{HOURS_PER_MONTH:g}/{r_('wh')},0)", "0.0000",
         f"{HOURS_PER_MONTH:g} hours a month / window hours: the window's traffic scaled to a month")
    line("P", "prompt tokens in the window", x.prompt_tokens, None, INT, "all traffic, served by anyone")
    line("C", "cached prompt tokens in the window", x.cached_prompt_tokens, None, INT,
         "prompt tokens the API's prefix cache served (priced at the cached rate)")
    line("O", "completion tokens in the window", x.completion_tokens, None, INT, "generated tokens")
    refp = x.reference
    ri = prices.api.get(refp.backend) if refp else None
    line("refname", "reference API", refp.backend if refp else NA, None, None,
         "the API the all-API scenario is priced at (the first route's counterfactual with a price)")
    for key, label, val, i in (("ri", "reference input $/Mtok", refp.input_per_mtok if refp else None, 0),
                               ("rc", "reference cached input $/Mtok", refp.cached_per_mtok if refp else None, 1),
                               ("ro", "reference output $/Mtok", refp.output_per_mtok if refp else None, 2)):
        line(key, label, _num(val), f"={ri[i]}" if ri else None, USD_MTOK, "from the Prices sheet (edit it there)")
    hour_refs = [prices.engine[n] for n in prices.decision_engines]
    line("H", "engines' total $/hour", x.device_hour_usd, f"={_sum(hour_refs)}", USD_HOUR,
         "the engines' device $/hour, all together (Prices sheet)")
    tok, tput = _sum(eng.tokens), _sum(eng.throughput_s)
    def weighted(weights: list[str]) -> str | None:
        if len(weights) < 2:
            return f"={r_('H')}"
        products = "+".join(f"N({w})*{p}" for w, p in zip(weights, eng.prices, strict=True))
        return f"=IF({_sum(weights)}>0,({products})/{_sum(weights)},{r_('H')})"

    line("Hup", "$/hour of an engine up-hour", x.up_price, weighted(eng.up_s), USD_HOUR,
         "each engine's $/hour weighted by its up time (one engine: its $/hour)")
    line("Hbusy", "$/hour of a busy engine-hour", x.busy_price,
         weighted(eng.busy_s if eng.has_uptime else eng.throughput_s), USD_HOUR,
         "each engine's $/hour weighted by its busy time (one engine: its $/hour)")
    line("T", "measured tokens/s", _num(x.tokens_per_s),
         f'=IF(AND({tput}>0,{tok}>0),{tok}/{tput},"{NA}")' if eng.tokens else None, DEC,
         "the engines' tokens (prompt + completion) per busy second (In-house sheet)")
    line("U_up", "engines' up (paid) hours in the window", x.up_hours,
         f"={_sum(eng.up_s)}/3600" if eng.up_s else None, DEC, "measured up time: an engine is paid while it runs")
    line("U_busy", "engines' busy hours in the window", x.busy_hours,
         f"={_sum(eng.busy_s)}/3600" if eng.busy_s else None, DEC, "the engines' own forward-pass time")
    line("mu", "measured utilisation", _num(measured),
         f'=IF({r_("U_up")}>0,{r_("U_busy")}/{r_("U_up")},"{NA}")', PCT, "busy hours / up hours")
    unote = ("edit me: the utilisation all-hosted is priced at (defaults to the measured one)" if measured is not None
             else f"edit me: no utilisation was measured (no engine_uptime rows), so {DEFAULT_UTILISATION:.0%} is "
                  "assumed")
    line("U", "utilisation to price all-hosted at", u, None, PCT,
         "the busy fraction of the paid device-hours; edit it to see all-hosted and the verdict move",
         input=True, note=unote, bold=True)

    s.add([])
    s.add([Cell("OUTPUTS (per month)", bold=True)])
    m = r_("m")
    line("p", "monthly prompt tokens", res.monthly_prompt_tokens, f"={r_('P')}*{m}", INT, "prompt tokens × scale")
    line("c", "monthly cached prompt tokens", res.monthly_cached_tokens, f"={r_('C')}*{m}", INT,
         "cached prompt tokens × scale")
    line("o", "monthly completion tokens", res.monthly_completion_tokens, f"={r_('O')}*{m}", INT,
         "completion tokens × scale")
    line("tok", "monthly tokens", res.monthly_prompt_tokens + res.monthly_completion_tokens,
         f"={r_('p')}+{r_('o')}", INT, "prompt + completion")
    p, c, o, tk, H, T, U = (r_(k) for k in ("p", "c", "o", "tok", "H", "T", "U"))
    Hup, Hbusy = r_("Hup"), r_("Hbusy")
    line("api", "all-API USD/month", _num(res.all_api_usd),
         (f"=(({p}-{c})*N({r_('ri')})+{c}*N({r_('rc')})+{o}*N({r_('ro')}))/1000000" if refp else None), USD,
         "every token at the reference API's prices: uncached prompt, cached prompt and output per Mtok", bold=True)
    bhn = None if not x.tokens_per_s else (res.monthly_prompt_tokens + res.monthly_completion_tokens) / (
        x.tokens_per_s * 3600.0)
    line("bhn", "busy device-hours needed/month", _num(bhn), f'=IF(N({T})>0,{tk}/({T}*3600),"{NA}")', DEC,
         "monthly tokens / (tokens/s × 3600): engine hours of actual work")
    B = r_("bhn")
    line("hosted", "all-hosted USD/month", _num(res.all_hosted_usd),
         f'=IF(AND(ISNUMBER({B}),N({U})>0),{B}/{U}*{Hbusy},"{NA}")', USD,
         "busy hours needed / utilisation (idle hours are paid too) × $/hour of a busy engine-hour", bold=True)
    line("apipart", "current mix: API part USD/month", res.current_mix_usd - x.up_hours * x.monthly_scale
         * x.up_price, None, USD, "API-served tokens at their own backends' prices (table below) × scale")
    line("engpart", "current mix: engines part USD/month", x.up_hours * x.monthly_scale * x.up_price,
         f"={r_('U_up')}*{m}*{Hup}", USD, "the engines' measured up hours × scale × $/hour of an up-hour")
    line("mix", "current mix USD/month", res.current_mix_usd, f"={r_('apipart')}+{r_('engpart')}", USD,
         "what the traffic as routed costs: API part + engines part", bold=True)
    line("idle", "cost of idle USD/month", res.idle_usd, f"=({r_('U_up')}*{Hup}-{r_('U_busy')}*{Hbusy})*{m}", USD,
         "paid device-hours not spent on requests: (up − busy) hours × scale, each at its engine's $/hour",
         bold=True)
    A = r_("api")
    line("beu", "break-even utilisation", _num(res.break_even_utilisation),
         f'=IF(AND(ISNUMBER({B}),ISNUMBER({A})),IF({A}<>0,{B}*{Hbusy}/{A},"{NA}"),"{NA}")', PCT,
         "the utilisation at which all-hosted costs what all-API costs; hosting wins above it", bold=True)
    verdict = {"hosting": "hosting is cheaper", "API": "the API is cheaper", "unknown": "unknown"}[res.cheaper]
    HO = r_("hosted")
    line("verdict", "at the utilisation above", verdict,
         f'=IF(AND(ISNUMBER({HO}),ISNUMBER({A})),IF({HO}<{A},"hosting is cheaper","the API is cheaper"),"unknown")',
         None, "above the break-even utilisation hosting is cheaper; at or below it the API is", bold=True)
    line("bet", "break-even daily tokens", _num(res.break_even_daily_tokens),
         f'=IF(AND(ISNUMBER({A}),{tk}>0,{H}>0),IF({A}<>0,{H}*24/({A}/{tk}),"{NA}"),"{NA}")', INT,
         "tokens a day at which the API costs what running the engines around the clock costs")
    line("cap", "capacity tokens/day", _num(res.capacity_daily_tokens), f'=IF(N({T})>0,{T}*86400,"{NA}")', INT,
         "the engines' tokens a day at 100% busy: hosting only wins between break-even and this")
    s.table("decision", first)

    s.add([])
    tfirst = s.header(["API traffic in the window", "prompt tokens", "cached prompt tokens", "completion tokens",
                       "input $/Mtok", "cached input $/Mtok", "output $/Mtok", "USD in the window"])
    cost_refs = []
    for a in x.api:
        r = s.next_row
        pr = prices.api[a.name]
        pv = a.price
        cost = 0.0 if pv is None else dec._per_mtok(a.prompt_tokens - a.cached_prompt_tokens, pv.input_per_mtok) + \
            dec._per_mtok(a.cached_prompt_tokens, pv.cached_per_mtok) + dec._per_mtok(a.completion_tokens,
                                                                                         pv.output_per_mtok)
        s.add([a.name, _c(a.prompt_tokens, fmt=INT), _c(a.cached_prompt_tokens, fmt=INT),
               _c(a.completion_tokens, fmt=INT),
               _c(_num(pv.input_per_mtok if pv else None), f"=IF(ISNUMBER({pr[0]}),{pr[0]},\"{NA}\")", USD_MTOK),
               _c(_num(pv.cached_per_mtok if pv else None), f"=IF(ISNUMBER({pr[1]}),{pr[1]},\"{NA}\")", USD_MTOK),
               _c(_num(pv.output_per_mtok if pv else None), f"=IF(ISNUMBER({pr[2]}),{pr[2]},\"{NA}\")", USD_MTOK),
               _c(cost, f"=((B{r}-C{r})*N(E{r})+C{r}*N(F{r})+D{r}*N(G{r}))/1000000", USD)])
        cost_refs.append(f"$H${r}")
    s.table("decision_api", tfirst)
    # the API part's formula, now that the table's cells have addresses
    row_i = int(ref["apipart"].split("$")[-1]) - 1
    s.rows[row_i][1].formula = f"={m}*{_sum(cost_refs)}"
    out.utilisation = s.ref(int(ref["U"].split("$")[-1]), 2)
    out.rows = {k: s.ref(int(v.split("$")[-1]), 2) for k, v in ref.items()}
    return s, out


# --------------------------------------------------------------------------------------------- Ladder


def ladder_sheet(bench: str | None, prices: PriceCells, d: DecisionCells) -> Sheet:
    from gateway.pricing import UTILISATION_FLOOR

    s = Sheet("Ladder", widths={7: 50}, wrap={7})
    from gateway.reports.bench_data import CHEAPER_MODEL

    path = bench or str(CHEAPER_MODEL)  # the packaged copy of the benchmark's figures, as `report ladder` reads
    head = ["rung", "output tok/s", "× previous", "× first", "$/Mtok @ 100%", "$/Mtok @ the Decision utilisation",
            "note"]
    try:
        from gateway.reports import ladder

        if prices.first_engine is None:
            raise ValueError("no engine backend to price a device-hour with")
        price_ref, price = prices.engine[prices.first_engine], prices.engine_value[prices.first_engine]
        rungs = ladder.ladder_rows(ladder.load_stack(path), price, d.utilisation_value)
    except Exception as exc:  # noqa: BLE001 - a missing module, file or bad benchmark: explain, do not fail
        first = s.header(["ladder"])
        s.add([f"no ladder: {type(exc).__name__}: {exc}"])
        s.table("ladder", first)
        return s
    first = s.header(head)
    U = d.utilisation
    uu = f"MAX(MIN({U},1),{UTILISATION_FLOOR!r})"
    for rg in rungs:
        r = s.next_row
        s.add([rg.rung, _c(rg.tok_s, fmt=DEC), _c(rg.speedup_vs_previous, fmt=X), _c(rg.speedup_vs_first, fmt=X),
               _c(rg.usd_per_mtok_full, f"={price_ref}/(B{r}*3600)*1000000", USD_MTOK),
               _c(_num(rg.usd_per_mtok_measured), f"={price_ref}/(B{r}*3600*{uu})*1000000", USD_MTOK), rg.note])
    s.table("ladder", first)
    s.add([])
    s.add([(f"benchmark: {path}; device $/hour from the Prices sheet ({prices.first_engine}); utilisation from "
            f"the Decision sheet, floored at {UTILISATION_FLOOR:.0%} and capped at 100%; "
            "$/Mtok = device $/hour / (tok/s × 3600 × utilisation) × 1e6 (output tokens)")])
    return s


# --------------------------------------------------------------------------------------------- Notes


def notes_sheet(window_text: str, database: str, policy_source: str, summary: Summary, x: dec.DecisionInputs,
                generated: datetime, definitions: list[str]) -> Sheet:
    s = Sheet("Notes", widths={2: 100}, wrap={2})
    first = s.header(["item", "value"])
    s.add(["window", window_text])
    s.add(["generated (UTC)", generated.strftime("%Y-%m-%d %H:%M:%S")])
    s.add(["database", database])
    s.add(["policy", policy_source])
    for line in x.pricing[1:]:
        s.add(["", line.strip()])
    if x.window_note:
        s.add(["window length", x.window_note])
    s.add(["first request", summary.first.isoformat() if summary.first else NA])
    s.add(["last request", summary.last.isoformat() if summary.last else NA])
    s.add(["served at $0 with no cost note", _c(summary.zero_cost_unexplained, fmt=INT)])
    for note, n in sorted(summary.notes.items()):
        s.add([f"rows with cost_note {note}", _c(n, fmt=INT)])
    for n in x.notes:
        if n != x.window_note:  # already its own row above
            s.add(["decision note", n])
    s.add([])
    s.add([Cell("definitions", bold=True)])
    for para in definitions:
        s.add(["", para])
    s.table("notes", first)
    return s
