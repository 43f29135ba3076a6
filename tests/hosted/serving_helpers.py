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

from gateway.listen_address import free_port

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


# ---------------------------------------------------------------------------------------------- servers
def build_tiny_chat_model(directory: Path, *, template: str = "llama3", seed: int = 0,
                          max_position_embeddings: int = 512) -> Path:
    """A random-weight Llama (saved with transformers' save_pretrained) with a byte-level BPE tokenizer and a
    Llama-3 chat template; EOS is <|eot_id|>."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_level_bpe()
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=tok.get_vocab_size(),
                         max_position_embeddings=max_position_embeddings,
                         bos_token_id=tok.token_to_id("<|begin_of_text|>"), eos_token_id=tok.token_to_id("<|eot_id|>"))
    LlamaForCausalLM(config).eval().save_pretrained(str(directory))
    write_tokenizer_dir(directory, tok, chat_template=chat_templates()[template])
    return directory




class EngineProcess:
    """`switchyard engine serve` as a real subprocess on 127.0.0.1; waits for its ready line."""

    def __init__(self, model_dir: Path, *extra_args: str, startup_timeout: float = 120.0) -> None:
        import subprocess
        import sys
        import threading

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "gateway.cli", "engine", "serve", "--model", str(model_dir),
               "--port", str(self.port), "--threads", "1", "--log-level", "warning", *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=str(Path(__file__).resolve().parents[2]))
        self.lines: list[str] = []
        self._ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("switchyard engine ready"):
                    self._ready.set()
            self._ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not self._ready.wait(startup_timeout) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError("engine server did not start:\n" + self.log)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout: float = 30.0) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except Exception:  # noqa: BLE001 - last resort, this process is ours
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Unlabelled and labelled samples of /metrics, keyed as written (e.g. 'x_total{status="success"}')."""
        import httpx

        return parse_metrics(httpx.get(self.base_url + "/metrics", timeout=10).text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {sample key as written (e.g. 'x_total{status="success"}'): value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
