"""Pick a routing threshold from labelled data, and write it into a policy route.

Convention (shared with the gateway): a request goes to the strong (`hard`) backend iff
score >= threshold.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml


class CalibrationError(ValueError):
    """The requested target cannot be met, or the policy cannot be edited safely."""


@dataclass(frozen=True, slots=True)
class Calibration:
    threshold: float
    strong_share: float      # share of the calibration rows routed strong at this threshold
    target: str              # what was asked, in words


def _groups(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct scores, descending, and how many rows score at or above each."""
    s = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    ends = np.append(np.flatnonzero(np.diff(s) != 0) + 1, s.size)
    return s, ends


def threshold_for_count(scores: np.ndarray, k: int) -> float:
    """A threshold that sends exactly the k highest-scoring rows strong (k at a tie-group end):
    halfway between the last strong and the first weak score, so it is robust on new data."""
    s = np.sort(np.asarray(scores, dtype=np.float64))[::-1]
    if k <= 0:
        return 1.0
    if k >= s.size:
        return 0.0
    return float((s[k - 1] + s[k]) / 2.0)


def for_strong_share(scores: np.ndarray, target: float) -> Calibration:
    if not 0.0 <= target <= 1.0:
        raise CalibrationError(f"--target-strong-share must be between 0 and 1, got {target}")
    s, ends = _groups(scores)
    ks = np.concatenate([[0], ends])
    k = int(ks[np.argmin(np.abs(ks - target * s.size))])  # nearest achievable share (ties split no further)
    thr = threshold_for_count(s, k)
    return Calibration(thr, float(np.mean(s >= thr)), f"strong share {target:g}")


def max_strong_share_for_budget(max_usd_per_1k: float, weak_usd: float, strong_usd: float) -> float:
    if strong_usd <= weak_usd:
        raise CalibrationError(f"the strong backend must cost more per request than the weak one "
                               f"(got weak {weak_usd:g}, strong {strong_usd:g} USD)")
    per_request = max_usd_per_1k / 1000.0
    if per_request < weak_usd:
        raise CalibrationError(f"a budget of {max_usd_per_1k:g} USD per 1k requests is below the cost of "
                               f"sending everything to the weak backend ({weak_usd * 1000:g} USD per 1k)")
    return min(1.0, (per_request - weak_usd) / (strong_usd - weak_usd))


def for_budget(scores: np.ndarray, max_usd_per_1k: float, weak_usd: float, strong_usd: float) -> Calibration:
    cap = max_strong_share_for_budget(max_usd_per_1k, weak_usd, strong_usd)
    s, ends = _groups(scores)
    ks = np.concatenate([[0], ends])
    k = int(ks[ks <= cap * s.size + 1e-9].max())  # the most strong calls the budget allows
    thr = threshold_for_count(s, k)
    return Calibration(thr, float(np.mean(s >= thr)),
                       f"at most {max_usd_per_1k:g} USD per 1k requests (strong share <= {cap:.4f})")


def policy_snippet(threshold: float, model_path: str) -> str:
    return (f"strategy: difficulty\n"
            f"threshold: {threshold:.6f}\n"
            f"model_path: {json.dumps(model_path)}\n")


# ---- editing a policy file in place ---------------------------------------------------------

def _mapping_get(node: yaml.MappingNode, key: str) -> tuple[yaml.Node, yaml.Node] | None:
    for k, v in node.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            return k, v
    return None


def write_route(policy_path: str | Path, route: str, threshold: float, model_path: str) -> str:
    """Set `threshold` and `model_path` of a difficulty route with targeted text edits, so
    comments and layout survive; validate the result; replace the file atomically. Returns the
    new text. On any problem raises CalibrationError and leaves the file as it was."""
    path = Path(policy_path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CalibrationError(f"{path}: cannot read the policy ({e.strerror or e})") from e
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

    edits: list[tuple[int, int, str]] = []  # (start, end, replacement) on the original text
    indent = node.value[0][0].start_mark.column
    missing: list[str] = []
    for key, value in (("threshold", f"{threshold:.6f}"), ("model_path", json.dumps(model_path))):
        kv = _mapping_get(node, key)
        if kv is None:
            missing.append(f"{' ' * indent}{key}: {value}\n")
        elif isinstance(kv[1], yaml.ScalarNode):
            edits.append((kv[1].start_mark.index, kv[1].end_mark.index, value))
        else:
            raise CalibrationError(f"{path}: routes.{route}.{key} is not a plain value; edit it by hand")
    if missing:
        last_end = node.value[-1][1].end_mark
        # Insert on the line after the route's last value. A block collection "ends" where the
        # next token starts (maybe indented on a later line): then insert before that line.
        line_start = last_end.index - last_end.column
        if not text[line_start:last_end.index].strip():
            pos = line_start
        else:
            nl = text.find("\n", last_end.index)
            pos = len(text) if nl < 0 else nl + 1
        prefix = "" if pos == 0 or text[pos - 1] == "\n" else "\n"
        edits.append((pos, pos, prefix + "".join(missing)))
    new = text
    for start, end, rep in sorted(edits, key=lambda e: e[0], reverse=True):
        new = new[:start] + rep + new[end:]

    _validate(new, path, route, threshold, model_path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(new, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return new


def _validate(text: str, path: Path, route: str, threshold: float, model_path: str) -> None:
    doc = yaml.safe_load(text)
    got = doc["routes"][route]
    if abs(float(got["threshold"]) - threshold) > 1e-6 or got["model_path"] != model_path:
        raise CalibrationError(f"{path}: internal error: the edit did not produce the expected values; "
                               f"file left unchanged")
    try:
        from gateway.policy import PolicyError, parse_policy
    except ImportError:  # a router-only install: the YAML check above is all we can do
        return
    try:
        parse_policy(text, str(path))
    except PolicyError as e:
        raise CalibrationError(f"{path}: the edited policy would not validate, file left unchanged:\n{e}") from e
