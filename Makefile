# The two commands of the README: `make demo` and `make test`. Everything else is set up
# on first use and cached outside the checkout: the test venvs by tools/venv.sh (keyed by
# their requirement files), the vLLM server environment and the model by
# pdclient/local/_prepare.py. The checkout itself gets no build output.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
export PYTHONDONTWRITEBYTECODE := 1

# One venv for everything that runs in the client's process: pdclient's dependencies,
# test tools, and the framework/observability/notebook packages (a superset of dev).
VENV = $(shell tools/venv.sh requirements-frameworks.txt)
# The client tiers again on openai 2.x.
VENV_OPENAI2 = $(shell tools/venv.sh requirements-openai2.txt)
PYTEST = -m pytest -ra --durations=25 -p no:cacheprovider

.PHONY: test install system-packages install-openai2 lint typecheck test-client test-pair-avx2 test-openai2 test-server-patch test-fast demo \
        bench-client-overhead bench-decode-ttft bench-proxies bench-dispatch bench-serve-cpu bench-migration bench-conversations \
        bench-multiturn bench-kv-accuracy

# Every tier, in the order a failure is cheapest to find (docs/ARCHITECTURE.md, "Tests").
test: lint typecheck test-client test-pair-avx2 test-openai2 test-server-patch

# pdclient installed into the venvs from this checkout (editable): tests, examples and
# benchmarks import it as a user does. Seconds; redone each run because CI clones afresh.
install:
	$(VENV)/bin/pip install -q --disable-pip-version-check --no-deps -e .

# Node.js, npm and curl for the real-pair tier's other-language clients (Debian packages).
system-packages:
	tools/system-packages.sh

install-openai2:
	$(VENV_OPENAI2)/bin/pip install -q --disable-pip-version-check --no-deps -e .

lint:
	$(VENV)/bin/ruff check pdclient tests benchmarks examples server_patch tools
	$(VENV)/bin/ruff format --check pdclient tests benchmarks examples server_patch tools
	$(VENV)/bin/lint-imports

typecheck: install
	$(VENV)/bin/mypy --strict pdclient

# Unit, mocked (respx), loopback stubs (faults, soak), the proxy (`pdclient serve` against
# stubs, Node's openai, curl), then the real local vLLM pair (parity, KV, frameworks,
# examples, notebook, the proxy), which starts once for the session.
test-client: install system-packages
	$(VENV)/bin/python $(PYTEST) tests/unit tests/mocked tests/stubs tests/serve tests/pair

# The real-pair tests whose answers come from the model, again on a pair that computes as an
# AVX2-only CPU would (vLLM's AVX2 kernels, oneDNN and ATen capped; pdclient/local/_cpu_isa.py):
# the same model answers differently there, and these tests must hold on any CPU. On a CPU
# without AVX-512 the pair of test-client computed so already: not run twice.
test-pair-avx2: install
	@if grep -qw avx512f /proc/cpuinfo; then \
	    PDCLIENT_SERVER_CPU_ISA=avx2 $(VENV)/bin/python $(PYTEST) tests/pair/test_parity.py tests/pair/test_dialects.py \
	        tests/pair/test_frameworks.py tests/pair/test_non_streamed.py \
	        tests/pair/test_local_pd.py::test_the_servers_compute_with_the_instruction_sets_asked_for; \
	else echo "test-pair-avx2: this CPU has no AVX-512, so test-client's real pair computed as an AVX2-only CPU does"; fi

test-openai2: install-openai2
	$(VENV_OPENAI2)/bin/python $(PYTEST) tests/unit tests/mocked

# Inside the vLLM server environment, once per vLLM version (0.20.2, 0.26.0, 0.32.0).
test-server-patch: install
	$(VENV)/bin/python tests/server_patch/run.py

# Everything that needs no vLLM and no soak: seconds, for the edit-test loop.
test-fast: install
	$(VENV)/bin/python $(PYTEST) tests/unit tests/mocked

# make demo KV_CONNECTOR=nixl-push DISPATCH=concurrent: vLLM's push mode, both legs sent at once.
demo: install
	$(VENV)/bin/python examples/demo.py --kv-connector $(or $(KV_CONNECTOR),nixl) --dispatch $(or $(DISPATCH),sequential)

# Client CPU and latency against the same two calls written by hand, on loopback stubs.
bench-client-overhead: install
	$(VENV)/bin/python benchmarks/bench_client_overhead.py $(ARGS)

# Decode TTFT with forwarded ids versus without, on a LocalPD pair it starts (~1.5 h here).
# ARGS="--prefill URL --decode URL ..." for another pair; see the script's docstring.
bench-decode-ttft: install
	$(VENV)/bin/python benchmarks/bench_decode_ttft.py $(ARGS)

# pdclient (in process, and as `pdclient serve`) against vllm-router and vLLM's toy proxy:
# ARGS=pair (client TTFT on a LocalPD pair; nothing else on the cores) or ARGS=stubs
# (added latency and throughput on loopback stubs). The peers: benchmarks/peers/README.md.
bench-proxies: install
	$(VENV)/bin/python benchmarks/bench_proxies.py $(ARGS)

# Concurrent against sequential dispatch on a push-mode pair, with the pull pair and vllm-router as peers.
bench-dispatch: install
	$(VENV)/bin/python benchmarks/bench_dispatch.py $(ARGS)

# pdclient serve's own CPU per call against another revision, in process: ARGS="--against REV".
bench-serve-cpu: install
	$(VENV)/bin/python benchmarks/bench_serve_cpu.py $(ARGS)

# Decode migration: the caller's pause when a decode server is SIGKILLed mid-answer, against
# a full retry, on a trio it starts (~20 min; run it with nothing else on the machine's cores).
bench-migration: install
	$(VENV)/bin/python benchmarks/bench_migration.py $(ARGS)

# remote_prefill "auto" against "always" through PDChatClient: multi-turn chat and tool-loop
# conversations on a pair from $PDCLIENT_{PREFILL,DECODE}_BASE_URL or a LocalPD it starts
# (~30 min at 6 rounds on this loaded machine; its timings want the cores to themselves).
bench-conversations: install
	$(VENV)/bin/python benchmarks/bench_conversations.py $(ARGS)

# vLLM's own multi-turn benchmark (from the vLLM sdist, unchanged) against pdclient serve (auto, always),
# vllm-router, vLLM's multi-turn P/D proxy and the decode alone, on one LocalPD pair it starts
# (~30 min at 3 rounds; its timings want the cores to themselves). ARGS="--workload long",
# ARGS="--workload tool-loop --clients 4" (short tool results, 80-token answers),
# ARGS="--quick" (1 round, 6 conversations), ARGS='--serve-args="--some-flag 1"' for both pdclient arms.
bench-multiturn: install
	$(VENV)/bin/python benchmarks/bench_multiturn.py $(ARGS)

# auto's predicted cached tokens against the decode server's own count, with KV events and
# with the estimator alone, on a LocalPD with a small KV cache and more conversations than fit.
bench-kv-accuracy: install
	$(VENV)/bin/python benchmarks/bench_kv_accuracy.py $(ARGS)
