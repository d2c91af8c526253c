# Two entry points for a fresh machine: `make demo` and `make test`. Both set up what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
SETUP_INPUTS := pyproject.toml scripts/setup-venv.sh $(wildcard integrations/*/pyproject.toml)
STAMP := $(VENV)/.kvtether-setup-$(shell cat $(SETUP_INPUTS) | sha1sum | cut -c1-12)
# The integrations' tests, where their distributions are installed (Python >= 3.11).
INTEGRATION_TESTS = $$($(PY) -c 'import sys; print("integrations/langgraph/tests integrations/openai-agents/tests" if sys.version_info >= (3, 11) else "")')

.PHONY: setup harnesses demo test test-fast test-compat bench bench-idle notebooks clean

setup: $(STAMP)

$(STAMP): $(SETUP_INPUTS)
	bash scripts/setup-venv.sh $(VENV)
	rm -f $(VENV)/.kvtether-setup-*
	touch $@

# Claude Code, Codex and OpenCode, pinned, for the tests that drive them (needs npm).
harnesses:
	bash scripts/setup-harnesses.sh

demo: setup
	$(PY) -m kvtether demo

test: setup harnesses
	$(PY) -m pytest tests $(INTEGRATION_TESTS) $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-compat

# The integrations against the oldest and newest releases of their framework ranges, each in a
# throwaway virtualenv (~2 min with a warm pip cache; needs the package index).
test-compat: setup
	PYTHON=$(PY) bash scripts/test-compat.sh $(COMPAT_ARGS)

test-fast: setup
	$(PY) -m pytest tests $(INTEGRATION_TESTS) -m "not vllm and not soak" $(PYTEST_ARGS)

# The published benchmark runs in docs/benchmarks/ (~30 min on 2 cores): every strategy on long
# coding-agent sessions (cpu-agents, 16-28K tokens), the same with every kvtether turn through
# prefill (no local prefill: the D->P read on every turn), the crossover grid, and public Claude
# Code traces replayed. BENCH_ARGS adds flags to the first. How to read them: docs/benchmark.md.
BENCH_OUT ?= docs/benchmarks
LONG_SESSIONS := --profile cpu-agents --sessions 6 --turns 8 12 --context-tokens 28000 \
	--system-tokens 10000 --max-output-tokens 64 --stream-fraction 1 --long-tools 1
bench: setup
	$(PY) -m kvtether bench $(LONG_SESSIONS) --out $(BENCH_OUT)/results $(BENCH_ARGS)
	KVTETHER_LOCAL_PREFILL_MAX_TOKENS=0 $(PY) -m kvtether bench $(LONG_SESSIONS) \
		--strategies colocated colocated-instance pd-oneway kvtether \
		--out $(BENCH_OUT)/every-turn-prefill
	rm $(BENCH_OUT)/every-turn-prefill/scenario.json  # results/'s, kept once (<= 3 MB)
	$(PY) -m kvtether bench crossover --out $(BENCH_OUT)/crossover
	$(PY) -m kvtether bench traces tests/fixtures/traces/kv-cache-tester-12.json --sessions 3 \
		--max-turns 10 --max-output-tokens 64 --out $(BENCH_OUT)/traces/scenario.json
	$(PY) -m kvtether bench --profile cpu-agents --scenario $(BENCH_OUT)/traces/scenario.json \
		--strategies colocated colocated-dp pd-oneway kvtether --out $(BENCH_OUT)/traces

bench-idle: setup
	$(PY) -m kvtether bench idle

# Re-run examples/*.ipynb on one bundled smol stack and save them with their outputs (~10 min).
notebooks: setup
	$(PY) scripts/run-notebooks.py

clean:
	-$(PY) -m kvtether stack down 2>/dev/null
	rm -rf $(VENV) .kvtether
