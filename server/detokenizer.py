"""Incremental detokenization and stop-string matching for streamed generation.

`IncrementalDetokenizer` turns token ids into text one at a time, holding back tokens whose bytes do
not yet form complete UTF-8 characters (byte-level BPE splits multi-byte characters across tokens),
and decodes each token in the context of the few before it so tokenizers that attach spaces to word
starts (SentencePiece "▁word") keep them. `StopMatcher` releases text only once it can no longer be the
beginning of a stop string, so a stream never shows text that the final answer truncates.
"""

from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded with the first generated ones (spacing context)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix = 0  # start of the window decoded for context only
        self._read = len(self._ids)  # tokens before this index have been released as text

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip))

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes (possibly "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""  # an incomplete character (or a skipped special token): wait for more tokens
        delta = full_text[len(prefix_text) :]
        # Slide the window so decoding cost stays constant per token.
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (a dangling partial character decodes
        to U+FFFD, as a full decode would)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        self._ids = self._ids[self._read :]
        self._prefix, self._read = 0, len(self._ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""


class StopMatcher:
    """Finds stop strings in generated text.

    hold_back=True (OpenAI semantics): text that could start a stop string is withheld until
    disambiguated; on a match the output ends right before the stop string.
    hold_back=False (TGI semantics): text flows through unchanged and the output keeps the stop sequence.
    """

    def __init__(self, stops: Sequence[str], hold_back: bool = True) -> None:
        self.stops = [s for s in stops if s]
        self.hold_back = hold_back
        self._longest = max((len(s) for s in self.stops), default=0)
        self._text = ""
        self._sent = 0
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """All text released so far (the final answer once finished)."""
        return self._text[: self._sent]

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add generated text; returns (text safe to release now, whether a stop string matched)."""
        if self.matched is not None:
            return "", True
        self._text += delta
        if not self.stops:
            return self._release(len(self._text)), False
        start = max(0, self._sent - self._longest + 1)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = self._text.find(stop, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is not None:
            self.matched = best[1]
            if self.hold_back:
                end = max(best[0], self._sent)
                out = self._release(end)
                self._text = self._text[:end]
                return out, True
            return self._release(len(self._text)), True
        if not self.hold_back:
            return self._release(len(self._text)), False
        return self._release(len(self._text) - self._partial_suffix()), False

    def flush(self) -> str:
        """Generation ended without a match: release the held-back tail."""
        if self.matched is not None:
            return ""
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        out = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return out

    def _partial_suffix(self) -> int:
        """Length of the longest unreleased suffix that is a proper prefix of some stop string."""
        pending = len(self._text) - self._sent
        for k in range(min(self._longest - 1, pending), 0, -1):
            tail = self._text[-k:]
            if any(stop.startswith(tail) for stop in self.stops):
                return k
        return 0
