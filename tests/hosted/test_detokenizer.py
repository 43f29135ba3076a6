"""Incremental detokenization is exact for every decoder family, and stop strings never leak."""
from __future__ import annotations

import random

import pytest

from hosted.detokenizer import IncrementalDetokenizer, StopStringMatcher, TextStream
from hosted.tokenizer import Tokenizer
from tests.hosted.serving_helpers import TOKENIZER_BUILDERS, write_tokenizer_dir

REAL_TEXTS = [
    "Hello world, don't panic. It's fine!",
    "你好，世界。😀🎉 family 👨‍👩‍👧 flag 🇫🇷 and ❤️",
    "  def f(x):\n\treturn x ** 2  # café\n",
    "ꙮ rare glyphs 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and combining e\u0301",
    "<|im_start|>assistant\nSure<|im_end|> tail",
]


@pytest.fixture(scope="module", params=sorted(TOKENIZER_BUILDERS))
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    d = write_tokenizer_dir(tmp_path_factory.mktemp(request.param), TOKENIZER_BUILDERS[request.param]())
    return Tokenizer.from_dir(d)


def _stream(tok: Tokenizer, ids: list[int], rng: random.Random, skip: bool = True,
            context: list[int] | None = None) -> tuple[list[str], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, context_ids=context or [])
    pieces, i = [], 0
    while i < len(ids):
        n = rng.choice((1, 1, 1, 2, 3))
        pieces.append(detok.push(ids[i:i + n]))
        i += n
    last = detok.finish()
    return pieces, last, detok


def test_random_ids_stream_exactly(tokenizer):
    """Random ids (specials, byte tokens, '##' pieces, broken UTF-8 included) concatenate to decode(all)."""
    rng = random.Random(1234)
    for trial in range(400):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            pieces, last, detok = _stream(tokenizer, ids, rng, skip)
            assert "".join(pieces) + last == tokenizer.decode(ids, skip_special_tokens=skip), (trial, ids, skip)
            assert detok.exact, (trial, ids)


def test_real_text_never_streams_half_a_character(tokenizer):
    rng = random.Random(7)
    for text in REAL_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer)
        streamed = []
        for t in ids:
            piece = detok.push([t])
            assert "\ufffd" not in piece, (text, piece)
            streamed.append(piece)
        streamed.append(detok.finish())
        assert "".join(streamed) == tokenizer.decode(ids), text
        # Most of the text is streamed before the end: holding back is the exception, not the rule.
        assert len(streamed[-1]) <= max(8, len(text) // 2), (text, streamed[-1])
        pieces, last, _ = _stream(tokenizer, ids, rng)
        assert "".join(pieces) + last == tokenizer.decode(ids)


def test_prompt_context_keeps_the_leading_space(tokenizer):
    prompt = tokenizer.encode("The answer is", add_special_tokens=False)
    full = tokenizer.encode("The answer is forty two 😀", add_special_tokens=False)
    if full[:len(prompt)] != prompt:
        pytest.skip("this tokenizer merges across the prompt boundary")
    out = full[len(prompt):]
    pieces, last, detok = _stream(tokenizer, out, random.Random(3), context=prompt)
    text = "".join(pieces) + last
    assert text == tokenizer.decode(full)[len(tokenizer.decode(prompt)):]
    assert detok.exact
    if tokenizer.decode(out) != text:  # SentencePiece/WordPiece: decoding the output alone loses the space
        assert text.startswith(" ")


def test_random_ids_with_context_stream_exactly(tokenizer):
    rng = random.Random(99)
    for _ in range(200):
        ctx = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 12))]
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        pieces, last, detok = _stream(tokenizer, ids, rng, context=ctx)
        assert detok.exact, (ctx, ids)
        # The context actually used: a few trailing prompt tokens, or none when the prompt ends mid-character.
        window = detok._ids[:detok._num_context]
        expected = tokenizer.decode(window + ids)[len(tokenizer.decode(window)):]
        assert "".join(pieces) + last == expected


# ------------------------------------------------------------------------------------------ stop strings
def _feed(matcher: StopStringMatcher, chunks: list[str]) -> tuple[list[str], str]:
    out = [matcher.push(c) for c in chunks]
    return out, matcher.flush()


def test_stop_string_across_pieces_is_cut_and_nothing_after_is_released():
    m = StopStringMatcher(["STOP"])
    out, tail = _feed(m, ["abc S", "T", "O", "Pdef", "ghi"])
    assert "".join(out) + tail == "abc "
    assert m.matched == "STOP"
    assert out[0] == "abc "  # 'S' was held back: it could begin the stop string


def test_earliest_stop_wins_and_false_starts_are_released():
    m = StopStringMatcher(["world", "lo w"])
    out, _ = _feed(m, ["hel", "lo wor", "ld"])
    assert "".join(out) == "hel" and m.matched == "lo w"
    m = StopStringMatcher(["\n\n"])
    out, tail = _feed(m, ["a\n", "b\n", "c"])
    assert "".join(out) + tail == "a\nb\nc" and m.matched is None


def test_stop_matcher_property():
    rng = random.Random(5)
    alphabet = "ab \n😀"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        m = StopStringMatcher(stops)
        released, seen = [], ""
        for c in chunks:
            released.append(m.push(c))
            seen += c
            # Whatever was released so far contains no stop and is a prefix of the final answer.
            assert not any(s in "".join(released) for s in stops)
        tail = m.flush()
        hits = [text.find(s) for s in stops if s in text]
        expected = text[:min(hits)] if hits else text
        assert "".join(released) + tail == expected, (text, stops, chunks)


def test_text_stream_stops_on_text_spanning_tokens(tokenizer):
    text = "Hello world, don't panic. It's fine!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(ids)
    stop = "panic."
    if stop not in decoded:
        pytest.skip("decoder rewrites the text")
    stream = TextStream(tokenizer, [stop])
    streamed = []
    for t in ids:
        streamed.append(stream.push([t]))
        if stream.stopped:
            break
    streamed.append(stream.finish())
    assert "".join(streamed) == decoded[:decoded.index(stop)]
    assert stream.stopped
    assert stream.push(ids[:3]) == "" and stream.finish() == ""


def test_text_stream_stop_in_final_flush(tokenizer):
    """A stop string completed by text the detokenizer held until the end is still cut."""
    ids = tokenizer.encode("abc 😀", add_special_tokens=False)
    decoded = tokenizer.decode(ids)
    stream = TextStream(tokenizer, [decoded[-1]])
    got = "".join(stream.push([t]) for t in ids) + stream.finish()
    assert got == decoded[:decoded.index(decoded[-1])]
