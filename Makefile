# megatron-ext: `make demo` and `make test` set everything up on a fresh machine.
# Both create .venv with Python 3.12 when it is missing and install the package (editable)
# with the pinned versions in constraints.txt.

SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# A Python 3.12 that actually runs: python3.12 on PATH (a pyenv shim may exist but fail),
# else pyenv's own 3.12 build.
PYTHON312 ?= $(shell \
  if python3.12 -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then \
    command -v python3.12; \
  else \
    root=$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv); \
    for p in $$root/versions/3.12*/bin/python3.12; do \
      if [ -x "$$p" ] && "$$p" -c 'import sys' >/dev/null 2>&1; then echo $$p; break; fi; \
    done; \
  fi)

.PHONY: venv demo test test-fast lint bench results clean help

help:
	@echo "make demo   - train the tiny CPU GPT recipe on 2 gloo ranks (runs/demo/)"
	@echo "make test   - run the whole test suite (what CI runs)"
	@echo "make test-fast - the in-process tests only (no torchrun, no subprocess): the edit-test loop"
	@echo "make lint   - ruff, and mypy over config/ run/ gpt/ optimizers/ distributed/"
	@echo "make bench  - optimizer benchmark (megatron-ext bench optimizers)"
	@echo "make results - render docs/results/*/*.md from the benchmarks' JSON (megatron-ext docs results)"

$(STAMP): setup.py constraints.txt
	@if [ ! -x "$(PY)" ]; then \
	  if [ -z "$(PYTHON312)" ]; then \
	    echo "error: no working Python 3.12 found (tried python3.12 on PATH and pyenv's versions/3.12*)." >&2; \
	    echo "       install Python 3.12 or pass PYTHON312=/path/to/python3.12" >&2; exit 1; \
	  fi; \
	  echo "creating $(VENV) with $(PYTHON312)"; \
	  "$(PYTHON312)" -m venv $(VENV); \
	fi
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/megatron-ext launch recipes/tiny_cpu_gpt.yaml

# Two pytest-xdist workers, a whole test file each at a time (module fixtures run once); the
# files that start processes first (tests/tiers.py), so that no long file is handed out last.
# --no-loadscope-reorder: else pytest-xdist re-sorts the files by their number of tests.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

# Markers are set at collection (tests/tiers.py); an unmarked test that starts a process of
# this project fails here, naming the fix.
test-fast: $(STAMP)
	MEGATRON_EXT_FAST_LANE=1 $(PY) -m pytest -q -m "not subprocess" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/typecheck.py

bench: $(STAMP)
	$(VENV)/bin/megatron-ext bench optimizers

results: $(STAMP)
	$(VENV)/bin/megatron-ext docs results

clean:
	rm -rf runs build *.egg-info
