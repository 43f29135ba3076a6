"""Constrained decoding (hosted/structured.py): with the real SmolLM2 model, every schema's output parses and
validates with `jsonschema`, greedy and sampled, many sequences at once in one engine (each with its own
matcher, next to unconstrained ones); invalid and unsupported schemas are 400s naming the field; a padded lm
head (logits wider than the vocabulary) never yields a padding token; constrained sequences get no drafts."""
from __future__ import annotations

import json

import jsonschema
import pytest

from hosted.async_llm_engine import AsyncLLMEngine
from hosted.engine import EngineConfig, LLMEngine
from hosted.models import SMOLLM2_MODEL
from hosted.request_plan import plan_chat
from hosted.sampling_params import SamplingParams
from hosted.structured import SchemaError, check_schema
from hosted.tokenizer import Tokenizer
from openai_wire import APIError
from openai_wire.engine_requests import EngineChatRequest
from openai_wire.request_errors import parse

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "location": {"type": "object", "properties": {
                                                      "lat": {"type": "number"}, "lon": {"type": "number"}},
                                                      "required": ["lat", "lon"]}},
                 "required": ["name", "location"]}}, "required": ["city"]},
    "enum_bool_null": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}, "nothing": {"type": "null"}},
        "required": ["colour", "ok", "nothing"]},
    "array_bounds": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 3}},
        "required": ["tags"]},
    "any_of": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}, {"type": "null"}]}},
        "required": ["value"]},
    "optional": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                                  "year": {"type": "integer"}, "rating": {"type": "number"}},
                 "required": ["title"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                 "when": {"type": "string", "format": "date"}},
                "required": ["code", "when"]},
    "refs_and_list": {"$defs": {"item": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                                                      "qty": {"type": "integer", "minimum": 1}},
                                         "required": ["sku", "qty"], "additionalProperties": False}},
                      "type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2},
    "one_of_discriminated": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
         "required": ["kind", "lives"]},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind", "good"]}]},
}


@pytest.fixture(scope="module")
def smollm2():
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model_dir=SMOLLM2_MODEL, max_num_seqs=32, kv_cache_gb=0.25)))
    return engine, Tokenizer.from_dir(SMOLLM2_MODEL)


def _plan(engine, tok, body):
    req = parse(EngineChatRequest, {"model": "m", **body})
    return plan_chat(req, tok, engine)


def _schema_body(name, schema, **kw):
    return {"messages": [{"role": "user", "content": f"Give me one example {name.replace('_', ' ')} as JSON."}],
            "max_tokens": 160, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": name, "schema": schema, "strict": True}},
            **kw}


def test_every_schema_validates_greedy_and_sampled_in_one_batch(smollm2):
    engine, tok = smollm2
    prompts, params, schemas = [], [], []
    for name, schema in SCHEMAS.items():
        for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}):
            job = _plan(engine, tok, _schema_body(name, schema, **kw)).jobs[0]
            prompts.append(job.ids)
            params.append(job.params)
            schemas.append(schema)
    # Unconstrained neighbours in the same batch: they pay nothing and are not masked.
    free = _plan(engine, tok, {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12,
                               "temperature": 0}).jobs[0]
    prompts.append(free.ids)
    params.append(free.params)
    outs = engine.engine.generate(prompts, params)
    for out, schema, p in zip(outs[:-1], schemas, params):
        assert out and out[-1] in engine.engine.eos_token_ids + tok.eos_token_ids, (tok.decode(out), "cut short")
        text = tok.decode(out)
        value = json.loads(text)
        jsonschema.validate(value, schema)
    assert engine.engine.stats().kv_blocks_free == engine.engine.stats().kv_blocks_total
    assert tok.decode(outs[-1])  # free text came out


def test_json_object_mode_and_length_cut(smollm2):
    engine, tok = smollm2
    body = {"messages": [{"role": "user", "content": "Reply with a JSON object with the keys name and age of a "
                                                     "cat, nothing else."}], "temperature": 0,
            "response_format": {"type": "json_object"}}
    job = _plan(engine, tok, {**body, "max_tokens": 200}).jobs[0]
    out = engine.engine.generate([job.ids], job.params)[0]
    assert out[-1] in tok.eos_token_ids, tok.decode(out)
    assert isinstance(json.loads(tok.decode(out)), dict)
    short = _plan(engine, tok, {**body, "max_tokens": 4}).jobs[0]
    engine.engine.add_request("short", short.ids, short.params)
    last = None
    while engine.engine.has_unfinished():
        for o in engine.engine.step():
            last = o
    assert last.finish_reason == "length"  # an unfinished JSON is never reported as a complete answer


def test_ignore_eos_still_ends_when_the_grammar_is_complete(smollm2):
    engine, tok = smollm2
    job = _plan(engine, tok, {**_schema_body("person", SCHEMAS["person"], temperature=0), "ignore_eos": True}).jobs[0]
    out = engine.engine.generate([job.ids], job.params)[0]
    jsonschema.validate(json.loads(tok.decode(out)), SCHEMAS["person"])
    assert len(out) < job.params.max_tokens


@pytest.mark.parametrize(("schema", "words"), [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, ["schema.properties.a", "'not'"]),
    ({"type": "array", "uniqueItems": True}, ["uniqueItems"]),
    ({"type": "string", "format": "credit-card"}, ["credit-card"]),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, ["allOf"]),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["oneOf", "overlap"]),
    ({"type": "object", "if": {}, "then": {}}, ["'if'"]),
    ({"type": "wat"}, ["type"]),
    ({"type": "string", "pattern": "(("}, ["pattern", "regular expression"]),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, ["missing"]),
    ({"type": "array", "minItems": 3, "maxItems": 1}, ["minItems"]),
])
def test_unsupported_or_invalid_schemas_are_400_naming_the_field(smollm2, schema, words):
    engine, tok = smollm2
    with pytest.raises(APIError) as err:
        _plan(engine, tok, _schema_body("bad", schema))
    assert err.value.status == 400
    # strict: the param names the keyword's own path below the schema (tests/hosted/test_strict_schema_*.py)
    assert err.value.param.startswith("response_format.json_schema.schema")
    for word in words:
        assert word.lower() in err.value.message.lower(), err.value.message


def test_response_format_shape_errors_name_the_field(smollm2):
    engine, tok = smollm2
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(APIError) as err:
        _plan(engine, tok, {"messages": msgs, "response_format": {"type": "json_schema"}})
    assert err.value.param == "response_format.json_schema"
    with pytest.raises(APIError) as err:
        _plan(engine, tok, {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    assert err.value.param == "response_format.json_schema.schema"
    with pytest.raises(APIError) as err:
        _plan(engine, tok, {"messages": msgs, "response_format": {"type": "yaml"}})
    assert err.value.param and err.value.param.startswith("response_format")


def test_check_schema_accepts_what_pydantic_writes():
    from pydantic import BaseModel

    class Item(BaseModel):
        name: str
        tags: list[str]
        price: float | None = None

    class Order(BaseModel):
        items: list[Item]
        note: str | None

    check_schema(Order.model_json_schema())
    with pytest.raises(SchemaError):
        check_schema({"type": "string", "format": "nope"})


def test_padded_lm_head_and_no_drafts_for_constrained_sequences(tmp_path):
    """A tiny model whose logits are wider than its tokenizer's vocabulary, with n-gram speculation on: the
    padding ids are masked, and constrained sequences are never given drafts (unconstrained ones may be)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.hosted.serving_helpers import byte_level_bpe, chat_templates, write_tokenizer_dir

    hf_tok = byte_level_bpe()
    vocab = hf_tok.get_vocab_size() + 37
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=vocab, max_position_embeddings=512,
                         eos_token_id=hf_tok.token_to_id("<|eot_id|>"))
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # make the padding ids the most likely tokens: only the mask keeps them out
        model.lm_head.weight[hf_tok.get_vocab_size():] = model.lm_head.weight[:37] * 50
    model.save_pretrained(str(tmp_path))
    write_tokenizer_dir(tmp_path, hf_tok, chat_template=chat_templates()["llama3"])
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(model_dir=str(tmp_path), num_kv_blocks=128,
                                                   speculative="ngram", num_speculative_tokens=3)))
    tok = Tokenizer.from_dir(tmp_path)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["ab", "cd"]}},
              "required": ["n", "s"]}
    jobs = [_plan(engine, tok, _schema_body("thing", schema, temperature=t, seed=1, max_tokens=60)).jobs[0]
            for t in (0, 1.0)]
    rep = [5, 6, 7, 8] * 10
    outs = engine.engine.generate([j.ids for j in jobs] + [rep],
                                  [j.params for j in jobs] + [SamplingParams(max_tokens=30, temperature=0)])
    for out in outs[:2]:
        assert all(t < hf_tok.get_vocab_size() for t in out)
        if out[-1] in tok.eos_token_ids:
            jsonschema.validate(json.loads(tok.decode(out)), schema)
    assert max(outs[2]) < vocab
    inner = engine.engine
    assert inner._constrained == 0  # finished constrained sequences are no longer counted: steps skip masks
    inner.add_request("cut", jobs[0].ids, jobs[0].params)
    assert inner._constrained == 1
    inner.step()
    inner.abort_request("cut")
    inner.step()
    assert inner._constrained == 0


def test_tools_parameters_schema_errors_name_the_tool(smollm2):
    engine, tok = smollm2
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {
                 "x": {"type": "string", "format": "nope"}}}}}]
    with pytest.raises(APIError) as err:
        _plan(engine, tok, {"messages": [{"role": "user", "content": "x"}], "tools": tools})
    assert err.value.param == "tools[1].function.parameters" and "nope" in err.value.message
