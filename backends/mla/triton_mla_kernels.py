"""TRITON_MLA's kernel: the absorbed (MQA) form of MLA over the paged latent cache, split-KV.

Every head of a request reads the same latent rows, so one program takes ``HEADS`` heads x
``Q_ROWS`` query rows of one request (``M = HEADS x Q_ROWS`` rows: row ``m`` is query
``m // HEADS``, head ``m % HEADS`` of the program's head block) and one split of its keys. Per
``BLOCK_N`` keys it loads the latent rows once, ``c`` [BLOCK_N, RANK] and ``k_pe``
[BLOCK_N, ROPE], and runs

    s   = (ql @ c^T + q_pe @ k_pe^T) * scale        (ql: q_nope @ W_UK, RANK wide)
    acc = acc * alpha + softmax_part(s) @ c          (online softmax in base 2)

so K and V are the same tile (the values are the latent's first RANK entries). Query ``t`` of a
request with ``n`` new tokens and ``s`` cached ones sits at position ``s - n + t`` and sees the
keys up to it (speculative decodes and short prefills). fp8 latents: the per-tensor scale goes
into the score scale and, for the output, into the split combine (or the final store).

With one split a program writes its rows' latent output; with more it writes fp32 partials
``[rows, heads, splits, RANK_P]`` and their natural-log LSEs, which TRITON_ATTN's split combine
(``combine_splits_kernel``) merges. Splits of a request cover ``ceil(s / splits)`` keys each
(rounded up to ``BLOCK_N``); an empty split writes LSE -inf. Programs past a request's rows or
heads return: a CUDA graph launches the grid of its capture size.

Block ids and lengths arrive on the device and are never trusted: the keys past the end of
the request's block-table row are absent (the key range stops there) and so is a key whose
block id is outside the cache (its range check is folded into the key mask: never read, out of
the softmax).

``VALUE_PARTS = 2`` gives each (head block, split) two programs, one per half of the value
columns: both compute the whole score (the other half's columns enter ``s`` only) and each
accumulates its half, ``[M, RANK_P / 2]`` -- half the accumulator registers and twice the
programs, for twice the score MMAs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attn_ops.backends.triton_attn_kernels import LN2, LOG2E


@triton.jit
def online_softmax_step(s, c, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One block of keys into a running softmax (base 2): scores ``s`` [M, N] (already
    scaled by log2(e); -inf where masked), the block's values ``c`` [N, width]; returns
    ``(m_i, l_i, acc)`` -- a row with no key yet keeps m -inf, l 0, acc 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_reqs", "num_pages", "bt_width", "num_rows"])
def mla_decode_kernel(
    ql_ptr, qpe_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr, kv_scale_ptr,
    num_reqs, sm_scale, num_pages, bt_width, num_rows,
    stride_lt, stride_lh, stride_pt, stride_ph, stride_ot, stride_oh,
    stride_cb, stride_cp, stride_bt,
    H: tl.constexpr, HEADS: tl.constexpr, Q_ROWS: tl.constexpr,
    RANK: tl.constexpr, RANK_P: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FP8: tl.constexpr,
    PRECISION: tl.constexpr, VALUE_PARTS: tl.constexpr,
):
    req = tl.program_id(0)
    head_block = tl.program_id(1) // VALUE_PARTS
    split = tl.program_id(2)
    if req >= num_reqs:
        return
    q0 = tl.load(qsl_ptr + req)
    n = tl.load(qsl_ptr + req + 1) - q0
    seq = tl.load(seq_lens_ptr + req)
    if n == 0:
        return
    M: tl.constexpr = HEADS * Q_ROWS
    offs_m = tl.arange(0, M)
    t = offs_m // HEADS
    h = head_block * HEADS + offs_m % HEADS
    # (a query_start_loc pointing outside the rows -- a corrupt device value -- touches none)
    row_ok = (t < n) & (h < H) & (q0 + t >= 0) & (q0 + t < num_rows)
    pos = seq - n + t
    # this program's value columns ("mine": all of them, or one half) and, with two parts, the
    # other half, which only enters the scores
    VW: tl.constexpr = RANK_P // VALUE_PARTS
    mine = (tl.program_id(1) % VALUE_PARTS) * VW
    offs_r = mine + tl.arange(0, VW)
    offs_p = tl.arange(0, ROPE_P)
    r_ok = offs_r < RANK
    p_ok = offs_p < ROPE
    row = (q0 + t).to(tl.int64)
    q_rows = ql_ptr + row[:, None] * stride_lt + h[:, None] * stride_lh
    ql = tl.load(q_rows + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    if VALUE_PARTS == 2:
        offs_o = (VW - mine) + tl.arange(0, VW)
        o_ok = offs_o < RANK
        ql_o = tl.load(q_rows + offs_o[None, :], mask=row_ok[:, None] & o_ok[None, :], other=0.0)
    qpe = tl.load(qpe_ptr + row[:, None] * stride_pt + h[:, None] * stride_ph + offs_p[None, :],
                  mask=row_ok[:, None] & p_ok[None, :], other=0.0)
    qk_scale = sm_scale * LOG2E
    if FP8:
        kv_scale = tl.load(kv_scale_ptr)
        qk_scale = qk_scale * kv_scale
    keys = tl.minimum(seq, bt_width * PAGE)  # (keys past the block-table row are absent)
    per_split = tl.cdiv(tl.cdiv(keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(keys, lo + per_split)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, VW], tl.float32)
    table = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        if PAGE % BLOCK_N == 0:  # (steps start at multiples of BLOCK_N: one page per step)
            page = tl.load(table + start // PAGE).to(tl.int64)
            n_ok = tl.where((page >= 0) & (page < num_pages), n_ok, False)  # (outside: absent)
        else:
            page = tl.load(table + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            n_ok = n_ok & (page >= 0) & (page < num_pages)  # (a block id outside: absent)
        rows = cache_ptr + page * stride_cb + (offs_n % PAGE).to(tl.int64) * stride_cp
        c = tl.load(rows[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                    other=0.0).to(ql.dtype)
        kpe = tl.load(rows[:, None] + RANK + offs_p[None, :],
                      mask=n_ok[:, None] & p_ok[None, :], other=0.0).to(qpe.dtype)
        s = tl.dot(ql, tl.trans(c), input_precision=PRECISION)
        if VALUE_PARTS == 2:
            c_o = tl.load(rows[:, None] + offs_o[None, :], mask=n_ok[:, None] & o_ok[None, :],
                          other=0.0).to(ql.dtype)
            s = tl.dot(ql_o, tl.trans(c_o), s, input_precision=PRECISION)
        s = tl.dot(qpe, tl.trans(kpe), s, input_precision=PRECISION)
        visible = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, c, m_i, l_i, acc, PRECISION)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        if FP8:
            o = o * kv_scale
        tl.store(out_ptr + row[:, None] * stride_ot + h[:, None] * stride_oh + offs_r[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])
    else:
        part = (row * H + h) * NUM_SPLITS + split
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
        tl.store(part_o_ptr + part[:, None] * RANK_P + offs_r[None, :], o,
                 mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, lse, mask=row_ok & (offs_m * 0 + mine == 0))
