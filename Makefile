# The two commands of the README: `make demo` and `make test`. Everything else is set up
# on first use and cached outside the checkout (see tools/venv.sh, pdclient/local/_prepare.py).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PY_SOURCES := pdclient tests benchmarks examples tools

DEV_VENV = $(shell tools/venv.sh requirements-dev.txt)
export PYTHONPATH := $(CURDIR)

.PHONY: test lint typecheck unit e2e server-patch-test demo bench clean

test: lint typecheck
	$(DEV_VENV)/bin/python -m pytest tests -ra
	$(DEV_VENV)/bin/python -m pdclient.local._prepare_cli server-tests

lint:
	$(DEV_VENV)/bin/ruff check pdclient tests benchmarks examples server_patch
	$(DEV_VENV)/bin/ruff format --check pdclient tests benchmarks examples server_patch

typecheck:
	$(DEV_VENV)/bin/mypy --strict pdclient

unit:
	$(DEV_VENV)/bin/python -m pytest tests -ra -m "not e2e"

demo:
	$(DEV_VENV)/bin/python examples/demo.py
