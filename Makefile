# Two commands set up and exercise everything on a fresh machine:
#   make repro   -> virtual environment, install, run the whole pipeline (tiny CPU profile)
#   make test    -> virtual environment, install, run the test suite
# And one to iterate with: make test-quick (no training, no services; a few minutes).
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
# Test workers (pytest-xdist), one per core: most of a test's time is one stage process that
# keeps one core busy (imports, small tensors), so on 2 cores two workers took 42 min where
# one process took 61 (benchmarks/RESULTS.md). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= auto
# Workers take whole groups in the order tests/conftest.py's schedule_order gives (longest first).
XDIST := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

.PHONY: venv repro test test-quick lint clean-scratch

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
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# Everything that neither trains a model (the `slow` marker, which every test using a trained
# fixture gets), nor runs NeMo-RL's runtime code (`upstream`: the equivalence suite's probes),
# nor starts podman, Slurm or Ray.
QUICK := not slow and not upstream and not container and not slurm and not ray
test-quick: venv
	$(BIN)/python -m pytest $(XDIST) -m "$(QUICK)" $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check alignpipe tests benchmarks
	$(BIN)/ruff format --check alignpipe tests benchmarks
	$(BIN)/lint-imports

clean-scratch:
	rm -rf "$${ALIGNPIPE_SCRATCH:-$$HOME/.cache/alignpipe/scratch}"
