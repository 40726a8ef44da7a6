# Two commands set up and exercise everything on a fresh machine:
#   make repro   -> virtual environment, install, run the whole pipeline (tiny CPU profile)
#   make test    -> virtual environment, install, run the test suite
PYTHON ?= python3
VENV   ?= .venv
# torch goes in first, on its own, so the index it comes from can be chosen. From PyPI,
# torch==2.13.0 on Linux x86_64 is the CUDA 13 build (it pulls triton and ~20 nvidia-* wheels,
# GBs a CPU host never uses). On a CPU-only host take PyTorch's CPU index (torch 2.13.0+cpu):
#   make venv TORCH_INDEX=https://download.pytorch.org/whl/cpu
# or name a wheel you have: make venv TORCH_SPEC=/path/to/torch-2.13.0+cpu-...whl.
# TORCH_INDEX empty: pip's configured indexes (PyPI unless pip.conf says otherwise).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
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
	$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_SPEC)"
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
