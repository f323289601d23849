"""The served bench's closed loop, simulated: the real scheduler (buckets/scheduler.py) on the server's bucket table,
each step costing what it measured on its own, clients sending their next request when one ends. What a scheduling
policy or a bucket choice would do to output tokens/s, TTFT and the longest step a decoding row waits through,
in seconds instead of a served run; and the least time any schedule could take at those step costs.

Costs (ms, one compute thread): mixed steps by token bucket from results/bench-mixed-<dtype>.json
(scripts/bench_mixed.py; a prefill of a length bucket is costed as the mixed step of that many tokens), decode steps
by batch bucket from --decode-ms (`python scripts/bench_decode.py --batches 1,4,8,16 --kv 2048 --position 250`).
The defaults are bf16 figures of an AMD EPYC core (2 vCPUs, AVX512-BF16, no AMX), session 35. The simulation leaves
out the host's HTTP, tokenizer and event-loop work: on that machine its tokens/s came out 13-17% above the served
`bucketserve bench` figures of the same session at 4-16 clients, and it ordered mixed budgets of 128 and 256 tokens
as the served runs did (level). Most of that gap is what the steps cost under load, not the host's work: with the
costs of a served trace (`--trace`, below) it came within 2-2.5% of the served runs it was taken from (2026-12-05:
146.9 against 143.9 tok/s at 16 clients, 140.6 against 137.3 at 8). Check a difference it predicts with served
runs before relying on it.

`--trace FILE` takes the costs from a served run instead (`scripts/trace_steps.py`: the median of each step kind
and bucket the trace holds, over the default costs where it holds none): the same replay with what the steps
cost under load, where prompt pieces sit at later offsets and decoding rows at longer positions than alone.

Usage: python scripts/simulate_schedule.py [--dtype bfloat16] [--concurrency 1,4,8,16] [--mixed-budget 128,256]
    [--trace FILE]
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, from any cwd

from bench.workload import WorkloadSpec, parse_length_dist, plan_requests  # noqa: E402
from buckets.scheduler import DecodeStep, MixedStep, PrefillStep, Scheduler, Sequence, Step  # noqa: E402
from buckets.table import BucketTable  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "results"
# Measured with scripts/bench_mixed.py (8 decoding rows) and a decode-step A/B, bf16, session 35 (AMD EPYC).
MIXED_MS = {32: 53.0, 64: 89.0, 128: 159.0, 256: 324.0, 512: 639.0, 1024: 1490.0}
DECODE_MS = {1: 17.0, 4: 18.0, 8: 21.0, 16: 35.0}
HOST_MS = 1.0  # a step's work outside its graph (scheduling, sampling, delivering tokens)
RTT_MS = 3.0  # from a request's last token to its client's next request


@dataclass(frozen=True)
class Costs:
    mixed: dict[int, float]
    decode: dict[int, float]

    def of(self, step: Step) -> float:
        if isinstance(step, MixedStep):
            return self.mixed[step.tokens]
        if isinstance(step, DecodeStep):
            return self.decode[step.batch]
        if isinstance(step, PrefillStep):
            return self.mixed[step.length]
        raise TypeError(f"no cost for {type(step).__name__} (chunk steps: a table without mixed steps)")


@dataclass(frozen=True)
class Outcome:
    tokens_per_s: float
    seconds: float
    ttft_p50_ms: float
    longest_decode_wait_ms: float  # the longest step that held a decoding row (what sets the ITL's tail)


def simulate(table: BucketTable, costs: Costs, clients: int, prompts: list[int], output_len: int) -> Outcome:
    """Closed loop: `clients` requests in flight, the next one sent RTT_MS after one ends, until all are done."""
    scheduler = Scheduler(table)
    clock, sent, done, produced, longest = 0.0, 0, 0, 0, 0.0
    arrivals: list[tuple[float, int]] = []
    sent_at: dict[str, float] = {}
    ttfts: list[float] = []
    for _ in range(min(clients, len(prompts))):
        heapq.heappush(arrivals, (0.0, sent))
        sent += 1
    while done < len(prompts):
        while arrivals and arrivals[0][0] <= clock:
            at, i = heapq.heappop(arrivals)
            scheduler.add(Sequence(f"r{i}", prompts[i], output_len, frozenset()))
            sent_at[f"r{i}"] = at
        step = scheduler.schedule()
        if step is None:
            clock = arrivals[0][0]
            continue
        ms = costs.of(step) + HOST_MS
        clock += ms
        if isinstance(step, (MixedStep, DecodeStep)) and any(s.num_generated for s in step.sampling_seqs):
            longest = max(longest, ms)
        sampling = step.sampling_seqs
        finished = scheduler.update(step, {s.request_id: 1 for s in sampling})
        for seq in sampling:
            if seq.num_generated == 1:
                ttfts.append(clock - sent_at[seq.request_id])
        produced += len(sampling)
        for _ in finished:
            done += 1
            if sent < len(prompts):
                heapq.heappush(arrivals, (clock + RTT_MS, sent))
                sent += 1
    ttfts.sort()
    return Outcome(produced / clock * 1e3, clock / 1e3, ttfts[len(ttfts) // 2], longest)


def least_seconds(costs: Costs, rows: int, prompt_tokens: int, decode_tokens: int) -> float:
    """A floor under any schedule at these step costs (padding, arrivals and a level's tails left out): every
    decode token rides in a step of at most `rows` decoding rows, so at least decode_tokens / rows such steps run;
    each is a decode step, or a mixed step of bucket T carrying T - rows prompt tokens; the prompt tokens left over
    run at the cheapest per-token price of any bucket. The least over T."""
    cheapest = min(ms / t for t, ms in costs.mixed.items())
    steps = decode_tokens / rows
    best = float("inf")
    for t, ms in costs.mixed.items():
        if t <= rows:
            continue
        mixed = min(steps, prompt_tokens / (t - rows))
        left = prompt_tokens - mixed * (t - rows)
        best = min(best, mixed * ms + (steps - mixed) * costs.decode[rows] + left * cheapest)
    return best / 1e3


def traced_costs(path: Path, mixed: dict[int, float], decode: dict[int, float]) -> Costs:
    """Median ms of each mixed token bucket and decode batch bucket in a scripts/trace_steps.py trace, over
    `mixed` and `decode` where the trace has no step of that bucket. A step's seconds there include its sampling
    and token delivery, so HOST_MS is subtracted."""
    seen: dict[tuple[str, int], list[float]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "MixedStep":
            seen.setdefault(("mixed", rec["tokens"]), []).append((rec["t1"] - rec["t0"]) * 1e3)
        elif rec["kind"] == "DecodeStep":
            seen.setdefault(("decode", rec["batch"]), []).append((rec["t1"] - rec["t0"]) * 1e3)
    median = {key: statistics.median(ms) - HOST_MS for key, ms in seen.items()}
    return Costs({t: median.get(("mixed", t), ms) for t, ms in mixed.items()},
                 {b: median.get(("decode", b), ms) for b, ms in decode.items()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", default="lognormal:median=128,sigma=1.0")
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--decode-ms", default=",".join(f"{b}:{ms:g}" for b, ms in DECODE_MS.items()),
                        help="decode step ms by batch bucket, e.g. 1:17,4:18,8:21,16:35")
    parser.add_argument("--mixed-budget", default="",
                        help="comma-separated mixed budgets to compare (tokens a step carries while rows decode)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="step costs from a served run's trace (scripts/trace_steps.py) where it has them")
    args = parser.parse_args()

    measured = RESULTS / f"bench-mixed-{args.dtype}.json"
    mixed = {int(t): float(ms) for t, ms in json.loads(measured.read_text())["ms"].items()} if measured.exists() \
        else dict(MIXED_MS)
    decode = {int(b): float(ms) for b, ms in (pair.split(":") for pair in args.decode_ms.split(","))}
    costs = traced_costs(args.trace, mixed, decode) if args.trace else Costs(mixed, decode)
    spec = WorkloadSpec(parse_length_dist(args.prompt_len), parse_length_dist(f"fixed:{args.output_len}"),
                        args.num_requests, 0, args.max_prompt_len)
    prompts = [plan.prompt_len for plan in plan_requests(spec, 10 ** 6)]
    # The server's default CPU table (server/config.py) for a 2048-token model.
    table = BucketTable(lengths=(32, 64, 128, 256), batch_sizes=tuple(decode), prefill_batch_sizes=(1,),
                        context_length=2048, chunked_prefill=True, mixed_tokens=tuple(sorted(mixed)))
    source = f"served trace {args.trace} over " if args.trace else ""
    source += f"measured: {measured}" if measured.exists() else "defaults"
    print(f"costs ({source}): mixed { {t: round(ms, 1) for t, ms in costs.mixed.items()} }, "
          f"decode { {b: round(ms, 1) for b, ms in costs.decode.items()} }; {len(prompts)} requests, "
          f"{sum(prompts)} prompt tokens")
    budgets = [int(b) for b in args.mixed_budget.split(",") if b] or [table.mixed_budget]
    for budget in budgets:
        with mock.patch.object(BucketTable, "mixed_budget", property(lambda _self, b=budget: b)):
            for clients in (int(c) for c in args.concurrency.split(",")):
                out = simulate(table, costs, clients, prompts, args.output_len)
                rows = table.batch_for(min(clients, table.max_batch))
                floor = least_seconds(costs, min(clients, rows), sum(prompts),
                                      len(prompts) * (args.output_len - 1))
                print(f"mixed budget {budget:4d}, {clients:2d} clients: {out.tokens_per_s:6.1f} tok/s "
                      f"({out.seconds:5.2f} s), TTFT p50 {out.ttft_p50_ms:6.0f} ms, longest step holding a decoding "
                      f"row {out.longest_decode_wait_ms:5.0f} ms; no schedule beats "
                      f"{len(prompts) * args.output_len / floor:6.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
