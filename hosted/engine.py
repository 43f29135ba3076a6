"""LLMEngine: requests in, tokens out, one scheduler iteration per `step()`.

Not thread-safe: call add_request / abort_request / step from one thread (the async wrapper does).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hosted.block_manager import BlockManager
from hosted.config import EngineConfig, ModelConfig
from hosted.kv_tiers import build_kv_tiers
from hosted.model_runner import ModelRunner
from hosted.sampler import Sampler
from hosted.sampling_params import SamplingParams
from hosted.scheduler import Scheduler
from hosted.sequence import Sequence
from hosted.spec.decoder import Sampled, SpecDecoder, plain_samples
from hosted.structured import GrammarMasks, new_matcher

__all__ = ["BurstInterrupt", "EngineConfig", "EngineStats", "LLMEngine", "SamplingParams", "StepOutput", "TokenLogprob"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float  # log-softmax of the raw model logits (before penalties and temperature), as OpenAI
    top: list[tuple[int, float]]  # (token_id, logprob), best first; len == top_logprobs


@dataclass(slots=True)
class StepOutput:
    request_id: str
    # Tokens produced for this request in this step (0 or 1; up to 1 + k when verifying k draft tokens).
    # When finish_reason == "stop" the last one is the EOS / stop token that ended the request: count it,
    # but do not render it as text.
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per new token when the request asked for logprobs
    finished: bool
    finish_reason: str | None  # "stop" (EOS / stop token), "length", "abort"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (fixed at first admission)
    device_seconds: float  # cumulative device time attributed to this request so far
    spec_proposed: int = 0  # draft tokens verified for this request so far (speculative decoding)
    spec_accepted: int = 0  # of them, kept as output
    # Of num_cached_tokens, those restored from the host-memory / disk KV tiers (hosted/kv_tiers.py).
    num_restored_host_tokens: int = 0
    num_restored_disk_tokens: int = 0


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_queries_tokens: int
    prefix_hit_tokens: int
    busy_seconds: float  # cumulative time spent in model forward + sampling
    num_preemptions: int
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_computed_tokens: int = 0  # tokens fed through the model (prefill + decode + recompute)
    spec_proposed_tokens: int = 0  # draft tokens verified (speculative decoding)
    spec_accepted_tokens: int = 0  # of them, kept as output
    kv_tiers: dict | None = None  # per tier (host, disk): blocks held, hits, bytes each way, restore seconds


class BurstInterrupt:
    """A flag another thread raises to end the engine's current decode burst (LLMEngine.step) after the step in
    progress: read between iterations, and after each step by a native greedy burst (as memory, without the GIL)."""

    def __init__(self) -> None:
        self.flag = torch.zeros(1, dtype=torch.int32)
        self._view = self.flag.numpy()  # numpy writes: cheaper than torch indexing, same memory

    def set(self) -> None:
        self._view[0] = 1

    def clear(self) -> None:
        self._view[0] = 0

    def is_set(self) -> bool:
        return bool(self._view[0])


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.eos_token_ids: list[int] = list(self.model_config.eos_token_ids)
        self.max_model_len = self._resolve_max_model_len()
        self.runner = ModelRunner(self.model_config, config, self.max_model_len)
        self.device = self.runner.device
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_tiers = build_kv_tiers(config, self.model_config, self.runner) if config.kv_tiering else None
        if self.kv_tiers is not None:
            self.block_manager.attach_tiers(self.kv_tiers)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(self.device)
        self.spec = (SpecDecoder(config, self.model_config, self.runner, self.max_model_len)
                     if config.spec_method is not None else None)
        # Constrained decoding (hosted/structured.py): per-sequence grammar matchers, masks filled during the forward.
        self.masks = GrammarMasks(self.model_config.vocab_size)
        self._constrained = 0  # live sequences with a grammar: without any, a step does no mask work at all
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[StepOutput] = []
        self._arrivals = 0
        self._busy = 0.0
        self._steps = 0
        self._generated = 0
        self._computed = 0
        self._greedy_step_s: dict[int, float] = {}  # batch size -> seconds per step of its last native greedy burst

    def _resolve_max_model_len(self) -> int:
        mc = self.model_config
        limit = mc.max_position_embeddings
        if mc.sliding_window is not None and mc.sliding_window < limit:
            # The attention kernels have no sliding window; within the window full attention is exact.
            log.info("capping max_model_len to the model's sliding_window %d", mc.sliding_window)
            limit = mc.sliding_window
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds what this model supports ({limit})")
        return wanted

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. Raises ValueError (and changes nothing) if it can never be served."""
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt holds {bad!r}, not a token id of this model (vocabulary size {vocab})")
        params.validate(vocab)
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the model's context length {self.max_model_len}")
        # The last generated token is never fed back, so total - 1 positions need KV.
        need = self.block_manager.blocks_for(total - 1)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"request needs {need} KV blocks but the pool holds {self.block_manager.num_blocks}; "
                             f"shorten the prompt or max_tokens")
        seq = Sequence(request_id=request_id, token_ids=list(prompt_token_ids),
                       num_prompt_tokens=len(prompt_token_ids), params=params, arrival=self._arrivals)
        self._arrivals += 1
        if params.grammar is not None:
            seq.matcher = new_matcher(params.grammar)
            self._constrained += 1
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Free the request's blocks now; the next step() reports it finished with reason "abort".
        Unknown or already finished ids are ignored."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        self._forget(seq)
        self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.release(seq)
        seq.finish_reason = "abort"
        self._aborted.append(self._output(seq, [], None))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    # ---- one iteration ----------------------------------------------------------------------------
    def step(self, before_forward: Callable[[], None] | None = None, *, burst_s: float = 0.0,
             interrupt: BurstInterrupt | None = None) -> list[StepOutput]:
        """One scheduler iteration. `before_forward` runs once the batch is prepared, right before the forward
        pass (not at all when nothing is scheduled).

        With `burst_s` > 0, a step whose batch only decoded runs further decode-only iterations back to back
        for up to that many seconds (steady greedy decoding: one native call for them all, _greedy_burst), and
        returns each request's tokens of them all in one StepOutput: whoever
        hands tokens on (the server's event loop, the SSE writer, the client) then works once per burst instead
        of once per token, while it would otherwise share the cores with the next step. A burst ends early when
        a request finishes, anything waits for admission, a sequence would be preempted, speculation (unless
        its planner rests: SpecDecoder.resting_steps) or a grammar is in play, or `interrupt` is raised (the
        server: a request arrived or was aborted), which a
        native greedy burst also reads after each of its steps."""
        outputs, self._aborted = self._aborted, []
        start, steps_before = time.perf_counter(), self._steps
        burst = None
        if burst_s > 0 and self._may_burst():
            # Steady greedy decoding: the whole burst is one native call, sized by the time per step of the last
            # one at this batch size (one step when there was none: the loop below adds what still fits).
            per_step = self._greedy_step_s.get(len(self.scheduler.running))
            burst = self._greedy_burst(max(1, int(burst_s / per_step)) if per_step else 1, interrupt, before_forward)
        decode_only = burst is not None
        if burst is None:
            iterated = self._iterate(before_forward)
            if iterated is None:
                return outputs
            burst, decode_only = iterated
        merged = {out.request_id: out for out in burst}
        while (burst_s > 0 and decode_only and burst and not any(out.finished for out in burst) and self._may_burst()
               and not (interrupt is not None and interrupt.is_set())):
            elapsed = time.perf_counter() - start
            per_step = max(elapsed / max(1, self._steps - steps_before), 1e-6)
            room = int((burst_s - elapsed) / per_step)  # steps that still fit
            if room < 1:
                break
            burst = self._greedy_burst(room, interrupt)
            decode_only = burst is not None
            if burst is None:
                iterated = self._iterate(None)
                if iterated is None:
                    break
                burst, decode_only = iterated
            for out in burst:
                merged[out.request_id] = _merge(merged.get(out.request_id), out)
        outputs.extend(merged.values())
        return outputs

    def _may_burst(self) -> bool:
        """Whether decode-only iterations may run back to back now: nothing waits for admission, and no speculation
        or grammar needs each step's tokens first (see step)."""
        spec_off = self.spec is None or self.spec.resting_steps(len(self.scheduler.running)) > 1
        return spec_off and not self._constrained and not self.scheduler.waiting

    def _greedy_burst(self, max_steps: int, interrupt: BurstInterrupt | None,
                      before_forward: Callable[[], None] | None = None) -> list[StepOutput] | None:
        """Up to max_steps decode steps of every running sequence in one native call (ModelRunner.decode_greedy),
        when each of them decodes greedily and needs nothing else per token (no logprobs, penalties, grammar or
        speculation) and the blocks for those steps are free; None when that does not apply (the caller runs a
        regular iteration). Tokens, finish reasons and accounting come out as from that many iterations.
        `before_forward` runs right before the call (not at all when it does not apply)."""
        seqs = list(self.scheduler.running)
        if (not self.runner.can_decode_greedy or not seqs or len(seqs) > self.config.max_num_batched_tokens
                or any(not s.params.greedy or s.params.logprobs or s.params.top_logprobs or s.params.has_penalties
                       or s.matcher is not None or s.num_uncomputed != 1 for s in seqs)):
            return None
        if self.spec is not None:  # speculation resting: the burst ends a step before it plans again
            max_steps = min(max_steps, self.spec.resting_steps(len(seqs)) - 1)
        # Tokens each may make before it ends by length (then the call stops: its output is final).
        budgets = [min(s.params.max_tokens - s.num_output_tokens, self.max_model_len - s.num_tokens) for s in seqs]
        bm = self.block_manager
        steps = min(max_steps, *budgets)
        while steps > 0 and sum(max(0, bm.blocks_for(s.num_computed_tokens + steps) - len(s.block_table))
                                for s in seqs) > bm.num_free_blocks:
            steps -= 1
        if steps < 1:
            return None
        for seq in seqs:
            bm.allocate(seq, seq.num_computed_tokens + steps)
        if self.kv_tiers is not None:
            self.kv_tiers.flush()  # blocks evicted for these steps move down before they are written
        stop_ids = [list(s.params.stop_token_ids) + ([] if s.params.ignore_eos else self.eos_token_ids) for s in seqs]
        if before_forward is not None:
            before_forward()
        t0 = time.perf_counter()
        new_tokens = self.runner.decode_greedy(seqs, steps, stop_ids, budgets,
                                               interrupt.flag if interrupt is not None else None)
        elapsed = time.perf_counter() - t0
        done = len(new_tokens[0])
        if self.spec is not None:
            self.spec.rested(done, elapsed, len(seqs))
        self._greedy_step_s[len(seqs)] = elapsed / done
        self._busy += elapsed
        self._steps += done
        self._computed += done * len(seqs)
        outputs: list[StepOutput] = []
        finished: list[Sequence] = []
        for seq, tokens in zip(seqs, new_tokens):
            seq.device_seconds += elapsed / len(seqs)
            seq.num_computed_tokens += done
            kept, reason = self._append(seq, tokens)
            self._generated += kept
            if reason is not None:
                seq.finish_reason = reason
                finished.append(seq)
            elif done < steps:
                bm.truncate(seq, seq.num_tokens)  # blocks taken for steps that did not run
            bm.register_computed_blocks(seq)
            outputs.append(self._output(seq, tokens[:kept], None))
        self._retire(finished)
        return outputs

    def _iterate(self, before_forward: Callable[[], None] | None) -> tuple[list[StepOutput], bool] | None:
        """One scheduler iteration's outputs, and whether its batch only decoded (nothing preempted); None when
        nothing was scheduled."""
        outputs: list[StepOutput] = []
        spec = self.spec
        if spec is not None:
            spec.propose(self.scheduler)  # draft tokens for running decodes, verified in this step's forward
        batch = self.scheduler.schedule()
        if self.kv_tiers is not None:
            self.kv_tiers.flush()  # demotions of evicted blocks, then restores, before the forward writes
        if spec is not None:
            for seq in batch.preempted:
                spec.release(seq)
        if batch.empty:
            return None
        t0 = time.perf_counter()
        constrained = self._constrained > 0 and self._start_masks(batch)
        with torch.inference_mode():
            logits, sample_seqs = self.runner.execute(batch, before_forward)
            if constrained:
                self.masks.apply(logits)  # waits for the bitmasks filled while the forward ran
            if not sample_seqs:
                sampled: list[Sampled] = []
            elif spec is not None:
                sampled = spec.sample(logits, sample_seqs, self.sampler)
            else:
                sampled = plain_samples(self.sampler(logits, sample_seqs))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        if spec is not None:
            spec.observe(batch.num_tokens, elapsed)
            elapsed += spec.propose_seconds
        self._busy += elapsed
        self._steps += 1
        self._computed += batch.num_tokens
        if self.kv_tiers is not None and batch.num_tokens > batch.num_decodes:
            self.kv_tiers.observe_prefill(batch.num_tokens - batch.num_decodes, elapsed)  # the recompute cost

        for seq, n in batch.items:
            seq.device_seconds += elapsed * n / batch.num_tokens
            seq.num_computed_tokens += n
        finished: list[Sequence] = []
        for seq, got in zip(sample_seqs, sampled):
            kept, reason = self._append(seq, got.token_ids)
            if got.num_proposed:
                assert spec is not None
                spec.settle(seq, got, kept, self.block_manager)  # roll back the rejected drafts' KV
            self._generated += kept
            logprobs = None
            if got.logprobs is not None:
                logprobs = [TokenLogprob(t, lp[0], lp[1]) for t, lp in zip(got.token_ids[:kept], got.logprobs)]
            if reason is not None:
                seq.finish_reason = reason
                finished.append(seq)
            outputs.append(self._output(seq, got.token_ids[:kept], logprobs))
        # Only now, with rejected drafts rolled back, may full computed blocks enter the prefix cache.
        for seq, _ in batch.items:
            self.block_manager.register_computed_blocks(seq)
        self._retire(finished)
        return outputs, not batch.preempted and batch.num_decodes == len(batch.items)

    def _retire(self, finished: list[Sequence]) -> None:
        """Sequences that ended this iteration leave the scheduler (their blocks freed) and the speculator."""
        for seq in finished:
            self.scheduler.remove(seq)
            if self.spec is not None:
                self.spec.release(seq)
            self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        """The request is over: drop it from the live sequences (and the count of constrained ones)."""
        del self._seqs[seq.request_id]
        if seq.matcher is not None:
            self._constrained -= 1

    def _start_masks(self, batch) -> bool:
        """Start filling the next-token bitmasks of the constrained sequences that sample this step (their logit
        rows as ModelRunner.execute lays them out); False, and nothing started, when there are none."""
        rows, matchers, row = [], [], 0
        for seq, n in batch.items:
            end = seq.num_computed_tokens + n
            if end < seq.num_tokens:
                continue  # a partial prefill chunk: no logits row
            if seq.matcher is not None:
                rows.append(row)
                matchers.append(seq.matcher)
            row += 1 + max(end - seq.num_tokens, 0)
        if not rows:
            return False
        self.masks.start(rows, matchers)
        return True

    def _append(self, seq: Sequence, tokens: list[int]) -> tuple[int, str | None]:
        """Append tokens up to the first that ends the request; returns (how many, finish reason or None)."""
        for i, token in enumerate(tokens):
            if seq.matcher is not None and not seq.matcher.accept_token(token):
                # Cannot happen with the mask applied; never emit a token the grammar rejects.
                log.error("request %s: the grammar rejected token %d; ending it", seq.request_id, token)
                return i, "length"
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                return i + 1, reason
        return len(tokens), None

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"  # the grammar is complete (it ends on a stop token)
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> StepOutput:
        return StepOutput(request_id=seq.request_id, new_token_ids=tokens, logprobs=logprobs,
                          finished=seq.finish_reason is not None, finish_reason=seq.finish_reason,
                          num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                          device_seconds=seq.device_seconds, spec_proposed=seq.spec_proposed,
                          spec_accepted=seq.spec_accepted, num_restored_host_tokens=seq.num_restored_host_tokens,
                          num_restored_disk_tokens=seq.num_restored_disk_tokens)

    # ---- introspection ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks, kv_blocks_free=bm.num_free_blocks,
            prefix_queries_tokens=bm.prefix_queries_tokens, prefix_hit_tokens=bm.prefix_hit_tokens,
            busy_seconds=self._busy, num_preemptions=self.scheduler.num_preemptions, num_steps=self._steps,
            num_generated_tokens=self._generated, num_computed_tokens=self._computed,
            spec_proposed_tokens=self.spec.num_proposed if self.spec is not None else 0,
            spec_accepted_tokens=self.spec.num_accepted if self.spec is not None else 0,
            kv_tiers=self.kv_tiers.snapshot() if self.kv_tiers is not None else None)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Convenience for tests and scripts: run prompts to completion, return each one's output tokens."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self._arrivals + i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]


def _merge(earlier: StepOutput | None, later: StepOutput) -> StepOutput:
    """One request's outputs of two consecutive iterations of a burst as one: tokens (and logprobs) in order,
    the later one's state."""
    if earlier is None:
        return later
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    later.new_token_ids = earlier.new_token_ids + later.new_token_ids
    later.logprobs = logprobs
    return later
