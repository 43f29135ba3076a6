"""Builders for the tiny tokenizers and checkpoints the tokenizer, detokenizer and server tests use.

Every tokenizer is trained here with the `tokenizers` library on a small mixed text (English, code, accents,
CJK, emoji), so the tests need no download and cover the three decoder families real models use:
byte-level BPE (GPT-2 / Llama 3 / Qwen), SentencePiece-style with byte fallback (Llama 2 / Mistral), and
WordPiece (BERT).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

CHAT_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<unk>", "<pad>",
]

_BASE_LINES = [
    "The quick brown fox jumps over the lazy dog. Don't panic; it's only a test!",
    "def add(a, b):\n    return a + b  # simple function\n",
    "Café naïve résumé coöperate — “quotes” and ‘apostrophes’ … ellipsis",
    "你好，世界。今天天气很好。我们一起去公园散步吧。",
    "日本語のテキストも少し。カタカナとひらがな。",
    "한국어 문장도 조금 있습니다.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 ❤️ 🚀✨ and the family 👨‍👩‍👧",
    "Numbers 0123456789, symbols @#$%^&*()[]{}<>|\\/~`",
    "In the beginning the engine streamed tokens; the server listened and answered.",
    "Once upon a time, a small model learned to talk about cats, dogs and tokens.",
]


def training_corpus(repeat: int = 30) -> list[str]:
    lines = []
    for i in range(repeat):
        for j, line in enumerate(_BASE_LINES):
            lines.append(f"{line} #{(i * 7 + j) % 13}")
    return lines


def byte_level_bpe(vocab_size: int = 400) -> Tokenizer:
    """GPT-2 / Llama-3 / Qwen style: byte-level pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def sentencepiece_bpe_byte_fallback(vocab_size: int = 400) -> Tokenizer:
    """Llama-2 / Mistral style: BPE over '▁'-marked text, byte fallback for unknown characters, BOS added."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIAL_TOKENS, show_progress=False,
                                  limit_alphabet=60)
    base.train_from_iterator(training_corpus(), trainer)
    model = json.loads(base.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(CHAT_SPECIAL_TOKENS)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return tok


def unigram_metaspace(vocab_size: int = 400) -> Tokenizer:
    """T5 / ALBERT style: Unigram with the Metaspace pre-tokenizer and decoder, plus byte fallback."""
    base = Tokenizer(models.Unigram())
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIAL_TOKENS,
                                      unk_token="<unk>", show_progress=False)
    base.train_from_iterator(training_corpus(), trainer)
    model = json.loads(base.to_str())["model"]
    vocab = [(piece, float(score)) for piece, score in model["vocab"]]
    present = {piece for piece, _ in vocab}
    vocab += [(f"<0x{b:02X}>", -30.0) for b in range(256) if f"<0x{b:02X}>" not in present]
    unk_id = [p for p, _ in vocab].index("<unk>")
    tok = Tokenizer(models.Unigram(vocab, unk_id=unk_id, byte_fallback=True))
    tok.add_special_tokens(CHAT_SPECIAL_TOKENS)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="always"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    return tok


def wordpiece(vocab_size: int = 400) -> Tokenizer:
    """BERT style: WordPiece with '##' continuations and cleanup."""
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIAL_TOKENS,
                                        show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer)
    return tok


TOKENIZER_BUILDERS = {
    "byte_level_bpe": byte_level_bpe,
    "sentencepiece_bpe": sentencepiece_bpe_byte_fallback,
    "unigram_metaspace": unigram_metaspace,
    "wordpiece": wordpiece,
}


def write_tokenizer_dir(directory: Path, tok: Tokenizer, *, chat_template: str | None = None,
                        bos_token: str | None = "<|begin_of_text|>", eos_token: str | None = "<|eot_id|>",
                        extra_config: dict | None = None) -> Path:
    """Write tokenizer.json and a transformers-loadable tokenizer_config.json into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                    "model_max_length": 4096}
    if bos_token is not None:
        config["bos_token"] = bos_token
    if eos_token is not None:
        config["eos_token"] = eos_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    config.update(extra_config or {})
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    return directory


def chat_templates() -> dict[str, str]:
    """Real models' chat templates (copied from their tokenizer_config.json files), keyed by model."""
    return json.loads((Path(__file__).parent / "chat_templates.json").read_text(encoding="utf-8"))
