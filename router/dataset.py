"""Read labelled routing data: CSV or JSONL rows saying whether a weak and a strong model
answered a prompt correctly.

A row's request is the `--prompt-col` field (a string), or else a `messages` field (an OpenAI
messages list; in CSV, its JSON text). Labels are booleans, or the strings True/False (any
case), or 1/0. Anything else is an error naming the file, the row and the fix.
"""
from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class DataError(ValueError):
    """The data file cannot be used as it is; the message says where and how to fix it."""


@dataclass(slots=True)
class LabelledSet:
    requests: list            # each a prompt string or a messages list
    weak: np.ndarray          # bool, weak model answered acceptably
    strong: np.ndarray        # bool, strong model answered acceptably
    family: list[str]         # task family / subject ("" when the file has none)
    source: str

    def __len__(self) -> int:
        return len(self.requests)

    def subset(self, idx: np.ndarray) -> LabelledSet:
        return LabelledSet([self.requests[i] for i in idx], self.weak[idx], self.strong[idx],
                           [self.family[i] for i in idx], self.source)


_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


def _parse_bool(value: object, where: str, col: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
    raise DataError(f"{where}: column {col!r} must be True or False, got {value!r}")


def _check_messages(value: object, where: str) -> list[dict]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: 'messages' is not valid JSON ({e})") from e
    if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    return value


def _request(row: dict, where: str, prompt_col: str) -> object:
    if prompt_col in row and row[prompt_col] not in (None, ""):
        value = row[prompt_col]
        if isinstance(value, list):
            return _check_messages(value, where)
        if not isinstance(value, str):
            raise DataError(f"{where}: column {prompt_col!r} must be text, got {type(value).__name__}")
        return value
    if row.get("messages") not in (None, ""):
        return _check_messages(row["messages"], where)
    if prompt_col in row:
        raise DataError(f"{where}: column {prompt_col!r} is empty")
    raise DataError(f"{where}: no {prompt_col!r} (or 'messages') field; name the prompt column with --prompt-col")


def _rows_jsonl(path: Path):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg}); expected one JSON object per line") from e
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
            yield where, row


def _rows_csv(path: Path, required: list[str]):
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        if not header:
            return
        missing = [c for c in required if c not in header]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r} (columns are: {', '.join(header)}); "
                            f"name it with the matching --…-col option")
        for row in reader:
            yield f"{path}:{reader.line_num}", row


def _is_jsonl(path: Path) -> bool:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return True
    if suffix in (".csv", ".tsv"):
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096).lstrip()
    return head.startswith("{")


def load_labelled(path: str | Path, prompt_col: str = "prompt", weak_col: str = "weak_correct",
                  strong_col: str = "strong_correct", family_col: str | None = None) -> LabelledSet:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    requests: list = []
    weak: list[bool] = []
    strong: list[bool] = []
    family: list[str] = []
    if _is_jsonl(path):
        rows = _rows_jsonl(path)
    else:
        with open(path, encoding="utf-8", newline="") as f:
            header = next(csv.reader(f), [])
        required = [weak_col, strong_col] + ([prompt_col] if "messages" not in header else [])
        rows = _rows_csv(path, required)
    fam_cols = [family_col] if family_col else ["family", "subject"]
    try:
        for where, row in rows:
            for col in (weak_col, strong_col):
                if col not in row:
                    raise DataError(f"{where}: no {col!r} field; name the label column with --weak-col/--strong-col")
            requests.append(_request(row, where, prompt_col))
            weak.append(_parse_bool(row[weak_col], where, weak_col))
            strong.append(_parse_bool(row[strong_col], where, strong_col))
            family.append(next((str(row[c]) for c in fam_cols if row.get(c) not in (None, "")), ""))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from e
    if not requests:
        raise DataError(f"{path}: no data rows")
    return LabelledSet(requests, np.array(weak, dtype=bool), np.array(strong, dtype=bool), family, str(path))
