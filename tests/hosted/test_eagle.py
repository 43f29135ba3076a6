"""The feature-level (EAGLE) draft through the whole engine (bundled demo model as the target): greedy output
with `speculative="eagle"` equals greedy output without it, solo, batched, under preemption and with the
planner on; sampled requests keep the target's distribution exactly (the rejection sampler's histogram test
on the eagle proposer's own draws); the planner keeps an eagle draft that costs more than it saves off; the
target's feature capture is off by default and matches the stream of an uncaptured forward."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hosted.config import ModelConfig
from hosted.distill.eagle_run import new_draft
from hosted.engine import EngineConfig, LLMEngine, SamplingParams
from hosted.models import DEMO_MODEL_DIR
from hosted.sequence import Sequence
from hosted.spec import rejection
from hosted.spec.eagle import EagleProposer
from hosted.spec.eagle_checkpoint import load_eagle, save_eagle
from hosted.spec.eagle_model import EagleDraft, EagleShape, feature_layers_for
from hosted.tokenizer import Tokenizer

TEXTS = ["def parse_args(argv):\n    parser = argparse.ArgumentParser()\n",
         "The os module provides a portable way of using", "Return the list of files in the directory",
         "class Config:\n    \"\"\"Settings.\"\"\"\n"]


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_dir(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tok = Tokenizer.from_dir(DEMO_MODEL_DIR)
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, cfg) -> str:
    """An untrained eagle draft started from the demo model's last layer, head over a third of the vocabulary:
    partial acceptance, every path exercised."""
    draft = new_draft(DEMO_MODEL_DIR, cfg, feature_layers_for(cfg.num_hidden_layers),
                      list(range(0, cfg.vocab_size, 3)), seed=0)
    out = tmp_path_factory.mktemp("eagle") / "draft"
    save_eagle(draft, out, "# test\n", {})
    return str(out)


@pytest.fixture(scope="module")
def plain_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, num_kv_blocks=128))


def _engine(eagle_dir: str, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("spec_adaptive", False)
    return LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, speculative="eagle", draft_model_dir=eagle_dir, **kw))


def _greedy(n: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_checkpoint_round_trip_is_int8_and_small(eagle_dir, cfg):
    draft = load_eagle(eagle_dir)
    assert draft.shape.feature_layers == feature_layers_for(cfg.num_hidden_layers)
    size = (Path(eagle_dir) / "model.safetensors").stat().st_size
    params = sum(p.numel() for p in draft.parameters())
    assert size < 1.2 * params  # ~1 byte per weight: int8 storage, no embedding or head in the file


def test_greedy_equals_plain_solo_and_batched(eagle_dir, prompts, plain_engine):
    want = plain_engine.generate(prompts, _greedy())
    engine = _engine(eagle_dir)
    assert engine.generate(prompts[:1], _greedy()) == want[:1]
    assert engine.generate(prompts, _greedy()) == want
    spec = engine.spec
    assert spec.num_proposed > 0 and 0 < spec.num_accepted < spec.num_proposed
    assert engine.runner.model.capture_layers is not None


def test_greedy_equals_plain_under_preemption_and_with_the_planner(eagle_dir, prompts, plain_engine):
    want = plain_engine.generate(prompts, _greedy(60))
    tiny = _engine(eagle_dir, num_kv_blocks=12, block_size=16, max_num_seqs=4)
    assert tiny.generate(prompts, _greedy(60)) == want
    planned = _engine(eagle_dir, spec_adaptive=True)
    assert planned.generate(prompts, _greedy(60)) == want


def test_capture_is_off_by_default_and_reads_the_layer_streams(prompts, plain_engine):
    model = plain_engine.runner.model
    assert model.capture_layers is None
    engine = LLMEngine(EngineConfig(model_dir=DEMO_MODEL_DIR, num_kv_blocks=64))
    m = engine.runner.model
    m.capture_layers = (0, len(m.layers) - 1)
    assert engine.generate(prompts[:1], _greedy(5)) == plain_engine.generate(prompts[:1], _greedy(5))
    assert m.captured is not None and m.captured.shape[1] == 2 * m.config.hidden_size
    assert torch.isfinite(m.captured).all()


def test_sampled_drafts_keep_the_target_distribution(eagle_dir, prompts):
    """The eagle proposer's draws (with the q it reports) through the rejection sampler: the emitted token's
    histogram closes in on the target's (temperature 1, top-k 6) distribution, not on the draft's."""
    engine = _engine(eagle_dir)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=6, ignore_eos=True)
    engine.add_request("a", prompts[1], params)
    engine.step()  # prefill: features of the prompt captured, first token sampled
    spec = engine.spec
    proposer = spec.draft
    assert isinstance(proposer, EagleProposer)
    proposer.ingest()
    seq = engine.scheduler.running[0]
    proposer.propose([seq], [1])
    q = seq.spec_draft_probs[0].clone()
    # The target's own row for the next position (what verification compares against).
    with torch.inference_mode():
        logits, _ = engine.runner.execute(_batch_of(seq))
    row = logits[:1]
    target = rejection.target_probs(row, [params])[0]
    counts = (200, 1600, 12800)
    torch.manual_seed(5)
    h = proposer._states[seq.request_id].cache.last
    seqs = []
    for _ in range(counts[-1]):  # the proposer's own draws, each with the distribution it reports
        token, q_now = proposer._next(h, seq, True)
        assert len(seqs) % 1000 or torch.equal(q_now, q)  # the same distribution every time (h is fixed)
        copy = Sequence(request_id="x", token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
                        params=params, arrival=0)
        copy.spec_token_ids, copy.spec_draft_probs = [token], q[None]
        seqs.append(copy)
    emitted = []
    for i in range(0, len(seqs), 800):
        chunk = seqs[i:i + 800]
        emitted += [out[0] for out in rejection.verify(row.expand(2 * len(chunk), -1).contiguous(), chunk)]
    support = torch.nonzero((target > 0) | (q > 0))[:, 0]
    tv_target, tv_draft = [], []
    for n in counts:
        hist = torch.bincount(torch.tensor(emitted[:n]), minlength=target.shape[0]).double()
        tv_target.append(0.5 * float((hist / n - target.double()).abs().sum()))
        tv_draft.append(0.5 * float((hist / n - q.double()).abs().sum()))
    gap = 0.5 * float((target - q).abs().sum())
    assert gap > 0.1, "the draft must differ from the target for this test to mean anything"
    assert len(support) >= 6
    assert tv_target[-1] < tv_target[0] / 3 and tv_target[-1] < 0.03, tv_target
    assert all(abs(d - gap) < 0.06 for d in tv_draft), (tv_draft, gap)


def _batch_of(seq):
    """A one-sequence batch feeding seq's last token (its position's target row), leaving its KV as it was."""
    from hosted.scheduler import ScheduledBatch

    batch = ScheduledBatch(items=[(seq, 1)])
    batch.num_decodes, batch.num_tokens = 1, 1
    return batch


def test_planner_keeps_a_costly_eagle_draft_off(tmp_path, cfg, prompts, plain_engine):
    """A draft layer with an MLP 24x the target's costs about what the target does per draft token: the planner
    measures that and stops proposing; output stays the target's."""
    shape = EagleShape(cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size * 24, cfg.num_attention_heads,
                       cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta, cfg.rope_scaling,
                       cfg.max_position_embeddings, feature_layers_for(cfg.num_hidden_layers), cfg.vocab_size)
    torch.manual_seed(0)
    draft = EagleDraft(shape)
    save_eagle(draft, tmp_path / "costly", "# costly\n", {})
    engine = _engine(str(tmp_path / "costly"), spec_adaptive=True)
    want = plain_engine.generate(prompts[:1], _greedy(80))
    assert engine.generate(prompts[:1], _greedy(80)) == want
    spec = engine.spec
    before = spec.num_proposed
    assert engine.generate(prompts[:1], _greedy(80)) == want
    assert spec.num_proposed - before <= 80 // 8, "speculation stayed on with a draft as costly as the target"


def test_a_prefix_cache_hit_still_drafts(eagle_dir, prompts, plain_engine):
    """A prompt whose first blocks come from the prefix cache is never fed, so it has no features there: the
    draft's context starts after the cached prefix (it used to stop proposing for good)."""
    prompt = prompts[0] * 3
    want = plain_engine.generate([prompt], _greedy(30))
    engine = _engine(eagle_dir)
    assert engine.generate([prompt], _greedy(30)) == want
    spec = engine.spec
    before = spec.num_proposed
    engine.add_request("again", prompt, _greedy(30))
    engine.step()
    assert engine.runner.captured_items[0][1] > 0, "the second prefill must start after cached blocks"
    while engine.has_unfinished():
        engine.step()
    assert spec.num_proposed - before > 0
    assert engine.generate([prompt], _greedy(30)) == want
