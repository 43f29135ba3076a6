"""The teacher's on-policy data: continuations it samples for each prompt through our own batched engine
(LLMEngine: continuous batching, paged KV), with the raw distribution's top-k logprobs at every token it
emitted -- the targets the student is trained on.

Shards of --shard-prompts prompts are written one by one (tmp file + rename) to WORK/teacher/, so an
interrupted run keeps every finished shard and a rerun generates only the rest. Each request has its own
seed (derived from the run's seed and the prompt's index), so a shard's tokens do not depend on what else
was in the batch, on how many shards were done before a restart, or on the engine's step timing.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hosted.distill.prompts import Chat
from hosted.engine import EngineConfig, LLMEngine, SamplingParams
from hosted.sampling_params import MAX_TOP_LOGPROBS
from hosted.tokenizer import Tokenizer

TOP_K = MAX_TOP_LOGPROBS  # the most the engine reports (OpenAI's limit)


@dataclass(slots=True)
class Example:
    """One prompt and the teacher's continuation: top_ids/top_logprobs[i] is the teacher's distribution
    (top TOP_K, raw logits) over output token i, given the prompt and output[:i]."""

    prompt_ids: list[int]
    output_ids: list[int]
    top_ids: torch.Tensor  # [len(output_ids), TOP_K] int32
    top_logprobs: torch.Tensor  # [len(output_ids), TOP_K] float32


@dataclass(slots=True)
class GenerationSettings:
    max_new_tokens: int
    temperature: float
    seed: int
    shard_prompts: int
    max_num_seqs: int = 32


def encode_prompts(tok: Tokenizer, chats: list[Chat], max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of each chat with the generation prompt (the chat template; plain text without one);
    prompts longer than max_prompt_tokens are dropped."""
    out = []
    for chat in chats:
        if tok.has_chat_template:
            ids = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True), add_special_tokens=False)
        else:
            ids = tok.encode("\n".join(m["content"] for m in chat))
        if 0 < len(ids) <= max_prompt_tokens:
            out.append(ids)
    return out


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.pt"


def generate_shards(teacher_dir: str, prompts: list[list[int]], settings: GenerationSettings, directory: Path,
                    tokens_wanted: int, should_stop: Callable[[], bool], progress: bool = True) -> list[Path]:
    """Generate shards until they hold `tokens_wanted` output tokens (cycling through the prompts with fresh
    seeds if needed) or should_stop() turns true between shards; returns the finished shards in order."""
    from tqdm import tqdm

    directory.mkdir(parents=True, exist_ok=True)
    done: list[Path] = []
    tokens = 0
    index = 0
    while shard_path(directory, index).is_file():  # what an earlier run finished
        path = shard_path(directory, index)
        tokens += sum(len(e.output_ids) for e in load_shard(path))
        done.append(path)
        index += 1
    if tokens >= tokens_wanted:
        return done
    engine = None
    bar = tqdm(total=tokens_wanted, initial=min(tokens, tokens_wanted), unit="tok", desc="teacher",
               disable=not progress, dynamic_ncols=True)
    try:
        while tokens < tokens_wanted and not should_stop():
            if engine is None:
                engine = LLMEngine(EngineConfig(model_dir=teacher_dir, max_num_seqs=settings.max_num_seqs))
            start = index * settings.shard_prompts
            chosen = [(start + i, prompts[(start + i) % len(prompts)]) for i in range(settings.shard_prompts)]
            examples = _generate(engine, chosen, settings, should_stop)
            if examples is None:  # stopped mid-shard: its partial work is dropped, a rerun redoes the shard
                break
            _save_shard(shard_path(directory, index), examples)
            done.append(shard_path(directory, index))
            got = sum(len(e.output_ids) for e in examples)
            tokens += got
            bar.update(min(got, max(tokens_wanted - bar.n, 0)))
            index += 1
    finally:
        bar.close()
    return done


def _generate(engine: LLMEngine, chosen: list[tuple[int, list[int]]], settings: GenerationSettings,
              should_stop: Callable[[], bool]) -> list[Example] | None:
    params = [SamplingParams(max_tokens=settings.max_new_tokens, temperature=settings.temperature,
                             seed=settings.seed * 1_000_003 + number, top_logprobs=TOP_K) for number, _ in chosen]
    ids = [f"distill-{number}" for number, _ in chosen]
    for rid, (_, prompt), p in zip(ids, chosen, params):
        engine.add_request(rid, prompt, p)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    tops: dict[str, list[list[tuple[int, float]]]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        if should_stop():
            for rid in ids:
                engine.abort_request(rid)
            return None
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            for lp in out.logprobs or []:
                tops[out.request_id].append(lp.top)
    examples = []
    for rid, (_, prompt) in zip(ids, chosen):
        if not tokens[rid]:
            continue
        top = tops[rid]
        examples.append(Example(prompt, tokens[rid], torch.tensor([[t for t, _ in row] for row in top],
                                                                  dtype=torch.int32),
                                torch.tensor([[lp for _, lp in row] for row in top], dtype=torch.float32)))
    return examples


def _save_shard(path: Path, examples: list[Example]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save([{"prompt_ids": e.prompt_ids, "output_ids": e.output_ids, "top_ids": e.top_ids,
                 "top_logprobs": e.top_logprobs} for e in examples], tmp)
    os.replace(tmp, path)


def load_shard(path: Path) -> list[Example]:
    return [Example(**row) for row in torch.load(path, map_location="cpu", weights_only=True)]
