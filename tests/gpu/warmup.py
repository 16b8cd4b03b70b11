"""Compile (in parallel) every FlashInfer kernel the GPU test matrix will need, so the tests
themselves never wait on nvcc. Run on the GPU machine before the tests:

    python tests/gpu/warmup.py
"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attn_ops.backends.flashinfer_plan import warmup  # noqa: E402
from test_backends_matrix import _params  # noqa: E402
from test_flashinfer import SPEC  # noqa: E402
from test_ops import SPECS  # noqa: E402

from attn_ops import current_platform, get_backend_class  # noqa: E402

platform = current_platform()
fi = get_backend_class("FLASHINFER")
specs = {p.values[1] for p in _params() if p.values[0] == "FLASHINFER"}
specs |= set(SPECS.values()) | {SPEC.with_(sliding_window=100, has_sinks=True)}
specs = [s for s in specs if not fi.not_supported_reasons(s, platform)]
major = torch.cuda.get_device_capability()[0]
t0 = time.time()
with ThreadPoolExecutor(max_workers=8) as pool:
    list(pool.map(lambda s: warmup(s, major), specs))
print(f"warmup: {len(specs)} specs compiled in {time.time() - t0:.0f} s")
