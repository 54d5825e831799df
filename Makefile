# Two targets do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[runtime,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/chameleon estimate --config examples/paper32.toml
	$(BIN)/chameleon estimate --config examples/paper32.toml --fail 5

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
