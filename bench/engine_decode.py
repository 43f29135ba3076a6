"""End-to-end engine decode: batch-1 tokens/s and model-bandwidth utilisation (MBU), batch-64 throughput,
with bf16 weights and with int8 / int4 weight-only quantization, side by side in one run.

The model is a random-weight Llama written straight to disk (config.json + sharded bf16 safetensors, no
transformers model allocated), then served by LLMEngine three times: unquantized --dtype weights (bf16 by
default: the peer), int8 per-channel, int4 group-wise with zero points (activations and KV cache stay in
--dtype). The CPU smoke run uses fp32 (bf16 matmuls are slow on CPU) and labels the dense run "fp32".

    python -m bench.engine_decode --device cuda    # Llama-3-8B shape; files bench/results/engine_decode/<gpu>
    python -m bench.engine_decode --cpu-smoke --out /tmp/engine_decode_smoke               # tiny, CPU, < 1 min

Measured per weight format (every step timed around LLMEngine.step(), which synchronises the GPU):
  * batch 1: one request, --prompt-len random tokens, then decode steps (the first few dropped as warm-up);
    tokens/s = 1 / mean step time.
  * bytes per step = weights read (every parameter except the embedding table, of which one row per token
    is read; a tied lm_head reads the whole table) + KV read (2 x layers x kv_heads x head_dim x bytes for
    every position each sequence attends to).
  * MBU = bytes per step x steps/s / the card's spec bandwidth (H200 4.8 TB/s, H100 SXM 3.35 TB/s, ...,
    looked up by device name), and also / a measured device copy bandwidth (read + write bytes/s of a
    large tensor copy) -- the practical ceiling on this machine.
  * batch 64: 64 requests prefilled, then only the steps in which all 64 decode are timed; tokens/s.
Each configuration has a wall-clock cap (--time-cap) and the whole run a budget (--budget); results are
rewritten to <out>.json / <out>.md after every measurement, so an interrupted run keeps what it measured.
Targets (issue 5, H100/H200): bf16 batch-1 MBU >= 65% of spec bandwidth.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import store
from bench.fixtures import SHAPES, checkpoint_bytes, default_work_dir, write_random_checkpoint
from bench.machine_info import cpu_model, gpu_slug
from bench.roofline import copy_bandwidth, peak_bandwidth

ROOT = Path(__file__).resolve().parent.parent

SCHEMES = ("dense", "int4", "int8")  # run order: the unquantized peer first, then int4 (the issue's target)
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
TARGET_BF16_MBU = 0.65
SKIP_STEPS = 2  # first decode steps of each measurement: allocator / autotune / compile leftovers


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def default_group_size(shape: dict) -> int:
    """Largest int4 group size dividing every linear's in_features (128 for Llama-3-8B, 64 for SmolLM)."""
    ks = (shape["hidden_size"], shape["intermediate_size"])
    return next(g for g in (128, 64, 32) if all(k % g == 0 for k in ks))


# ------------------------------------------------------------------------------------------- measuring
def weight_bytes_per_step(model, batch: int) -> int:
    """Weight bytes one decode step reads: each projection's packed copy where it has one (the copy is what its
    GEMM reads: bf16/int8/int4 strips, fp32 panels; an int8 copy of the lm_head), else its parameters; the
    other parameters (norms); one embedding row per sequence, or the whole table when it is the tied head."""
    from hosted.layers.linear import Linear

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    total, seen = 0, set()
    for m in model.modules():
        if isinstance(m, Linear):
            own = list(m.parameters(recurse=False))
            seen.update(id(p) for p in own)
            total += m.packed.extra_bytes if m.packed is not None else nbytes(own)
    embed = model.embed_tokens.weight
    seen.add(id(embed))
    total += nbytes(p for p in model.parameters() if id(p) not in seen)
    total += batch * embed.shape[1] * embed.element_size()
    if model.lm_head is None:  # tied: the head reads the table (or its packed copy)
        head = model.tied_head
        total += head.packed.extra_bytes if head.packed is not None else nbytes([embed])
    return total


def kv_bytes_per_position(engine) -> int:
    mc = engine.model_config
    elem = engine.runner.kv_cache.element_size()
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * elem


def _rates(step_seconds: list[float]) -> dict:
    mean = statistics.mean(step_seconds)
    return {"steps": len(step_seconds), "mean_ms": mean * 1e3, "median_ms": statistics.median(step_seconds) * 1e3,
            "max_ms": max(step_seconds) * 1e3, "steps_per_s": 1 / mean}


def _drain(engine, ids: list[str]) -> None:
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()


def measure_decode(engine, *, batch: int, prompt_len: int, steps: int, time_cap: float, seed: int,
                   weight_bytes: int, peak: float | None, copy_gbs: float) -> dict:
    """Time `steps` decode steps in which all `batch` sequences decode (none prefilling)."""
    from hosted.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    ids = [f"b{batch}-{seed}-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, temperature=0.0, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(prompt_len)], params)
    kv_pos = kv_bytes_per_position(engine)
    lengths = {rid: prompt_len for rid in ids}  # tokens in each sequence (the next step attends to all + 1)
    times: list[float] = []
    kv_bytes: list[int] = []
    decode_steps = 0
    capped = False
    t_start = time.perf_counter()
    while len(times) < steps:
        before = engine.stats().num_computed_tokens
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        computed = engine.stats().num_computed_tokens - before
        produced = [o for o in outs if o.new_token_ids]
        if computed == batch and len(produced) == batch:  # a pure decode step of the whole batch
            decode_steps += 1
            if decode_steps > SKIP_STEPS:
                times.append(dt)
                kv_bytes.append(kv_pos * sum(lengths.values()))  # each attends to its length (incl. new token)
        for o in produced:
            lengths[o.request_id] += len(o.new_token_ids)
        if any(o.finished for o in outs) or not engine.has_unfinished():
            break  # a sequence hit max_model_len: not expected with the sizes run_scheme chooses
        if time.perf_counter() - t_start > time_cap:
            capped = True
            break
    _drain(engine, ids)
    if not times:
        return {"batch": batch, "error": "no complete decode step measured", "capped": capped}
    r = _rates(times)
    bytes_per_step = weight_bytes + statistics.mean(kv_bytes)
    achieved = bytes_per_step * r["steps_per_s"]
    return {"batch": batch, **r, "tok_s": batch * r["steps_per_s"], "weight_bytes": weight_bytes,
            "kv_bytes": statistics.mean(kv_bytes), "bytes_per_step": bytes_per_step, "achieved_gb_s": achieved / 1e9,
            "mbu_peak": achieved / peak if peak else None, "mbu_copy": achieved / (copy_gbs * 1e9),
            "capped": capped}


def run_scheme(scheme: str, model_dir: Path, args, device: torch.device, peak: float | None,
               copy_gbs: float, group_size: int) -> dict:
    from hosted.engine import EngineConfig, LLMEngine
    from kernels import ops

    longest = args.prompt_len + SKIP_STEPS + max(args.steps_b1, args.steps_b64) + 64  # prefill-time decodes
    max_batch = max(args.batch_sizes)
    blocks = max_batch * -(-longest // 16) + 8
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model_dir=str(model_dir), dtype=args.dtype, device=str(device), max_num_seqs=max_batch,
        max_num_batched_tokens=args.max_batched_tokens, num_kv_blocks=blocks, block_size=16,
        enable_prefix_caching=False, max_model_len=longest,
        quantization=None if scheme == "dense" else scheme, quantization_group_size=group_size))
    result: dict = {"scheme": scheme, "label": label(scheme, args.dtype), "load_seconds": time.perf_counter() - t0}
    model = engine.runner.model
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    result["kernel_backend"] = ops.active_backend(torch.empty(1, device=device))
    if device.type == "cuda":
        result["gpu_allocated_bytes"] = torch.cuda.memory_allocated(device)  # weights + KV pool
        result["gpu_peak_load_bytes"] = torch.cuda.max_memory_allocated(device)
    log(f"  {result['label']}: loaded in {result['load_seconds']:.1f}s, parameters {result['param_bytes'] / 1e9:.3f} GB")
    try:
        # Warm-up: compiles the prefill and decode kernels (and autotunes the GEMVs) outside the timings.
        t0 = time.perf_counter()
        measure_decode(engine, batch=1, prompt_len=min(args.prompt_len, 32), steps=args.warmup_steps,
                       time_cap=args.time_cap, seed=1, weight_bytes=0, peak=None, copy_gbs=copy_gbs)
        result["warmup_seconds"] = time.perf_counter() - t0
        for batch in args.batch_sizes:
            steps = args.steps_b1 if batch == 1 else args.steps_b64
            if args.full_warmup:
                # The same workload once untimed: Triton compiles a kernel variant the first time a launch
                # parameter crosses a threshold (e.g. the split count as contexts grow); none may land in a
                # timed step.
                t0 = time.perf_counter()
                measure_decode(engine, batch=batch, prompt_len=args.prompt_len, steps=steps, time_cap=args.time_cap,
                               seed=100 + batch, weight_bytes=0, peak=None, copy_gbs=copy_gbs)
                result[f"warmup_b{batch}_seconds"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            r = measure_decode(engine, batch=batch, prompt_len=args.prompt_len, steps=steps, time_cap=args.time_cap,
                               seed=100 + batch, weight_bytes=weight_bytes_per_step(model, batch), peak=peak,
                               copy_gbs=copy_gbs)
            r["wall_seconds"] = time.perf_counter() - t0
            result[f"b{batch}"] = r
            log(f"  {result['label']} batch {batch}: " + (r.get("error") or
                f"{r['tok_s']:.1f} tok/s, {r['mean_ms']:.2f} ms/step, {r['achieved_gb_s']:.0f} GB/s"
                + (f", MBU {100 * r['mbu_peak']:.1f}% of peak" if r["mbu_peak"] else "")
                + f", {100 * r['mbu_copy']:.1f}% of copy bw" + (" (time-capped)" if r["capped"] else "")))
            yield result
    finally:
        del engine, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    yield result


# ------------------------------------------------------------------------------------------- reporting
def label(scheme: str, dtype: str) -> str:
    """Run key and table label: the dense run is named by its dtype (bf16 on the GPU)."""
    return SHORT_DTYPE[dtype] if scheme == "dense" else scheme


def add_ratios(results: dict) -> None:
    runs, meta = results["runs"], results["meta"]
    dense = label("dense", meta["dtype"])
    base = runs.get(dense, {})
    ratios = {}
    for scheme in ("int8", "int4"):
        run = runs.get(scheme, {})
        for b in meta["batch_sizes"]:
            a, q = base.get(f"b{b}", {}).get("tok_s"), run.get(f"b{b}", {}).get("tok_s")
            if a and q:
                ratios[f"{scheme}_vs_{dense}_b{b}_tok_s"] = q / a
        if base.get("param_bytes") and run.get("param_bytes"):
            ratios[f"{scheme}_vs_{dense}_param_bytes"] = run["param_bytes"] / base["param_bytes"]
    results["ratios"] = ratios
    mbu = base.get("b1", {}).get("mbu_peak") if dense == "bf16" else None
    results["targets"] = {"bf16_b1_mbu_peak": {"target": TARGET_BF16_MBU, "measured": mbu,
                                               "met": None if mbu is None else mbu >= TARGET_BF16_MBU}}


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _vs(base: dict, run: dict, key: str) -> str:
    a, q = base.get(key, {}).get("tok_s"), run.get(key, {}).get("tok_s")
    return f"{q / a:.2f}x" if a and q else ""


def markdown(results: dict) -> str:
    m = results["meta"]
    dense = label("dense", m["dtype"])
    big = f"b{max(m['batch_sizes'])}"
    peak = f"{m['peak_gb_s']:.0f} GB/s spec" if m["peak_gb_s"] else "spec bandwidth unknown"
    lines = [f"# Engine decode — {m['device_name']}, {m['shape']} shape, weights {dense} / int8 / int4", "",
             (f"torch {m['torch']}, triton {m['triton']}; activations {m['dtype']}; {peak}; measured copy "
              f"{m['copy_gb_s']:.0f} GB/s; prompt {m['prompt_len']} tokens; int4 group {m['group_size']}; "
              f"status: {m['status']}"), ""]
    if m["cpu_smoke"]:
        backends = sorted({r["kernel_backend"] for r in results["runs"].values() if "kernel_backend" in r})
        lines += [(f"CPU smoke run (tiny shape, kernels: {', '.join(backends) or 'none run'}): exercises the code, "
                  "the numbers mean nothing."), ""]
    lines += [(f"| weights | params GB | load s | b1 tok/s | b1 ms/tok | b1 GB/s | b1 MBU (spec) | b1 MBU (copy) | "
               f"{big} tok/s | b1 vs {dense} | {big} vs {dense} |"),
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = results["runs"].get(dense, {})
    for name in (dense, "int8", "int4"):
        r = results["runs"].get(name)
        if r is None:
            lines.append(f"| {name} | not run | | | | | | | | | |")
            continue
        if r.get("error") and "param_bytes" not in r:
            lines.append(f"| {name} | error: {r['error'][:80]} | | | | | | | | | |")
            continue
        b1 = r.get("b1", {})
        lines.append(f"| {name} | {r['param_bytes'] / 1e9:.3f} | {r['load_seconds']:.1f} | "
                     f"{_fmt(b1.get('tok_s'), '.1f')} | {_fmt(b1.get('mean_ms'), '.2f')} | "
                     f"{_fmt(b1.get('achieved_gb_s'), '.0f')} | {_pct(b1.get('mbu_peak'))} | {_pct(b1.get('mbu_copy'))} | "
                     f"{_fmt(r.get(big, {}).get('tok_s'), '.1f')} | {_vs(base, r, 'b1')} | {_vs(base, r, big)} |")
        if r.get("error"):
            lines.append(f"| {name} (cont.) | error after the above: {r['error'][:80]} | | | | | | | | | |")
    t = results.get("targets", {}).get("bf16_b1_mbu_peak", {})
    if t:
        met = {True: "met", False: "NOT met", None: "not measured (no spec bandwidth or no bf16 run)"}[t["met"]]
        lines += ["", f"Target: bf16 batch-1 MBU >= {TARGET_BF16_MBU:.0%} of spec bandwidth — {met}."]
    lines += ["", ("MBU = (weight bytes read per step + KV bytes read per step) x steps/s / bandwidth. Embedding: "
                   "one row per token (whole table if tied to the lm_head); the lm_head is never quantized.")]
    return "\n".join(lines) + "\n"


def save(results: dict, out: Path) -> None:
    add_ratios(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str))
    tmp.replace(out.with_name(out.name + ".json"))
    out.with_name(out.name + ".md").write_text(markdown(results))


# ------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--shape", default=None, choices=list(SHAPES), help="model shape (default: llama3-8b)")
    p.add_argument("--quick", action="store_true", help="fewer steps and a shorter prompt")
    p.add_argument("--cpu-smoke", action="store_true", help="= --device cpu --shape tiny --quick (< 1 minute)")
    p.add_argument("--out", default=None, help="output path without extension (.json and .md written) instead of "
                                               "filing the run in bench/results/engine_decode/<device>")
    p.add_argument("--label", default="", help="a name for this run in the results history")
    p.add_argument("--schemes", default=",".join(SCHEMES), help="comma list of dense,int8,int4")
    p.add_argument("--dtype", default=None, choices=list(SHORT_DTYPE),
                   help="activations, KV cache and the unquantized weights")
    p.add_argument("--group-size", type=int, default=None, help="int4 group size (default: largest that fits)")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--steps-b1", type=int, default=None, help="timed batch-1 decode steps")
    p.add_argument("--steps-b64", type=int, default=None, help="timed decode steps at the large batch")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--warmup-steps", type=int, default=None, help="decode steps of the first, short warm-up")
    p.add_argument("--full-warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run each measured workload once untimed first (default: on for CUDA, off on CPU)")
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--time-cap", type=float, default=None, help="seconds per measurement loop")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run; later formats skipped")
    p.add_argument("--work-dir", default=None, help="where the random checkpoint goes (default /dev/shm or tmp)")
    p.add_argument("--model-dir", default=None, help="reuse/keep the random checkpoint here (not deleted)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.device, args.quick = "cpu", True
        args.shape = args.shape or "tiny"
        args.threads = args.threads or 2
        args.dtype = args.dtype or "float32"
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible (use --cpu-smoke or --device cpu --shape tiny)")
    args.shape = args.shape or "llama3-8b"
    args.dtype = args.dtype or "bfloat16"
    q = args.quick
    args.prompt_len = args.prompt_len or (16 if args.cpu_smoke else 64 if q else 256)
    args.steps_b1 = args.steps_b1 or (6 if args.cpu_smoke else 32 if q else 128)
    args.steps_b64 = args.steps_b64 or (3 if args.cpu_smoke else 16 if q else 48)
    args.warmup_steps = args.warmup_steps or (2 if args.cpu_smoke else 4)
    if args.full_warmup is None:
        args.full_warmup = args.device.startswith("cuda")
    args.time_cap = args.time_cap or (20.0 if args.device == "cpu" else 45.0)
    args.budget = args.budget or (45.0 if args.cpu_smoke else 480.0)
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    args.schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in args.schemes if s not in SCHEMES]
    if bad:
        p.error(f"--schemes: unknown {bad}; choose from {', '.join(SCHEMES)}")
    args.schemes = [s for s in SCHEMES if s in args.schemes]  # dense first: the peer
    group = args.group_size or default_group_size(SHAPES[args.shape])
    if SHAPES[args.shape]["hidden_size"] % group or SHAPES[args.shape]["intermediate_size"] % group:
        p.error(f"--group-size {group} does not divide the {args.shape} layers' in_features")
    args.group_size = group
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_run = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({cpu_model()}, {torch.get_num_threads()} threads)"
    peak = peak_bandwidth(name) if device.type == "cuda" else None
    # Progress goes to --out (or a temporary file) after every format; the run is filed at the end.
    out = Path(args.out) if args.out else Path(tempfile.gettempdir()) / f"switchyard-engine-decode-{os.getpid()}"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None

    log(f"device {name}; shape {args.shape}; spec bandwidth {peak / 1e9 if peak else 'unknown'} GB/s")
    copy = copy_bandwidth(1024 if device.type == "cuda" else (64 if args.cpu_smoke else 256), device)
    log(f"measured copy bandwidth {copy['gb_s']:.1f} GB/s")
    results: dict = {
        "meta": {"device": str(device), "device_name": name, "torch": torch.__version__, "triton": triton_version,
                 "shape": args.shape, "model": shape, "dtype": args.dtype, "group_size": args.group_size,
                 "prompt_len": args.prompt_len, "steps_b1": args.steps_b1, "steps_b64": args.steps_b64,
                 "batch_sizes": args.batch_sizes, "time_cap_s": args.time_cap, "budget_s": args.budget,
                 "peak_gb_s": peak / 1e9 if peak else None, "copy_gb_s": copy["gb_s"], "quick": args.quick, "full_warmup": args.full_warmup,
                 "cpu_smoke": args.cpu_smoke, "kernels_env": os.environ.get("SWITCHYARD_KERNELS", "auto"),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S"), "status": "running"},
        "copy_bandwidth": copy, "runs": {}}

    need = checkpoint_bytes(shape, dtype)
    if args.model_dir:
        model_dir, owned = Path(args.model_dir), False
    else:
        base = Path(args.work_dir) if args.work_dir else default_work_dir(need)
        model_dir, owned = Path(tempfile.mkdtemp(prefix="switchyard_engine_decode_", dir=base)), True
    try:
        marker = model_dir / "random_checkpoint.json"
        wanted = {"shape": shape, "seed": args.seed, "dtype": args.dtype}
        if marker.is_file() and json.loads(marker.read_text()) == wanted:
            log(f"reusing the random checkpoint in {model_dir}")
            results["checkpoint"] = {"path": str(model_dir), "bytes": need, "reused": True}
        else:
            log(f"writing a random {args.shape} checkpoint ({need / 1e9:.2f} GB, {args.dtype}) to {model_dir}")
            results["checkpoint"] = write_random_checkpoint(model_dir, shape, seed=args.seed, dtype=dtype,
                                                            device=device.type if device.type == "cuda" else "cpu")
            marker.write_text(json.dumps(wanted))
            log(f"  written in {results['checkpoint']['write_seconds']:.1f}s "
                f"({results['checkpoint']['shards']} shards)")
        save(results, out)
        for scheme in args.schemes:
            if time.perf_counter() - t_run > args.budget:
                log(f"budget of {args.budget:.0f}s spent: skipping {scheme}")
                results["runs"][label(scheme, args.dtype)] = {"scheme": scheme, "error": "skipped: run budget spent"}
                continue
            log(f"== {scheme}")
            try:
                for partial in run_scheme(scheme, model_dir, args, device, peak, copy["gb_s"], args.group_size):
                    results["runs"][label(scheme, args.dtype)] = partial
                    save(results, out)
            except Exception as exc:  # noqa: BLE001 - one format failing must not lose the others
                log(f"  {scheme} failed: {exc!r}")
                results["runs"].setdefault(label(scheme, args.dtype), {"scheme": scheme})["error"] = repr(exc)
            gc.collect()  # outside the except block: its traceback may hold the engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save(results, out)
        results["meta"]["status"] = "done"
        results["meta"]["wall_seconds"] = time.perf_counter() - t_run
    finally:
        if results["meta"]["status"] != "done":
            results["meta"]["status"] = "interrupted"
        save(results, out)
        if owned:
            shutil.rmtree(model_dir, ignore_errors=True)
    print(markdown(results))
    if args.out:
        log(f"wrote {out}.json and {out}.md")
    else:
        machine = gpu_slug(name) if device.type == "cuda" else None
        log(f"saved {store.save('engine_decode', results, markdown=markdown(results), label=args.label, machine=machine)}")
        for suffix in (".json", ".md"):
            out.with_name(out.name + suffix).unlink(missing_ok=True)
    failed = [s for s, r in results["runs"].items() if r.get("error")]
    return 1 if failed and len(failed) == len(results["runs"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
