"""The serving path on an accelerator, checked end to end in one short run: exactness, agreement, timings.

Meant for a machine lent for minutes (a CUDA GPU here; `--device neuron` on Trainium takes the same steps).
Nothing is downloaded: the checkpoints are random weights built on the spot.

1. `verify` of a tiny random Llama in float32 on the device: greedy tokens against transformers' eager float32
   `generate` on the CPU, on every bucket (exit 0 only when token for token equal);
2. the same in bfloat16 (token agreement >= verify's --min-agreement);
3. `bench` of a random-weight checkpoint with the default model's shape (SmolLM2-135M: its config and tokenizer
   from --shape-dir) served on the device with the default bucket table: ready time, graph count,
   recompilations, TTFT and output tokens/s at the bench's concurrency levels.

Each step has its own time limit and writes as it goes, so a run cut short still reports the steps it finished.
Usage: python scripts/check_accelerator.py --device cuda --shape-dir DIR --out results/accelerator
Writes <out>/summary.md (one line per step) beside each step's log and report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLI = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main())"]
# The tiny table of the tests (tests/support/tiny.py): every phase, two KV buckets, a 128-token context.
TINY_ARGS = ["--buckets", "8,16,32,64", "--batch-sizes", "1,2,4", "--prefill-batch-sizes", "1,2",
             "--kv-buckets", "32,128", "--max-model-len", "128", "--compile-backend", "inductor"]


def environment(device: str) -> str:
    """One line: interpreter, torch, transformers and the device's name."""
    import torch
    import transformers

    name = "cpu"
    if device == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
    return (f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"device {device} ({name})")


def shaped_checkpoint(shape_dir: Path, out: Path) -> str:
    """Random weights (bf16) in the shape of shape_dir's config.json, beside a copy of its tokenizer files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "model.safetensors").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(shape_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    model.save_pretrained(out)
    for f in shape_dir.iterdir():
        if f.name != "config.json" and f.suffix in (".json", ".jinja"):
            (out / f.name).write_bytes(f.read_bytes())
    return str(out)


def step(name: str, argv: list[str], out: Path, timeout: float) -> tuple[int, float]:
    """Run one command with its output in out/<name>.log; (exit status, seconds). 124: timed out."""
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - t0


def verify_line(report: Path) -> str:
    """Greedy agreement and exactness from a verify report.json."""
    if not report.exists():
        return "no report"
    data = json.loads(report.read_text())
    cases = data.get("cases", [])
    exact = sum(c["first_divergence"] is None for c in cases)
    return (f"{data['verdict']}, token agreement {data['agreement']:.3f}, {exact}/{len(cases)} cases exact, "
            f"{len(data['graphs'])} graphs exercised")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda", "neuron"])
    p.add_argument("--shape-dir", default="", help="config.json + tokenizer of the model to imitate (the bench step)")
    p.add_argument("--out", default="results/accelerator")
    p.add_argument("--work", default="/tmp/bucketserve-accelerator", help="where the checkpoints are built")
    p.add_argument("--steps", default="verify-f32,verify-bf16,bench")
    p.add_argument("--step-timeout", type=float, default=240.0, help="seconds per verify step")
    p.add_argument("--bench-timeout", type=float, default=600.0)
    p.add_argument("--concurrency", default="1,8,16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--collect", default="", help="copy the summaries and logs here, flat, after each step")
    p.add_argument("--bench-args", default="", help="more arguments for the served engine")
    args = p.parse_args()
    if "bench" in args.steps.split(",") and not args.shape_dir:
        p.error("the bench step needs --shape-dir")
    out, work = Path(args.out).resolve(), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    lines = [f"# Accelerator check ({time.strftime('%Y-%m-%d %H:%M')})", "", environment(args.device), ""]

    def record(text: str) -> None:
        lines.append(f"- {text}")
        (out / "summary.md").write_text("\n".join(lines) + "\n")
        print(text, flush=True)
        if args.collect:  # a flat copy of the few files worth reading (a lent machine returns only a few)
            collect = Path(args.collect)
            collect.mkdir(parents=True, exist_ok=True)
            wanted = {"summary.md": out / "summary.md", "verify-f32.md": out / "verify-f32" / "report.md",
                      "verify-bf16.md": out / "verify-bf16" / "report.md", "bench.md": out / "bench" / "summary.md"}
            wanted |= {f.name: f for f in out.glob("*.log")}
            wanted |= {f"server-{f.name}": f for f in (out / "bench" / "logs").glob("*.log")}
            for name, src in wanted.items():
                if src.exists():
                    (collect / name).write_bytes(src.read_bytes()[-4_000_000:])

    record("started")
    wanted = args.steps.split(",")
    if {"verify-f32", "verify-bf16"} & set(wanted):
        from tests.support.tiny import build_tiny_checkpoint

        tiny = build_tiny_checkpoint(work / "tiny-llama")
        for dtype in ("float32", "bfloat16"):
            name = "verify-f32" if dtype == "float32" else "verify-bf16"
            if name not in wanted:
                continue
            rc, secs = step(name, [*CLI, "verify", "--model", tiny, "--device", args.device, "--dtype", dtype,
                                   *TINY_ARGS, "--compile-cache-dir", str(work / "cache"), "--num-threads", "4",
                                   "--out", str(out / name)], out, args.step_timeout)
            record(f"{name}: exit {rc} in {secs:.0f} s; {verify_line(out / name / 'report.json')}")
    if "bench" in wanted:
        model = shaped_checkpoint(Path(args.shape_dir), work / "shaped")
        served = f"--device {args.device} --compile-cache-dir {work / 'cache'} {args.bench_args}".strip()
        rc, secs = step("bench", [*CLI, "bench", "--compare", "bucketserve", "--model", model,
                                  "--bucketserve-args", served, "--threads", "0", "--max-num-seqs", "16",
                                  "--concurrency", args.concurrency, "--num-requests", str(args.num_requests),
                                  "--prompt-len", "lognormal:median=128,sigma=1.0", "--max-prompt-len", "1024",
                                  "--output-len", "fixed:64", "--ttft-probe", "32,128,512,1024", "--no-plots",
                                  "--max-seconds-per-level", "60", "--out", str(out / "bench")],
                        out, args.bench_timeout)
        record(f"bench: exit {rc} in {secs:.0f} s (see bench/summary.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
