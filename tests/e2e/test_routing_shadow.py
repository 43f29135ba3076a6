"""Shadow evaluation through a real gateway: sampled requests are mirrored to the other backend, judged, and
labelled in shadow_evals; the mirrored and judge calls are ledger rows billed to no key.

Backends are stand-ins speaking the OpenAI wire format: `weak` answers "tok0 tok1", `strong` answers
"tok0 tok1 tok2" (their default completion lengths differ), so a reference decides which one was right.
The judge stand-in answers like a grading model would: "yes" when the candidate answer it is shown is
"tok0 tok1 tok2", "no" otherwise, and an unusable "maybe" for requests that mention bananas.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.shadow.runner import SHADOW_EVENTS
from gateway.testing.standin import run_standin, standin_stats
from router.model import DifficultyModel
from router.train import train_default_model
from tests.e2e.conftest import MASTER_KEY, free_port, ledger_rows, run_gateway

EASY = "What is the capital of France?"
HARD = "Prove that there are infinitely many primes of the form 4k+3, and explain each step rigorously."
RIGHT_FOR_STRONG, RIGHT_FOR_WEAK = "tok0 tok1 tok2", "Tok0  tok1"  # the exact judge folds case and spaces

POLICY = """
backends:
  weak:
    kind: engine
    model: small
    api_base: {weak}
    gpu_hour_usd: 2.0
  strong:
    kind: litellm
    model: openai/gpt-4o
    api_base: {strong}
    api_key_env: STANDIN_API_KEY
    input_usd_per_mtok: 2.5
    output_usd_per_mtok: 10
  grader:
    kind: litellm
    model: openai/gpt-4o-mini
    api_base: {judge}
    api_key_env: STANDIN_API_KEY
    input_usd_per_mtok: 0.15
    output_usd_per_mtok: 0.6
routes:
  assistant:
    strategy: difficulty
    easy: weak
    hard: strong
    threshold: {threshold}
    model_path: {model}
    shadow: {{sample_rate: 1.0, judge: exact}}
  judged:
    strategy: difficulty
    easy: weak
    hard: strong
    threshold: {threshold}
    model_path: {model}
    shadow: {{sample_rate: 1.0, judge: grader}}
"""


def judge_app() -> Starlette:
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        question = body["messages"][-1]["content"]
        verdict = ("maybe" if "banana" in question
                   else "Yes." if "Candidate answer:\ntok0 tok1 tok2\n" in question else "no")
        return JSONResponse({"id": "chatcmpl-judge", "object": "chat.completion", "created": int(time.time()),
                             "model": body.get("model", "judge"),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": verdict}}],
                             "usage": {"prompt_tokens": len(question.split()), "completion_tokens": 1,
                                       "total_tokens": len(question.split()) + 1}})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture
def judge():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(judge_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def model_and_threshold(tmp_path_factory):
    path = tmp_path_factory.mktemp("router") / "default.npz"
    train_default_model(path)
    model = DifficultyModel.load(path)
    easy, hard = model.score(EASY), model.score(HARD)
    assert easy < hard
    return path, round((easy + hard) / 2, 4)


@pytest.fixture
def gateway(judge, model_and_threshold, tmp_path, monkeypatch):
    monkeypatch.setenv("STANDIN_API_KEY", "sk-standin")
    model, threshold = model_and_threshold
    with run_standin(engine_extension=True, default_max_tokens=2) as weak, \
            run_standin(default_max_tokens=3) as strong:
        policy = POLICY.format(weak=weak, strong=strong, judge=judge, model=model, threshold=threshold)
        with run_gateway(policy, tmp_path) as running:
            running.standins = {"weak": weak, "strong": strong}
            yield running


def settle(gateway) -> None:
    """Wait for the shadow workers, then make every row durable."""
    gw = gateway.gw
    gateway.call(gw.services.shadow.drain)
    gateway.call(gw.services.shadow.writer.flush)
    gateway.call(gw.services.ledger.flush)


def shadow_rows(gateway) -> dict[str, dict]:
    import sqlalchemy as sa

    from gateway import db

    engine = sa.create_engine(db.sync_url(gateway.config.database_url))
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM shadow_evals ORDER BY id"))]
    engine.dispose()
    return {r["request_id"]: r for r in rows}


def test_exact_judge_labels_plain_and_streamed_requests(gateway) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    # Easy → served by weak, mirrored to strong; the reference is strong's answer.
    easy = client.chat.completions.with_raw_response.create(
        model="assistant", messages=[{"role": "user", "content": EASY}],
        metadata={"reference": RIGHT_FOR_STRONG, "team": "docs"})
    assert easy.headers["x-switchyard-backend"] == "weak" and easy.parse().choices[0].message.content == "tok0 tok1"
    # The reference is ours: the upstream saw the rest of metadata only.
    assert standin_stats(gateway.standins["weak"])["last_payload"]["metadata"] == {"team": "docs"}
    # Hard and streamed → served by strong, mirrored to weak; here the reference matches weak's answer.
    stream = client.chat.completions.with_raw_response.create(
        model="assistant", messages=[{"role": "system", "content": "Be rigorous."},
                                     {"role": "user", "content": HARD}],
        stream=True, metadata={"reference": RIGHT_FOR_WEAK})
    assert stream.headers["x-switchyard-backend"] == "strong"
    assert "".join(c.choices[0].delta.content or "" for c in stream.parse() if c.choices) == "tok0 tok1 tok2"
    # The completions endpoint, easy, with the reference in the body.
    done = client.completions.with_raw_response.create(model="assistant", prompt=EASY,
                                                       extra_body={"metadata": {"reference": RIGHT_FOR_STRONG}})
    # No reference: nothing to compare with, so not sampled.
    client.chat.completions.create(model="assistant", messages=[{"role": "user", "content": EASY}])
    settle(gateway)

    labels = shadow_rows(gateway)
    ids = [easy.headers["x-request-id"], stream.headers["x-request-id"], done.headers["x-request-id"]]
    assert sorted(labels) == sorted(ids)  # two workers: labels may land in either order
    first, second, third = (labels[i] for i in ids)
    assert (first["served_backend"], first["weak_correct"], first["strong_correct"]) == ("weak", False, True)
    assert (second["served_backend"], second["weak_correct"], second["strong_correct"]) == ("strong", True, False)
    assert (third["weak_correct"], third["strong_correct"], third["endpoint"]) == (False, True, "completions")
    assert first["weak_answer"] == "tok0 tok1" and first["strong_answer"] == "tok0 tok1 tok2"
    assert json.loads(second["messages_json"])[0] == {"role": "system", "content": "Be rigorous."}
    assert second["prompt_text"] == "Be rigorous.\n" + HARD and third["messages_json"] is None
    assert {r["judge"] for r in labels.values()} == {"exact"}
    assert all(r["route"] == "assistant" and r["model_version"] and r["difficulty"] is not None
               and (r["easy_backend"], r["hard_backend"]) == ("weak", "strong") for r in labels.values())

    ledger = ledger_rows(gateway.config.database_url)
    served = [r for r in ledger if r["route_reason"] != "shadow"]
    mirrored = [r for r in ledger if r["route_reason"] == "shadow"]
    assert len(served) == 4 and {r["api_key_id"] for r in served} != {None}
    assert sorted(r["backend"] for r in mirrored) == ["strong", "strong", "weak"]
    assert all(r["status"] == "ok" and r["api_key_id"] is None and r["team"] is None and r["cost_usd"] > 0
               and r["route"] == "assistant" for r in mirrored)
    assert {r["backend"]: r["cost_basis"] for r in mirrored} == {"strong": "api_price", "weak": "gpu_amortized"}


def test_backend_judge_labels_with_yes_no_and_skips_unclear_verdicts(gateway) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
    unclear_before = SHADOW_EVENTS.labels("judge_unclear")._value.get()
    plain = client.chat.completions.with_raw_response.create(
        model="judged", messages=[{"role": "user", "content": EASY}])  # no reference needed
    client.chat.completions.create(model="judged", messages=[{"role": "user", "content": "hi, banana?"}])
    settle(gateway)

    labels = shadow_rows(gateway)
    assert list(labels) == [plain.headers["x-request-id"]]  # the unclear verdict left no label
    row = labels[plain.headers["x-request-id"]]
    assert (row["judge"], row["weak_correct"], row["strong_correct"]) == ("grader", False, True)
    assert SHADOW_EVENTS.labels("judge_unclear")._value.get() == unclear_before + 1

    ledger = ledger_rows(gateway.config.database_url)
    judge_rows = [r for r in ledger if r["route_reason"] == "shadow_judge"]
    assert len(judge_rows) == 4 and {r["backend"] for r in judge_rows} == {"grader"}  # two answers × two requests
    assert all(r["api_key_id"] is None and r["cost_usd"] > 0 for r in judge_rows)
    assert len([r for r in ledger if r["route_reason"] == "shadow"]) == 2
