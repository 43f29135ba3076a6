"""An EAGLE draft directory: config.json ("switchyard_eagle": the shape), model.safetensors (the trained tensors;
2-D ones as int8 with an fp16 scale per 32 values, as the distilled drafts store theirs) and README.md.
The embedding, final norm and head rows come from the target at load (EagleDraft.attach_target)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hosted.loader import dequantize_int8_storage, int8_storage
from hosted.spec.eagle_model import EagleDraft, EagleShape

STORAGE_BLOCK = 32
CONFIG_KEY = "switchyard_eagle"


def is_eagle_dir(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and CONFIG_KEY in json.loads(config.read_text())


def save_eagle(draft: EagleDraft, out_dir: Path, card: str, extra: dict[str, Any]) -> int:
    """Write the draft to out_dir atomically (a .partial directory renamed into place); returns the file bytes."""
    tensors: dict[str, torch.Tensor] = {}
    for name, param in draft.trained_parameters().items():
        value = param.detach().float().contiguous()
        if value.dim() == 2 and value.shape[1] % STORAGE_BLOCK == 0:
            tensors[name], tensors[name + "_scale"] = int8_storage(value, STORAGE_BLOCK)
        else:
            tensors[name] = value
    tensors["vocab_ids"] = draft.vocab_ids.clone()
    config = {CONFIG_KEY: draft.shape.as_dict(), "switchyard_storage": {"int8_block_size": STORAGE_BLOCK}, **extra}
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (partial / "README.md").write_text(card)
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(partial, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return (out_dir / "model.safetensors").stat().st_size


def load_eagle(path: str | Path) -> EagleDraft:
    """The draft in `path` (fp32, eval mode), not yet attached to a target."""
    directory = Path(path)
    if not is_eagle_dir(directory):
        raise ValueError(f"{str(directory)!r} is not an EAGLE draft directory (config.json has no {CONFIG_KEY!r}; "
                         f"make one with `switchyard engine distill --method eagle`)")
    config = json.loads((directory / "config.json").read_text())
    draft = EagleDraft(EagleShape(**config[CONFIG_KEY]))
    raw = load_file(str(directory / "model.safetensors"))
    block = config.get("switchyard_storage", {}).get("int8_block_size", STORAGE_BLOCK)
    named = dict(dequantize_int8_storage(raw.items(), block))  # NAME.weight + NAME.weight_scale -> fp32
    draft.vocab_ids.copy_(named.pop("vocab_ids"))
    missing, unexpected = draft.load_state_dict({k: v.float() for k, v in named.items()}, strict=False)
    missing = [m for m in missing if m != "vocab_ids"]
    if missing or unexpected:
        raise ValueError(f"{str(directory)!r}: tensors missing {missing}, unexpected {unexpected}")
    return draft.eval()

