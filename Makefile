# Two commands for a newcomer: `make demo` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STORE ?= database
PROCS ?= 8
STAMP_BASE := $(VENV)/.installed-base
STAMP_TEST := $(VENV)/.installed-test

.PHONY: demo test lint typecheck serve bench tox clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP_BASE): $(BIN)/python setup.cfg
	$(BIN)/pip install -q -e '.[redis,celery]'
	touch $@

$(STAMP_TEST): $(BIN)/python setup.cfg
	$(BIN)/pip install -q -e '.[test]'
	touch $@ $(STAMP_BASE)

# The race: PROCS processes charge the same invoices through the lock (STORE=database|redis).
demo: $(STAMP_BASE)
	cd example_project && KEEL_LOCK_STORE=$(STORE) ../$(BIN)/python manage.py race --procs $(PROCS)

# The example site on ADDR (default 127.0.0.1:8000) with a seeded superuser it prints.
serve: $(STAMP_BASE)
	cd example_project && KEEL_LOCK_STORE=$(STORE) ../$(BIN)/python manage.py serve_demo $(ADDR)

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
	$(BIN)/python -m bench.bench_db
	$(BIN)/python -m bench.bench_redis

# Every tox env (Django 4.2 and 5.2; the Redis tests on redis-py 5.0), or TOXENV's.
tox: $(BIN)/python
	$(BIN)/pip install -q 'tox>=4'
	$(BIN)/tox $(if $(TOXENV),-e $(TOXENV))

clean:
	rm -rf $(VENV) build dist *.egg-info
