"""The kernels of an MLA step's MHA part: ragged attention with QK ``nope + rope`` and V
``v_head_dim`` widths and a natural-log LSE, over the new tokens (causal) and over each context
chunk (no mask). :func:`mha_kernel` returns the one :func:`attn_ops.routing.mla_prefill_kernel`
picks for a device and head dims: FlashAttention 4, FlashInfer's ragged prefill, or PyTorch."""

from __future__ import annotations

import functools
from itertools import pairwise

import torch

from attn_ops.backends.flashinfer import LN2
from attn_ops.backends.mla.reference import mha_torch
from attn_ops.routing import Kernel, mla_prefill_kernel

__all__ = ["mha_fa4", "mha_flashinfer", "mha_kernel"]


def mha_fa4(q, k, v, cu_q, cu_k, cu_q_host, cu_k_host, out, lse, scale, causal) -> None:
    """FlashAttention 4's varlen forward on dense ragged K/V (causal bottom-right aligned).
    Requests with no keys (a context chunk that holds none of theirs) get ``out = 0`` and
    ``lse = -inf``, what the LSE merge reads as empty."""
    from flash_attn.cute.interface import _flash_attn_fwd

    lens_q = [b - a for a, b in pairwise(cu_q_host)]
    lens_k = [b - a for a, b in pairwise(cu_k_host)]
    lse_hm = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    _flash_attn_fwd(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q=cu_q,
                    cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q, default=0),
                    max_seqlen_k=max(lens_k, default=0), softmax_scale=scale, causal=causal,
                    return_lse=True, out=out, lse=lse_hm)
    lse.copy_(lse_hm.t())
    _set_empty(out, lse, lens_q, lens_k)


def _set_empty(out, lse, lens_q, lens_k) -> None:
    """Rows of requests without keys: ``out = 0``, ``lse = -inf`` (whatever a kernel left)."""
    if any(n_k == 0 and n_q for n_q, n_k in zip(lens_q, lens_k)):
        empty = torch.repeat_interleave(
            torch.tensor([n_k == 0 for n_k in lens_k], device=out.device),
            torch.tensor(lens_q, device=out.device), output_size=out.shape[0])
        out.masked_fill_(empty[:, None, None], 0.0)
        lse.masked_fill_(empty[:, None], float("-inf"))


_RAGGED: dict = {}  # device -> FlashInfer's ragged prefill wrapper (planned per call)


def _ragged_wrapper(device: torch.device):
    wrapper = _RAGGED.get(device)
    if wrapper is None:
        import flashinfer

        from attn_ops.backends.flashinfer_plan import float_workspace

        fa3 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
        wrapper = _RAGGED[device] = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(
            float_workspace(device), "NHD", backend="fa3" if fa3 else "fa2")
    return wrapper


def mha_flashinfer(q, k, v, cu_q, cu_k, cu_q_host, cu_k_host, out, lse, scale, causal) -> None:
    """FlashInfer's ragged prefill (fa3 on sm90, fa2 elsewhere), planned on the host from the
    host offsets at each call; its base-2 LSE converted to natural log; requests without keys
    set empty."""
    wrapper = _ragged_wrapper(q.device)
    host = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    wrapper.plan(host(cu_q_host), host(cu_k_host), q.shape[1], k.shape[1], q.shape[2],
                 head_dim_vo=v.shape[2], causal=causal, sm_scale=scale, q_data_type=q.dtype)
    lse2 = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    wrapper.run(q.contiguous(), k.contiguous(), v.contiguous(), out=out, lse=lse2,
                return_lse=True)
    torch.mul(lse2, LN2, out=lse)
    _set_empty(out, lse, [b - a for a, b in pairwise(cu_q_host)],
               [b - a for a, b in pairwise(cu_k_host)])


@functools.cache
def _fa4_usable(device: torch.device, head_dim: int, v_head_dim: int) -> bool:
    if device.type != "cuda":
        return False
    from attn_ops.backends.flash_attn import GENERATIONS
    from attn_ops.backends.flash_attn_kernels import fa4_head_dim_reasons
    from attn_ops.platforms import current_platform
    from attn_ops.spec import AttentionSpec

    fa4, platform = GENERATIONS[4], current_platform()
    cap = platform.capability
    spec = AttentionSpec(num_heads=1, head_dim=head_dim, head_dim_v=v_head_dim,
                         dtype=torch.bfloat16)
    return (fa4.package.reason("", platform) is None and cap is not None
            and fa4.min_capability <= cap <= fa4.max_capability and max(head_dim, v_head_dim) <= 256
            and not fa4_head_dim_reasons("", spec, platform))


@functools.cache
def _flashinfer_usable(device: torch.device, head_dim: int, v_head_dim: int) -> bool:
    if device.type != "cuda" or head_dim % 16 or v_head_dim % 16 or max(head_dim,
                                                                       v_head_dim) > 256:
        return False
    from attn_ops.backends.flashinfer import FLASHINFER_PACKAGE
    from attn_ops.platforms import current_platform

    return FLASHINFER_PACKAGE.reason("", current_platform()) is None


def mha_kernel(device: torch.device, head_dim: int, v_head_dim: int, requests: int = 0,
               flashinfer_max_requests: int = 0):
    """The MHA-part kernel for ``device``, the (QK, V) head dims and ``requests`` MHA-form
    requests (:func:`attn_ops.routing.mla_prefill_kernel`)."""
    kernel = mla_prefill_kernel(_fa4_usable(device, head_dim, v_head_dim),
                                _flashinfer_usable(device, head_dim, v_head_dim), requests,
                                flashinfer_max_requests)
    return {Kernel.FA4: mha_fa4, Kernel.FLASHINFER_RAGGED: mha_flashinfer,
            Kernel.TORCH_MHA: mha_torch}[kernel]
