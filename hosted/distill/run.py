"""`switchyard engine distill`, phase by phase; every phase's result lives in the work directory, so a rerun
of the same command continues where the last one stopped:

  1. prompts      the --prompts file or the default set; a hashed share held out for the acceptance report
  2. teacher      on-policy continuations + top-k distributions through our engine (WORK/teacher/shard-*.pt)
  3. head         the student's head tokens: the teacher's most frequent output tokens (+ its EOS tokens)
  4. before       the untrained student (teacher layers, same shape) exported and its acceptance measured
  5. train        the divergence over the teacher's distributions (WORK/checkpoint.pt)
  6. export       OUT: the engine checkpoint, its acceptance measured on the exported file, a model card
WORK/run.json records the settings that shape the result; a rerun with other settings refuses to mix them.
"""
from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hosted.config import ModelConfig
from hosted.distill import prompts as prompt_sets
from hosted.distill.acceptance import measure_acceptance
from hosted.distill.losses import DIVERGENCES
from hosted.distill.student import export_draft, new_student, student_shape
from hosted.distill.teacher import GenerationSettings, encode_prompts, generate_shards, load_shard
from hosted.distill.trainer import StopRequest, TrainSettings, total_steps, train
from hosted.tokenizer import Tokenizer

RUN_FILE = "run.json"
REPORT_FILE = "distill_report.json"


@dataclass(slots=True)
class DistillSettings:
    teacher: str
    out: str
    work_dir: str | None = None  # default: OUT + ".work"
    layers: int = 4
    hidden: int | None = None  # default: the teacher's
    head_vocab: int = 8192  # 0: the whole vocabulary
    prompts: str | None = None  # default: prompts.default_prompts
    tokens: int = 100_000  # teacher output tokens to train on
    divergence: str = "fkl"
    max_new_tokens: int = 128
    temperature: float = 0.7
    max_prompt_tokens: int = 384
    epochs: float = 2.0
    batch_size: int = 16
    lr: float = 5e-4
    seed: int = 0
    bf16: bool = True
    checkpoint_every: int = 25
    held_out_percent: int = 10
    eval_prompts: int = 32
    eval_tokens: int = 64
    num_speculative_tokens: int = 4
    shard_prompts: int = 64  # prompts per teacher shard (the unit of resumable generation)
    progress: bool = True

    def work_path(self) -> Path:
        return Path(self.work_dir) if self.work_dir else Path(self.out + ".work")

    def result_key(self) -> dict[str, Any]:
        """The settings the distilled weights depend on (a resumed run must use the same ones)."""
        keep = ("teacher", "layers", "hidden", "head_vocab", "prompts", "tokens", "divergence", "max_new_tokens",
                "temperature", "max_prompt_tokens", "epochs", "batch_size", "lr", "seed", "bf16",
                "held_out_percent", "shard_prompts")
        return {k: getattr(self, k) for k in keep}


def distill(s: DistillSettings, log: Callable[[str], None] = print) -> dict[str, Any] | None:
    """Run (or continue) the distillation; the report, or None when stopped by Ctrl-C / SIGTERM (rerun to
    continue)."""
    if s.divergence not in DIVERGENCES:
        raise ValueError(f"--divergence must be one of {', '.join(DIVERGENCES)}, got {s.divergence!r}")
    work = s.work_path()
    teacher_cfg = ModelConfig.from_dir(s.teacher)
    head_vocab = s.head_vocab or teacher_cfg.vocab_size
    shape = student_shape(teacher_cfg, s.layers, s.hidden, min(head_vocab, teacher_cfg.vocab_size))
    tok = Tokenizer.from_dir(s.teacher)
    # 1. prompts (read before anything is written: bad input leaves no work directory behind)
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
    _claim_work_dir(work, s.result_key())
    with StopRequest() as stop:
        # 2. teacher
        gen = GenerationSettings(s.max_new_tokens, s.temperature, s.seed, s.shard_prompts)
        t0 = time.perf_counter()
        shards = generate_shards(s.teacher, train_ids, gen, work / "teacher", s.tokens, stop, s.progress)
        if stop():
            return None
        examples = [e for path in shards for e in load_shard(path)]
        teacher_tokens = sum(len(e.output_ids) for e in examples)
        log(f"teacher data: {len(examples)} continuations, {teacher_tokens:,} tokens "
            f"({time.perf_counter() - t0:.0f} s this run)")
        # 3. head
        head_tokens = choose_head(examples, shape.head_vocab, teacher_cfg)
        counts = Counter(t for e in examples for t in e.output_ids)
        coverage = sum(counts[t] for t in head_tokens) / max(teacher_tokens, 1)
        # 4. before
        student = new_student(shape, s.teacher, teacher_cfg, head_tokens, s.seed)
        before = _cached_acceptance(work / "before.json", s, eval_ids, lambda: _export_and_measure(
            student, work / "before-draft", s, teacher_cfg, eval_ids, "untrained (teacher layers)"))
        if stop():
            return None
        log(f"acceptance before distillation: {before['rate']:.3f} (K={s.num_speculative_tokens})")
        # 5. train
        settings = TrainSettings(s.divergence, s.epochs, s.batch_size, s.lr, s.seed, s.bf16, s.checkpoint_every)
        state = train(student, examples, settings, work, stop, s.progress, log)
        if state.step < total_steps(settings, len(examples)):
            log(f"stopped at step {state.step}; rerun the same command to continue")
            return None
        # 6. export
        report = {"teacher": s.teacher, "shape": asdict(shape), "settings": s.result_key(),
                  "teacher_tokens": teacher_tokens, "train_examples": len(examples), "head_coverage": coverage,
                  "steps": state.step, "train_seconds": state.seconds, "final_loss": _tail_loss(state.history),
                  "first_loss": state.history[0]["loss"] if state.history else None,
                  "num_speculative_tokens": s.num_speculative_tokens, "acceptance_before": before}
        out = Path(s.out)
        size = export_draft(student, out, s.teacher, teacher_cfg, model_card(report), {"distill": s.result_key()})
        after = measure_acceptance(s.teacher, str(out), eval_ids, s.eval_tokens, s.num_speculative_tokens)
        report.update(acceptance_after=after.as_dict(), file_bytes=size, eval_prompts=len(eval_ids),
                      eval_tokens=s.eval_tokens)
        (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        (out / "README.md").write_text(model_card(report))
        log(f"acceptance after distillation: {after.rate:.3f} (before {before['rate']:.3f}); wrote {out} "
            f"({size / 1e6:.1f} MB)")
        return report


def choose_head(examples: list, head_vocab: int, cfg: ModelConfig) -> list[int]:
    """The head's tokens: every EOS token, then the teacher's output tokens by frequency (ties by id), then
    the lowest unused ids if the teacher emitted fewer distinct tokens; sorted by id."""
    if head_vocab >= cfg.vocab_size:
        return list(range(cfg.vocab_size))
    counts = Counter(t for e in examples for t in e.output_ids)
    chosen = list(dict.fromkeys([t for t in cfg.eos_token_ids if t < cfg.vocab_size]
                                + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]))
    chosen = chosen[:head_vocab]
    if len(chosen) < head_vocab:
        taken = set(chosen)
        chosen += [t for t in range(cfg.vocab_size) if t not in taken][: head_vocab - len(chosen)]
    return sorted(chosen)


def _claim_work_dir(work: Path, key: dict[str, Any]) -> None:
    work.mkdir(parents=True, exist_ok=True)
    path = work / RUN_FILE
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved != key:
            diff = {k: (saved.get(k), v) for k, v in key.items() if saved.get(k) != v}
            raise ValueError(f"the work directory {str(work)!r} holds a run with other settings {diff} "
                             f"(saved, asked); use another --work-dir or delete it")
        return
    path.write_text(json.dumps(key, indent=2) + "\n")


def _cached_acceptance(path: Path, s: DistillSettings, eval_ids: list[list[int]],
                       measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    key = {"eval_prompts": len(eval_ids), "eval_tokens": s.eval_tokens, "k": s.num_speculative_tokens}
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["acceptance"]
    result = measure()
    path.write_text(json.dumps({"key": key, "acceptance": result}, indent=2) + "\n")
    return result


def _export_and_measure(student, directory: Path, s: DistillSettings, cfg: ModelConfig,
                        eval_ids: list[list[int]], what: str) -> dict[str, Any]:
    export_draft(student, directory, s.teacher, cfg, f"# {what}\n", {})
    result = measure_acceptance(s.teacher, str(directory), eval_ids, s.eval_tokens, s.num_speculative_tokens)
    shutil.rmtree(directory, ignore_errors=True)
    return result.as_dict()


def _tail_loss(history: list[dict[str, float]], n: int = 20) -> float | None:
    tail = history[-n:]
    return sum(r["loss"] for r in tail) / len(tail) if tail else None


def model_card(r: dict[str, Any]) -> str:
    shape, st = r["shape"], r["settings"]
    before, after = r["acceptance_before"], r.get("acceptance_after")
    prompts = st["prompts"] or "the default set (hosted/distill/prompts.py: stdlib documentation tasks, code, " \
                                "open questions)"
    lines = [
        "# Distilled draft model", "",
        f"A speculative-decoding draft for `{r['teacher']}`, written by `switchyard engine distill`. Serve it as",
        f"`switchyard engine serve --model {r['teacher']} --draft DIR`.", "",
        "## Shape", "",
        (f"- {shape['num_layers']} layers (hidden {shape['hidden_size']}, {shape['num_heads']} heads / "
        f"{shape['num_kv_heads']} KV heads, MLP {shape['intermediate_size']}), started from the teacher's layers "
        f"{shape['teacher_layers'] or '(none: trained from scratch)'}"),
        (f"- output head over {shape['head_vocab']:,} of {shape['vocab_size']:,} tokens (the teacher's most "
        f"frequent outputs; they cover {r['head_coverage']:.1%} of its training outputs); other tokens get "
        f"logit -inf, so the draft never proposes them"),
        ("- input embedding: the teacher's, frozen; every 2-D tensor stored int8 with an fp16 scale per 32 "
        "values (dequantized at load)"), "",
        "## Training", "",
        (f"- data: {r['teacher_tokens']:,} tokens the teacher generated on-policy (temperature "
        f"{st['temperature']}, up to {st['max_new_tokens']} tokens) through the Switchyard engine for "
        f"{r['train_examples']:,} prompts from {prompts}; targets: the teacher's top-20 logprobs per token"),
        (f"- loss: {st['divergence']} over the head's tokens; {r['steps']} steps of batch {st['batch_size']} "
        f"({st['epochs']} epochs), AdamW lr {st['lr']} cosine, bf16 autocast {st['bf16']}, seed {st['seed']}"),
        (f"- time: {r['train_seconds'] / 60:.1f} min of training on this machine's CPU; loss "
        f"{r['first_loss']:.4f} at the first step, {r['final_loss']:.4f} over the last 20"), "",
        "## Acceptance", "",
        (f"Greedy, K = {r['num_speculative_tokens']} drafts verified at every step, on held-out prompts the draft "
        f"was not trained on:"), "",
        "| draft | acceptance | accepted / proposed |", "| --- | ---: | ---: |",
        (f"| untrained (teacher layers, same shape) | {before['rate']:.3f} | "
         f"{before['accepted']:,} / {before['proposed']:,} |"),
    ]
    if after is not None:
        lines.append(f"| distilled | {after['rate']:.3f} | {after['accepted']:,} / {after['proposed']:,} |")
    lines.append("")
    return "\n".join(lines)
