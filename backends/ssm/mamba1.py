"""``torch.ops.attn.mamba1_scan``: Mamba's (Mamba1's) selective scan over a step's new tokens,
each request continuing from its SSM state, and the state update.

Per channel ``d`` with ``dt' = softplus(dt + dt_bias)`` (softplus with ``dt_softplus``):
``state_t[d] = exp(dt'_d A[d]) * state_{t-1}[d] + dt'_d x_t[d] B_t`` (``[d_state]`` a channel,
``A[d]`` its own ``d_state`` rates), ``y_t[d] = state_t[d] . C_t + D[d] x_t[d]``, times
``silu(z_t[d])`` where ``z`` is given. Every channel has its own time step (Mamba2 shares one a
head) and B, C are one ``d_state`` vector a token, shared by the channels.

``x`` ``[T, d_inner]``, ``dt`` ``[T, d_inner]`` (before ``dt_bias``), ``A`` ``[d_inner, d_state]``
(negative: ``-exp(A_log)``), ``B`` / ``C`` ``[T, d_state]``, ``D`` ``[d_inner]`` or None, ``z``
``[T, d_inner]`` or None, ``dt_bias`` ``[d_inner]`` or None, ``state`` ``[slots, d_inner,
d_state]``. Padding rows, initial states, speculative writes, ``max_query_len`` and the checks as
in :data:`~attn_ops.backends.ssm.mamba2.mamba2_ssd` (x, B, C and z of one floating dtype; a
state slot outside ``state`` absent: the request runs from a zero state, none of its states
written). The torch body is the reference and the CPU path (token by token over all requests
at once, fp32; fp64 for fp64 inputs). On GPUs, Triton: prefills with at least
``Tuning.ssm.chunked_min_query_len`` new tokens in a request (one slot a request) a chunk at a
time (:func:`~attn_ops.backends.ssm.mamba1_kernels.mamba1_chunked_triton`; with
``Tuning.ssm.mamba1_unrolled`` token by token with each channel's ``d_state`` row in one
thread: :func:`~attn_ops.backends.ssm.mamba1_kernels.mamba1_unrolled_triton`, over segments of
a request with ``mamba1_unrolled_segment``:
:func:`~attn_ops.backends.ssm.mamba1_kernels.mamba1_segmented_triton`), other steps
token by token (:func:`~attn_ops.backends.ssm.triton_kernels.mamba1_recurrent_triton`), one
program a request and block of channels, the state block in registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn_ops.backends.ssm.common import (check_inputs, check_step, check_step_values,
                                          chunked_step_kernel, compute_dtype, scan_requests,
                                          store_states)
from attn_ops.ops import define_op
from attn_ops.routing import Kernel, mamba1_read_ahead, mamba1_walk_read_ahead

__all__ = ["mamba1_reference", "mamba1_scan"]


def _check(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
           has_initial_state, max_query_len) -> None:
    op = "mamba1_scan"
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [num_tokens, d_inner], got {tuple(x.shape)}")
    check_inputs(op, x.device, {"x": x, "B": B, "C": C, "z": z, "dt": dt, "A": A, "D": D,
                                "dt_bias": dt_bias, "state": state},
                 same_dtype=("x", "B", "C", "z"))
    t, d = x.shape
    if A.dim() != 2 or A.shape[0] != d:
        raise ValueError(f"{op}: A must be [d_inner={d}, d_state], got {tuple(A.shape)}")
    n = A.shape[1]
    for name, val, want in (("dt", dt, (t, d)), ("B", B, (t, n)), ("C", C, (t, n)),
                            ("D", D, (d,)), ("z", z, (t, d)), ("dt_bias", dt_bias, (d,))):
        if val is not None and tuple(val.shape) != want:
            raise ValueError(f"{op}: {name} must be {list(want)}, got {tuple(val.shape)}")
    check_step(op, query_start_loc, state_indices, has_initial_state, state, "state",
               {"d_inner": d, "d_state": n}, max_query_len)


def mamba1_reference(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
                     has_initial_state, max_query_len, dt_softplus):
    """The op's torch body, returning ``(y, states, slots)`` in the compute dtype: the output
    and the states the step writes at ``slots`` (nothing written here), as
    :func:`~attn_ops.backends.ssm.mamba2.mamba2_reference`."""
    _check(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
           has_initial_state, max_query_len)
    return _reference(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
                      has_initial_state, dt_softplus)


def _reference(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
               has_initial_state, dt_softplus):
    dtype = compute_dtype(x)
    t, d = x.shape
    x, dt, A, B, C = (u.to(dtype) for u in (x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)

    def step(s, r):  # s: [B, d_inner, d_state]
        decay = (dt[r][..., None] * A).exp()
        updated = s * decay + (dt[r] * x[r])[..., None] * B[r][:, None, :]
        return updated, (updated * C[r][:, None, :]).sum(-1)

    y, states, slots, real = scan_requests(state, query_start_loc, state_indices,
                                           has_initial_state, t, dtype, (d,), step)
    if D is not None:
        y = y + D.to(dtype) * x
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return torch.where(real[:, None], y, torch.zeros_like(y)), states, slots


def _impl(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
          has_initial_state, max_query_len, dt_softplus, tuning=None):
    _check(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
           has_initial_state, max_query_len)
    check_step_values("mamba1_scan", query_start_loc, state_indices, x.shape[0],
                      state.shape[0], max_query_len)
    kernel, t = chunked_step_kernel(x, max_query_len, state_indices, tuning)
    args = (x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
            has_initial_state, dt_softplus)
    if kernel is Kernel.SSM_TRITON_CHUNKED and t.mamba1_unrolled:
        segment, ahead = _walk_plan(x, A, query_start_loc, max_query_len, t)
        if segment:
            from attn_ops.backends.ssm.mamba1_kernels import mamba1_segmented_triton

            return mamba1_segmented_triton(*args, segment, t.mamba1_unrolled_block_d,
                                           t.mamba1_unrolled_warps, ahead,
                                           t.mamba1_unrolled_y_parts,
                                           t.mamba1_unrolled_l2_ahead)
        from attn_ops.backends.ssm.mamba1_kernels import mamba1_unrolled_triton

        return mamba1_unrolled_triton(*args, t.mamba1_unrolled_block_d, t.mamba1_unrolled_warps,
                                      ahead, t.mamba1_unrolled_y_parts,
                                      t.mamba1_unrolled_l2_ahead)
    if kernel is Kernel.SSM_TRITON_CHUNKED:
        from attn_ops.backends.ssm.mamba1_kernels import mamba1_chunked_triton

        return mamba1_chunked_triton(*args, t.mamba1_chunk, t.mamba1_chunk_block_d,
                                     t.mamba1_chunk_warps, t.mamba1_prefetch)
    if kernel is Kernel.SSM_TRITON:
        from attn_ops.backends.ssm.triton_kernels import mamba1_recurrent_triton

        return mamba1_recurrent_triton(*args, t.mamba1_block_d, t.decode_num_warps,
                                       mamba1_read_ahead(max_query_len, t.mamba1_prefetch),
                                       t.mamba1_min_programs,
                                       t.mamba1_decode_streaming, t.mamba1_channel_major)
    y, s, slots = _reference(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc,
                             state_indices, has_initial_state, dt_softplus)
    store_states(state, slots, s)
    return y.to(x.dtype)


def _walk_plan(x, A, query_start_loc, max_query_len: int, t) -> tuple[int, int]:
    """The unrolled prefill's ``(segment length, tokens read ahead)`` for the step
    (:func:`attn_ops.routing.mamba1_segment`, 0: one walk a request;
    :func:`attn_ops.routing.mamba1_walk_read_ahead`): its programs are a request's -- or, with
    segments, about a segment's -- blocks of ``Tuning.ssm.mamba1_unrolled_block_d`` channels."""
    from attn_ops.routing import DeviceFacts, cdiv, mamba1_segment, pow2

    d = x.shape[1]
    block_d = min(pow2(d), t.mamba1_unrolled_block_d)
    blocks, sms = cdiv(d, block_d), DeviceFacts.of(x.device).num_sms
    requests = query_start_loc.shape[0] - 1
    segment = mamba1_segment(requests, x.shape[0], max_query_len, blocks, sms,
                             t.mamba1_unrolled_segment, t.mamba1_walk_min_programs)
    walks = cdiv(x.shape[0], segment) if segment else requests
    ahead = mamba1_walk_read_ahead(A.shape[1], t.mamba1_unrolled_prefetch, walks * blocks, sms,
                                   max(1, block_d // (32 * t.mamba1_unrolled_warps)),
                                   t.mamba1_unrolled_warps)
    return segment, ahead


def _fake(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
          has_initial_state, max_query_len, dt_softplus, tuning=None):
    _check(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
           has_initial_state, max_query_len)
    return torch.empty_like(x)


mamba1_scan = define_op(
    "mamba1_scan",
    "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, "
    "Tensor(a!) state, Tensor query_start_loc, Tensor state_indices, Tensor has_initial_state, "
    "int max_query_len, bool dt_softplus, Tensor? tuning=None) -> Tensor",
    _impl, _fake)
