"""The client's reference answer for shadow evaluation: OpenAI's `metadata` field, key `reference`."""
from __future__ import annotations


def reference_of(body: dict) -> str | None:
    """The client's reference answer (a string in `metadata.reference`), or None."""
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("reference"), str):
        return meta["reference"]
    return None


def without_reference(payload: dict) -> dict:
    """The payload for an upstream: `metadata.reference` is ours (and may exceed OpenAI's 512-char values).
    The payload itself is returned when there is nothing to remove; otherwise a copy (the caller's is kept)."""
    meta = payload.get("metadata")
    if isinstance(meta, dict) and "reference" in meta:
        rest = {k: v for k, v in meta.items() if k != "reference"}
        payload = dict(payload)
        if rest:
            payload["metadata"] = rest
        else:
            payload.pop("metadata")
    return payload
