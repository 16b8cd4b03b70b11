"""``torch.ops.attn.gated_delta_rule``: the gated delta rule of Gated DeltaNet over a step's
new tokens, each request continuing from its recurrent state, and the state update.

Per value head, with ``S`` ``[head_k_dim, head_v_dim]``, ``a_t = exp(g_t)``:
``S_t = a_t S_{t-1} + k_t (beta_t (v_t - (a_t S_{t-1})^T k_t))^T``, ``o_t = S_t^T q_t``
(q and k L2-normalized first with ``qk_l2norm``, q times ``scale``; each k head serves
``num_v_heads / num_k_heads`` consecutive v heads).

``q`` / ``k`` ``[T, Hk, Dk]``, ``v`` ``[T, Hv, Dv]``, ``g`` / ``beta`` ``[T, Hv]`` (the log
decay and the write strength, gating already applied), ``state`` ``[slots, Hv, Dk, Dv]``;
``max_query_len`` bounds the new tokens of any request (a host int: a decode-only step's is 1;
it picks the kernel, and no token is dropped by it). Rows past ``query_start_loc[-1]`` are
padding (output 0); a request without ``has_initial_state`` starts from zeros; every request's
slot receives its final state. The torch body is the reference and the CPU path: a
token-by-token recurrence over all requests at once, in fp32 (fp64 for fp64 inputs).

Inputs served or refused: shapes, dtypes (q, k, v of one floating dtype; g, beta and ``state``
floating) and devices are checked at every call; ``query_start_loc``'s values where they are
on the host (from 0, never decreasing, at most ``T``) and ``max_query_len`` against them, all
with a ``ValueError`` naming the values. A state slot is a device-side index: one outside
``state`` (``< 0`` or ``>= slots``) is absent -- its request runs from a zero state, as without
an initial state, and no state of it is written -- in the torch body and the kernels alike,
with no host sync; with debug checks (:func:`attn_ops.set_debug_checks`) the op raises on the
first one instead.
"""

from __future__ import annotations

import torch

from attn_ops.backends.ssm.common import (check_inputs, check_step, check_step_values,
                                          chunked_step_kernel, compute_dtype, scan_requests,
                                          store_states)
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
    check_inputs(op, q.device, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state},
                 same_dtype=("q", "k", "v"))
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
    and the states the step writes at ``slots`` (nothing written here; slots outside ``state``
    are absent: :func:`~attn_ops.backends.ssm.common.store_states`). It steps through every
    request's new tokens whatever ``max_query_len`` says
    (:func:`~attn_ops.backends.ssm.common.padded_steps`)."""
    _check(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
           max_query_len)
    return _reference(q, k, v, g, beta, state, query_start_loc, state_indices,
                      has_initial_state, scale, qk_l2norm)


def _reference(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
               scale, qk_l2norm):
    dtype = compute_dtype(v)
    t, hk, _ = q.shape
    hv = v.shape[1]
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    if hv != hk:
        q, k = (x.repeat_interleave(hv // hk, dim=1) for x in (q, k))

    def step(s, r):  # s: [B, Hv, Dk, Dv]
        decayed = s * g[r].exp()[..., None, None]
        kv = (decayed * k[r][..., None]).sum(-2)  # (a S)^T k: [B, Hv, Dv]
        delta = (v[r] - kv) * beta[r][..., None]
        updated = decayed + k[r][..., None] * delta[..., None, :]
        return updated, (updated * q[r][..., None]).sum(-2)

    out, states, slots, _ = scan_requests(state, query_start_loc, state_indices,
                                          has_initial_state, t, dtype, (hv, v.shape[2]), step)
    return out, states, slots


def _impl(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
          max_query_len, scale, qk_l2norm, tuning=None):
    _check(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
           max_query_len)
    check_step_values("gated_delta_rule", query_start_loc, state_indices, q.shape[0],
                      state.shape[0], max_query_len)
    kernel, tuning = chunked_step_kernel(v, max_query_len, state_indices, tuning)
    if kernel is not Kernel.SSM_TORCH:
        from attn_ops.backends.ssm import triton_kernels as tk

        if kernel is Kernel.SSM_TRITON_CHUNKED:
            from attn_ops.backends.ssm.chunked_kernels import gdn_chunked_triton

            return gdn_chunked_triton(q, k, v, g, beta, state, query_start_loc, state_indices,
                                      has_initial_state, scale, qk_l2norm, tuning.gdn_chunk,
                                      tuning.gdn_state_block_v, tuning.gdn_output_block_v,
                                      (tuning.gdn_wy_warps, tuning.gdn_state_warps,
                                       tuning.gdn_output_warps), tuning.gdn_state_min_programs,
                                      tuning.gdn_state_stages)
        return tk.gdn_recurrent_triton(q, k, v, g, beta, state, query_start_loc, state_indices,
                                       has_initial_state, scale, qk_l2norm,
                                       tuning.decode_block_v, tuning.decode_num_warps,
                                       tuning.decode_min_programs, tuning.gdn_decode_streaming)
    o, s, slots = _reference(q, k, v, g, beta, state, query_start_loc, state_indices,
                             has_initial_state, scale, qk_l2norm)
    store_states(state, slots, s)
    return o.to(v.dtype)


def _fake(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
          max_query_len, scale, qk_l2norm, tuning=None):
    _check(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
           max_query_len)
    return torch.empty_like(v)


gated_delta_rule = define_op(
    "gated_delta_rule",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, "
    "Tensor query_start_loc, Tensor state_indices, Tensor has_initial_state, int max_query_len, "
    "float scale, bool qk_l2norm, Tensor? tuning=None) -> Tensor",
    _impl, _fake)
