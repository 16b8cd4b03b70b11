"""Chunked Triton kernels of the recurrent-state prefills: each request's new tokens cut into
chunks from its first new token (the chunk size is the caller's; the math does not depend on
where the cuts fall), in launches of which only the state hand-off between chunks is
sequential:

1. per chunk, in parallel: what a chunk computes from its own tokens -- Gated DeltaNet's WY
   factors (``w``, ``u``), Mamba2's state contribution (and, once per group of heads, its
   ``C B^T``);
2. per request, head and block of state columns, chunk after chunk: the state at every chunk
   start (into a ``[chunks, ...]`` buffer) and the final state into the request's slot -- GDN
   a pair of small products per chunk, Mamba2 an elementwise update (lightning attention's
   split prefill, ``lightning_kernels``, is steps 2 and 3 alone);
3. per chunk, in parallel: the outputs from the chunk's start state and its tokens.

Products run on the tensor cores in the inputs' dtype with fp32 accumulation; fp32 inputs
(the tests' oracle runs) keep every product in exact fp32 (``IEEE``).

The chunk table is built on the device from ``query_start_loc`` with a size known from the
shapes (``num_tokens // chunk + num_reqs`` entries bound the real chunks; the rest are empty
and their programs return at once), so the ops capture in CUDA graphs and read nothing on the
host. It is one launch (:func:`chunk_table_triton`; :func:`chunk_table` is its definition in
torch ops, the tests' oracle): an eager prefill's host time is its launches (tens of us each
on the H200's host, more than its kernels take below a few thousand tokens), and the table in
torch ops is about 20 of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.backends.ssm.triton_kernels import (_or_zeros, _request_state, _zero_padding_rows,
                                                  request_span, state_block)
from attn_ops.routing import cdiv, pow2

__all__ = ["chunk_table", "chunk_table_triton", "gdn_chunked_triton", "ssd_chunked_triton"]


def chunk_table(query_start_loc: torch.Tensor, num_tokens: int, chunk: int):
    """``(offsets [B + 1], starts [M], ends [M])``: request ``r``'s chunks are entries
    ``offsets[r]:offsets[r + 1]``, chunk ``j`` its rows ``qsl[r] + j * chunk`` up to the next
    boundary or its end; ``M = num_tokens // chunk + B`` bounds the chunks of any batch of
    ``num_tokens`` rows, the entries past the real ones are empty (``start == end``)."""
    qsl = query_start_loc.long()
    b = qsl.shape[0] - 1
    lens = qsl[1:] - qsl[:-1]
    offsets = torch.cat([qsl.new_zeros(1), ((lens + chunk - 1) // chunk).cumsum(0)])
    m = num_tokens // chunk + b
    idx = torch.arange(m, device=qsl.device)
    req = torch.searchsorted(offsets[1:], idx, right=True).clamp(max=max(b - 1, 0))
    starts = qsl[req] + (idx - offsets[req]) * chunk
    ends = torch.minimum(starts + chunk, qsl[req + 1])
    real = idx < offsets[-1]
    return (offsets.to(torch.int32), torch.where(real, starts, 0).to(torch.int32),
            torch.where(real, ends, 0).to(torch.int32))


@triton.jit
def chunk_table_kernel(qsl_ptr, offsets_ptr, starts_ptr, ends_ptr, num_reqs, num_chunks,
                       num_tokens, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Per request: its first chunk's entry (the chunks of the requests before it, summed
    ``BLOCK`` requests at a time), its chunks' rows and ``offsets[r + 1]``; the last request's
    program also empties the entries past the real chunks."""
    r = tl.program_id(0)
    before = r * 0
    for r0 in range(0, r, BLOCK):
        i = r0 + tl.arange(0, BLOCK)
        ok = i < r
        lo = tl.minimum(tl.maximum(tl.load(qsl_ptr + i, mask=ok, other=0), 0), num_tokens)
        hi = tl.minimum(tl.maximum(tl.load(qsl_ptr + i + 1, mask=ok, other=0), lo), num_tokens)
        before += tl.sum((hi - lo + CHUNK - 1) // CHUNK, axis=0).to(tl.int32)
    start, end = request_span(qsl_ptr, r, num_tokens)
    start = start.to(tl.int32)
    end = end.to(tl.int32)
    n = (end - start + CHUNK - 1) // CHUNK
    if r == 0:
        tl.store(offsets_ptr, before)
    tl.store(offsets_ptr + r + 1, before + n)
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        ok = j < n
        rows = start + j * CHUNK
        tl.store(starts_ptr + before + j, rows, mask=ok)
        tl.store(ends_ptr + before + j, tl.minimum(rows + CHUNK, end), mask=ok)
    if r == num_reqs - 1:
        for j0 in range(before + n, num_chunks, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            ok = j < num_chunks
            tl.store(starts_ptr + j, j * 0, mask=ok)
            tl.store(ends_ptr + j, j * 0, mask=ok)


def chunk_table_triton(query_start_loc: torch.Tensor, num_tokens: int, chunk: int):
    """:func:`chunk_table` in one launch."""
    b = query_start_loc.shape[0] - 1
    m = num_tokens // chunk + b
    table = torch.empty(b + 1 + 2 * m, dtype=torch.int32, device=query_start_loc.device)
    offsets, starts, ends = table[:b + 1], table[b + 1:b + 1 + m], table[b + 1 + m:]
    chunk_table_kernel[(b,)](query_start_loc, offsets, starts, ends, b, m, num_tokens,
                             CHUNK=chunk, BLOCK=256, num_warps=1)
    return offsets, starts, ends


@triton.jit
def _dot(a, b, like, IEEE: tl.constexpr):
    """``a @ b`` in fp32: exact fp32 products (``IEEE``) or operands in ``like``'s element
    dtype (the inputs' bf16 / fp16) on the tensor cores."""
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a.to(like.dtype.element_ty), b.to(like.dtype.element_ty))
    return c


@triton.jit
def _dot32(a, b, IEEE: tl.constexpr):
    """``a @ b`` of fp32 operands: exact (``IEEE``) or in tf32 on the tensor cores."""
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision="tf32")
    return c


@triton.jit
def _tile(ptr, rows, ok, stride_t, head_off, offs, offs_ok):
    """``[rows, cols]`` of one head as stored (0 outside)."""
    return tl.load(ptr + rows[:, None] * stride_t + head_off + offs[None, :],
                   mask=ok[:, None] & offs_ok[None, :], other=0.0)


@triton.jit
def _rows(ptr, rows, ok, stride_t, head_off, offs, offs_ok, L2NORM: tl.constexpr):
    """``[rows, cols]`` of one head in fp32 (0 outside), each row L2-normalised if
    ``L2NORM``."""
    x = _tile(ptr, rows, ok, stride_t, head_off, offs, offs_ok).to(tl.float32)
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _chunk_output_program(start_ptr, end_ptr, HEADS: tl.constexpr, DK: tl.constexpr,
                          DV: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_V: tl.constexpr):
    """What a program of a chunk-output launch (:func:`_split_pid` over chunks, heads and
    blocks of value columns) covers: ``(chunk, head, start, end, offs_c, rows, ok, offs_k,
    k_ok, offs_v, v_ok)`` -- the chunk's token rows ``rows = start + offs_c`` (``ok`` below its
    ``end``), all key columns, its block of value columns."""
    c, head, vb = _split_pid(HEADS, DV, BLOCK_V)
    start = tl.load(start_ptr + c)
    end = tl.load(end_ptr + c)
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = start + offs_c
    return c, head, start, end, offs_c, rows, rows < end, offs_k, offs_k < DK, offs_v, offs_v < DV


@triton.jit
def _chunk_start_state(h_ptr, c, head, stride_hc, stride_hh, offs_k, k_ok, offs_v, v_ok,
                       DV: tl.constexpr):
    """A chunk's start state ``[BLOCK_K, BLOCK_V]`` of one head (0 outside), as the hand-off
    wrote it into ``h [chunks, heads, DK, DV]``."""
    return tl.load(h_ptr + c.to(tl.int64) * stride_hc + head * stride_hh
                   + offs_k[:, None] * DV + offs_v[None, :],
                   mask=k_ok[:, None] & v_ok[None, :], other=0.0)


@triton.jit
def _split_pid(HEADS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr):
    """``(outer, head, column block)`` of a flattened launch axis, column blocks fastest then
    heads: programs reading the same rows and heads run side by side and share them in L2 (and
    one axis holds any number of chunks or requests)."""
    pid = tl.program_id(0)
    nb = (COLS + BLOCK - 1) // BLOCK
    return pid // (HEADS * nb), (pid // nb) % HEADS, pid % nb


@triton.jit
def _last_outer(HEADS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr):
    """Whether this program of a :func:`_split_pid` launch is one of the last outer index's
    (the last request's)."""
    return tl.program_id(0) >= tl.num_programs(0) - HEADS * ((COLS + BLOCK - 1) // BLOCK)


# --- Gated DeltaNet -------------------------------------------------------------------------

@triton.jit
def _unit_lower_inverse(a, eye, LOG2_SIZE: tl.constexpr, IEEE: tl.constexpr):
    """``(I + a)^-1`` of a strictly lower triangular ``[n, n]`` ``a`` (nilpotent: ``a^n =
    0``), as the product of ``I + (-a)^(2^i)``: ``log2(n) - 1`` squarings."""
    n = -a
    t = eye + n
    for _i in tl.static_range(LOG2_SIZE - 1):
        n = _dot32(n, n, IEEE)
        t = _dot32(t, eye + n, IEEE)
    return t


@triton.jit
def _wy_rows(k_ptr, v_ptr, g_ptr, beta_ptr, rows, end, hv, stride_kt, stride_kh, stride_vt,
             stride_vh, stride_gt, offs_k, offs_v, GROUP: tl.constexpr, DK: tl.constexpr,
             DV: tl.constexpr, L2NORM: tl.constexpr):
    """Rows of a chunk for value head ``hv``: ``(valid, k, v, beta, g)`` (0 outside)."""
    ok = rows < end
    k = _rows(k_ptr, rows, ok, stride_kt, (hv // GROUP) * stride_kh, offs_k, offs_k < DK,
              L2NORM)
    v = _rows(v_ptr, rows, ok, stride_vt, hv * stride_vh, offs_v, offs_v < DV, False)
    g = tl.load(g_ptr + rows * stride_gt + hv, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_gt + hv, mask=ok, other=0.0).to(tl.float32)
    return ok, k, v, beta, g


@triton.jit
def _wy_store(w_ptr, u_ptr, w, u, rows, ok, hv, stride_wt, stride_wh, stride_ut, stride_uh,
              offs_k, offs_v, DK: tl.constexpr, DV: tl.constexpr):
    tl.store(w_ptr + rows[:, None] * stride_wt + hv * stride_wh + offs_k[None, :],
             w.to(w_ptr.dtype.element_ty), mask=ok[:, None] & (offs_k < DK)[None, :])
    tl.store(u_ptr + rows[:, None] * stride_ut + hv * stride_uh + offs_v[None, :],
             u.to(u_ptr.dtype.element_ty), mask=ok[:, None] & (offs_v < DV)[None, :])


@triton.jit
def _store_keys(kn_ptr, k, rows, ok, hv, stride_kt, stride_kh, offs_k, GROUP: tl.constexpr,
                DK: tl.constexpr, L2NORM: tl.constexpr):
    if L2NORM:
        if hv % GROUP == 0:
            tl.store(kn_ptr + rows[:, None] * stride_kt + (hv // GROUP) * stride_kh
                     + offs_k[None, :], k.to(kn_ptr.dtype.element_ty),
                     mask=ok[:, None] & (offs_k < DK)[None, :])


@triton.jit
def gdn_wy_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, kn_ptr, start_ptr, end_ptr,
                  stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_wt, stride_wh,
                  stride_ut, stride_uh, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr,
                  DV: tl.constexpr, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
                  IEEE: tl.constexpr):
    """Per chunk and value head: with ``G`` the chunk's cumulative log decay,
    ``A = tril_-1(beta k k^T e^(G_i - G_j))`` and ``T = (I + A)^-1``, the WY factors
    ``w = T (beta e^G k)`` and ``u = T (beta v)``. Chunks of 64 tokens and more invert by
    halves -- ``T_11``, ``T_22`` by squarings (two independent chains of one squaring fewer)
    and ``T_21 = -T_22 A_21 T_11`` -- instead of squaring the whole ``[chunk, chunk]``.
    With ``L2NORM`` the first value head of each key head also writes the normalised keys
    into ``kn`` (the key layout), so the later launches -- the sequential hand-off above
    all -- load them ready instead of reducing every row again."""
    c, hv, _col = _split_pid(HV, 1, 1)
    start = tl.load(start_ptr + c)
    end = tl.load(end_ptr + c)
    if start < end:
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = tl.arange(0, BLOCK_V)
        if CHUNK < 64:
            offs_c = tl.arange(0, CHUNK)
            rows = start + offs_c
            ok, k, v, beta, g = _wy_rows(
                k_ptr, v_ptr, g_ptr, beta_ptr, rows, end, hv, stride_kt, stride_kh, stride_vt,
                stride_vh, stride_gt, offs_k, offs_v, GROUP, DK, DV, L2NORM)
            cum = tl.cumsum(g, axis=0)
            below = offs_c[:, None] > offs_c[None, :]
            decay = tl.exp(tl.minimum(cum[:, None] - cum[None, :], 0.0))
            a = tl.where(below, beta[:, None] * _dot(k, tl.trans(k), w_ptr, IEEE) * decay, 0.0)
            eye = (offs_c[:, None] == offs_c[None, :]).to(tl.float32)
            t = _unit_lower_inverse(a, eye, LOG2_CHUNK, IEEE)
            w = _dot(t, (beta * tl.exp(cum))[:, None] * k, w_ptr, IEEE)
            u = _dot(t, beta[:, None] * v, w_ptr, IEEE)
            _wy_store(w_ptr, u_ptr, w, u, rows, ok, hv, stride_wt, stride_wh, stride_ut,
                      stride_uh, offs_k, offs_v, DK, DV)
            _store_keys(kn_ptr, k, rows, ok, hv, stride_kt, stride_kh, offs_k, GROUP, DK,
                        L2NORM)
        else:
            offs_c = tl.arange(0, CHUNK // 2)
            rows1 = start + offs_c
            rows2 = rows1 + CHUNK // 2
            ok1, k1, v1, beta1, g1 = _wy_rows(
                k_ptr, v_ptr, g_ptr, beta_ptr, rows1, end, hv, stride_kt, stride_kh, stride_vt,
                stride_vh, stride_gt, offs_k, offs_v, GROUP, DK, DV, L2NORM)
            ok2, k2, v2, beta2, g2 = _wy_rows(
                k_ptr, v_ptr, g_ptr, beta_ptr, rows2, end, hv, stride_kt, stride_kh, stride_vt,
                stride_vh, stride_gt, offs_k, offs_v, GROUP, DK, DV, L2NORM)
            cum1 = tl.cumsum(g1, axis=0)
            cum2 = tl.cumsum(g2, axis=0) + tl.sum(g1, axis=0)
            below = offs_c[:, None] > offs_c[None, :]
            eye = (offs_c[:, None] == offs_c[None, :]).to(tl.float32)
            a11 = tl.where(below, beta1[:, None] * _dot(k1, tl.trans(k1), w_ptr, IEEE)
                           * tl.exp(tl.minimum(cum1[:, None] - cum1[None, :], 0.0)), 0.0)
            a22 = tl.where(below, beta2[:, None] * _dot(k2, tl.trans(k2), w_ptr, IEEE)
                           * tl.exp(tl.minimum(cum2[:, None] - cum2[None, :], 0.0)), 0.0)
            a21 = beta2[:, None] * _dot(k2, tl.trans(k1), w_ptr, IEEE) \
                * tl.exp(tl.minimum(cum2[:, None] - cum1[None, :], 0.0))
            t11 = _unit_lower_inverse(a11, eye, LOG2_CHUNK - 1, IEEE)
            t22 = _unit_lower_inverse(a22, eye, LOG2_CHUNK - 1, IEEE)
            t21 = -_dot32(t22, _dot32(a21, t11, IEEE), IEEE)
            x1 = (beta1 * tl.exp(cum1))[:, None] * k1
            x2 = (beta2 * tl.exp(cum2))[:, None] * k2
            y1 = beta1[:, None] * v1
            y2 = beta2[:, None] * v2
            w1 = _dot(t11, x1, w_ptr, IEEE)
            u1 = _dot(t11, y1, w_ptr, IEEE)
            w2 = _dot(t21, x1, w_ptr, IEEE) + _dot(t22, x2, w_ptr, IEEE)
            u2 = _dot(t21, y1, w_ptr, IEEE) + _dot(t22, y2, w_ptr, IEEE)
            _wy_store(w_ptr, u_ptr, w1, u1, rows1, ok1, hv, stride_wt, stride_wh, stride_ut,
                      stride_uh, offs_k, offs_v, DK, DV)
            _wy_store(w_ptr, u_ptr, w2, u2, rows2, ok2, hv, stride_wt, stride_wh, stride_ut,
                      stride_uh, offs_k, offs_v, DK, DV)
            _store_keys(kn_ptr, k1, rows1, ok1, hv, stride_kt, stride_kh, offs_k, GROUP, DK,
                        L2NORM)
            _store_keys(kn_ptr, k2, rows2, ok2, hv, stride_kt, stride_kh, offs_k, GROUP, DK,
                        L2NORM)


@triton.jit
def gdn_state_kernel(k_ptr, g_ptr, w_ptr, u_ptr, h_ptr, state_ptr, o_ptr, qsl_ptr, coff_ptr,
                     slot_ptr, init_ptr, stride_kt, stride_kh, stride_gt, stride_wt, stride_wh,
                     stride_ut, stride_uh, stride_hc, stride_hh, stride_ss, stride_sh, stride_sk,
                     stride_ot, stride_oh, num_tokens, num_slots, HV: tl.constexpr,
                     GROUP: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_V: tl.constexpr, IEEE: tl.constexpr, EVICT: tl.constexpr):
    """Per request, value head and block of value columns, chunk after chunk: the state at
    the chunk's start into ``h``, the corrected values ``d = u - w S`` over ``u``, then
    ``S = e^(G_last) S + k^T (e^(G_last - G) d)``; the final state into the slot, and the
    last request's programs zero the output rows past its end. ``k``: the normalised keys.
    Only ``S`` carries from chunk to chunk, so each step's loads are issued ahead
    (``num_stages``) and its chain is two small products; the decay scales ``d`` (a block
    of value columns), not the keys' full rows."""
    r, hv, vb = _split_pid(HV, DV, BLOCK_V)
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    start, end, s, _, s_ptrs, s_mask, w_mask = _request_state(
        qsl_ptr, slot_ptr, init_ptr, state_ptr, r, 1, stride_ss, num_slots, hv * stride_sh,
        offs_k, offs_v, k_ok, v_ok, stride_sk, num_tokens, EVICT)
    h_offs = hv * stride_hh + offs_k[:, None] * DV + offs_v[None, :]
    c = tl.load(coff_ptr + r).to(tl.int64)
    for c0 in range(start, end, CHUNK):
        tl.store(h_ptr + c * stride_hc + h_offs, s.to(h_ptr.dtype.element_ty), mask=s_mask)
        rows = c0 + offs_c
        ok = rows < end
        w = _tile(w_ptr, rows, ok, stride_wt, hv * stride_wh, offs_k, k_ok)
        u_ptrs = u_ptr + rows[:, None] * stride_ut + hv * stride_uh + offs_v[None, :]
        uv_mask = ok[:, None] & v_ok[None, :]
        d = tl.load(u_ptrs, mask=uv_mask, other=0.0).to(tl.float32) - _dot(w, s, w_ptr, IEEE)
        tl.store(u_ptrs, d.to(u_ptr.dtype.element_ty), mask=uv_mask)
        k = _tile(k_ptr, rows, ok, stride_kt, (hv // GROUP) * stride_kh, offs_k, k_ok)
        g = tl.load(g_ptr + rows * stride_gt + hv, mask=ok, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, axis=0)
        last = tl.sum(g, axis=0)
        s = tl.exp(last) * s + _dot(tl.trans(k), d * tl.exp(last - cum)[:, None], w_ptr, IEEE)
        c += 1
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=w_mask)
    _zero_padding_rows(o_ptr, _last_outer(HV, DV, BLOCK_V), end, num_tokens, stride_ot,
                       hv * stride_oh + offs_v, v_ok)


@triton.jit
def gdn_output_kernel(q_ptr, k_ptr, g_ptr, u_ptr, h_ptr, o_ptr, start_ptr, end_ptr, scale,
                      stride_kt, stride_kh, stride_gt, stride_ut, stride_uh, stride_hc,
                      stride_hh, stride_ot, stride_oh, HV: tl.constexpr, GROUP: tl.constexpr,
                      DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
                      IEEE: tl.constexpr):
    """Per chunk, value head and block of value columns: ``o = (e^G q) S + tril(q k^T
    e^(G_i - G_j)) d`` from the chunk's start state ``S`` and corrected values ``d``
    (``k``: the normalised keys; ``q`` normalised here with ``L2NORM``)."""
    c, hv, start, end, offs_c, rows, ok, offs_k, k_ok, offs_v, v_ok = _chunk_output_program(
        start_ptr, end_ptr, HV, DK, DV, CHUNK, BLOCK_K, BLOCK_V)
    if start < end:
        head = (hv // GROUP) * stride_kh
        q = _rows(q_ptr, rows, ok, stride_kt, head, offs_k, k_ok, L2NORM) * scale
        k = _rows(k_ptr, rows, ok, stride_kt, head, offs_k, k_ok, False)
        g = tl.load(g_ptr + rows * stride_gt + hv, mask=ok, other=0.0).to(tl.float32)
        cum = tl.cumsum(g, axis=0)
        s = _chunk_start_state(h_ptr, c, hv, stride_hc, stride_hh, offs_k, k_ok, offs_v, v_ok, DV)
        d = _tile(u_ptr, rows, ok, stride_ut, hv * stride_uh, offs_v, v_ok)
        decay = tl.exp(tl.minimum(cum[:, None] - cum[None, :], 0.0))
        causal = tl.where(offs_c[:, None] >= offs_c[None, :],
                          _dot(q, tl.trans(k), u_ptr, IEEE) * decay, 0.0)
        o = _dot(q * tl.exp(cum)[:, None], s, u_ptr, IEEE) + _dot(causal, d, u_ptr, IEEE)
        tl.store(o_ptr + rows[:, None] * stride_ot + hv * stride_oh + offs_v[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=ok[:, None] & v_ok[None, :])


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the intermediates and of the products' operands: the inputs' (fp32 for
    fp32 inputs: exact products)."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


def gdn_chunked_triton(q, k, v, g, beta, state, query_start_loc, state_indices,
                       has_initial_state, scale, qk_l2norm, chunk: int = 32,
                       state_block_v: int = 32, output_block_v: int = 64,
                       warps: tuple[int, int, int] = (4, 4, 4),
                       state_min_programs: int = 1, state_stages: int = 2) -> torch.Tensor:
    """``torch.ops.attn.gated_delta_rule`` in chunks of ``chunk`` (a power of two >= 16)
    tokens, one slot a request, the state hand-off and the outputs over blocks of
    ``state_block_v`` (halved, not below 32, while the hand-off has fewer than
    ``state_min_programs`` programs) / ``output_block_v`` value columns; ``warps``: of the
    WY, hand-off and output launches; ``state_stages``: the hand-off's software-pipelined
    loads (inputs already checked)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    b = query_start_loc.shape[0] - 1
    if b == 0:
        return torch.zeros_like(v)
    out = torch.empty_like(v)
    offsets, starts, ends = chunk_table_triton(query_start_loc, t, chunk)
    m = starts.shape[0]
    wdt = _work_dtype(q)
    ieee = wdt == torch.float32
    block_k, block_v = max(pow2(dk), 16), max(pow2(dv), 16)
    w = torch.empty(t, hv, dk, dtype=wdt, device=q.device)
    u = torch.empty(t, hv, dv, dtype=wdt, device=q.device)
    h = torch.empty(m, hv, dk, dv, dtype=wdt, device=q.device)
    kn = torch.empty(t, hk, dk, dtype=wdt, device=q.device) if qk_l2norm else k
    common = dict(HV=hv, GROUP=hv // hk, DK=dk, DV=dv, CHUNK=chunk, BLOCK_K=block_k, IEEE=ieee)
    gdn_wy_kernel[(m * hv,)](
        k, v, g, beta, w, u, kn, starts, ends, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), g.stride(0), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        LOG2_CHUNK=chunk.bit_length() - 1, BLOCK_V=block_v, L2NORM=qk_l2norm,
        num_warps=warps[0], **common)
    state_bv = state_block(b * hv, dv, state_block_v, state_min_programs)
    gdn_state_kernel[(b * hv * cdiv(dv, state_bv),)](
        kn, g, w, u, h, state, out, query_start_loc, offsets, state_indices,
        has_initial_state, kn.stride(0), kn.stride(1), g.stride(0), w.stride(0), w.stride(1),
        u.stride(0), u.stride(1), h.stride(0), h.stride(1), state.stride(0), state.stride(1),
        state.stride(2), out.stride(0), out.stride(1), t, state.shape[0], BLOCK_V=state_bv,
        EVICT="", num_warps=warps[1], num_stages=state_stages, **common)
    out_bv = min(block_v, output_block_v)
    gdn_output_kernel[(m * hv * cdiv(dv, out_bv),)](
        q, kn, g, u, h, out, starts, ends, scale, kn.stride(0), kn.stride(1), g.stride(0),
        u.stride(0), u.stride(1), h.stride(0), h.stride(1), out.stride(0), out.stride(1),
        BLOCK_V=out_bv, L2NORM=qk_l2norm, num_warps=warps[2], **common)
    return out


# --- Mamba2 (SSD) ---------------------------------------------------------------------------

@triton.jit
def ssd_dt_kernel(dt_ptr, a_ptr, dtb_ptr, dtc_ptr, cum_ptr, start_ptr, end_ptr, dt_min, dt_max,
                  stride_dtt, num_tokens, H: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_H: tl.constexpr, SOFTPLUS: tl.constexpr):
    """Per chunk and block of heads: the step sizes (dt + bias, softplus, clamped) and the
    chunk's log decay through each row, ``cum = cumsum(dt * A)``, into ``[heads, tokens]``
    fp32 rows that the later launches read whole instead of recomputing."""
    c = tl.program_id(0)
    start = tl.load(start_ptr + c)
    end = tl.load(end_ptr + c)
    if start < end:
        rows = start + tl.arange(0, CHUNK)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < H
        ok = (rows < end)[:, None] & h_ok[None, :]
        dt = tl.load(dt_ptr + rows[:, None] * stride_dtt + heads[None, :], mask=ok,
                     other=0.0).to(tl.float32)
        dt += tl.load(dtb_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)[None, :]
        if SOFTPLUS:
            dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
        dt = tl.where(ok, tl.minimum(tl.maximum(dt, dt_min), dt_max), 0.0)
        cum = tl.cumsum(dt * tl.load(a_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)[None, :],
                        axis=0)
        offs = heads[None, :].to(tl.int64) * num_tokens + rows[:, None]
        tl.store(dtc_ptr + offs, dt, mask=ok)
        tl.store(cum_ptr + offs, cum, mask=ok)


@triton.jit
def _ssd_rows(dtc_ptr, cum_ptr, x_ptr, rows, end, h, num_tokens, stride_xt, stride_xh, offs_p,
              p_ok):
    """Rows of a chunk for head ``h``: ``(valid, dt, cum, x)`` -- their step sizes, the chunk's
    log decay through each and their inputs (0 outside)."""
    ok = rows < end
    at = h.to(tl.int64) * num_tokens + rows
    dt = tl.load(dtc_ptr + at, mask=ok, other=0.0)
    cum = tl.load(cum_ptr + at, mask=ok, other=0.0)
    x = _tile(x_ptr, rows, ok, stride_xt, h * stride_xh, offs_p, p_ok)
    return ok, dt, cum, x


@triton.jit
def ssd_contrib_kernel(x_ptr, dtc_ptr, cum_ptr, b_ptr, st_ptr, start_ptr, end_ptr, num_tokens,
                       stride_xt, stride_xh, stride_bt, stride_bg, stride_sc, stride_sh,
                       H: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr,
                       N: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Per chunk, head and block of head channels: the chunk's own contribution to the state
    at its end, ``(e^(cum_last - cum) dt x)^T B``, over the chunk ``BLOCK`` rows at a time."""
    c, h, pb = _split_pid(H, P, BLOCK_P)
    start = tl.load(start_ptr + c)
    end = tl.load(end_ptr + c)
    if start < end:
        grp = h // HEADS_PER_GROUP
        offs_b = tl.arange(0, BLOCK)
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        p_ok = offs_p < P
        n_ok = offs_n < N
        last = tl.load(cum_ptr + h.to(tl.int64) * num_tokens + end - 1)
        acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        for b0 in tl.static_range(0, CHUNK, BLOCK):
            rows = start + b0 + offs_b
            ok, dt, cum, x = _ssd_rows(dtc_ptr, cum_ptr, x_ptr, rows, end, h, num_tokens,
                                       stride_xt, stride_xh, offs_p, p_ok)
            bb = tl.load(b_ptr + rows[:, None] * stride_bt + grp * stride_bg + offs_n[None, :],
                         mask=ok[:, None] & n_ok[None, :], other=0.0)
            xs = x.to(tl.float32) * (dt * tl.exp(last - cum))[:, None]
            acc += _dot(tl.trans(xs), bb, x_ptr, IEEE)
        tl.store(st_ptr + c.to(tl.int64) * stride_sc + h * stride_sh + offs_p[:, None] * N
                 + offs_n[None, :], acc, mask=p_ok[:, None] & n_ok[None, :])


@triton.jit
def ssd_state_kernel(cum_ptr, st_ptr, hs_ptr, state_ptr, y_ptr, qsl_ptr, coff_ptr, slot_ptr,
                     init_ptr, num_tokens, num_slots, stride_sc, stride_sh, stride_ss,
                     stride_slot_h, stride_slot_p, stride_yt, stride_yh, H: tl.constexpr,
                     P: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr):
    """Per request, head and block of head channels, chunk after chunk: the state at the
    chunk's start into ``hs`` (in the inputs' dtype: the output launch's product operand,
    half the bytes of the fp32 contribution ``st``), then ``S = e^(cum_last) S +
    contribution``; the final state into the slot, and the last request's programs zero the
    output rows past its end."""
    r, h, pb = _split_pid(H, P, BLOCK_P)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_ok = offs_p < P
    n_ok = offs_n < N
    start, end, s, _, s_ptrs, s_mask, w_mask = _request_state(
        qsl_ptr, slot_ptr, init_ptr, state_ptr, r, 1, stride_ss, num_slots, h * stride_slot_h,
        offs_p, offs_n, p_ok, n_ok, stride_slot_p, num_tokens, EVICT)
    cum_h = cum_ptr + h.to(tl.int64) * num_tokens
    st_offs = h * stride_sh + offs_p[:, None] * N + offs_n[None, :]
    c = tl.load(coff_ptr + r).to(tl.int64)
    for c0 in range(start, end, CHUNK):
        last = tl.load(cum_h + tl.minimum(c0 + CHUNK, end) - 1)
        at = c * stride_sc + st_offs
        contrib = tl.load(st_ptr + at, mask=s_mask, other=0.0)
        tl.store(hs_ptr + at, s.to(hs_ptr.dtype.element_ty), mask=s_mask)
        s = tl.exp(last) * s + contrib
        c += 1
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=w_mask)
    _zero_padding_rows(y_ptr, _last_outer(H, P, BLOCK_P), end, num_tokens, stride_yt,
                       h * stride_yh + offs_p, p_ok)


@triton.jit
def ssd_cb_kernel(b_ptr, c_ptr, cb_ptr, start_ptr, end_ptr, stride_bt, stride_bg, stride_cbc,
                  stride_cbg, N: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Per chunk, ``BLOCK`` rows of it and group: ``C B^T`` against the chunk's keys up to
    those rows (the causal part), once for all the group's heads."""
    c = tl.program_id(0)
    m0_rel = tl.program_id(1) * BLOCK
    grp = tl.program_id(2)
    start = tl.load(start_ptr + c)
    end = tl.load(end_ptr + c)
    if start + m0_rel < end:
        offs_b = tl.arange(0, BLOCK)
        offs_n = tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        rows = start + m0_rel + offs_b
        cc = tl.load(c_ptr + rows[:, None] * stride_bt + grp * stride_bg + offs_n[None, :],
                     mask=(rows < end)[:, None] & n_ok[None, :], other=0.0)
        out = cb_ptr + c.to(tl.int64) * stride_cbc + grp * stride_cbg \
            + (m0_rel + offs_b)[:, None] * CHUNK
        for k0 in range(0, m0_rel + BLOCK, BLOCK):
            keys = start + k0 + offs_b
            bb = tl.load(b_ptr + keys[:, None] * stride_bt + grp * stride_bg + offs_n[None, :],
                         mask=(keys < end)[:, None] & n_ok[None, :], other=0.0)
            tl.store(out + (k0 + offs_b)[None, :], _dot(cc, tl.trans(bb), c_ptr, IEEE))


@triton.jit
def ssd_output_kernel(x_ptr, dtc_ptr, cum_ptr, cb_ptr, c_ptr, d_ptr, z_ptr, hs_ptr, y_ptr,
                      start_ptr, end_ptr, num_tokens, stride_xt, stride_xh, stride_bt,
                      stride_bg, stride_cbc, stride_cbg, stride_sc, stride_sh,
                      H: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr,
                      N: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                      KEY_BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                      HAS_Z: tl.constexpr, IEEE: tl.constexpr):
    """Per ``BLOCK`` rows of a chunk, head and block of head channels: ``y = e^cum (C S^T) +
    sum over the chunk's earlier keys, KEY_BLOCK at a time, of (tril(C B^T e^(cum_i - cum_j))
    dt) x`` (``C B^T`` from :func:`ssd_cb_kernel`, which wrote every entry a row reads:
    ``KEY_BLOCK`` divides the chunk), then ``+ D x`` and the ``z`` gate. A group's heads run
    side by side: they read the same ``C B^T`` and ``C``."""
    blk, h, pb = _split_pid(H, P, BLOCK_P)
    c = blk // (CHUNK // BLOCK)
    m0_rel = (blk % (CHUNK // BLOCK)) * BLOCK
    start = tl.load(start_ptr + c)
    end = tl.load(end_ptr + c)
    m0 = start + m0_rel
    if m0 < end:
        grp = h // HEADS_PER_GROUP
        offs_b = tl.arange(0, BLOCK)
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_n = tl.arange(0, BLOCK_N)
        p_ok = offs_p < P
        n_ok = offs_n < N
        rows = m0 + offs_b
        ok, _, cum, x = _ssd_rows(dtc_ptr, cum_ptr, x_ptr, rows, end, h, num_tokens, stride_xt,
                                  stride_xh, offs_p, p_ok)
        cc = tl.load(c_ptr + rows[:, None] * stride_bt + grp * stride_bg + offs_n[None, :],
                     mask=ok[:, None] & n_ok[None, :], other=0.0)
        s = tl.load(hs_ptr + c.to(tl.int64) * stride_sc + h * stride_sh + offs_p[:, None] * N
                    + offs_n[None, :], mask=p_ok[:, None] & n_ok[None, :], other=0.0)
        y = tl.exp(cum)[:, None] * _dot(cc, tl.trans(s), x_ptr, IEEE)  # [BLOCK, BLOCK_P]
        cb_rows = cb_ptr + c.to(tl.int64) * stride_cbc + grp * stride_cbg \
            + (m0_rel + offs_b)[:, None] * CHUNK
        offs_kb = tl.arange(0, KEY_BLOCK)
        for k0 in range(0, m0_rel + BLOCK, KEY_BLOCK):
            keys = start + k0 + offs_kb
            k_ok, dt_k, cum_k, xk = _ssd_rows(dtc_ptr, cum_ptr, x_ptr, keys, end, h, num_tokens,
                                              stride_xt, stride_xh, offs_p, p_ok)
            causal = (rows[:, None] >= keys[None, :]) & k_ok[None, :]
            # unmasked (vectorised) -- every entry is inside the buffer, and those the C B^T
            # launch left unwritten (above the diagonal, past the chunk's end) are dropped
            # by the select below or land in rows that are not stored
            cb = tl.load(cb_rows + (k0 + offs_kb)[None, :])
            wts = tl.where(causal, cb * tl.exp(tl.minimum(cum[:, None] - cum_k[None, :], 0.0))
                           * dt_k[None, :], 0.0)
            y += _dot(wts, xk, x_ptr, IEEE)
        y += tl.load(d_ptr + h).to(tl.float32) * x.to(tl.float32)
        x_ptrs = rows[:, None] * stride_xt + h * stride_xh + offs_p[None, :]
        xp_mask = ok[:, None] & p_ok[None, :]
        if HAS_Z:
            z = tl.load(z_ptr + x_ptrs, mask=xp_mask, other=0.0).to(tl.float32)
            y = y * z / (1.0 + tl.exp(-z))
        tl.store(y_ptr + x_ptrs, y.to(y_ptr.dtype.element_ty), mask=xp_mask)


def ssd_chunked_triton(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
                       has_initial_state, dt_softplus, dt_min, dt_max, chunk: int = 256,
                       block: int | None = None, num_warps: int = 4,
                       state_block_p: int = 64, key_block: int | None = None,
                       num_stages: int = 1, contrib_block: int = 64,
                       contrib_warps: int = 4) -> torch.Tensor:
    """``torch.ops.attn.mamba2_ssd`` in chunks of ``chunk`` (a power of two >= 16) tokens,
    ``block`` (default ``min(chunk, 32)``) rows of a chunk an output program of
    ``num_warps`` warps and ``num_stages`` pipeline stages stepping ``key_block`` (default
    ``block``; at most the chunk) of its keys at a time, ``contrib_block`` rows a step of a
    contribution program of ``contrib_warps`` warps, ``state_block_p`` head channels a
    program of the state hand-off, one slot a request (inputs already checked)."""
    x, dt, B, C = (u.contiguous() for u in (x, dt, B, C))
    z = z.contiguous() if z is not None else None
    t, h, p = x.shape
    g, n = B.shape[1:]
    b = query_start_loc.shape[0] - 1
    if b == 0:
        return torch.zeros_like(x)
    y = torch.empty_like(x)
    offsets, starts, ends = chunk_table_triton(query_start_loc, t, chunk)
    m = starts.shape[0]
    ieee = _work_dtype(x) == torch.float32
    block = block or min(chunk, 32)
    key_block = min(key_block or block, chunk)
    block_p = max(min(pow2(p), 64), 16)
    block_n = max(pow2(n), 16)
    D, dt_bias = _or_zeros(D, h, x.device), _or_zeros(dt_bias, h, x.device)
    dtc = torch.empty(h, t, dtype=torch.float32, device=x.device)
    cum = torch.empty_like(dtc)
    block_h = min(pow2(h), max(4096 // chunk, 1))
    ssd_dt_kernel[(m, cdiv(h, block_h))](
        dt, A, dt_bias, dtc, cum, starts, ends, float(dt_min), float(min(dt_max, 3.0e38)),
        dt.stride(0), t, H=h, CHUNK=chunk, BLOCK_H=block_h, SOFTPLUS=dt_softplus, num_warps=4)
    st = torch.empty(m, h, p, n, dtype=torch.float32, device=x.device)
    shape = dict(H=h, P=p, N=n, CHUNK=chunk)
    n_pb = cdiv(p, block_p)
    ssd_contrib_kernel[(m * h * n_pb,)](
        x, dtc, cum, B, st, starts, ends, t, x.stride(0), x.stride(1), B.stride(0), B.stride(1),
        st.stride(0), st.stride(1), HEADS_PER_GROUP=h // g, BLOCK=min(contrib_block, chunk),
        BLOCK_P=block_p, BLOCK_N=block_n, IEEE=ieee, num_warps=contrib_warps, **shape)
    state_bp = min(block_p, state_block_p)
    hs = torch.empty(st.shape, dtype=_work_dtype(x), device=x.device)
    ssd_state_kernel[(b * h * cdiv(p, state_bp),)](
        cum, st, hs, state, y, query_start_loc, offsets, state_indices, has_initial_state, t,
        state.shape[0], st.stride(0), st.stride(1), state.stride(0), state.stride(1),
        state.stride(2), y.stride(0), y.stride(1), EVICT="", BLOCK_P=state_bp, BLOCK_N=block_n,
        num_warps=4, **shape)
    cb = torch.empty(m, g, chunk, chunk, dtype=torch.float32, device=x.device)
    ssd_cb_kernel[(m, chunk // block, g)](
        B, C, cb, starts, ends, B.stride(0), B.stride(1), cb.stride(0), cb.stride(1), N=n,
        CHUNK=chunk, BLOCK=block, BLOCK_N=block_n, IEEE=ieee, num_warps=4)
    ssd_output_kernel[(m * (chunk // block) * h * n_pb,)](
        x, dtc, cum, cb, C, D, z if z is not None else x, hs, y, starts, ends, t, x.stride(0),
        x.stride(1), C.stride(0), C.stride(1), cb.stride(0), cb.stride(1), st.stride(0),
        st.stride(1), HEADS_PER_GROUP=h // g, BLOCK=block, KEY_BLOCK=key_block,
        BLOCK_P=block_p, BLOCK_N=block_n, HAS_Z=z is not None, IEEE=ieee, num_warps=num_warps,
        num_stages=num_stages, **shape)
    return y
