"""The recurrent-state family's routing: which kernels an op runs."""

from __future__ import annotations

import torch

from attn_ops.routing.common import Kernel

__all__ = ["ssm_kernel"]

def ssm_kernel(on_gpu: bool, dtype: torch.dtype, triton_available: bool,
               max_query_len: int = 1, one_slot: bool = True,
               chunked_min_query_len: int | None = None) -> Kernel:
    """The kernels of a recurrent-state op (``backends/ssm``): Triton on GPUs for 16- and
    32-bit inputs (they compute in fp32), else the torch body -- on the CPU, and for fp64, the
    oracle's precision, which fp32 kernels must not round. Ops with a chunked kernel
    (``chunked_min_query_len`` given: ``Tuning.ssm``) run it for steps whose longest request
    has at least that many new tokens, one state slot a request."""
    if not (on_gpu and triton_available and dtype != torch.float64):
        return Kernel.SSM_TORCH
    if chunked_min_query_len is not None and one_slot and max_query_len >= chunked_min_query_len:
        return Kernel.SSM_TRITON_CHUNKED
    return Kernel.SSM_TRITON
