"""Loading a checkpoint's tokenizer: files, special tokens, EOS ids, encode/decode parity with transformers."""
from __future__ import annotations

import json

import pytest

from hosted.tokenizer import Tokenizer, TokenizerError
from tests.hosted.serving_helpers import TOKENIZER_BUILDERS, write_tokenizer_dir

TEXTS = ["Hello world", "  leading spaces and trailing  ", "Café 你好 😀 👨‍👩‍👧", "def f(x):\n    return x\n",
         "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture(scope="module")
def built():
    return {name: build() for name, build in TOKENIZER_BUILDERS.items()}


def test_missing_tokenizer_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_json_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot be loaded"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("name", sorted(TOKENIZER_BUILDERS))
def test_encode_decode_match_transformers(tmp_path, built, name):
    transformers = pytest.importorskip("transformers")
    d = write_tokenizer_dir(tmp_path, built[name], bos_token="<s>", eos_token="</s>")
    ours = Tokenizer.from_dir(d)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == hf(text, add_special_tokens=add_special)["input_ids"], (name, text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (name, text)


def test_special_tokens_and_eos_ids(tmp_path, built):
    tok = built["sentencepiece_bpe"]
    d = write_tokenizer_dir(tmp_path, tok, bos_token=None, eos_token=None, extra_config={
        # the serialized-AddedToken form older checkpoints use
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "special": True},
        "eos_token": {"content": "</s>", "special": True},
        "pad_token": "<pad>",
    })
    im_end = tok.token_to_id("<|im_end|>")
    eot = tok.token_to_id("<|eot_id|>")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": eot}))
    ours = Tokenizer.from_dir(d)
    assert ours.bos_token == "<s>" and ours.bos_token_id == tok.token_to_id("<s>")
    assert ours.eos_token == "</s>"
    assert ours.eos_token_ids == [im_end, eot, tok.token_to_id("</s>")]
    assert ours.special_tokens["pad_token"] == "<pad>"
    assert tok.token_to_id("<s>") in ours.special_token_ids
    # The post-processor in tokenizer.json adds BOS; a chat template's own BOS is not doubled.
    assert ours.encode("hi")[0] == ours.bos_token_id
    assert ours.encode("<s>hi", add_special_tokens=False).count(ours.bos_token_id) == 1


@pytest.mark.parametrize("name", sorted(TOKENIZER_BUILDERS))
def test_token_bytes_spell_the_text(tmp_path, built, name):
    d = write_tokenizer_dir(tmp_path, built[name])
    ours = Tokenizer.from_dir(d)
    text = "Café naïve 你好 😀 rare ꙮ glyph"
    ids = ours.encode(text, add_special_tokens=False)
    joined = b"".join(ours.token_bytes(i) for i in ids)
    if name == "byte_level_bpe":
        assert joined == text.encode()
    elif name == "wordpiece":
        # WordPiece drops spaces between words ('##' marks continuations) and maps unknown words to <unk>.
        assert joined == ours.decode(ids, skip_special_tokens=False).replace(" ", "").encode()
    else:
        # SentencePiece: '▁' is a space; byte-fallback tokens are single raw bytes.
        assert joined.strip() == text.encode()
    for i in ids:
        assert isinstance(ours.token_text(i), str)
