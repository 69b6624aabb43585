# Two commands for a newcomer: `make demo` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STORE ?= database
PROCS ?= 8
STAMP_BASE := $(VENV)/.installed-base
STAMP_TEST := $(VENV)/.installed-test

.PHONY: demo test lint typecheck serve bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP_BASE): $(BIN)/python setup.cfg
	$(BIN)/pip install -q -e '.[redis,celery]'
	touch $@

$(STAMP_TEST): $(BIN)/python setup.cfg
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(STAMP_BASE)

demo: $(STAMP_BASE)
	cd example_project && STORE=$(STORE) ../$(BIN)/python manage.py race --procs $(PROCS)

serve: $(STAMP_BASE)
	cd example_project && ../$(BIN)/python manage.py serve_demo

test: $(STAMP_TEST)
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(BIN)/ruff check .
	$(BIN)/mypy

lint: $(STAMP_TEST)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP_TEST)
	$(BIN)/mypy

bench: $(STAMP_TEST)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) build dist *.egg-info
