"""Redaction of upstream text before it reaches a client or a log line.

An upstream's error message is not trusted: a provider's 401 may quote the bearer key we sent, a proxy in
front of it may answer with a traceback (file paths, library internals), and litellm wraps messages in its
own class names. `redact(text, secrets)` masks every configured secret value it is given, anything shaped
like an API key or bearer token, file-system paths and Python/litellm internals.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable

MASK = "[redacted]"
PATH_MASK = "[path]"
_MIN_SECRET = 6  # shorter configured values are not masked by value (they would mask ordinary words)

# Order matters: the specific shapes first, then the generic long-token rule.
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # "Authorization: Bearer xyz", "Bearer xyz", "Basic xyz"
    (re.compile(r"(?i)\b(bearer|basic|token)(\s+|=|:\s*)[^\s\"',;]+"), r"\1\2" + MASK),
    # key=value / "api_key": "value" / x-api-key: value
    (re.compile(r"(?i)\b((?:x-)?api[_-]?key|access[_-]?token|secret(?:[_-]?key)?|password|passwd|pwd|key)"
                r"(\"?\s*[:=]\s*\"?)[^\s\"',;&]+"), r"\1\2" + MASK),
    # credentials in a URL: scheme://user:pass@host
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@"), r"\1" + MASK + "@"),
    # provider key shapes: sk-…, sk-proj-…, sk-ant-…, pk-/rk-…, GitHub ghp_…, Slack xox…-, Google AIza…
    (re.compile(r"\b(?:sk|pk|rk)-[A-Za-z0-9_\-]{6,}"), MASK),
    (re.compile(r"\b(?:gh[pousr]_|xox[abprs]-|AIza)[A-Za-z0-9_\-]{10,}"), MASK),
    # AWS access key ids
    (re.compile(r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA)[A-Z0-9]{12,}\b"), MASK),
    # JSON web tokens
    (re.compile(r"\beyJ[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-]*)?"), MASK),
)
# Long hex / base64 / url-safe runs: keys, secrets, signatures (see _mask_long_token for which are masked).
_LONG_TOKEN = re.compile(r"[A-Za-z0-9+_\-]{20,}={0,2}")
_HEX = re.compile(r"[0-9a-fA-F]{32,}")
# Standard base64 (with / and +, no - or _): 30+ characters mixing upper, lower and digits.
_BASE64 = re.compile(r"(?<![\w/.])[A-Za-z0-9+][A-Za-z0-9+/]{29,}={0,2}")
_SEGMENTS = re.compile(r"[-_]")

# File-system paths: anything under site-/dist-packages, any absolute path to a source or library file, and
# absolute paths under the usual roots. URL paths (/v1/chat/completions) are not file paths and are kept.
_PATHS = (
    re.compile(r"(?:[A-Za-z]:)?[\\/]?(?:[\w.+@~-]+[\\/])*[\w.+-]*(?:site|dist)-packages(?:[\\/][\w.+@-]+)*"),
    re.compile(r"(?:[A-Za-z]:\\|/)(?:[\w.+@~-]+[\\/])+[\w.+@-]+\.(?:py[cdiox]?|so|pth|dll|dylib|egg|whl)\b"),
    re.compile(r"(?<![\w:/.])/(?:home|usr|opt|srv|var|tmp|etc|root|app|mnt|data|workspace|Users|nix|proc|run|"
               r"lib|lib64|bin|sbin)(?:/[\w.+@~-]+)+/?"),
    re.compile(r"\b[A-Za-z]:\\(?:[\w.+@ ~-]+\\)*[\w.+@~-]+"),
)
# Python and litellm internals: traceback framing, object reprs, litellm's own wrapping and class names.
_INTERNALS = (
    re.compile(r"Traceback \(most recent call last\):"),
    re.compile(r"File \"[^\"]*\", line \d+(?:, in [\w<>.]+)?"),
    re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>"),
    re.compile(r"\blitellm(?:\.[\w]+)+(?::\s*)?"),
    re.compile(r"\b(?:LiteLLM|litellm)\b[\w ]*?(?:Exception|Error)\b\s*[:-]?\s*"),
    re.compile(r"\b\w*(?:Exception|Error)\s+-\s+"),  # "OpenAIException - …"
    re.compile(r"^(?:\s*\w*(?:Exception|Error)\s*:\s*)+"),  # a leading "AuthenticationError: "
    re.compile(r"\s*(?:Received Model Group=|LiteLLM Retried:|Available Model Group Fallbacks=|"
               r"model_group=|deployment=).*$", re.DOTALL),
)
_SPACES = re.compile(r"[ \t]{2,}")


def configured_secrets(env_names: Iterable[str | None]) -> list[str]:
    """The values of the environment variables named (the backends' api_key_env): secrets to mask by value."""
    out = []
    for name in env_names:
        value = os.environ.get(name) if name else None
        if value and len(value) >= _MIN_SECRET:
            out.append(value)
    return out


def _mask_base64(match: re.Match[str]) -> str:
    token = match.group(0)
    mixed = any(c.isupper() for c in token) and any(c.islower() for c in token) and any(c.isdigit() for c in token)
    return MASK if mixed else token


def _mask_long_token(match: re.Match[str]) -> str:
    """32+ hex digits, or a run with a 16+ character segment mixing digits and letters, is a secret; model
    names (claude-3-5-sonnet-20241022, Meta-Llama-3-70B-Instruct) are words and short numbers, and kept."""
    token = match.group(0)
    if _HEX.fullmatch(token) and not token.isdigit():
        return MASK
    for segment in _SEGMENTS.split(token.rstrip("=")):
        if len(segment) >= 16 and any(c.isdigit() for c in segment) and any(c.isalpha() for c in segment):
            return MASK
    return token


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with secrets, key- and token-shaped strings, file paths and library internals masked or removed."""
    if not text:
        return text
    for secret in sorted({s for s in secrets if s and len(s) >= _MIN_SECRET}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    for pattern in _INTERNALS:
        text = pattern.sub("", text)
    for pattern in _PATHS:
        text = pattern.sub(PATH_MASK, text)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    text = _BASE64.sub(_mask_base64, text)
    text = _LONG_TOKEN.sub(_mask_long_token, text)
    return _SPACES.sub(" ", text).strip()
