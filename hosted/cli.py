"""`switchyard engine …` subcommands. Imports torch only inside handlers."""
from __future__ import annotations

import argparse


def _add_serve(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("serve", help="serve a model over the OpenAI API",
                        description="Serve a Hugging Face checkpoint directory over an OpenAI-compatible API.")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--served-model-name", default=None, help="model name reported by the API (default: dir name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most sequences decoded in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests beyond which the server answers 429")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache memory budget in GiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-cache-gb)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's max_position_embeddings)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="weight-only quantization of the decoder linears at load time (embedding and lm_head "
                        "stay in --dtype): int8 per output channel, int4 group-wise with zero points")
    p.add_argument("--quantization-group-size", type=int, default=128, choices=[32, 64, 128],
                   help="int4: input features per scale/zero group; must divide every layer's input size")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="info")

    def run(args: argparse.Namespace) -> int:
        from hosted.server import cli_serve

        return cli_serve(args)

    p.set_defaults(func=run)


def _add_train_demo(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("train-demo", help="train the bundled demo model and its tokenizer",
                        description="Train a small Llama-architecture model and a BPE tokenizer on text every "
                                    "machine has offline (the Python standard library's docs and docstrings).")
    p.add_argument("--out", default="hosted/models/demo", help="output checkpoint directory (HF layout)")
    p.add_argument("--work-dir", default="data/train-demo", help="checkpoints for resuming")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--minutes", type=float, default=None, help="stop after this much training time")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-only", action="store_true", help="export the checkpoint in --work-dir; no training")

    def run(args: argparse.Namespace) -> int:
        from hosted.train_demo import cli_train_demo

        return cli_train_demo(args)

    p.set_defaults(func=run)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="the in-house inference engine", description="The in-house inference engine.")
    esub = p.add_subparsers(dest="engine_command", required=True)
    _add_serve(esub)
    _add_train_demo(esub)
