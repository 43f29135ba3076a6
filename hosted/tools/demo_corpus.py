"""Gather the demo model's training text from the Python standard library on this machine.

Every Python install carries the same kind of prose: module, class and function docstrings in the
stdlib's `.py` sources, and the language reference topics that `pydoc` shows (`pydoc_data/topics.py`).
We read them with `ast` (nothing is imported or executed), in a fixed order, drop duplicates, and
split off a held-out set by a hash of each document's text, so the split does not depend on order.
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

BOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, IM_START, IM_END)

# ChatML, rendered by transformers' apply_chat_template (Jinja) and by `render_chat` below identically.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM_PROMPT = "You are a helpful assistant that explains the Python standard library."

# Test suites are mostly assertions, not prose; the stdlib's bundled third-party tree is not stdlib.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_MIN_DOC_CHARS = 24
VAL_PERCENT = 2          # share of documents held out for validation, by text hash
CHAT_PERCENT = 30        # share of function/class documents rendered as a chat exchange


@dataclass(frozen=True, slots=True)
class Document:
    kind: str        # "module" | "class" | "function" | "topic"
    name: str        # dotted name, or the pydoc topic name
    header: str      # first line shown before the text (a signature for functions)
    body: str        # the cleaned docstring or topic text

    @property
    def digest(self) -> str:
        return hashlib.sha1(self.body.encode("utf-8")).hexdigest()

    @property
    def is_validation(self) -> bool:
        return int(self.digest[:8], 16) % 100 < VAL_PERCENT


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """All stdlib `.py` files in a deterministic (sorted) order, without tests and bundled packages."""
    root = root or stdlib_dir()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(Path(dirpath) / name)
    return found


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) or path.stem


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = node.args
    if args.args and args.args[0].arg in ("self", "cls"):
        args = ast.arguments(posonlyargs=args.posonlyargs, args=args.args[1:], vararg=args.vararg,
                             kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults, kwarg=args.kwarg,
                             defaults=args.defaults)
    try:
        return ast.unparse(args)
    except (ValueError, TypeError, AttributeError, RecursionError):  # unparse refused: names suffice
        return "..."


def documents_from_source(source: str, modname: str) -> Iterator[Document]:
    """Docstrings of a module and of its classes and functions (nested ones too), in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    doc = ast.get_docstring(tree)
    if doc and len(doc) >= _MIN_DOC_CHARS:
        yield Document("module", modname, f"Module {modname}", inspect.cleandoc(doc))

    def walk(body: list[ast.stmt], prefix: str) -> Iterator[Document]:
        for node in body:
            if isinstance(node, ast.ClassDef):
                name = f"{prefix}.{node.name}"
                doc = ast.get_docstring(node)
                if doc and len(doc) >= _MIN_DOC_CHARS:
                    yield Document("class", name, f"class {name}", inspect.cleandoc(doc))
                yield from walk(node.body, name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{node.name}"
                doc = ast.get_docstring(node)
                if doc and len(doc) >= _MIN_DOC_CHARS:
                    yield Document("function", name, f"{name}({_signature(node)})", inspect.cleandoc(doc))
                yield from walk(node.body, name)

    yield from walk(tree.body, modname)


def pydoc_topics(root: Path) -> Iterator[Document]:
    """The language reference topics behind `help('if')` etc., read from pydoc_data/topics.py."""
    path = root / "pydoc_data" / "topics.py"
    if not path.is_file():
        return
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            for name in sorted(topics):
                text = topics[name].strip()
                if len(text) >= _MIN_DOC_CHARS:
                    yield Document("topic", name, f"Help on topic {name}", text)


def iter_documents(root: Path | None = None, paths: Iterable[Path] | None = None) -> Iterator[Document]:
    """Deduplicated documents: pydoc topics first, then each source file's docstrings, in sorted order."""
    root = root or stdlib_dir()
    seen: set[str] = set()
    sources = stdlib_sources(root) if paths is None else list(paths)

    def fresh(docs: Iterable[Document]) -> Iterator[Document]:
        for d in docs:
            if d.digest not in seen:
                seen.add(d.digest)
                yield d

    if paths is None:
        yield from fresh(pydoc_topics(root))
    for path in sources:
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield from fresh(documents_from_source(source, module_name(path, root)))


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template in plain Python; a test checks it against transformers' rendering."""
    text = BOS + "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def _question(doc: Document, pick: int) -> str:
    if doc.kind == "class":
        return [f"What is {doc.name}?", f"Explain the class {doc.name}.", f"Describe {doc.name}."][pick % 3]
    return [f"What does {doc.name} do?", f"Explain {doc.name}.", f"How do I use {doc.name}?"][pick % 3]


def render(doc: Document) -> str:
    """The text the model trains on, BOS first. Some function/class docs become a chat exchange, so the
    model also learns the chat template and to end its answer with <|im_end|>."""
    h = int(doc.digest[8:16], 16)
    if doc.kind in ("function", "class") and h % 100 < CHAT_PERCENT:
        messages = [{"role": "user", "content": _question(doc, h // 100)},
                    {"role": "assistant", "content": f"{doc.header}\n\n{doc.body}"}]
        if (h // 1000) % 2:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        return render_chat(messages)
    return f"{BOS}{doc.header}\n\n{doc.body}\n"


def split_documents(docs: Iterable[Document]) -> tuple[list[Document], list[Document]]:
    train: list[Document] = []
    val: list[Document] = []
    for d in docs:
        (val if d.is_validation else train).append(d)
    return train, val
