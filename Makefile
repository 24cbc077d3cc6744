# The two commands of the README. Each sets up .venv by itself on a fresh machine.
#   make demo   run Parkade on its default model and stream a completion
#   make test   run the test suite (what .ci/run calls)
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	# NOTE: torch first, pinned: a CPU build that satisfies the project's torch>=... requirement,
	# where an unpinned install would pull a multi-GB CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

# Starts `parkade up` (the shipped stories260K, local broker) in the background, streams one story
# with `parkade generate`, stops it; see scripts/demo.sh.
demo: $(STAMP)
	VENV=$(VENV) bash scripts/demo.sh

# The README's kcat lines are run by a test: Debian's kcat, installed here when we may (root, apt).
test: $(STAMP)
	command -v kcat >/dev/null || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq kcat >/dev/null || { apt-get update -qq && apt-get install -y -qq kcat >/dev/null; }; }; } || \
	  echo "kcat is not installed (apt-get install kcat): its test will fail"
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q

bench: $(STAMP)
	$(VENV)/bin/python loadtest/offline_bench.py
