"""How many tokens prompt-lookup (n-gram) speculative decoding accepts per verify step on the `make bench`
workload: greedy outputs from transformers (bf16, one thread), then, for each request, the server's own drafts
(buckets/speculation.py: up to k after a 3-token match, one after a shorter one) replayed against them, accepted
while they equal the greedy tokens. The evidence for the drafting rule in docs/performance.md.

    python scripts/ngram_acceptance.py [--requests 32] [--drafts 2,3,4,6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, from any cwd

from buckets.speculation import NgramIndex  # noqa: E402


def replay(prompt: list[int], out: list[int], k: int) -> tuple[int, int, int]:
    """(verify steps, drafts, accepted drafts) of one request's greedy output under the server's drafting rule."""
    index, i, steps, drafts, accepted = NgramIndex(prompt), 0, 0, 0, 0
    while i < len(out):
        d = index.propose(min(k, len(out) - i - 1))  # as plan_drafts: never past max_tokens
        ok = 0
        while ok < len(d) and d[ok] == out[i + ok]:
            ok += 1
        for token in out[i : i + ok + 1]:  # the accepted drafts and the verify step's own token
            index.append(token)
        i += ok + 1
        steps, drafts, accepted = steps + 1, drafts + len(d), accepted + ok
    return steps, drafts, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--drafts", default="2,3,4,6")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.prompts import build_prompts
    from bench.workload import WorkloadSpec, parse_length_dist, plan_requests
    from models.loading import resolve_model_path

    torch.set_num_threads(1)
    path = resolve_model_path("default")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    class Encoder:
        name = "default"

        def encode(self, text: str) -> list[int]:
            return list(tok.encode(text, add_special_tokens=False))

    corpus = (Path(__file__).resolve().parent.parent / "bench" / "corpus.txt").read_text()
    spec = WorkloadSpec(parse_length_dist("lognormal:median=128,sigma=1.0"), parse_length_dist("fixed:64"),
                        args.requests)
    runs = []
    for p in build_prompts(plan_requests(spec, len(corpus)), Encoder(), corpus):  # type: ignore[arg-type]
        ids = torch.tensor([list(p.ids)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        runs.append((list(p.ids), out[0, ids.shape[1]:].tolist()))
    for k in (int(x) for x in args.drafts.split(",")):
        per = [replay(prompt, out, k) for prompt, out in runs]
        steps, drafts, accepted = (sum(r[i] for r in per) for i in range(3))
        tokens = sum(len(out) for _, out in runs)
        print(f"{k} drafts: {tokens / steps:.2f} tokens a verify step (median request "
              f"{statistics.median(len(o) / r[0] for (_, o), r in zip(runs, per)):.2f}), {drafts / steps:.2f} drafts "
              f"a step, {accepted / max(drafts, 1):.0%} of drafts accepted")

if __name__ == "__main__":
    main()
