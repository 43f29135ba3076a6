"""The draft being distilled: a trainable Llama (plain PyTorch, padded batches, SDPA) with a narrow output head,
initialised from the teacher, and its export as a checkpoint the engine serves as a `--draft`.

Same math as hosted/models/llama.py (RMSNorm, GQA attention with HF rotate-half rotary, SwiGLU MLP), so a
student holding all of the teacher's layers and a full head reproduces the teacher's logits (tested). The
engine model is built for serving (paged KV, fused projections, no autograd); this one for training.

Cheap by construction:
  * layers: `num_layers` of the teacher's, evenly spaced from the first to the last (the residual stream's
    entry and exit matter most), copied when the hidden size is the teacher's; a narrower `hidden` starts the
    layers from scratch and the embedding from the teacher's projected onto its top principal directions;
  * head: only the `head_vocab` most frequent tokens of the teacher's own outputs (its rows initialised from
    the teacher's head), the rest get logit -inf. At 49,152 x 576 a full head is 28M parameters -- a fifth of
    SmolLM2 -- and most of a small draft's forward; 8,192 rows cover almost every token the teacher emits;
  * the input embedding stays the teacher's (frozen): it is a lookup, nearly free at run time.
The export stores every 2-D tensor as int8 with one fp16 scale per 32 values (the Q8_0 layout; the loader
dequantizes at load), which keeps the file at tens of MB; acceptance is measured on the exported file.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from hosted.config import ModelConfig
from hosted.loader import hf_state_dict, int8_storage, load_model
from hosted.models import resolve_model_path
from hosted.tools.quantize import checkpoint_config, write_tokenizer_files
from kernels.reference import rotary_cos_sin

STORAGE_BLOCK = 32


def hf_layer_name(name: str) -> str:
    """A student layer's parameter name (q_proj.weight, gate_proj.weight, ...) under its HF checkpoint name."""
    module = name.split(".", 1)[0]
    if module in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return f"self_attn.{name}"
    if module in ("gate_proj", "up_proj", "down_proj"):
        return f"mlp.{name}"
    return name  # the two layer norms keep their names


@dataclass(slots=True)
class StudentShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_vocab: int  # rows of the output head (== vocab_size: a full head)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    teacher_layers: list[int]  # the teacher layer each student layer started from ([] when trained from scratch)


def student_shape(teacher: ModelConfig, num_layers: int, hidden: int | None, head_vocab: int) -> StudentShape:
    """The student's shape for --layers / --hidden / --head-vocab, checked against the teacher's."""
    if not 1 <= num_layers <= teacher.num_hidden_layers:
        raise ValueError(f"--layers must be in [1, {teacher.num_hidden_layers}] (the teacher's), got {num_layers}")
    hidden = hidden or teacher.hidden_size
    d = teacher.head_dim
    if hidden > teacher.hidden_size or hidden % d:
        raise ValueError(f"--hidden must be a multiple of the head dim {d} and at most the teacher's "
                         f"{teacher.hidden_size}, got {hidden}")
    if not 1 <= head_vocab <= teacher.vocab_size:
        raise ValueError(f"--head-vocab must be in [1, {teacher.vocab_size}], got {head_vocab}")
    if hidden == teacher.hidden_size:
        heads, kv_heads, inter = teacher.num_attention_heads, teacher.num_key_value_heads, teacher.intermediate_size
        n = teacher.num_hidden_layers
        layers = sorted({round(i * (n - 1) / max(num_layers - 1, 1)) for i in range(num_layers)})
    else:
        heads = hidden // d
        kv_heads = math.gcd(heads, teacher.num_key_value_heads)
        inter = max(64, round(teacher.intermediate_size * hidden / teacher.hidden_size / 64) * 64)
        layers = []
    return StudentShape(teacher.vocab_size, hidden, inter, num_layers, heads, kv_heads, d, head_vocab,
                        teacher.rms_norm_eps, teacher.rope_theta, teacher.rope_scaling,
                        teacher.max_position_embeddings, layers)


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class _Layer(nn.Module):
    def __init__(self, s: StudentShape) -> None:
        super().__init__()
        h, d = s.hidden_size, s.head_dim
        self.heads, self.kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, d
        self.input_layernorm = _RMSNorm(h, s.rms_norm_eps)
        self.q_proj = nn.Linear(h, s.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, s.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, s.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(s.num_heads * d, h, bias=False)
        self.post_attention_layernorm = _RMSNorm(h, s.rms_norm_eps)
        self.gate_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(y).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(y).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Student(nn.Module):
    """Causal LM over padded [B, T] batches: logits over the head's tokens only ([B, T, head_vocab])."""

    def __init__(self, shape: StudentShape) -> None:
        super().__init__()
        self.shape = shape
        # Frozen: the teacher's (or its projection); a buffer, so the optimizer never holds 28M states for it.
        self.register_buffer("embed", torch.zeros(shape.vocab_size, shape.hidden_size))
        self.layers = nn.ModuleList(_Layer(shape) for _ in range(shape.num_layers))
        self.norm = _RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.head_vocab, bias=False)
        self.register_buffer("vocab_ids", torch.arange(shape.head_vocab, dtype=torch.int64))
        cos_sin = rotary_cos_sin(shape.head_dim, shape.max_position_embeddings, shape.rope_theta,
                                 shape.rope_scaling)
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        half = self.shape.head_dim // 2
        cos, sin = self.cos_sin[:t, :half], self.cos_sin[:t, half:]
        x = self.embed[input_ids]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x)).float()


def new_student(shape: StudentShape, teacher_dir: str, teacher_cfg: ModelConfig, head_tokens: list[int],
                seed: int) -> Student:
    """A student initialised from the teacher: embedding (frozen), final norm, head rows and -- at the teacher's
    width -- the chosen layers; a narrower student's layers start from a random init seeded by `seed`."""
    torch.manual_seed(seed)
    student = Student(shape)
    _init_from_teacher(student, teacher_dir, teacher_cfg, head_tokens)
    return student


def _init_from_teacher(student: Student, teacher_dir: str, teacher_cfg: ModelConfig,
                       head_tokens: list[int]) -> None:
    s = student.shape
    weights = teacher_state(teacher_dir, teacher_cfg)
    embed = weights["model.embed_tokens.weight"]
    head = weights.get("lm_head.weight", embed)
    ids = torch.tensor(head_tokens, dtype=torch.int64)
    with torch.no_grad():
        student.vocab_ids.copy_(ids)
        if s.hidden_size == teacher_cfg.hidden_size:
            student.embed.copy_(embed)
            student.lm_head.weight.copy_(head[ids])
            student.norm.weight.copy_(weights["model.norm.weight"])
            for mine, theirs in zip(student.layers, s.teacher_layers):
                prefix = f"model.layers.{theirs}."
                for name, param in mine.named_parameters():
                    param.copy_(weights[prefix + hf_layer_name(name)])
        else:
            # Principal directions of the teacher's embedding: the best rank-H linear map of its token space.
            centered = embed - embed.mean(dim=0, keepdim=True)
            _, _, v = torch.linalg.svd(centered[:: max(1, embed.shape[0] // 8192)], full_matrices=False)
            basis = v[: s.hidden_size].T  # [teacher_hidden, hidden]
            projected = embed @ basis
            student.embed.copy_(projected * (embed.norm(dim=1).mean() / projected.norm(dim=1).mean()))
            student.lm_head.weight.copy_((head @ basis)[ids])


def teacher_state(teacher_dir: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The teacher's weights in fp32 under HF names (a GGUF file's blocks dequantized)."""
    model = load_model(teacher_dir, cfg, torch.float32, torch.device("cpu"))
    return hf_state_dict(model)


def export_draft(student: Student, out_dir: Path, teacher_dir: str, teacher_cfg: ModelConfig,
                 card: str, extra_config: dict[str, Any]) -> int:
    """Write the student as an engine checkpoint (config.json with head_vocab_size and int8 storage,
    model.safetensors, the teacher's tokenizer files, README.md) to out_dir, atomically; returns its bytes."""
    s = student.shape
    tensors: dict[str, torch.Tensor] = {}

    def put(name: str, value: torch.Tensor) -> None:
        value = value.detach().float().contiguous()
        if value.dim() == 2 and value.shape[1] % STORAGE_BLOCK == 0:
            q, scale = int8_storage(value, STORAGE_BLOCK)
            tensors[name], tensors[name + "_scale"] = q, scale
        else:
            tensors[name] = value.to(torch.bfloat16)

    put("model.embed_tokens.weight", student.embed)
    for i, layer in enumerate(student.layers):
        for name, param in layer.named_parameters():
            put(f"model.layers.{i}.{hf_layer_name(name)}", param)
    put("model.norm.weight", student.norm.weight)
    put("lm_head.weight", student.lm_head.weight)
    tensors["lm_head.vocab_ids"] = student.vocab_ids.clone()

    source = resolve_model_path(teacher_dir)
    config = checkpoint_config(source, teacher_cfg, "bfloat16")
    config.pop("quantization_config", None)
    config.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden_size,
                   "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_layers,
                   "num_attention_heads": s.num_heads, "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
                   "tie_word_embeddings": False, "head_vocab_size": s.head_vocab,
                   "switchyard_storage": {"int8_block_size": STORAGE_BLOCK},
                   "switchyard_draft": {"shape": asdict(s), **extra_config}})
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_files(source, teacher_cfg, partial)
    (partial / "README.md").write_text(card)
    for f in partial.iterdir():
        f.chmod(0o644)
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(partial, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return (out_dir / "model.safetensors").stat().st_size
