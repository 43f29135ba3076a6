"""gateway/backends/translate.py's pure parts: what a completions request becomes as chat, and chat answers back."""
from __future__ import annotations

import pytest

from gateway.backends.translate import (
    chat_chunk_to_completion,
    chat_to_completion,
    completions_to_chat,
    untranslatable,
)

BASE = {"model": "m", "prompt": "Say hi", "max_tokens": 5}


@pytest.mark.parametrize(("extra", "param"), [
    ({}, None), ({"echo": False}, None), ({"suffix": ""}, None), ({"best_of": 2, "n": 2}, None),
    ({"prompt": ["one prompt"]}, None), ({"logprobs": None}, None),
    ({"echo": True}, "echo"), ({"logprobs": 0}, "logprobs"), ({"suffix": "end"}, "suffix"),
    ({"best_of": 3, "n": 2}, "best_of"), ({"prompt": [1, 2]}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [[1, 2]]}, "prompt"),
])
def test_untranslatable(extra, param) -> None:
    assert untranslatable({**BASE, **extra}) == param


def test_completions_to_chat_carries_everything_but_the_prompt_fields() -> None:
    body = {**BASE, "prompt": ["Say hi"], "temperature": 0.5, "n": 2, "best_of": 2, "stop": ["\n"], "seed": 7,
            "user": "u", "stream": True, "stream_options": {"include_usage": True}, "echo": False, "top_k": 3}
    assert completions_to_chat(body) == {
        "model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5, "temperature": 0.5,
        "n": 2, "stop": ["\n"], "seed": 7, "user": "u", "stream": True, "stream_options": {"include_usage": True},
        "top_k": 3}


def test_a_chat_completion_as_a_text_completion() -> None:
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    chat = {"id": "chatcmpl-abc", "object": "chat.completion", "created": 1, "model": "m", "usage": usage,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"},
                        {"index": 1, "message": {"role": "assistant", "content": None}, "finish_reason": "length"}],
            "switchyard": {"device_seconds": 0.1}}
    assert chat_to_completion(chat) == {
        "id": "cmpl-abc", "object": "text_completion", "created": 1, "model": "m", "usage": usage,
        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop"},
                    {"index": 1, "text": "", "logprobs": None, "finish_reason": "length"}],
        "switchyard": {"device_seconds": 0.1}}


def test_chat_chunks_as_completion_chunks() -> None:
    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    role_only = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert chat_chunk_to_completion(role_only) is None  # nothing to say
    text = chat_chunk_to_completion({**head, "choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": None})
    assert text == {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": "m", "usage": None,
                    "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]}
    end = chat_chunk_to_completion({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    assert end["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    last = chat_chunk_to_completion({**head, "choices": [], "usage": usage, "switchyard": {"device_seconds": 1}})
    assert last["choices"] == [] and last["usage"] == usage and last["switchyard"] == {"device_seconds": 1}
