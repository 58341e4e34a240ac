VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bootstrap-stamp

.PHONY: demo test bench clean-venv

$(STAMP): setup.cfg pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)
	touch $(STAMP)

## make demo: the Open-SWE workflow on a LocalCluster with a real vLLM CPU engine
demo: $(STAMP)
	$(PY) -m examples.swe --requests 8

## make test: the test suite
test: $(STAMP)
	$(PY) -m pytest -q tests

## make bench: the benchmarks, quick forms (installs the peer frameworks first)
bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench,peers]"
	$(PY) benchmarks/overhead.py --quick --json benchmarks/results/overhead.json
	$(PY) benchmarks/e2e.py --quick --json benchmarks/results/e2e-realistic-quick.json

clean-venv:
	rm -rf $(VENV)
