"""The EAGLE draft's training data: the teacher's own greedy continuations and, for every position of prompt +
continuation, its residual streams after the draft's feature layers.

Two passes per shard, both through our engine: (1) generate the continuations on the fast path (batched, no
capture, so decode-only steps run as the native greedy step); (2) capture the features with ONE teacher-forced
prefill of prompt + continuation per sequence (LlamaForCausalLM.capture_layers; a causal model's streams at a
position are the same whether the position was decoded or prefilled, up to rounding). Prefix caching is off in
that engine: a prefix taken from the cache would never be fed, so it would have no features.

Shards of --shard-prompts prompts are written one by one (tmp file + rename) to WORK/eagle/; an interrupted run
keeps every finished shard and a rerun generates only the rest (greedy: a shard's content does not depend on
the batch it ran in beyond rounding).
"""
from __future__ import annotations

import os
import time
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


@dataclass(slots=True)
class CaptureStats:
    """Seconds spent per pass this run, and the tokens each pass handled (figures for the report)."""
    generate_s: float = 0.0
    generated: int = 0
    capture_s: float = 0.0
    captured: int = 0  # prompt + continuation positions fed through the capturing prefill


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.pt"


def capture_shards(teacher_dir: str, prompts: list[list[int]], layers: list[int], max_new_tokens: int,
                   shard_prompts: int, directory: Path, tokens_wanted: int, should_stop: Callable[[], bool],
                   progress: bool = True, max_num_seqs: int = 32,
                   stats: CaptureStats | None = None) -> list[Path]:
    """Generate and capture shards until they hold `tokens_wanted` continuation tokens, the prompts run out, or
    should_stop() turns true between shards; returns the finished shards in order."""
    from tqdm import tqdm

    stats = stats if stats is not None else CaptureStats()
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
                engine = LLMEngine(EngineConfig(model_dir=teacher_dir, max_num_seqs=max_num_seqs,
                                                enable_prefix_caching=False))
            chosen = prompts[index * shard_prompts:(index + 1) * shard_prompts]
            t0 = time.perf_counter()
            outputs = _generate(engine, chosen, max_new_tokens, should_stop)
            if outputs is None:
                break
            t1 = time.perf_counter()
            examples = _capture(engine, chosen, outputs, layers, should_stop)
            if examples is None:
                break
            stats.generate_s += t1 - t0
            stats.capture_s += time.perf_counter() - t1
            stats.generated += sum(len(o) for o in outputs)
            stats.captured += sum(int(e.tokens.shape[0]) - 1 for e in examples)
            _save_shard(shard_path(directory, index), examples)
            done.append(shard_path(directory, index))
            got = sum(int(e.tokens.shape[0]) - e.prompt_len for e in examples)
            tokens += got
            bar.update(min(got, max(tokens_wanted - bar.n, 0)))
            index += 1
    finally:
        bar.close()
    return done


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]],
         should_stop: Callable[[], bool], on_step: Callable[[], None] | None = None) -> dict[str, list[int]] | None:
    """Run the requests to the end (None if stopped: they are aborted); on_step runs after every step."""
    outputs: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        if should_stop():
            for rid, _, _ in requests:
                engine.abort_request(rid)
            return None
        outs = engine.step()
        if on_step is not None:
            on_step()
        for out in outs:
            outputs[out.request_id].extend(out.new_token_ids)
    return outputs


def _generate(engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int,
              should_stop: Callable[[], bool]) -> list[list[int]] | None:
    """The teacher's greedy continuations, on the engine's fast path (nothing captured)."""
    engine.runner.model.capture_layers = None
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    outs = _run(engine, [(f"gen-{i}", p, params) for i, p in enumerate(prompts)], should_stop)
    return None if outs is None else [outs[f"gen-{i}"] for i in range(len(prompts))]


def _capture(engine: LLMEngine, prompts: list[list[int]], outputs: list[list[int]], layers: list[int],
             should_stop: Callable[[], bool]) -> list[FeatureExample] | None:
    """One capturing prefill of prompt + continuation[:-1] per sequence (the last token is never fed); its one
    sampled token is thrown away."""
    runner = engine.runner
    model = runner.model
    model.capture_layers = tuple(layers)
    width = len(layers) * runner.model_config.hidden_size
    fed = {f"cap-{i}": p + o[:-1] for i, (p, o) in enumerate(zip(prompts, outputs)) if len(o) >= 2}
    feats = {rid: torch.zeros(len(ids), width, dtype=torch.bfloat16) for rid, ids in fed.items()}

    def file_rows() -> None:
        captured, row = model.captured, 0
        for seq, start, n in runner.captured_items:
            if captured is not None and seq.request_id in feats:
                feats[seq.request_id][start:start + n] = captured[row:row + n].to(torch.bfloat16)
            row += n
        model.captured, runner.captured_items = None, []

    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        if _run(engine, [(rid, ids, params) for rid, ids in fed.items()], should_stop, file_rows) is None:
            return None
    finally:
        model.capture_layers, model.captured, runner.captured_items = None, None, []
    examples = []
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        rid = f"cap-{i}"
        if rid in fed:
            examples.append(FeatureExample(torch.tensor(prompt + out, dtype=torch.int64), len(prompt), feats[rid]))
    return examples


def _save_shard(path: Path, examples: list[FeatureExample]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save([{"tokens": e.tokens, "prompt_len": e.prompt_len, "feats": e.feats} for e in examples], tmp)
    os.replace(tmp, path)


def load_shard(path: Path) -> list[FeatureExample]:
    return [FeatureExample(**row) for row in torch.load(path, map_location="cpu", weights_only=True)]
