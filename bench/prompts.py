"""Prompts of an exact token length, cut from the bundled English corpus with the target's own tokenizer.

The tokenizer is the server's `/tokenize` endpoint when it has one (bucketserve: {"prompt"}; llama.cpp:
{"content"}), else a local tokenizer directory (transformers, imported lazily: the bench itself never
loads torch). A prompt keeps both its text and its ids: ids go to servers that accept token-id prompts
(exact length), the text to those that only take strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from bench.workload import FilePrompt, RequestPlan

CORPUS_PATH = Path(__file__).with_name("corpus.txt")


class TokenizerError(RuntimeError):
    """No usable tokenizer, or the tokenizer answered something unexpected."""


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]: ...


class ServerTokenizer:
    """POST {base}/tokenize. Tries the bucketserve body first, then llama.cpp's."""

    _BODIES = ("prompt", "content")

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout: float = 30.0) -> None:
        self.name = f"{base_url}/tokenize"
        self._url = base_url.rstrip("/") + "/tokenize"
        self._client = httpx.Client(timeout=timeout, headers=headers or {})
        self._key: str | None = None

    def encode(self, text: str) -> list[int]:
        keys = (self._key,) if self._key else self._BODIES
        last = "no attempt"
        for key in keys:
            try:
                resp = self._client.post(self._url, json={key: text})
            except httpx.HTTPError as exc:
                raise TokenizerError(f"{self._url}: {exc!r}") from exc
            tokens = _tokens_from(resp)
            if tokens is not None:
                self._key = key
                return tokens
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        raise TokenizerError(f"{self._url} did not tokenize ({last})")

    def close(self) -> None:
        self._client.close()


def _tokens_from(resp: httpx.Response) -> list[int] | None:
    if resp.status_code != 200:
        return None
    try:
        data: Any = resp.json()
    except ValueError:
        return None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list):
        return None
    # llama.cpp may return {"id": .., "piece": ..} objects when asked for pieces; we never ask.
    return [int(t["id"]) if isinstance(t, dict) else int(t) for t in tokens]


def probe_server_tokenizer(base_url: str, headers: dict[str, str] | None = None) -> ServerTokenizer | None:
    """The server's tokenizer, or None when it has no /tokenize endpoint (or is unreachable)."""
    tok = ServerTokenizer(base_url, headers)
    try:
        if tok.encode("Hello there, world."):
            return tok
    except TokenizerError:
        pass
    tok.close()
    return None


class LocalTokenizer:
    """A transformers tokenizer from a directory, or from a GGUF file (its embedded vocabulary)."""

    def __init__(self, path: str) -> None:
        self.name = path
        try:
            from transformers import AutoTokenizer  # lazy: heavy, and only needed without /tokenize
        except ImportError as exc:  # pragma: no cover - transformers is installed with the project
            raise TokenizerError(f"--tokenizer {path} needs the transformers package") from exc
        p = Path(path)
        if p.suffix == ".gguf":
            self._tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        else:
            self._tok = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])


class CachingTokenizer:
    """Memoises encode(): the exact-length search asks for the same prefixes for equal lengths."""

    def __init__(self, inner: Tokenizer) -> None:
        self.name = inner.name
        self._inner = inner
        self._cache: dict[str, list[int]] = {}
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        hit = self._cache.get(text)
        if hit is None:
            self.calls += 1
            hit = self._cache[text] = self._inner.encode(text)
        return hit


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    ids: tuple[int, ...]  # exactly the planned length (cut when the text ran one token over)
    output_len: int
    text_tokens: int  # tokens in `text` itself; equals len(ids) unless no prefix hit the length exactly


def load_corpus(path: str | Path = CORPUS_PATH) -> str:
    """The corpus as one line of single-spaced prose (paragraph breaks would vary token counts)."""
    text = " ".join(Path(path).read_text().split())
    if not text:
        raise TokenizerError(f"corpus {path} is empty")
    return text


def rotate(corpus: str, offset: int) -> str:
    """The corpus starting at the first word boundary at or after `offset`, wrapping around."""
    start = corpus.find(" ", offset % len(corpus)) + 1 if offset else 0
    return corpus[start:] + " " + corpus[:start] if start else corpus


def exact_prompt(tok: Tokenizer, source: str, n: int) -> tuple[str, list[int]]:
    """Longest character prefix of `source` (repeated as needed) with exactly `n` tokens, and its ids.

    The longest such prefix ends on a whole word rather than a one-letter fragment. When no prefix has
    exactly `n` tokens (the count jumps over it), the shortest one with more is returned and the caller
    cuts the ids to `n`. Binary search over the prefix length costs about log2(6n) tokenize calls.
    """
    if n < 1:
        raise TokenizerError(f"prompt length must be positive, got {n}")
    chars = max(64, 6 * n)
    while True:
        window = (source + " ") * (chars // (len(source) + 1) + 1)
        window = window[:chars]
        if len(tok.encode(window)) > n:
            break
        if chars > 64 * n + 10_000:
            raise TokenizerError(f"{tok.name}: cannot reach {n} tokens from the corpus")
        chars *= 2
    lo, hi = 0, len(window)  # invariant: count(window[:lo]) <= n < count(window[:hi])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(tok.encode(window[:mid])) <= n:
            lo = mid
        else:
            hi = mid
    text = window[:lo]
    ids = tok.encode(text) if lo else []
    if len(ids) != n:
        text = window[:hi]
        ids = tok.encode(text)
    return text, ids


def build_prompts(
    plans: list[RequestPlan],
    tok: Tokenizer,
    corpus: str,
    file_prompts: list[FilePrompt] | None = None,
    max_prompt_len: int = 1 << 30,
) -> list[Prompt]:
    out: list[Prompt] = []
    for plan in plans:
        if plan.source >= 0 and file_prompts:
            text = file_prompts[plan.source].text
            ids = tok.encode(text)
            if len(ids) > max_prompt_len:
                text, ids = exact_prompt(tok, text, max_prompt_len)
            target = min(len(ids), max_prompt_len)
        else:
            text, ids = exact_prompt(tok, rotate(corpus, plan.offset), plan.prompt_len)
            target = plan.prompt_len
        out.append(Prompt(plan.index, text, tuple(ids[:target]), plan.output_len, len(ids)))
    return out
