"""`switchyard engine distill --method eagle`, phase by phase; each phase's result lives in the work directory,
so a rerun of the same command continues where the last one stopped:

  1. prompts   the --prompts file or the default set; a hashed share held out for the acceptance report
  2. capture   the teacher's greedy continuations (fast path), then its streams after the feature layers from
               one capturing prefill per sequence (WORK/eagle/shard-*)
  3. head      the draft's head rows: the teacher's most frequent output tokens (+ EOS)
  4. train     one decoder layer over fused features + next-token embedding, unrolled over the drafting steps
               (training-time test; WORK/eagle-checkpoint.pt)
  5. export    OUT (int8 storage, model card); acceptance by position measured through the engine on held-out
               prompts (greedy, K drafts verified at every step)
"""
from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hosted.config import ModelConfig
from hosted.distill import prompts as prompt_sets
from hosted.distill.eagle_data import CaptureStats, capture_shards, load_shard
from hosted.distill.eagle_train import STEP_DECAY, UNROLL_STEPS, train_eagle
from hosted.distill.run import DistillSettings, _claim_work_dir
from hosted.distill.student import teacher_state
from hosted.distill.teacher import encode_prompts
from hosted.distill.trainer import StopRequest, TrainSettings, total_steps
from hosted.spec.eagle_checkpoint import save_eagle
from hosted.spec.eagle_model import EagleDraft, EagleShape, feature_layers_for, init_from_target
from hosted.tokenizer import Tokenizer
from kernels.reference import rotary_cos_sin

REPORT_FILE = "distill_report.json"


def eagle_key(s: DistillSettings) -> dict[str, Any]:
    keep = ("teacher", "head_vocab", "prompts", "tokens", "max_new_tokens", "max_prompt_tokens", "epochs",
            "batch_size", "lr", "seed", "bf16", "held_out_percent", "shard_prompts")
    return {"method": "eagle", **{k: getattr(s, k) for k in keep}}


def distill_eagle(s: DistillSettings, log: Callable[[str], None] = print) -> dict[str, Any] | None:
    """Run (or continue) the EAGLE distillation; the report, or None when stopped (rerun to continue)."""
    work = s.work_path()
    cfg = ModelConfig.from_dir(s.teacher)
    tok = Tokenizer.from_dir(s.teacher)
    chats = prompt_sets.load_prompts(s.prompts) if s.prompts else prompt_sets.default_prompts(
        max(256, s.tokens // 16))
    train_chats = [c for c in chats if not prompt_sets.is_held_out(c, s.held_out_percent)]
    eval_chats = [c for c in chats if prompt_sets.is_held_out(c, s.held_out_percent)]
    if not train_chats or not eval_chats:
        raise ValueError(f"{len(chats)} prompts leave {len(train_chats)} to train on and {len(eval_chats)} "
                         f"held out ({s.held_out_percent}%): give more prompts")
    train_ids = encode_prompts(tok, train_chats, s.max_prompt_tokens)
    eval_ids = encode_prompts(tok, eval_chats, s.max_prompt_tokens)[: s.eval_prompts]
    if not train_ids or not eval_ids:
        raise ValueError(f"no prompt fits in --max-prompt-tokens {s.max_prompt_tokens}")
    log(f"{len(train_ids)} training prompts, {len(eval_ids)} held out for the acceptance report")
    _claim_work_dir(work, eagle_key(s))
    layers = feature_layers_for(cfg.num_hidden_layers)
    with StopRequest() as stop:
        t0 = time.perf_counter()
        cap = CaptureStats()
        shards = capture_shards(s.teacher, train_ids, layers, s.max_new_tokens, s.shard_prompts, work / "eagle",
                                s.tokens, stop, s.progress, stats=cap)
        if stop():
            return None
        examples = [e for path in shards for e in load_shard(path)]
        teacher_tokens = sum(int(e.tokens.shape[0]) - e.prompt_len for e in examples)
        log(f"teacher features: {len(examples)} continuations, {teacher_tokens:,} tokens "
            f"({time.perf_counter() - t0:.0f} s this run: generation {cap.generate_s:.0f} s, capture "
            f"{cap.capture_s:.0f} s)")
        head = choose_head(examples, min(s.head_vocab or cfg.vocab_size, cfg.vocab_size), cfg)
        draft = new_draft(s.teacher, cfg, layers, head, s.seed)
        settings = TrainSettings("fkl", s.epochs, s.batch_size, s.lr, s.seed, s.bf16, s.checkpoint_every)
        state = train_eagle(draft, examples, settings, work, stop, s.progress, log)
        if state.step < total_steps(settings, len(examples)):
            log(f"stopped at step {state.step}; rerun the same command to continue")
            return None
        counts = Counter(t for e in examples for t in e.tokens[e.prompt_len:].tolist())
        coverage = sum(counts[t] for t in head) / max(teacher_tokens, 1)
        report: dict[str, Any] = {
            "method": "eagle", "teacher": s.teacher, "shape": draft.shape.as_dict(), "settings": eagle_key(s),
            "teacher_tokens": teacher_tokens, "train_examples": len(examples), "head_coverage": coverage,
            "steps": state.step, "train_seconds": state.seconds,
            "first_loss": state.history[0]["loss"] if state.history else None,
            "final_loss": _tail(state.history), "num_speculative_tokens": s.num_speculative_tokens,
            "unroll_steps": UNROLL_STEPS, "step_decay": STEP_DECAY,
            "data_seconds_this_run": {"generate": cap.generate_s, "capture": cap.capture_s,
                                      "generated_tokens": cap.generated, "captured_positions": cap.captured}}
        out = Path(s.out)
        size = save_eagle(draft, out, model_card(report), {"distill": eagle_key(s)})
        acc = measure_eagle(s.teacher, str(out), eval_ids, s.eval_tokens, s.num_speculative_tokens)
        report.update(acceptance=acc, file_bytes=size, eval_prompts=len(eval_ids), eval_tokens=s.eval_tokens)
        (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        (out / "README.md").write_text(model_card(report))
        log(f"acceptance by position {[round(a, 3) for a in acc['by_position']]}, mean accepted length "
            f"{acc['mean_accepted']:.2f}; wrote {out} ({size / 1e6:.1f} MB)")
        return report


def choose_head(examples: list, head_vocab: int, cfg: ModelConfig) -> list[int]:
    """Every EOS token, then the teacher's continuation tokens by frequency (ties by id), then the lowest unused
    ids; sorted."""
    if head_vocab >= cfg.vocab_size:
        return list(range(cfg.vocab_size))
    counts = Counter(t for e in examples for t in e.tokens[e.prompt_len:].tolist())
    chosen = list(dict.fromkeys([t for t in cfg.eos_token_ids if t < cfg.vocab_size]
                                + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]))[:head_vocab]
    if len(chosen) < head_vocab:
        taken = set(chosen)
        chosen += [t for t in range(cfg.vocab_size) if t not in taken][: head_vocab - len(chosen)]
    return sorted(chosen)


def new_draft(teacher_dir: str, cfg: ModelConfig, layers: list[int], head: list[int], seed: int) -> EagleDraft:
    """A draft started from the teacher's last layer, attached to the teacher's embedding, norm and head."""
    torch.manual_seed(seed)
    last = cfg.num_hidden_layers - 1
    shape = EagleShape(cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                       cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta, cfg.rope_scaling,
                       cfg.max_position_embeddings, list(layers), len(head), last)
    draft = EagleDraft(shape)
    weights = teacher_state(teacher_dir, cfg)
    prefix = f"model.layers.{last}."
    init_from_target(draft, {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)})
    draft.vocab_ids.copy_(torch.tensor(head, dtype=torch.int64))
    embed = weights["model.embed_tokens.weight"]
    draft.attach_target(embed, weights["model.norm.weight"], weights.get("lm_head.weight", embed),
                        rotary_cos_sin(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling))
    return draft


def measure_eagle(teacher: str, draft_dir: str, prompts: list[list[int]], max_new_tokens: int, k: int,
                  max_num_seqs: int = 16) -> dict[str, Any]:
    """Greedy generation with the draft proposing k tokens at every step (no planning): acceptance by position,
    mean accepted drafts per verification, totals."""
    from hosted.engine import EngineConfig, LLMEngine, SamplingParams
    from hosted.spec.decoder import acceptance_by_position

    engine = LLMEngine(EngineConfig(model_dir=teacher, speculative="eagle", draft_model_dir=draft_dir,
                                    num_speculative_tokens=k, spec_adaptive=False, max_num_seqs=max_num_seqs))
    engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    spec = engine.spec
    assert spec is not None
    ver = spec.verifications
    n = sum(ver.values())
    return {"by_position": acceptance_by_position(ver), "verifications": n,
            "mean_accepted": sum(a * c for (_, a), c in ver.items()) / max(n, 1),
            "proposed": spec.num_proposed, "accepted": spec.num_accepted,
            "rate": spec.num_accepted / max(spec.num_proposed, 1)}


def _tail(history: list[dict[str, float]], n: int = 20) -> float | None:
    tail = history[-n:]
    return sum(r["loss"] for r in tail) / len(tail) if tail else None


def model_card(r: dict[str, Any]) -> str:
    shape, st = r["shape"], r["settings"]
    acc = r.get("acceptance")
    lines = [
        "# EAGLE draft (feature-level)", "",
        f"A speculative-decoding draft for `{r['teacher']}`, written by `switchyard engine distill --method eagle`.",
        f"Serve it as `switchyard engine serve --model {r['teacher']} --speculative eagle --draft DIR`.", "",
        "## Shape", "",
        (f"- one decoder layer (hidden {shape['hidden_size']}, {shape['num_heads']} heads / {shape['num_kv_heads']} "
         f"KV heads, MLP {shape['intermediate_size']}), started from the teacher's layer {shape['init_layer']}"),
        (f"- input: the teacher's streams after layers {shape['feature_layers']} fused by a linear "
         f"{len(shape['feature_layers'])}H -> H, with the next token's embedding (the teacher's, frozen), by a "
         f"linear 2H -> H; drafting steps after the first read the draft's own output instead of the features"),
        (f"- head: the teacher's final norm and its head rows for {shape['head_vocab']:,} of "
         f"{shape['vocab_size']:,} tokens (its most frequent outputs: {r['head_coverage']:.1%} of its training "
         f"outputs), read from the target at load; the file holds only the trained tensors, int8 per 32 values"),
        "", "## Training", "",
        (f"- data: {r['teacher_tokens']:,} tokens of the teacher's own greedy continuations ({r['train_examples']:,} "
         f"prompts, up to {st['max_new_tokens']} tokens; generated batched on the Switchyard engine's fast path), "
         f"with its hidden states captured by one teacher-forced prefill of prompt + continuation per sequence"),
        (f"- loss: training-time test over {r.get('unroll_steps', 1)} drafting steps (step 1 on the target's "
         f"features, later steps on the draft's own previous output, attention as when serving), each step's "
         f"loss weighted {r.get('step_decay', 1.0)}^(k-1): forward KL to the teacher's next-token distribution "
         f"over the head rows + 0.1 x a normalised regression onto its last-layer stream; "
         f"{r['steps']} steps of batch {st['batch_size']} ({st['epochs']} epochs), AdamW lr {st['lr']}"),
        (f"- time: {r['train_seconds'] / 60:.1f} min of training on this machine's CPU; loss {r['first_loss']:.3f} "
         f"at the first step, {r['final_loss']:.3f} over the last 20"), ""]
    if acc is not None:
        lines += ["## Acceptance", "",
                  (f"Greedy, K = {r['num_speculative_tokens']} drafts verified at every step, {r['eval_prompts']} "
                   f"held-out prompts x {r['eval_tokens']} tokens: {acc['accepted']:,} of {acc['proposed']:,} "
                   f"drafts accepted ({acc['rate']:.3f}), mean accepted length {acc['mean_accepted']:.2f} + 1 "
                   f"per verification."), "",
                  "| draft position | " + " | ".join(str(j) for j in range(1, len(acc["by_position"]) + 1)) + " |",
                  "| --- |" + " ---: |" * len(acc["by_position"]),
                  "| P(accepted \\| reached) | " + " | ".join(f"{a:.3f}" for a in acc["by_position"]) + " |", ""]
    return "\n".join(lines)
