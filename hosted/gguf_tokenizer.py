"""A GGUF file's tokenizer (its `tokenizer.*` metadata) as a `tokenizers.Tokenizer` and the rest of what our
Tokenizer takes (`Tokenizer.from_gguf` builds it: this module does not import hosted/tokenizer.py back).

A GGUF carries no tokenizer.json; llama.cpp stores the vocabulary, merges, token types, special ids and the
chat template as metadata. Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE), the pre-tokenizers
below, and files that embed their tokenizer.json whole (`tokenizer.huggingface.json`). What we build mirrors
transformers' GGUF tokenizer (BPE over the vocabulary as the file spells it, a ByteLevel pre-tokenizer and
decoder; CONTROL tokens added as special, USER_DEFINED as plain added tokens), with one difference: for the
`smollm`-family pre-tokenizers we split digits one by one first, as the original SmolLM tokenizer.json and
llama.cpp do (transformers' GGUF loader omits it; for SmolLM2's vocabulary, which has no multi-digit tokens,
both give the same ids).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from hosted.checkpoint import TokenizerError
from hosted.gguf_reader import field, open_gguf

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's llama-vocab.cpp groups).
_GPT2 = ("default", "gpt2", "gpt-2")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva")
_LLAMA3 = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")


def tokenizer_args(path: str | Path) -> dict[str, Any]:
    """Our Tokenizer's arguments for a GGUF file: the `tokenizers` tokenizer (encode/decode), special tokens, EOS
    ids and the chat templates."""
    reader = open_gguf(path)
    src = str(path)
    embedded = field(reader, "tokenizer.huggingface.json", None)
    hf_tok = HFTokenizer.from_str(embedded) if embedded is not None else _byte_level_bpe(reader, src)
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens", source=src)
    special: dict[str, str] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        tid = field(reader, f"tokenizer.ggml.{key}", None)
        if tid is not None:
            if not 0 <= int(tid) < len(tokens):
                raise TokenizerError(f"{src}: tokenizer.ggml.{key}={tid} is not a token id (vocabulary {len(tokens)})")
            special[name] = tokens[int(tid)]
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tid = field(reader, f"tokenizer.ggml.{key}", None)
        if tid is not None and int(tid) not in eos_ids:
            eos_ids.append(int(tid))
    templates: dict[str, str] = {}
    template = field(reader, "tokenizer.chat_template", None)
    if template is not None:
        templates["default"] = template
    for name in field(reader, "tokenizer.chat_templates", None) or []:
        named = field(reader, f"tokenizer.chat_template.{name}", None)
        if named is not None:
            templates[name] = named
    return {"hf_tokenizer": hf_tok, "special_tokens": special, "chat_templates": templates,
            "eos_token_ids": eos_ids, "name": Path(path).stem}


def _byte_level_bpe(reader: Any, src: str) -> HFTokenizer:
    kind = field(reader, "tokenizer.ggml.model", source=src)
    if kind != "gpt2":
        raise TokenizerError(f"{src}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', byte-level BPE)")
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens", source=src)
    merges: list[str] = field(reader, "tokenizer.ggml.merges", source=src)
    token_types: list[int] = field(reader, "tokenizer.ggml.token_type", None) or []
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    byte_char = _byte_to_char()
    # Every BPE token is spelt in the byte alphabet; a token written otherwise (raw text) is respelt.
    vocab = {(t if set(t) <= alphabet else "".join(byte_char[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    pairs = []
    for i, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep:
            raise TokenizerError(f"{src}: tokenizer.ggml.merges[{i}] = {merge!r} is not 'LEFT RIGHT'")
        pairs.append((left, right))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(field(reader, "tokenizer.ggml.pre", "default"), src)
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED]
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    tok.post_processor = _post_processor(reader, tokens)
    return tok


def _pre_tokenizer(pre: str, src: str) -> Any:
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _LLAMA3:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise TokenizerError(f"{src}: tokenizer.ggml.pre {pre!r} is not supported "
                         f"(supported: {', '.join(_GPT2 + _DIGITS_THEN_GPT2 + _LLAMA3)})")


def _post_processor(reader: Any, tokens: list[str]) -> Any:
    """BOS/EOS added by encode(add_special_tokens=True) when the file asks for them (gpt2 default: neither)."""
    single, specials = ["$A"], []
    for flag, key, at_start in (("add_bos_token", "bos_token_id", True), ("add_eos_token", "eos_token_id", False)):
        tid = field(reader, f"tokenizer.ggml.{key}", None)
        if field(reader, f"tokenizer.ggml.{flag}", False) and tid is not None:
            token = tokens[int(tid)]
            single = [token, *single] if at_start else [*single, token]
            specials.append((token, int(tid)))
    if not specials:
        return processors.ByteLevel(trim_offsets=False)
    return processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
