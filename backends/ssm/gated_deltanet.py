"""``torch.ops.attn.gated_delta_rule``: the gated delta rule of Gated DeltaNet over a step's
new tokens, each request continuing from its recurrent state, and the state update.

Per value head, with ``S`` ``[head_k_dim, head_v_dim]``, ``a_t = exp(g_t)``:
``S_t = a_t S_{t-1} + k_t (beta_t (v_t - (a_t S_{t-1})^T k_t))^T``, ``o_t = S_t^T q_t``
(q and k L2-normalized first with ``qk_l2norm``, q times ``scale``; each k head serves
``num_v_heads / num_k_heads`` consecutive v heads).

``q`` / ``k`` ``[T, Hk, Dk]``, ``v`` ``[T, Hv, Dv]``, ``g`` / ``beta`` ``[T, Hv]`` (the log
decay and the write strength, gating already applied), ``state`` ``[slots, Hv, Dk, Dv]``;
``max_query_len`` bounds the new tokens of any request (a host int: a decode-only step's is 1).
Rows past ``query_start_loc[-1]`` are padding (output 0); a request without
``has_initial_state`` starts from zeros; every request's slot receives its final state. The
torch body is the reference and the CPU path: a token-by-token recurrence over all requests at
once, in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch

from attn_ops.backends.ssm.common import (check_step, chunked_step_kernel, compute_dtype,
                                          padded_tokens, split_slots, step_writes)
from attn_ops.routing import Kernel
from attn_ops.ops import define_op

__all__ = ["gated_delta_rule", "gdn_reference", "l2norm"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last dim (fla's and HF's form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _check(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
           max_query_len) -> None:
    op = "gated_delta_rule"
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: q and k must be [num_tokens, num_k_heads, head_k_dim] and v "
                         f"[num_tokens, num_v_heads, head_v_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"{op}: num_v_heads={hv} must be a multiple of num_k_heads={hk}")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (t, hv):
            raise ValueError(f"{op}: {name} must be [num_tokens={t}, num_v_heads={hv}], got "
                             f"{tuple(x.shape)}")
    check_step(op, query_start_loc, state_indices, has_initial_state, state, "state",
               {"num_v_heads": hv, "head_k_dim": dk, "head_v_dim": dv}, max_query_len)


def gdn_reference(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
                  max_query_len, scale, qk_l2norm):
    """The op's torch body, returning ``(o, states, slots)`` in the compute dtype: the output
    and the states the step writes at ``slots`` (nothing written here)."""
    _check(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
           max_query_len)
    dtype = compute_dtype(v)
    t, hk, _ = q.shape
    hv = v.shape[1]
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    if hv != hk:
        q, k = (x.repeat_interleave(hv // hk, dim=1) for x in (q, k))
    init = has_initial_state[:, None, None, None]
    read, writes = split_slots(state_indices)
    s = state[read].to(dtype)
    s = torch.where(init, s, torch.zeros_like(s))  # [B, Hv, Dk, Dv]
    out = v.new_zeros(t + 1, hv, v.shape[2])  # (row t: where steps without a token write)
    rows, valid = padded_tokens(query_start_loc, max_query_len)
    lens = valid.sum(1)
    written, slots = [], []
    for i in range(max_query_len):
        r, ok = rows[:, i], valid[:, i]
        decayed = s * g[r].exp()[..., None, None]
        kv = (decayed * k[r][..., None]).sum(-2)  # (a S)^T k: [B, Hv, Dv]
        delta = (v[r] - kv) * beta[r][..., None]
        updated = decayed + k[r][..., None] * delta[..., None, :]
        s = torch.where(ok[:, None, None, None], updated, s)
        o = (s * q[r][..., None]).sum(-2)
        out.index_copy_(0, torch.where(ok, r, t), o)
        if writes is not None:
            written.append(s)
            slots.append(step_writes(writes, lens, i))
    if writes is None:
        return out[:t], s, read
    return out[:t], torch.cat(written or [s[:0]]), torch.cat(slots or [read[:0]])


def _impl(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
          max_query_len, scale, qk_l2norm):
    kernel, tuning = chunked_step_kernel(v, max_query_len, state_indices)
    if kernel is not Kernel.SSM_TORCH:
        from attn_ops.backends.ssm import triton_kernels as tk

        _check(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
               max_query_len)
        if kernel is Kernel.SSM_TRITON_CHUNKED:
            from attn_ops.backends.ssm.chunked_kernels import gdn_chunked_triton

            return gdn_chunked_triton(q, k, v, g, beta, state, query_start_loc, state_indices,
                                      has_initial_state, scale, qk_l2norm, tuning.gdn_chunk,
                                      tuning.gdn_state_block_v, tuning.gdn_output_block_v,
                                      (tuning.gdn_wy_warps, tuning.gdn_state_warps,
                                       tuning.gdn_output_warps), tuning.gdn_state_min_programs)
        return tk.gdn_recurrent_triton(q, k, v, g, beta, state, query_start_loc, state_indices,
                                       has_initial_state, scale, qk_l2norm,
                                       tuning.decode_block_v, tuning.decode_num_warps,
                                       tuning.decode_min_programs, tuning.gdn_decode_streaming)
    o, s, slots = gdn_reference(q, k, v, g, beta, state, query_start_loc, state_indices,
                                has_initial_state, max_query_len, scale, qk_l2norm)
    state.index_copy_(0, slots, s.to(state.dtype))
    return o.to(v.dtype)


def _fake(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
          max_query_len, scale, qk_l2norm):
    _check(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
           max_query_len)
    return torch.empty_like(v)


gated_delta_rule = define_op(
    "gated_delta_rule",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, "
    "Tensor query_start_loc, Tensor state_indices, Tensor has_initial_state, int max_query_len, "
    "float scale, bool qk_l2norm) -> Tensor",
    _impl, _fake)
