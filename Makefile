# The two commands of the README: `make demo` and `make test`. Everything else is set up
# on first use and cached outside the checkout: the test venvs by tools/venv.sh (keyed by
# their requirement files), the vLLM server environment and the model by
# pdclient/local/_prepare.py. The checkout itself gets no build output.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
export PYTHONPATH := $(CURDIR)
export PYTHONDONTWRITEBYTECODE := 1

# One venv for everything that runs in the client's process: pdclient's dependencies,
# test tools, and the framework/observability/notebook packages (a superset of dev).
VENV = $(shell tools/venv.sh requirements-frameworks.txt)
# The client tier again on openai 2.x.
VENV_OPENAI2 = $(shell tools/venv.sh requirements-openai2.txt)
CLIENT_TIER = tests/unit tests/test_transport.py tests/test_config.py tests/test_concurrency.py \
              tests/test_resilience.py tests/test_signing.py tests/test_stubserver.py

.PHONY: test lint typecheck test-client test-openai2 test-server-patch test-fast demo bench-decode-ttft

test: lint typecheck test-client test-openai2 test-server-patch

lint:
	$(VENV)/bin/ruff check pdclient tests benchmarks examples server_patch
	$(VENV)/bin/ruff format --check pdclient tests benchmarks examples server_patch

typecheck:
	$(VENV)/bin/mypy --strict pdclient

# Unit, respx, loopback stubs, soak, then the real local vLLM pair (e2e, frameworks,
# examples, notebook), which starts once for the session.
test-client:
	$(VENV)/bin/python -m pytest tests -ra -p no:cacheprovider

test-openai2:
	$(VENV_OPENAI2)/bin/python -m pytest $(CLIENT_TIER) -ra -p no:cacheprovider

# Inside the vLLM server environment, once per vLLM version (0.20.2, 0.26.0, 0.32.0).
test-server-patch:
	$(VENV)/bin/python tests/server_patch/run.py

# Everything that needs no vLLM: seconds, for the edit-test loop.
test-fast:
	$(VENV)/bin/python -m pytest tests -ra -p no:cacheprovider -m "not e2e" --ignore=tests/test_faults_stub.py

demo:
	$(VENV)/bin/python examples/demo.py

# Decode TTFT with forwarded ids versus without, on a LocalPD pair it starts (~1.5 h here).
# ARGS="--prefill URL --decode URL ..." for another pair; see the script's docstring.
bench-decode-ttft:
	$(VENV)/bin/python benchmarks/bench_decode_ttft.py $(ARGS)
