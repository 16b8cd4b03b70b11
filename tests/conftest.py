import dataclasses
import os

import pytest
import torch

# Without a GPU, Triton kernels (TRITON_ATTN) run in Triton's interpreter. It must be chosen
# before any kernel is decorated, i.e. before the backends are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    # A developer's ATTN_OPS_BACKEND must not change what the tests select.
    monkeypatch.delenv("ATTN_OPS_BACKEND", raising=False)


# Triton's interpreter checks every int32 add, subtract and multiply of a kernel for overflow
# (each recomputed in int64 and asserted: about a third of its time). The CPU tests' tensors are
# far below 2**31 elements, so only the files whose inputs carry extreme values (ids and lengths
# of 2**30 and 2**31 - 1) keep the check; a kernel compiled for the GPU runs without it anyway.
_OVERFLOW_CHECKED = {"test_fuzz.py", "test_device_indices.py", "test_mla_sparse.py"}


def _interpreter_builder():
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    builder = getattr(interpreter, "interpreter_builder", None)
    return builder if hasattr(getattr(builder, "options", None), "sanitize_overflow") else None


@pytest.fixture(autouse=True)
def _interpreter_overflow_check(request):
    builder = _interpreter_builder()
    if builder is None:
        yield
        return
    before = builder.options
    builder.options = dataclasses.replace(
        before, sanitize_overflow=request.node.path.name in _OVERFLOW_CHECKED)
    yield
    builder.options = before


# A device fault (an illegal address) leaves the process's CUDA context unusable: every later
# test in it would fail for that one cause. Under pytest-xdist the worker that saw one exits
# after reporting it, so the fault is reported once and a fresh worker runs the rest.
_CUDA_FAULTS = ("illegal memory access", "illegal address", "unspecified launch failure",
                "misaligned address")
_FAULTED = pytest.StashKey[bool]()


def pytest_runtest_makereport(item, call):
    if call.excinfo is None or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(fault in str(call.excinfo.value) for fault in _CUDA_FAULTS):
        item.config.stash[_FAULTED] = True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if item.config.stash.get(_FAULTED, False):
        os._exit(3)


@pytest.fixture
def poisoned_buffers(monkeypatch):
    """``torch.empty`` / ``empty_like`` buffers poisoned while the test runs -- floating ones
    with NaN, integer ones with -7: a launch must write every entry of its outputs (padding
    rows included) and read nothing an earlier launch left unwritten, or drop it."""
    def poisoned(make):
        def wrapper(*args, **kwargs):
            out = make(*args, **kwargs)
            if out.is_floating_point():
                return out.fill_(float("nan"))
            return out if out.dtype == torch.bool else out.fill_(-7)
        return wrapper

    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
