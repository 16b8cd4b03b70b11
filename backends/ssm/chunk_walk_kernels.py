"""One-launch chunked Triton kernels of the recurrent-state prefills whose state update needs no
inverse (Mamba1's selective scan, lightning attention): one program a request and block of
state rows or columns walks the request's new tokens a chunk at a time, the state block in
registers, and writes the final state into the request's slot.

* :func:`mamba1_chunked_kernel` -- a chunk's ``[tokens, channels, d_state]`` decays and inputs
  reduced by an associative scan along the tokens (``(a1, b1) . (a2, b2) = (a1 a2, b1 a2 + b2)``,
  products of decays only: no ratio of decays that could overflow), the chunk's start state
  carried in by the scan's decay products.
* :func:`lightning_chunked_kernel` -- a chunk as linear attention: ``(q k^T * decay) v`` within
  it, ``(q * a^(i+1)) S`` from the state, ``S = a^n S + (k * a^(n-1-j))^T v`` after it, each
  product on the tensor cores.

The token-by-token kernels (``triton_kernels``) serve decodes and speculative decodes; these
serve steps whose longest request has at least ``Tuning.ssm.chunked_min_query_len`` new
tokens, one state slot a request. They read each input once in ``[chunk, ...]`` tiles instead
of one row a step of a dependent loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.backends.ssm.chunked_kernels import _dot
from attn_ops.backends.ssm.triton_kernels import (_keep_final, _request_state,
                                                  _zero_padding_rows, lightning_launch,
                                                  mamba1_launch)

__all__ = ["lightning_chunked_triton", "mamba1_chunked_triton"]


@triton.jit
def _compose(a1, b1, a2, b2):
    """Two steps ``s -> a s + b`` composed, the first (1) before the second (2)."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _mamba1_chunk_inputs(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, rows, end, offs_d, offs_n, d_ok,
                         n_ok, stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct,
                         HAS_Z: tl.constexpr):
    """A chunk's inputs as stored: ``dt``, ``x``, ``z`` as ``[chunk, channels]``, ``B``, ``C``
    as ``[chunk, d_state]``; rows at or past ``end`` read nothing."""
    ok = (rows < end)[:, None] & d_ok[None, :]
    n_mask = (rows < end)[:, None] & n_ok[None, :]
    dt = tl.load(dt_ptr + rows[:, None] * stride_dtt + offs_d[None, :], mask=ok, other=0.0)
    x = tl.load(x_ptr + rows[:, None] * stride_xt + offs_d[None, :], mask=ok, other=0.0)
    z = x
    if HAS_Z:
        z = tl.load(z_ptr + rows[:, None] * stride_zt + offs_d[None, :], mask=ok, other=0.0)
    bb = tl.load(b_ptr + rows[:, None] * stride_bt + offs_n[None, :], mask=n_mask, other=0.0)
    cc = tl.load(c_ptr + rows[:, None] * stride_ct + offs_n[None, :], mask=n_mask, other=0.0)
    return dt, x, z, bb, cc


@triton.jit
def mamba1_chunked_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr,
                          state_ptr, y_ptr, qsl_ptr, slot_ptr, init_ptr, stride_idx,
                          stride_xt, stride_yt, stride_dtt, stride_zt, stride_bt, stride_ct,
                          stride_a, stride_ss, stride_sd, num_tokens, num_slots,
                          D_INNER: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_Z: tl.constexpr,
                          SOFTPLUS: tl.constexpr, PREFETCH: tl.constexpr):
    """Request ``program_id(0)``, channels ``program_id(1) * BLOCK_D ...``: the channels'
    ``[BLOCK_D, d_state]`` state over the request's tokens, ``CHUNK`` at a time, carried
    between chunks in the scan's 3-D layout; ``PREFETCH``: the next chunk's inputs are read
    before this chunk's scan (the loop is otherwise bound by their latency)."""
    r = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, CHUNK)
    d_ok = offs_d < D_INNER
    n_ok = offs_n < N
    start, end, s, s_offs, s_ptrs, s_mask, w_mask = _request_state(
        qsl_ptr, slot_ptr, init_ptr, state_ptr, r, stride_idx, stride_ss, num_slots, 0,
        offs_d, offs_n, d_ok, n_ok, stride_sd, num_tokens, "")
    a = tl.load(a_ptr + offs_d[:, None] * stride_a + offs_n[None, :],
                mask=d_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    d_skip = tl.load(d_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    last = (offs_l == CHUNK - 1)[:, None, None]
    s3 = s[None, :, :]  # (carried 3-D: the scan's layout, not converted back each chunk)
    if PREFETCH:
        dt_n, x_n, z_n, b_n, c_n = _mamba1_chunk_inputs(
            x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, start + offs_l, end, offs_d, offs_n, d_ok, n_ok,
            stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct, HAS_Z)
    for c0 in range(start, end, CHUNK):
        rows = c0 + offs_l
        if PREFETCH:
            dt_r, x_r, z_r, b_r, c_r = dt_n, x_n, z_n, b_n, c_n
            dt_n, x_n, z_n, b_n, c_n = _mamba1_chunk_inputs(
                x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, rows + CHUNK, end, offs_d, offs_n, d_ok,
                n_ok, stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct, HAS_Z)
        else:
            dt_r, x_r, z_r, b_r, c_r = _mamba1_chunk_inputs(
                x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, rows, end, offs_d, offs_n, d_ok, n_ok,
                stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct, HAS_Z)
        ok = (rows < end)[:, None] & d_ok[None, :]
        dt = dt_r.to(tl.float32) + dt_bias[None, :]
        if SOFTPLUS:
            dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
        # rows past the request: decay 1, input 0 -- the scan's last row is its final state
        dt = tl.where(ok, dt, 0.0)
        x = x_r.to(tl.float32)
        decay = tl.exp(dt[:, :, None] * a[None, :, :])
        inp = (dt * x)[:, :, None] * b_r.to(tl.float32)[:, None, :]
        carried, h = tl.associative_scan((decay, inp), 0, _compose)
        h = h + carried * s3
        y = tl.sum(h * c_r.to(tl.float32)[:, None, :], axis=2) + d_skip[None, :] * x
        if HAS_Z:
            z = z_r.to(tl.float32)
            y = y * z / (1.0 + tl.exp(-z))
        tl.store(y_ptr + rows[:, None] * stride_yt + offs_d[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=ok)
        s3 = tl.sum(tl.where(last, h, 0.0), axis=0, keep_dims=True)
    _keep_final(state_ptr, s_ptrs, tl.reshape(s3, (BLOCK_D, BLOCK_N)), w_mask, 0, "")
    _zero_padding_rows(y_ptr, r == tl.num_programs(0) - 1, end, num_tokens, stride_yt, offs_d,
                       d_ok)


def mamba1_chunked_triton(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc,
                          state_indices, has_initial_state, dt_softplus, chunk: int = 16,
                          block_d: int = 32, num_warps: int = 4,
                          prefetch: bool = True) -> torch.Tensor:
    """``torch.ops.attn.mamba1_scan`` ``chunk`` tokens at a time (a power of two), ``block_d``
    channels a program, one slot a request (inputs already checked)."""
    return mamba1_launch(mamba1_chunked_kernel, x, dt, A, B, C, D, z, dt_bias, state,
                         query_start_loc, state_indices, has_initial_state, dt_softplus,
                         block_d, num_warps, CHUNK=chunk, PREFETCH=prefetch)


@triton.jit
def lightning_chunked_kernel(q_ptr, k_ptr, v_ptr, slope_ptr, state_ptr, o_ptr, qsl_ptr,
                             slot_ptr, init_ptr, stride_idx, stride_qt, stride_qh, stride_kt,
                             stride_kh, stride_vt, stride_vh, stride_ss, stride_sh, stride_sk,
                             stride_ot, stride_oh, num_tokens, num_slots, DK: tl.constexpr,
                             DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                             CHUNK: tl.constexpr, IEEE: tl.constexpr):
    """Request ``program_id(0)``, head ``program_id(1)``, value columns ``program_id(2) *
    BLOCK_V ...``: the ``[DK, BLOCK_V]`` state block over the request's tokens, ``CHUNK`` at
    a time."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_l = tl.arange(0, CHUNK)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    start, end, s, s_offs, s_ptrs, s_mask, w_mask = _request_state(
        qsl_ptr, slot_ptr, init_ptr, state_ptr, r, stride_idx, stride_ss, num_slots,
        h * stride_sh, offs_k, offs_v, k_ok, v_ok, stride_sk, num_tokens, "")
    slope = tl.load(slope_ptr + h).to(tl.float32)
    pos = offs_l.to(tl.float32)
    for c0 in range(start, end, CHUNK):
        rows = c0 + offs_l
        ok = rows < end
        kmask = ok[:, None] & k_ok[None, :]
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_k[None, :],
                    mask=kmask, other=0.0)
        k = tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + offs_k[None, :],
                    mask=kmask, other=0.0)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
                    mask=ok[:, None] & v_ok[None, :], other=0.0)
        # (the decays scale rows of the products' outputs and of v, not q and k: [chunk,
        # head_dim] fp32 copies of those would not fit in registers beside the state)
        # token i reads token j <= i of its chunk at a^(i - j), the chunk's start state at
        # a^(i+1) (made here, not held over the loop: registers)
        gap = pos[:, None] - pos[None, :]
        scores = _dot(q, tl.trans(k), q_ptr, IEEE)
        scores = tl.where(gap >= 0, scores * tl.exp(-slope * tl.maximum(gap, 0.0)), 0.0)
        o = (_dot(scores, v, q_ptr, IEEE)
             + _dot(q, s, q_ptr, IEEE) * tl.exp(-slope * (pos + 1.0))[:, None])
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=ok[:, None] & v_ok[None, :])
        n = tl.minimum(end - c0, CHUNK).to(tl.float32)
        to_end = tl.where(ok, tl.exp(-slope * tl.maximum(n - 1.0 - pos, 0.0)), 0.0)
        s = s * tl.exp(-slope * n) + _dot(tl.trans(k), v.to(tl.float32) * to_end[:, None],
                                          q_ptr, IEEE)
    _keep_final(state_ptr, s_ptrs, s, w_mask, 0, "")
    _zero_padding_rows(o_ptr, r == tl.num_programs(0) - 1, end, num_tokens, stride_ot,
                       h * stride_oh + offs_v, v_ok)


def lightning_chunked_triton(q, k, v, slope, state, query_start_loc, state_indices,
                             has_initial_state, chunk: int = 64, block_v: int = 64,
                             num_warps: int = 4) -> torch.Tensor:
    """``torch.ops.attn.lightning_attention`` ``chunk`` tokens at a time (a power of two
    >= 16), ``block_v`` value columns a program, one slot a request (inputs already
    checked)."""
    return lightning_launch(lightning_chunked_kernel, q, k, v, slope, state, query_start_loc,
                            state_indices, has_initial_state, block_v, num_warps, min_block=16,
                            CHUNK=chunk, IEEE=q.dtype == torch.float32)
