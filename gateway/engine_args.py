"""A backend's `engine_args` against `switchyard engine serve`'s own argument parser: each flag must be one of its
options and each value one it would take (type and choices, as argparse converts them); what passes becomes the
argument line an embedded engine is started with.

The parser is the engine's (hosted/engine_args.py, reached through gateway/cli.py, no torch): there is no second
list of flags here. A switch (an option that takes no value) is written `true` or `false`: true passes the flag,
false leaves it out (or passes `--no-FLAG` where the option has one). An option with an "off" choice takes
YAML's unquoted `off` (read as false) as that choice (`speculative: off`).
"""
from __future__ import annotations

import argparse
import difflib
import functools
import re
from dataclasses import dataclass

# Options the gateway sets on every embedded engine, and what to write in the policy instead.
GATEWAY_SET = {
    "model": "set `engine_model_path:` instead",
    "served-model-name": "the backend's `model:` is the name it serves",
    "port": "set `engine_port:` instead (default: a free port)",
    "host": "embedded engines listen on 127.0.0.1, for the gateway only",
    "help": "remove it",
}


@dataclass(slots=True, frozen=True)
class ArgProblem:
    key: str  # as written in the policy
    problem: str
    fix: str


@functools.cache
def _parser() -> argparse.ArgumentParser | None:
    """The engine's parser; None when the engine's package is not installed (nothing to check against)."""
    try:
        from gateway.cli import engine_serve_parser

        return engine_serve_parser()
    except ImportError:
        return None


def available() -> bool:
    return _parser() is not None


def _flag(key: str) -> str:
    return str(key).strip().lstrip("-").replace("_", "-")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for o, a in parser._option_string_actions.items() if o.startswith("--")}


def check(engine_args: dict) -> list[ArgProblem]:
    """Every problem with `engine_args` ([] when the engine is not installed: see `available`)."""
    parser = _parser()
    if parser is None:
        return []
    options = _options(parser)
    problems = []
    for key, value in engine_args.items():
        flag = _flag(key)
        if flag in GATEWAY_SET:
            problems.append(ArgProblem(key, f"--{flag} is set by the gateway", GATEWAY_SET[flag]))
        elif f"--{flag}" not in options:
            problems.append(ArgProblem(key, f"--{flag} is not an option of `switchyard engine serve`",
                                       _did_you_mean(flag, options)))
        else:
            problem = _value_problem(options[f"--{flag}"], flag, value)
            if problem is not None:
                problems.append(ArgProblem(key, *problem))
    return problems


def _did_you_mean(flag: str, options: dict[str, argparse.Action]) -> str:
    names = [o for o in options if o[2:] not in GATEWAY_SET]
    # An option whose help names this flag as another server's (TGI's --max-batch-size is our --max-num-seqs).
    named = re.compile(rf"--{re.escape(flag)}(?![\w-])")
    guesses = [o for o in names if named.search(options[o].help or "")]
    guesses += [g for g in difflib.get_close_matches(f"--{flag}", names, n=3, cutoff=0.5) if g not in guesses]
    listing = "`switchyard engine serve --help` lists every option"
    return f"did you mean {' or '.join(guesses[:3])}? ({listing})" if guesses else listing


def _value_problem(action: argparse.Action, flag: str, value: object) -> tuple[str, str] | None:
    """(problem, fix) when argparse would refuse `value` for this option (or the line could not say it)."""
    if action.nargs == 0:
        if isinstance(value, bool):
            return None
        return f"--{flag} is a switch: write true or false (got {value!r})", f"write `{flag}: true`"
    value = _yaml_off(action, value)
    if isinstance(value, bool):
        return f"--{flag} needs a value (got {str(value).lower()})", f"write `{flag}: VALUE` ({action.help})"
    text = str(value)
    converted: object = text
    if action.type is not None:
        try:
            converted = action.type(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            kind = getattr(action.type, "__name__", "")
            return f"--{flag}: invalid {kind} value: {text!r}", f"write a {kind}" + (
                f" ({action.help})" if action.help else "")
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        guess = difflib.get_close_matches(text, [str(c) for c in action.choices], n=1)
        return (f"--{flag}: invalid choice: {text!r} (choose from {choices})",
                f"did you mean {guess[0]!r}?" if guess else f"use one of: {choices}")
    return None


def argv(engine_args: dict) -> list[str]:
    """The flags for the engine's command line (checked args: see `check`)."""
    parser = _parser()
    options = _options(parser) if parser is not None else {}
    out: list[str] = []
    for key, value in engine_args.items():
        flag = _flag(key)
        action = options.get(f"--{flag}")
        if isinstance(value, bool) and (action is None or action.nargs == 0):
            if value:
                out.append(f"--{flag}")
            elif isinstance(action, argparse.BooleanOptionalAction) and f"--no-{flag}" in action.option_strings:
                out.append(f"--no-{flag}")
            continue
        out += [f"--{flag}", str(_yaml_off(action, value))]
    return out


def _yaml_off(action: argparse.Action | None, value: object) -> object:
    """YAML reads an unquoted `off` as false: for an option whose choices include "off" it means that."""
    if value is False and action is not None and action.choices is not None and "off" in action.choices:
        return "off"
    return value
