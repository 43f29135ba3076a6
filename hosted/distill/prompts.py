"""Prompts to distill on: a user's --prompts file, or a default set built offline from the standard library.

A --prompts file is JSON Lines (one object per line with "messages" -- a chat -- or "prompt" -- a user
message) or plain text (one user message per line). The default set mixes what a small chat model is asked
to do: input-grounded work (summarise, explain or extract from documentation given in the prompt), writing
code from a specification, and open-ended questions from templates. Documentation of the modules in
HELD_OUT_MODULES is never used, so benchmarks can measure on text the draft was not distilled on.
A prompt goes to the held-out set (acceptance before/after) by a hash of its text, not by its position.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

Chat = list[dict[str, str]]

# Benchmarks (bench/cheaper_model.py) draw their held-out prompts from these modules' documentation.
HELD_OUT_MODULES = frozenset({"calendar", "difflib", "optparse", "getopt", "configparser", "shlex", "sched",
                              "imaplib", "textwrap", "fractions", "heapq", "bisect", "graphlib", "statistics"})
MAX_DOC_CHARS = 700

_GROUNDED = (
    "Summarise the following documentation in two or three sentences.\n\n{body}",
    "Explain in plain words what `{name}` does, based on its documentation:\n\n{body}",
    "List the parameters mentioned in this documentation of `{header}`, one per line.\n\n{body}",
    "Rewrite this documentation as a short bulleted list of facts.\n\n{body}",
)
_CODE = (
    "Write a Python function with the signature `{header}` that does the following:\n\n{first}",
    "Show a short example of how to call `{name}` in Python, with a comment on each line.",
)
_OPEN = (
    "What is {topic}? Explain it to a beginner.", "Give me three practical tips about {topic}.",
    "Write a short paragraph about {topic}.", "What are the pros and cons of {topic}?",
    "How would you explain {topic} to a child?", "Write a haiku about {topic}.",
    "What is a common mistake people make with {topic}?", "Tell me an interesting fact about {topic}.",
)
_TOPICS = ("recursion", "the water cycle", "compound interest", "photosynthesis", "version control",
           "healthy sleep", "public speaking", "time management", "the solar system", "machine learning",
           "climate change", "the French revolution", "learning a new language", "unit testing", "volcanoes",
           "electric cars", "the human heart", "bread baking", "chess openings", "prime numbers", "gardening",
           "job interviews", "the internet", "saving money", "running a marathon", "databases", "coffee",
           "the Roman empire", "black holes", "meditation", "renewable energy", "writing a resume", "bees",
           "password security", "cloud computing", "the ocean", "music theory", "team work", "rainbows",
           "sorting algorithms", "vaccines", "the stock market", "origami", "earthquakes", "nutrition")


def load_prompts(path: str | Path) -> list[Chat]:
    """Chats from a --prompts file (JSON Lines with "messages" or "prompt", else one prompt per line)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--prompts {str(file)!r} is not a file")
    chats: list[Chat] = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{file}:{number}: not valid JSON: {exc}") from exc
            chats.append(_chat_from_row(row, f"{file}:{number}"))
        else:
            chats.append([{"role": "user", "content": line}])
    if not chats:
        raise ValueError(f"--prompts {str(file)!r} holds no prompts")
    return chats


def _chat_from_row(row: object, where: str) -> Chat:
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        messages = row["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                   for m in messages) or not messages:
            raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{role, content}} strings")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    raise ValueError(f"{where}: each JSON line needs \"messages\" (a list) or \"prompt\" (a string)")


def default_prompts(limit: int) -> list[Chat]:
    """Up to `limit` chats, deterministic for one Python version: documentation tasks, code, open questions
    (in proportions 4 : 2 : 3, interleaved)."""
    from hosted.tools.demo_corpus import iter_documents

    docs = [d for d in iter_documents() if d.kind in ("module", "class", "function")
            and d.name.split(".")[0] not in HELD_OUT_MODULES and len(d.body) >= 120
            and not any(part.startswith("_") for part in d.name.split("."))]
    docs.sort(key=lambda d: d.digest)  # spread over modules whatever the limit
    grounded, code = [], []
    for i, doc in enumerate(docs):
        body = doc.body[:MAX_DOC_CHARS]
        grounded.append(_GROUNDED[i % len(_GROUNDED)].format(body=body, name=doc.name, header=doc.header))
        if doc.kind == "function":
            first = body.split("\n\n")[0]
            code.append(_CODE[i % len(_CODE)].format(header=doc.header, name=doc.name, first=first))
    open_ended = [t.format(topic=topic) for i, topic in enumerate(_TOPICS) for j, t in enumerate(_OPEN)
                  if (i + j) % 2 == 0]
    out: list[str] = []
    pools = [(grounded, 4), (code, 2), (open_ended, 3)]
    cursors = [0, 0, 0]
    while len(out) < limit and any(c < len(p) for (p, _), c in zip(pools, cursors)):
        for n, ((pool, share), cursor) in enumerate(zip(pools, cursors)):
            take = pool[cursor:cursor + share]
            out.extend(take)
            cursors[n] += len(take)
    return [[{"role": "user", "content": text}] for text in out[:limit]]


def is_held_out(chat: Chat, percent: int) -> bool:
    """Whether a prompt belongs to the held-out share (by a hash of its text)."""
    digest = hashlib.sha1(json.dumps(chat, sort_keys=True).encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < percent
