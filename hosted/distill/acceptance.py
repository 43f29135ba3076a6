"""A draft's acceptance rate on held-out prompts, measured by the engine's own speculative decoding: the
target generates greedily with the draft proposing a fixed K tokens at every step (no adaptive planning, so
every proposal is verified); the rate is accepted / proposed draft tokens. Greedy outputs are the target's own, with or without the draft (checked by the tests)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from hosted.engine import EngineConfig, LLMEngine, SamplingParams


@dataclass(slots=True)
class Acceptance:
    proposed: int
    accepted: int
    output_tokens: int

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "rate": round(self.rate, 4)}


def measure_acceptance(target_dir: str, draft_dir: str, prompts: list[list[int]], max_new_tokens: int, k: int,
                       max_num_seqs: int = 16) -> Acceptance:
    engine = LLMEngine(EngineConfig(model_dir=target_dir, draft_model_dir=draft_dir, num_speculative_tokens=k,
                                    spec_adaptive=False, max_num_seqs=max_num_seqs))
    before = engine.stats()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    after = engine.stats()
    return Acceptance(after.spec_proposed_tokens - before.spec_proposed_tokens,
                      after.spec_accepted_tokens - before.spec_accepted_tokens,
                      sum(len(o) for o in outputs))
