"""The engine through the kernels' Triton path (TRITON_INTERPRET=1 on CPU): same greedy tokens as the
reference path. Tiny on purpose: the interpreter is slow."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import sys
from hosted.engine import EngineConfig, LLMEngine, SamplingParams
from kernels import ops
engine = LLMEngine(EngineConfig(model_dir=sys.argv[1], num_kv_blocks=8, block_size=4, max_num_batched_tokens=6))
import torch
assert ops.active_backend(torch.zeros(1)) == "triton", ops.active_backend(torch.zeros(1))
# Two requests: one prefilled in chunks, then decoded alongside the other's prefill (mixed steps).
out = engine.generate([[11, 12, 13, 14, 15, 16, 17, 18, 19], [3, 4]], SamplingParams(max_tokens=3, temperature=0.0))
engine.block_manager.check_all_free()
print("TOKENS", out)
"""


def _triton_available() -> str | None:
    try:
        import triton  # noqa: F401

        from kernels import triton_ops  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means the path is not there
        return f"kernels Triton path not importable: {exc}"
    return None


@pytest.mark.timeout(240)
def test_greedy_equal_under_triton_interpreter(tiny_model_dirs, make_engine):
    reason = _triton_available()
    if reason:
        pytest.skip(reason)
    from hosted.engine import SamplingParams

    ref_engine = make_engine(tiny_model_dirs["llama"], num_kv_blocks=8, block_size=4, max_num_batched_tokens=6)
    want = ref_engine.generate([[11, 12, 13, 14, 15, 16, 17, 18, 19], [3, 4]],
                               SamplingParams(max_tokens=3, temperature=0.0))
    # A subprocess: TRITON_INTERPRET must be set before triton is imported.
    env = {**os.environ, "SWITCHYARD_KERNELS": "triton", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model_dirs["llama"]], check=False, env=env,
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS"))
    assert line == f"TOKENS {want}"
