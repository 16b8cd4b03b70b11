"""What the recurrent ops share: the varlen batch as token -> request maps and as a padded
``[requests, max_query_len]`` gather, both computed on the device from ``query_start_loc``
(no host reads, so the ops capture in CUDA graphs), and the checks of the step tensors."""

from __future__ import annotations

import functools

import torch

__all__ = ["check_step", "chunked_step_kernel", "compute_dtype", "padded_tokens", "split_slots",
           "step_writes", "token_requests", "triton_available", "use_triton"]


def split_slots(state_indices: torch.Tensor):
    """``(read, writes)`` of ``state_indices``: ``[B]`` -- each request reads and writes its
    final state at one slot (``writes`` None); ``[B, 1 + W]`` (speculative decoding) -- it
    reads column 0 (the slot of its last accepted position) and writes its state after its
    ``i``-th new token to column ``1 + min(i, W - 1)``: a decode of ``1 + K <= W`` tokens keeps
    the state of every position, a longer request (a prefill, ``W = 1``) its final state."""
    idx = state_indices.long()
    if idx.dim() == 1:
        return idx, None
    return idx[:, 0], idx[:, 1:]


def step_writes(writes: torch.Tensor, lens: torch.Tensor, i: int) -> torch.Tensor:
    """``[B]``: where the state after each request's ``i``-th new token goes (see
    :func:`split_slots`; the null slot 0 where it is not kept)."""
    w = writes.shape[1]
    kept = (lens > i) & ((i < w - 1) | (lens == i + 1))
    return torch.where(kept, writes[:, min(i, w - 1)], 0)


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` runs its Triton kernels (:func:`attn_ops.routing.ssm_kernel`)."""
    from attn_ops.routing import Kernel, ssm_kernel

    return ssm_kernel(x.is_cuda, x.dtype, triton_available()) is Kernel.SSM_TRITON


def chunked_step_kernel(x: torch.Tensor, max_query_len: int, state_indices: torch.Tensor):
    """``(kernel, Tuning.ssm)`` of an op with a chunked kernel for a step
    (:func:`attn_ops.routing.ssm_kernel`)."""
    from attn_ops.routing import ssm_kernel
    from attn_ops.tuning import default_tuning

    tuning = default_tuning().ssm
    return ssm_kernel(x.is_cuda, x.dtype, triton_available(), max_query_len,
                      state_indices.dim() == 1, tuning.chunked_min_query_len), tuning


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp64 for fp64 inputs (the oracle), else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_step(op: str, query_start_loc, state_indices, has_initial_state, state: torch.Tensor,
               state_name: str, dims: dict[str, int] | None = None,
               max_query_len: int | None = None) -> None:
    """The step tensors' shapes and dtypes; with ``dims``, ``state`` must be
    ``[num_slots, *dims.values()]`` (named by ``dims``' keys); ``max_query_len`` >= 0."""
    if dims is not None and (state.dim() != 1 + len(dims)
                             or tuple(state.shape[1:]) != tuple(dims.values())):
        named = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise ValueError(f"{op}: {state_name} must be [num_slots, {named}], got "
                         f"{tuple(state.shape)}")
    if max_query_len is not None and max_query_len < 0:
        raise ValueError(f"{op}: max_query_len={max_query_len} must be >= 0")
    b = state_indices.shape[0] if state_indices.dim() in (1, 2) else -1
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] != b + 1 or (
            state_indices.dim() == 2 and state_indices.shape[1] < 2):
        raise ValueError(f"{op}: query_start_loc must be [num_reqs + 1] and state_indices "
                         f"[num_reqs] (or [num_reqs, 1 + tokens] with speculative decodes), got "
                         f"{tuple(query_start_loc.shape)} and {tuple(state_indices.shape)}")
    if has_initial_state.shape != (b,) or has_initial_state.dtype != torch.bool:
        raise ValueError(f"{op}: has_initial_state must be bool [num_reqs={b}], got "
                         f"{has_initial_state.dtype} {tuple(has_initial_state.shape)}")
    for name, t in (("query_start_loc", query_start_loc), ("state_indices", state_indices)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: {name} must be int32 or int64, got {t.dtype}")
    if state.dim() < 2:
        raise ValueError(f"{op}: {state_name} must be [num_slots, ...], got "
                         f"{tuple(state.shape)}")


def token_requests(query_start_loc: torch.Tensor, num_tokens: int):
    """``(request, position, real)`` of each of ``num_tokens`` rows: its request (rows past the
    last request's tokens -- padding -- get the last request, and ``real`` False) and its
    offset among that request's new tokens."""
    qsl = query_start_loc.long()
    num_reqs = qsl.shape[0] - 1
    tok = torch.arange(num_tokens, device=qsl.device)
    req = torch.searchsorted(qsl[1:], tok, right=True).clamp(max=max(num_reqs - 1, 0))
    real = tok < qsl[-1]
    return req, tok - qsl[req], real


def padded_tokens(query_start_loc: torch.Tensor, max_query_len: int):
    """``(rows, valid)``, both ``[num_reqs, max_query_len]``: the batch row of each request's
    ``i``-th new token (clamped into range where it has none) and whether it has one."""
    qsl = query_start_loc.long()
    offs = torch.arange(max_query_len, device=qsl.device)
    lens = qsl[1:] - qsl[:-1]
    valid = offs[None, :] < lens[:, None]
    rows = torch.where(valid, qsl[:-1, None] + offs[None, :], 0)
    return rows, valid
