"""SSE chunk rendering (hosted/render.py): the per-choice template of a text delta renders exactly the bytes the
general chunk() path renders, whatever the text."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hosted.render import ChunkWriter

TEXTS = ["Paris", " the", 'say "hi"', "back\\slash", "new\nline\ttab", "\x00\x1f control", "é ü 中文 🙂",
         "\u2028\u2029", "", "{\"index\":0}"]


def _writer(kind: str, include_usage: bool) -> ChunkWriter:
    plan = SimpleNamespace(kind=kind, request_id="cmpl-abc", include_usage=include_usage, tools=None, logprobs=None)
    choices = [SimpleNamespace(index=i, job=SimpleNamespace(echo_text="")) for i in range(3)]
    gen = SimpleNamespace(plan=plan, choices=choices)
    return ChunkWriter(SimpleNamespace(model_name="m\"od\x00el"), gen)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_text_chunk_template_renders_what_chunk_renders(kind, include_usage):
    writer = _writer(kind, include_usage)
    for index in (0, 2):
        for text in TEXTS:
            if kind == "chat":
                choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
            else:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
            want = writer.chunk([choice])
            got = writer.text_chunk(index, text)
            assert got == want
            body = json.loads(got.removeprefix(b"data: ").removesuffix(b"\n\n"))
            assert (body["choices"][0]["delta"]["content"] if kind == "chat" else body["choices"][0]["text"]) == text
