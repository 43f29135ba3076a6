"""The precision `switchyard engine serve` runs a model at: what --dtype / --quantization ask for, or, when
neither is given (`--quantization auto`, the default), the fastest one measured to be sound: within 1% of float32's
perplexity AND keeping float32's greedy answers as test_quantization.py requires of a quantized engine (>= 75% of
the tokens the same until the first flip). Measured on SmolLM2-135M-Instruct's Q4_1 GGUF (docs/engine.md
"Precision", bench/results/default_precision/): every precision is within 1% (bf16 +0.12%, int4 g32 +0.33%,
int8 +0.48%), but the native int8/int4 kernels round the activations to int8 and their greedy chat answers flip
early (int4 54% and int8 30% of the tokens kept; the README's quick-start question answered with nonsense at
int4), while bf16 keeps them all, at 1.3x float32's batch-1 decode speed there (int8 / int4: 1.8-2.3x). So:

  * a GGUF file whose decoder linears are quantized (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0), on a CPU with the native bf16
    kernels: bfloat16 (the weights dequantized to bf16, bf16 KV cache).
  * anything else keeps float32, the default before `auto`: a full-precision file or checkpoint directory (one
    saved quantized by `engine quantize` loads as saved either way), a GPU (not measured), or a CPU without the
    native kernels (no C compiler, SWITCHYARD_CPU_NATIVE=0, SWITCHYARD_CPU_PACKED_WEIGHTS=0), where bf16 runs
    through torch.

An explicit --dtype (weights in that dtype, nothing quantized) or --quantization int8 / int4 / none wins: int4
with group size 32 takes a Q4 file's own blocks.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

AUTO, NONE = "auto", "none"
QUANTIZATION_CHOICES = (AUTO, NONE, "int8", "int4")
DEFAULT_DTYPE = "float32"


@dataclass(frozen=True, slots=True)
class Precision:
    """What the engine loads the model as, who decided (`auto` or `flags`) and why, in words."""

    dtype: str  # activations, KV cache (unless --kv-cache-dtype) and the weights left unquantized
    quantization: str | None  # decoder linears: None | "int8" | "int4"
    group_size: int  # int4's input features per scale/zero group; 0 otherwise
    chosen_by: str  # "auto" | "flags" | "checkpoint"
    reason: str

    @property
    def weights(self) -> str:
        """One label for the decoder weights: int4-g32, int8, float32, bfloat16, float16."""
        if self.quantization == "int4":
            return f"int4-g{self.group_size}"
        return self.quantization or self.dtype

    def as_dict(self) -> dict:
        return {"weights": self.weights, **asdict(self)}

    def describe(self) -> str:
        return f"precision {self.weights} (activations {self.dtype}; {self.chosen_by}: {self.reason})"


def choose(model_path: str | Path, device_type: str, dtype: str | None = None, quantization: str | None = None,
           group_size: int = 128) -> Precision:
    """The precision for `model_path` (a resolved directory or GGUF file) on a device of `device_type` ("cpu",
    "cuda"), given `engine serve`'s --dtype (None: not given), --quantization (None or "auto": decide) and
    --quantization-group-size."""
    from hosted.config import ModelConfig
    from hosted.models import is_gguf

    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    path = Path(model_path)
    gguf = is_gguf(path)
    if not gguf:
        saved = ModelConfig.from_dir(path)
        if saved.quantization is not None and quantization in (None, AUTO, NONE):
            # The loader loads a saved-quantized checkpoint as saved whatever is asked (re-rounding would round twice).
            return Precision(dtype or DEFAULT_DTYPE, saved.quantization, saved.quantization_group_size, "checkpoint",
                             "the checkpoint was saved quantized (`switchyard engine quantize`) and loads as saved")
    if quantization in ("int8", "int4"):
        size = group_size if quantization == "int4" else 0
        flag = f"--quantization {quantization}" + (f" --quantization-group-size {size}" if size else "")
        return Precision(dtype or DEFAULT_DTYPE, quantization, size, "flags", flag)
    if quantization == NONE:
        return Precision(dtype or DEFAULT_DTYPE, None, 0, "flags", "--quantization none")
    if dtype is not None:
        return Precision(dtype, None, 0, "flags", f"--dtype {dtype} without --quantization: nothing quantized")
    return _auto(path, gguf, device_type)


def _auto(path: Path, gguf: bool, device_type: str) -> Precision:
    def keep(reason: str) -> Precision:
        return Precision(DEFAULT_DTYPE, None, 0, AUTO, reason)

    if not gguf:
        return keep("a full-precision checkpoint directory keeps float32")
    from hosted.gguf_loader import QUANTIZED_TYPES, decoder_linear_types

    types = decoder_linear_types(path)
    names = "/".join(sorted(t.name for t in types)) or "none"
    if not types or not types <= set(QUANTIZED_TYPES):
        return keep(f"the file's decoder linears are {names}, not quantized: float32")
    if device_type != "cpu":
        return keep(f"the file's decoder linears are {names}, on {device_type}: float32 (auto is measured on CPUs "
                    f"only)")
    missing = missing_bf16_kernels()
    if missing is not None:
        return keep(f"the file's decoder linears are {names}, but this CPU has no native bf16 kernels ({missing}): "
                    f"float32")
    return Precision("bfloat16", None, 0, AUTO,
                     f"the file's decoder linears are {names}, dequantized to bfloat16: the fastest precision "
                     f"measured to keep float32's perplexity and greedy answers (int4/int8 change the answers; "
                     f"--quantization int4 --quantization-group-size 32 for the file's own blocks)")


def missing_int_kernels() -> str | None:
    """Why quantized linears would not run on the native int8/int4 kernels here (None: they would)."""
    from kernels import cpu_lowp

    return _missing_native(cpu_lowp.FEATURE_VNNI, "int8/int4 dot products (AVX-512 VNNI or AVX2)")


def missing_bf16_kernels() -> str | None:
    """Why bf16 linears would not run on the native bf16 kernels here (None: they would)."""
    from kernels import cpu_lowp

    return _missing_native(cpu_lowp.FEATURE_BF16, "bf16 projections (AVX512-BF16 or AVX2)")


def _missing_native(feature: int, what: str) -> str | None:
    from kernels import switches

    if not switches.current().cpu_packed_weights:  # the process's switch, as hosted/model_runner.py's default
        return "packed CPU weights off (SWITCHYARD_CPU_PACKED_WEIGHTS=0 or cpu_packed_weights)"
    from kernels import cpu_lowp, cpu_native

    if cpu_lowp.features() & feature:
        return None
    return cpu_native.unavailable_reason() or f"the native library was built without {what}"
