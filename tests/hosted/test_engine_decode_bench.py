"""bench/engine_decode.py: its random checkpoint is a real HF checkpoint, its shapes are the named models',
and its CPU smoke run (the same code the GPU run uses) produces complete, self-consistent results."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import engine_decode as bench
from bench.fixtures import tensor_plan

ROOT = Path(__file__).resolve().parents[2]


def test_shapes_are_the_named_models():
    plan = tensor_plan(bench.SHAPES["llama3-8b"])
    assert sum(math.prod(s) for _, s in plan) == 8_030_261_248  # Meta-Llama-3-8B's parameter count
    assert bench.checkpoint_bytes(bench.SHAPES["llama3-8b"]) == 2 * 8_030_261_248
    assert sum(math.prod(s) for _, s in tensor_plan(bench.SHAPES["smollm"])) == 134_515_008  # SmolLM-135M
    assert [bench.default_group_size(bench.SHAPES[k]) for k in ("tiny", "smollm", "llama3-8b")] == [128, 64, 128]


def test_peak_bandwidth_by_device_name():
    assert bench.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert bench.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert bench.peak_bandwidth("Some Future GPU") is None


def test_random_checkpoint_is_a_valid_sharded_hf_checkpoint(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hosted.engine import EngineConfig, LLMEngine, SamplingParams

    shape = bench.SHAPES["tiny"]
    info = bench.write_random_checkpoint(tmp_path, shape, seed=3, shard_bytes=200_000)
    assert info["shards"] >= 3 and info["bytes"] == bench.checkpoint_bytes(shape)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {name for name, _ in tensor_plan(shape)}
    with safe_open(str(tmp_path / index["weight_map"]["model.layers.1.mlp.down_proj.weight"]), "pt") as f:
        w = f.get_tensor("model.layers.1.mlp.down_proj.weight")
    assert w.dtype == torch.bfloat16 and w.shape == (128, 256)
    assert 0.015 < float(w.float().std()) < 0.025

    hf, loading = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    # The engine reads the same checkpoint the same way transformers does: same next-token logits.
    engine = LLMEngine(EngineConfig(model_dir=str(tmp_path), num_kv_blocks=16))
    rows: list[torch.Tensor] = []
    engine.runner.model.register_forward_hook(lambda _m, _i, out: rows.append(out.clone()))
    prompt = [7, 300, 12, 45, 511, 3, 99]
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(rows[0][0], want, rtol=0, atol=1e-4 * float(want.abs().max()))


@pytest.mark.timeout(120)
def test_cpu_smoke_run_produces_complete_results(tmp_path):
    out = tmp_path / "res" / "engine_decode_smoke"
    proc = subprocess.run([sys.executable, "-m", "bench.engine_decode", "--cpu-smoke", "--out", str(out), "--work-dir", str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=110, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.with_name(out.name + ".json").read_text())
    meta = res["meta"]
    assert meta["status"] == "done" and meta["device"] == "cpu" and meta["shape"] == "tiny"
    assert meta["peak_gb_s"] is None and meta["copy_gb_s"] > 0
    assert list(res["runs"]) == ["fp32", "int4", "int8"]
    shape = bench.SHAPES["tiny"]
    embed_bytes = shape["vocab_size"] * shape["hidden_size"] * 4
    kv_per_pos = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * 32 * 4
    for name, run in res["runs"].items():
        assert "error" not in run, (name, run)
        assert run["kernel_backend"] == "reference"
        for batch, steps in ((1, 6), (64, 3)):
            r = run[f"b{batch}"]
            assert r["steps"] == steps and r["tok_s"] > 0 and not r["capped"], (name, r)
            assert r["tok_s"] == pytest.approx(batch * 1000 / r["mean_ms"])
            # untied lm_head: every parameter but the embedding table, as the GEMMs read it (packed copies:
            # fp32 panels padded to 48 rows, int8/int4 strips with their scales, an int8 copy of the head beside
            # quantized layers), plus one embedding row per sequence
            read = r["weight_bytes"] - batch * shape["hidden_size"] * 4
            assert 0.25 * (run["param_bytes"] - embed_bytes) < read <= 1.15 * (run["param_bytes"] - embed_bytes)
        assert run["b64"]["weight_bytes"] - run["b1"]["weight_bytes"] == 63 * shape["hidden_size"] * 4
        for batch in (1, 64):
            r = run[f"b{batch}"]
            # each sequence attends to the prompt plus its generated tokens: at least prompt + 1 positions
            assert r["kv_bytes"] >= batch * (meta["prompt_len"] + 1) * kv_per_pos
            assert r["mbu_copy"] == pytest.approx(r["bytes_per_step"] * 1000 / r["mean_ms"] / (meta["copy_gb_s"] * 1e9))
            assert r["mbu_peak"] is None
    sizes = {n: r["param_bytes"] for n, r in res["runs"].items()}
    assert sizes["int4"] < sizes["int8"] < sizes["fp32"]
    assert set(res["ratios"]) >= {"int8_vs_fp32_b1_tok_s", "int4_vs_fp32_b64_tok_s", "int4_vs_fp32_param_bytes"}
    table = out.with_name(out.name + ".md").read_text()
    assert all(f"| {n} | " in table for n in ("fp32", "int8", "int4")), table
    assert not list(tmp_path.glob("switchyard_engine_decode_*")), "the random checkpoint was not removed"


def test_run_budget_skips_formats_and_still_writes_results(tmp_path):
    out = tmp_path / "r"
    rc = bench.main(["--cpu-smoke", "--budget", "1e-9", "--out", str(out), "--work-dir", str(tmp_path)])
    res = json.loads(out.with_name("r.json").read_text())
    assert rc == 1  # nothing measured
    assert res["meta"]["status"] == "done"
    assert {r["error"] for r in res["runs"].values()} == {"skipped: run budget spent"}
    assert "not measured" in out.with_name("r.md").read_text()
