# Two entry points for a fresh machine: `make demo` and `make test`. Both set up what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtether-setup-$(shell cat pyproject.toml scripts/setup-venv.sh | sha1sum | cut -c1-12)

.PHONY: setup demo test test-fast bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup-venv.sh
	bash scripts/setup-venv.sh $(VENV)
	rm -f $(VENV)/.kvtether-setup-*
	touch $@

demo: setup
	$(PY) -m kvtether demo

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest tests -m "not vllm" $(PYTEST_ARGS)

bench: setup
	$(PY) -m kvtether bench idle

clean:
	-$(PY) -m kvtether stack down 2>/dev/null
	rm -rf $(VENV) .kvtether
