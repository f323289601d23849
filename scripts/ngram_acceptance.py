"""How many tokens prompt-lookup (n-gram) speculative decoding would accept per verify step on the `make bench`
workload: greedy outputs from transformers (bf16, one thread), then, for each request, drafts of k tokens taken
after the latest earlier match of the last 3..1 tokens of the prompt and output so far, accepted while they equal
the greedy tokens. An estimate for docs/performance.md (speculative decoding is not built).

    python scripts/ngram_acceptance.py [--requests 24] [--drafts 2,3,4,6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, from any cwd


def draft(ctx: list[int], k: int, longest: int = 3) -> list[int]:
    """The k tokens after the latest earlier occurrence of ctx's last n tokens (n = longest..1), or none."""
    for n in range(longest, 0, -1):
        if len(ctx) <= n:
            continue
        tail = ctx[-n:]
        for i in range(len(ctx) - n - 1, -1, -1):
            if ctx[i : i + n] == tail:
                return ctx[i + n : i + n + k]
    return []


def tokens_per_step(prompt: list[int], out: list[int], k: int) -> float:
    ctx, i, steps = list(prompt), 0, 0
    while i < len(out):
        d = draft(ctx, k)
        ok = 0
        while ok < len(d) and i + ok < len(out) and d[ok] == out[i + ok]:
            ok += 1
        n = min(ok + 1, len(out) - i)  # the accepted drafts and the verify step's own token
        ctx += out[i : i + n]
        i += n
        steps += 1
    return len(out) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
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
        per = [tokens_per_step(prompt, out, k) for prompt, out in runs]
        print(f"{k} drafts: tokens a verify step mean {statistics.mean(per):.2f} median {statistics.median(per):.2f} "
              f"min {min(per):.2f} max {max(per):.2f}")


if __name__ == "__main__":
    main()
