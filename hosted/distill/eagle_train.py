"""Training the EAGLE draft on captured teacher features: deterministic batches, resumable checkpoints, a clean
stop on Ctrl-C (the same contract as trainer.py, whose batch order, schedule and stop handling it reuses).

Training-time test (EAGLE-3): every row is drafted UNROLL_STEPS steps deep at once (EagleDraft.unroll: step 1 on
the target's features, steps 2.. on the draft's own previous output, each attending to what it sees when
serving). Loss of step k at row p (predicting token p + 2 after the chain): forward KL from the teacher's
distribution -- its own head read off its captured last-layer stream at p + 1, over the draft's head rows --
to the draft's, plus a small regression of the draft's output stream onto that teacher stream (normalised);
step k weighs STEP_DECAY ** (k - 1) (a later draft is reached less often). A row counts for step k when the
chain's first draft comes after the prompt, as when serving.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from hosted.distill.eagle_data import FeatureExample
from hosted.distill.trainer import TrainSettings, TrainState, batch_for_step, lr_at, total_steps
from hosted.spec.eagle_model import EagleDraft, rms

CHECKPOINT = "eagle-checkpoint.pt"
REGRESSION_WEIGHT = 0.1
UNROLL_STEPS = 4
STEP_DECAY = 0.8


def collate(examples: list[FeatureExample], hidden: int) -> tuple[torch.Tensor, ...]:
    """(feats [B, M, F*H] fp32, next tokens [B, M], teacher last stream at p + 1 [B, M, H], first row whose
    prediction is a continuation token [B], rows [B]) for input positions p = 0..M-1, M = longest T - 2."""
    m = max(int(e.tokens.shape[0]) - 2 for e in examples)
    width = examples[0].feats.shape[1]
    feats = torch.zeros(len(examples), m, width)
    nxt = torch.zeros(len(examples), m, dtype=torch.int64)
    target = torch.zeros(len(examples), m, hidden)
    first = torch.zeros(len(examples), dtype=torch.int64)
    rows = torch.zeros(len(examples), dtype=torch.int64)
    for b, e in enumerate(examples):
        n = int(e.tokens.shape[0]) - 2
        feats[b, :n] = e.feats[:n].float()
        nxt[b, :n] = e.tokens[1:n + 1]
        target[b, :n] = e.feats[1:n + 1, -hidden:].float()
        first[b], rows[b] = max(e.prompt_len - 1, 0), n
    return feats, nxt, target, first, rows


def step_masks(first: torch.Tensor, rows: torch.Tensor, width: int, steps: int) -> list[torch.Tensor]:
    """[B, width] masks of the rows step k = 1..steps trains on: p < rows and p - (k - 1) >= first (the chain's
    first draft is predicted from the last prompt position or later)."""
    p = torch.arange(width)[None, :]
    return [(p < rows[:, None]) & (p - (k - 1) >= first[:, None]) for k in range(1, steps + 1)]


def loss_on(draft: EagleDraft, examples: list[FeatureExample], bf16: bool,
            steps: int = UNROLL_STEPS) -> torch.Tensor:
    h = draft.shape.hidden_size
    feats, nxt, target, first, rows = collate(examples, h)
    masks = step_masks(first, rows, feats.shape[1], steps)
    eps = draft.shape.rms_norm_eps
    with torch.no_grad():
        teacher = F.log_softmax(draft.logits(target[masks[0]]), dim=-1)
        target_dir = rms(target[masks[0]], torch.ones(h), eps)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        outs = draft.unroll(draft.fuse(feats), nxt, steps)
    total = torch.zeros(())
    for k, (out, mask) in enumerate(zip(outs, masks)):
        pick = mask[masks[0]]  # this step's rows among step 1's
        if not bool(pick.any()):
            continue
        rows_k = out[mask].float()
        log_q = F.log_softmax(draft.logits(rows_k), dim=-1)
        log_p = teacher[pick]
        kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
        reg = F.smooth_l1_loss(rms(rows_k, torch.ones(h), eps), target_dir[pick])
        total = total + STEP_DECAY ** k * (kl + REGRESSION_WEIGHT * reg)
    return total


def train_eagle(draft: EagleDraft, examples: list[FeatureExample], settings: TrainSettings, work_dir: Path,
                should_stop: Callable[[], bool], progress: bool = True,
                log: Callable[[str], None] = print) -> TrainState:
    """Train until the last step or a stop request, resuming from work_dir's checkpoint if there is one."""
    from tqdm import tqdm

    params = list(draft.parameters())
    opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    state = TrainState()
    ckpt = _load(work_dir)
    if ckpt is not None:
        draft.load_state_dict(ckpt["draft"], strict=False)
        opt.load_state_dict(ckpt["optimizer"])
        state = TrainState(ckpt["step"], ckpt["seconds"], ckpt["history"])
        log(f"resumed training at step {state.step}")
    total = total_steps(settings, len(examples))
    draft.train()
    bar = tqdm(total=total, initial=state.step, unit="step", desc="eagle", disable=not progress, dynamic_ncols=True)
    try:
        while state.step < total and not should_stop():
            t0 = time.perf_counter()
            lr = lr_at(settings, state.step, total)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = [examples[i] for i in batch_for_step(settings, len(examples), state.step)]
            loss = loss_on(draft, batch, settings.bf16)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            state.step += 1
            state.seconds += time.perf_counter() - t0
            state.history.append({"step": state.step, "loss": loss.item(), "lr": lr})
            bar.update(1)
            bar.set_postfix(loss=f"{state.history[-1]['loss']:.4f}")
            if state.step % settings.checkpoint_every == 0:
                _save(work_dir, draft, opt, state)
    finally:
        bar.close()
        _save(work_dir, draft, opt, state)
    draft.eval()
    return state


def _save(work_dir: Path, draft: EagleDraft, opt: torch.optim.Optimizer, state: TrainState) -> None:
    import os

    path = work_dir / CHECKPOINT
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"version": 1, "draft": draft.state_dict(), "optimizer": opt.state_dict(), "step": state.step,
                "seconds": state.seconds, "history": state.history}, tmp)
    os.replace(tmp, path)


def _load(work_dir: Path) -> dict | None:
    path = work_dir / CHECKPOINT
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None
