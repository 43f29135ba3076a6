"""CPU cost of two steps every /v1 answer takes (issue 33 #6's refactor of them): the x-switchyard-* headers set
on an answer (`proxy._answer_headers`, against its previous one-header-at-a-time form) and the hot path's dispatch
(`HotPathApp`, which now answers an APIError with the app's handler, against a copy without that `try`).

    python -m bench.answer_headers [--rounds 7] [--calls 20000]

CPU time (time.process_time) per call, the two forms alternated each round (a noisy shared machine hits both),
medians; prints a table and files the run in bench/results/answer_headers/<machine>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from datetime import UTC, datetime

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from bench import store
from bench.machine_info import cpu_model
from gateway import errors, proxy
from gateway.hot_path import HotPathApp
from gateway.ledger.record import LedgerRecord
from openai_wire import APIError

RECORD = LedgerRecord(request_id="req_bench", created_at=datetime.now(UTC), endpoint="chat")
RECORD.backend, RECORD.route_reason, RECORD.cost_usd = "eng", "fixed", 0.000123


def headers_one_by_one(response: Response, record: LedgerRecord) -> Response:
    """The previous _answer_headers, as it was: each header through MutableHeaders."""
    if record.backend:
        response.headers["x-switchyard-backend"] = record.backend
    if record.replica:
        response.headers["x-switchyard-replica"] = record.replica
    if record.route_reason:
        response.headers["x-switchyard-route-reason"] = record.route_reason
    response.headers["x-switchyard-cost-usd"] = proxy.usd_header(record.cost_usd)
    response.headers["x-request-id"] = record.request_id
    return response


class HotPathWithoutHandler(HotPathApp):
    """The previous dispatch: no exception handler around the endpoint."""

    async def _dispatch(self, scope: dict, receive, send) -> None:
        scope["app"] = self.app
        response = await self._handlers[scope["path"]](Request(scope, receive))
        await response(scope, receive, send)


def headers_us(fn, calls: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        fn(Response(b"{}", media_type="application/json"), RECORD)
    return (time.process_time() - started) / calls * 1e6


async def dispatch_us(cls: type[HotPathApp], calls: int) -> float:
    async def endpoint(request: Request) -> Response:
        return Response(b"{}")

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        return None

    app = Starlette(exception_handlers={APIError: errors.answer})
    hot = cls(app, {"/v1/x": endpoint}, lambda inner: inner)
    started = time.process_time()
    for _ in range(calls):
        await hot({"type": "http", "method": "POST", "path": "/v1/x", "headers": [], "query_string": b""},
                  receive, send)
    return (time.process_time() - started) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--out", default=None, help="write this JSON file instead of filing the run")
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"headers, one by one (before)": [], "headers, raw pairs (after)": [],
                                    "dispatch, no handler (before)": [], "dispatch, with handler (after)": []}
    for _ in range(args.rounds):
        runs["headers, one by one (before)"].append(headers_us(headers_one_by_one, args.calls))
        runs["headers, raw pairs (after)"].append(headers_us(proxy._answer_headers, args.calls))
        runs["dispatch, no handler (before)"].append(asyncio.run(dispatch_us(HotPathWithoutHandler, args.calls)))
        runs["dispatch, with handler (after)"].append(asyncio.run(dispatch_us(HotPathApp, args.calls)))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    lines = [f"CPU: {cpu_model()}; {args.rounds} alternated rounds of {args.calls} calls; CPU us per call (median)",
             "", "| step | us / call |", "|---|---:|", *(f"| {name} | {us:.2f} |" for name, us in medians.items())]
    print("\n".join(lines))
    saved = store.save("answer_headers", {"rounds": args.rounds, "calls": args.calls, "medians_us": medians,
                                          "runs_us": runs}, markdown="\n".join(lines) + "\n", out=args.out)
    print(f"\nsaved {saved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
