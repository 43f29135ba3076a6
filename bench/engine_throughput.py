"""Engine throughput, batch-1 decode bandwidth and prefix-cache TTFT, against transformers, in one run.

Model: random weights in the SmolLM-135M shape (hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate
1536, vocab 49152, tied embeddings), built with transformers' LlamaConfig and saved with save_pretrained.
fp32 on CPU with 2 threads by default. Workload: 64 requests, prompt lengths uniform in [32, 512] (random
token ids), 128 output tokens each (EOS ignored). Compared:

  (a) transformers `generate`, one request at a time (on a sample of --hf-requests requests: tok/s is a
      rate, so the sample gives the rate; the time for all requests is extrapolated and marked so)
  (b) transformers `generate` on static batches of 16, left-padded
  (c) this engine (LLMEngine directly), all requests submitted at once: continuous batching, chunked
      prefill, paged KV cache

Also measured:
  * batch-1 decode "bandwidth achieved" (as gpt-fast prints it): bytes read per decode step (weights + the
    KV cache attended to) x decode steps per second, against a measured large-tensor copy bandwidth
    (read + write bytes per second of torch's `copy_`, same thread count);
  * TTFT with a shared 1,024-token system prompt: first request (prefix-cache miss) vs a later request
    with the same system prompt and a different question (hit).

    python -m bench.engine_throughput                 # full run (long on a small CPU)
    python -m bench.engine_throughput --quick         # smoke run, < 1 minute
    nice -n 10 python -m bench.engine_throughput --hf-requests 8

Prints a table and files the run in bench/results/engine_throughput/<machine>.json.
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import store
from bench.fixtures import random_smollm
from bench.machine_info import cpu_model
from bench.roofline import copy_bandwidth

ROOT = Path(__file__).resolve().parent.parent

TARGETS = {"engine_vs_hf_sequential": 15.0, "engine_vs_hf_static": 2.5, "bandwidth_fraction": 0.75,
           "prefix_ttft_speedup": 5.0}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ setup
def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def make_engine(model_dir: Path, args, *, max_num_seqs: int, prefix_caching: bool = True,
                kv_cache_gb: float | None = None):
    from hosted.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model_dir=str(model_dir), dtype="float32", device="cpu",
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                                  kv_cache_gb=kv_cache_gb or args.kv_cache_gb,
                                  enable_prefix_caching=prefix_caching))


# ------------------------------------------------------------------------------------------------ (a), (b)
def hf_generate(model, batch: list[list[int]], new_tokens: int) -> int:
    """Greedy-generate exactly new_tokens for each prompt of a left-padded batch; returns tokens produced."""
    width = max(len(p) for p in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    produced = out.shape[1] - width
    assert produced == new_tokens, produced
    return produced * len(batch)


def bench_hf_sequential(model, prompts: list[list[int]], new_tokens: int, total_requests: int) -> dict:
    hf_generate(model, [prompts[0][:16]], 2)  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for i, p in enumerate(prompts):
        tokens += hf_generate(model, [p], new_tokens)
        log(f"  (a) request {i + 1}/{len(prompts)}: {tokens / (time.perf_counter() - t0):.1f} tok/s so far")
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    rate = tokens / seconds
    return {"requests_measured": len(prompts), "requests_total": total_requests, "output_tokens": tokens,
            "seconds": seconds, "output_tok_s": rate, "cpu_seconds": cpu, "output_tok_per_cpu_s": tokens / cpu,
            "seconds_all_requests_extrapolated": total_requests * new_tokens / rate,
            "sampled": len(prompts) < total_requests}


def bench_hf_static(model, prompts: list[list[int]], new_tokens: int, batch_size: int, total_requests: int) -> dict:
    hf_generate(model, [p[:16] for p in prompts[:2]], 2)  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for b in range(0, len(prompts), batch_size):
        tokens += hf_generate(model, prompts[b:b + batch_size], new_tokens)
        log(f"  (b) batch {b // batch_size + 1}/{-(-len(prompts) // batch_size)}: "
            f"{tokens / (time.perf_counter() - t0):.1f} tok/s so far")
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    rate = tokens / seconds
    return {"requests": len(prompts), "requests_total": total_requests, "batch_size": batch_size,
            "output_tokens": tokens, "seconds": seconds, "output_tok_s": rate, "cpu_seconds": cpu,
            "output_tok_per_cpu_s": tokens / cpu,
            "seconds_all_requests_extrapolated": total_requests * new_tokens / rate,
            "sampled": len(prompts) < total_requests}


# ------------------------------------------------------------------------------------------------ (c)
def bench_engine(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    from hosted.sampling_params import SamplingParams

    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    engine.block_manager.reset_prefix_cache()
    before = engine.stats()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    arrival = {}
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    for i, p in enumerate(prompts):
        rid = f"bench-{i}"
        engine.add_request(rid, p, params)
        arrival[rid] = time.perf_counter()
        counts[rid] = 0
    steps = 0
    total = new_tokens * len(prompts)
    next_report = total // 8
    # Where the time goes: steps that carry prompt tokens (compute-bound prefill, with any decodes mixed in)
    # vs decode-only steps (one token per running sequence).
    split = {"prefill_steps": 0, "prefill_seconds": 0.0, "decode_steps": 0, "decode_seconds": 0.0}
    computed = engine.stats().num_computed_tokens
    while engine.has_unfinished():
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        now = engine.stats().num_computed_tokens
        kind = "prefill" if now - computed > len(outs) else "decode"
        computed = now
        split[f"{kind}_steps"] += 1
        split[f"{kind}_seconds"] += dt
        for out in outs:
            if out.new_token_ids:
                counts[out.request_id] += len(out.new_token_ids)
                first.setdefault(out.request_id, time.perf_counter())
        steps += 1
        done = sum(counts.values())
        if done >= next_report and done < total:
            log(f"  (c) {done}/{total} tokens after {steps} steps: {done / (time.perf_counter() - t0):.1f} tok/s")
            next_report += total // 8
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = engine.stats()
    tokens = sum(counts.values())
    assert tokens == new_tokens * len(prompts), tokens
    ttfts = sorted(first[r] - arrival[r] for r in first)
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "cpu_seconds": cpu, "output_tok_per_cpu_s": tokens / cpu,
            "steps": steps, "preemptions": after.num_preemptions - before.num_preemptions,
            "busy_fraction_of_wall": (after.busy_seconds - before.busy_seconds) / seconds,
            "ttft_median_s": statistics.median(ttfts), "ttft_max_s": ttfts[-1],
            "kv_blocks": after.kv_blocks_total, "max_num_seqs": engine.config.max_num_seqs,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens, "time_split": split}


# ------------------------------------------------------------------------------------------------ bandwidth
def bench_decode_bandwidth(engine, model_info: dict, prompt_len: int, decode_tokens: int, seed: int) -> dict:
    from hosted.sampling_params import SamplingParams

    mc = engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    # The embedding lookup reads one row per step, but the tied lm_head reads the whole matrix: count it once.
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 4
    prompt = make_prompts(1, prompt_len, prompt_len, mc.vocab_size, seed)[0]
    engine.block_manager.reset_prefix_cache()
    engine.add_request("bw", prompt, SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True))
    step_times, contexts = [], []
    produced = 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if produced >= 1:  # the first step is the prefill; count decode steps only
            step_times.append(dt)
            contexts.append(prompt_len + produced)
        produced += sum(len(o.new_token_ids) for o in outs)
    # Drop the first decode steps (allocator warm-up) when there are enough.
    skip = min(4, len(step_times) // 4)
    step_times, contexts = step_times[skip:], contexts[skip:]
    mean_step = statistics.median(step_times)  # median: robust to other processes stealing the CPU
    bytes_per_step = weight_bytes + kv_per_token * statistics.mean(contexts)
    achieved = bytes_per_step / mean_step
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token, "mean_context": statistics.mean(contexts),
            "bytes_per_step": bytes_per_step, "decode_steps": len(step_times), "steps_per_s": 1 / mean_step,
            "achieved_gb_s": achieved / 1e9}


# ------------------------------------------------------------------------------------------------ compute floor
def workload_flops(shape: dict, prompts: list[list[int]], new_tokens: int) -> dict:
    """FLOPs any engine must spend on the workload (no padding, logits only for sampled positions): every
    prompt token and every output token but the last goes through the decoder layers; each output token
    costs one lm_head row; attention at position p reads p + 1 keys and values."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    layers = shape["num_hidden_layers"]
    per_token_macs = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    tokens = sum(len(p) + new_tokens - 1 for p in prompts)
    # sum over processed positions p of (p + 1) = n (n + 1) / 2 for a sequence of n processed tokens
    positions = sum((len(p) + new_tokens - 1) * (len(p) + new_tokens) // 2 for p in prompts)
    linear = 2 * (tokens * per_token_macs + len(prompts) * new_tokens * h * vocab)
    attention = 2 * layers * 2 * shape["num_attention_heads"] * d * positions
    return {"linear_flops": linear, "attention_flops": attention, "total_flops": linear + attention}


def best_gemm_rate(shape: dict, rows: int = 2048, repeats: int = 5) -> dict:
    """The fastest F.linear rate (FLOP/s) this CPU reaches now on the model's projection shapes with many rows
    (the most favourable case for the hardware): a roofline for the whole workload."""
    import torch.nn.functional as F

    h, inter = shape["hidden_size"], shape["intermediate_size"]
    best = 0.0
    with torch.inference_mode():
        for n, k in ((2 * inter, h), (h, inter), (h, h)):
            x, w = torch.randn(rows, k), torch.randn(n, k)
            F.linear(x, w)
            for _ in range(repeats):
                t0 = time.perf_counter()
                F.linear(x, w)
                best = max(best, 2 * rows * n * k / (time.perf_counter() - t0))
    return {"rows": rows, "flops_per_s": best}


# ------------------------------------------------------------------------------------------------ prefix TTFT
def bench_prefix_ttft(engine, system_len: int, question_len: int, trials: int, seed: int) -> dict:
    from hosted.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size

    cpu_times: dict[str, float] = {}

    def ttft(rid: str, prompt: list[int]) -> tuple[float, int]:
        t0, c0 = time.perf_counter(), time.process_time()
        engine.add_request(rid, prompt, params)
        cached = 0
        seconds = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids and seconds is None:
                    seconds = time.perf_counter() - t0
                    cpu_times[rid] = time.process_time() - c0
                    cached = out.num_cached_tokens
        assert seconds is not None
        return seconds, cached

    ttft("warm", make_prompts(1, 64, 64, vocab, seed + 999)[0])
    misses, hits, cached_hits = [], [], []
    for t in range(trials):
        system = make_prompts(1, system_len, system_len, vocab, seed + 100 + t)[0]
        q1, q2 = make_prompts(2, question_len, question_len, vocab, seed + 200 + t)
        miss, cached_miss = ttft(f"miss-{t}", system + q1)
        hit, cached_hit = ttft(f"hit-{t}", system + q2)
        assert cached_miss == 0, cached_miss
        misses.append(miss)
        hits.append(hit)
        cached_hits.append(cached_hit)
        log(f"  prefix trial {t + 1}/{trials}: miss {miss * 1000:.0f} ms, hit {hit * 1000:.0f} ms "
            f"({cached_hit} cached tokens)")
    miss_m, hit_m = statistics.median(misses), statistics.median(hits)
    miss_cpu = statistics.median(cpu_times[f"miss-{t}"] for t in range(trials))
    hit_cpu = statistics.median(cpu_times[f"hit-{t}"] for t in range(trials))
    return {"system_tokens": system_len, "question_tokens": question_len, "trials": trials,
            "ttft_miss_median_s": miss_m, "ttft_hit_median_s": hit_m, "speedup": miss_m / hit_m,
            "ttft_miss_median_cpu_s": miss_cpu, "ttft_hit_median_cpu_s": hit_cpu, "speedup_cpu": miss_cpu / hit_cpu,
            "cached_tokens_on_hit": statistics.median(cached_hits)}


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 layers, 4 short requests, about a minute")
    ap.add_argument("--requests", type=int, default=None, help="requests (default 64; quick 4)")
    ap.add_argument("--min-prompt", type=int, default=None, help="shortest prompt (default 32)")
    ap.add_argument("--max-prompt", type=int, default=None, help="longest prompt (default 512; quick 64)")
    ap.add_argument("--output-tokens", type=int, default=None, help="tokens per request (default 128; quick 8)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 30; quick 2)")
    ap.add_argument("--batch-size", type=int, default=16, help="static batch size for (b)")
    ap.add_argument("--hf-requests", type=int, default=None,
                    help="requests measured for (a) (default 16; quick 2); the rate is reported for all")
    ap.add_argument("--hf-batches", type=int, default=None,
                    help="static batches measured for (b) (default all); the rate is reported for all")
    ap.add_argument("--skip-hf", action="store_true", help="only measure the engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gb", type=float, default=None,
                    help="engine KV pool (default: enough for every request at full length)")
    ap.add_argument("--system-tokens", type=int, default=None, help="shared system prompt (default 1024; quick 128)")
    ap.add_argument("--prefix-trials", type=int, default=None, help="(default 5; quick 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write this JSON file instead of filing the run in "
                                                "bench/results/engine_throughput/<machine>.json")
    ap.add_argument("--label", default="", help="a name for this run in the results history (--quick: 'quick')")
    args = ap.parse_args(argv)
    q = args.quick
    n_req = args.requests or (4 if q else 64)
    lo = args.min_prompt or 32
    hi = args.max_prompt or (64 if q else 512)
    new_tokens = args.output_tokens or (8 if q else 128)
    layers = args.layers or (2 if q else 30)
    hf_requests = min(n_req, args.hf_requests or (2 if q else 16))
    system_tokens = args.system_tokens or (128 if q else 1024)
    trials = args.prefix_trials or (2 if q else 5)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    results: dict = {"config": {"requests": n_req, "prompt_len": [lo, hi], "output_tokens": new_tokens,
                                "layers": layers, "threads": args.threads, "dtype": "float32", "device": "cpu",
                                "quick": q, "hf_requests": hf_requests, "batch_size": args.batch_size},
                     "machine": {"platform": platform.platform(), "processor": cpu_model(),
                                 "cpu_count": os.cpu_count(), "torch": torch.__version__,
                                 "load_avg_at_start": os.getloadavg()}}
    with tempfile.TemporaryDirectory(prefix="sy-bench-") as tmp:
        model_dir = Path(tmp) / "smollm-135m-shape"
        log(f"building random-weight model ({layers} layers) in {model_dir}")
        info = random_smollm(model_dir, layers, seed=args.seed)
        results["model"] = info
        prompts = make_prompts(n_req, lo, hi, info["vocab_size"], args.seed)
        need_tokens = sum(len(p) + new_tokens for p in prompts)
        kv_gb = args.kv_cache_gb or (need_tokens * 2 * layers * 3 * 64 * 4 * 1.1 / (1 << 30) + 0.05)

        if not args.skip_hf:
            hf = load_hf(model_dir)
            sample = random.Random(args.seed + 1).sample(prompts, hf_requests)
            log(f"(a) transformers generate, one request at a time, {hf_requests} of {n_req} requests")
            results["hf_sequential"] = bench_hf_sequential(hf, sample, new_tokens, n_req)
            batches = prompts if args.hf_batches is None else prompts[:args.hf_batches * args.batch_size]
            log(f"(b) transformers generate, static batches of {args.batch_size}, {len(batches)} requests")
            results["hf_static"] = bench_hf_static(hf, batches, new_tokens, args.batch_size, n_req)
            del hf
            gc.collect()

        log(f"(c) engine, {n_req} requests at once (KV pool {kv_gb:.2f} GiB)")
        engine = make_engine(model_dir, args, max_num_seqs=n_req, kv_cache_gb=kv_gb)
        results["engine"] = bench_engine(engine, prompts, new_tokens)
        log(f"  (c) {results['engine']['output_tok_s']:.1f} tok/s")
        del engine
        gc.collect()

        log("batch-1 decode bandwidth")
        results["copy_bandwidth"] = copy_bandwidth(128 if q else 512)
        engine = make_engine(model_dir, args, max_num_seqs=4, kv_cache_gb=0.25)
        results["decode_bandwidth"] = bench_decode_bandwidth(engine, info, 256 if not q else 64,
                                                             16 if q else 64, args.seed)
        del engine
        gc.collect()

        log(f"TTFT with a shared {system_tokens}-token system prompt")
        engine = make_engine(model_dir, args, max_num_seqs=4, kv_cache_gb=0.5)
        results["prefix_ttft"] = bench_prefix_ttft(engine, system_tokens, 32, trials, args.seed)
        del engine

        results["workload"] = workload_flops(info, prompts, new_tokens)
        results["gemm_roofline"] = best_gemm_rate(info)

    results["machine"]["load_avg_at_end"] = os.getloadavg()
    ratios: dict = {}
    cpu_ratios: dict = {}
    eng = results["engine"]["output_tok_s"]
    if "hf_sequential" in results:
        ratios["engine_vs_hf_sequential"] = eng / results["hf_sequential"]["output_tok_s"]
        ratios["engine_vs_hf_static"] = eng / results["hf_static"]["output_tok_s"]
        # The same ratios per CPU-second of this process: less sensitive to other load on a shared machine.
        eng_cpu = results["engine"]["output_tok_per_cpu_s"]
        cpu_ratios["engine_vs_hf_sequential"] = eng_cpu / results["hf_sequential"]["output_tok_per_cpu_s"]
        cpu_ratios["engine_vs_hf_static"] = eng_cpu / results["hf_static"]["output_tok_per_cpu_s"]
    cpu_ratios["prefix_ttft_speedup"] = results["prefix_ttft"]["speedup_cpu"]
    ratios["bandwidth_fraction"] = (results["decode_bandwidth"]["achieved_gb_s"]
                                    / results["copy_bandwidth"]["gb_s"])
    ratios["prefix_ttft_speedup"] = results["prefix_ttft"]["speedup"]
    results["ratios"] = ratios
    results["ratios_per_cpu_second"] = cpu_ratios
    floor_s = results["workload"]["total_flops"] / results["gemm_roofline"]["flops_per_s"]
    results["compute_floor"] = {
        "seconds": floor_s, "max_output_tok_s": new_tokens * n_req / floor_s,
        "engine_fraction_of_roofline": floor_s / results["engine"]["seconds"]}
    if "hf_sequential" in results:
        results["compute_floor"]["max_ratio_vs_hf_sequential"] = (results["compute_floor"]["max_output_tok_s"]
                                                                  / results["hf_sequential"]["output_tok_s"])
    results["targets"] = TARGETS
    results["targets_met"] = {k: ratios[k] >= v for k, v in TARGETS.items() if k in ratios}
    print_table(results)
    label = args.label or ("quick" if q else "")
    log(f"wrote {store.save('engine_throughput', results, label=label, out=args.out)}")
    return 0


def print_table(r: dict) -> None:
    c = r["config"]
    print()
    print(f"Engine throughput — {r['model']['parameters'] / 1e6:.0f}M-parameter SmolLM-135M-shape model "
          f"({c['layers']} layers), fp32, CPU, {c['threads']} threads")
    print(f"{c['requests']} requests, prompts {c['prompt_len'][0]}-{c['prompt_len'][1]} tokens, "
          f"{c['output_tokens']} output tokens each (EOS ignored)")
    print(f"load average: {r['machine']['load_avg_at_start'][0]:.1f} at start, "
          f"{r['machine']['load_avg_at_end'][0]:.1f} at end ({r['machine']['cpu_count']} CPUs)")
    print()
    rows = []
    if "hf_sequential" in r:
        a = r["hf_sequential"]
        note = (f"sampled {a['requests_measured']}/{a['requests_total']} requests; all would take "
                f"~{a['seconds_all_requests_extrapolated']:.0f} s (extrapolated)" if a["sampled"] else "all requests")
        rows.append(("(a) transformers, one at a time", a["output_tok_s"], a["seconds"], a["output_tok_per_cpu_s"],
                     note))
        b = r["hf_static"]
        note = (f"sampled {b['requests']}/{b['requests_total']} requests; all would take "
                f"~{b['seconds_all_requests_extrapolated']:.0f} s (extrapolated)" if b["sampled"] else "all requests")
        rows.append((f"(b) transformers, static batches of {b['batch_size']}", b["output_tok_s"], b["seconds"],
                     b["output_tok_per_cpu_s"], f"{note}; left padding"))
    e = r["engine"]
    rows.append(("(c) switchyard engine", e["output_tok_s"], e["seconds"], e["output_tok_per_cpu_s"],
                 f"{e['steps']} steps, {e['preemptions']} preemptions, median TTFT {e['ttft_median_s']:.1f} s"))
    print(f"{'method':<42} {'output tok/s':>12} {'seconds':>9} {'tok/CPU-s':>9}  notes")
    for name, rate, sec, per_cpu, note in rows:
        print(f"{name:<42} {rate:>12.1f} {sec:>9.1f} {per_cpu:>9.2f}  {note}")
    ratios, targets = r["ratios"], r["targets"]
    print()
    cpu = r.get("ratios_per_cpu_second", {})
    print(f"{'ratio':<42} {'measured':>12} {'target':>9}          {'per CPU-s':>9}")
    labels = {"engine_vs_hf_sequential": "(c) / (a) output tok/s", "engine_vs_hf_static": "(c) / (b) output tok/s",
              "bandwidth_fraction": "batch-1 decode bandwidth / copy bandwidth",
              "prefix_ttft_speedup": "TTFT miss / TTFT hit (shared system prompt)"}
    for key, label in labels.items():
        if key in ratios:
            ok = "met" if ratios[key] >= targets[key] else "NOT met"
            extra = f"{cpu[key]:>8.2f}x" if key in cpu else ""
            print(f"{label:<42} {ratios[key]:>11.2f}x {targets[key]:>8.2f}x  {ok:<8} {extra}")
    bw, cp = r["decode_bandwidth"], r["copy_bandwidth"]
    print()
    print(f"bandwidth achieved: {bw['achieved_gb_s']:.2f} GB/s = {bw['bytes_per_step'] / 1e6:.0f} MB/step "
          f"(weights {bw['weight_bytes'] / 1e6:.0f} MB + KV at mean context {bw['mean_context']:.0f}) x "
          f"{bw['steps_per_s']:.2f} steps/s; copy bandwidth {cp['gb_s']:.2f} GB/s (read+write)")
    ts = e["time_split"]
    print(f"engine time: {ts['prefill_steps']} steps carrying prompt tokens took {ts['prefill_seconds']:.1f} s, "
          f"{ts['decode_steps']} decode-only steps {ts['decode_seconds']:.1f} s "
          f"({1000 * ts['decode_seconds'] / max(ts['decode_steps'], 1):.0f} ms each)")
    w, g, f = r["workload"], r["gemm_roofline"], r["compute_floor"]
    bound = (f" = {f['max_ratio_vs_hf_sequential']:.1f}x (a)" if "max_ratio_vs_hf_sequential" in f else "")
    print(f"compute floor: the workload is {w['total_flops'] / 1e12:.2f} TFLOP (linear "
          f"{w['linear_flops'] / 1e12:.2f}, attention {w['attention_flops'] / 1e12:.2f}); at the best GEMM rate "
          f"measured now ({g['flops_per_s'] / 1e9:.0f} GFLOP/s, {g['rows']} rows) it needs {f['seconds']:.1f} s, "
          f"i.e. at most {f['max_output_tok_s']:.0f} output tok/s{bound}; the engine ran at "
          f"{100 * f['engine_fraction_of_roofline']:.0f}% of that roofline")
    p = r["prefix_ttft"]
    print(f"prefix TTFT: miss {p['ttft_miss_median_s'] * 1000:.0f} ms, hit {p['ttft_hit_median_s'] * 1000:.0f} ms "
          f"({p['cached_tokens_on_hit']:.0f} of {p['system_tokens'] + p['question_tokens']} prompt tokens cached), "
          f"median of {p['trials']}")


if __name__ == "__main__":
    sys.exit(main())
