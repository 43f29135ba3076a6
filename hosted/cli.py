"""`switchyard engine …` subcommands and their handlers. Imports torch (and the engine) only inside handlers,
so `switchyard --help` stays fast."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hosted.config import DEFAULT_DECODE_BURST_MS
from hosted.engine_args import MODEL_HELP, SERVE_DESCRIPTION, SERVE_HELP, add_serve_arguments
from hosted.models import DEMO_MODEL_DIR, is_gguf, resolve_model_path
from hosted.spec.default import Speculation
from hosted.spec.default import resolve as resolve_speculation

if TYPE_CHECKING:
    from hosted.async_llm_engine import AsyncLLMEngine
    from hosted.precision import Precision
    from hosted.server_state import ServerState
    from hosted.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def checked_model_path(model: str) -> Path:
    """--model as a path: a `package:` reference resolved (hosted/models), then a directory or a GGUF file;
    ValueError naming the problem otherwise."""
    path = resolve_model_path(model)
    if not (path.is_dir() or (path.is_file() and is_gguf(path))):
        raise ValueError(f"--model {model!r} is not a checkpoint directory or a GGUF file")
    return path


def served_name(path: Path) -> str:
    """The default model name: the directory's name, or the GGUF file's name without `.gguf`."""
    path = path.resolve()
    return path.stem if path.is_file() else path.name


def _add_serve(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("serve", help=SERVE_HELP, description=SERVE_DESCRIPTION)
    add_serve_arguments(p)  # hosted/engine_args.py: the one definition (the gateway checks engine_args with it)
    p.set_defaults(func=cli_serve)


def _add_train_demo(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("train-demo", help="train the bundled demo model and its tokenizer",
                        description="Train a small Llama-architecture model and a BPE tokenizer on text every "
                                    "machine has offline (the Python standard library's docs and docstrings).")
    p.add_argument("--out", default=DEMO_MODEL_DIR, help="output checkpoint directory (HF layout)")
    p.add_argument("--work-dir", default="data/train-demo", help="checkpoints for resuming")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--minutes", type=float, default=None, help="stop after this much training time")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-only", action="store_true", help="export the checkpoint in --work-dir; no training")

    def run(args: argparse.Namespace) -> int:
        from hosted.tools.train_demo import cli_train_demo

        return cli_train_demo(args)

    p.set_defaults(func=run)


def _add_quantize(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("quantize", help="write a weight-only quantized checkpoint (int8 / int4)",
                        description="Quantize every decoder linear of a model (as `engine serve --quantization` "
                                    "does at load) and write a self-contained checkpoint directory "
                                    "(safetensors, config.json recording the scheme, tokenizer) that `engine serve "
                                    "--model OUT` loads without quantizing again.")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--bits", type=int, required=True, choices=[8, 4],
                   help="8: int8 per output channel; 4: int4 group-wise with zero points")
    p.add_argument("--group-size", type=int, default=None, choices=[32, 64, 128],
                   help="int4: input features per scale/zero group (default: 32 for a GGUF file, whose Q4_0/Q4_1 "
                        "blocks then map exactly; else the largest that divides every layer)")
    p.add_argument("--out", required=True, help="output checkpoint directory (must not exist, or be empty)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the tensors left unquantized (embedding, norms, lm_head); serve with the same "
                        "--dtype for logits identical to quantizing at load")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")

    def run(args: argparse.Namespace) -> int:
        from hosted.tools.quantize import cli_quantize

        return cli_quantize(args)

    p.set_defaults(func=run)


def _add_distill(esub: argparse._SubParsersAction) -> None:
    from hosted.distill.losses import DIVERGENCES

    p = esub.add_parser("distill", help="distill a small draft model for speculative decoding",
                        description="Train a draft to imitate --teacher (DistillSpec): the teacher generates "
                                    "on-policy continuations through the engine, the student (a subset of the "
                                    "teacher's layers with a narrow head) is trained on a divergence over the "
                                    "teacher's token distributions, and the acceptance rate is reported before and "
                                    "after on held-out prompts. Resumable: rerun the same command after Ctrl-C.")
    p.add_argument("--method", default="draft", choices=["draft", "eagle"],
                   help="draft: a subset of the teacher's layers (serve with --draft OUT); eagle: one layer over the "
                        "teacher's own hidden states (serve with --speculative eagle --draft OUT)")
    p.add_argument("--teacher", required=True, help=MODEL_HELP)
    p.add_argument("--out", required=True, help="output draft checkpoint directory (serve with --draft OUT)")
    p.add_argument("--work-dir", default=None, help="teacher data and checkpoints for resuming (default: OUT.work)")
    p.add_argument("--layers", type=int, default=4, help="student layers (taken from the teacher, evenly spaced)")
    p.add_argument("--hidden", type=int, default=None,
                   help="student hidden size (default: the teacher's; narrower starts the layers from scratch)")
    p.add_argument("--head-vocab", type=int, default=8192,
                   help="output head over the teacher's N most frequent output tokens (0: the whole vocabulary)")
    p.add_argument("--prompts", default=None,
                   help="JSON Lines ('messages' or 'prompt' per line) or text (one prompt per line); default: a "
                        "built-in set from the standard library's documentation")
    p.add_argument("--tokens", type=int, default=100_000, help="teacher output tokens to generate and train on")
    p.add_argument("--divergence", default="fkl", choices=DIVERGENCES,
                   help="fkl: KL(teacher||student), rkl: KL(student||teacher), jsd: Jensen-Shannon")
    p.add_argument("--max-new-tokens", type=int, default=128, help="teacher continuation length per prompt")
    p.add_argument("--temperature", type=float, default=0.7, help="teacher sampling temperature")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts are skipped")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per training step")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast for the student's forward (fp32 weights and loss)")
    p.add_argument("--checkpoint-every", type=int, default=25, help="steps between checkpoints")
    p.add_argument("--held-out-percent", type=int, default=10, help="share of prompts held out, by hash")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts for the acceptance report")
    p.add_argument("--eval-tokens", type=int, default=64, help="greedy tokens per held-out prompt")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="K for the acceptance report")
    p.add_argument("--shard-prompts", type=int, default=64, help="prompts per teacher shard (the unit a rerun "
                   "resumes from)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")

    def run(args: argparse.Namespace) -> int:
        from hosted.tools.distill import cli_distill

        return cli_distill(args)

    p.set_defaults(func=run)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="the in-house inference engine", description="The in-house inference engine.")
    esub = p.add_subparsers(dest="engine_command", required=True)
    _add_serve(esub)
    _add_train_demo(esub)
    _add_quantize(esub)
    _add_distill(esub)


# ---------------------------------------------------------------------------------------------- serve
def choose_precision(args: argparse.Namespace) -> Precision:
    """The precision `engine serve` loads --model at: --dtype / --quantization, or what auto decides for this
    file on this device (hosted/precision.py)."""
    from hosted import precision
    from hosted.model_runner import resolve_device

    return precision.choose(resolve_model_path(args.model), resolve_device(args.device).type, args.dtype,
                            getattr(args, "quantization", None), getattr(args, "quantization_group_size", 128))


def speculation(args: argparse.Namespace) -> Speculation:
    """`--speculative` / `--draft` resolved for this model (hosted/spec/default.py: auto, off or a method)."""
    return resolve_speculation(resolve_model_path(args.model), getattr(args, "speculative", None), getattr(args, "draft", None))


def load_model(args: argparse.Namespace, state: ServerState | None = None) -> tuple[AsyncLLMEngine, Tokenizer]:
    """Build the tokenizer and engine from `switchyard engine serve` arguments; the precision chosen is logged
    and, with `state`, kept there for /health and /metrics."""
    from hosted.async_llm_engine import AsyncLLMEngine
    from hosted.engine import EngineConfig, LLMEngine
    from hosted.tokenizer import Tokenizer
    from kernels import switches

    # The process's kernel switches as the flags say (precision's choice reads them too); unset: the defaults,
    # or their environment overrides (kernels/switches.py).
    switches.configure(**{name: value for name in ("kernels", "cpu_native", "cpu_packed_weights", "cpu_decode_step")
                          if (value := getattr(args, name, None)) is not None})
    chosen = choose_precision(args)
    log.info("%s", chosen.describe())
    if state is not None:
        state.precision = chosen
        state.metrics.set_precision(chosen.weights, chosen.dtype, chosen.chosen_by)
    tokenizer = Tokenizer.from_dir(args.model)
    spec = speculation(args)
    log.info("%s", spec.describe())
    config = EngineConfig(model_dir=args.model, dtype=chosen.dtype, device=args.device,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          kv_cache_gb=args.kv_cache_gb, num_kv_blocks=getattr(args, "num_kv_blocks", None),
                          block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                          max_model_len=getattr(args, "max_model_len", None),
                          quantization=chosen.quantization,
                          quantization_group_size=chosen.group_size or getattr(args, "quantization_group_size", 128),
                          quantize_head=getattr(args, "quantize_head", None),
                          kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                          decode_burst_ms=getattr(args, "decode_burst_ms", DEFAULT_DECODE_BURST_MS),
                          speculative=spec.method, draft_model_dir=spec.draft_dir,
                          spec_ngram_alongside=spec.ngram_alongside,
                          num_speculative_tokens=getattr(args, "num_speculative_tokens", 4),
                          kv_host_gb=getattr(args, "kv_host_gb", 0.0), kv_disk_dir=getattr(args, "kv_disk_dir", None),
                          kv_disk_gb=getattr(args, "kv_disk_gb", 10.0),
                          kv_disk_persist=getattr(args, "kv_disk_persist", False),
                          kv_restore=getattr(args, "kv_restore", "auto"),
                          kernels=getattr(args, "kernels", None), cpu_native=getattr(args, "cpu_native", None),
                          cpu_packed_weights=getattr(args, "cpu_packed_weights", None),
                          cpu_decode_step=getattr(args, "cpu_decode_step", None))
    engine = AsyncLLMEngine(LLMEngine(config), max_waiting=args.max_waiting)
    return engine, tokenizer


def cli_serve(args: argparse.Namespace) -> int:
    """`switchyard engine serve`: bind, load the model in the background (health 503 until ready), print a
    ready line, serve until SIGINT/SIGTERM, then stop cleanly."""
    from hosted.server import build_app
    from hosted.server_state import ServerState

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        model_path = checked_model_path(args.model)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or served_name(model_path)
    run = _ServeRun(args, name)
    state = ServerState(model_name=name)
    app = build_app(state, loader=lambda: load_model(args, state), on_ready=run.ready,
                    on_load_error=run.failed)
    run.serve(app)
    if run.exit_code == 0:
        print("switchyard engine stopped", flush=True)
    return run.exit_code


class _ServeRun:
    """One `switchyard engine serve` process: the uvicorn server, the ready line and the exit code."""

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        self.args = args
        self.name = name
        self.exit_code = 0
        self.server: Any = None

    def ready(self, state: ServerState) -> None:
        assert state.engine is not None
        args, s, chosen = self.args, state.engine.stats(), state.precision
        if chosen is not None:  # why, once (health and metrics say it too)
            print(f"switchyard engine {chosen.describe()}", flush=True)
        dtype, weights = (chosen.dtype, chosen.weights) if chosen is not None else (args.dtype, args.dtype)
        print(f"switchyard engine ready: model={self.name} url=http://{args.host}:{args.port}/v1 "
              f"device={state.engine.engine.device} dtype={dtype} precision={weights} "
              f"max_model_len={state.engine.max_model_len} kv_blocks={s.kv_blocks_total}x{args.block_size}", flush=True)

    def failed(self, exc: BaseException) -> None:
        print(f"error: cannot serve {self.args.model!r}: {exc}", file=sys.stderr, flush=True)
        self.exit_code = 1
        if self.server is not None:
            self.server.should_exit = True

    def serve(self, app: Any) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                # uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown, so the process would
                # die by the signal; a clean shutdown should exit 0 instead. A second SIGINT still forces exit.
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True

        config = uvicorn.Config(app, host=self.args.host, port=self.args.port,
                                log_level=self.args.log_level.lower(), access_log=False,
                                timeout_graceful_shutdown=10, lifespan="on")
        self.server = Server(config)
        self.server.run()
