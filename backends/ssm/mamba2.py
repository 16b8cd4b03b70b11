"""``torch.ops.attn.mamba2_ssd``: Mamba2's selective state space (SSD) recurrence over a step's
new tokens, each request continuing from its SSM state, and the state update.

Per head ``h`` (group ``h / (H / G)`` of B and C), with ``dt' = clamp(softplus(dt + dt_bias),
dt_min, dt_max)`` (softplus with ``dt_softplus``): ``state_t = exp(dt' A_h) state_{t-1} +
dt' x_t B_t^T`` (``[head_dim, d_state]``), ``y_t = state_t C_t + D_h x_t``, times ``silu(z_t)``
where ``z`` is given.

``x`` ``[T, H, P]``, ``dt`` ``[T, H]``, ``A`` ``[H]``, ``B`` / ``C`` ``[T, G, N]``, ``D`` ``[H]`` or
None, ``z`` ``[T, H, P]`` or None, ``dt_bias`` ``[H]`` or None, ``state`` ``[slots, H, P, N]``.
Padding rows, initial states, the final write, ``max_query_len`` and the checks as in
:data:`~attn_ops.backends.ssm.gated_deltanet.gated_delta_rule` (x, B, C and z of one floating
dtype; a state slot outside ``state`` absent: the request runs from a zero state, no state of
it written). The torch body is the reference and the CPU path (token by token over all
requests at once, fp32; fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn_ops.backends.ssm.common import (check_inputs, check_step, check_step_values,
                                          chunked_step_kernel, compute_dtype, scan_requests,
                                          store_states)
from attn_ops.routing import Kernel
from attn_ops.ops import define_op

__all__ = ["mamba2_reference", "mamba2_ssd"]


def _check(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
           has_initial_state, max_query_len) -> None:
    op = "mamba2_ssd"
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be [num_tokens, num_heads, head_dim], got "
                         f"{tuple(x.shape)}")
    check_inputs(op, x.device, {"x": x, "B": B, "C": C, "z": z, "dt": dt, "A": A, "D": D,
                                "dt_bias": dt_bias, "state": state},
                 same_dtype=("x", "B", "C", "z"))
    t, h, p = x.shape
    if B.dim() != 3 or C.shape != B.shape or B.shape[0] != t:
        raise ValueError(f"{op}: B and C must be [num_tokens={t}, n_groups, d_state], got "
                         f"{tuple(B.shape)} and {tuple(C.shape)}")
    g, n = B.shape[1:]
    if h % g:
        raise ValueError(f"{op}: num_heads={h} must be a multiple of n_groups={g}")
    for name, val, want in (("dt", dt, (t, h)), ("A", A, (h,)), ("D", D, (h,)),
                            ("z", z, (t, h, p)), ("dt_bias", dt_bias, (h,))):
        if val is not None and tuple(val.shape) != want:
            raise ValueError(f"{op}: {name} must be {list(want)}, got {tuple(val.shape)}")
    check_step(op, query_start_loc, state_indices, has_initial_state, state, "state",
               {"num_heads": h, "head_dim": p, "d_state": n}, max_query_len)


def mamba2_reference(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
                     has_initial_state, max_query_len, dt_softplus, dt_min, dt_max):
    """The op's torch body, returning ``(y, states, slots)`` in the compute dtype: the output
    and the states the step writes at ``slots`` (nothing written here; slots outside ``state``
    are absent), every request's new tokens whatever ``max_query_len`` says (as
    :func:`~attn_ops.backends.ssm.gated_deltanet.gdn_reference`)."""
    _check(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
           has_initial_state, max_query_len)
    return _reference(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
                      has_initial_state, dt_softplus, dt_min, dt_max)


def _reference(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
               has_initial_state, dt_softplus, dt_min, dt_max):
    dtype = compute_dtype(x)
    t, h, _ = x.shape
    rep = h // B.shape[1]
    x, dt, A, B, C = (u.to(dtype) for u in (x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(dt_min, dt_max)
    B, C = (u.repeat_interleave(rep, dim=1) for u in (B, C))  # [T, H, N]

    def step(s, r):  # s: [B, H, P, N]
        decay = (dt[r] * A).exp()[..., None, None]
        updated = s * decay + (dt[r][..., None] * x[r])[..., None] * B[r][:, :, None, :]
        return updated, (updated * C[r][:, :, None, :]).sum(-1)

    y, states, slots, real = scan_requests(state, query_start_loc, state_indices,
                                           has_initial_state, t, dtype, (h, x.shape[2]), step)
    if D is not None:
        y = y + D.to(dtype)[:, None] * x
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return torch.where(real[:, None, None], y, torch.zeros_like(y)), states, slots


def _impl(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
          has_initial_state, max_query_len, dt_softplus, dt_min, dt_max, tuning=None):
    _check(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
           has_initial_state, max_query_len)
    check_step_values("mamba2_ssd", query_start_loc, state_indices, x.shape[0], state.shape[0],
                      max_query_len)
    kernel, tuning = chunked_step_kernel(x, max_query_len, state_indices, tuning)
    if kernel is not Kernel.SSM_TORCH:
        from attn_ops.backends.ssm import triton_kernels as tk

        args = (x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
                has_initial_state, dt_softplus, dt_min, dt_max)
        if kernel is Kernel.SSM_TRITON_CHUNKED:
            from attn_ops.backends.ssm.chunked_kernels import ssd_chunked_triton

            return ssd_chunked_triton(*args, chunk=tuning.mamba2_chunk,
                                      block=min(tuning.mamba2_block, tuning.mamba2_chunk),
                                      num_warps=tuning.mamba2_num_warps,
                                      state_block_p=tuning.mamba2_state_block_p,
                                      key_block=tuning.mamba2_key_block or None,
                                      num_stages=tuning.mamba2_num_stages,
                                      contrib_block=tuning.mamba2_contrib_block,
                                      contrib_warps=tuning.mamba2_contrib_warps)
        return tk.ssd_recurrent_triton(*args, tuning.decode_block_p, tuning.decode_num_warps,
                                       tuning.mamba2_decode_streaming)
    y, s, slots = _reference(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc,
                             state_indices, has_initial_state, dt_softplus, dt_min, dt_max)
    store_states(state, slots, s)
    return y.to(x.dtype)


def _fake(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
          has_initial_state, max_query_len, dt_softplus, dt_min, dt_max, tuning=None):
    _check(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
           has_initial_state, max_query_len)
    return torch.empty_like(x)


mamba2_ssd = define_op(
    "mamba2_ssd",
    "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, "
    "Tensor(a!) state, Tensor query_start_loc, Tensor state_indices, Tensor has_initial_state, "
    "int max_query_len, bool dt_softplus, float dt_min, float dt_max, "
    "Tensor? tuning=None) -> Tensor",
    _impl, _fake)
