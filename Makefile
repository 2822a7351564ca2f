# Two entry points that work on a fresh machine:
#   make up    bootstrap the virtualenv, then run the appliance (embedded tiny CPU model)
#   make test  bootstrap the virtualenv, then lint, type-check and run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.bootstrapped
ARGS ?=

.PHONY: up test lint unit bootstrap clean

bootstrap: $(STAMP)

# torch first and pinned to the CPU wheel (anything unpinned pulls a CUDA build of several GB),
# then the project, then verl without its dependencies (its extras pin CUDA torch).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps verl==0.9.1
	touch $(STAMP)

up: $(STAMP)
	$(BIN)/lightning-appliance up $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

test: lint unit

clean:
	rm -rf $(VENV) appliance-data .mypy_cache .ruff_cache .pytest_cache
