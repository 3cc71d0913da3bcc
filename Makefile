# kvwatch: `make up` starts the lab and the dashboard, `make test` runs the whole suite.
# Both bootstrap first: a virtualenv with kvwatch installed, and Debian's nginx, Prometheus and
# Alertmanager when they are missing; `make test` also installs Debian's Chromium for the dashboard's
# browser test.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvwatch-installed
SYSTEM_PACKAGES := nginx prometheus prometheus-alertmanager
TEST_PACKAGES := chromium
LAB_ARGS ?=

.PHONY: bootstrap system-packages test-packages up down test bench lint generate

bootstrap: system-packages $(STAMP)

system-packages:
	@sh scripts/system-packages.sh $(SYSTEM_PACKAGES)

test-packages:
	@sh scripts/system-packages.sh $(TEST_PACKAGES)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

up: bootstrap
	$(BIN)/kvwatch lab up $(LAB_ARGS)

down:
	@test -x $(BIN)/kvwatch && $(BIN)/kvwatch lab down || true

test: bootstrap test-packages
	$(BIN)/python -m pytest -q --durations=15

bench: bootstrap
	$(BIN)/python -m benchmarks

generate: bootstrap
	$(BIN)/python -m collectors.generate

lint: bootstrap
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
