"""Mamba1's prefill kernels beside the token-by-token one (``triton_kernels``), for steps
whose longest request has at least ``Tuning.ssm.chunked_min_query_len`` new tokens, one state
slot a request:

* :func:`mamba1_chunked_kernel` -- one program a request and block of channels walks the
  request's new tokens a chunk at a time: a chunk's ``[tokens, channels, d_state]`` decays and
  inputs reduced by an associative scan along the tokens (``(a1, b1) . (a2, b2) = (a1 a2, b1 a2
  + b2)``, products of decays only: no ratio of decays that could overflow), the chunk's start
  state carried in by the scan's decay products; each input read once in ``[chunk, ...]``
  tiles instead of one row a step of a dependent loop.
* :func:`mamba1_unrolled_kernel` -- token by token with each channel's ``d_state`` row unrolled
  into one thread's registers (``Tuning.ssm.mamba1_unrolled``).
* :func:`mamba1_segment_kernel` / :func:`mamba1_segment_chain_kernel` -- the unrolled walk over
  segments of a request, in three launches (``Tuning.ssm.mamba1_unrolled_segment``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from attn_ops.backends.ssm.chunked_kernels import chunk_table_triton
from attn_ops.backends.ssm.triton_kernels import (_inside, _keep_final, _num_writes,
                                                  _request_state, _zero_padding_rows,
                                                  mamba1_launch, mamba1_operands,
                                                  request_span)
from attn_ops.backends.triton_attn_kernels import LN2, LOG2E
from attn_ops.routing import cdiv, pow2

__all__ = ["mamba1_chunked_triton", "mamba1_segmented_triton", "mamba1_unrolled_triton"]


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
            y = _silu_gate(y, z)
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


# Compiled, the walk runs inline PTX: its per-channel exponentials and logarithm are MUFU's
# approximate ones (``ex2`` / ``lg2.approx.ftz``: one instruction each, where ``tl.exp`` adds a
# denormal range check and ``tl.log`` is a precise polynomial of ~15 instructions a token a
# channel), its reads non-coherent loads and L2 prefetches. The interpreter has no inline PTX
# and runs ``tl.exp2`` / ``tl.log2`` / ``tl.load``.
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _exp2(v):
    if _PTX:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [v],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return tl.exp2(v)


@triton.jit
def _softplus(v):
    """``log(1 + exp(v))``, ``v`` itself above 20 (as mamba-ssm)."""
    if _PTX:
        one_plus = 1.0 + _exp2(v * LOG2E)
        log2 = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [one_plus],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        log2 = tl.log2(1.0 + tl.exp2(v * LOG2E))
    return tl.where(v > 20.0, v, log2 * LN2)


@triton.jit
def _silu_gate(y, z):
    """``y * silu(z)``: the gate's exponential on :func:`_exp2`, its division not IEEE."""
    return tl.fdiv(y * z, 1.0 + _exp2(z * -LOG2E))


@triton.jit
def _halves(pair):
    """The two fp32 values of a little-endian 64-bit word, the lower address first."""
    return (pair.to(tl.int32).to(tl.float32, bitcast=True),
            (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True))


@triton.jit
def _read(ptr):
    """``*ptr`` of memory the kernel never writes, compiled as a non-coherent load
    (``ld.global.nc``): ptxas may then issue it ahead of the walk's output stores, which a
    plain load must follow (they might alias), so a read ahead stays ahead."""
    if _PTX:
        if ptr.dtype.element_ty.primitive_bitwidth == 64:
            return tl.inline_asm_elementwise("ld.global.nc.b64 $0, [$1];", "=l,l", [ptr],
                                             dtype=tl.int64, is_pure=True, pack=1)
        elif ptr.dtype.element_ty.primitive_bitwidth == 32:
            return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr],
                                             dtype=tl.int32, is_pure=True,
                                             pack=1).to(ptr.dtype.element_ty, bitcast=True)
        else:
            tl.static_assert(ptr.dtype.element_ty.primitive_bitwidth == 16)
            return tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [ptr],
                                             dtype=tl.int16, is_pure=True,
                                             pack=1).to(ptr.dtype.element_ty, bitcast=True)
    return tl.load(ptr)


@triton.jit
def _to_l2(ptr):
    """Ask for ``*ptr``'s line in L2 (``prefetch.global.L2``: no register, nothing waits on
    it); compiled only."""
    if _PTX:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.b32 $0, 0;", "=r,l", [ptr],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _mamba1_row(t, end):
    """The row a walk reads for token ``t``: ``t``, or the request's last row at or past
    ``end`` (a read ahead; row 0 for an empty request)."""
    return tl.maximum(tl.minimum(t, end - 1), 0)


@triton.jit
def _mamba1_rows_to_l2(x_ptr, dt_ptr, z_ptr, t, end, offs_r, stride_xt, stride_dtt, stride_zt,
                       HAS_Z: tl.constexpr):
    """Token ``t``'s ``x``, ``dt`` and ``z`` rows of the channels (:func:`_mamba1_row`) asked
    into L2: a later read of them then waits on L2, not on DRAM."""
    row = _mamba1_row(t, end)
    _to_l2(dt_ptr + row * stride_dtt + offs_r)
    _to_l2(x_ptr + row * stride_xt + offs_r)
    if HAS_Z:
        _to_l2(z_ptr + row * stride_zt + offs_r)


@triton.jit
def _mamba1_row_inputs(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, t, end, offs_r, stride_xt,
                       stride_dtt, stride_zt, stride_bt, stride_ct, N: tl.constexpr,
                       HAS_Z: tl.constexpr):
    """Token ``t``'s inputs as stored (:func:`_read`): ``dt``, ``x``, ``z`` of the channels
    ``offs_r`` (in range: a lane past the channels reads one it does not store), and ``B`` /
    ``C`` as tuples of ``N`` values, each a vector of one address (every channel reads the
    same ``B[t, n]``). A token at or past ``end`` (a read ahead) reads row ``end - 1`` (row 0
    for an empty request) instead: unmasked reads -- a masked one costs a zeroed register
    and, for the ``B`` / ``C`` vectors, a load a channel where one serves a thread's channels
    -- of a row the walk never steps with (:func:`_mamba1_token` zeroes such a token's time
    step)."""
    row = _mamba1_row(t, end)
    dt = _read(dt_ptr + row * stride_dtt + offs_r)
    x = _read(x_ptr + row * stride_xt + offs_r)
    z = x
    if HAS_Z:
        z = _read(z_ptr + row * stride_zt + offs_r)
    bb = ()
    cc = ()
    if N % 2 == 0:  # (value pairs, one little-endian 64-bit load each: rows aligned by
        # _float_rows)
        b_pairs = (b_ptr + row * stride_bt).to(tl.pointer_type(tl.int64)) + offs_r * 0
        c_pairs = (c_ptr + row * stride_ct).to(tl.pointer_type(tl.int64)) + offs_r * 0
        for n in tl.static_range(N // 2):
            bb = bb + _halves(_read(b_pairs + n))
            cc = cc + _halves(_read(c_pairs + n))
    else:
        for n in tl.static_range(N):
            bb = bb + (_read(b_ptr + row * stride_bt + n + offs_r * 0),)
            cc = cc + (_read(c_ptr + row * stride_ct + n + offs_r * 0),)
    return dt, x, z, bb, cc


@triton.jit
def _mamba1_rates(a_ptr, offs_d, d_ok, stride_a, N: tl.constexpr):
    """The channels' rates as a tuple of ``N`` vectors scaled by ``log2(e)`` (each decay an
    exp2)."""
    a = ()
    for n in tl.static_range(N):
        a = a + (tl.load(a_ptr + offs_d * stride_a + n, mask=d_ok, other=0.0).to(tl.float32)
                 * LOG2E,)
    return a


@triton.jit
def _mamba1_slot_state(slot_ptr, init_ptr, state_ptr, r, stride_idx, stride_ss, stride_sd,
                       num_slots, offs_d, d_ok, N: tl.constexpr):
    """Request ``r``'s slot row pointers (``N`` strided entries a channel from there), whether
    the slot is present, and its state as a tuple of ``N`` vectors (zeros without an initial
    state or a present slot)."""
    slot = tl.load(slot_ptr + r * stride_idx).to(tl.int64)
    present = _inside(slot + offs_d * 0, num_slots)  # (vectors: scalar masks fail interpreted)
    init = (tl.load(init_ptr + r + offs_d * 0) != 0) & present
    slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    row = state_ptr + slot * stride_ss + offs_d * stride_sd
    s = ()
    for n in tl.static_range(N):
        s = s + (tl.load(row + n, mask=d_ok & init, other=0.0).to(tl.float32),)
    return row, present, s


@triton.jit
def _mamba1_keep_state(state_ptr, row, s, mask, N: tl.constexpr):
    """The state tuple ``s`` back into the slot row (:func:`_mamba1_slot_state`)."""
    for n in tl.static_range(N):
        tl.store(row + n, s[n].to(state_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mamba1_token(s, a, inputs, t, end, d_skip, dt_bias, y_ptr, stride_yt, offs_d, d_ok,
                  N: tl.constexpr, HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr,
                  OUTPUT: tl.constexpr, MASKED: tl.constexpr, Y_PARTS: tl.constexpr):
    """Token ``t``'s step from the state ``s`` over its ``inputs``
    (:func:`_mamba1_row_inputs`): ``h_n = h_n exp2(dt a_n) + dt x B_n``, and with ``OUTPUT``
    ``y = sum_n h_n C_n + D x`` (times ``silu(z)``) stored; returns the new state and the
    channels' time step. ``MASKED``: ``t`` may be at or past ``end`` -- then its inputs are the
    request's last row (:func:`_mamba1_row_inputs`), its time step is set to 0 (the state
    unchanged: ``exp2(0) = 1``, ``0 x B = 0``) and nothing is stored. ``Y_PARTS`` (1, 2 or 4):
    the sum over ``n`` in that many interleaved partial sums, added at the end -- dependent
    chains of ``N / Y_PARTS`` multiply-adds instead of one of ``N``."""
    tl.static_assert(Y_PARTS == 1 or Y_PARTS == 2 or Y_PARTS == 4)
    dt_r, x_r, z_r, b_r, c_r = inputs
    dt = dt_r.to(tl.float32) + dt_bias
    if SOFTPLUS:
        dt = _softplus(dt)
    if MASKED:
        dt = tl.where(offs_d * 0 + t < end, dt, 0.0)
    x = x_r.to(tl.float32)
    dtx = dt * x
    y = d_skip * x
    y1 = y
    y2 = y
    y3 = y
    stepped = ()
    for n in tl.static_range(N):
        h = s[n] * tl.exp2(dt * a[n]) + dtx * b_r[n].to(tl.float32)
        if OUTPUT:
            hc = h * c_r[n].to(tl.float32)
            if n % Y_PARTS == 0:
                y += hc
            elif n % Y_PARTS == 1:
                y1 = hc if n == 1 else y1 + hc
            elif n % Y_PARTS == 2:
                y2 = hc if n == 2 else y2 + hc
            else:
                y3 = hc if n == 3 else y3 + hc
        stepped = stepped + (h,)
    if OUTPUT and Y_PARTS == 4 and N > 3:
        y2 = y2 + y3
    if OUTPUT and Y_PARTS == 4 and N > 2:
        y1 = y1 + y2
    if OUTPUT and Y_PARTS > 1 and N > 1:
        y = y + y1
    if OUTPUT:
        if HAS_Z:
            z = z_r.to(tl.float32)
            y = _silu_gate(y, z)
        ok = d_ok
        if MASKED:
            ok = ok & (offs_d * 0 + t < end)
        tl.store(y_ptr + t * stride_yt + offs_d, y.to(y_ptr.dtype.element_ty), mask=ok)
    return stepped, dt


@triton.jit
def _mamba1_walk(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, y_ptr, a, s, d_skip, dt_bias, start, end,
                 offs_d, d_ok, stride_xt, stride_yt, stride_dtt, stride_zt, stride_bt,
                 stride_ct, N: tl.constexpr, HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr,
                 PREFETCH: tl.constexpr, OUTPUT: tl.constexpr, Y_PARTS: tl.constexpr,
                 L2_AHEAD: tl.constexpr):
    """Rows ``[start, end)`` token by token (:func:`_mamba1_token`) from the state ``s`` (a
    tuple of ``N`` ``[BLOCK_D]`` vectors: each channel's ``d_state`` row in one thread);
    returns the final state and the channels' summed time steps. ``PREFETCH``: 0 reads a
    token's inputs when it steps; 1 one token ahead (the inputs rotate through registers: a
    move each a step); ``P`` >= 2: ``P`` tokens an iteration over ``P`` buffers, each
    reloaded with the row ``P`` ahead (no moves; an iteration past the request's end steps
    masked tokens). ptxas issues all of an iteration's reads at its end, waited for at the
    next one's top: an iteration exposes about one read latency, spread over ``P`` tokens.
    ``L2_AHEAD`` > 0: each step also asks the ``x`` / ``dt`` / ``z`` rows that many tokens
    ahead into L2 (:func:`_mamba1_rows_to_l2`), so the exposed latency is L2's, not DRAM's."""
    total = d_skip * 0.0
    offs_r = tl.where(d_ok, offs_d, 0)
    if PREFETCH >= 2:
        rows = ()
        for i in tl.static_range(PREFETCH):
            rows = rows + (_mamba1_row_inputs(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, start + i, end,
                                              offs_r, stride_xt, stride_dtt, stride_zt,
                                              stride_bt, stride_ct, N, HAS_Z and OUTPUT),)
        for t in range(start, end, PREFETCH):
            ahead = ()
            for i in tl.static_range(PREFETCH):
                s, dt = _mamba1_token(s, a, rows[i], t + i, end, d_skip, dt_bias, y_ptr,
                                      stride_yt, offs_d, d_ok, N, HAS_Z, SOFTPLUS, OUTPUT, i > 0,
                                      Y_PARTS)
                total += dt
                if L2_AHEAD:
                    _mamba1_rows_to_l2(x_ptr, dt_ptr, z_ptr, t + L2_AHEAD + i, end, offs_r,
                                       stride_xt, stride_dtt, stride_zt, HAS_Z and OUTPUT)
                ahead = ahead + (_mamba1_row_inputs(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr,
                                                    t + PREFETCH + i, end, offs_r, stride_xt,
                                                    stride_dtt, stride_zt, stride_bt, stride_ct,
                                                    N, HAS_Z and OUTPUT),)
            rows = ahead
    else:
        if PREFETCH:
            ahead = _mamba1_row_inputs(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, start, end, offs_r,
                                       stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct,
                                       N, HAS_Z and OUTPUT)
        for t in range(start, end):
            if L2_AHEAD:
                _mamba1_rows_to_l2(x_ptr, dt_ptr, z_ptr, t + L2_AHEAD, end, offs_r, stride_xt,
                                   stride_dtt, stride_zt, HAS_Z and OUTPUT)
            if PREFETCH:
                inputs = ahead
                ahead = _mamba1_row_inputs(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, t + 1, end,
                                           offs_r, stride_xt, stride_dtt, stride_zt, stride_bt,
                                           stride_ct, N, HAS_Z and OUTPUT)
            else:
                inputs = _mamba1_row_inputs(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, t, end, offs_r,
                                            stride_xt, stride_dtt, stride_zt, stride_bt,
                                            stride_ct, N, HAS_Z and OUTPUT)
            s, dt = _mamba1_token(s, a, inputs, t, end, d_skip, dt_bias, y_ptr, stride_yt,
                                  offs_d, d_ok, N, HAS_Z, SOFTPLUS, OUTPUT, False, Y_PARTS)
            total += dt
    return s, total


@triton.jit
def mamba1_unrolled_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr,
                           state_ptr, y_ptr, qsl_ptr, slot_ptr, init_ptr, stride_idx,
                           stride_xt, stride_yt, stride_dtt, stride_zt, stride_bt, stride_ct,
                           stride_a, stride_ss, stride_sd, num_tokens, num_slots,
                           NUM_WRITES: tl.constexpr, D_INNER: tl.constexpr, N: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_Z: tl.constexpr,
                           SOFTPLUS: tl.constexpr, PREFETCH: tl.constexpr,
                           Y_PARTS: tl.constexpr, L2_AHEAD: tl.constexpr):
    """:func:`mamba1_recurrent_kernel` with each channel's ``d_state`` row unrolled into
    ``N`` registers of one thread (:func:`_mamba1_walk`, a channel a thread): ``y = sum_n h_n
    C_n`` is a chain of fused multiply-adds in the thread, where the 2-D form spreads
    ``d_state`` over lanes and sums it with shuffles, and the per-channel time step, skip and
    gate are computed once a channel, not once a lane. One slot a request (``NUM_WRITES``
    0); the state row's ``N`` reads and writes are strided, once a request."""
    r = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D_INNER
    start, end = request_span(qsl_ptr, r, num_tokens)
    row, present, s = _mamba1_slot_state(slot_ptr, init_ptr, state_ptr, r, stride_idx,
                                         stride_ss, stride_sd, num_slots, offs_d, d_ok, N)
    d_skip = tl.load(d_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    s, _ = _mamba1_walk(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, y_ptr,
                        _mamba1_rates(a_ptr, offs_d, d_ok, stride_a, N), s, d_skip, dt_bias,
                        start, end, offs_d, d_ok, stride_xt, stride_yt, stride_dtt, stride_zt,
                        stride_bt, stride_ct, N, HAS_Z, SOFTPLUS, PREFETCH, True, Y_PARTS,
                        L2_AHEAD)
    _mamba1_keep_state(state_ptr, row, s, d_ok & present, N)
    _zero_padding_rows(y_ptr, r == tl.num_programs(0) - 1, end, num_tokens, stride_yt, offs_d,
                       d_ok)


def _float_rows(u: torch.Tensor) -> torch.Tensor:
    """``B`` / ``C`` ``[tokens, d_state]`` as the unrolled walks read them: fp32 -- every
    channel's thread reads each of a token's ``d_state`` values, so converting them once (a
    tiny pass, ``d_state`` values a token) takes two instructions an element out of the loop
    (sm_90, bf16 inputs: 229 -> 197 a thread a token at 128 channels on 4 warps) -- and, for
    an even ``d_state``, rows of 8-byte aligned value pairs, which :func:`_mamba1_row_inputs`
    reads as one 64-bit load (a copy where the rows are not)."""
    pairs = u.shape[-1] % 2 == 0
    if u.dtype == torch.float32 and u.stride(-1) == 1 and (
            not pairs or (u.stride(0) % 2 == 0 and u.data_ptr() % 8 == 0)):
        return u
    return torch.empty(u.shape, dtype=torch.float32, device=u.device).copy_(u)


def mamba1_unrolled_triton(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc,
                           state_indices, has_initial_state, dt_softplus, block_d: int = 256,
                           num_warps: int = 4, prefetch: int = 0, y_parts: int = 1,
                           l2_ahead: int = 0) -> torch.Tensor:
    """``torch.ops.attn.mamba1_scan`` token by token with ``d_state`` unrolled
    (:func:`mamba1_unrolled_kernel`), ``block_d`` channels a program, one slot a request,
    ``y = sum_n h_n C_n`` in ``y_parts`` partial sums (:func:`_mamba1_token`), the rows
    ``l2_ahead`` tokens ahead asked into L2 (:func:`_mamba1_walk`; inputs already checked)."""
    if _num_writes(state_indices):
        raise ValueError("mamba1_unrolled_triton keeps one state a request; speculative "
                         "steps run mamba1_recurrent_triton")
    B, C = _float_rows(B), _float_rows(C)
    return mamba1_launch(mamba1_unrolled_kernel, x, dt, A, B, C, D, z, dt_bias, state,
                         query_start_loc, state_indices, has_initial_state, dt_softplus,
                         block_d, num_warps, NUM_WRITES=0,
                         PREFETCH=int(prefetch) if x.shape[0] else 0,  # (reads ahead read a row)
                         Y_PARTS=y_parts, L2_AHEAD=l2_ahead)


@triton.jit
def mamba1_segment_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr, hs_ptr,
                          sum_ptr, y_ptr, start_ptr, end_ptr, stride_xt, stride_yt, stride_dtt,
                          stride_zt, stride_bt, stride_ct, stride_a, D_INNER: tl.constexpr,
                          N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_Z: tl.constexpr,
                          SOFTPLUS: tl.constexpr, PREFETCH: tl.constexpr,
                          OUTPUT: tl.constexpr, Y_PARTS: tl.constexpr,
                          L2_AHEAD: tl.constexpr):
    """Per segment and block of channels, token by token with ``d_state`` unrolled
    (:func:`_mamba1_walk`): without ``OUTPUT``, the
    segment's state from zero into ``hs[c]`` (``[segments, N, d_inner]``, channels fastest)
    and its summed time steps into ``sum[c]``; with ``OUTPUT``, its outputs from its start
    state ``hs[c]`` (which the chain wrote over the local one)."""
    c = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D_INNER
    start = tl.load(start_ptr + c)
    end = tl.load(end_ptr + c)
    if start < end:
        d_skip = tl.load(d_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        dt_bias = tl.load(dtb_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        base = hs_ptr + c.to(tl.int64) * (N * D_INNER) + offs_d
        s = ()
        for n in tl.static_range(N):
            if OUTPUT:
                s = s + (tl.load(base + n * D_INNER, mask=d_ok, other=0.0),)
            else:
                s = s + (d_skip * 0.0,)
        s, total = _mamba1_walk(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, y_ptr,
                                _mamba1_rates(a_ptr, offs_d, d_ok, stride_a, N), s, d_skip,
                                dt_bias, start, end, offs_d, d_ok, stride_xt, stride_yt,
                                stride_dtt, stride_zt, stride_bt, stride_ct, N, HAS_Z,
                                SOFTPLUS, PREFETCH, OUTPUT, Y_PARTS, L2_AHEAD)
        if not OUTPUT:
            for n in tl.static_range(N):
                tl.store(base + n * D_INNER, s[n], mask=d_ok)
            tl.store(sum_ptr + c.to(tl.int64) * D_INNER + offs_d, total, mask=d_ok)


@triton.jit
def mamba1_segment_chain_kernel(a_ptr, hs_ptr, sum_ptr, state_ptr, y_ptr, qsl_ptr, coff_ptr,
                                slot_ptr, init_ptr, stride_idx, stride_a, stride_ss, stride_sd,
                                stride_yt, num_tokens, num_slots, D_INNER: tl.constexpr,
                                N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per request and block of channels, segment after segment: the state at the segment's
    start over its local one in ``hs``, then ``S = exp(A sum(dt)) S + local`` (a segment's
    decays multiply into one: ``prod_t exp(dt_t A) = exp(A sum_t dt_t)``); the final state
    into the request's slot, and the last request's programs zero the output rows past its
    end."""
    r = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D_INNER
    start, end = request_span(qsl_ptr, r, num_tokens)
    row, present, s = _mamba1_slot_state(slot_ptr, init_ptr, state_ptr, r, stride_idx,
                                         stride_ss, stride_sd, num_slots, offs_d, d_ok, N)
    a = _mamba1_rates(a_ptr, offs_d, d_ok, stride_a, N)
    c = tl.load(coff_ptr + r).to(tl.int64)
    for _ in range(tl.load(coff_ptr + r), tl.load(coff_ptr + r + 1)):
        base = hs_ptr + c * (N * D_INNER) + offs_d
        total = tl.load(sum_ptr + c * D_INNER + offs_d, mask=d_ok, other=0.0)
        chained = ()
        for n in tl.static_range(N):
            local = tl.load(base + n * D_INNER, mask=d_ok, other=0.0)
            tl.store(base + n * D_INNER, s[n], mask=d_ok)
            chained = chained + (s[n] * tl.exp2(total * a[n]) + local,)
        s = chained
        c += 1
    _mamba1_keep_state(state_ptr, row, s, d_ok & present, N)
    _zero_padding_rows(y_ptr, r == tl.num_programs(0) - 1, end, num_tokens, stride_yt, offs_d,
                       d_ok)


def mamba1_segmented_triton(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc,
                            state_indices, has_initial_state, dt_softplus, segment: int = 256,
                            block_d: int = 256, num_warps: int = 4, prefetch: int = 0,
                            y_parts: int = 1, l2_ahead: int = 0) -> torch.Tensor:
    """``torch.ops.attn.mamba1_scan`` over segments of ``segment`` tokens of each request
    (one slot a request), in three launches: every segment's local state from zero, the
    hand-off of states between a request's segments, every segment's outputs from its start
    state -- the token loops of a long request run side by side, at 1.7 times the single
    walk's instructions; ``y_parts`` and ``l2_ahead`` as :func:`mamba1_unrolled_triton`'s
    (inputs already checked)."""
    if state_indices.dim() != 1:
        raise ValueError("mamba1_segmented_triton keeps one state a request; speculative "
                         "steps run mamba1_recurrent_triton")
    x, dt, A, B, C, D, z, dt_bias = mamba1_operands(x, dt, A, B, C, D, z, dt_bias)
    B, C = _float_rows(B), _float_rows(C)
    t, d = x.shape
    n = A.shape[1]
    b = query_start_loc.shape[0] - 1
    if b == 0:
        return torch.zeros_like(x)
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    offsets, starts, ends = chunk_table_triton(query_start_loc, t, segment)
    m = starts.shape[0]
    hs = torch.empty(m, n, d, dtype=torch.float32, device=x.device)
    sums = torch.empty(m, d, dtype=torch.float32, device=x.device)
    block_d = min(pow2(d), block_d)
    zz = z if z is not None else x
    inputs = (x, dt, A, B, C, D, zz, dt_bias, hs, sums, y, starts, ends, x.stride(0),
              y.stride(0), dt.stride(0), z.stride(0) if z is not None else 0, B.stride(0),
              C.stride(0), A.stride(0))
    common = dict(D_INNER=d, N=n, BLOCK_D=block_d, HAS_Z=z is not None, SOFTPLUS=dt_softplus,
                  PREFETCH=int(prefetch), Y_PARTS=y_parts, L2_AHEAD=l2_ahead,
                  num_warps=num_warps)
    grid = (m, cdiv(d, block_d))
    mamba1_segment_kernel[grid](*inputs, OUTPUT=False, **common)
    mamba1_segment_chain_kernel[(b, cdiv(d, block_d))](
        A, hs, sums, state, y, query_start_loc, offsets, state_indices, has_initial_state,
        state_indices.stride(0), A.stride(0), state.stride(0), state.stride(1), y.stride(0), t,
        state.shape[0], D_INNER=d, N=n, BLOCK_D=block_d, num_warps=num_warps)
    mamba1_segment_kernel[grid](*inputs, OUTPUT=True, **common)
    return y
