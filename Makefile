# Two commands set up and exercise everything on a fresh machine:
#   make repro   -> virtual environment, install, run the whole pipeline (tiny CPU profile)
#   make test    -> virtual environment, install, run the test suite
# And one to iterate with: make test-quick (no training, no services; a few minutes).
# The lock (lock/requirements.txt) is written for CPython 3.11.
PYTHON ?= python3.11
VENV   ?= .venv
LOCK   := lock/requirements.txt
# The extras the lock holds besides the core dependencies: the CPU engine and the dev tools.
LOCK_EXTRAS := local dev
# Where Linux x86-64's CPU build of torch comes from (lock/torch.txt; PyPI has only the CUDA
# build there). The lock pins the file by its hash, so any place that holds it serves: a
# wheelhouse in pip's find-links (an air-gapped host's), else PyTorch's CPU index.
WHEELHOUSE ?= $(PIP_FIND_LINKS)
TORCH_WHEELS ?= $(or $(firstword $(foreach d,$(WHEELHOUSE),$(if $(wildcard $(d)/torch-*.whl),$(d)))),https://download.pytorch.org/whl/cpu/torch/)
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
# one process took 61 (DEVELOPING.md, "Test suite speed"). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= auto
# Workers take whole groups in the order tests/conftest.py's schedule_order gives (longest first).
XDIST := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

UV := $(BIN)/uv -q
.PHONY: venv lock repro test test-quick lint clean-scratch

# uv and packaging first, at their locked versions and hashes: uv installs the rest, and
# lock/check.py (packaging) refuses a lock that no longer matches pyproject.toml.
$(BIN)/.bootstrapped: $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	awk '/^[^ #]/ { keep = /^(uv|packaging)==/ } keep' $(LOCK) > $(VENV)/bootstrap.txt
	$(BIN)/python -m pip install -q --require-hashes --no-deps -r $(VENV)/bootstrap.txt
	touch $@

# Exactly the lock: `uv pip sync` removes what it does not list. torch goes first, on Linux
# x86-64 from TORCH_WHEELS, checked against the lock's hash (-c); then everything else from PyPI.
# Where PYTHONDONTWRITEBYTECODE is set, nothing would write the .pyc files and every process would
# compile torch and transformers again (a no-op `dvc repro` spent 3.5 of its 6.6 s compiling): there
# every module is compiled ahead (51 CPU s). Elsewhere Python writes each module's cache the first
# time it is imported, about a fifth of them.
COMPILE := $(if $(PYTHONDONTWRITEBYTECODE),--compile-bytecode)
$(BIN)/.installed: pyproject.toml $(LOCK) $(BIN)/.bootstrapped
	$(BIN)/python lock/check.py $(LOCK_EXTRAS)
	$(if $(filter Linux-x86_64,$(shell uname -s)-$(shell uname -m)),$(UV) pip install --python $(BIN)/python --no-deps $(COMPILE) -c $(LOCK) --find-links $(TORCH_WHEELS) torch)
	$(UV) pip sync --python $(BIN)/python --require-hashes $(COMPILE) $(LOCK)
	$(UV) pip install --python $(BIN)/python --no-deps --no-build-isolation -e .
	touch $@

venv: $(BIN)/.installed

# After changing dependencies in pyproject.toml (or lock/torch.txt): resolve again, for every
# platform the lock serves (lock/check.py's PLATFORMS), with every file's hash. And NeMo-Gym's
# venv (lock/gym.in, Python 3.12, .ci/install-gym.sh).
lock: $(BIN)/.bootstrapped
	$(UV) pip compile pyproject.toml $(addprefix --extra ,$(LOCK_EXTRAS)) --universal --python-version 3.11 \
	  --generate-hashes --override lock/torch.txt --find-links $(TORCH_WHEELS) \
	  --custom-compile-command "make lock" -o $(LOCK)
	$(UV) pip compile lock/gym.in --universal --python-version 3.12 --generate-hashes \
	  --custom-compile-command "make lock" -o lock/gym.txt

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
	$(BIN)/ruff check alignpipe tests benchmarks lock
	$(BIN)/ruff format --check alignpipe tests benchmarks lock
	$(BIN)/lint-imports
	$(BIN)/actionlint

clean-scratch:
	rm -rf "$${ALIGNPIPE_SCRATCH:-$$HOME/.cache/alignpipe/scratch}"
