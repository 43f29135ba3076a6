"""Tree-mask attention cost on the native CPU kernels: masked vs unmasked attention, SmolLM2-135M's attention
shape (9 q heads, 3 kv heads, head_dim 64), block size 16.

Rows (per cache dtype and cached prefix):
  decode B=1 / B=8: plain decode with tree_masks None vs all -1 (the masked path's per-row branch, nothing masked);
  verify n as decode rows: n rows of one sequence over prefix + n positions, unmasked vs a random tree's masks;
  verify n as a prefill chunk: the same n rows as one chunk (causal), unmasked vs masked.
Each pair is timed alternately (the fastest of rounds of `calls` calls), so load on the machine hits both alike.

    python -m bench.tree_attention              # files bench/results/tree_attention/<machine>.{json,md}
    python -m bench.tree_attention --quick --out /tmp/tree   # fewer rounds, ad hoc
"""
from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from bench import store
from bench.machine_info import cpu_model
from kernels import cpu_native, ops, switches

HQ, HKV, D, BLOCK = 9, 3, 64, 16


def _tree_masks(n: int, gen: torch.Generator) -> list[int]:
    masks: list[int] = []
    for i in range(n):
        parent = -1 if i == 0 else int(torch.randint(0, i, (1,), generator=gen))
        m = (1 << i) | (masks[parent] if parent >= 0 else 0)
        masks.append(m)
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]


def _pool(seqs: int, length: int, dtype: torch.dtype, gen: torch.Generator):
    nblk = -(-length // BLOCK)
    k = torch.randn(seqs * nblk, BLOCK, HKV, D, generator=gen).to(dtype)
    v = torch.randn(seqs * nblk, BLOCK, HKV, D, generator=gen).to(dtype)
    tables = torch.randperm(seqs * nblk, generator=gen).to(torch.int32).view(seqs, nblk)
    return k, v, tables


def _pair(a, b, calls: int, rounds: int) -> tuple[float, float]:
    """Microseconds per call of a and of b, timed alternately: the lowest round's (the loaded machine this ran on
    descheduled whole rounds for milliseconds, which a median of few rounds still caught)."""
    ta, tb = [], []
    for fn in (a, b):
        fn()
    for _ in range(rounds):
        for fn, out in ((a, ta), (b, tb)):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - start) / calls * 1e6)
    return min(ta), min(tb)


def run(calls: int, rounds: int, prefixes: list[int], n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for prefix in prefixes:
            for batch in (1, 8):
                k, v, tables = _pool(batch, prefix + 1, dtype, gen)
                q = torch.randn(batch, HQ, D, generator=gen)
                lens = torch.full((batch,), prefix + 1, dtype=torch.int32)
                plain = torch.full((batch,), -1, dtype=torch.int64)
                starts = torch.zeros(batch, dtype=torch.int32)
                call = partial(ops.paged_decode_attention, q, k, v, tables, lens, 0.125)
                a, b = _pair(call, partial(call, plain, starts), calls, rounds)
                rows.append(_row(dtype, prefix, f"decode B={batch}", "masks None", "masks all -1", a, b))
            k, v, tables = _pool(1, prefix + n, dtype, gen)
            q = torch.randn(n, HQ, D, generator=gen)
            masks = torch.tensor(_tree_masks(n, gen), dtype=torch.int64)
            starts = torch.full((n,), prefix, dtype=torch.int32)
            lens = torch.full((n,), prefix + n, dtype=torch.int32)
            rep = tables.expand(n, -1).contiguous()
            call = partial(ops.paged_decode_attention, q, k, v, rep, lens, 0.125)
            a, b = _pair(call, partial(call, masks, starts), calls, rounds)
            rows.append(_row(dtype, prefix, f"verify {n} as decode rows", "unmasked", "tree masks", a, b))
            cu = torch.tensor([0, n], dtype=torch.int32)
            plen = torch.tensor([prefix + n], dtype=torch.int32)
            call = partial(ops.paged_prefill_attention, q, k, v, tables, cu, plen, 0.125)
            a, b = _pair(call, partial(call, masks, starts), calls, rounds)
            rows.append(_row(dtype, prefix, f"verify {n} as prefill chunk", "causal", "causal + tree masks", a, b))
    return rows


def _row(dtype, prefix, case, base, masked, base_us, masked_us) -> dict:
    return {"cache": str(dtype)[6:], "prefix": prefix, "case": case, "base": base, "masked": masked,
            "base_us": round(base_us, 2), "masked_us": round(masked_us, 2),
            "ratio": round(masked_us / base_us, 3)}


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Tree-mask attention, native CPU kernels — {meta['device']}", "",
             (f"{meta['threads']} threads, {meta['rounds']} alternated rounds of {meta['calls']} calls; us per call "
              "in the fastest round. ratio = masked / base."), "",
             "| cache | prefix | case | base | us | masked | us | ratio |",
             "| --- | ---: | --- | --- | ---: | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['prefix']} | {r['case']} | {r['base']} | {r['base_us']} | "
                     f"{r['masked']} | {r['masked_us']} | {r['ratio']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output path without extension instead of the results store")
    parser.add_argument("--label", default="")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and one prefix")
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads (1: steadier on a shared "
                                                                    "machine)")
    args = parser.parse_args(argv)
    switches.configure(kernels="auto")
    if cpu_native.library() is None:
        parser.error(f"the native CPU kernels are unavailable: {cpu_native.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    calls, rounds = (20, 10) if args.quick else (30, 40)
    prefixes = [384] if args.quick else [384, 1024]
    with torch.inference_mode():
        rows = run(calls, rounds, prefixes, 16)
    meta = {"device": f"cpu ({cpu_model()})", "threads": args.threads, "calls": calls, "rounds": rounds,
            "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    table = markdown(meta, rows)
    saved = store.save("tree_attention", {"meta": meta, "rows": rows}, markdown=table, label=args.label, out=args.out)
    print(table)
    print(f"saved {saved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
