"""Constrained decoding with xgrammar: JSON schemas (response_format) and tool calls compiled to grammars, whose
token masks the engine applies to each constrained sequence's logits at every step.

* `GrammarCompiler` (one per served model): xgrammar's `TokenizerInfo` built from our tokenizer (its
  `tokenizers` vocabulary, padded to the model's logits width: the lm head may be wider than the vocabulary, and
  the padding ids are never allowed), and a caching compiler. Compiling runs where requests are planned, off the
  event loop.
* `check_schema`: a schema is refused (ValueError naming the keyword and where it is) when it is not a JSON schema
  or uses a feature xgrammar would silently not enforce (`not`, `if`/`then`/`else`, `uniqueItems`, multi-branch
  `allOf`, `oneOf` whose branches may overlap, unknown `format`s ...), so constrained output always validates.
* `GrammarMasks` (one per engine): each constrained sequence has its own `xgrammar.GrammarMatcher`; unconstrained
  sequences pay nothing. Before a step's forward the next-token bitmasks of the constrained rows are filled on a
  worker thread (xgrammar's batch API, while the forward runs); after it they are applied to those logit rows in
  place (xgrammar's CPU/CUDA kernel) before sampling, and each sampled token is fed to its matcher.

The tool-call text format and the prompt side live in hosted/tool_calls.py.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

# String formats xgrammar enforces (its JSON-schema converter); any other `format` would be ignored.
SUPPORTED_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                               "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords a schema may use that xgrammar does not enforce; a schema using them is refused (400).
_UNSUPPORTED = {
    "not": "'not'", "if": "'if'/'then'/'else'", "then": "'if'/'then'/'else'", "else": "'if'/'then'/'else'",
    "dependentSchemas": "'dependentSchemas'", "dependencies": "'dependencies'",
    "contentEncoding": "'contentEncoding'", "contentMediaType": "'contentMediaType'", "contentSchema":
    "'contentSchema'", "$dynamicRef": "'$dynamicRef'", "$recursiveRef": "'$recursiveRef'",
}
_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
                  "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


class SchemaError(ValueError):
    """A schema that is not valid, or that uses a feature constrained decoding cannot enforce."""


# ---------------------------------------------------------------------------------------------- schema checks
def check_schema(schema: Any, where: str = "schema", root: Any = None) -> None:
    """Raise SchemaError naming the first problem (`where` is the path shown in the message; `root` the whole
    schema, against which local $refs resolve)."""
    root = schema if root is None else root
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise SchemaError(f"{where} must be a JSON schema object or a boolean, got {type(schema).__name__}")
    for key, what in _UNSUPPORTED.items():
        if key in schema:
            raise SchemaError(f"{where} uses {what}, which constrained decoding does not support")
    t = schema.get("type")
    if t is not None:
        types = t if isinstance(t, list) else [t]
        if not types or any(not isinstance(x, str) or x not in _TYPES for x in types):
            raise SchemaError(f"{where}.type must be one of {sorted(_TYPES)} (or a list of them), got {t!r}")
    if schema.get("uniqueItems") is True:
        raise SchemaError(f"{where} uses 'uniqueItems', which constrained decoding does not support")
    fmt = schema.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt not in SUPPORTED_FORMATS):
        raise SchemaError(f"{where} uses format {fmt!r}, which constrained decoding does not support "
                          f"(supported: {', '.join(sorted(SUPPORTED_FORMATS))})")
    for key in ("required", "enum"):
        if key in schema and not isinstance(schema[key], list):
            raise SchemaError(f"{where}.{key} must be an array")
    if "enum" in schema and not schema["enum"]:
        raise SchemaError(f"{where}.enum must not be empty")
    for key in ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"):
        if key in schema and (not isinstance(schema[key], int) or isinstance(schema[key], bool) or schema[key] < 0):
            raise SchemaError(f"{where}.{key} must be a non-negative integer")
    if isinstance(schema.get("minItems"), int) and isinstance(schema.get("maxItems"), int) \
            and schema["minItems"] > schema["maxItems"]:
        raise SchemaError(f"{where}: minItems is greater than maxItems")
    if "pattern" in schema:
        if not isinstance(schema["pattern"], str):
            raise SchemaError(f"{where}.pattern must be a string")
        try:
            re.compile(schema["pattern"])
        except re.error as exc:
            raise SchemaError(f"{where}.pattern is not a valid regular expression: {exc}") from None
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise SchemaError(f"{where} uses 'allOf' with {len(all_of)} schemas, which constrained decoding does not "
                          f"support (merge them into one schema)")
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint(one_of, root):
        raise SchemaError(f"{where} uses 'oneOf' with branches that may overlap, which constrained decoding "
                          f"cannot enforce; use 'anyOf', or give each branch a different 'type' or a "
                          f"discriminating 'const' property")
    for key in _SUBSCHEMA_MAPS:
        sub = schema.get(key)
        if sub is not None:
            if not isinstance(sub, Mapping):
                raise SchemaError(f"{where}.{key} must be an object")
            for name, value in sub.items():
                if key == "dependentSchemas":
                    continue
                check_schema(value, f"{where}.{key}.{name}", root)
    for key in _SUBSCHEMA_ONE:
        if key in schema:
            check_schema(schema[key], f"{where}.{key}", root)
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or not schema[key]:
                raise SchemaError(f"{where}.{key} must be a non-empty array of schemas")
            for i, value in enumerate(schema[key]):
                check_schema(value, f"{where}.{key}.{i}", root)


def resolve_ref(schema: Any, root: Any, depth: int = 16) -> Any:
    """`schema` itself, or what its local `$ref` ('#' or '#/a/b') points at (followed up to `depth` times);
    None when a reference does not resolve."""
    while isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str) and depth > 0:
        ref, node = schema["$ref"], root
        if ref != "#" and not ref.startswith("#/"):
            return None
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        schema, depth = node, depth - 1
    return schema


def _disjoint(branches: list[Any], root: Any = None) -> bool:
    """Whether oneOf branches provably exclude each other: pairwise different single types, or objects that
    each fix the same property to a different constant (a discriminated union, as pydantic writes them, whose
    branches may be local $refs)."""
    branches = [resolve_ref(b, root) for b in branches] if root is not None else branches
    if not all(isinstance(b, Mapping) for b in branches):
        return False
    types = [b.get("type") for b in branches]
    if all(isinstance(t, str) for t in types) and len(set(types)) == len(types) \
            and not {"number", "integer"} <= set(types):
        return True
    shared = None
    for b in branches:
        props = b.get("properties") or {}
        keys = {k for k, v in props.items() if isinstance(v, Mapping) and
                ("const" in v or (isinstance(v.get("enum"), list) and len(v["enum"]) == 1))
                and k in (b.get("required") or [])}
        shared = keys if shared is None else shared & keys
    for key in shared or ():
        values = []
        for b in branches:
            v = b["properties"][key]
            values.append(json.dumps(v["const"] if "const" in v else v["enum"][0], sort_keys=True))
        if len(set(values)) == len(values):
            return True
    return False


# ---------------------------------------------------------------------------------------------- compiling
class GrammarCompiler:
    """xgrammar's tokenizer info and compiler for one model (thread-safe; built on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted({t for t in stop_token_ids if 0 <= t < vocab_size})
        self._lock = threading.Lock()
        self._compiler = None

    def _get(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=2, cache_enabled=True)
            return self._compiler

    def _tokenizer_info(self):
        import xgrammar as xgr

        hf = self.tokenizer._tok  # the `tokenizers.Tokenizer` hosted/tokenizer.py wraps
        encoded = [""] * self.vocab_size  # ids past the tokenizer's vocabulary (a padded lm head) stay empty
        for token, idx in hf.get_vocab(with_added_tokens=True).items():
            if idx < self.vocab_size:
                encoded[idx] = token
        try:
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
            vocab_type, prefix = meta["vocab_type"], meta["add_prefix_space"]
        except Exception:  # noqa: BLE001 - a private helper; fall back to what our tokenizer knows
            tok = self.tokenizer
            vocab_type = (xgr.VocabType.BYTE_LEVEL if tok._byte_level else
                          xgr.VocabType.BYTE_FALLBACK if tok.byte_fallback_ids else xgr.VocabType.RAW)
            prefix = vocab_type == xgr.VocabType.BYTE_FALLBACK
        if not self.stop_token_ids:
            raise SchemaError("this model has no end-of-sequence token: constrained decoding cannot end")
        return xgr.TokenizerInfo(encoded, vocab_type=vocab_type, vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_token_ids, add_prefix_space=prefix)

    def json_schema(self, schema: Any):
        """A compiled grammar for one JSON value matching `schema` (compact separators `, ` and `: `, no free
        whitespace: a small model cannot loop on blanks)."""
        check_schema(schema)
        try:
            return self._get().compile_json_schema(json.dumps(schema), any_whitespace=False)
        except RuntimeError as exc:
            raise SchemaError(_xgr_message(exc)) from None

    def structural_tag(self, fmt: dict[str, Any]):
        try:
            return self._get().compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))
        except (RuntimeError, ValueError) as exc:
            raise SchemaError(_xgr_message(exc)) from None


def _xgr_message(exc: BaseException) -> str:
    """xgrammar's C++ message without its '[time] file:line: ' prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(exc).__name__


# ---------------------------------------------------------------------------------------------- the engine side
def new_matcher(compiled: Any):
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


class GrammarMasks:
    """The engine's per-step masking for constrained sequences (`Sequence.matcher` not None).

    `start(rows, matchers)` fills the bitmask of the constrained logit rows; with `overlap` it does so on a
    worker thread while the forward runs. `apply(logits)` waits for it and masks the rows in place.
    """

    def __init__(self, vocab_size: int, overlap: bool = True) -> None:
        self.vocab_size = vocab_size
        self.overlap = overlap
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._batch = None
        self._pending: tuple[list[int], Any, concurrent.futures.Future | None] | None = None
        self.mask_seconds = 0.0  # time the engine thread spent waiting for / filling / applying masks

    def _fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=2)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def start(self, rows: list[int], matchers: list[Any]) -> None:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        if self.overlap:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="switchyard-grammar")
            self._pending = (rows, bitmask, self._pool.submit(self._fill, matchers, bitmask))
        else:
            self._fill(matchers, bitmask)
            self._pending = (rows, bitmask, None)

    def apply(self, logits: torch.Tensor | None) -> None:
        import xgrammar as xgr

        pending, self._pending = self._pending, None
        if pending is None:
            return
        rows, bitmask, future = pending
        if future is not None:
            future.result()
        if logits is None or not rows:
            return
        sub = logits[rows]
        if sub.device.type != "cpu":
            bitmask = bitmask.to(sub.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=min(self.vocab_size, sub.shape[-1]))
        if sub.shape[-1] > self.vocab_size:  # logits wider than the grammar's vocabulary: never allowed
            sub[:, self.vocab_size:] = float("-inf")
        logits[rows] = sub

    def cancel(self) -> None:
        """Drop a pending fill (the step produced no logits)."""
        self.apply(None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
