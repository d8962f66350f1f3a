# kvroute — the two commands a newcomer needs:
#   make up     set up the project-local venv, then run the gateway + local workers
#   make test   set up the project-local venv, then run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
WORKERS ?= 4
ARGS ?=

.PHONY: venv up test test-slow test-all lint bench clean

# torch==2.13.0 (extra `worker`) resolves to the CPU wheel on this machine's disk;
# it is pinned so pip never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,worker,loadtest]'
	touch $(STAMP)

venv: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/kvroute up --sim --workers $(WORKERS) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(ARGS)

# ruff over the tree; mypy over every package (strict where pyproject says so).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy kvindex kvwire router workers loadtest kvroute

# The adversarial suite (docs/harden.md): a real gateway and workers, every case, one table;
# exit 1 on any hung/lost/wrong answer or disallowed 5xx. SIZE=full: the issue's numbers; CASES=a,b.
.PHONY: harden
harden: $(STAMP)
	$(VENV)/bin/kvroute loadtest harden --size $(or $(SIZE),small) $(if $(CASES),--cases $(CASES)) $(ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -m '' $(ARGS)

bench: $(STAMP)
	@failed=""; for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || failed="$$failed $$b"; done; \
	if [ -n "$$failed" ]; then echo "failed:$$failed (the trace benchmarks need LOADTEST_TRACES)"; exit 1; fi

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
