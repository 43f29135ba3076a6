"""The student's training loop: deterministic batches, resumable checkpoints and a clean stop.

Step s trains on batch s % steps_per_epoch of epoch s // steps_per_epoch, whose order is a permutation
seeded by (seed, epoch): the batch a step sees depends on nothing but s, so a run resumed from a checkpoint
(weights, optimizer state, step, loss history) takes exactly the steps an uninterrupted run takes, and
ends with the same weights (same torch build and thread count: the arithmetic is then the same).
Ctrl-C or SIGTERM (StopRequest) ends the loop after the step in flight, and the checkpoint is written then;
a second Ctrl-C interrupts at once (the last checkpoint is still whole: files are renamed into place).
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import torch

from hosted.distill.losses import divergence, head_index, teacher_targets
from hosted.distill.student import Student
from hosted.distill.teacher import Example

CHECKPOINT = "checkpoint.pt"


class StopRequest:
    """Turns the first SIGINT / SIGTERM into a flag the loops poll; the second SIGINT raises at once.
    Installed only from the main thread (signal handlers cannot be set elsewhere)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after the current step (Ctrl-C again to stop at once) ...", flush=True)

    def __call__(self) -> bool:
        return self.requested


@dataclass(slots=True)
class TrainSettings:
    divergence: str
    epochs: float
    batch_size: int
    lr: float
    seed: int
    bf16: bool
    checkpoint_every: int
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1


@dataclass(slots=True)
class TrainState:
    step: int = 0
    seconds: float = 0.0  # training time over every run that contributed
    history: list[dict[str, float]] = field(default_factory=list)  # {"step", "loss", "lr"} per step


def total_steps(settings: TrainSettings, num_examples: int) -> int:
    return max(1, math.ceil(settings.epochs * steps_per_epoch(settings, num_examples)))


def steps_per_epoch(settings: TrainSettings, num_examples: int) -> int:
    return max(1, num_examples // settings.batch_size)


def batch_for_step(settings: TrainSettings, num_examples: int, step: int) -> list[int]:
    per_epoch = steps_per_epoch(settings, num_examples)
    epoch, offset = divmod(step, per_epoch)
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(settings.seed * 7919 + epoch))
    return order[offset * settings.batch_size:(offset + 1) * settings.batch_size].tolist()


def lr_at(settings: TrainSettings, step: int, total: int) -> float:
    """Linear warm-up, then cosine down to lr * min_lr_ratio at the last step."""
    warm = min(1.0, (step + 1) / max(settings.warmup_steps, 1))
    progress = step / max(total - 1, 1)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return settings.lr * warm * (settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cos)


def make_optimizer(student: Student, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(student.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def collate(examples: list[Example], index: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """(input_ids [B, T] right-padded, the flat positions predicting output tokens, their targets [N, H]).
    The input is prompt + output[:-1]; the row at position len(prompt) - 1 + i predicts output token i."""
    seqs = [e.prompt_ids + e.output_ids[:-1] for e in examples]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    rows = []
    for b, (seq, e) in enumerate(zip(seqs, examples)):
        ids[b, :len(seq)] = torch.tensor(seq)
        start = b * width + len(e.prompt_ids) - 1
        rows.append(torch.arange(start, start + len(e.output_ids)))
    targets = torch.cat([teacher_targets(e.top_ids, e.top_logprobs, index, head_size) for e in examples])
    return ids, torch.cat(rows), targets


def loss_on(student: Student, examples: list[Example], index: torch.Tensor, name: str, bf16: bool) -> torch.Tensor:
    ids, rows, targets = collate(examples, index, student.shape.head_vocab)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = student(ids)
    return divergence(name, logits.reshape(-1, logits.shape[-1]).index_select(0, rows), targets)


def train(student: Student, examples: list[Example], settings: TrainSettings, work_dir: Path,
          should_stop: Callable[[], bool], progress: bool = True, log: Callable[[str], None] = print) -> TrainState:
    """Train until the last step or a stop request, resuming from work_dir/checkpoint.pt if there is one;
    the checkpoint is written every settings.checkpoint_every steps and when the loop ends."""
    from tqdm import tqdm

    opt = make_optimizer(student, settings.lr)
    state = TrainState()
    ckpt = load_checkpoint(work_dir)
    if ckpt is not None:
        student.load_state_dict(ckpt["student"])
        opt.load_state_dict(ckpt["optimizer"])
        state = TrainState(ckpt["step"], ckpt["seconds"], ckpt["history"])
        log(f"resumed training at step {state.step}")
    total = total_steps(settings, len(examples))
    index = head_index(student.vocab_ids, student.shape.vocab_size)
    student.train()
    bar = tqdm(total=total, initial=state.step, unit="step", desc="distill", disable=not progress,
               dynamic_ncols=True)
    try:
        while state.step < total and not should_stop():
            t0 = time.perf_counter()
            lr = lr_at(settings, state.step, total)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = [examples[i] for i in batch_for_step(settings, len(examples), state.step)]
            loss = loss_on(student, batch, index, settings.divergence, settings.bf16)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            state.step += 1
            state.seconds += time.perf_counter() - t0
            state.history.append({"step": state.step, "loss": loss.item(), "lr": lr})
            bar.update(1)
            bar.set_postfix(loss=f"{state.history[-1]['loss']:.4f}")
            if state.step % settings.checkpoint_every == 0:
                save_checkpoint(work_dir, student, opt, state)
    finally:
        bar.close()
        save_checkpoint(work_dir, student, opt, state)
    student.eval()
    return state


def save_checkpoint(work_dir: Path, student: Student, opt: torch.optim.Optimizer, state: TrainState) -> None:
    path = work_dir / CHECKPOINT
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"version": 1, "student": student.state_dict(), "optimizer": opt.state_dict(), "step": state.step,
                "seconds": state.seconds, "history": state.history}, tmp)
    os.replace(tmp, path)


def load_checkpoint(work_dir: Path) -> dict[str, Any] | None:
    path = work_dir / CHECKPOINT
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None
