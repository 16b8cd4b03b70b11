"""``torch.ops.attn.lightning_attention``: MiniMax's lightning attention (linear attention with a
fixed decay a head) over a step's new tokens, each request continuing from its KV state, and
the state update.

Per head ``h`` with decay ``a_h = exp(-slope_h)``: ``S_t = a_h S_{t-1} + k_t v_t^T``
(``[head_dim, head_dim_v]``), ``o_t = S_t^T q_t`` -- so a token attends to itself undecayed and to
token ``j`` before it with weight ``a_h^(t - j) (q_t . k_j)``, as HF's
``MiniMaxLightningAttention`` computes block by block.

``q`` / ``k`` ``[T, H, D]``, ``v`` ``[T, H, Dv]``, ``slope`` ``[H]`` (positive rates), ``state``
``[slots, H, D, Dv]``. Padding rows, initial states, speculative writes, ``max_query_len`` and the
checks as in :data:`~attn_ops.backends.ssm.gated_deltanet.gated_delta_rule` (q, k and v of one
floating dtype; a state slot outside ``state`` absent). The torch body is the reference and the
CPU path (token by token over all requests at once, fp32; fp64 for fp64 inputs). On GPUs,
Triton: prefills with at least ``Tuning.ssm.chunked_min_query_len`` new tokens in a request (one
slot a request) a chunk at a time, as block-wise linear attention on the tensor cores
(:func:`~attn_ops.backends.ssm.lightning_kernels.lightning_chunked_triton`; with
``Tuning.ssm.lightning_split``, a state hand-off then the chunks' outputs in parallel:
:func:`~attn_ops.backends.ssm.lightning_kernels.lightning_split_triton`), other steps token
by token (:func:`~attn_ops.backends.ssm.triton_kernels.lightning_recurrent_triton`), one program
a request, head and block of value columns.
"""

from __future__ import annotations

import torch

from attn_ops.backends.ssm.common import (check_inputs, check_step, check_step_values,
                                          chunked_step_kernel, compute_dtype, scan_requests,
                                          store_states)
from attn_ops.ops import define_op
from attn_ops.routing import Kernel

__all__ = ["lightning_attention", "lightning_reference"]


def _check(q, k, v, slope, state, query_start_loc, state_indices, has_initial_state,
           max_query_len) -> None:
    op = "lightning_attention"
    if q.dim() != 3 or v.dim() != 3:
        raise ValueError(f"{op}: q, k must be [num_tokens, num_heads, head_dim] and v "
                         f"[num_tokens, num_heads, head_dim_v], got {tuple(q.shape)} and "
                         f"{tuple(v.shape)}")
    check_inputs(op, q.device, {"q": q, "k": k, "v": v, "slope": slope, "state": state},
                 same_dtype=("q", "k", "v"))
    t, h, d = q.shape
    if k.shape != q.shape or v.shape[:2] != (t, h):
        raise ValueError(f"{op}: k must be q's shape {tuple(q.shape)} and v [{t}, {h}, "
                         f"head_dim_v], got {tuple(k.shape)} and {tuple(v.shape)}")
    if slope.shape != (h,):
        raise ValueError(f"{op}: slope must be [num_heads={h}], got {tuple(slope.shape)}")
    check_step(op, query_start_loc, state_indices, has_initial_state, state, "state",
               {"num_heads": h, "head_dim": d, "head_dim_v": v.shape[2]}, max_query_len)


def lightning_reference(q, k, v, slope, state, query_start_loc, state_indices,
                        has_initial_state, max_query_len):
    """The op's torch body, returning ``(o, states, slots)`` in the compute dtype (as
    :func:`~attn_ops.backends.ssm.mamba2.mamba2_reference`)."""
    _check(q, k, v, slope, state, query_start_loc, state_indices, has_initial_state,
           max_query_len)
    return _reference(q, k, v, slope, state, query_start_loc, state_indices, has_initial_state)


def _reference(q, k, v, slope, state, query_start_loc, state_indices, has_initial_state):
    dtype = compute_dtype(q)
    t, h, _ = q.shape
    q, k, v = (u.to(dtype) for u in (q, k, v))
    decay = torch.exp(-slope.to(dtype))[:, None, None]  # [H, 1, 1]

    def step(s, r):  # s: [B, H, D, Dv]
        updated = s * decay + k[r][..., :, None] * v[r][..., None, :]
        return updated, torch.einsum("bhdv,bhd->bhv", updated, q[r])

    out, states, slots, _ = scan_requests(state, query_start_loc, state_indices,
                                          has_initial_state, t, dtype, (h, v.shape[2]), step)
    return out, states, slots


def _impl(q, k, v, slope, state, query_start_loc, state_indices, has_initial_state,
          max_query_len, tuning=None):
    _check(q, k, v, slope, state, query_start_loc, state_indices, has_initial_state,
           max_query_len)
    check_step_values("lightning_attention", query_start_loc, state_indices, q.shape[0],
                      state.shape[0], max_query_len)
    kernel, t = chunked_step_kernel(q, max_query_len, state_indices, tuning)
    args = (q, k, v, slope, state, query_start_loc, state_indices, has_initial_state)
    if kernel is Kernel.SSM_TRITON_CHUNKED and t.lightning_split:
        from attn_ops.backends.ssm.lightning_kernels import lightning_split_triton

        return lightning_split_triton(*args, t.lightning_split_chunk, t.lightning_state_block_v,
                                      t.lightning_output_block_v,
                                      (t.lightning_state_warps, t.lightning_output_warps),
                                      t.lightning_state_block_k)
    if kernel is Kernel.SSM_TRITON_CHUNKED:
        from attn_ops.backends.ssm.lightning_kernels import lightning_chunked_triton

        return lightning_chunked_triton(*args, t.lightning_chunk, t.lightning_chunk_block_v,
                                        t.lightning_chunk_warps)
    if kernel is Kernel.SSM_TRITON:
        from attn_ops.backends.ssm.triton_kernels import lightning_recurrent_triton

        return lightning_recurrent_triton(*args, t.lightning_block_v, t.decode_num_warps,
                                          t.lightning_decode_streaming)
    o, s, slots = _reference(q, k, v, slope, state, query_start_loc, state_indices,
                             has_initial_state)
    store_states(state, slots, s)
    return o.to(v.dtype)


def _fake(q, k, v, slope, state, query_start_loc, state_indices, has_initial_state,
          max_query_len, tuning=None):
    _check(q, k, v, slope, state, query_start_loc, state_indices, has_initial_state,
           max_query_len)
    return torch.empty_like(v)


lightning_attention = define_op(
    "lightning_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor slope, Tensor(a!) state, Tensor query_start_loc, "
    "Tensor state_indices, Tensor has_initial_state, int max_query_len, "
    "Tensor? tuning=None) -> Tensor",
    _impl, _fake)
