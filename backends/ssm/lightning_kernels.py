"""Lightning attention's prefill kernels beside the token-by-token one (``triton_kernels``),
for steps whose longest request has at least ``Tuning.ssm.chunked_min_query_len`` new tokens,
one state slot a request; each chunk as block-wise linear attention on the tensor cores
(:func:`_chunk_out`: ``(q k^T * decay) v`` within it, ``(q * a^(i+1)) S`` from its start state;
:func:`_chunk_state`: ``S = a^n S + (k * a^(n-1-j))^T v`` after it):

* :func:`lightning_chunked_kernel` -- one program a request, head and block of value columns
  walks the request's chunks, the state block in registers;
* :func:`lightning_state_kernel` / :func:`lightning_output_kernel` -- the same split as GDN's
  (``chunked_kernels``, ``Tuning.ssm.lightning_split``): a hand-off launch walking the chunks
  with one product each and writing every chunk's start state, then every chunk's outputs in
  parallel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.backends.ssm.chunked_kernels import (_chunk_output_program, _chunk_start_state,
                                                   _dot, _last_outer, _split_pid, _tile,
                                                   _work_dtype, chunk_table_triton)
from attn_ops.backends.ssm.triton_kernels import (_keep_final, _request_state,
                                                  _zero_padding_rows, lightning_launch)
from attn_ops.routing import DeviceFacts, cdiv, lightning_split_chunk, pow2

__all__ = ["lightning_chunked_triton", "lightning_split_triton"]


@triton.jit
def _chunk_out(q, k, v, s, slope, pos, like, IEEE: tl.constexpr):
    """A chunk's outputs ``[chunk, columns]``: token ``i`` reads token ``j <= i`` of its chunk
    at ``a^(i - j)`` and the chunk's start state ``s`` at ``a^(i+1)`` (the decays scale rows of
    the products' outputs, not ``q`` and ``k``: fp32 copies of those would not fit in registers
    beside a walked state); ``pos``: the chunk's positions as floats."""
    gap = pos[:, None] - pos[None, :]
    scores = _dot(q, tl.trans(k), like, IEEE)
    scores = tl.where(gap >= 0, scores * tl.exp(-slope * tl.maximum(gap, 0.0)), 0.0)
    return (_dot(scores, v, like, IEEE)
            + _dot(q, s, like, IEEE) * tl.exp(-slope * (pos + 1.0))[:, None])


@triton.jit
def _chunk_state(s, k, v, slope, pos, ok, n, like, IEEE: tl.constexpr):
    """The state after a chunk of ``n`` tokens (rows ``ok``): ``a^n s + k^T (a^(n-1-j) v)``."""
    to_end = tl.where(ok, tl.exp(-slope * tl.maximum(n - 1.0 - pos, 0.0)), 0.0)
    return s * tl.exp(-slope * n) + _dot(tl.trans(k), v.to(tl.float32) * to_end[:, None], like,
                                         IEEE)


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
        q = _tile(q_ptr, rows, ok, stride_qt, h * stride_qh, offs_k, k_ok)
        k = _tile(k_ptr, rows, ok, stride_kt, h * stride_kh, offs_k, k_ok)
        v = _tile(v_ptr, rows, ok, stride_vt, h * stride_vh, offs_v, v_ok)
        o = _chunk_out(q, k, v, s, slope, pos, q_ptr, IEEE)
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=ok[:, None] & v_ok[None, :])
        s = _chunk_state(s, k, v, slope, pos, ok, tl.minimum(end - c0, CHUNK).to(tl.float32),
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
@triton.jit
def lightning_state_kernel(k_ptr, v_ptr, slope_ptr, h_ptr, state_ptr, o_ptr, qsl_ptr, coff_ptr,
                           slot_ptr, init_ptr, stride_idx, stride_kt, stride_kh, stride_vt,
                           stride_vh, stride_hc, stride_hh, stride_ss, stride_sh, stride_sk,
                           stride_ot, stride_oh, num_tokens, num_slots, H: tl.constexpr,
                           DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, IEEE: tl.constexpr):
    """Per request, head and ``[BLOCK_K, BLOCK_V]`` block of the state, chunk after chunk: the
    state at the chunk's start into ``h``, then ``S = a^n S + k^T (a^(n-1-j) v)`` (``a =
    e^-slope``, ``n`` the chunk's tokens) -- one product a chunk. A row of the state depends on
    its own key column only (the decay is a scalar a head), so the key dim splits across
    programs as the value columns do: more, shorter chains for few requests. The final state
    into the slot, and the last request's first key block zeroes the output rows past its
    end."""
    nv: tl.constexpr = (DV + BLOCK_V - 1) // BLOCK_V
    blocks: tl.constexpr = nv * ((DK + BLOCK_K - 1) // BLOCK_K)  # (the state's, a head)
    r, hh, kv = _split_pid(H, blocks, 1)
    kb, vb = kv // nv, kv % nv
    offs_c = tl.arange(0, CHUNK)
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    start, end, s, _, s_ptrs, s_mask, w_mask = _request_state(
        qsl_ptr, slot_ptr, init_ptr, state_ptr, r, stride_idx, stride_ss, num_slots,
        hh * stride_sh, offs_k, offs_v, k_ok, v_ok, stride_sk, num_tokens, "")
    slope = tl.load(slope_ptr + hh).to(tl.float32)
    pos = offs_c.to(tl.float32)
    h_offs = hh * stride_hh + offs_k[:, None] * DV + offs_v[None, :]
    c = tl.load(coff_ptr + r).to(tl.int64)
    for c0 in range(start, end, CHUNK):
        tl.store(h_ptr + c * stride_hc + h_offs, s.to(h_ptr.dtype.element_ty), mask=s_mask)
        rows = c0 + offs_c
        ok = rows < end
        k = _tile(k_ptr, rows, ok, stride_kt, hh * stride_kh, offs_k, k_ok)
        v = _tile(v_ptr, rows, ok, stride_vt, hh * stride_vh, offs_v, v_ok)
        s = _chunk_state(s, k, v, slope, pos, ok, tl.minimum(end - c0, CHUNK).to(tl.float32),
                         k_ptr, IEEE)
        c += 1
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=w_mask)
    _zero_padding_rows(o_ptr, _last_outer(H, blocks, 1) & (kb == 0), end, num_tokens,
                       stride_ot, hh * stride_oh + offs_v, v_ok)


@triton.jit
def lightning_output_kernel(q_ptr, k_ptr, v_ptr, slope_ptr, h_ptr, o_ptr, start_ptr, end_ptr,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_hc, stride_hh, stride_ot, stride_oh, H: tl.constexpr,
                            DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, IEEE: tl.constexpr):
    """Per chunk, head and block of value columns: ``o_i = a^(i+1) q_i S + sum_(j <= i)
    a^(i-j) (q_i . k_j) v_j`` from the chunk's start state ``S``."""
    c, hh, start, end, offs_c, rows, ok, offs_k, k_ok, offs_v, v_ok = _chunk_output_program(
        start_ptr, end_ptr, H, DK, DV, CHUNK, BLOCK_K, BLOCK_V)
    if start < end:
        q = _tile(q_ptr, rows, ok, stride_qt, hh * stride_qh, offs_k, k_ok)
        k = _tile(k_ptr, rows, ok, stride_kt, hh * stride_kh, offs_k, k_ok)
        v = _tile(v_ptr, rows, ok, stride_vt, hh * stride_vh, offs_v, v_ok)
        s = _chunk_start_state(h_ptr, c, hh, stride_hc, stride_hh, offs_k, k_ok, offs_v, v_ok, DV)
        o = _chunk_out(q, k, v, s, tl.load(slope_ptr + hh).to(tl.float32),
                       offs_c.to(tl.float32), q_ptr, IEEE)
        tl.store(o_ptr + rows[:, None] * stride_ot + hh * stride_oh + offs_v[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=ok[:, None] & v_ok[None, :])


def lightning_split_triton(q, k, v, slope, state, query_start_loc, state_indices,
                           has_initial_state, chunk: int = 64, state_block_v: int = 64,
                           output_block_v: int = 64, warps: tuple[int, int] = (4, 4),
                           state_block_k: int = 0) -> torch.Tensor:
    """``torch.ops.attn.lightning_attention`` in chunks of ``chunk`` (a power of two >= 16;
    shorter where the hand-off's tiles would not fit a block's shared memory:
    :func:`attn_ops.routing.lightning_split_chunk`) tokens, one slot a request: the state
    hand-off over blocks of ``state_block_k`` key rows (0: all) x ``state_block_v`` value
    columns of the state (the chunks' start states into a ``[chunks, H, D, Dv]`` buffer in
    the inputs' dtype), then the outputs of every chunk in parallel over blocks of
    ``output_block_v``; ``warps``: of the two launches (inputs already checked)."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    t, heads, dk = q.shape
    dv = v.shape[2]
    b = query_start_loc.shape[0] - 1
    if b == 0:
        return torch.zeros_like(v)
    out = torch.empty(t, heads, dv, dtype=v.dtype, device=v.device)
    wdt = _work_dtype(q)
    block_k, block_v = max(pow2(dk), 16), max(pow2(dv), 16)
    state_bv = min(block_v, max(state_block_v, 16))
    state_bk = min(block_k, max(state_block_k, 16)) if state_block_k else block_k
    shared = DeviceFacts.of(q.device).shared_memory
    chunk = lightning_split_chunk(chunk, state_bk, state_bv, wdt.itemsize,
                                  shared[1] if shared else None)
    offsets, starts, ends = chunk_table_triton(query_start_loc, t, chunk)
    m = starts.shape[0]
    h = torch.empty(m, heads, dk, dv, dtype=wdt, device=q.device)
    common = dict(H=heads, DK=dk, DV=dv, CHUNK=chunk, IEEE=wdt == torch.float32)
    lightning_state_kernel[(b * heads * cdiv(dk, state_bk) * cdiv(dv, state_bv),)](
        k, v, slope, h, state, out, query_start_loc, offsets, state_indices, has_initial_state,
        state_indices.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        h.stride(0), h.stride(1), state.stride(0), state.stride(1), state.stride(2),
        out.stride(0), out.stride(1), t, state.shape[0], BLOCK_K=state_bk, BLOCK_V=state_bv,
        num_warps=warps[0], **common)
    out_bv = min(block_v, max(output_block_v, 16))
    lightning_output_kernel[(m * heads * cdiv(dv, out_bv),)](
        q, k, v, slope, h, out, starts, ends, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), h.stride(0), h.stride(1), out.stride(0),
        out.stride(1), BLOCK_K=block_k, BLOCK_V=out_bv, num_warps=warps[1], **common)
    return out
