"""Write a calibrated threshold into a policy route with targeted text edits (`router calibrate --write`).

Only the route's `threshold` and `model_path` values change (or are added after its last value), so
comments and layout survive; the result is validated with the gateway's policy parser before the
file is replaced atomically. Every problem raises router.calibrate.CalibrationError (so the router
CLI reports it as one `error:` line, exit 2) and leaves the file as it was.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from gateway.policy import PolicyError, parse_policy
from router.calibrate import CalibrationError

Edit = tuple[int, int, str]  # (start, end, replacement) on the original text


def write_route(policy_path: str | Path, route: str, threshold: float, model_path: str) -> str:
    """Set `threshold` and `model_path` of a difficulty route; validate; replace the file atomically.
    Returns the new text. On any problem raises CalibrationError and leaves the file as it was."""
    path = Path(policy_path)
    text = _read(path)
    node = _route_node(text, path, route)
    values = {"threshold": f"{threshold:.6f}", "model_path": json.dumps(model_path)}
    new = _apply(text, _edits(text, node, path, route, values))
    _validate(new, path, route, threshold, model_path)
    _replace(path, new)
    return new


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise CalibrationError(f"{path}: cannot read the policy ({e.strerror or e})") from e


def _mapping_get(node: yaml.MappingNode, key: str) -> tuple[yaml.Node, yaml.Node] | None:
    for k, v in node.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            return k, v
    return None


def _route_node(text: str, path: Path, route: str) -> yaml.MappingNode:
    """The route's block mapping in the composed YAML; it must be a `strategy: difficulty` route."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise CalibrationError(f"{path}: not valid YAML ({e}); fix it before calibrating into it") from e
    if not isinstance(root, yaml.MappingNode) or _mapping_get(root, "routes") is None:
        raise CalibrationError(f"{path}: no `routes:` section; add the route first")
    routes = _mapping_get(root, "routes")[1]
    if not isinstance(routes, yaml.MappingNode):
        raise CalibrationError(f"{path}: `routes:` must be a mapping of route names")
    found = _mapping_get(routes, route)
    if found is None:
        names = ", ".join(k.value for k, _ in routes.value) or "none"
        raise CalibrationError(f"{path}: no route {route!r} (routes: {names})")
    node = found[1]
    if not isinstance(node, yaml.MappingNode) or node.flow_style or not node.value:
        raise CalibrationError(f"{path}: route {route!r} must be a block mapping to be edited; edit it by hand")
    strategy = _mapping_get(node, "strategy")
    if strategy is None or strategy[1].value != "difficulty":
        raise CalibrationError(f"{path}: route {route!r} is not `strategy: difficulty`; set the strategy "
                               f"and its `easy:` and `hard:` backends first")
    return node


def _edits(text: str, node: yaml.MappingNode, path: Path, route: str, values: dict[str, str]) -> list[Edit]:
    """Replace each key's plain value in place; add the keys the route lacks as new lines."""
    edits: list[Edit] = []
    indent = node.value[0][0].start_mark.column
    missing: list[str] = []
    for key, value in values.items():
        kv = _mapping_get(node, key)
        if kv is None:
            missing.append(f"{' ' * indent}{key}: {value}\n")
        elif isinstance(kv[1], yaml.ScalarNode):
            edits.append((kv[1].start_mark.index, kv[1].end_mark.index, value))
        else:
            raise CalibrationError(f"{path}: routes.{route}.{key} is not a plain value; edit it by hand")
    if missing:
        pos = _insert_position(text, node)
        prefix = "" if pos == 0 or text[pos - 1] == "\n" else "\n"
        edits.append((pos, pos, prefix + "".join(missing)))
    return edits


def _insert_position(text: str, node: yaml.MappingNode) -> int:
    """The start of the line after the route's last value. A block collection "ends" where the next
    token starts (maybe indented on a later line): then insert before that line."""
    last_end = node.value[-1][1].end_mark
    line_start = last_end.index - last_end.column
    if not text[line_start:last_end.index].strip():
        return line_start
    nl = text.find("\n", last_end.index)
    return len(text) if nl < 0 else nl + 1


def _apply(text: str, edits: list[Edit]) -> str:
    for start, end, rep in sorted(edits, key=lambda e: e[0], reverse=True):
        text = text[:start] + rep + text[end:]
    return text


def _validate(text: str, path: Path, route: str, threshold: float, model_path: str) -> None:
    doc = yaml.safe_load(text)
    got = doc["routes"][route]
    if abs(float(got["threshold"]) - threshold) > 1e-6 or got["model_path"] != model_path:
        raise CalibrationError(f"{path}: internal error: the edit did not produce the expected values; "
                               f"file left unchanged")
    try:
        parse_policy(text, str(path))
    except PolicyError as e:
        raise CalibrationError(f"{path}: the edited policy would not validate, file left unchanged:\n{e}") from e


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
