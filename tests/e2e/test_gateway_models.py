"""`GET /v1/models/{id}`: the openai SDK's `models.retrieve`, for every route of the live policy."""
from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import MASTER_KEY, run_gateway
from tests.e2e.policy_builder import litellm, policy


def policy_text(standin: str) -> str:
    return policy(backends={"api": litellm(standin)}, routes={"chat-mini": {"backend": "api"},
                                                              "team/assistant": {"backend": "api"}})


def test_models_retrieve(standin, tmp_path) -> None:
    with run_gateway(policy_text(standin), tmp_path) as gateway:
        client = openai.OpenAI(base_url=gateway.base_url, api_key=MASTER_KEY, max_retries=0)
        listed = {m.id: m for m in client.models.list()}
        for name in ("chat-mini", "team/assistant"):  # a route name may hold a slash
            model = client.models.retrieve(name)
            assert (model.id, model.object, model.owned_by) == (name, "model", "switchyard")
            assert model.created == listed[name].created
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve("no-such-route")
        assert err.value.code == "model_not_found" and "chat-mini" in err.value.message
        anonymous = openai.OpenAI(base_url=gateway.base_url, api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.retrieve("chat-mini")
