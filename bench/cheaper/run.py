"""python -m bench.cheaper: parse the sections asked for, run them in order, file one result (bench/store.py)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from bench import store
from bench.cheaper import __doc__ as SECTIONS_DOC
from bench.cheaper import peers as cheaper_peers
from bench.cheaper import spec as cheaper_spec
from bench.cheaper import stack as cheaper_stack
from bench.cheaper.precision import (
    GROUP_SIZE,
    MODEL,
    PPL_MODULES,
    PRECISIONS,
    PROMPT_MODULES,
    ROOT,
    TARGETS,
    docstrings,
    log,
    run_precision,
    table,
)
from bench.machine_info import cpu_model
from bench.roofline import read_bandwidth

BENCH = "cheaper"
SECTIONS = ("precision", "spec", "stack", "peers")
ALIASES = {"model": "precision"}  # --section model: the model's own figures per precision


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m bench.cheaper", description=SECTIONS_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md (path without extension) instead of "
                                               "filing the run in bench/results/cheaper/<machine>")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    p.add_argument("--section", action="append", default=[], metavar="NAME",
                   help="run this section (repeatable; 'model' = precision); overrides --sections")
    p.add_argument("--label", default=None, help="a name for this run in the results history (default: the sections "
                                                 "run, empty for all of them)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ppl-tokens", type=int, default=4096, help="held-out tokens scored (at most)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--read-mib", type=int, default=2048)
    p.add_argument("--spec-k", type=int, default=4, help="speculation: --num-speculative-tokens")
    p.add_argument("--spec-tokens", type=int, default=128, help="speculation: greedy tokens per request")
    p.add_argument("--spec-rounds", type=int, default=3, help="odd: the median is a measured round")
    p.add_argument("--spec-batches", default="1,8,32")
    p.add_argument("--spec-eagle", default=None, metavar="DIR",
                   help="speculation: the feature-level draft (default: hosted/models/smollm2-eagle when present)")
    p.add_argument("--spec-configs", default=None, help="speculation: comma-separated name parts of the "
                   "configurations to run (ngram, draft, eagle, tree, default; none always runs)")
    p.add_argument("--spec-workloads", default=None, help="speculation: open-ended (default), grounded, or both")
    p.add_argument("--spec-precisions", default="default,fp32",
                   help="speculation: default (what engine serve picks for the GGUF) and/or fp32")
    p.add_argument("--spec-quick", "--quick", action="store_true", dest="spec_quick",
                   help="speculation: batches 1 and 8, 32 tokens, one round, the first precision (minutes)")
    p.add_argument("--stack-requests", type=int, default=32)
    p.add_argument("--stack-tokens", type=int, default=64)
    p.add_argument("--merge", action="store_true",
                   help="keep the other sections of the previous run (--out's JSON, else this machine's latest run)")
    cheaper_peers.add_args(p)
    args = p.parse_args(argv)
    args.spec_batches = [int(b) for b in args.spec_batches.split(",")]
    sections = [ALIASES.get(x, x) for x in (args.section or args.sections.split(",")) if x]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    return args, sections


def previous_run(args) -> dict | None:
    if args.out:
        old = Path(args.out).with_suffix(".json")
        return json.loads(old.read_text()) if old.is_file() else None
    return store.latest(BENCH, label="")  # the latest run of every section


def merge_previous(res: dict, old: dict, sections: list[str]) -> None:
    """Carry the sections not rerun over from `old`."""
    for key in ("spec", "stack", "peers"):
        if key not in sections and key in old:
            res[key] = old[key]
    if "precision" not in sections:
        res["runs"] = old.get("runs", {})
    res["meta"]["merged_sections_from_earlier_run"] = [s for s in SECTIONS if s not in sections]


def main(argv: list[str] | None = None) -> int:
    from hosted.models import resolve_model_path
    from hosted.tokenizer import Tokenizer

    args, sections = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    path = resolve_model_path(MODEL)
    args.model = str(path)
    tok = Tokenizer.from_gguf(path)
    ppl_ids = tok.encode(docstrings(PPL_MODULES), add_special_tokens=False)[:args.ppl_tokens]
    prompt = tok.encode(docstrings(PROMPT_MODULES), add_special_tokens=False)[:args.prompt_tokens]
    log(f"held-out text: {len(ppl_ids)} tokens; prompt {len(prompt)} tokens")
    bw = read_bandwidth(args.read_mib)
    log(f"streaming read: {bw['gb_s']:.2f} GB/s ({bw['threads']} threads, {bw['buffer_bytes'] >> 20} MiB)")
    res = {"meta": {"model": MODEL, "path": str(path), "cpu": cpu_model(),
                    "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
                    "prompt_tokens": len(prompt), "new_tokens": args.new_tokens, "runs": args.runs,
                    "ppl_tokens": len(ppl_ids), "window": args.window, "ppl_modules": list(PPL_MODULES),
                    "read_bandwidth": bw, "targets": TARGETS, "group_size": GROUP_SIZE, "sections": sections,
                    "load_avg_at_start": list(os.getloadavg())},
           "runs": {}}
    old = previous_run(args) if args.merge else None
    if old:
        merge_previous(res, old, sections)
    # Progress after every section, so an interrupted run keeps what it measured; the run is filed at the end.
    progress = Path(args.out).with_suffix(".json") if args.out else \
        Path(tempfile.gettempdir()) / f"switchyard-bench-cheaper-{os.getpid()}.json"

    def checkpoint() -> None:
        res["meta"]["wall_seconds"] = time.perf_counter() - t_start
        res["meta"]["load_avg_at_end"] = list(os.getloadavg())
        progress.parent.mkdir(parents=True, exist_ok=True)
        progress.write_text(json.dumps(res, indent=1))

    log(f"progress in {progress}")
    run_sections(res, sections, args, path, tok, prompt, ppl_ids, checkpoint)
    checkpoint()
    label = args.label if args.label is not None else ("" if args.merge or sections == list(SECTIONS)
                                                       else ",".join(sections))
    saved = store.save(BENCH, res, markdown=report(res), label=label, out=args.out)
    if not args.out:
        progress.unlink(missing_ok=True)
    print(report(res), flush=True)
    log(f"saved {saved}")
    return 0


def run_sections(res: dict, sections: list[str], args, path, tok, prompt, ppl_ids, checkpoint) -> None:
    if "precision" in sections:
        for label in args.precisions.split(","):
            res["runs"][label] = run_precision(label, path, args, prompt, ppl_ids)
            checkpoint()
    if "spec" in sections:
        res["spec"] = cheaper_spec.run(args, ROOT, tok, log)
        checkpoint()
    if "stack" in sections:
        res["stack"] = cheaper_stack.run(args, ROOT, tok, log)
        checkpoint()
    if "peers" in sections:
        grounded = cheaper_spec.encode(tok, cheaper_spec.grounded_chats())
        chat = cheaper_spec.encode(tok, list(cheaper_spec.OPEN_ENDED))
        res["peers"] = cheaper_peers.run(args, prompt, grounded, chat, log)
        checkpoint()


def report(res: dict) -> str:
    parts = [table(res)] if res["runs"] else []
    if "spec" in res:
        parts.append(cheaper_spec.table(res["spec"]))
    if "stack" in res:
        parts.append(cheaper_stack.table(res["stack"]))
    if "peers" in res:
        parts.append(cheaper_peers.table(res["peers"]))
    return "\n".join(parts)
