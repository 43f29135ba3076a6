"""Sampler math, without a model."""
from __future__ import annotations

import torch

from hosted.sampler import Sampler, apply_penalties, top_k_top_p_filter
from hosted.sampling_params import SamplingParams
from hosted.sequence import Sequence


def seq(params: SamplingParams, outputs: list[int] | None = None, seed: int | None = None) -> Sequence:
    s = Sequence(request_id="x", token_ids=[0] + list(outputs or []), num_prompt_tokens=1, params=params, arrival=0)
    if seed is not None:
        s.generator = torch.Generator().manual_seed(seed)
    return s


def test_penalties_follow_openai_formula():
    logits = torch.zeros(2, 5)
    out = apply_penalties(logits, [[1, 1, 3], []], presence=torch.tensor([0.5, 0.5]),
                          frequency=torch.tensor([0.25, 0.25]))
    # token 1: 2 * 0.25 + 0.5; token 3: 0.25 + 0.5; others untouched; the empty row is untouched.
    assert out[0].tolist() == [0.0, -1.0, 0.0, -0.75, 0.0]
    assert out[1].tolist() == [0.0] * 5


def test_penalties_only_count_generated_tokens():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    s = Sequence(request_id="x", token_ids=[2, 2, 2, 1], num_prompt_tokens=3, params=params, arrival=0)
    # The prompt's token 2 is not penalised, the generated token 1 is: 2.0 stays the best.
    assert Sampler(torch.device("cpu"))(logits, [s]).token_ids == [2]
    s2 = Sequence(request_id="y", token_ids=[0, 2], num_prompt_tokens=1, params=params, arrival=0)
    assert Sampler(torch.device("cpu"))(logits, [s2]).token_ids == [1]


def test_top_k_top_p_filter():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = lambda k, p: torch.isfinite(top_k_top_p_filter(logits, torch.tensor([k]), torch.tensor([p])))[0].tolist()
    assert kept(0, 1.0) == [True] * 4
    assert kept(2, 1.0) == [True, True, False, False]
    assert kept(0, 0.5) == [True, False, False, False]  # the top token alone reaches 0.5
    assert kept(0, 0.8) == [True, True, False, False]
    assert kept(0, 0.81) == [True, True, True, False]
    assert kept(1, 0.9) == [True, False, False, False]


def test_sampling_matches_the_distribution():
    """4,000 unseeded draws in one batch: frequencies within a few standard errors of the softmax."""
    torch.manual_seed(0)
    target = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits = torch.log(target.clamp(min=1e-30)).repeat(4000, 1) * 2.0  # temperature 2 undoes the *2
    params = SamplingParams(temperature=2.0)
    tokens = torch.tensor(Sampler(torch.device("cpu"))(logits, [seq(params)] * 4000).token_ids)
    freq = torch.bincount(tokens, minlength=5).float() / 4000
    se = (target * (1 - target) / 4000).sqrt()
    assert ((freq - target).abs() <= 4 * se + 1e-9).all(), freq
    assert freq[4] == 0


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(6, 50)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    alone = Sampler(torch.device("cpu"))(logits[2:3], [seq(params, seed=7)]).token_ids[0]
    others = [seq(SamplingParams(temperature=1.0)) for _ in range(6)]
    others[2] = seq(params, seed=7)
    others[4] = seq(SamplingParams(temperature=0.0))
    assert Sampler(torch.device("cpu"))(logits, others).token_ids[2] == alone


def test_logprobs_are_raw_model_logprobs():
    logits = torch.randn(2, 30)
    params = SamplingParams(temperature=0.5, logprobs=True, top_logprobs=3, frequency_penalty=1.5)
    s = seq(params, outputs=[int(logits[0].argmax())], seed=1)
    res = Sampler(torch.device("cpu"))(logits[:1], [s])
    raw = torch.log_softmax(logits[0], -1)
    chosen, top = res.logprobs[0]
    assert abs(chosen - raw[res.token_ids[0]].item()) < 1e-6
    best = raw.topk(3)
    assert [t for t, _ in top] == best.indices.tolist()
    assert all(abs(v - w) < 1e-6 for (_, v), w in zip(top, best.values.tolist()))


def test_greedy_tokens_take_the_first_index_on_ties_like_argmax():
    from hosted.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(0, 3, (64, 500), generator=gen).float()  # many tied maxima per row
    logits[5, 7] = float("nan")  # NaN wins, as in argmax
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[5] == 7


def test_greedy_tokens_on_views_and_inference_tensors():
    """The CPU path reads the logits through numpy: strided views and inference-mode tensors give argmax's ids,
    as int64, and the logits are left as they were."""
    from hosted.sampler import greedy_tokens

    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        logits = torch.randn(6, 1000, generator=gen)
        before = logits.clone()
        for view in (logits, logits[:, ::3], logits[::2], logits.t().contiguous().t()):
            got = greedy_tokens(view)
            assert got.dtype == torch.int64
            assert torch.equal(got, view.argmax(dim=-1))
        assert torch.equal(logits, before)
    bf16 = torch.randn(3, 50, generator=gen).bfloat16()  # not fp32: torch's own reduction
    assert torch.equal(greedy_tokens(bf16), bf16.argmax(dim=-1))
