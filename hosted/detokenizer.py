"""Incremental, exact detokenization and stop-string handling for streamed output.

`IncrementalDetokenizer` turns a growing list of token ids into text pieces whose concatenation is exactly
`tokenizer.decode(all_ids)` (skip_special_tokens as configured), whatever the tokenizer's decoder:

* Each step decodes a short window of recent tokens twice — up to the last emitted token and up to the
  newest — and emits the difference. Decoders only act locally (strip a leading space from the first token,
  drop a '##' continuation mark, merge bytes), and both decodes start at the same token, so these effects
  cancel out.
* Text is held back while the window decodes to something ending in U+FFFD (half a UTF-8 character from a
  byte-level vocabulary), and while the newest token is a byte-fallback token (<0xXX>): a run of them is
  decoded as one byte string, and one bad byte later turns the whole run into U+FFFDs.
* Special tokens are dropped before anything else when skipping them, so they never split a window.
* `finish()` decodes the whole output once and returns what was not emitted yet: the final text is exact
  even if a decoder ever breaks the locality assumption mid-stream (`exact` reports whether the streamed
  prefix agreed).

`StopStringMatcher` finds stop strings across piece boundaries: it holds back the longest tail that could
still begin a stop string, and on a match returns the text before it and nothing after.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from hosted.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 context_ids: Sequence[int] = (), context_tokens: int = 6) -> None:
        """`context_ids` (e.g. the prompt) are decoded only as left context, so the output keeps a leading
        space that a SentencePiece decoder would strip from a first token; the output text is then
        decode(context_tail + output) minus decode(context_tail)."""
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._special = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._byte_tokens = tokenizer.byte_fallback_ids
        full_ctx = [t for t in context_ids if t not in self._special]
        # Keep a few tokens of left context, not starting inside a run of byte tokens or a UTF-8 character.
        start = max(0, len(full_ctx) - context_tokens) if context_tokens > 0 else len(full_ctx)
        while 0 < start < len(full_ctx) and len(full_ctx) - start < 4 * context_tokens and (
                full_ctx[start] in self._byte_tokens or self._decode(full_ctx[start:]).startswith(_REPLACEMENT)):
            start -= 1
        self._ids: list[int] = full_ctx[start:]
        if self._ids and (self._ids[-1] in self._byte_tokens or self._decode(self._ids).endswith(_REPLACEMENT)):
            # The context ends inside a character: output bytes would merge into it. Decode the output alone.
            self._ids = []
        self._num_context = len(self._ids)
        self._context_text = self._decode(self._ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._pieces: list[str] = []
        self._num_output_ids = 0
        self.exact = True
        self.finished = False

    def _decode(self, ids: Sequence[int]) -> str:
        # Special tokens were filtered out already; decoding with skip=False keeps added non-special tokens.
        return self._tok.decode(ids, skip_special_tokens=False)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    @property
    def output_ids(self) -> list[int]:
        """The output ids kept for decoding (special tokens removed when skipping them)."""
        return self._ids[self._num_context:]

    def push(self, token_ids: Iterable[int]) -> str:
        """Add new tokens; return the text they settle (possibly empty)."""
        added = False
        for t in token_ids:
            if t not in self._special:
                self._ids.append(t)
                added = True
        if not added or self._ids[-1] in self._byte_tokens:
            return ""
        ids = self._ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(ids[self._prefix_offset:])
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT) \
                or not window_text.startswith(prefix_text):
            return ""
        piece = window_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._pieces.append(piece)
        return piece

    def finish(self) -> str:
        """Return the text not yet emitted, computed from one decode of the whole output."""
        if self.finished:
            return ""
        self.finished = True
        full = self._decode(self._ids)
        if self._num_context:
            if full.startswith(self._context_text):
                full = full[len(self._context_text):]
            else:  # the output changed how the context itself decodes; keep the output's own decode
                self.exact = False
                full = self._decode(self._ids[self._num_context:])
        emitted = self.text
        if not full.startswith(emitted):
            self.exact = False
            return ""
        rest = full[len(emitted):]
        if rest:
            self._pieces.append(rest)
        return rest


class StopStringMatcher:
    """Cut a text stream before the first occurrence of any stop string, never releasing text past it."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self._pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Add text; return what is safe to release. After a match, returns the text before the stop string
        and then nothing more."""
        if self.matched is not None:
            return ""
        if not self.stop:
            return text
        pending = self._pending + text
        first, which = -1, None
        for s in self.stop:
            i = pending.find(s)
            if i != -1 and (first == -1 or i < first):
                first, which = i, s
        if which is not None:
            self.matched = which
            self._pending = ""
            return pending[:first]
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(pending)), hold, -1):
                if pending.endswith(s[:k]):
                    hold = k
                    break
        release = pending[:len(pending) - hold]
        self._pending = pending[len(release):]
        return release

    def flush(self) -> str:
        """End of stream: the held tail cannot start a stop string any more."""
        out, self._pending = self._pending, ""
        return "" if self.matched is not None else out


class TextStream:
    """One generated sequence's text: incremental detokenization followed by stop-string cutting."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), *, skip_special_tokens: bool = True,
                 context_ids: Sequence[int] = ()) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens,
                                                  context_ids=context_ids)
        self.matcher = StopStringMatcher(stop)
        self._out: list[str] = []

    @property
    def stopped(self) -> bool:
        """A stop string was found: the caller should end the request."""
        return self.matcher.matched is not None

    @property
    def text(self) -> str:
        return "".join(self._out)

    def push(self, token_ids: Iterable[int]) -> str:
        if self.stopped:
            return ""
        piece = self.matcher.push(self.detokenizer.push(token_ids))
        if piece:
            self._out.append(piece)
        return piece

    def finish(self) -> str:
        """End of the sequence (any reason): release everything left, still cut at a stop string."""
        if self.stopped:
            return ""
        piece = self.matcher.push(self.detokenizer.finish())
        if not self.stopped:
            piece += self.matcher.flush()
        if piece:
            self._out.append(piece)
        return piece
