"""Prompts that share a long prefix, as JSONL for `bucketserve bench --prompts-file`: one ~420-token "system
prompt" (notes from the bench corpus) plus a distinct ~35-token question each, 64 output tokens. The workload of
docs/performance.md's prefix-caching section; `--part a` and `--part b` give disjoint questions, so a second
level run on the other part replays none of the first level's prompts.

    python scripts/shared_prefix_prompts.py --part a > /tmp/shared_a.jsonl
    bucketserve bench --url http://127.0.0.1:8000 --prompts-file /tmp/shared_a.jsonl --concurrency 1 --num-requests 32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "bench" / "corpus.txt"


def prompts(part: int, count: int) -> list[dict[str, object]]:
    words = CORPUS.read_text().split()
    system = ("You are a helpful assistant for a local history society. Answer from the following notes.\n\n"
              + " ".join(words[:300]) + "\n\n")
    out: list[dict[str, object]] = []
    for i in range(count):
        k = 2 * i + part
        start = 300 + k * 7 % 350
        out.append({"prompt": f"{system}Question {k}: " + " ".join(words[start:start + 25]) + "?", "max_tokens": 64})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["a", "b"], default="a")
    parser.add_argument("--count", type=int, default=40)
    args = parser.parse_args()
    for item in prompts("ab".index(args.part), args.count):
        print(json.dumps(item))


if __name__ == "__main__":
    main()
