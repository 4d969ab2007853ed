# `make test` and `make setup` work on a fresh machine: they create .venv and install everything.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test lint k8s-tools serve bench-blockd clean

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

test: lint k8s-tools
	$(PY) -m pytest -q $(PYTEST_ARGS)

# What tests/deploy checks the Kubernetes manifests with: kubernetes-validate and checkov (pinned in
# deploy/k8s/tools-requirements.txt) in a virtual environment of their own, since checkov brings some 400 MB that
# nothing else needs; kubectl (for `kubectl kustomize`) from the system, installed with apt-get where missing.
K8S_VENV  ?= .venv-k8s
K8S_STAMP := $(K8S_VENV)/.installed
export K8S_VENV  # tests/deploy finds the tools there

k8s-tools: $(K8S_STAMP)
	@command -v kubectl >/dev/null 2>&1 || apt-get install -y -qq kubectl >/dev/null 2>&1 \
		|| { apt-get update -qq && apt-get install -y -qq kubectl; } \
		|| echo "kubectl could not be installed: tests/deploy skips the checks of the rendered manifests"

$(K8S_STAMP): deploy/k8s/tools-requirements.txt
	$(PYTHON) -m venv $(K8S_VENV)
	$(K8S_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(K8S_VENV)/bin/python -m pip install --quiet -r deploy/k8s/tools-requirements.txt
	touch $(K8S_STAMP)

# A whole local stack (blockd, executors, gateway) until Ctrl-C; e.g. make serve SERVE_ARGS='--executors 2'
serve: setup
	$(VENV)/bin/pagedkv serve $(SERVE_ARGS)

bench-blockd: setup
	$(VENV)/bin/pagedkv bench blockd

clean:
	rm -rf $(VENV) $(K8S_VENV) build *.egg-info .pytest_cache .hypothesis
