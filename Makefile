# Two entry points that work on a fresh CPU machine: `make demo` and `make test`.
# The environment lives in .venv (override with VENV=...). A torch already importable there is
# kept as is; otherwise torch==2.13.0 is installed (on the CPU machines of this project that
# resolves to the CPU build on local disk; never let pip pick a bare `torch`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attn_ops-installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m attn_ops demo

test: $(STAMP)  # two workers: the suite is compile-bound, one core each
	$(PY) -m pytest -q -p no:cacheprovider -n 2

clean:
	rm -rf $(VENV) build *.egg-info
