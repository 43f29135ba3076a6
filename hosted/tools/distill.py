"""`switchyard engine distill`: argument handling around hosted.distill.run (the phases live there)."""
from __future__ import annotations

import argparse
import sys

import torch


def cli_distill(args: argparse.Namespace) -> int:
    from hosted.config import ConfigError
    from hosted.distill.run import DistillSettings, distill

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = DistillSettings(
        teacher=args.teacher, out=args.out, work_dir=args.work_dir, layers=args.layers, hidden=args.hidden,
        head_vocab=args.head_vocab, prompts=args.prompts, tokens=args.tokens, divergence=args.divergence,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, max_prompt_tokens=args.max_prompt_tokens,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed, bf16=args.bf16,
        checkpoint_every=args.checkpoint_every, held_out_percent=args.held_out_percent,
        eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens,
        num_speculative_tokens=args.num_speculative_tokens, progress=not args.no_progress)
    try:
        report = distill(settings)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished phases and the last checkpoint are kept; rerun to continue", file=sys.stderr)
        return 130
    return 0 if report is not None else 130
