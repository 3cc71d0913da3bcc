# kvwatch: `make up` starts the lab and the dashboard, `make test` runs the whole suite.
# Both bootstrap first: a virtualenv with kvwatch installed, and Debian's nginx, Prometheus and
# Alertmanager when they are missing; `make test` also installs Debian's Chromium for the dashboard's
# browser test, kubectl (kubernetes-client) whose kustomize renders deploy/k8s, Node.js with Grafana's
# schema for the boards' schema test, VictoriaMetrics and vmalert for the lab on VictoriaMetrics, and real vLLM for the real-engine tests (`make up` does only with
# LAB_ARGS="--engine vllm").

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvwatch-installed
SYSTEM_PACKAGES := nginx prometheus prometheus-alertmanager
TEST_PACKAGES := chromium nodejs npm postgresql openssl rsyslog kubernetes-client victoria-metrics
LAB_ARGS ?=
# Where the generated alerts and boards link the runbook (default: this project's public repository),
# e.g. `make generate RUNBOOK_URL=https://wiki.example.net/kvwatch-runbook`; the dashboard's is
# dashboard.runbook_url in the config.
RUNBOOK_URL ?=
# Real vLLM (CPU build) for `kvwatch lab up --engine vllm` and the real-engine tests, in a virtualenv of
# its own, cached across runs and clones; lab/replicas/vllm.py looks for it here by default.
VLLM_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvwatch/vllm-0.32.0
export KVWATCH_VLLM_VENV := $(VLLM_VENV)
# Grafana's own definitions of a board (@grafana/schema of Grafana 11.6 and 12.4) and TypeScript, pinned by
# the lockfile there; npm's cache keeps them across clones.
GRAFANA_SCHEMA := tools/grafana-schema
GRAFANA_SCHEMA_STAMP := $(GRAFANA_SCHEMA)/node_modules/.kvwatch-installed
LAB_WANTS_VLLM := $(or $(findstring --engine vllm,$(LAB_ARGS)),$(findstring --engine=vllm,$(LAB_ARGS)))

.PHONY: bootstrap system-packages test-packages vllm grafana-schema up down test test-unit bench lint generate

bootstrap: system-packages $(STAMP)

system-packages:
	@sh scripts/system-packages.sh $(SYSTEM_PACKAGES)

test-packages:
	@sh scripts/system-packages.sh $(TEST_PACKAGES)

vllm:
	@sh scripts/vllm-venv.sh $(VLLM_VENV)

grafana-schema: test-packages $(GRAFANA_SCHEMA_STAMP)

$(GRAFANA_SCHEMA_STAMP): $(GRAFANA_SCHEMA)/package-lock.json
	cd $(GRAFANA_SCHEMA) && npm ci --prefer-offline --no-audit --no-fund --loglevel=error
	@touch $@

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

up: bootstrap $(if $(LAB_WANTS_VLLM),vllm)
	$(BIN)/kvwatch lab up $(LAB_ARGS)

down:
	@test -x $(BIN)/kvwatch && $(BIN)/kvwatch lab down || true

test: bootstrap test-packages vllm grafana-schema
	@sh scripts/test.sh $(BIN)/python

# The inner loop: each package's unit tests, without the ones that start a lab or a real component.
test-unit: bootstrap
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto -m "not integration" tests/unit

bench: bootstrap
	$(BIN)/python -m benchmarks

generate: bootstrap
	$(BIN)/python -m kvwatch.cli.generate $(if $(RUNBOOK_URL),--runbook-url $(RUNBOOK_URL))

lint: bootstrap
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
