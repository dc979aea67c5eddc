# Two entry points: `make demo` and `make test`. Both build ./.venv themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# On the project's CPU machines the CPU build of torch lies in /opt/wheels; elsewhere pip's own index is used.
WHEELS := $(wildcard /opt/wheels)
PIP    := $(PY) -m pip install -q $(if $(WHEELS),--find-links $(WHEELS))
# Never let a range pull the multi-GB CUDA build where the local CPU wheel exists.
TORCH  := $(if $(wildcard /opt/wheels/torch-2.13.0*),torch==2.13.0,torch>=2.11)

.PHONY: demo test install install-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH)"
	$(PIP) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(VENV)/bin/mhla-convert demo

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
