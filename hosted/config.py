"""Model and engine configuration: parse a Hugging Face `config.json` into the fields the engine uses."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ConfigError lives in the leaf hosted/checkpoint.py (the GGUF reader raises it too); imported from here as always.
from hosted.checkpoint import ConfigError, is_gguf, resolve_model_path

__all__ = ["ConfigError", "EngineConfig", "ModelConfig"]

# HF architecture name -> our model family. All three share the Llama block; they differ in biases,
# tied embeddings and defaults, which ModelConfig captures.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Weight-only quantization applied at load time (hosted/layers/linear.py); the int4 group sizes the
# kernels support (kernels.reference.INT4_GROUP_SIZES, kept here so this module needs no torch).
QUANTIZATION_SCHEMES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """The subset of a HF causal-LM config the engine needs (HF field names where one exists)."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": "linear"|"llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    o_bias: bool  # Llama when attention_bias
    mlp_bias: bool
    sliding_window: int | None  # Mistral v0.1 style window; the engine caps max_model_len to it
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # the checkpoint's dtype as stored, informational
    # Set when the checkpoint was saved quantized (`switchyard engine quantize`, config.json
    # "quantization_config"): its linears load as they are, "int8" | "int4" with this int4 group size.
    quantization: str | None = None
    quantization_group_size: int = 0
    # A draft model's narrow output head (config.json "head_vocab_size", written by `switchyard engine distill`):
    # lm_head has this many rows, for the token ids in the tensor lm_head.vocab_ids; every other token gets logit
    # -inf. The input embedding still covers all vocab_size tokens. None: a head over the whole vocabulary.
    head_vocab_size: int | None = None
    # Tensors saved as int8 with per-block scales (config.json "switchyard_storage": {"int8_block_size": B},
    # tensor NAME plus NAME_scale), dequantized at load: a smaller file, not a quantized model. 0: none.
    storage_int8_block_size: int = 0

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """From a HF checkpoint directory, a GGUF file (hosted/gguf_reader.py) or a `package:` reference."""
        path = resolve_model_path(model_dir)
        if is_gguf(path):
            from hosted.gguf_reader import model_config_fields  # gguf is imported only for a GGUF file

            return cls(**model_config_fields(path))
        if not path.is_dir():
            raise ConfigError(f"model directory {str(path)!r} does not exist or is not a directory")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{str(cfg_path)!r} is missing: a Hugging Face checkpoint directory needs config.json")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{str(cfg_path)!r} is not valid JSON: {exc}") from exc
        gen_eos: list[int] = []
        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            try:
                gen_eos = _as_id_list(json.loads(gen_path.read_text()).get("eos_token_id"))
            except json.JSONDecodeError:
                gen_eos = []
        return cls.from_dict(raw, extra_eos_token_ids=gen_eos, source=str(cfg_path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], extra_eos_token_ids: list[int] | None = None,
                  source: str = "config.json") -> ModelConfig:
        arch = _architecture(raw, source)
        family = SUPPORTED_ARCHITECTURES[arch]
        hidden, heads, kv_heads, head_dim = _attention_shape(raw, source)
        _check_supported_features(raw, source)
        rope_theta, rope_scaling = _parse_rope(raw, source)
        attention_bias = bool(raw.get("attention_bias", False))
        eos = _eos_token_ids(raw, extra_eos_token_ids)
        return cls(
            architecture=arch,
            model_type=family,
            vocab_size=int(_need(raw, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_need(raw, "intermediate_size", source)),
            num_hidden_layers=int(_need(raw, "num_hidden_layers", source)),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or (family == "llama" and attention_bias),
            o_bias=family == "llama" and attention_bias,
            mlp_bias=family == "llama" and bool(raw.get("mlp_bias", False)),
            sliding_window=_sliding_window(raw, family),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            **_parse_quantization(raw, source),
            **_parse_draft_fields(raw, source),
        )


def _parse_draft_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelConfig's head_vocab_size / storage_int8_block_size from a distilled draft's config.json."""
    out: dict[str, Any] = {}
    head = raw.get("head_vocab_size")
    if head is not None:
        vocab = int(raw["vocab_size"])
        if not isinstance(head, int) or not 0 < head <= vocab:
            raise ConfigError(f"{source}: head_vocab_size must be an integer in [1, vocab_size={vocab}], got {head!r}")
        if raw.get("tie_word_embeddings"):
            raise ConfigError(f"{source}: head_vocab_size needs an untied lm_head (tie_word_embeddings false)")
        out["head_vocab_size"] = head
    storage = raw.get("switchyard_storage")
    if storage is not None:
        block = storage.get("int8_block_size") if isinstance(storage, dict) else None
        if not isinstance(block, int) or block <= 0:
            raise ConfigError(f"{source}: switchyard_storage must be {{\"int8_block_size\": N}} with N > 0, "
                              f"got {storage!r}")
        out["storage_int8_block_size"] = block
    return out


# config.json "quantization_config" of a checkpoint written by `switchyard engine quantize`.
QUANT_METHOD = "switchyard"


def _parse_quantization(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelConfig's quantization fields from "quantization_config" (none: a full-precision checkpoint)."""
    qc = raw.get("quantization_config")
    if qc is None:
        return {}
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: quantization_config must be an object")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise ConfigError(f"{source}: quantization_config.quant_method {method!r} is not supported: only "
                          f"{QUANT_METHOD!r} checkpoints (written by `switchyard engine quantize`) load quantized")
    bits = qc.get("bits")
    if bits not in (8, 4):
        raise ConfigError(f"{source}: quantization_config.bits {bits!r} is not supported (8 or 4)")
    if bits == 8:
        return {"quantization": "int8", "quantization_group_size": 0}
    group = qc.get("group_size")
    if group not in INT4_GROUP_SIZES:
        raise ConfigError(f"{source}: quantization_config.group_size {group!r} is not supported for bits 4 "
                          f"({', '.join(map(str, INT4_GROUP_SIZES))})")
    return {"quantization": "int4", "quantization_group_size": int(group)}


def _architecture(raw: dict[str, Any], source: str) -> str:
    """The supported HF architecture named in `architectures` (or implied by `model_type` when absent)."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is not None:
        return arch
    # Fall back to model_type when `architectures` is absent (configs saved from a bare config object).
    by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    if not archs and raw.get("model_type") in by_type:
        return by_type[raw["model_type"]]
    raise ConfigError(f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                      f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _need(raw: dict[str, Any], key: str, source: str) -> Any:
    if raw.get(key) is None:
        raise ConfigError(f"{source}: required field {key!r} is missing")
    return raw[key]


def _attention_shape(raw: dict[str, Any], source: str) -> tuple[int, int, int, int]:
    """(hidden_size, num_attention_heads, num_key_value_heads, head_dim)."""
    hidden = int(_need(raw, "hidden_size", source))
    heads = int(_need(raw, "num_attention_heads", source))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv_heads}")
    return hidden, heads, kv_heads, head_dim


def _check_supported_features(raw: dict[str, Any], source: str) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported (only 'silu')")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise ConfigError(f"{source}: pretraining_tp > 1 is not supported")


def _sliding_window(raw: dict[str, Any], family: str) -> int | None:
    sliding = raw.get("sliding_window")
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        sliding = None
    return int(sliding) if sliding else None


def _eos_token_ids(raw: dict[str, Any], extra: list[int] | None) -> list[int]:
    """config.json's EOS ids, then any others (generation_config.json's) not already listed."""
    eos = _as_id_list(raw.get("eos_token_id"))
    for tok in extra or []:
        if tok not in eos:
            eos.append(tok)
    return eos


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _parse_rope(raw: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """Read rope settings from either the transformers<5 layout (rope_theta + rope_scaling)
    or the transformers>=5 layout (rope_parameters with rope_theta inside)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict[str, Any] | None = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling")
    if scaling:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"{source}: rope scaling type {rope_type!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConfigError(f"{source}: partial_rotary_factor != 1 is not supported")
        if rope_type == "default":
            return theta, None
        scaling["rope_type"] = rope_type
        scaling.setdefault("type", rope_type)
        if rope_type == "llama3":
            for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if key not in scaling:
                    raise ConfigError(f"{source}: llama3 rope scaling needs {key!r}")
        elif "factor" not in scaling:
            raise ConfigError(f"{source}: {rope_type} rope scaling needs 'factor'")
        return theta, scaling
    return theta, None


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
DEFAULT_DECODE_BURST_MS = 20.0  # EngineConfig.decode_burst_ms (and the CLI's default)


@dataclass(slots=True)
class EngineConfig:
    """How to run one model. Field names and defaults are the engine's public contract."""

    model_dir: str
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str | None = None  # None -> cuda if available else cpu
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_gb: float | None = None  # None -> see ModelRunner.default_kv_cache_bytes
    num_kv_blocks: int | None = None  # explicit pool size, overrides kv_cache_gb
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: config.max_position_embeddings (capped by sliding_window)
    # Weight-only quantization of every decoder-layer linear (not the embedding or lm_head): None keeps the
    # weights in `dtype`; "int8" = symmetric per output channel; "int4" = asymmetric (zero points), groups
    # of `quantization_group_size` input features. Activations and the KV cache stay in `dtype`.
    quantization: str | None = None
    quantization_group_size: int = 128  # int4 only; must divide every quantized layer's in_features
    # The lm_head read as int8 on CPU (the native VNNI GEMM; its full-precision weight stays for the embedding
    # lookup): None = when the decoder layers are quantized (as llama.cpp's q8_0 quantizes the tied head).
    quantize_head: bool | None = None
    # The KV cache's element type: "auto" = `dtype`; "bfloat16" beside float32 / int8 / int4 weights halves the
    # bytes every decode step reads from the cache and doubles the tokens a pool holds (llama.cpp keeps f16 KV by
    # default); K and V are rounded to bf16 when written, attention still computes in fp32. CPU only for now.
    kv_cache_dtype: str = "auto"
    # Serving (AsyncLLMEngine): decode-only steps run back to back for up to this many milliseconds before their
    # tokens go to the server, which then detokenizes and writes them once per burst instead of once per token
    # (on a CPU host that work shares the cores with the next step). A new request, an abort, a finished request
    # or a preemption ends a burst at once; streams arrive in bursts no longer than this. 0 = every step.
    decode_burst_ms: float = DEFAULT_DECODE_BURST_MS
    # Speculative decoding (hosted/spec/): None or "off" = off; "ngram" = prompt lookup (n-grams of spec_ngram_max down
    # to spec_ngram_min tokens); "draft" = draft_model_dir, a small model with the same vocabulary (a draft
    # directory alone implies "draft"); "eagle" = draft_model_dir holds a feature-level draft (one layer reading the
    # target's hidden states, `distill --method eagle`).
    # Up to num_speculative_tokens drafts per decode per step, as many as
    # measured goodput favours (none when verifying costs more than it saves); spec_adaptive=False always
    # verifies every draft offered (tests, benchmarks). spec_ngram_alongside (eagle / draft): each sequence
    # also looks up n-grams, and a step takes whichever proposal the planner expects to pay more. `engine serve`'s
    # default ("auto") is resolved to these fields by hosted/spec/default.py.
    speculative: str | None = None
    draft_model_dir: str | None = None
    num_speculative_tokens: int = 4
    spec_adaptive: bool = True
    spec_ngram_min: int = 1
    spec_ngram_max: int = 3
    spec_ngram_alongside: bool = False
    # KV-cache tiers (hosted/kv_tiers.py): cached blocks the device pool evicts move to host memory (kv_host_gb)
    # and beyond it to kv_disk_dir (kv_disk_gb), and come back on a prefix hit when restoring is cheaper than
    # recomputing (kv_restore "auto"; "always" restores every hit: tests, benchmarks). kv_disk_persist keeps the
    # directory's blocks across restarts; otherwise it is scratch, cleared at start. 0 / None: no such tier.
    kv_host_gb: float = 0.0
    kv_disk_dir: str | None = None
    kv_disk_gb: float = 10.0
    kv_disk_persist: bool = False
    kv_restore: str = "auto"
    # Kernel switches (kernels/switches.py): None = the process's (the default, or its SWITCHYARD_* environment
    # override read once at start). kernels: auto | triton | reference; cpu_native: the compiled CPU kernels
    # (built once per process); cpu_packed_weights: CPU GEMMs on a packed copy of the weights; cpu_decode_step:
    # decode steps through the native layer loop (else the per-op loop).
    kernels: str | None = None
    cpu_native: bool | None = None
    cpu_packed_weights: bool | None = None
    cpu_decode_step: bool | None = None

    @property
    def spec_method(self) -> str | None:
        if self.speculative == "off":
            return None
        if self.speculative is None and self.draft_model_dir is not None:
            return "draft"
        return self.speculative

    def validate(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_SCHEMES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_SCHEMES)} (or None), "
                             f"got {self.quantization!r}")
        if not (isinstance(self.decode_burst_ms, int | float) and 0 <= self.decode_burst_ms <= 1000):
            raise ValueError(f"decode_burst_ms must be a number of milliseconds in [0, 1000], got {self.decode_burst_ms!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                             f"got {self.quantization_group_size!r}")
        self._validate_spec()
        if self.kv_host_gb < 0 or self.kv_disk_gb < 0:
            raise ValueError(f"kv_host_gb and kv_disk_gb must be >= 0, got {self.kv_host_gb}, {self.kv_disk_gb}")
        if self.kv_restore not in ("auto", "always"):
            raise ValueError(f"kv_restore must be 'auto' or 'always', got {self.kv_restore!r}")

    @property
    def kv_tiering(self) -> bool:
        return self.enable_prefix_caching and (self.kv_host_gb > 0 or self.kv_disk_dir is not None)

    def _validate_spec(self) -> None:
        method = self.spec_method
        if method not in (None, "ngram", "draft", "eagle"):
            raise ValueError(f"speculative must be 'ngram', 'draft', 'eagle' or 'off' (or None), got {self.speculative!r}")
        if self.speculative == "off" and self.draft_model_dir is not None:
            raise ValueError("speculative='off' with draft_model_dir set: leave out the draft, or choose a method")
        if self.spec_ngram_alongside and method not in ("draft", "eagle"):
            raise ValueError("spec_ngram_alongside needs a draft (speculative 'draft' or 'eagle')")
        if method in ("draft", "eagle") and self.draft_model_dir is None:
            raise ValueError(f"speculative={method!r} needs draft_model_dir (--draft DIR)")
        if method == "ngram" and self.draft_model_dir is not None:
            raise ValueError("draft_model_dir is set but speculative='ngram': choose one proposer")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= spec_ngram_min <= spec_ngram_max, "
                             f"got {self.spec_ngram_min}..{self.spec_ngram_max}")
