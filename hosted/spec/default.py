"""What `--speculative` means for `switchyard engine serve`, resolved once at start: `off`, an explicit method, or
`auto` (the default) -- speculation where a measured default exists, nothing elsewhere.

auto, for SmolLM2-135M-Instruct (the GGUF the shipped policy serves, or a directory of that name): the committed
feature-level draft (hosted/models/smollm2-eagle/, `distill --method eagle`) with adaptive n-gram lookup
alongside (per sequence, whichever proposer the planner expects to pay); while that directory is absent, adaptive
n-gram lookup alone, said in a log line. Any other model: off (no draft is known to pay for it). The goodput
planner decides per step whether speculating pays at all (hosted/spec/planner.py), so `auto` costs no more than
noise where it does not. Imports torch-free modules only.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

AUTO, OFF = "auto", "off"
METHODS = ("ngram", "draft", "eagle")
CHOICES = (AUTO, OFF, *METHODS)
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
EAGLE_CONFIG_KEY = "switchyard_eagle"  # eagle_checkpoint.CONFIG_KEY (that module imports torch)
# The committed feature-level draft for SmolLM2-135M-Instruct, inside the package (found wherever serve runs).
SMOLLM2_EAGLE_DIR = Path(__file__).resolve().parent.parent / "models" / "smollm2-eagle"


@dataclass(frozen=True, slots=True)
class Speculation:
    """EngineConfig's speculation fields as resolved, and why (logged at start)."""

    method: str | None  # None: off
    draft_dir: str | None
    ngram_alongside: bool  # eagle / draft with n-gram lookup per sequence beside it
    reason: str

    def describe(self) -> str:
        what = self.method or "off"
        if self.method in ("eagle", "draft"):
            what += f" (draft {self.draft_dir}{', n-gram alongside' if self.ngram_alongside else ''})"
        return f"speculative decoding {what}: {self.reason}"


def is_smollm2(model_path: str | Path) -> bool:
    """Whether the model is SmolLM2-135M-Instruct, by its file or directory name (the package GGUF's is)."""
    return SMOLLM2_NAME.lower() in Path(str(model_path)).name.lower()


def eagle_draft_present(path: Path = SMOLLM2_EAGLE_DIR) -> bool:
    """A complete feature-level draft directory: its config says it is one, and its weights are there."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return EAGLE_CONFIG_KEY in config and (path / "model.safetensors").is_file()


def resolve(model_path: str | Path, speculative: str | None, draft: str | None,
            eagle_dir: Path = SMOLLM2_EAGLE_DIR) -> Speculation:
    """`--speculative` (None: auto) and `--draft` for this model. An explicit --draft without a method is the
    4-layer kind (as before auto existed); `off` wins over --draft."""
    choice = speculative or AUTO
    if choice not in CHOICES:
        raise ValueError(f"speculative must be one of {', '.join(CHOICES)}, got {speculative!r}")
    if choice == OFF:
        return Speculation(None, None, False, "--speculative off")
    if choice in METHODS:
        if choice == "ngram" and draft is not None:
            raise ValueError("--draft DIR with --speculative ngram: choose one proposer")
        return Speculation(choice, draft if choice != "ngram" else None, False, f"--speculative {choice}")
    if draft is not None:
        return Speculation("draft", draft, False, "--draft DIR without --speculative: a draft model")
    if not is_smollm2(model_path):
        return Speculation(None, None, False, "auto: no draft is known to pay for this model")
    if eagle_draft_present(eagle_dir):
        return Speculation("eagle", str(eagle_dir), True,
                           "auto: the committed feature-level draft with n-gram lookup alongside, each step only "
                           "where the planner measures a gain")
    log.info("speculative auto: %s is absent, serving with adaptive n-gram lookup only", eagle_dir)
    return Speculation("ngram", None, False, f"auto: no feature-level draft at {eagle_dir}; adaptive n-gram lookup")
