"""DSV4_TRITON's attention kernel: a query's sliding window and its compressed entries (the
indexer's picks, or every entry complete at its position) with the sink, in one pass.

One program takes one query row, ``HEADS`` of its heads and one split of its keys (every head
reads the same keys: the layer has one key = value head). The row finds its request by a
binary search of ``query_start_loc`` and its position from ``seq_lens``; its keys are a
virtual list, the window first:

* ``j < n_win`` (``n_win = min(p + 1, W)``): window token ``p - n_win + 1 + j`` through the
  request's window block table;
* then ``n_comp`` compressed entries: entry ``c`` (dense, ``MODE`` 1: ``c < (p + 1) //
  ratio``) or ``picks[row, c]`` (sparse, ``MODE`` 2: kept where ``0 <= pick < (p + 1) //
  ratio``) through the compressed block table.

A page outside its cache, a column past the table, or a negative block id is absent (its key
masked, nothing read), so pages released behind the window may hold -1. Keys are read as rows
of the model dtype (``[blocks, page, D]``) or vLLM's 584-byte entries (``uint8 [blocks,
>= page * 584]``: per page ``page x 576`` data bytes -- 448 e4m3, then 64 bf16 -- then ``page
x 8`` UE8M0 scale bytes), dequantized in registers. Scores ``s = (q_nope . k_nope + q_rope .
k_rope) * scale`` and ``acc += softmax_part(s) @ [k_nope | k_rope]`` (K = V) in base 2;
the output is ``acc / l * sigmoid(lse - sink)`` (the sink in the denominator only). With
``SPLITS`` > 1 each split writes fp32 partials and natural-log LSEs, and TRITON_ATTN's split
combine merges them and applies the sink. Rows past the last request write zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.backends.deepseek_v4.cache import DATA_BYTES, ENTRY_BYTES, GROUP, entries_a_page
from attn_ops.backends.mla.indexer_kernels import _row_position
from attn_ops.backends.triton_attn_kernels import LN2, LOG2E
from attn_ops.routing import cdiv, combine_split_block, pow2

__all__ = ["dsv4_attention_kernel", "dsv4_attention_triton"]

DATA_BYTES_C: tl.constexpr = tl.constexpr(DATA_BYTES)
SCALE_BYTES_C: tl.constexpr = tl.constexpr(ENTRY_BYTES - DATA_BYTES)
GROUP_C: tl.constexpr = tl.constexpr(GROUP)


@triton.jit
def _ue8m0(exponent):
    """UE8M0 scale bytes as fp32 ``2^(e - 127)``: the byte is the float's exponent field (an
    integer shift, not an exponential an element); 0 is the one subnormal, 255 infinity as
    ``exp2(128)``."""
    bits = exponent.to(tl.int32) << 23
    return tl.where(exponent == 0, 5.877471754111438e-39, bits.to(tl.float32, bitcast=True))


@triton.jit
def _key_tile(cache_ptr, slot, ok, stride_b, stride_p, PAGE: tl.constexpr,
              ENTRIES: tl.constexpr, NOPE_D: tl.constexpr, NOPE_P: tl.constexpr,
              ROPE_D: tl.constexpr, ROPE_P: tl.constexpr, COMPUTE: tl.constexpr):
    """Keys ``slot`` [BLOCK_N] of a paged cache (``ok``: present), transposed -- ``(nope
    [NOPE_P, BLOCK_N], rope [ROPE_P, BLOCK_N])`` in ``COMPUTE``, a key a column (the score
    product's right operand); absent keys are zero. Built so (a key's bytes along the first
    axis), the tiles enter the products with fewer changes of layout through shared memory:
    built as ``[BLOCK_N, D]`` and transposed, the sm_90 build spent about 250 shared-memory
    instructions a thread more per 64 keys. An absent key's slot may be anything: every load
    of it is masked by ``ok`` (clamping it with ``tl.where`` instead breaks Triton 3.6's sm_90
    layout pass at fp32 with small pages)."""
    page = slot // PAGE
    row = slot % PAGE
    offs_n = tl.arange(0, NOPE_P)
    offs_r = tl.arange(0, ROPE_P)
    n_mask = (offs_n < NOPE_D)[:, None] & ok[None, :]
    r_mask = (offs_r < ROPE_D)[:, None] & ok[None, :]
    if ENTRIES:  # (planar 584-byte entries: data plane, then the scale plane)
        base = cache_ptr + page * stride_b
        data = base + row * DATA_BYTES_C
        raw = tl.load(data[None, :] + offs_n[:, None], mask=n_mask, other=0)
        exponent = tl.load(base[None, :] + PAGE * DATA_BYTES_C + row[None, :] * SCALE_BYTES_C
                           + (offs_n // GROUP_C)[:, None], mask=n_mask, other=127)
        nope = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _ue8m0(exponent)
        rope = tl.load((data + NOPE_D).to(tl.pointer_type(tl.bfloat16))[None, :]
                       + offs_r[:, None], mask=r_mask, other=0.0)
    else:
        rows = cache_ptr + page * stride_b + row * stride_p
        nope = tl.load(rows[None, :] + offs_n[:, None], mask=n_mask, other=0.0)
        rope = tl.load(rows[None, :] + NOPE_D + offs_r[:, None], mask=r_mask, other=0.0)
    return nope.to(COMPUTE), rope.to(COMPUTE)


@triton.jit
def _softmax_step(s, kn, kr, m_i, l_i, acc_n, acc_r, PRECISION: tl.constexpr):
    """One key block into the running softmax (base 2; ``s`` -inf where absent): the values
    are the keys' two parts (``kn`` / ``kr`` as :func:`_key_tile` gives them, transposed)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc_n = tl.dot(p.to(kn.dtype), tl.trans(kn), acc_n * alpha[:, None],
                   input_precision=PRECISION)
    acc_r = tl.dot(p.to(kr.dtype), tl.trans(kr), acc_r * alpha[:, None],
                   input_precision=PRECISION)
    return m_new, l_i, acc_n, acc_r


@triton.jit(do_not_specialize=["num_reqs", "steps", "win_blocks", "comp_blocks", "bt_width",
                               "cbt_width", "num_picks", "window", "ratio"])
def dsv4_attention_kernel(
    q_ptr, win_ptr, comp_ptr, qsl_ptr, seq_ptr, bt_ptr, cbt_ptr, picks_ptr, sinks_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    num_reqs, steps, win_blocks, comp_blocks, bt_width, cbt_width, num_picks, window, ratio,
    sm_scale, stride_qt, stride_qh, stride_wb, stride_wp, stride_cb, stride_cp, stride_bt,
    stride_cbt, stride_pk, stride_ot, stride_oh,
    H: tl.constexpr, HEADS: tl.constexpr, NOPE_D: tl.constexpr, NOPE_P: tl.constexpr,
    ROPE_D: tl.constexpr, ROPE_P: tl.constexpr, DV_P: tl.constexpr, WPAGE: tl.constexpr,
    CPAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    WIN_ENTRIES: tl.constexpr, COMP_ENTRIES: tl.constexpr, MODE: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    split = tl.program_id(2)
    req, pos = _row_position(qsl_ptr, seq_ptr, t, num_reqs, steps)
    live = t < tl.load(qsl_ptr + num_reqs)
    pos = pos.to(tl.int64)
    n_win = tl.where(live, tl.minimum(tl.maximum(pos + 1, 0), window), 0)
    visible = tl.maximum(pos + 1, 0) // ratio
    if MODE == 1:
        n_comp = tl.where(live, visible, 0)
    elif MODE == 2:
        n_comp = tl.where(live, num_picks, 0)
    else:
        n_comp = n_win * 0
    n = n_win + n_comp
    per = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per
    hi = tl.minimum(n, lo + per)

    t64 = t.to(tl.int64)
    req64 = req.to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    h_ok = h < H
    offs_n = tl.arange(0, NOPE_P)
    offs_r = tl.arange(0, ROPE_P)
    q_row = q_ptr + t64 * stride_qt + h[:, None] * stride_qh
    qn = tl.load(q_row + offs_n[None, :], mask=h_ok[:, None] & (offs_n < NOPE_D)[None, :],
                 other=0.0).to(COMPUTE)
    qr = tl.load(q_row + NOPE_D + offs_r[None, :],
                 mask=h_ok[:, None] & (offs_r < ROPE_D)[None, :], other=0.0).to(COMPUTE)
    qk_scale = sm_scale * LOG2E
    m_i = tl.full([HEADS], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS], tl.float32)
    acc_n = tl.zeros([HEADS, NOPE_P], tl.float32)
    acc_r = tl.zeros([HEADS, ROPE_P], tl.float32)
    first = pos - n_win + 1  # (the window's first position)
    for j0 in range(lo, tl.minimum(hi, n_win), BLOCK_N):  # the window
        j = j0 + tl.arange(0, BLOCK_N)
        wpos = first + j
        col = wpos // WPAGE
        ok = (j < tl.minimum(hi, n_win)) & (col < bt_width)
        block = tl.load(bt_ptr + req64 * stride_bt + col, mask=ok, other=-1).to(tl.int64)
        ok = ok & (block >= 0) & (block < win_blocks)
        kn, kr = _key_tile(win_ptr, block * WPAGE + wpos % WPAGE, ok, stride_wb, stride_wp,
                           WPAGE, WIN_ENTRIES, NOPE_D, NOPE_P, ROPE_D, ROPE_P, COMPUTE)
        s = tl.dot(qn, kn, input_precision=PRECISION)
        s = tl.dot(qr, kr, s, input_precision=PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc_n, acc_r = _softmax_step(s, kn, kr, m_i, l_i, acc_n, acc_r, PRECISION)
    if MODE > 0:  # the compressed entries
        for j0 in range(tl.maximum(lo, n_win), hi, BLOCK_N):
            c = j0 + tl.arange(0, BLOCK_N) - n_win
            ok = c < hi - n_win
            if MODE == 1:
                entry = c
            else:
                entry = tl.load(picks_ptr + t64 * stride_pk + c, mask=ok, other=-1).to(tl.int64)
            col = entry // CPAGE
            ok = ok & (entry >= 0) & (entry < visible) & (col < cbt_width)
            block = tl.load(cbt_ptr + req64 * stride_cbt + col, mask=ok, other=-1).to(tl.int64)
            ok = ok & (block >= 0) & (block < comp_blocks)
            kn, kr = _key_tile(comp_ptr, block * CPAGE + entry % CPAGE, ok, stride_cb,
                               stride_cp, CPAGE, COMP_ENTRIES, NOPE_D, NOPE_P, ROPE_D, ROPE_P,
                               COMPUTE)
            s = tl.dot(qn, kn, input_precision=PRECISION)
            s = tl.dot(qr, kr, s, input_precision=PRECISION)
            s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
            m_i, l_i, acc_n, acc_r = _softmax_step(s, kn, kr, m_i, l_i, acc_n, acc_r,
                                                   PRECISION)
    has = l_i > 0
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    inv = 1.0 / tl.where(has, l_i, 1.0)
    n_mask = h_ok[:, None] & (offs_n < NOPE_D)[None, :]
    r_mask = h_ok[:, None] & (offs_r < ROPE_D)[None, :]
    if SPLITS == 1:
        sink = tl.load(sinks_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
        f = inv * tl.sigmoid(lse - sink)  # (no key: lse -inf, the row is zero)
        o_row = out_ptr + t64 * stride_ot + h[:, None] * stride_oh
        tl.store(o_row + offs_n[None, :], (acc_n * f[:, None]).to(out_ptr.dtype.element_ty),
                 mask=n_mask)
        tl.store(o_row + NOPE_D + offs_r[None, :],
                 (acc_r * f[:, None]).to(out_ptr.dtype.element_ty), mask=r_mask)
    else:
        part = (t64 * H + h) * SPLITS + split
        o_row = part_o_ptr + part[:, None] * DV_P
        tl.store(o_row + offs_n[None, :], acc_n * inv[:, None], mask=n_mask)
        tl.store(o_row + NOPE_D + offs_r[None, :], acc_r * inv[:, None], mask=r_mask)
        tl.store(part_lse_ptr + part, lse, mask=h_ok)


def dsv4_attention_triton(q, window_cache, query_start_loc, seq_lens, block_table, sinks,
                          scale: float, sliding_window: int, rope_dim: int,
                          compressed_cache=None, compressed_block_table=None, ratio: int = 0,
                          picks=None, launch=(64, 64, 8, 2, 1), out=None) -> torch.Tensor:
    """``q [T, H, D]`` over each row's window (and compressed entries, or the ``picks`` among
    them): ``[T, H, D]`` in ``q``'s dtype, no host read. ``launch``: (heads a program, keys a
    step, warps, stages, splits of a row's keys). A cache is ``[blocks, page, D]`` rows or
    ``uint8 [blocks, >= page * 584]`` entries (``D`` 512, ``rope_dim`` 64)."""
    from attn_ops.backends.triton_attn_kernels import combine_splits_kernel

    t, h, d = q.shape
    out = torch.empty_like(q) if out is None else out
    if t == 0:
        return out
    block_h, block_n, warps, stages, splits = launch
    block_h = max(16, min(block_h, pow2(h)))  # (tl.dot: M >= 16)
    nope = d - rope_dim
    nope_p, rope_p, dv_p = pow2(nope, 16), pow2(rope_dim, 16), pow2(d, 16)

    def paged(cache):
        entries = cache.dtype == torch.uint8
        return (cache, entries_a_page(cache), cache.stride(0),
                ENTRY_BYTES if entries else cache.stride(1), entries)

    win, wpage, stride_wb, stride_wp, win_entries = paged(window_cache)
    compressed = compressed_cache is not None
    comp, cpage, stride_cb, stride_cp, comp_entries = paged(
        compressed_cache if compressed else window_cache)
    cbt = compressed_block_table if compressed else block_table
    mode = 0 if not compressed else (2 if picks is not None else 1)
    pk = picks if picks is not None else cbt
    part_o = part_lse = out
    if splits > 1:
        part_o = torch.empty(t, h, splits, dv_p, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(t, h, splits, dtype=torch.float32, device=q.device)
    b = seq_lens.shape[0]
    compute = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(q.dtype, tl.float32)
    dsv4_attention_kernel[(t, cdiv(h, block_h), splits)](
        q, win, comp, query_start_loc, seq_lens, block_table, cbt, pk, sinks, out, part_o,
        part_lse, b, max(1, b.bit_length()), win.shape[0], comp.shape[0], block_table.shape[1],
        cbt.shape[1], pk.shape[1] if picks is not None else 0, sliding_window, max(ratio, 1),
        scale, q.stride(0), q.stride(1), stride_wb, stride_wp, stride_cb, stride_cp,
        block_table.stride(0), cbt.stride(0), pk.stride(0), out.stride(0), out.stride(1),
        H=h, HEADS=block_h, NOPE_D=nope, NOPE_P=nope_p, ROPE_D=rope_dim, ROPE_P=rope_p,
        DV_P=dv_p, WPAGE=wpage, CPAGE=cpage, BLOCK_N=max(16, block_n), SPLITS=splits,
        WIN_ENTRIES=win_entries, COMP_ENTRIES=comp_entries, MODE=mode, COMPUTE=compute,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages)
    if splits > 1:  # (every row of the grid: padding rows' partials are empty, their rows 0)
        combine_splits_kernel[(t, h)](
            out, out, part_o, part_lse, query_start_loc, sinks, out, b, out.stride(0),
            out.stride(1), 0, HQ=h, NUM_SPLITS=splits, SPLITS_P=pow2(splits), DV=d, DV_P=dv_p,
            HAS_SINKS=True, FP8=False, WRITE_LSE=False,
            SPLIT_BLOCK=combine_split_block(splits, dv_p), ALL_ROWS=True, num_warps=4)
    return out
