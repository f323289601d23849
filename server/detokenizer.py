"""Incremental detokenization: token ids to text one at a time, for streaming and non-streaming alike.

Both detokenizers hold back tokens whose bytes do not yet form complete UTF-8 characters (byte-level BPE
splits multi-byte characters across tokens) and decode each token in the context of the few before it, so
tokenizers that attach spaces to word starts (SentencePiece "▁word") keep them. Fast tokenizers use the
`tokenizers` library's own `DecodeStream` (as vLLM does); `IncrementalDetokenizer`, written here, is the
fallback for slow (pure Python) tokenizers and for tokenizers that post-process decoded text.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

log = logging.getLogger("bucketserve.http")

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded with the first generated ones (spacing context)


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes (possibly "")."""

    def flush(self) -> str:
        """At the end of generation: whatever is still held back."""


def incremental_detokenizer(tokenizer: Any, prompt_ids: Sequence[int] = (),
                            skip_special_tokens: bool = True) -> Detokenizer:
    """`DecodeStream` over the Rust tokenizer when there is one and decoding is plain; else the fallback."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return StreamDetokenizer(backend, prompt_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)


class StreamDetokenizer:
    """`tokenizers.decoders.DecodeStream`, primed with the end of the prompt. DecodeStream never releases a
    dangling partial character; `flush` decodes it (as U+FFFD, like a full decode) from the ids it kept back."""

    def __init__(self, backend: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._context = _clean_suffix(backend, list(prompt_ids), skip_special_tokens)
        self._pending: list[int] = []  # ids since the last released text
        self._stream = self._primed()

    def _primed(self) -> DecodeStream:
        stream = DecodeStream(skip_special_tokens=self._skip)
        for token_id in self._context:
            stream.step(self._backend, token_id)
        return stream

    def add(self, token_id: int) -> str:
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - DecodeStream refuses a non-monotonic decode ("Invalid prefix")
            log.warning("DecodeStream lost its place; restarting it from the last released tokens")
            self._stream = self._primed()
            held = [self._stream.step(self._backend, t) for t in self._pending]
            text = "".join(h for h in held if h) + (self._stream.step(self._backend, token_id) or "")
        self._pending.append(token_id)
        if not text:
            return ""
        self._context = (self._context + self._pending)[-CONTEXT_TOKENS:]
        self._pending = []
        return str(text)

    def flush(self) -> str:
        if not self._pending:
            return ""
        prefix = self._backend.decode(self._context, skip_special_tokens=self._skip)
        full = self._backend.decode(self._context + self._pending, skip_special_tokens=self._skip)
        self._context, self._pending = (self._context + self._pending)[-CONTEXT_TOKENS:], []
        return full[len(prefix):] if len(full) > len(prefix) else ""


def _clean_suffix(backend: Tokenizer, prompt_ids: list[int], skip: bool) -> list[int]:
    """The last few prompt ids, cut so that they decode to whole characters: a prompt ending inside a
    character would otherwise leak its partial bytes into the first generated text."""
    for n in range(min(CONTEXT_TOKENS, len(prompt_ids)), 0, -1):
        suffix = prompt_ids[-n:]
        if REPLACEMENT not in backend.decode(suffix, skip_special_tokens=skip):
            return suffix
    return []


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
