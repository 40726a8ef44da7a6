# Two commands set up and exercise everything on a fresh machine:
#   make repro   -> virtual environment, install, run the whole pipeline (tiny CPU profile)
#   make test    -> virtual environment, install, run the test suite
PYTHON ?= python3
VENV   ?= .venv
# CPU wheel first so the resolver never pulls a multi-GB CUDA build on CPU hosts.
TORCH_SPEC ?= torch==2.13.0
BIN    := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export PYTHONHASHSEED := 0
PYTEST_ARGS ?=

.PHONY: venv repro test lint clean-scratch

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[local,dev]"
	touch $@

venv: $(BIN)/.installed

repro: venv
	$(BIN)/dvc repro

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check alignpipe tests benchmarks
	$(BIN)/ruff format --check alignpipe tests benchmarks
	$(BIN)/lint-imports

clean-scratch:
	rm -rf "$${ALIGNPIPE_SCRATCH:-$$HOME/.cache/alignpipe/scratch}"
