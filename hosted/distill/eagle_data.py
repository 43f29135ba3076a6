"""The EAGLE draft's training data: the teacher's own greedy continuations and, for every position of prompt +
continuation, its residual streams after the draft's feature layers -- captured while our engine generates
(LlamaForCausalLM.capture_layers on the engine's model: the rows of every forward, prefill and decode, filed by
sequence and position), so no second pass over the data is needed.

Shards of --shard-prompts prompts are written one by one (tmp file + rename) to WORK/eagle/; an interrupted run
keeps every finished shard and a rerun generates only the rest (greedy: a shard's content does not depend on
the batch it ran in beyond rounding).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hosted.engine import EngineConfig, LLMEngine, SamplingParams


@dataclass(slots=True)
class FeatureExample:
    tokens: torch.Tensor  # [T] int64: prompt + continuation
    prompt_len: int
    feats: torch.Tensor  # [T - 1, F * H] bf16: streams at positions 0..T-2 (the last token is never fed)


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.pt"


def capture_shards(teacher_dir: str, prompts: list[list[int]], layers: list[int], max_new_tokens: int,
                   shard_prompts: int, directory: Path, tokens_wanted: int, should_stop: Callable[[], bool],
                   progress: bool = True, max_num_seqs: int = 16) -> list[Path]:
    """Generate and capture shards until they hold `tokens_wanted` continuation tokens, the prompts run out, or
    should_stop() turns true between shards; returns the finished shards in order."""
    from tqdm import tqdm

    directory.mkdir(parents=True, exist_ok=True)
    done: list[Path] = []
    tokens, index = 0, 0
    while shard_path(directory, index).is_file():
        done.append(shard_path(directory, index))
        tokens += sum(int(e.tokens.shape[0]) - e.prompt_len for e in load_shard(done[-1]))
        index += 1
    engine = None
    bar = tqdm(total=tokens_wanted, initial=min(tokens, tokens_wanted), unit="tok", desc="teacher features",
               disable=not progress, dynamic_ncols=True)
    try:
        while tokens < tokens_wanted and index * shard_prompts < len(prompts) and not should_stop():
            if engine is None:
                engine = LLMEngine(EngineConfig(model_dir=teacher_dir, max_num_seqs=max_num_seqs))
                engine.runner.model.capture_layers = tuple(layers)
            chosen = prompts[index * shard_prompts:(index + 1) * shard_prompts]
            examples = _generate(engine, chosen, max_new_tokens, should_stop)
            if examples is None:
                break
            _save_shard(shard_path(directory, index), examples)
            done.append(shard_path(directory, index))
            got = sum(int(e.tokens.shape[0]) - e.prompt_len for e in examples)
            tokens += got
            bar.update(min(got, max(tokens_wanted - bar.n, 0)))
            index += 1
    finally:
        bar.close()
    return done


def _generate(engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int,
              should_stop: Callable[[], bool]) -> list[FeatureExample] | None:
    runner = engine.runner
    width = len(runner.model.capture_layers or ()) * runner.model_config.hidden_size
    ids = [f"eagle-{i}" for i in range(len(prompts))]
    feats = {rid: torch.zeros(len(p) + max_new_tokens, width, dtype=torch.bfloat16) for rid, p in zip(ids, prompts)}
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    while engine.has_unfinished():
        if should_stop():
            for rid in ids:
                engine.abort_request(rid)
            return None
        outs = engine.step()
        captured = runner.model.captured
        row = 0
        for seq, start, n in runner.captured_items:
            if captured is not None:
                feats[seq.request_id][start:start + n] = captured[row:row + n].to(torch.bfloat16)
            row += n
        for out in outs:
            outputs[out.request_id].extend(out.new_token_ids)
    examples = []
    for rid, prompt in zip(ids, prompts):
        out = outputs[rid]
        if len(out) < 2:
            continue
        tokens = torch.tensor(prompt + out, dtype=torch.int64)
        examples.append(FeatureExample(tokens, len(prompt), feats[rid][: tokens.shape[0] - 1].clone()))
    return examples


def _save_shard(path: Path, examples: list[FeatureExample]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save([{"tokens": e.tokens, "prompt_len": e.prompt_len, "feats": e.feats} for e in examples], tmp)
    os.replace(tmp, path)


def load_shard(path: Path) -> list[FeatureExample]:
    return [FeatureExample(**row) for row in torch.load(path, map_location="cpu", weights_only=True)]
