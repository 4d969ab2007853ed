# `make test` and `make setup` work on a fresh machine: they create .venv and install everything.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
K8S_VENV  ?= .venv-k8s
K8S_STAMP := $(K8S_VENV)/.installed

.PHONY: setup k8s-tools compose-cli test lint serve bench-blockd compose-test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# kubernetes-validate and checkov for the Kubernetes manifests' tests (tests/deploy), in an environment of their own.
k8s-tools: $(K8S_STAMP)

$(K8S_STAMP): deploy/k8s/tools-requirements.txt
	$(PYTHON) -m venv $(K8S_VENV)
	$(K8S_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(K8S_VENV)/bin/python -m pip install --quiet -r deploy/k8s/tools-requirements.txt
	touch $(K8S_STAMP)

# The Compose v2 CLI for tests/compose where `docker compose` is not installed (see the script).
compose-cli:
	sh compose/fetch-compose-cli.sh .compose-cli

# The linters and the import-layer contract first: they take seconds, the tests minutes.
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint k8s-tools compose-cli
	PAGEDKV_K8S_TOOLS=$(abspath $(K8S_VENV))/bin $(PY) -m pytest -q $(PYTEST_ARGS)

# A whole local stack (blockd, executors, gateway) until Ctrl-C; e.g. make serve SERVE_ARGS='--executors 2'
serve: setup
	$(VENV)/bin/pagedkv serve $(SERVE_ARGS)

bench-blockd: setup
	$(VENV)/bin/pagedkv bench blockd

# The compose stack built and run for real (CPU image): needs a Docker engine with Compose >= 2.24, takes
# minutes, and is not part of `make test`. Where Docker Hub is unreachable: eval "$$(../shared/tools/docker-here)"
compose-test: setup
	$(PY) -m tests.compose.compose_e2e $(COMPOSE_TEST_ARGS)

clean:
	rm -rf $(VENV) $(K8S_VENV) .compose-cli build *.egg-info .pytest_cache .hypothesis
