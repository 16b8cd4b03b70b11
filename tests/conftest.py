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
