"""Shadow evaluation parts that need no gateway: sampling, the bounded queue, verdicts, and the durable writer."""
from __future__ import annotations

import random
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import sqlalchemy as sa

from gateway import db
from gateway.backends.resilience import BreakerRegistry
from gateway.ledger.record import ShadowRecord
from gateway.ledger.writer import ShadowEvalWriter
from gateway.policy import parse_policy
from gateway.routing import Decision
from gateway.shadow.judge import judge_messages, normalise, parse_verdict
from gateway.shadow.reference import without_reference
from gateway.shadow.runner import SHADOW_EVENTS, ShadowRunner

POLICY = """
backends:
  local: {kind: engine, model: tiny, api_base: "http://127.0.0.1:9/v1"}
  mini: {kind: litellm, model: openai/gpt-4o-mini, input_usd_per_mtok: 1, output_usd_per_mtok: 2}
routes:
  exact:
    strategy: difficulty
    easy: local
    hard: mini
    shadow: {sample_rate: 0.25}
  judged:
    strategy: difficulty
    easy: local
    hard: mini
    shadow: {sample_rate: 1.0, judge: mini}
"""


def runner(tmp_path: Path, **kw) -> ShadowRunner:
    writer = ShadowEvalWriter(f"sqlite:///{tmp_path}/l.db", tmp_path / "shadow-spool.jsonl")
    return ShadowRunner(SimpleNamespace(), BreakerRegistry(), SimpleNamespace(), writer, **kw)


def chat(reference: str | None = None) -> dict:
    body = {"model": "exact", "messages": [{"role": "user", "content": "q"}], "stream": True,
            "stream_options": {"include_usage": True}}
    if reference is not None:
        body["metadata"] = {"reference": reference}
    return body


def test_sampling_rate_and_exact_judge_needs_a_reference(tmp_path: Path) -> None:
    policy = parse_policy(POLICY, "p.yaml")
    r = runner(tmp_path, rng=random.Random(7))
    decision = Decision(chain=["local", "mini"], reason="difficulty_easy", difficulty=0.2, threshold=0.5,
                        model_version="v1")
    tickets = [r.ticket(f"req_{i}", policy.routes["exact"], policy, chat("ref"), "chat", decision)
               for i in range(4000)]
    share = sum(t is not None for t in tickets) / len(tickets)
    assert 0.22 < share < 0.28
    t = next(t for t in tickets if t is not None)
    assert t.payload == {"model": "exact", "messages": [{"role": "user", "content": "q"}]}  # not streamed, no ref
    assert (t.reference, t.difficulty, t.threshold, t.model_version) == ("ref", 0.2, 0.5, "v1")
    assert all(r.ticket("x", policy.routes["exact"], policy, chat(), "chat", decision) is None for _ in range(200))
    judged = r.ticket("y", policy.routes["judged"], policy, chat(), "chat", decision)
    assert judged is not None and judged.reference is None  # a judge backend needs no reference


async def test_a_full_queue_drops_and_counts_instead_of_blocking(tmp_path: Path) -> None:
    policy = parse_policy(POLICY, "p.yaml")
    r = runner(tmp_path, max_queue=2, workers=0)
    db.upgrade(r.writer.database_url)
    await r.start()
    decision = Decision(chain=["local", "mini"], reason="difficulty_easy")
    ticket = r.ticket("req", policy.routes["judged"], policy, chat(), "chat", decision)
    dropped = SHADOW_EVENTS.labels("dropped_queue_full")._value.get()
    for _ in range(5):
        r.submit(ticket, "local", "answer")  # returns at once, whatever the queue holds
    assert r.queue_depth == 2
    assert SHADOW_EVENTS.labels("dropped_queue_full")._value.get() == dropped + 3
    r.drain_timeout_s = 0.1
    await r.aclose()  # nobody works the queue: shutdown gives up after the drain timeout
    r.submit(ticket, "local", "late")  # after close: counted, not raised
    assert r.queue_depth == 2


def test_verdicts_and_normalisation() -> None:
    assert parse_verdict("Yes.") is True and parse_verdict(" no, it is wrong") is False
    assert parse_verdict("**YES**") is True
    assert parse_verdict("maybe") is None and parse_verdict("") is None and parse_verdict("yesterday") is None
    assert normalise("  Paris\n is  the capital ") == normalise("paris is the CAPITAL")
    msgs = judge_messages("user: q", "a", "r")
    assert msgs[0]["role"] == "system" and "Reference answer:\nr" in msgs[1]["content"]
    assert "Reference answer" not in judge_messages("user: q", "a", None)[1]["content"]


def test_reference_is_removed_from_upstream_payloads() -> None:
    body = {"model": "m", "metadata": {"reference": "r", "team": "t"}}
    assert without_reference(body) == {"model": "m", "metadata": {"team": "t"}}
    assert without_reference({"model": "m", "metadata": {"reference": "r"}}) == {"model": "m"}
    assert body["metadata"] == {"reference": "r", "team": "t"}  # the caller's body is untouched
    untouched = {"model": "m", "metadata": {"team": "t"}}
    assert without_reference(untouched) is untouched


def record(i: int) -> ShadowRecord:
    return ShadowRecord(request_id=f"req_{i}", created_at=datetime(2025, 5, 1, tzinfo=UTC), route="a",
                        endpoint="chat.completions", prompt_text=f"prompt {i}", messages_json="[]",
                        easy_backend="local", hard_backend="mini", served_backend="local", weak_answer="w",
                        strong_answer="s", weak_correct=i % 2 == 0, strong_correct=True, judge="exact",
                        difficulty=0.1 * i, threshold=0.5, model_version="v", policy_version="p")


async def test_writer_spools_during_an_outage_and_replays_into_shadow_evals(tmp_path: Path,
                                                                              migrated_db_url: str) -> None:
    spool = tmp_path / "shadow-spool.jsonl"
    down = ShadowEvalWriter("postgresql://nobody@127.0.0.1:1/none", spool, retry_initial_s=60)
    await down.start()
    for i in range(3):
        down.submit(record(i))
    await down.flush()
    await down.close(timeout_s=5)
    left = [p for p in (spool, spool.with_name(spool.name + ".replaying")) if p.exists()]
    assert down.stats.spooled == 3 and left  # durable on disk (a failed last replay leaves it as .replaying)

    url = migrated_db_url  # SQLite and PostgreSQL
    up = ShadowEvalWriter(url, spool)
    await up.start()  # replays the previous process's spool first
    up.submit(record(3))
    await up.flush()
    await up.close()
    engine = sa.create_engine(db.sync_url(url))
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT request_id, weak_correct, difficulty FROM shadow_evals "
                                    "ORDER BY request_id")).all()
    engine.dispose()
    assert [r[0] for r in rows] == ["req_0", "req_1", "req_2", "req_3"]
    assert [bool(r[1]) for r in rows] == [True, False, True, False] and rows[2][2] == 0.2
    assert not any(p.exists() for p in left) and up.stats.replayed == 3
