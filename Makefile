# Two entry points that work on a fresh CPU machine: `make demo` and `make test`.
# The environment lives in .venv (override with VENV=...). A torch already importable there is
# kept as is; otherwise torch==2.13.0 is installed (on the CPU machines of this project that
# resolves to the CPU build on local disk; never let pip pick a bare `torch`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attn_ops-installed

.PHONY: demo test test-hf-paged wheel-check install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m attn_ops demo

# Two workers (the suite is compile-bound, one core each), a test file to a worker: a file's
# tests share their compiled kernels and module setup, which per-test dealing repeats on both.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile
	$(MAKE) --no-print-directory test-hf-paged

# The HF tests again over transformers 5.17, the last release that accepts a third-party
# continuous-batching name, so "paged|attn_ops" runs here too, not only on the GPU machine.
# Installed beside $(VENV), not into it (its newer transformers stays); psutil is what HF's
# continuous batching sizes its cache by on a CPU.
HF_PAGED := $(VENV)/transformers-5.17
$(HF_PAGED)/.installed: $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(HF_PAGED) "transformers==5.17.0" \
		"huggingface-hub==1.5.0" "httpx==0.29.0" "httpcore==1.0.9" "certifi==2026.10.19.post1" \
		"psutil==7.2.2"
	touch $@

test-hf-paged: $(HF_PAGED)/.installed
	PYTHONPATH=$(HF_PAGED) ATTN_OPS_EXPECT_PAGED=1 $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_hf_integration.py

# The package as a user installs it: build the wheel, install it into a fresh virtualenv and run
# both demos and the console script from there, in a temporary folder so that the checkout is not
# importable; attn_ops must load from that virtualenv. The virtualenv has no copy of the
# dependencies: a .pth line puts $(VENV)'s site-packages after its own (torch is large). Python
# processes .pth files only in site-packages folders, not in folders a .pth line adds, so
# $(VENV)'s editable install of attn_ops stays inactive there. build/ is removed before and after:
# setuptools copies into it without deleting, so a stale file there would end up in the wheel.
# Inductor's cache is the user's usual one.
wheel-check: $(STAMP)
	@set -eu; start=$$(date +%s); tmp=$$(mktemp -d); trap 'rm -rf "$$tmp" "$(CURDIR)/build"' EXIT; \
	py="$(abspath $(PY))"; wpy="$$tmp/venv/bin/python"; rm -rf build; \
	echo "== build the wheel"; \
	"$$py" -m pip wheel -q --no-deps --no-build-isolation -w "$$tmp/dist" .; \
	echo "== install $$(cd "$$tmp/dist" && ls *.whl) into a fresh virtualenv"; \
	"$$py" -m venv --without-pip "$$tmp/venv"; \
	"$$py" -m pip --python "$$wpy" install -q --no-deps "$$tmp"/dist/*.whl; \
	site=$$("$$wpy" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'); \
	"$$py" -c 'import sysconfig; print(*dict.fromkeys(sysconfig.get_path(k) for k in ("purelib", "platlib")), sep="\n")' > "$$site/_wheel_check_deps.pth"; \
	cd "$$tmp"; unset PYTHONPATH; \
	where=$$("$$wpy" -c 'import os, attn_ops, attn_ops.backends.ssm as b, attn_ops.compile_passes as c; \
		print(os.path.commonpath([attn_ops.__file__, b.__file__, c.__file__]))'); \
	case "$$where" in "$(CURDIR)"/*|"$(CURDIR)") echo "attn_ops loads from the checkout: $$where"; exit 1;; \
		"$$site/attn_ops") echo "attn_ops loads from $$where";; \
		*) echo "attn_ops loads from $$where, not from the wheel in $$site"; exit 1;; esac; \
	echo "== attn-ops --help"; "$$tmp/venv/bin/attn-ops" --help > /dev/null; \
	echo "== python -m attn_ops demo"; "$$wpy" -m attn_ops demo; \
	echo "== python -m attn_ops demo --hybrid gated_deltanet"; \
	"$$wpy" -m attn_ops demo --hybrid gated_deltanet; \
	echo "== wheel-check passed in $$(( $$(date +%s) - start )) s"

clean:
	rm -rf $(VENV) build *.egg-info
