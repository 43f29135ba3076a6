"""Policy diagnostics: every problem in a policy file as file:line:col, field, what is wrong and the fix.

Reads YAML while remembering where each key and item starts, and turns YAML syntax errors, duplicate
keys and pydantic validation errors into `PolicyIssue`s. It knows nothing of the policy's schema:
gateway/policy.py passes in what it must know (which fields a location allows).
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import yaml

Marks = dict[tuple, tuple[int, int]]  # path in the document -> (1-based line, column) where it starts


@dataclass(slots=True)
class PolicyIssue:
    """One problem in a policy file: where it is, what is wrong, how to fix it."""

    source: str
    path: str  # e.g. "routes.gpt-4o-mini.fallbacks[0]"; "" for the whole document
    problem: str
    fix: str
    line: int | None = None
    col: int | None = None

    def __str__(self) -> str:
        where = self.source
        if self.line is not None:
            where += f":{self.line}" + (f":{self.col}" if self.col is not None else "")
        field = f" {self.path}:" if self.path else ""
        return f"{where}:{field} {self.problem}; fix: {self.fix}"


class PolicyError(Exception):
    """A policy file that cannot be used. `str()` lists every problem, one per line."""

    def __init__(self, issues: list[PolicyIssue]):
        self.issues = issues
        head = f"invalid policy ({len(issues)} problem{'s' if len(issues) != 1 else ''}):\n" if len(issues) > 1 else ""
        super().__init__(head + "\n".join(str(i) for i in issues))


# ---------------------------------------------------------------- YAML with line numbers


class _Loader(yaml.SafeLoader):
    pass


def read_yaml(text: str, source: str) -> tuple[Any, Marks]:
    """Parse YAML and remember where every key and item starts (1-based line, column)."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        marks: Marks = {}
        dupes: list[PolicyIssue] = []
        _index(node, (), marks, dupes, source)
        if dupes:
            raise PolicyError(dupes)
        return loader.construct_document(node), marks
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = ": ".join(x for x in (e.context, e.problem) if x) or "invalid YAML"
        raise PolicyError([PolicyIssue(source, "", f"YAML syntax error: {problem}",
                                       "fix the indentation/quoting at this position",
                                       mark.line + 1 if mark else None,
                                       mark.column + 1 if mark else None)]) from None
    except yaml.YAMLError as e:
        raise PolicyError([PolicyIssue(source, "", f"YAML error: {e}", "fix the YAML syntax")]) from None
    finally:
        loader.dispose()


def _index(node: yaml.Node, path: tuple, marks: Marks, dupes: list[PolicyIssue], source: str,
           active: frozenset = frozenset()) -> None:
    marks.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
    if id(node) in active:  # a recursive alias (&a [*a]); pydantic will reject the value itself
        return
    active = active | {id(node)}
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            kpath = path + (key,)
            if key in seen:
                dupes.append(PolicyIssue(source, fmt_path(kpath), f"duplicate key '{key}'",
                                         "keep only one entry with this name",
                                         key_node.start_mark.line + 1, key_node.start_mark.column + 1))
            seen.add(key)
            marks[kpath] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            _index(value_node, kpath, marks, dupes, source, active)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _index(item, path + (i,), marks, dupes, source, active)


# ---------------------------------------------------------------- issues


def fmt_path(path: Iterable) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def issue_at(source: str, path: tuple, marks: Marks, problem: str, fix: str) -> PolicyIssue:
    """An issue at `path`, located at the deepest part of the path that exists in the file."""
    line = col = None
    for n in range(len(path), -1, -1):
        if path[:n] in marks:
            line, col = marks[path[:n]]
            break
    return PolicyIssue(source, fmt_path(path), problem, fix, line, col)


def suggest(word: str, options: Iterable[str]) -> str | None:
    match = difflib.get_close_matches(str(word), list(options), n=1, cutoff=0.6)
    return match[0] if match else None


def typename(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", int: "a number", float: "a number",
            bool: "true/false", type(None): "nothing"}.get(type(value), type(value).__name__)


def from_pydantic(err: dict, source: str, marks: Marks, allowed_fields: Callable[[tuple], list[str]]) -> PolicyIssue:
    """One pydantic error as an issue; `allowed_fields(loc)` lists the fields the error's mapping may have."""
    loc = tuple(err["loc"])
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        allowed = allowed_fields(loc)
        guess = suggest(loc[-1], allowed)
        fix = f"did you mean '{guess}'?" if guess else f"remove it; allowed fields: {', '.join(allowed)}"
        return issue_at(source, loc, marks, f"unknown field '{loc[-1]}'", fix)
    if kind == "missing":
        what = {"backends": "a `backends:` section", "routes": "a `routes:` section"}.get(loc[-1], f"`{loc[-1]}:`")
        return issue_at(source, loc, marks, f"missing required field '{loc[-1]}'", f"add {what}")
    if kind == "literal_error":
        expected = re.findall(r"'([^']*)'", err.get("ctx", {}).get("expected", ""))
        guess = suggest(str(value), expected)
        fix = f"use one of: {', '.join(expected)}" + (f" (did you mean '{guess}'?)" if guess else "")
        return issue_at(source, loc, marks, f"invalid value {value!r}", fix)
    if kind in ("dict_type", "model_type") and value is None:
        return issue_at(source, loc, marks, "the section is empty", "add entries under it, or remove the key")
    if kind in ("dict_type", "model_type"):
        return issue_at(source, loc, marks, f"expected a mapping of `key: value` lines, got {typename(value)}",
                        "indent the fields under this key")
    if kind == "list_type":
        return issue_at(source, loc, marks, f"expected a list, got {typename(value)}",
                        f"write it as a list, e.g. [{value}]" if isinstance(value, str) else "write it as [a, b]")
    msg = err["msg"].removeprefix("Value error, ")
    return issue_at(source, loc, marks, f"{msg} (got {value!r})", "change the value to one that fits")
