"""What a request needs and what each backend can do, so that routing never sends a request where it
cannot be served.

A request needs `tools` (tool definitions, unless tool_choice is "none"), `json_mode` (response_format
json_object), `structured_output` (response_format json_schema), `images` (an image_url content part), or
a context of at least its estimated prompt size; a `/v1/embeddings` request needs `embeddings`. A backend's
capabilities come from the policy's `capabilities:` block where it says so, and are derived otherwise:

- litellm backends: litellm's model map (`supports_function_calling`, `supports_response_schema`,
  `supports_vision`, `max_input_tokens`, `mode`). A model the map does not know, or a field it leaves
  out, counts as supported: the provider's own 400 then reaches the client as a client error. Embeddings:
  only models the map lists with `mode: embedding` (e.g. text-embedding-3-small; gpt-4o-mini is `chat`).
- engine backends: tools, JSON mode and structured outputs (constrained decoding); no images, no embeddings.

A `/v1/completions` request with a parameter a chat completion cannot carry (`echo`, `logprobs`, `suffix`,
`best_of` above `n`, token-id or several prompts: gateway/backends/translate.py) needs `native_completions`:
a backend whose policy `endpoints:` leaves out `completions` (a chat-only upstream, sent completions as chat)
lacks it. Every other completions or Responses request can go to any backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway import pricing
from gateway.backends.translate import untranslatable

if TYPE_CHECKING:
    from gateway.policy import BackendSpec

FEATURES = ("tools", "json_mode", "structured_output", "images", "embeddings")
# Not declared under `capabilities:` but by the backend's `endpoints:` (the policy's BackendSpec).
NATIVE_COMPLETIONS = "native_completions"


@dataclass(frozen=True, slots=True)
class Capabilities:
    tools: bool = True
    json_mode: bool = True
    structured_output: bool = True
    images: bool = True
    embeddings: bool = True
    max_context: int | None = None  # prompt tokens the backend accepts; None: not known, not checked
    native_completions: bool = True  # serves /v1/completions itself (not only as chat)

    def missing(self, needs: frozenset[str], prompt_tokens: int | None = None) -> list[str]:
        """The needed features this backend lacks, in FEATURES order (plus `context` when too long)."""
        out = [f for f in (*FEATURES, NATIVE_COMPLETIONS) if f in needs and not getattr(self, f)]
        if prompt_tokens is not None and self.max_context is not None and prompt_tokens > self.max_context:
            out.append("context")
        return out


def needs(body: dict, endpoint: str = "chat") -> frozenset[str]:
    """The features a request body asks for (cheap: no tokenizing). /v1/responses bodies are checked in their
    chat form (gateway/responses_api.py `to_chat`)."""
    if endpoint == "embeddings":
        return _EMBEDDINGS
    found = set()
    if endpoint == "completions" and untranslatable(body) is not None:
        found.add(NATIVE_COMPLETIONS)
    if body.get("tools") and body.get("tool_choice") != "none":
        found.add("tools")
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        if fmt.get("type") == "json_object":
            found.add("json_mode")
        elif fmt.get("type") == "json_schema":
            found.add("structured_output")
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            found.add("images")
            break
    return frozenset(found)


_EMBEDDINGS = frozenset({"embeddings"})


_OF: dict[int, tuple[BackendSpec, Capabilities]] = {}  # id(spec) -> (spec, its capabilities)


def of(spec: BackendSpec) -> Capabilities:
    """The backend's capabilities: the policy's declarations over the derived ones. Worked out once per spec
    object (a BackendSpec is frozen, and each policy version holds its own): the request path asks for every
    backend of a route's chain on every request."""
    hit = _OF.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    found = _of(spec)
    if len(_OF) >= 4096:  # old policy versions' specs: let them go
        _OF.clear()
    _OF[id(spec)] = (spec, found)
    return found


def _of(spec: BackendSpec) -> Capabilities:
    base = _derived(spec)
    declared = spec.capabilities
    if declared is None:
        return base
    return Capabilities(**{name: (getattr(declared, name) if getattr(declared, name) is not None
                                  else getattr(base, name))
                           for name in (*FEATURES, "max_context")}, native_completions=base.native_completions)


def _derived(spec: BackendSpec) -> Capabilities:
    native = spec.endpoints is None or "completions" in spec.endpoints
    if spec.kind == "engine":
        return Capabilities(images=False, embeddings=False, native_completions=native)
    info = pricing.model_info(spec.model)
    if info is None:
        return Capabilities(native_completions=native)
    if info.get("mode") == "embedding":
        return Capabilities(tools=False, json_mode=False, structured_output=False, images=False, embeddings=True,
                            max_context=info.get("max_input_tokens"))

    def flag(key: str) -> bool:
        return info.get(key) is not False  # absent: not known to be unsupported

    return Capabilities(tools=flag("supports_function_calling"), json_mode=flag("supports_response_schema")
                        or flag("supports_function_calling"), structured_output=flag("supports_response_schema"),
                        images=flag("supports_vision"), embeddings=False, max_context=info.get("max_input_tokens"),
                        native_completions=native)
