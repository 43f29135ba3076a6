"""Judging a shadow pair: is each answer right? `exact` against the client's reference, or a judge backend's
yes/no to the question in JUDGE_SYSTEM / `judge_messages`."""
from __future__ import annotations

from gateway import admission
from openai_wire import content_text

JUDGE_SYSTEM = ("You grade answers. Read the request and the candidate answer (and the reference answer when "
                "one is given). Reply with exactly one word: yes if the candidate answer is correct and an "
                "acceptable reply to the request, no otherwise.")


def judge_messages(request_text: str, answer: str, reference: str | None) -> list[dict]:
    """The judge's chat: the system rule above and one user turn with the request and the answer."""
    parts = [f"Request:\n{request_text}"]
    if reference is not None:
        parts.append(f"Reference answer:\n{reference}")
    parts.append(f"Candidate answer:\n{answer}")
    parts.append("Is the candidate answer acceptable? Answer yes or no.")
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": "\n\n".join(parts)}]


def judge_request(model: str, request_text: str, answer: str, reference: str | None) -> dict:
    """The chat request asking a judge backend about one answer (a one-word reply is all it needs)."""
    return {"model": model, "temperature": 0, "max_tokens": 4,
            "messages": judge_messages(request_text, answer, reference)}


def parse_verdict(text: str) -> bool | None:
    """yes → True, no → False (first word, case and punctuation ignored); anything else → None."""
    words = text.strip().split()
    if not words:
        return None
    word = words[0].strip(".,!:;\"'`*").casefold()
    return True if word == "yes" else False if word == "no" else None


def normalise(text: str) -> str:
    return " ".join(text.split()).casefold()


def matches_reference(answer: str, reference: str) -> bool:
    """The `exact` judge: equal once whitespace is collapsed and case folded."""
    return normalise(answer) == normalise(reference)


def conversation_text(body: dict, endpoint: str) -> str:
    """The request as the judge reads it: `role: text` per message, or the completions prompt."""
    if endpoint != "chat":
        return admission.prompt_text(body, endpoint)
    return "\n".join(f"{m.get('role', 'user')}: {content_text(m.get('content'))}" for m in body.get("messages") or ())
