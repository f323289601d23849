"""Stop-string matching for streamed generation: `StopMatcher` releases text only once it can no longer be
the beginning of a stop string, so a stream never shows text that the final answer truncates."""

from __future__ import annotations

from typing import Sequence


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
