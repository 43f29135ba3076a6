"""Chat templates of real models render exactly as transformers' apply_chat_template renders them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hosted.tokenizer import ChatTemplateError, Tokenizer
from tests.hosted.serving_helpers import byte_level_bpe, chat_templates, write_tokenizer_dir

transformers = pytest.importorskip("transformers")

# (template key, bos_token, eos_token) as the models' tokenizer_config.json files set them.
FAMILIES = {
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama3_2": ("<|begin_of_text|>", "<|eot_id|>"),
    "qwen2_5": (None, "<|im_end|>"),
    "mistral": ("<s>", "</s>"),
    "zephyr": ("<s>", "</s>"),
}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a <city> & its 'region' — ünïcode",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello, how are you?"}],
    "system": [
        {"role": "system", "content": "  You are terse.  \n"},
        {"role": "user", "content": "Name a colour. 你好 😀"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "I'm doing great. How can I help you today?"},
        {"role": "user", "content": "I'd like to show off how chat templating works!\n\n"},
    ],
    "none_content": [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": None, "tool_calls": None},
        {"role": "user", "content": "again"},
    ],
}


@pytest.fixture(scope="module")
def base_tokenizer():
    return byte_level_bpe()


def _pair(tmp_path: Path, base, family: str, template: str | None = None) -> tuple[Tokenizer, object]:
    bos, eos = FAMILIES.get(family, ("<s>", "</s>"))
    d = write_tokenizer_dir(tmp_path / family, base, chat_template=template or chat_templates()[family],
                            bos_token=bos, eos_token=eos)
    return Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))


def _hf_render(hf, messages, **kwargs) -> str:
    return hf.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_templates_render_like_transformers(tmp_path, base_tokenizer, family):
    ours, hf = _pair(tmp_path, base_tokenizer, family)
    checked = 0
    for name, conv in CONVERSATIONS.items():
        for add_generation_prompt in (False, True):
            try:
                expected = _hf_render(hf, conv, add_generation_prompt=add_generation_prompt,
                                      date_string="26 Jul 2024")
            except Exception:  # noqa: BLE001 - the template itself refuses this conversation: we must refuse too
                with pytest.raises(ChatTemplateError):
                    ours.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                             date_string="26 Jul 2024")
                continue
            got = ours.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           date_string="26 Jul 2024")
            assert got == expected, (family, name, add_generation_prompt)
            # Token ids too: the rendered text is encoded without adding special tokens, as transformers does.
            assert ours.encode(got, add_special_tokens=False) == hf(expected, add_special_tokens=False)["input_ids"]
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("family", ["llama3_2", "qwen2_5"])
def test_tools_and_tool_calls_render_like_transformers(tmp_path, base_tokenizer, family):
    ours, hf = _pair(tmp_path, base_tokenizer, family)
    conv = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
    ]
    for messages in (conv[:2], conv):
        expected = _hf_render(hf, messages, tools=TOOLS, add_generation_prompt=True)
        got = ours.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
        assert got == expected
    # tojson must not HTML-escape (Jinja's built-in filter would turn '<' into \u003c).
    assert "<city> & its 'region'" in got


def test_strftime_now_default_date_matches_transformers(tmp_path, base_tokenizer):
    ours, hf = _pair(tmp_path, base_tokenizer, "llama3_2")
    conv = CONVERSATIONS["single"]
    got = ours.apply_chat_template(conv, add_generation_prompt=True)
    assert got == _hf_render(hf, conv, add_generation_prompt=True)
    assert "Today Date: 26 Jul 2024" not in got  # the template's fallback was not used


def test_raise_exception_reaches_the_caller(tmp_path, base_tokenizer):
    ours, _ = _pair(tmp_path, base_tokenizer, "mistral")
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_generation_blocks_and_loop_controls(tmp_path, base_tokenizer):
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
                "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
                "{% else %}[{{ m['role'] }}] {{ m['content'] }}\n{% endif %}{% endfor %}")
    ours, hf = _pair(tmp_path, base_tokenizer, "custom", template)
    conv = [{"role": "system", "content": "skip"}] + CONVERSATIONS["multi_turn"]
    assert ours.apply_chat_template(conv, add_generation_prompt=False) == _hf_render(hf, conv)


def test_named_template_list_and_jinja_file(tmp_path, base_tokenizer):
    templates = [{"name": "default", "template": "D:{{ messages[0]['content'] }}"},
                 {"name": "tool_use", "template": "T:{{ tools | length }}:{{ messages[0]['content'] }}"}]
    d = write_tokenizer_dir(tmp_path / "named", base_tokenizer, chat_template=templates)  # type: ignore[arg-type]
    ours = Tokenizer.from_dir(d)
    msgs = [{"role": "user", "content": "x"}]
    assert ours.apply_chat_template(msgs) == "D:x"
    assert ours.apply_chat_template(msgs, tools=TOOLS) == "T:1:x"
    # chat_template.jinja (transformers>=4.47 layout) takes precedence over the config entry.
    (d / "chat_template.jinja").write_text("J:{{ bos_token }}{{ messages[0]['content'] }}")
    assert Tokenizer.from_dir(d).apply_chat_template(msgs) == "J:<|begin_of_text|>x"


def test_missing_template_and_empty_messages_are_clear_errors(tmp_path, base_tokenizer):
    d = write_tokenizer_dir(tmp_path / "none", base_tokenizer, chat_template=None)
    ours = Tokenizer.from_dir(d)
    assert not ours.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0]['content'] }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError, match="at least one message"):
        Tokenizer.from_dir(d).apply_chat_template([])


def test_template_cannot_escape_the_sandbox(tmp_path, base_tokenizer):
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    ours, _ = _pair(tmp_path, base_tokenizer, "evil", template)
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template([{"role": "user", "content": "x"}])
