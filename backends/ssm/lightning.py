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
CPU path (token by token over all requests at once, fp32; fp64 for fp64 inputs); on GPUs the
Triton kernel (:func:`~attn_ops.backends.ssm.triton_kernels.lightning_recurrent_triton`) steps
token by token, one program a request, head and block of value columns.
"""

from __future__ import annotations

import torch

from attn_ops.backends.ssm.common import (check_inputs, check_step, check_step_values,
                                          compute_dtype, padded_steps, padded_tokens,
                                          read_states, sanitized_starts, split_slots,
                                          ssm_tuning, step_writes, store_states, use_triton)
from attn_ops.ops import define_op

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
    read, writes = split_slots(state_indices)
    s = read_states(state, read, has_initial_state, dtype)  # [B, H, D, Dv]
    out = v.new_zeros(t + 1, h, v.shape[2])
    query_start_loc = sanitized_starts(query_start_loc, t)  # (no row outside the batch)
    steps = padded_steps(query_start_loc, t)
    rows, valid = padded_tokens(query_start_loc, steps)
    lens = valid.sum(1)
    written, slots = [], []
    for i in range(steps):
        r, ok = rows[:, i], valid[:, i]
        updated = s * decay + k[r][..., :, None] * v[r][..., None, :]
        s = torch.where(ok[:, None, None, None], updated, s)
        out.index_copy_(0, torch.where(ok, r, t), torch.einsum("bhdv,bhd->bhv", s, q[r]))
        if writes is not None:
            written.append(s)
            slots.append(step_writes(writes, lens, i))
    o = out[:t]
    rows_real = torch.arange(t, device=q.device) < query_start_loc[-1]
    o = torch.where(rows_real[:, None, None], o, torch.zeros_like(o))
    if writes is None:
        return o, s, read
    return o, torch.cat(written or [s[:0]]), torch.cat(slots or [read[:0]])


def _impl(q, k, v, slope, state, query_start_loc, state_indices, has_initial_state,
          max_query_len, tuning=None):
    _check(q, k, v, slope, state, query_start_loc, state_indices, has_initial_state,
           max_query_len)
    check_step_values("lightning_attention", query_start_loc, state_indices, q.shape[0],
                      state.shape[0], max_query_len)
    if use_triton(q):
        from attn_ops.backends.ssm.triton_kernels import lightning_recurrent_triton

        t = ssm_tuning(tuning)
        return lightning_recurrent_triton(q, k, v, slope, state, query_start_loc,
                                          state_indices, has_initial_state,
                                          t.lightning_block_v, t.decode_num_warps)
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
    "Tensor state_indices, Tensor has_initial_state, int max_query_len, Tensor? tuning=None) -> Tensor",
    _impl, _fake)
