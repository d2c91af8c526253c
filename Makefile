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

# kvtether bench: every strategy on one scenario; results in .kvtether/bench/results-*/ unless
# BENCH_ARGS names --out. What it measures and how to read it: docs/benchmark.md.
bench: setup
	$(PY) -m kvtether bench $(BENCH_ARGS)

bench-idle: setup
	$(PY) -m kvtether bench idle

# Re-run examples/*.ipynb on one bundled smol stack and save them with their outputs (~10 min).
notebooks: setup
	$(PY) scripts/run-notebooks.py

clean:
	-$(PY) -m kvtether stack down 2>/dev/null
	rm -rf $(VENV) .kvtether
