"""`switchyard engine distill`: argument handling around hosted.distill.run (the phases live there)."""
from __future__ import annotations

import argparse
import dataclasses
import sys

import torch


def cli_distill(args: argparse.Namespace) -> int:
    from hosted.config import ConfigError
    from hosted.distill.run import DistillSettings, distill

    if args.threads:
        torch.set_num_threads(args.threads)
    # Every DistillSettings field with a flag of the same name comes from it (--no-progress is inverted).
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistillSettings) if hasattr(args, f.name)}
    settings = DistillSettings(**given, progress=not args.no_progress)
    try:
        if getattr(args, "method", "draft") == "eagle":
            from hosted.distill.eagle_run import distill_eagle

            report = distill_eagle(settings)
        else:
            report = distill(settings)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished phases and the last checkpoint are kept; rerun to continue", file=sys.stderr)
        return 130
    return 0 if report is not None else 130
