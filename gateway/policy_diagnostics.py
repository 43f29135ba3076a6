"""Policy diagnostics: every problem in a policy file as file:line:col, field, what is wrong and the fix.

Reads YAML while remembering where each key and item starts, and turns YAML syntax errors, duplicate
keys and pydantic validation errors into `PolicyIssue`s. It knows nothing of the policy's schema:
gateway/policy.py passes in what it must know (which fields a location allows).

Limits, so that no file can make the reader spin or crash (a policy is a few KB; these are generous):
- MAX_POLICY_BYTES (1 MiB): a bigger file is refused before it is read in full;
- MAX_YAML_NODES (100,000 values, counted after YAML aliases are expanded): an "alias bomb" (billion
  laughs) is refused while it is composed, at the line of the alias that crosses the limit, before anything
  walks, constructs or validates the expanded document;
- MAX_YAML_DEPTH (64 levels of nesting) instead of a RecursionError; an alias used inside the value it
  names (a recursive document) is refused too.
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import yaml

Marks = dict[tuple, tuple[int, int]]  # path in the document -> (1-based line, column) where it starts

MAX_POLICY_BYTES = 1 << 20
MAX_YAML_NODES = 100_000
MAX_YAML_DEPTH = 64


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


def check_size(nbytes: int, source: str) -> None:
    """Refuse a policy larger than MAX_POLICY_BYTES."""
    if nbytes > MAX_POLICY_BYTES:
        raise PolicyError([PolicyIssue(source, "", f"the file is larger than {MAX_POLICY_BYTES >> 20} MiB "
                                       f"({nbytes:,} bytes or more)",
                                       "a policy is a few KB: check that this is the right file")])


class _TooBig(Exception):
    def __init__(self, issue: PolicyIssue):
        self.issue = issue


class _Loader(yaml.SafeLoader):
    """A SafeLoader that counts, while composing, how many values each node stands for once aliases are
    expanded (the expansion itself never happens: an alias is the anchored node, shared), and refuses a
    document past MAX_YAML_NODES or MAX_YAML_DEPTH. Composing is linear in the file's size, so a refusal
    costs no more than reading the file."""

    def __init__(self, text: str, source: str):
        super().__init__(text)
        self._source = source
        self._sizes: dict[int, int] = {}  # id(node) -> values it stands for, aliases expanded
        self._path: list = []  # where the node being composed is: keys and item indexes
        self._last_alias: tuple[str, yaml.Mark, tuple] | None = None

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        here = (*self._path, _step(index))
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = super().compose_node(parent, index)
            if id(node) not in self._sizes:  # the anchored node is still open: the alias is inside it
                raise self._refuse(event.start_mark, here, f"the alias *{event.anchor} is used inside the "
                                   "value it names", "remove the alias; a setting cannot contain itself")
            self._last_alias = (event.anchor, event.start_mark, here)
            return node
        if len(self._path) >= MAX_YAML_DEPTH:
            raise self._refuse(self.peek_event().start_mark, here, f"values are nested deeper than "
                               f"{MAX_YAML_DEPTH} levels", "a policy needs a few levels: flatten this value")
        self._path.append(here[-1])
        try:
            node = super().compose_node(parent, index)
        finally:
            self._path.pop()
        self._sizes[id(node)] = size = 1 + sum(self._sizes[id(child)] for child in _children(node))
        if size > MAX_YAML_NODES:
            raise self._too_many(node, here, size)
        return node

    def _too_many(self, node: yaml.Node, here: tuple, size: int) -> _TooBig:
        alias = self._last_alias  # blamed when it lies inside the node that grew too big
        if alias is not None and node.start_mark.index <= alias[1].index <= node.end_mark.index:
            anchor, mark, where = alias
            stands_for = self._sizes[id(self.anchors[anchor])]
            return self._refuse(mark, where, f"YAML aliases expand the document past {MAX_YAML_NODES:,} values "
                                f"(*{anchor} here stands for {stands_for:,}; an alias bomb?)",
                                "write the shared values out, or nest fewer aliases")
        return self._refuse(node.start_mark, here, f"the document has more than {MAX_YAML_NODES:,} values "
                            f"({size:,} here)", "a policy needs far fewer: check that this is the right file")

    def _refuse(self, mark: yaml.Mark, path: tuple, problem: str, fix: str) -> _TooBig:
        return _TooBig(PolicyIssue(self._source, fmt_path(p for p in path if p is not None), problem, fix,
                                   mark.line + 1, mark.column + 1))


def _step(index: Any) -> str | int | None:
    """The path step PyYAML's `index` names: a mapping value's key, a sequence position, None for keys."""
    if isinstance(index, yaml.ScalarNode):
        return index.value
    return index if isinstance(index, int) else None


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return node.value
    return []


def read_yaml(text: str, source: str) -> tuple[Any, Marks]:
    """Parse YAML and remember where every key and item starts (1-based line, column)."""
    check_size(len(text.encode("utf-8", "surrogatepass")), source)
    loader = _Loader(text, source)
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
    except _TooBig as e:
        raise PolicyError([e.issue]) from None
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
    if kind == "finite_number":
        return issue_at(source, loc, marks, f"expected a finite number, got {value!r}",
                        "write a number (prices, rates and limits cannot be .inf or .nan)")
    msg = err["msg"].removeprefix("Value error, ")
    return issue_at(source, loc, marks, f"{msg} (got {value!r})", "change the value to one that fits")
