# `make test` and `make setup` work on a fresh machine: they create .venv and install everything.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test lint serve bench-blockd clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The linters and the import-layer contract first: they take seconds, the tests minutes.
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

# A whole local stack (blockd, executors, gateway) until Ctrl-C; e.g. make serve SERVE_ARGS='--executors 2'
serve: setup
	$(VENV)/bin/pagedkv serve $(SERVE_ARGS)

bench-blockd: setup
	$(VENV)/bin/pagedkv bench blockd

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
