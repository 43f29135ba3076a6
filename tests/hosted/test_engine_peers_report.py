"""bench/engine_peers.py's report: the roofline from the read rate measured around each row's batch-1 runs, and the issue's
targets judged from the rows (a synthetic result: the benchmark itself needs the peers built)."""
from __future__ import annotations

from argparse import Namespace

from bench import engine_peers


def _row(engine, precision, b1, conc, read, step_mb=100.0, drift=0.0):
    row = {"engine": engine, "precision": precision, "served": "x", "step_bytes": step_mb * 1e6,
           "kv_elem_bytes": 4,
           "batch1": {"decode_tok_s": b1, "ttft_p50_s": 0.1, "read_gb_s_around": [read - drift, read + drift]},
           "concurrent": {"output_tok_s": conc, "min": conc, "max": conc}}
    engine_peers.add_roofline(row, Namespace(batch1_prompt_tokens=256, batch1_new_tokens=256), kv_values=0)
    return row


def test_roofline_uses_each_rows_read_rate_and_targets_compare_same_precision():
    rows = [_row("ours", "fp32", 90.0, 300.0, 50.0, drift=10.0), _row("llama.cpp", "fp32", 100.0, 200.0, 60.0),
            _row("ours", "int8", 300.0, 450.0, 50.0, 25.0), _row("llama.cpp", "int8", 150.0, 150.0, 50.0, 25.0),
            _row("vllm", "fp32", 80.0, 310.0, 40.0)]
    # the mean of the reads before (40) and after (60) the batch-1 runs
    assert rows[0]["read_gb_s"] == 50.0 and rows[0]["roofline_tok_s"] == 500.0 and rows[1]["roofline_tok_s"] == 600.0
    assert abs(rows[0]["roofline_fraction"] - 0.18) < 1e-9
    targets = engine_peers.check_targets(rows)
    assert "batch-1 fp32: ours 90.0 vs llama.cpp 100.0 tok/s — missed" in targets
    assert "batch-1 int8: ours 300.0 vs llama.cpp 150.0 tok/s — met" in targets
    assert "batch-1 int8 / our fp32: 3.33x (target 1.8x) — met" in targets
    assert "64 concurrent fp32: ours 300.0 vs best peer vllm 310.0 tok/s — missed" in targets
    res = {"meta": {"cpu": "c", "threads": 2, "runs": 1, "batch1_prompt_tokens": 256, "batch1_new_tokens": 256,
                    "concurrency": 64, "concurrent_requests": 64, "concurrent_prompt_tokens": [32, 512],
                    "concurrent_new_tokens": 128, "seconds": 1.0, "read_gb_s_range": [40.0, 60.0],
                    "read_bandwidth": {"gb_s": 50.0, "buffer_bytes": 2 << 30, "threads": 2}},
           "rows": rows, "targets": targets}
    text = engine_peers.table(res)
    assert "40.0–60.0 GB/s over the run" in text
    assert "| ours | fp32 | x | 300.0 (300.0–300.0) | 90.0 | 100 | 100 | 50.0 | 500 | 18 |" in text


def test_no_roofline_without_reads_around_batch1():
    row = {"engine": "ours", "precision": "fp32", "step_bytes": 1e8, "kv_elem_bytes": 4,
           "batch1": {"decode_tok_s": 90.0}}
    engine_peers.add_roofline(row, Namespace(batch1_prompt_tokens=256, batch1_new_tokens=256), kv_values=0)
    assert "roofline_tok_s" not in row and "roofline_fraction" not in row
