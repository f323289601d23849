"""Continuous batching over static slots: a pure-Python scheduler with a two-call contract.

    step = scheduler.schedule()          # a PrefillStep, a DecodeStep, or None when idle
    ... the engine runs the graph for `step` and samples one token per sequence ...
    finished = scheduler.update(step, {request_id: token_id})

Policy: first come, first served. A waiting request is prefilled (padded to its length bucket, together with
later waiting requests of the same bucket when prefill batch buckets allow) into the lowest free slots, then
joins the running decode batch at the next step. Prefill and decode alternate while both have work, so neither
starves. A decode step runs the smallest batch bucket that covers the highest busy slot (slots are handed out
lowest first to keep that bucket small) and the smallest KV-length bucket that covers the longest live row.

Chunked prefill (when the table has it): a prompt longer than the chunk length takes a slot and is prefilled
one chunk per step, its first chunk by a PrefillStep and the rest by ChunkSteps; between two of its chunks a
decode step runs whenever any row is decoding, so a decode row never waits for more than one chunk. The
chunking request is older than anything waiting, so it goes first (FCFS); it can be aborted between chunks.
In a mixed step, though, a waiting prompt that fits whole in half the step's prompt budget starts beside a prompt
mid-chunk that would take all of it (docs/performance.md, session 47). Prompts still start in arrival order.
Finished or aborted sequences free their slot at once.

Prefix caching (`prefix_caching`, mixed steps only): a freed slot keeps its K/V, and a new prompt that begins
with the tokens a free slot holds, or a running request has computed, starts its prefill where the match ends,
by mixed steps (a prefill step starts at position 0); buckets/prefix_cache.py has the policy.

Speculative decoding (`speculative_tokens`, mixed steps only): a decoding row that speculates carries draft tokens
(buckets/speculation.py) after its last token, in a mixed step (a decode step computes one token a row), and
`update` then takes each row's list of tokens, which the engine verified. Beside prompts, the drafts take only
what the prompts that can start leave of the step's budget, and a row carries a draft only where its chance of being
accepted pays for what a token costs at the step's size (buckets/draft_cost.py, from the step times the engine
reports through `observe`; each row's chance from its own verify results and, while it drafts nothing, from whether
its draft would have held).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import islice

from buckets.draft_cost import DraftCost
from buckets.errors import QueueFullError
from buckets.prefix_cache import SlotPrefixes
from buckets.speculation import step_drafts
from buckets.step_sizing import solo_prompt, trimmed
from buckets.steps import ChunkStep, DecodeStep, MixedStep, Piece, PrefillStep, Sequence, Step
from buckets.table import BucketTable
from buckets.waiting_queue import WaitingQueue

__all__ = ["ChunkStep", "DecodeStep", "MixedStep", "Piece", "PrefillStep", "QueueFullError", "Scheduler", "Sequence",
           "Step", "WAITING_SERVED_RATIO"]

WAITING_SERVED_RATIO = 1.0  # on: see Scheduler.waiting_served_ratio and docs/performance.md (session 46)


@dataclass
class Scheduler:
    table: BucketTable
    max_waiting_requests: int = 64
    max_waiting_tokens: int = 65536
    policy: str = "continuous"  # "static": run-to-completion batches (what many static-shape servers do)
    # Mixed steps: when the prompts that could start now (free slots permitting) plus a prompt mid-chunk number at
    # least this many times the decoding rows, a step carries up to the solo budget instead of the mixed budget:
    # a round of arrivals is taken together (as vLLM's are) and the clients stay in step. 1 (the default): as many
    # waiting as decoding; 0: off (the mixed budget whenever a row decodes); 0.05: nearly always (vLLM's one
    # budget); docs/performance.md has the measurements. Named after TGI's setting (there it gates a prefill batch).
    waiting_served_ratio: float = WAITING_SERVED_RATIO
    prefix_caching: bool = False
    speculative_tokens: int = 0  # the most drafts a row carries (0: off); the table's draft_rows bound a step's
    # whether drafts pay for their cost at a step's size, from the step times the engine reports (`observe`)
    draft_cost: DraftCost = field(default_factory=DraftCost)
    waiting: WaitingQueue = field(init=False)
    running: dict[int, Sequence] = field(default_factory=dict)  # slot -> sequence
    _last_was_prefill: bool = False
    _prefixes: SlotPrefixes | None = None

    def __post_init__(self) -> None:
        self.waiting = WaitingQueue(self.max_waiting_requests, self.max_waiting_tokens)
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {self.policy!r}")
        if not 0 <= self.waiting_served_ratio < float("inf"):  # NaN too
            raise ValueError(f"waiting_served_ratio must be finite and >= 0 (0: off), got {self.waiting_served_ratio}")
        if self.policy == "static" and self.table.mixed_tokens:
            raise ValueError("static batching runs no mixed steps: its table needs chunk graphs, not mixed tokens")
        if self.prefix_caching:
            if not self.table.mixed_tokens or self.policy != "continuous":
                raise ValueError("prefix caching needs mixed steps (continuous batching and a table with mixed "
                                 "tokens): a cached prompt's prefill starts where its match ends")
            self._prefixes = SlotPrefixes(self.table.context_length)
        if self.speculative_tokens < 0 or (self.speculative_tokens and not self.table.draft_rows):
            raise ValueError("speculative decoding needs verify graphs (a table with mixed tokens and draft_rows); "
                             f"speculative_tokens must be >= 0, got {self.speculative_tokens}")

    # -- admission -----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a request (raises QueueFullError or PromptTooLongError; never drops silently)."""
        self.add_many([seq])

    def add_many(self, seqs: list[Sequence]) -> None:
        """Queue several requests (the n choices of one request) together or none of them. Every size check
        comes first: a request that can never fit is refused as such (400), whatever the queue holds (429)."""
        for seq in seqs:
            seq.bucket = self.table.check_request(seq.prompt_len, seq.max_tokens)
            if seq.prompt_ids and len(seq.prompt_ids) != seq.prompt_len:
                raise ValueError(f"{len(seq.prompt_ids)} prompt ids for a prompt of {seq.prompt_len} tokens")
        self.waiting.admit(seqs)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a waiting or running request; its slot is free for the next step."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                return seq
        for seq in self.running.values():
            if seq.request_id == request_id:
                self._release(seq)
                seq.finish_reason = "abort"
                return seq
        return None

    # -- the two calls ---------------------------------------------------------------------------
    def schedule(self) -> Step | None:
        free = self.free_slots()
        chunking = min((s for s in self.running.values() if not s.is_decoding), key=lambda s: s.slot, default=None)
        decoding = {slot: s for slot, s in self.running.items() if s.is_decoding}
        want_prefill = chunking is not None or (bool(self.waiting) and bool(free))
        if want_prefill and self.table.mixed_tokens and self.policy == "continuous" \
                and (chunking is not None or bool(decoding) or self._solo_prompt(free) or self._head_hits(free)):
            return self._mixed(decoding, chunking, free)
        if self.policy == "static":
            # A batch forms (consecutive prefills) only while nothing decodes, then runs to completion.
            want_prefill = want_prefill and (not decoding or self._last_was_prefill)
        elif want_prefill and self._last_was_prefill and decoding:
            want_prefill = False  # a decode step between any two prefill steps: decode never starves
        if want_prefill:
            self._last_was_prefill = True
            return self._chunk(chunking) if chunking is not None else self._prefill(free)
        self._last_was_prefill = False
        if decoding:
            decode = tuple(decoding[s] for s in sorted(decoding))
            drafts = step_drafts(decode, self.speculative_tokens, self.table, fill=True,
                                 threshold=self.draft_cost.threshold(len(decode)))
            if drafts:  # a verify step: every decoding row, the drafts after their last token
                rows = len(decode) + sum(map(len, drafts))
                return MixedStep(self.table.verify_for(rows), decode, (), drafts=drafts)
            batch = self.table.batch_for(max(decoding) + 1)
            kv = self.table.kv_for(max(seq.position for seq in decoding.values()) + 1)
            parked = tuple((slot, s.prefilled) for slot, s in sorted(self.running.items())
                           if slot < batch and not s.is_decoding)
            if self._prefixes is not None:  # the step computes its free rows at position 0 of their slots
                for slot in range(batch):
                    if slot not in self.running:
                        self._prefixes.forget(slot)
            return DecodeStep(batch, kv, decode, parked)
        return None

    def update(self, step: Step, sampled: Mapping[str, int | list[int]]) -> list[Sequence]:
        """Record each sequence's new token (a verify step's row: its tokens, in order, of which those after a stop
        or the length limit are dropped); returns the sequences that finished (slots freed)."""
        finished: list[Sequence] = []
        drafts = {id(q): d for q, d in zip(step.decode, step.drafts)} if isinstance(step, MixedStep) else {}
        for seq in step.seqs:
            if seq.finish_reason is not None:
                continue  # aborted while the step ran
            prefilled = step.prefilled(seq)  # None: the step decoded seq
            if prefilled is not None:
                seq.prefilled, seq.num_chunks = prefilled, seq.num_chunks + 1
            if not seq.is_decoding or seq.request_id not in sampled:
                continue  # a chunk that does not end the prompt yields no token
            tokens = sampled[seq.request_id]
            drafted = drafts.get(id(seq), ())
            if seq.ngrams is not None and self.speculative_tokens:
                if drafted and isinstance(tokens, list):
                    seq.ngrams.verified(len(drafted), len(tokens) - 1, self.speculative_tokens)
                elif not drafted and prefilled is None:  # a decoding row without drafts: would its draft have held?
                    seq.ngrams.observe(tokens[0] if isinstance(tokens, list) else tokens)
            for token in tokens if isinstance(tokens, list) else (tokens,):
                if seq.advance(token, self.table.context_length):
                    self._release(seq)
                    finished.append(seq)
                    break
        return finished

    def observe(self, step: Step, seconds: float) -> None:
        """The engine ran `step` (graph and sampling) in `seconds`: what `draft_cost` fits its line to."""
        self.draft_cost.observe(step, seconds)

    # -- state ------------------------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return [s for s in range(self.table.max_batch) if s not in self.running]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_decoding(self) -> int:
        """Running rows past their prefill (a prefill or chunk step makes them wait)."""
        return sum(1 for seq in self.running.values() if seq.is_decoding)

    @property
    def waiting_tokens(self) -> int:
        return self.waiting.tokens

    def _prefill(self, free: list[int]) -> PrefillStep:
        head = self.waiting[0]
        room = min(len(free), self.table.prefill_batch_sizes[-1])
        if head.bucket > self.table.max_length:  # a chunked prompt: its first chunk runs alone
            room = 1
        group = [s for s in self.waiting if s.bucket == head.bucket][:room]
        for seq in group:
            slot, _, _ = self._place(seq.prompt_ids, free)  # a prefill starts at position 0 whatever matches
            self.waiting.remove(seq)
            self._take(seq, slot)
        length = min(head.bucket, self.table.max_length)
        return PrefillStep(length, self.table.prefill_batch_for(len(group)), tuple(group))

    def _solo_prompt(self, free: list[int]) -> bool:
        """Nothing decodes and the next prompt starts by mixed steps rather than a prefill (step_sizing)."""
        return bool(free and self.waiting) and solo_prompt(self.table, self.waiting[0].prompt_len)

    def _mixed(self, decoding: dict[int, Sequence], chunking: Sequence | None, free: list[int]) -> MixedStep:
        decode = tuple(decoding[s] for s in sorted(decoding))
        startable = min(len(self.waiting), len(free)) + (chunking is not None)
        # The solo budget when no decoding row waits on the step, or when the waiting outnumber the decoding.
        ratio = self.waiting_served_ratio
        big = not decode or (ratio > 0 and startable >= ratio * len(decode))
        total = self.table.solo_budget if big else self.table.mixed_budget
        prompt = (chunking.prompt_len - chunking.prefilled if chunking is not None else 0) \
            + sum(seq.prompt_len for seq in islice(self.waiting, len(free)))  # what can start: free slots
        # Drafts (verify graphs: up to the mixed budget) take what the prompts leave of it: in a full step a draft
        # costs what a prompt token does, and a rejected one is work no request needed (prompt first).
        room = 0 if big else max(0, total - len(decode) - prompt)
        drafts = step_drafts(decode, self.speculative_tokens, self.table, room=room,  # beside the step's other tokens
                             threshold=self.draft_cost.threshold(total - room)) if room else ()
        rows = len(decode) + sum(map(len, drafts))  # the decoding rows' tokens
        total = trimmed(self.table, min(total, rows + prompt), rows)
        budget = total - rows
        pieces: list[Piece] = []
        copies: list[tuple[int, int, int]] = []
        if chunking is not None:
            # Waiting prompts that fit whole in half the budget start beside a long prompt mid-chunk rather than
            # behind it (it keeps at least half, so it is at most 2x slower to finish).
            if chunking.prompt_len - chunking.prefilled > budget:
                short = budget // 2
                while self.waiting and free and self.waiting[0].prompt_len <= short:
                    n = self._admit(free, copies, pieces, short)
                    short, budget = short - n, budget - n
            n = min(budget, chunking.prompt_len - chunking.prefilled)
            pieces.append(Piece(chunking, chunking.prefilled, n))
            budget -= n
        while budget > 0 and self.waiting and free:
            budget -= self._admit(free, copies, pieces, budget)
        self._last_was_prefill = False  # decoding rows advanced in this step too
        bucket = self.table.verify_for(total - budget) if drafts else self.table.mixed_for(total - budget)
        return MixedStep(bucket, decode, tuple(pieces), tuple(copies), drafts)

    def _admit(self, free: list[int], copies: list[tuple[int, int, int]], pieces: list[Piece], budget: int) -> int:
        """The head of the queue starts in a free slot with up to `budget` of its prompt tokens; returns how many."""
        seq = self.waiting.popleft()
        slot, source, reuse = self._place(seq.prompt_ids, free)
        if source not in (-1, slot):
            copies.append((source, slot, reuse))
        self._take(seq, slot, reuse)
        n = min(budget, seq.prompt_len - reuse)
        pieces.append(Piece(seq, reuse, n))
        return n

    def _take(self, seq: Sequence, slot: int, reuse: int = 0) -> None:
        """`seq` starts in `slot`, whose first `reuse` positions already hold its prompt's K/V."""
        seq.slot = slot
        seq.cached = seq.prefilled = reuse
        self.running[slot] = seq
        if self._prefixes is not None:
            self._prefixes.forget(slot)

    def _release(self, seq: Sequence) -> None:
        """`seq` leaves its slot (finished or aborted); the slot keeps what its K/V holds."""
        if self.running.get(seq.slot) is not seq:
            return
        del self.running[seq.slot]
        if self._prefixes is not None:
            self._prefixes.release(seq.slot, seq.held_tokens())

    def discard(self, seq: Sequence) -> None:
        """A step that wrote `seq`'s slot failed (its copy too, perhaps): the slot, once free, claims nothing."""
        if self._prefixes is not None and seq.slot not in self.running:
            self._prefixes.forget(seq.slot)

    def _place(self, prompt: tuple[int, ...], free: list[int]) -> tuple[int, int, int]:
        """(slot, source slot, tokens to reuse) for a new prompt, its slot taken out of `free`: the lowest free
        slot, or with prefix caching SlotPrefixes.place's choice among those below the decode batch bucket the
        lowest would give, and its match."""
        if self._prefixes is None:
            slot, source, reuse = free[0], -1, 0
        else:
            bound = self.table.batch_for(max([free[0], *self.running]) + 1)
            slot, source, reuse = self._prefixes.place(prompt, [s for s in free if s < bound], free, self.running)
        free.remove(slot)
        return slot, source, reuse

    def _head_hits(self, free: list[int]) -> bool:
        """The next waiting prompt has a reusable prefix: it starts by mixed steps, from where the match ends."""
        if self._prefixes is None or not (free and self.waiting):
            return False
        return self._prefixes.source(self.waiting[0].prompt_ids, free[0], free[1:], self.running)[1] > 0

    def _chunk(self, seq: Sequence) -> ChunkStep:
        c = self.table.chunk_length
        n = min(c, seq.prompt_len - seq.prefilled)
        return ChunkStep(c, self.table.kv_for(seq.prefilled + n), seq.prefilled, n, seq)
