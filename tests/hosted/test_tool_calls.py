"""hosted/tool_calls.py without a model: the output parser (whole and streamed in any split), the prompt side
(native templates and the documented fallback), and the grammars for each tool_choice."""
from __future__ import annotations

import json

import pytest

from hosted import tool_calls
from hosted.tool_calls import ToolCallParser, call_text, prepare_messages

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]

OUTPUT = ("Let me check.\n" + call_text("get_weather", {"city": "Paris}\n</tool_call>", "days": 2}) + "\n"
          + call_text("add", {"a": 1, "b": {"deep": [1, 2]}}))


def _reassemble(pieces: list[str]) -> tuple[str, list[dict]]:
    parser = ToolCallParser()
    content, calls = "", {}
    for d in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += d.content
        for tc in d.tool_calls:
            slot = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
            slot["arguments"] += tc["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_parser_reassembles_calls_in_any_split(size):
    pieces = [OUTPUT[i:i + size] for i in range(0, len(OUTPUT), size)]
    content, calls = _reassemble(pieces)
    assert content.strip() == "Let me check."
    assert [c["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris}\n</tool_call>", "days": 2}
    assert json.loads(calls[1]["arguments"]) == {"a": 1, "b": {"deep": [1, 2]}}
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]


def test_parser_plain_text_and_a_cut_short_call():
    content, calls = _reassemble(["Just text, with a < sign and <tool"])
    assert content == "Just text, with a < sign and <tool" and calls == []
    parser = ToolCallParser()
    parser.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b')
    parser.finish()
    assert parser.calls[0].name == "add" and not parser.calls[0].complete
    assert parser.calls[0].arguments == '{"a": 1, "b'  # what was generated; finish_reason says "length"
    assert parser.content is None


def test_fallback_prompt_renders_tools_and_history():
    messages = [{"role": "system", "content": "Be helpful."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
                {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    out = prepare_messages(messages, TOOLS, "required", native=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be helpful.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in out[0]["content"] and "You must call at least one function." in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": call_text("get_weather", {"city": "Paris"})}
    assert out[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>\n'
                                                 '<tool_response>\nsunny\n</tool_response>'}
    assert len(out) == 4
    named = prepare_messages(messages[1:2], TOOLS, "add", native=False)
    assert named[0]["role"] == "system" and "You must call the function 'add'." in named[0]["content"]


def test_native_prompt_keeps_messages_and_parses_arguments():
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}]
    out = prepare_messages(messages, TOOLS, "auto", native=True)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'  # not mutated
    assert tool_calls.template_supports_tools("{% if tools %}x{% endif %}")
    assert not tool_calls.template_supports_tools("{% for message in messages %}{{ message['content'] }}{% endfor %}")


def test_grammars_per_tool_choice():
    xgr = pytest.importorskip("xgrammar")
    vocab = [chr(c) for c in range(32, 127)] + ["\n", "</s>"]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[len(vocab) - 1])
    compiler = xgr.GrammarCompiler(info, max_threads=1)

    def accepts(fmt, text):
        m = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt})))
        return m.accept_string(text) and m.accept_token(len(vocab) - 1)

    weather = call_text("get_weather", {"city": "Rome"})
    add = call_text("add", {"a": 1, "b": 2})
    bad = call_text("add", {"a": "x", "b": 2})
    auto = tool_calls.tool_format(TOOLS, "auto", parallel=False)
    assert accepts(auto, "no call at all") and accepts(auto, "ok " + weather) and not accepts(auto, bad)
    required = tool_calls.tool_format(TOOLS, "required", parallel=True)
    assert accepts(required, weather + "\n" + add) and not accepts(required, "text") and not accepts(required, bad)
    assert not accepts(tool_calls.tool_format(TOOLS, "required", parallel=False), weather + "\n" + add)
    named = tool_calls.tool_format(TOOLS, "add", parallel=True)
    assert accepts(named, add) and not accepts(named, weather)
    text = {"type": "json_schema", "json_schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                   "required": ["x"]}}
    both = tool_calls.tool_format(TOOLS, "auto", parallel=False, text_format=text)
    assert accepts(both, '{"x": 3}') and accepts(both, add) and not accepts(both, "free text")
