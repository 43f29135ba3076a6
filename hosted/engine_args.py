"""The arguments of `switchyard engine serve`, defined once. hosted/cli.py builds the command from here, and the
gateway checks a policy's `engine_args` against the same definition (gateway/engine_args.py, through
gateway/cli.py): a flag or value this parser refuses is refused when the policy loads, not when the engine
exits 2 (a name other servers use is mentioned in the help of ours, and the gateway's "did you mean" reads it).
Imports argparse and torch-free constants only, so a gateway-only install can read it."""
from __future__ import annotations

import argparse

from hosted.config import DEFAULT_DECODE_BURST_MS, KV_CACHE_DTYPES
from hosted.models import SMOLLM2_MODEL
from hosted.precision import QUANTIZATION_CHOICES
from hosted.spec.default import CHOICES as SPEC_CHOICES

MODEL_HELP = ("checkpoint directory (config.json, *.safetensors, tokenizer.json), a llama-architecture GGUF "
              f"file, or package:NAME/FILE (a file inside an installed package, e.g. {SMOLLM2_MODEL})")
SERVE_HELP = "serve a model over the OpenAI API"
SERVE_DESCRIPTION = "Serve a Hugging Face checkpoint directory or a GGUF file over an OpenAI-compatible API."


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of `switchyard engine serve`."""
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--served-model-name", default=None,
                   help="model name reported by the API (default: the directory's or file's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="activations and unquantized weights; given without --quantization, the weights stay in it, "
                        "nothing quantized (default: as --quantization auto decides, float32 or bfloat16)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="most sequences decoded in one step (the batch size: TGI's --max-batch-size, llama.cpp's "
                        "--parallel)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per step (TGI's --max-batch-total-tokens)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests beyond which the server answers 429 (TGI's --max-concurrent-requests)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache memory budget in GiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-cache-gb)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's max_position_embeddings; llama.cpp's "
                        "--ctx-size, TGI's --max-total-tokens)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help="weight-only quantization of the decoder linears at load time (embedding and lm_head "
                        "stay in --dtype): int8 per output channel, int4 group-wise with zero points (with group "
                        "size 32 a Q4_0/Q4_1 GGUF's own blocks); none: keep them in --dtype. Default auto, when "
                        "--dtype is not given either: a quantized GGUF file on a CPU with the native bf16 kernels "
                        "is served as bfloat16 (the fastest precision measured to keep float32's perplexity and "
                        "greedy answers), anything else as float32 (docs/engine.md, Precision)")
    p.add_argument("--quantization-group-size", type=int, default=128, choices=[32, 64, 128],
                   help="--quantization int4: input features per scale/zero group; must divide every layer's input "
                        "size (32 maps a Q4_0/Q4_1 GGUF's blocks as they are)")
    p.add_argument("--quantize-head", default=None, action=argparse.BooleanOptionalAction,
                   help="read the lm_head as int8 on CPU (default: when the decoder linears are quantized, by "
                        "--quantization or the checkpoint)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache element type (default auto: --dtype); bfloat16 beside float32 or int8/int4 weights "
                        "halves the cache bytes each decode step reads and doubles the tokens the pool holds (CPU)")
    p.add_argument("--decode-burst-ms", type=float, default=DEFAULT_DECODE_BURST_MS, metavar="MS",
                   help="run decode-only steps back to back for up to MS milliseconds before their tokens are "
                        "streamed (one SSE chunk per burst; a new request or an abort ends a burst at once); "
                        "0 streams every step's token")
    p.add_argument("--speculative", default=None, choices=list(SPEC_CHOICES),
                   help="speculative decoding: auto (default) = for SmolLM2-135M-Instruct the committed feature-level "
                        "draft with n-gram lookup alongside (n-gram alone until that draft is present), off for other "
                        "models; off; ngram = prompt lookup (no draft model); draft = --draft DIR; eagle = --draft DIR "
                        "holds a feature-level draft reading the target's hidden states. Each step speculates only "
                        "where the planner measures a gain")
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="draft model for speculative decoding (same tokenizer as --model); implies --speculative draft")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="most draft tokens verified per sequence per step; each step picks 0..K from measured goodput")
    p.add_argument("--kv-host-gb", type=float, default=0.0, metavar="G",
                   help="host memory (GiB; pinned on CUDA) for prefix-cache KV blocks the device pool evicts: a "
                        "returning prompt restores them instead of recomputing, when that is cheaper (vLLM's CPU "
                        "offloading, SGLang's HiCache); 0: none")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="directory for KV blocks beyond --kv-host-gb (one file per block, checked against the model "
                        "and a checksum before use); scratch, cleared at start, unless --kv-disk-persist")
    p.add_argument("--kv-disk-gb", type=float, default=10.0, metavar="G", help="most GiB --kv-disk-dir holds (LRU)")
    p.add_argument("--kv-disk-persist", action="store_true",
                   help="keep --kv-disk-dir's blocks across restarts (LMCache's local disk backend)")
    p.add_argument("--kv-restore", default="auto", choices=["auto", "always"],
                   help="auto: restore a lower-tier prefix only where the measured copy is faster than recomputing "
                        "it; always: restore every hit (benchmarks)")
    p.add_argument("--kernels", default=None, choices=["auto", "triton", "reference"],
                   help="kernel backend: auto = Triton on CUDA, the native CPU kernels on CPU; reference = plain "
                        "torch (default: auto, or SWITCHYARD_KERNELS)")
    p.add_argument("--cpu-native", default=None, action=argparse.BooleanOptionalAction,
                   help="the compiled CPU kernels (default: on, or SWITCHYARD_CPU_NATIVE)")
    p.add_argument("--cpu-packed-weights", default=None, action=argparse.BooleanOptionalAction,
                   help="CPU GEMMs on a packed copy of the weights, more memory (default: on, or "
                        "SWITCHYARD_CPU_PACKED_WEIGHTS)")
    p.add_argument("--cpu-decode-step", default=None, action=argparse.BooleanOptionalAction,
                   help="decode steps through one native call for all layers (default: on, or "
                        "SWITCHYARD_CPU_DECODE_STEP)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="info")


def serve_parser() -> argparse.ArgumentParser:
    """`switchyard engine serve`'s parser on its own (what the gateway checks a policy's engine_args with)."""
    p = argparse.ArgumentParser(prog="switchyard engine serve", description=SERVE_DESCRIPTION)
    add_serve_arguments(p)
    return p
