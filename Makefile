# Two commands for a newcomer: `make demo` and `make test`. Everything else is a helper.
# PYTHON picks the interpreter, VENV its virtualenv, DJANGO a requirement to pin Django with
# (default: the newest the interpreter allows), e.g.
#   make test PYTHON="$$(PYENV_VERSION=3.13.0 pyenv which python3.13)" VENV=.venv313 DJANGO='django>=6.1,<6.2'
PYTHON ?= python3
VENV ?= .venv
DJANGO ?=
BIN := $(VENV)/bin
STORE ?= database
PROCS ?= 8
STAMP_BASE := $(VENV)/.installed-base
STAMP_TEST := $(VENV)/.installed-test
STAMP_DOCS := $(VENV)/.installed-docs

.PHONY: demo test lint typecheck serve bench tox dist docs clean

# What Debian must provide (.ci/system-deps, the one list) for a virtualenv, or for the [test]
# extra and the suite when a goal needs them, checked before the virtualenv is made: as root the
# missing packages are installed, otherwise make stops at once with one line naming them all;
# nothing happens when they are all there.
SYSTEM_DEPS := $(if $(filter test lint typecheck bench,$(MAKECMDGOALS)),test,venv)
$(BIN)/python:
	.ci/system-deps $(SYSTEM_DEPS) $(PYTHON)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP_BASE): $(BIN)/python setup.cfg
	$(BIN)/pip install -q -e '.[redis,celery]' $(if $(DJANGO),'$(DJANGO)')
	touch $@

$(STAMP_TEST): $(BIN)/python setup.cfg
	.ci/system-deps test $(PYTHON)
	$(BIN)/pip install -q -e '.[test]' $(if $(DJANGO),'$(DJANGO)')
	touch $@ $(STAMP_BASE)

# The race: PROCS processes charge the same invoices through the lock (STORE=database|redis).
demo: $(STAMP_BASE)
	cd example_project && KEEL_LOCK_STORE=$(STORE) ../$(BIN)/python manage.py race --procs $(PROCS)

# The example site on ADDR (default 127.0.0.1:8000) with a seeded superuser it prints.
serve: $(STAMP_BASE)
	cd example_project && KEEL_LOCK_STORE=$(STORE) ../$(BIN)/python manage.py serve_demo $(ADDR)

test: $(STAMP_TEST)
	.ci/system-deps test $(PYTHON)
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
	$(BIN)/python -m bench.bench_core

# Every tox env (each supported Python x Django pair; the Redis tests on redis-py 5.0), or
# TOXENV's. PYENV_VERSION makes pyenv's python3.11/3.12/3.13 shims all answer.
PYENV_ALL ?= 3.11.7:3.12.1:3.13.0
tox: $(BIN)/python
	.ci/system-deps test $(PYTHON)
	$(BIN)/pip install -q 'tox>=4'
	PYENV_VERSION=$(PYENV_ALL) $(BIN)/tox $(if $(TOXENV),-e $(TOXENV))

# The documentation site (docs/, Sphinx + furo + MyST) into docs/_build/html; warnings fail it.
$(STAMP_DOCS): $(BIN)/python setup.cfg
	$(BIN)/pip install -q -e '.[docs,redis,celery]' $(if $(DJANGO),'$(DJANGO)')
	touch $@

docs: $(STAMP_DOCS)
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html

# The sdist (with everything the test suite needs) and the wheel (the package only), checked.
dist: $(BIN)/python
	$(BIN)/pip install -q build twine
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*
	$(BIN)/python .ci/check_dist.py dist

clean:
	rm -rf $(VENV) build dist *.egg-info
