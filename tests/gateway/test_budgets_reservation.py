"""Budget reservation parts: the book's spend lookup (failures are 503s, retried, never cached), the request's
token demand, its worst case over a chain, and the policy's rules for what cannot be priced."""
from __future__ import annotations

import asyncio

import pytest

from gateway import admission, budgets
from gateway.budgets import BudgetBook, reservation_usd
from gateway.keys import KeyInfo
from gateway.policy import BackendSpec, BudgetSpec, CapabilitySpec, PolicyError, parse_policy
from gateway.pricing import DEFAULT_ENGINE_RESERVE_USD_PER_MTOK, TokenDemand, prices_for, worst_case
from openai_wire import APIError

KEY = KeyInfo(id="key_b", team="t", budget_usd=1.0, rpm=None, tpm=None, is_admin=False)


class FlakyLedger:
    """A spend lookup that fails `failures` times (as a database blip does), then answers `spent`."""

    def __init__(self, failures: int, spent: float = 0.25, delay_s: float = 0.0) -> None:
        self.failures, self.spent, self.delay_s, self.calls = failures, spent, delay_s, 0

    async def __call__(self, key_id: str) -> float:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.calls <= self.failures:
            raise ConnectionRefusedError("database unreachable")
        return self.spent


async def test_a_failed_spend_lookup_is_a_503_and_is_retried_by_the_next_request() -> None:
    ledger = FlakyLedger(failures=2)
    book = BudgetBook(ledger)
    for _ in range(2):
        with pytest.raises(APIError) as err:
            await book.reserve(KEY, 0.1)
        assert err.value.status == 503 and err.value.headers["Retry-After"] == "2"
        assert err.value.body()["error"]["code"] == "budget_unavailable"
    reservation = await book.reserve(KEY, 0.1)  # the database is back: loaded, not the cached failure
    assert reservation is not None and ledger.calls == 3
    assert (book.spent(KEY.id), book.reserved(KEY.id)) == (0.25, pytest.approx(0.1))


async def test_concurrent_requests_share_one_lookup_and_a_leaving_one_does_not_cancel_it() -> None:
    ledger = FlakyLedger(failures=0, delay_s=0.05)
    book = BudgetBook(ledger)
    leaving = asyncio.create_task(book.reserve(KEY, 0.1))
    staying = [asyncio.create_task(book.reserve(KEY, 0.1)) for _ in range(3)]
    await asyncio.sleep(0.01)
    leaving.cancel()  # its client went away while the spend was loading
    results = await asyncio.gather(*staying)
    assert all(r is not None for r in results) and ledger.calls == 1
    assert book.reserved(KEY.id) == pytest.approx(0.3)


async def test_a_hanging_lookup_times_out_as_a_503_and_a_late_answer_is_kept() -> None:
    book = BudgetBook(FlakyLedger(failures=0, delay_s=0.3), load_timeout_s=0.05)
    with pytest.raises(APIError) as err:
        await book.reserve(KEY, 0.1)
    assert err.value.status == 503
    await asyncio.sleep(0.35)
    assert book.spent(KEY.id) == 0.25  # the lookup finished after all: the next request needs no other


async def test_a_nan_budget_or_estimate_refuses() -> None:
    book = BudgetBook(FlakyLedger(failures=0))
    nan_key = KeyInfo(id="key_n", team="t", budget_usd=float("nan"), rpm=None, tpm=None, is_admin=False)
    for key, estimate in ((nan_key, 0.1), (KEY, float("nan"))):
        with pytest.raises(APIError) as err:
            await book.reserve(key, estimate)
        assert err.value.status == 429


async def test_settle_releases_once() -> None:
    book = BudgetBook(FlakyLedger(failures=0, spent=0.0))
    reservation = await book.reserve(KEY, 0.4)
    book.settle(reservation, 0.1)
    book.settle(reservation, 0.1)
    assert (book.spent(KEY.id), book.reserved(KEY.id)) == (pytest.approx(0.1), 0.0)


# ---------------------------------------------------------------- what a request may produce


def _chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(("body", "endpoint", "expected"), [
    (_chat(max_tokens=10, n=100), "chat", (100, 1, 10)),
    (_chat(max_completion_tokens=7, max_tokens=30), "chat", (1, 1, 30)),  # an upstream may honour either
    (_chat(max_output_tokens=5), "chat", (1, 1, None)),  # not chat's own field: an upstream may ignore it
    (_chat(best_of=3, n=2), "chat", (3, 1, None)),
    ({"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 4, "best_of": 5, "n": 2}, "completions", (5, 3, 4)),
    ({"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 4}, "completions", (1, 2, 4)),
    ({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}, "completions", (1, 1, 4)),
    ({"model": "m", "prompt": "abc", "max_completion_tokens": 9}, "completions", (1, 1, None)),
    ({"model": "m", "input": "x", "max_output_tokens": 20}, "responses", (1, 1, 20)),
])
def test_token_demand_counts_choices_prompts_and_the_endpoints_own_cap(body, endpoint, expected) -> None:
    demand = admission.token_demand(body, endpoint, 12)
    assert (demand.choices, demand.prompts, demand.max_tokens) == expected
    assert demand.sequences == expected[0] * expected[1] and demand.prompt_tokens == 12


def test_embeddings_count_every_input_and_produce_nothing() -> None:
    body = {"model": "m", "input": ["a" * 30, "b" * 30, "c" * 30]}
    one = admission.estimate_prompt_tokens({"model": "m", "input": "a" * 30}, "embeddings")
    assert admission.estimate_prompt_tokens(body, "embeddings") == 3 * one
    demand = admission.token_demand(body, "embeddings", 33)
    assert demand.sequences == 0 and demand.prompt_tokens == 33


# ---------------------------------------------------------------- the worst case over a chain

MINI = BackendSpec(name="mini", kind="litellm", model="openai/gpt-4o-mini")
CUSTOM = BackendSpec(name="custom", kind="litellm", model="openai/no-such-model", input_usd_per_mtok=1,
                     output_usd_per_mtok=2)
UNPRICED = BackendSpec(name="mystery", kind="litellm", model="openai/no-such-model")
ENGINE = BackendSpec(name="eng", kind="engine", model="e", api_base="http://127.0.0.1:1/v1", gpu_hour_usd=2.0)
FREE_ENGINE = BackendSpec(name="free", kind="engine", model="e", api_base="http://127.0.0.1:1/v1")


def test_worst_case_multiplies_outputs_by_prompts_and_choices() -> None:
    p = prices_for(MINI)
    worst = worst_case([MINI], TokenDemand(100, choices=4, prompts=3, max_tokens=10))
    assert worst.priceable and worst.priced_usd == pytest.approx(100 * p.input_per_token + 120 * p.output_per_token)
    engine = worst_case([ENGINE], TokenDemand(100, choices=4, prompts=3, max_tokens=10))
    assert engine.priced_usd == pytest.approx((400 + 120) * DEFAULT_ENGINE_RESERVE_USD_PER_MTOK * 1e-6)
    both = worst_case([ENGINE, MINI], TokenDemand(100, choices=4, prompts=3, max_tokens=10))
    assert both.priced_usd == max(worst.priced_usd, engine.priced_usd)


def test_without_max_tokens_the_models_output_limit_is_the_bound() -> None:
    p = prices_for(MINI)
    worst = worst_case([MINI], TokenDemand(10, choices=2))
    assert worst.priceable and worst.priced_usd == pytest.approx(10 * p.input_per_token + 2 * 16384 * p.output_per_token)
    declared = CUSTOM.model_copy(update={"capabilities": CapabilitySpec(max_context=1000)})
    assert worst_case([declared], TokenDemand(10)).priced_usd == pytest.approx(10e-6 + 1000 * 2e-6)


def test_what_cannot_be_priced_says_why() -> None:
    unbounded = worst_case([CUSTOM], TokenDemand(10))
    assert not unbounded.priceable and unbounded.unbounded and not unbounded.unpriced
    assert unbounded.estimate_usd == pytest.approx(10e-6 + 4096 * 2e-6)  # the guess before ceilings existed
    for spec in (UNPRICED, FREE_ENGINE):
        worst = worst_case([MINI, spec], TokenDemand(10, max_tokens=5))
        assert worst.unpriced and f"'{spec.name}'" in worst.unpriced[0]
        assert worst.priced_usd == worst_case([MINI], TokenDemand(10, max_tokens=5)).priced_usd
    assert worst_case([CUSTOM], TokenDemand(10, outputs=False)).priceable  # embeddings have no outputs to bound


def test_the_policy_decides_what_an_unpriced_request_reserves() -> None:
    unbounded = worst_case([CUSTOM], TokenDemand(10))
    assert reservation_usd(unbounded, BudgetSpec(), "max_tokens") == unbounded.estimate_usd
    assert reservation_usd(unbounded, BudgetSpec(unpriced_reservation_usd=0.5), "max_tokens") == 0.5
    with pytest.raises(APIError) as err:
        reservation_usd(unbounded, BudgetSpec(refuse_unpriced=True), "max_tokens")
    assert err.value.status == 400 and err.value.body()["error"]["param"] == "max_tokens"
    priced_part = worst_case([MINI, UNPRICED], TokenDemand(10 ** 6, max_tokens=5))
    assert reservation_usd(priced_part, BudgetSpec(unpriced_reservation_usd=0.01), "max_tokens") == \
        priced_part.priced_usd > 0.01  # never less than what the priced backends may charge
    with pytest.raises(APIError) as err:
        reservation_usd(priced_part, BudgetSpec(refuse_unpriced=True), "max_tokens")
    assert err.value.status == 403 and err.value.body()["error"]["code"] == "unpriced_backend"
    priced = worst_case([MINI], TokenDemand(10, max_tokens=5))
    assert reservation_usd(priced, BudgetSpec(refuse_unpriced=True), "max_tokens") == priced.priced_usd


POLICY = """
backends: {a: {kind: litellm, model: openai/gpt-4o-mini}}
routes: {r: {backend: a}}
"""


@pytest.mark.parametrize(("budgets_yaml", "problem"), [
    ("{unpriced_reservation_usd: .inf}", "finite"),
    ("{unpriced_reservation_usd: .nan}", "finite"),
    ("{unpriced_reservation_usd: 0}", "greater than 0"),
    ("{unpriced_reservation_usd: -1}", "greater than 0"),
    ("{refuse_unpriced: maybe}", "refuse_unpriced"),
    ("{unpriced_ceiling: 1}", "did you mean 'unpriced_reservation_usd'"),
])
def test_the_budgets_section_is_validated(budgets_yaml: str, problem: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(POLICY + f"budgets: {budgets_yaml}\n", "p.yaml")
    assert "budgets." in str(err.value) and problem in str(err.value)


def test_the_budgets_section_is_optional() -> None:
    assert parse_policy(POLICY, "p.yaml").budgets == BudgetSpec()
    policy = parse_policy(POLICY + "budgets: {unpriced_reservation_usd: 0.25, refuse_unpriced: false}\n", "p.yaml")
    assert policy.budgets.unpriced_reservation_usd == 0.25
    assert budgets.SPEND_RETRY_AFTER_S >= 1
