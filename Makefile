# The two commands of the README. Each sets up .venv by itself on a fresh machine.
#   make demo   run Parkade on its default model and stream a completion
#   make test   run the test suite (what .ci/run calls)
# And while working: make test-fast (lint, format, the pure-logic tier: well under a minute).
PY ?= python3
VENV := .venv
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench

# What Parkade needs to run (the demo): torch and the project, no test extras.
$(RUN_STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	# NOTE: torch first, pinned: a CPU build that satisfies the project's torch>=... requirement,
	# where an unpinned install would pull a multi-GB CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e .
	touch $(RUN_STAMP)

# And the test extras (pytest, triton, openai, ...): what `make test` and `make lint` need.
$(STAMP): $(RUN_STAMP)
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

# Starts `parkade up` (the shipped stories260K, local broker) in the background, streams one story
# with `parkade generate`, stops it; see scripts/demo.sh.
demo: $(RUN_STAMP)
	VENV=$(VENV) bash scripts/demo.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Tools that tests run: the README's kcat lines (Debian's kcat) and `docker-compose config` on the
# compose files, installed here when we may (root, apt).
test: lint
	for tool in kcat docker-compose; do \
	  command -v $$tool >/dev/null || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
	    { apt-get install -y -qq $$tool >/dev/null || { apt-get update -qq && apt-get install -y -qq $$tool >/dev/null; }; }; } || \
	    echo "$$tool is not installed (apt-get install $$tool): its test will fail or skip"; \
	done
	$(VENV)/bin/pytest -q

# tests/unit: pure logic in this process (no broker, no service process, no wheel).
test-fast: lint
	$(VENV)/bin/pytest -q tests/unit

bench: $(RUN_STAMP)
	$(VENV)/bin/python loadtest/offline_bench.py
