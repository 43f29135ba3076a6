"""Train the bundled demo model: a byte-level BPE tokenizer and a small Llama on stdlib docstrings.

An offline tool, not engine code. `switchyard engine train-demo` calls `cli_train_demo` (output:
hosted.models.DEMO_MODEL_DIR unless --out). The run is resumable: every few minutes (and on Ctrl-C /
SIGTERM) the model, optimizer, step, RNG and data position go to `--work-dir/checkpoint.pt`, written to a
temporary file and renamed, so an interrupted run never leaves a broken checkpoint.
When the step or time budget is reached the model is exported in Hugging Face layout (bf16
safetensors, tokenizer.json, tokenizer_config.json with the chat template, generation_config.json).
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hosted.models import DEMO_MODEL_DIR
from hosted.tools import demo_corpus as corpus

CHECKPOINT = "checkpoint.pt"
LOG_CSV = "train_log.csv"
LOG_FIELDS = ("step", "tokens", "train_seconds", "lr", "train_loss", "val_loss")


@dataclass(slots=True)
class TrainConfig:
    # model (Llama architecture; ~27M parameters at these defaults)
    vocab_size: int = 8192
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    # optimisation
    seq_len: int = 256
    batch_size: int = 4
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bf16_autocast: bool = True   # about 2x faster on CPUs with avx512_bf16; weights stay fp32
    # budget: stop at whichever comes first; the cosine schedule follows the same progress measure
    steps: int | None = None
    minutes: float | None = None
    # bookkeeping
    log_every: int = 10
    eval_every: int = 50
    eval_windows: int = 16
    checkpoint_every_s: float = 180.0
    seed: int = 0

    def model_fields(self) -> dict[str, Any]:
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "max_position_embeddings", "rope_theta", "seq_len", "seed")
        return {k: getattr(self, k) for k in keys}


@dataclass(slots=True)
class TrainResult:
    step: int
    tokens_seen: int
    train_seconds: float
    last_train_loss: float
    val_loss: float | None
    finished: bool                 # budget reached (as opposed to interrupted)
    exported_to: Path | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- data

@dataclass(slots=True)
class PreparedData:
    tokenizer: Any                 # tokenizers.Tokenizer
    train_tokens: np.ndarray       # uint16, every document starts with BOS
    val_tokens: np.ndarray
    digest: str                    # identifies corpus + tokenizer settings
    documents: int
    val_documents: int


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """Byte-level BPE; the chat/document special tokens get ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(corpus.SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    # Plain encodes start with BOS, as every training document does; trim_offsets=False keeps offsets exact.
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{corpus.BOS} $A", pair=f"{corpus.BOS} $A {corpus.BOS} $B",
                                      special_tokens=[(corpus.BOS, tok.token_to_id(corpus.BOS))]),
    ])
    return tok


def _encode_all(tok: Any, texts: list[str]) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
    return np.asarray(ids, dtype=np.uint16)


def prepare_data(cfg: TrainConfig, work_dir: Path, sources: list[Path] | None = None,
                 log: Any = print) -> PreparedData:
    """Gather the corpus, train the tokenizer and encode both splits; cached in work_dir by digest."""
    from tokenizers import Tokenizer

    docs = list(corpus.iter_documents(paths=sources))
    train_docs, val_docs = corpus.split_documents(docs)
    if not val_docs or not train_docs:
        raise ValueError(f"{len(docs)} documents give no held-out/training split; use more source files")
    h = hashlib.sha1(json.dumps({"v": 1, "vocab": cfg.vocab_size}).encode())
    for d in docs:
        h.update(d.digest.encode())
    digest = h.hexdigest()[:16]
    cache = work_dir / f"data-{digest}"
    if (cache / "tokenizer.json").is_file() and (cache / "val.npy").is_file():
        tok = Tokenizer.from_file(str(cache / "tokenizer.json"))
        return PreparedData(tok, np.load(cache / "train.npy"), np.load(cache / "val.npy"), digest,
                            len(docs), len(val_docs))
    log(f"corpus: {len(docs)} documents ({len(val_docs)} held out) from {corpus.stdlib_dir()}")
    # The tokenizer learns from the training split's plain text; special tokens are added whole.
    tok = train_tokenizer([f"{d.header}\n\n{d.body}\n" for d in train_docs], cfg.vocab_size)
    train_ids = _encode_all(tok, [corpus.render(d) for d in train_docs])
    val_ids = _encode_all(tok, [corpus.render(d) for d in val_docs])
    log(f"tokens: {len(train_ids):,} train, {len(val_ids):,} validation (vocab {tok.get_vocab_size()})")
    tmp = work_dir / f".data-{digest}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save(str(tmp / "tokenizer.json"))
    np.save(tmp / "train.npy", train_ids)
    np.save(tmp / "val.npy", val_ids)
    shutil.rmtree(cache, ignore_errors=True)
    os.replace(tmp, cache)
    return PreparedData(tok, train_ids, val_ids, digest, len(docs), len(val_docs))


@dataclass(slots=True)
class WindowSampler:
    """Yields batches of (seq_len + 1)-token windows: a fresh seeded shuffle and start offset per epoch.
    Its whole state is (epoch, cursor), which the checkpoint stores."""
    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int
    epoch: int = 0
    cursor: int = 0
    _order: np.ndarray | None = None
    _offset: int = 0

    def _plan(self) -> None:
        rng = np.random.default_rng([self.seed, self.epoch])
        span = self.seq_len + 1
        self._offset = int(rng.integers(0, self.seq_len)) if len(self.tokens) > 2 * span else 0
        n = (len(self.tokens) - self._offset) // span
        if n < 1:
            raise ValueError(f"corpus too small: {len(self.tokens)} tokens for windows of {span}")
        self._order = rng.permutation(n)

    def next_batch(self) -> torch.Tensor:
        rows = []
        span = self.seq_len + 1
        while len(rows) < self.batch_size:
            if self._order is None:
                self._plan()
            assert self._order is not None
            if self.cursor >= len(self._order):
                self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
                continue
            start = self._offset + int(self._order[self.cursor]) * span
            rows.append(self.tokens[start:start + span].astype(np.int64))
            self.cursor += 1
        return torch.from_numpy(np.stack(rows))

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor, self._order = int(state["epoch"]), int(state["cursor"]), None

    def windows_per_epoch(self) -> int:
        return (len(self.tokens)) // (self.seq_len + 1)


def validation_windows(tokens: np.ndarray, seq_len: int, limit: int | None = None) -> torch.Tensor:
    span = seq_len + 1
    n = len(tokens) // span
    if n == 0:  # a tiny held-out set still gives one (shorter) window
        return torch.from_numpy(tokens.astype(np.int64))[None, :]
    if limit is not None:
        n = min(n, limit)
    return torch.from_numpy(tokens[: n * span].astype(np.int64).reshape(n, span))


# ---------------------------------------------------------------------------------------------- model

def build_model(cfg: TrainConfig, special_ids: dict[str, int]) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
        attention_bias=False, mlp_bias=False, initializer_range=0.02,
        bos_token_id=special_ids[corpus.BOS], pad_token_id=special_ids[corpus.BOS],
        eos_token_id=[special_ids[corpus.BOS], special_ids[corpus.IM_END]],
    )
    return LlamaForCausalLM(config)


@torch.no_grad()
def mean_loss(model: Any, windows: torch.Tensor, batch_size: int, autocast: bool) -> float:
    """Mean next-token cross-entropy (nats/token) over the windows."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=chunk[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(),
                                                 reduction="sum")
        total += float(loss)
        count += chunk[:, 1:].numel()
    model.train(was_training)
    return total / max(count, 1)


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup, then cosine from lr to lr*min_lr_ratio over the run's progress (0..1)."""
    warm = min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
    cos = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cos)


def _progress(cfg: TrainConfig, step: int, seconds: float) -> float:
    parts = []
    if cfg.steps:
        parts.append(step / cfg.steps)
    if cfg.minutes:
        parts.append(seconds / (cfg.minutes * 60.0))
    return max(parts) if parts else 0.0


# ----------------------------------------------------------------------------------------- checkpoint

def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(work_dir: Path, state: dict[str, Any]) -> None:
    _atomic_write(work_dir / CHECKPOINT, lambda p: torch.save(state, p))


def load_checkpoint(work_dir: Path) -> dict[str, Any] | None:
    path = work_dir / CHECKPOINT
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def write_log(path: Path, history: list[dict[str, Any]]) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=LOG_FIELDS)
            w.writeheader()
            for row in history:
                w.writerow({k: row.get(k, "") for k in LOG_FIELDS})
    _atomic_write(path, write)


# --------------------------------------------------------------------------------------------- export

def tokenizer_files(tok: Any, max_length: int) -> dict[str, Any]:
    """The JSON files beside tokenizer.json that transformers (and our engine) read."""
    ids = {t: tok.token_to_id(t) for t in corpus.SPECIAL_TOKENS}
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for t, i in ids.items()}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": corpus.BOS, "eos_token": corpus.IM_END, "pad_token": corpus.BOS, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_length, "padding_side": "left",
        "added_tokens_decoder": added, "chat_template": corpus.CHAT_TEMPLATE,
    }
    special_tokens_map = {"bos_token": corpus.BOS, "eos_token": corpus.IM_END, "pad_token": corpus.BOS,
                          "additional_special_tokens": [corpus.IM_START, corpus.IM_END]}
    generation_config = {"bos_token_id": ids[corpus.BOS], "eos_token_id": [ids[corpus.IM_END], ids[corpus.BOS]],
                         "pad_token_id": ids[corpus.BOS], "do_sample": False}
    return {"tokenizer_config.json": tokenizer_config, "special_tokens_map.json": special_tokens_map,
            "generation_config.json": generation_config}


def export(model: Any, tok: Any, out_dir: Path, max_length: int) -> None:
    """Write the checkpoint in HF layout to a fresh directory, then swap it in place of out_dir."""
    out_dir = out_dir.resolve()
    tmp = out_dir.with_name(f".{out_dir.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    bf16 = type(model)(model.config)
    bf16.load_state_dict(model.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    bf16.config.dtype = "bfloat16"
    bf16.save_pretrained(tmp, safe_serialization=True)
    # transformers 5 writes rope_parameters/dtype; readers of the 4.x layout look for these two keys.
    config = json.loads((tmp / "config.json").read_text())
    if "rope_theta" in (config.get("rope_parameters") or {}):
        config.setdefault("rope_theta", config["rope_parameters"]["rope_theta"])
    config.setdefault("torch_dtype", "bfloat16")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok.save(str(tmp / "tokenizer.json"))
    for name, payload in tokenizer_files(tok, max_length).items():
        (tmp / name).write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    old = out_dir.with_name(f".{out_dir.name}.export-old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes owner-only files; a model directory is meant to be shared
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------- training

class _Stop(Exception):
    pass


def _check_compatible(ckpt: dict[str, Any], cfg: TrainConfig, digest: str) -> None:
    if ckpt.get("data_digest") != digest:
        raise SystemExit("the checkpoint was trained on a different corpus or tokenizer "
                         "(another Python version?); start over with --no-resume or another --work-dir")
    if ckpt.get("model_fields") != cfg.model_fields():
        raise SystemExit(f"the checkpoint's model settings {ckpt.get('model_fields')} differ from "
                         f"{cfg.model_fields()}; start over with --no-resume or another --work-dir")


@dataclass(slots=True)
class _Run:
    """What a training run carries from step to step (and what its checkpoint saves)."""

    cfg: TrainConfig
    data: PreparedData
    model: Any
    opt: torch.optim.Optimizer
    sampler: WindowSampler
    val_eval: torch.Tensor
    step: int = 0
    tokens_seen: int = 0
    seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    recent: list[float] = field(default_factory=list)  # losses since the last log row: its mean stays exact

    def done(self) -> bool:
        if self.cfg.steps is not None and self.step >= self.cfg.steps:
            return True
        return self.cfg.minutes is not None and self.seconds >= self.cfg.minutes * 60.0

    def snapshot(self) -> dict[str, Any]:
        return {"version": 1, "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "sampler": self.sampler.state(), "torch_rng": torch.get_rng_state(), "step": self.step,
                "tokens_seen": self.tokens_seen, "train_seconds": self.seconds, "history": self.history,
                "recent_losses": self.recent, "data_digest": self.data.digest,
                "model_fields": self.cfg.model_fields(), "config": asdict(self.cfg)}


def train(cfg: TrainConfig, work_dir: Path, out_dir: Path | None = None, resume: bool = True,
          sources: list[Path] | None = None, progress: bool = True, export_only: bool = False,
          log: Any = print) -> TrainResult:
    """Train (or continue training) until cfg.steps / cfg.minutes, then export to out_dir if given.
    KeyboardInterrupt and SIGTERM save a checkpoint and return with finished=False."""
    if export_only and not (work_dir / CHECKPOINT).is_file():
        raise SystemExit(f"nothing to export: no {CHECKPOINT} in {work_dir}")
    work_dir.mkdir(parents=True, exist_ok=True)
    run = setup_run(cfg, prepare_data(cfg, work_dir, sources, log=log))
    ckpt = load_checkpoint(work_dir) if resume else None
    if export_only and ckpt is None:
        raise SystemExit("--export-only needs --resume (it exports the saved checkpoint)")
    if ckpt is not None:
        resume_run(run, ckpt, log)
    finished = export_only or train_until_done(run, work_dir, progress, log)
    if not export_only:
        save_checkpoint(work_dir, run.snapshot())
        write_log(work_dir / LOG_CSV, run.history)
    last = next((r["train_loss"] for r in reversed(run.history)), float("nan"))
    result = TrainResult(run.step, run.tokens_seen, run.seconds, last, None, finished, history=run.history)
    if finished and out_dir is not None:
        result.val_loss = export_run(run, work_dir, out_dir, last, log)
        result.exported_to = out_dir
    return result


def setup_run(cfg: TrainConfig, data: PreparedData) -> _Run:
    """A fresh model, optimizer and data sampler for `cfg` on the prepared data."""
    special_ids = {t: data.tokenizer.token_to_id(t) for t in corpus.SPECIAL_TOKENS}
    if data.tokenizer.get_vocab_size() > cfg.vocab_size:
        raise ValueError("tokenizer vocabulary exceeds the model's")
    model = build_model(cfg, special_ids)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    sampler = WindowSampler(data.train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed)
    val_eval = validation_windows(data.val_tokens, cfg.seq_len, cfg.eval_windows)
    return _Run(cfg, data, model, opt, sampler, val_eval)


def resume_run(run: _Run, ckpt: dict[str, Any], log: Any) -> None:
    """Continue from a saved checkpoint: weights, optimizer, data position, RNG and counters."""
    _check_compatible(ckpt, run.cfg, run.data.digest)
    run.model.load_state_dict(ckpt["model"])
    run.opt.load_state_dict(ckpt["optimizer"])
    run.sampler.load(ckpt["sampler"])
    torch.set_rng_state(ckpt["torch_rng"])
    run.step, run.tokens_seen, run.seconds = ckpt["step"], ckpt["tokens_seen"], ckpt["train_seconds"]
    run.history = [r for r in ckpt["history"] if r["step"] <= run.step]
    run.recent = list(ckpt.get("recent_losses", []))
    log(f"resumed at step {run.step} ({run.tokens_seen:,} tokens, {run.seconds / 60:.1f} min trained)")


def train_until_done(run: _Run, work_dir: Path, progress: bool, log: Any) -> bool:
    """Step until the budget is spent (True) or Ctrl-C / SIGTERM arrives (False), checkpointing as it goes."""
    from tqdm import tqdm

    def on_sigterm(signum: int, frame: Any) -> None:
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, on_sigterm) if _main_thread() else None
    bar = tqdm(total=run.cfg.steps, initial=run.step, disable=not progress, unit="step", dynamic_ncols=True,
               desc="train-demo", file=sys.stderr)
    run.model.train()
    last_ckpt = time.monotonic()
    try:
        while not run.done():
            lr = train_step(run)
            bar.update(1)
            if run.step % run.cfg.log_every == 0 or run.step == 1:
                row = log_row(run, lr)
                bar.set_postfix(loss=row["train_loss"], val=row.get("val_loss", "-"), lr=row["lr"])
                write_log(work_dir / LOG_CSV, run.history)
            if time.monotonic() - last_ckpt >= run.cfg.checkpoint_every_s:
                save_checkpoint(work_dir, run.snapshot())
                last_ckpt = time.monotonic()
        return True
    except (KeyboardInterrupt, _Stop):
        log(f"\ninterrupted at step {run.step}; saving checkpoint")
        return False
    finally:
        bar.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def train_step(run: _Run) -> float:
    """One optimizer step on the next batch; returns the learning rate it used."""
    cfg, t0 = run.cfg, time.perf_counter()
    lr = lr_at(cfg, run.step, _progress(cfg, run.step, run.seconds))
    for group in run.opt.param_groups:
        group["lr"] = lr
    batch = run.sampler.next_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
        logits = run.model(input_ids=batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    run.step += 1
    run.tokens_seen += batch[:, 1:].numel()
    run.seconds += time.perf_counter() - t0
    run.recent.append(float(loss.detach()))
    return lr


def log_row(run: _Run, lr: float) -> dict[str, Any]:
    """Append the history row for this step (with the validation loss every eval_every steps)."""
    cfg = run.cfg
    row: dict[str, Any] = {"step": run.step, "tokens": run.tokens_seen, "train_seconds": round(run.seconds, 1),
                           "lr": f"{lr:.3e}", "train_loss": round(sum(run.recent) / len(run.recent), 4)}
    run.recent = []
    if run.step % cfg.eval_every == 0 or run.step == 1:
        t1 = time.perf_counter()
        row["val_loss"] = round(mean_loss(run.model, run.val_eval, cfg.batch_size, cfg.bf16_autocast), 4)
        run.seconds += time.perf_counter() - t1  # evaluation is part of the time budget
    run.history.append(row)
    return row


def export_run(run: _Run, work_dir: Path, out_dir: Path, last_loss: float, log: Any) -> float:
    """Measure the full validation loss, export the checkpoint and write summary.json; returns the loss."""
    cfg, data = run.cfg, run.data
    val_loss = mean_loss(run.model, validation_windows(data.val_tokens, cfg.seq_len), cfg.batch_size,
                         cfg.bf16_autocast)
    export(run.model, data.tokenizer, out_dir, cfg.max_position_embeddings)
    summary = {"step": run.step, "tokens_seen": run.tokens_seen, "train_seconds": round(run.seconds, 1),
               "final_train_loss": last_loss, "final_val_loss": round(val_loss, 4),
               "val_tokens": len(data.val_tokens), "train_tokens": len(data.train_tokens),
               "documents": data.documents, "val_documents": data.val_documents,
               "parameters": sum(p.numel() for p in run.model.parameters()),
               "python": sys.version.split()[0], "config": asdict(cfg)}
    (work_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"exported to {out_dir}: step {run.step}, val loss {val_loss:.3f} "
        f"(ln vocab = {math.log(cfg.vocab_size):.2f})")
    return val_loss


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def cli_train_demo(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(seed=args.seed, steps=args.steps, minutes=args.minutes)
    if cfg.steps is None and cfg.minutes is None:
        cfg.minutes = 60.0
    for name in ("steps", "minutes"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            print(f"--{name} must be positive", file=sys.stderr)
            return 2
    out_dir = Path(getattr(args, "out", None) or DEMO_MODEL_DIR)
    result = train(cfg, Path(args.work_dir), out_dir, resume=args.resume,
                   export_only=getattr(args, "export_only", False))
    if not result.finished:
        print(f"stopped at step {result.step}; run the same command again to continue", file=sys.stderr)
        return 130
    return 0


# --------------------------------------------------------------------------------- model-card helpers

def plot_loss(log_csv: Path, png: Path) -> None:
    """Train/validation loss against tokens seen, as a small PNG for docs/demo-model.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(log_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    tok = [int(r["tokens"]) / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
    ax.plot(tok, [float(r["train_loss"]) for r in rows], lw=1, label="train (mean since last row)")
    val = [(t, float(r["val_loss"])) for t, r in zip(tok, rows, strict=True) if r["val_loss"]]
    ax.plot([v[0] for v in val], [v[1] for v in val], "o-", ms=3, lw=1.2, label="validation (held-out docs)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def sample_continuations(model_dir: Path, prompts: list[str], chat: list[str], max_new_tokens: int = 48,
                         seed: int = 0) -> list[dict[str, str]]:
    """Greedy and sampled (T=0.8, top_p=0.95) continuations from the exported checkpoint, via transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = [(p, tok(p, return_tensors="pt").input_ids) for p in prompts]
    for question in chat:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        inputs.append((f"[chat] {question}", ids))
    out = []
    for label, ids in inputs:
        row = {"prompt": label}
        for mode, kwargs in (("greedy", {"do_sample": False}),
                             ("sampled", {"do_sample": True, "temperature": 0.8, "top_p": 0.95})):
            torch.manual_seed(seed)
            gen = model.generate(ids, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **kwargs)
            row[mode] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
        out.append(row)
    return out
