"""A checkpoint's tokenizer: `tokenizer.json` via `tokenizers`, its special tokens, and its chat template.

The chat template is rendered the way Hugging Face `transformers` renders it (`apply_chat_template`): a
sandboxed Jinja2 environment with trim_blocks/lstrip_blocks, the `loopcontrols` extension, a `tojson` filter
that does not HTML-escape, `raise_exception` and `strftime_now` globals, the named special tokens
(`bos_token`, `eos_token`, ...) as variables, and `{% generation %}` blocks accepted. The rendered text is
encoded without adding special tokens (the template writes them itself), as transformers does.

Decoding is exactly `tokenizers.Tokenizer.decode`; `clean_up_tokenization_spaces` from tokenizer_config.json
is not applied (it rewrites text non-locally, which exact streaming cannot honour).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# TokenizerError lives in the leaf hosted/checkpoint.py (the GGUF tokenizer raises it too); imported from here
# as always.
from hosted.checkpoint import TokenizerError, is_gguf, resolve_model_path

# The named special tokens transformers passes to every chat template.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (raise_exception) or failed to render."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as a serialized AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


@lru_cache(maxsize=1)
def _bytes_to_unicode_inverse() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-character map used by the ByteLevel pre-tokenizer/decoder."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def _decoder_types(decoder_json: Any) -> set[str]:
    if not isinstance(decoder_json, dict):
        return set()
    found = {str(decoder_json.get("type"))}
    for child in decoder_json.get("decoders") or []:
        found |= _decoder_types(child)
    return found


class _GenerationBlock(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (assistant-mask markers) and render the body as is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; templates expect plain JSON (as transformers provides).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc}") from exc


def _drop_none(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    # transformers drops None-valued keys (e.g. OpenAI's content=None) before rendering: templates test
    # `'key' in message`, and would otherwise print "None".
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"chat messages must be objects, got {type(message).__name__}")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


class Tokenizer:
    """Encode/decode with a checkpoint's tokenizer.json, and render its chat template."""

    def __init__(self, hf_tokenizer: _HFTokenizer, *, special_tokens: Mapping[str, str] | None = None,
                 chat_templates: Mapping[str, str] | None = None, eos_token_ids: Sequence[int] = (),
                 name: str = "tokenizer") -> None:
        self.name = name
        self._tok = hf_tokenizer
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._templates_src: dict[str, str] = dict(chat_templates or {})
        self._templates: dict[str, jinja2.Template] = {}
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        added = hf_tokenizer.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_ids: frozenset[int] = frozenset(added)

        decoder_json = json.loads(hf_tokenizer.to_str()).get("decoder")
        kinds = _decoder_types(decoder_json)
        self._byte_level = "ByteLevel" in kinds
        self._wordpiece = "WordPiece" in kinds
        # Byte-fallback tokens (<0xXX>) merge with their neighbours when decoded, so streaming must hold
        # them back until a non-byte token follows.
        self.byte_fallback_ids: frozenset[int] = frozenset()
        if "ByteFallback" in kinds:
            ids = set()
            for b in range(256):
                tid = hf_tokenizer.token_to_id(f"<0x{b:02X}>")
                if tid is not None:
                    ids.add(tid)
            self.byte_fallback_ids = frozenset(ids)

        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id: int | None = self.token_to_id(self.bos_token) if self.bos_token else None
        eos: list[int] = [int(i) for i in eos_token_ids]
        if self.eos_token is not None:
            tid = self.token_to_id(self.eos_token)
            if tid is not None and tid not in eos:
                eos.append(tid)
        self.eos_token_ids: list[int] = eos

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer a GGUF file's metadata describes (hosted/gguf_tokenizer.py)."""
        from hosted.gguf_tokenizer import tokenizer_args

        return cls(**tokenizer_args(path))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json plus tokenizer_config.json / special_tokens_map.json / chat_template.jinja /
        generation_config.json / config.json from a Hugging Face checkpoint directory. A GGUF file (or a
        `package:` reference, hosted/models) is read with from_gguf."""
        path = resolve_model_path(model_dir)
        if is_gguf(path):
            return cls.from_gguf(path)
        tok_path = path / "tokenizer.json"
        if not tok_path.is_file():
            raise TokenizerError(f"{str(tok_path)!r} is missing: the engine needs a fast tokenizer "
                                 f"(tokenizer.json) in the checkpoint directory")
        try:
            hf_tok = _HFTokenizer.from_file(str(tok_path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise TokenizerError(f"{str(tok_path)!r} cannot be loaded: {exc}") from exc

        tok_cfg = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        special: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            content = _token_content(tok_cfg.get(name))
            if content is None:
                content = _token_content(special_map.get(name))
            if content is not None:
                special[name] = content

        templates: dict[str, str] = {}
        raw_template = tok_cfg.get("chat_template")
        if isinstance(raw_template, str):
            templates["default"] = raw_template
        elif isinstance(raw_template, list):
            for item in raw_template:
                if isinstance(item, Mapping) and isinstance(item.get("template"), str):
                    templates[str(item.get("name", "default"))] = item["template"]
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():  # transformers>=4.47 saves the template in its own file; it wins
            templates["default"] = jinja_file.read_text(encoding="utf-8")

        eos_ids = _id_list(_read_json(path / "generation_config.json").get("eos_token_id"))
        for tid in _id_list(_read_json(path / "config.json").get("eos_token_id")):
            if tid not in eos_ids:
                eos_ids.append(tid)
        return cls(hf_tok, special_tokens=special, chat_templates=templates, eos_token_ids=eos_ids,
                   name=path.name)

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (special tokens, chat templates) so that from_dir
        reads this tokenizer back (e.g. a GGUF file's, into a self-contained checkpoint directory)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))
        config: dict[str, Any] = {**self.special_tokens, "tokenizer_class": "PreTrainedTokenizerFast"}
        if self._templates_src:
            names = list(self._templates_src)
            config["chat_template"] = (self._templates_src["default"] if names == ["default"] else
                                       [{"name": n, "template": t} for n, t in self._templates_src.items()])
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                    encoding="utf-8")

    # ---------------------------------------------------------------- tokens
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI logprobs `bytes`); partial UTF-8 for byte tokens."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if token_id in self.byte_fallback_ids:
            match = _BYTE_TOKEN.match(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        if self._byte_level:
            inverse = _bytes_to_unicode_inverse()
            if all(ch in inverse for ch in piece):
                return bytes(inverse[ch] for ch in piece)
        if self._wordpiece:
            return piece.removeprefix("##").encode("utf-8")
        # SentencePiece-style vocabularies mark a leading space with U+2581.
        return piece.replace("\u2581", " ").encode("utf-8")

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token stands for (computed once): a bound on how few tokens a text needs."""
        cached = getattr(self, "_max_token_bytes", None)
        if cached is None:
            cached = max((len(self.token_bytes(i)) for i in range(self.vocab_size)), default=1)
            self._max_token_bytes = cached = max(cached, 1)
        return cached

    def token_text(self, token_id: int) -> str:
        """A single token as text for logprobs (U+FFFD where it holds part of a UTF-8 character)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # ---------------------------------------------------------------- chat
    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates_src)

    def chat_template_source(self, tools: Sequence[Any] | None = None) -> str:
        if not self._templates_src:
            raise ChatTemplateError(f"{self.name}: the checkpoint has no chat template "
                                    f"(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        if tools and "tool_use" in self._templates_src:
            return self._templates_src["tool_use"]
        if "default" in self._templates_src:
            return self._templates_src["default"]
        return next(iter(self._templates_src.values()))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render a conversation to the prompt text, as transformers' apply_chat_template(tokenize=False)."""
        if not messages:
            raise ChatTemplateError("messages must hold at least one message")
        source = self.chat_template_source(tools)
        template = self._templates.get(source)
        if template is None:
            template = compile_chat_template(source)
            self._templates[source] = template
        variables: dict[str, Any] = {**self.special_tokens, **kwargs}
        try:
            return template.render(messages=_drop_none(messages), tools=list(tools) if tools is not None else None,
                                   documents=list(documents) if documents is not None else None,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on this conversation: {exc}") from exc

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        return self.encode(text, add_special_tokens=False)
