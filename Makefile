# Two targets do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench clean examples

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The tested versions (constraints.txt) within the ranges pyproject.toml declares.
$(STAMP): $(BIN)/python pyproject.toml setup.py constraints.txt src/chameleon_ft/perf/_listsched.c
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[runtime,dev,hf,tensorboard]'
	touch $(STAMP)

# The main job: train a tiny GPT on 4 worker processes (dp 2 x pp 2), kill one of them
# mid-step, recover in place without restarting the survivors, and print the report.
demo: $(STAMP)
	rm -rf runs/demo
	OMP_NUM_THREADS=1 $(BIN)/chameleon train --config examples/tiny_cpu.toml \
		--fault rank=3,step=120,kind=kill,phase=backward --out runs/demo

# The examples' models, tokenizer and token files (examples/llama_tiny_cpu.toml,
# examples/qwen_tiny_cpu.toml), built locally: no download.
examples: examples/data/tokens.bin examples/data/llama-tiny/config.json \
	examples/data/qwen-tokens.bin examples/data/qwen-tiny/config.json

examples/data/tokens.bin: $(STAMP) examples/make_tokens.py
	$(BIN)/python examples/make_tokens.py --out $@

examples/data/llama-tiny/config.json: $(STAMP) examples/make_model.py
	$(BIN)/python examples/make_model.py --family llama --out examples/data/llama-tiny

examples/data/tokenizer/tokenizer.json: $(STAMP) examples/make_tokenizer.py
	$(BIN)/python examples/make_tokenizer.py --out examples/data/tokenizer \
		--corpus examples/data/corpus.jsonl

examples/data/qwen-tokens.bin: examples/data/tokenizer/tokenizer.json
	$(BIN)/chameleon prepare-data --tokenizer examples/data/tokenizer \
		--input examples/data/corpus.jsonl --out $@

examples/data/qwen-tiny/config.json: $(STAMP) examples/make_model.py
	$(BIN)/python examples/make_model.py --family qwen2 --out examples/data/qwen-tiny

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy
	# pytest exits 5 when it collects no test; that is not a failure of the suite.
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest || test $$? -eq 5

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/estimate.py
	$(BIN)/python benchmarks/decision.py
	$(BIN)/python benchmarks/simulate.py
	$(BIN)/python benchmarks/recovery.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
