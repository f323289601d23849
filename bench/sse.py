"""Server-sent events: split a byte stream into `data:` payloads and read OpenAI streaming chunks.

Token counting rule (when the server sends no usage): one chunk that carries generated text is one
token. A completions chunk with a choice and no finish_reason counts even when its text is empty (servers
hold back partial UTF-8 or stop-string bytes but still emit one chunk per token); a final chunk counts
only if it carries text. Chat chunks count when `delta.content` is non-empty (the first chunk usually
carries only the role).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


class SSEDecoder:
    """Incremental SSE parser: feed text as it arrives, get back complete event data payloads."""

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []

    def feed(self, text: str) -> list[str]:
        self._buf += text.replace("\r\n", "\n").replace("\r", "\n")
        events: list[str] = []
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            if not line:  # blank line ends an event
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):
                continue  # comment / keep-alive
            elif line.startswith("data"):
                _, _, value = line.partition(":")
                self._data.append(value[1:] if value.startswith(" ") else value)
            # other fields (event:, id:, retry:) carry nothing we need
        return events

    def close(self) -> list[str]:
        """Flush a final event that was not followed by a blank line."""
        events = self.feed("\n\n") if self._buf or self._data else []
        return events


@dataclass(frozen=True)
class Chunk:
    """What one payload means for the measurements."""

    tokens: int = 0  # token-bearing chunks in this payload (0 or 1)
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from usage, when present
    prompt_tokens: int | None = None
    done: bool = False  # the [DONE] sentinel
    error: str | None = None  # an error object inside the stream
    text: str = ""


def interpret(payload: str) -> Chunk:
    """Read one `data:` payload of a /v1/completions or /v1/chat/completions stream."""
    if payload.strip() == DONE:
        return Chunk(done=True)
    try:
        obj: Any = json.loads(payload)
    except json.JSONDecodeError:
        return Chunk(error=f"invalid JSON in stream: {payload[:80]!r}")
    if not isinstance(obj, dict):
        return Chunk(error=f"unexpected stream payload: {payload[:80]!r}")
    if "error" in obj and not obj.get("choices"):
        err = obj["error"]
        return Chunk(error=str(err.get("message", err)) if isinstance(err, dict) else str(err))
    raw_usage = obj.get("usage")
    usage: dict[str, Any] = raw_usage if isinstance(raw_usage, dict) else {}
    completion = usage.get("completion_tokens")
    prompt = usage.get("prompt_tokens")
    tokens, finish, text = 0, None, ""
    choices = obj.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        finish = choice.get("finish_reason")
        if "delta" in choice:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            tokens = 1 if text else 0
        else:
            text = choice.get("text") or ""
            tokens = 1 if (text or finish is None) else 0
    return Chunk(
        tokens=tokens,
        finish_reason=finish,
        completion_tokens=completion if isinstance(completion, int) else None,
        prompt_tokens=prompt if isinstance(prompt, int) else None,
        text=text,
    )
