"""Streamed /v1/completions: every chunk's text is a string on both backend kinds, so SDK code that joins the
chunks' texts works (litellm ends such a stream with `text: null`)."""
from __future__ import annotations

import openai

from tests.e2e.conftest import MASTER_KEY, run_gateway
from tests.e2e.policy_builder import engine, litellm, policy


def policy_text(standin: str) -> str:
    return policy(backends={"api": litellm(standin, model="openai/gpt-3.5-turbo-instruct", input_usd_per_mtok=1.5,
                                           output_usd_per_mtok=2),
                            "eng": engine(standin, model="e", gpu_hour_usd=1)},
                  routes={"via-litellm": {"backend": "api"}, "via-engine": {"backend": "eng"}})


def test_streamed_completion_texts_join(standin, tmp_path) -> None:
    with run_gateway(policy_text(standin), tmp_path) as gateway:
        client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
        for model in ("via-litellm", "via-engine"):
            chunks = list(client.completions.create(model=model, prompt="hello there", max_tokens=5, stream=True))
            texts = [choice.text for chunk in chunks for choice in chunk.choices]
            assert texts and all(isinstance(t, str) for t in texts), (model, texts)
            assert "".join(texts).split() == ["tok0", "tok1", "tok2", "tok3", "tok4"]
