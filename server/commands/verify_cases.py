"""The prompts `bucketserve verify` runs: every length bucket at its boundaries, chunk boundaries, KV-bucket
crossings, several decode batch sizes at once and requests that join while others decode.

Pure Python over a bucket table and a token source (the model's tokenization of a fixed English text, so
the reference and the served model see natural prompts, not random ids).
"""

from __future__ import annotations

from dataclasses import dataclass

from buckets import BucketTable


@dataclass(frozen=True)
class Case:
    name: str  # why the case exists, e.g. "length 64: b+1"
    ids: tuple[int, ...]
    max_tokens: int
    wave: int  # 0: submitted at once at the start; 1: joins once wave 0 is decoding
    logprobs: bool  # ask for logprobs (the sampling graph's path) or not (the argmax path)
    # Tokens that count toward the agreement score: verify's --max-tokens, also for a long generation (whose
    # hundreds of tokens would otherwise outweigh every other case); exactness reads all max_tokens.
    scored: int = 0  # 0: max_tokens

    @property
    def prompt_len(self) -> int:
        return len(self.ids)


def _lengths(table: BucketTable, max_tokens: int) -> list[tuple[str, int, int]]:
    """(reason, prompt length, tokens to generate): 1, b-1, b, b+1 per length bucket; c*m-1, c*m, c*m+1 at chunk
    multiples; a prompt that makes generation cross each KV bucket but the last. Lengths the table does not admit
    are left out, except a KV crossing: where its prompt would be too long (a table without chunked prefill whose
    prompts stop below a KV bucket), the longest admitted prompt generates as many tokens as the crossing needs."""
    # Without chunked prefill the largest length bucket is the longest prompt the table admits.
    longest = table.context_length if table.chunk_length else table.max_length
    limit = min(table.context_length - max_tokens, longest)
    out: list[tuple[str, int, int]] = []
    for b in table.lengths:
        for label, n in (("1", 1), ("b-1", b - 1), ("b", b), ("b+1", b + 1)):
            out.append((f"length {b}: {label}", n, max_tokens))
    c = table.chunk_length
    if c:
        multiples = sorted({2, 3, table.context_length // c})
        for m in multiples:
            for label, n in (("c*m-1", m * c - 1), ("c*m", m * c), ("c*m+1", m * c + 1)):
                out.append((f"chunks of {c}, m={m}: {label}", n, max_tokens))
    for kv in table.kv_lengths[:-1]:
        n = kv - max_tokens // 2
        if n > limit and limit >= 1 and n + max_tokens <= table.context_length:
            # the same prompt + generation as the plain case, so its last step writes the same position
            out.append((f"decode crosses KV {kv} (long generation)", limit, n + max_tokens - limit))
        else:
            out.append((f"decode crosses KV {kv}", n, max_tokens))
    seen: set[int] = set()
    unique = []
    for reason, n, tokens in out:
        if 1 <= n <= limit and (n not in seen or tokens != max_tokens):
            seen.add(n)
            unique.append((reason, n, tokens))
    return unique


def plan_cases(table: BucketTable, tokens: list[int], max_tokens: int, num_prompts: int = 0) -> list[Case]:
    """Cases over `tokens` (cycled): each prompt starts at its own offset so no two share a prefix. Half ask
    for logprobs; about a third join as a second wave. `num_prompts` > 0 keeps the first that many."""
    if not tokens:
        raise ValueError("verify needs a non-empty token source")
    cases = []
    for i, (reason, n, generate) in enumerate(_lengths(table, max_tokens)):
        start = (i * 7919) % len(tokens)
        ids = tuple(tokens[(start + j) % len(tokens)] for j in range(n))
        cases.append(Case(reason, ids, generate, wave=1 if i % 3 == 2 else 0, logprobs=i % 2 == 0,
                          scored=min(generate, max_tokens)))
    return cases[:num_prompts] if num_prompts > 0 else cases
