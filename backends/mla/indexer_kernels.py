"""The sparse-MLA indexer's ops on the device, reading no host value (so they capture in CUDA
graphs): the index-key write (:func:`index_k_write_kernel`, a token a program) and the top-k,
for each query row of ``vis`` visible positions (its position + 1; 0 for padding rows):

1. :func:`index_score_kernel` -- rows that see more than ``topk`` positions: one program per
   row and chunk of positions, the row's query heads loaded once, then per ``BLOCK_N``
   positions the keys gathered through the block table, ``score_j = sum_h w_h relu(q_h .
   k_j)`` as one product over the heads (in the query's dtype when the keys convert to it
   exactly: fp8 with one scale a token -- applied after the ReLU, ``relu(s x) = s relu(x)``
   for ``s > 0`` -- or keys of the query's dtype; fp32 otherwise), into ``[rows, positions]``
   fp32 scores;
2. the ``topk`` best of a row's scores by a radix select on order-preserving 32-bit keys:
   four 256-bin histograms of 8-bit digits from the top, each of the next digit among the
   keys sharing the digits decided so far (:func:`topk_hist_kernel` launches, the later
   ones by an atomic add a key; or the first added by the scoring as it stores the scores),
   give the ``topk``-th key ``T`` and how many keys equal to it the row takes (each launch's
   programs descend one histogram, from the state the launch before stored:
   :func:`_descend`); :func:`topk_count_kernel` counts each
   span's keys above and equal to ``T``, and :func:`topk_write_kernel`, from the counts of
   the spans before its own, writes the positions above ``T`` and the first of those equal
   to it: ascending, equal scores keeping the lower position (the reference's stable sort).
   Every launch runs rows x spans programs (``routing.indexer_select_span``), so one long
   row fills the GPU as many short ones do. With ``Tuning.mla.index_select_candidates`` the
   select reads the scores three times instead: two passes, :func:`topk_compact_kernel`,
   :func:`topk_finish_kernel`. A row that sees at most ``topk`` positions takes
   them all without a score; the write fills the rest with -1.

The position axis is the block table's capacity (pages x page), a shape; long steps run in
groups of :data:`ROWS_A_PASS` rows to bound the ``[rows, positions]`` buffers.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from attn_ops.routing import cdiv, indexer_score_chunk, indexer_select_span, pow2

__all__ = ["ROWS_A_PASS", "index_k_write_kernel", "index_score_kernel",
           "indexer_k_write_device", "indexer_topk_device", "topk_compact_kernel",
           "topk_count_kernel", "topk_finish_kernel", "indexer_slots_device",
           "topk_hist_kernel", "topk_write_kernel", "visible_rows", "visible_rows_triton"]

ROWS_A_PASS = 2048
_SIGN = tl.constexpr(-2147483648)  # (the int32 sign bit)
# A row's select, int32 words: the four passes' 256 digit bins, then the state after each pass
# (the decided prefix of its top-k-th key, how many keys of that prefix it takes).
HIST_ROW = 4 * 256 + 8
_ROW = tl.constexpr(HIST_ROW)
_STATE = tl.constexpr(4 * 256)


@triton.jit
def _order_key(s):
    """An int32 of fp32 ``s`` whose unsigned order is the scores' (-inf lowest; -0 as +0, one
    key for equal scores)."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) | _SIGN)


@triton.jit
def _descend_local(hist, remaining):
    """One digit down a 256-bin histogram ``hist`` of the keys sharing the digits decided so
    far, ``remaining`` of which are taken: the top-k-th key's digit and how many keys sharing
    it are still taken."""
    bins = tl.arange(0, 256)
    suffix = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # (this digit or above)
    digit = tl.max(tl.where(suffix >= remaining, bins, 0), axis=0)
    return digit, remaining - tl.sum(tl.where(bins > digit, hist, 0), axis=0)


@triton.jit
def _descend(hrow, topk, PASS: tl.constexpr):
    """One digit down a row's select (``hrow``: its :data:`HIST_ROW` words): from the state
    after pass ``PASS - 1`` (the decided high bits of its ``topk``-th key and how many keys
    sharing them it still takes; none before pass 0) and pass ``PASS``'s histogram, the state
    after pass ``PASS``, stored for the launch after this one. Every program of a launch
    stores the same values, so each descends one histogram, not all of those before it."""
    hist = tl.load(hrow + PASS * 256 + tl.arange(0, 256))
    if PASS == 0:
        prefix = tl.full([], 0, tl.int32)
        remaining = tl.minimum(tl.sum(hist, axis=0), topk)
    else:
        prefix = tl.load(hrow + _STATE + 2 * (PASS - 1))
        remaining = tl.load(hrow + _STATE + 2 * (PASS - 1) + 1)
    digit, remaining = _descend_local(hist, remaining)
    prefix = prefix | (digit << (24 - 8 * PASS))
    tl.store(hrow + _STATE + 2 * PASS, prefix)
    tl.store(hrow + _STATE + 2 * PASS + 1, remaining)
    return prefix, remaining


@triton.jit
def _histogram(u, ok, PASS: tl.constexpr):
    """The 256-bin histogram of pass ``PASS``'s digit (bits ``31 - 8 PASS`` down) of the keys
    ``u`` where ``ok`` (the others counted in bin 0, then taken out of it)."""
    local = tl.histogram(tl.where(ok, (u >> (24 - 8 * PASS)) & 255, 0), 256)
    return local - tl.where(tl.arange(0, 256) == 0, tl.sum((ok == 0).to(tl.int32), axis=0), 0)


@triton.jit
def _keys_at(src, start, hi, BLOCK: tl.constexpr):
    """Positions ``[start, start + BLOCK)``, which of them are below ``hi``, and their scores'
    order keys (the others' from 0.0)."""
    offs = start + tl.arange(0, BLOCK)
    ok = offs < hi
    return offs, ok, _order_key(tl.load(src + offs, mask=ok, other=0.0))


@triton.jit
def _flush_histogram(hist_ptr, local, PASS: tl.constexpr):
    """Add a program's histogram into its row's pass ``PASS`` bins."""
    tl.atomic_add(hist_ptr + PASS * 256 + tl.arange(0, 256), local, mask=local > 0)


@triton.jit
def _first_tile(src, lo, hi, BLOCK: tl.constexpr, READ_FIRST: tl.constexpr):
    """A select program's first tile of scores, ``[lo, lo + BLOCK)`` below ``hi``, read before
    the program waits on its row's histogram state (``READ_FIRST``; else a placeholder
    :func:`_tile` replaces): the two reads' latencies overlap."""
    offs = lo + tl.arange(0, BLOCK)
    if READ_FIRST:
        return tl.load(src + offs, mask=offs < hi, other=0.0)
    return tl.zeros([BLOCK], tl.float32)


@triton.jit
def _tile(src, s, offs, hi, BLOCK: tl.constexpr, READ_FIRST: tl.constexpr):
    """The scores at ``offs`` (below ``hi``) and the next tile's: read one tile ahead (``s``
    already holds these, :func:`_first_tile`), or this one now (the next: a placeholder)."""
    if READ_FIRST:
        after = offs + BLOCK
        return s, tl.load(src + after, mask=after < hi, other=0.0)
    return tl.load(src + offs, mask=offs < hi, other=0.0), s


@triton.jit
def _round_to_e4m3(x):
    """``x`` (fp32, ``|x| <= 448``) rounded to the nearest e4m3 value, ties to even, by exact
    arithmetic on its exponent bits (3 mantissa bits; below 2^-6 the subnormals' step 2^-9):
    the conversion after it is then exact everywhere -- Triton's interpreter mis-rounds values
    whose rounding crosses a power of two."""
    e = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    y = x * inv  # (exact: a power of two; |y| <= 16)
    y = (y + 12582912.0) - 12582912.0  # (1.5 * 2^23: to the nearest integer, ties to even)
    return y * step


@triton.jit
def index_score_kernel(q_ptr, w_ptr, keys_ptr, scales_ptr, table_ptr, req_ptr, vis_ptr,
                       out_ptr, hist_ptr, row0, topk, chunk, num_blocks, stride_qt, stride_qh,
                       stride_wt,
                       stride_kb, stride_kp, stride_sb, stride_sp, stride_bt, stride_ot,
                       H: tl.constexpr, H_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                       PAGE: tl.constexpr, GROUP: tl.constexpr, HAS_SCALES: tl.constexpr,
                       SCALE_AFTER: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr, HIST: tl.constexpr, FP8_Q: tl.constexpr,
                       KEYS_M: tl.constexpr):
    i = tl.program_id(0)  # (a row of this pass)
    t = row0 + i
    vis = tl.load(vis_ptr + t)
    req = tl.load(req_ptr + t).to(tl.int64)
    lo = tl.program_id(1) * chunk
    # (rows that see at most top-k positions take them all: nothing to score)
    hi = tl.where(vis > topk, tl.minimum(lo + chunk, vis), lo)
    offs_h = tl.arange(0, H_P)
    offs_d = tl.arange(0, D_P)
    h_ok = offs_h < H
    d_ok = offs_d < D
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
                + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=h_ok, other=0.0)
    if FP8_Q:  # each head in e4m3 at its own scale, folded into its weight (relu(s x) = s relu(x))
        q = q.to(tl.float32)
        q_scale = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-30) / 448.0
        q = _round_to_e4m3(q / q_scale[:, None]).to(tl.float8e4nv)
        w = w * q_scale
    else:
        q = q.to(COMPUTE)
    local = tl.zeros([256], tl.int32)  # (the select's first digit histogram)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        ok = offs_n < hi
        page = tl.load(table_ptr + req * stride_bt + offs_n // PAGE, mask=ok,
                       other=0).to(tl.int64)
        cached = ok & (page >= 0) & (page < num_blocks)  # (a page outside the cache: absent)
        page = tl.where(cached, page, 0)
        row = page * stride_kb + (offs_n % PAGE) * stride_kp
        k = tl.load(keys_ptr + row[:, None] + offs_d[None, :],
                    mask=cached[:, None] & d_ok[None, :], other=0.0)
        srow = page * stride_sb + (offs_n % PAGE) * stride_sp
        if not FP8_Q:  # (else the fp8 keys as stored)
            k = k.to(tl.float32)
            if HAS_SCALES and not SCALE_AFTER:
                k = k * tl.load(scales_ptr + srow[:, None] + (offs_d // GROUP)[None, :],
                                mask=cached[:, None] & d_ok[None, :], other=0.0)
            k = k.to(COMPUTE)
        if KEYS_M:  # [BLOCK_N, H_P]: the head sum stays within a thread and its lane quad
            dots = tl.dot(k, tl.trans(q), input_precision=PRECISION)
            score = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)
        else:  # [H_P, BLOCK_N]: the head sum crosses the warps
            dots = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
        if SCALE_AFTER:
            score = score * tl.load(scales_ptr + srow, mask=cached, other=0.0)
        score = tl.where(cached, score, float("-inf"))
        tl.store(out_ptr + i.to(tl.int64) * stride_ot + offs_n, score, mask=ok)
        if HIST:
            local += _histogram(_order_key(score), ok, 0)
    if HIST:
        _flush_histogram(hist_ptr + i.to(tl.int64) * _ROW, local, 0)


@triton.jit
def topk_hist_kernel(scores_ptr, vis_ptr, hist_ptr, row0, topk, span, stride_s,
                     PASS: tl.constexpr, BLOCK: tl.constexpr, ATOMIC: tl.constexpr,
                     READ_FIRST: tl.constexpr):
    """Program ``(i, b)``: pass ``PASS``'s digit histogram of row ``i``'s keys in ``[b * span,
    (b + 1) * span)`` that share the digits decided so far, added into ``hist[i, PASS]``
    (rows seeing at most ``topk`` positions: none). ``ATOMIC``: each such key adds its own
    count to the row's bins -- for the later passes, where few keys still share the decided
    digits, cheaper than a block's histogram (about a hundred integer operations a key)."""
    i = tl.program_id(0)
    vis = tl.load(vis_ptr + row0 + i)
    n = tl.where(vis > topk, vis, 0)
    lo = tl.program_id(1) * span
    hi = tl.minimum(lo + span, n)
    hrow = hist_ptr + i.to(tl.int64) * _ROW
    src = scores_ptr + i.to(tl.int64) * stride_s
    s = _first_tile(src, lo, hi, BLOCK, READ_FIRST)
    prefix = tl.full([], 0, tl.int32)
    if PASS > 0:
        prefix, _ = _descend(hrow, topk, PASS - 1)
    local = tl.zeros([256], tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < hi
        s, s_next = _tile(src, s, offs, hi, BLOCK, READ_FIRST)
        u = _order_key(s)
        s = s_next
        if PASS > 0:
            ok = ok & ((u >> (32 - 8 * PASS)) == (prefix >> (32 - 8 * PASS)))
        if ATOMIC:
            tl.atomic_add(hrow + PASS * 256 + ((u >> (24 - 8 * PASS)) & 255), 1, mask=ok,
                          sem="relaxed")
        else:
            local += _histogram(u, ok, PASS)
    if not ATOMIC:
        _flush_histogram(hrow, local, PASS)


@triton.jit
def topk_count_kernel(scores_ptr, vis_ptr, hist_ptr, counts_ptr, row0, topk, span, blocks,
                      stride_s, BLOCK: tl.constexpr, READ_FIRST: tl.constexpr):
    """Program ``(i, b)``: how many of row ``i``'s keys in its ``b``-th span are above its
    ``topk``-th key and how many equal it, into ``counts[i, 0, b]`` and ``counts[i, 1, b]``."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    vis = tl.load(vis_ptr + row0 + i)
    n = tl.where(vis > topk, vis, 0)
    lo = b * span
    hi = tl.minimum(lo + span, n)
    src = scores_ptr + i.to(tl.int64) * stride_s
    s = _first_tile(src, lo, hi, BLOCK, READ_FIRST)
    prefix, _ = _descend(hist_ptr + i.to(tl.int64) * _ROW, topk, 3)
    threshold = prefix ^ _SIGN  # (compared as a signed int32: the same order)
    above = tl.full([], 0, tl.int32)
    equal = tl.full([], 0, tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < hi
        s, s_next = _tile(src, s, offs, hi, BLOCK, READ_FIRST)
        o = _order_key(s) ^ _SIGN
        s = s_next
        above += tl.sum((ok & (o > threshold)).to(tl.int32), axis=0)
        equal += tl.sum((ok & (o == threshold)).to(tl.int32), axis=0)
    tl.store(counts_ptr + i.to(tl.int64) * 2 * blocks + b, above)
    tl.store(counts_ptr + i.to(tl.int64) * 2 * blocks + blocks + b, equal)


@triton.jit
def topk_write_kernel(scores_ptr, vis_ptr, hist_ptr, counts_ptr, out_ptr, row0, topk, span,
                      blocks, stride_s, stride_o, BLOCK: tl.constexpr, BLOCKS_P: tl.constexpr,
                      READ_FIRST: tl.constexpr):
    """Program ``(i, b)``: row ``i``'s chosen positions in its ``b``-th span -- those above
    its ``topk``-th key and the first of those equal to it -- at their ranks in position order
    (from the counts of the spans before it); a row seeing at most ``topk`` positions writes
    them all, in place, and -1 from there to ``topk`` (the part of it in this span)."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    vis = tl.load(vis_ptr + row0 + i)
    n = tl.where(vis > topk, vis, 0)
    lo = b * span
    hi = tl.minimum(lo + span, n)
    src = scores_ptr + i.to(tl.int64) * stride_s
    s = _first_tile(src, lo, hi, BLOCK, READ_FIRST)
    state = hist_ptr + i.to(tl.int64) * _ROW + _STATE + 2 * 3  # (the count launch's)
    threshold = tl.load(state) ^ _SIGN
    remaining = tl.load(state + 1)
    dst = out_ptr + i.to(tl.int64) * stride_o
    spans = tl.arange(0, BLOCKS_P)
    before = spans < b
    counts = counts_ptr + i.to(tl.int64) * 2 * blocks + spans
    ties = tl.sum(tl.load(counts + blocks, mask=before, other=0), axis=0)
    taken = tl.sum(tl.load(counts, mask=before, other=0), axis=0) + tl.minimum(ties, remaining)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < hi
        s, s_next = _tile(src, s, offs, hi, BLOCK, READ_FIRST)
        o = _order_key(s) ^ _SIGN
        s = s_next
        above = ok & (o > threshold)
        eq = ok & (o == threshold)
        # one scan for both: the keys above (low 16 bits) and the equal ones (high), inclusive
        both = tl.cumsum(above.to(tl.int32) | (eq.to(tl.int32) << 16), axis=0)
        eq_upto = ties + (both >> 16)  # (equal keys so far, this one included)
        chosen = above | (eq & (eq_upto <= remaining))
        at = taken + (both & 0xFFFF) + tl.minimum(eq_upto, remaining) \
            - tl.minimum(ties, remaining) - 1
        tl.store(dst + at, offs, mask=chosen)
        taken += tl.sum(chosen.to(tl.int32), axis=0)
        ties += tl.sum(eq.to(tl.int32), axis=0)
    every = tl.where(vis > topk, 0, vis)  # (a row that takes all it sees)
    fill_hi = tl.where(vis > topk, 0, tl.minimum(lo + span, topk))
    for start in range(lo, fill_hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.where(offs < every, offs, -1), mask=offs < fill_hi)


@triton.jit
def topk_compact_kernel(scores_ptr, vis_ptr, hist_ptr, counts_ptr, out_ptr, cand_ptr, row0,
                        topk, span, cap, stride_s, stride_o, BLOCK: tl.constexpr):
    """Program ``(i, b)``, after the first two passes decided the top 16 bits of row ``i``'s
    ``topk``-th key: its span's positions whose keys are above those bits go straight to the
    row's output, those sharing them to the row's ``cap`` candidates, each at slots claimed
    by an atomic add on ``counts[i, 0]`` / ``counts[i, 1]`` (any order: the finish sorts the
    row; the candidates' count goes on past ``cap``, and the finish then reads the row again
    instead)."""
    i = tl.program_id(0)
    vis = tl.load(vis_ptr + row0 + i)
    n = tl.where(vis > topk, vis, 0)
    lo = tl.program_id(1) * span
    hi = tl.minimum(lo + span, n)
    prefix, _ = _descend(hist_ptr + i.to(tl.int64) * _ROW, topk, 1)
    top = (prefix ^ _SIGN) >> 16  # (signed compares of key ^ sign: the keys' order)
    src = scores_ptr + i.to(tl.int64) * stride_s
    dst = out_ptr + i.to(tl.int64) * stride_o
    cand = cand_ptr + i.to(tl.int64) * cap
    for start in range(lo, hi, BLOCK):
        offs, ok, u = _keys_at(src, start, hi, BLOCK)
        o = (u ^ _SIGN) >> 16
        above = ok & (o > top)
        match = ok & (o == top)
        # one scan for both (BLOCK < 2^16): the keys above (low 16 bits), those sharing (high)
        both = tl.cumsum(above.to(tl.int32) | (match.to(tl.int32) << 16), axis=0)
        base = tl.atomic_add(counts_ptr + 2 * i, tl.sum(above.to(tl.int32), axis=0))
        tl.store(dst + base + (both & 0xFFFF) - 1, offs, mask=above)
        base = tl.atomic_add(counts_ptr + 2 * i + 1, tl.sum(match.to(tl.int32), axis=0))
        at = base + (both >> 16) - 1
        tl.store(cand + at, offs, mask=match & (at < cap))


@triton.jit
def _finish_candidates(src, dst, cand, m, top, remaining, topk, CAP_P: tl.constexpr):
    """:func:`topk_finish_kernel` over a row's ``m`` candidates (positions at ``cand``, any
    order; their keys share the decided 16 bits ``top``): the ``remaining`` it takes of them
    into the row's last ``remaining`` output columns -- those above its top-k-th key, then the
    lowest-positioned equal ones."""
    c = tl.arange(0, CAP_P)
    live = c < m
    pos = tl.load(cand + c, mask=live, other=0)
    u = _order_key(tl.load(src + pos, mask=live, other=0.0))
    d2, r2 = _descend_local(_histogram(u, live, 2), remaining)
    d3, r3 = _descend_local(_histogram(u, live & (((u >> 8) & 255) == d2), 3), r2)
    low, t16 = u & 0xFFFF, (d2 << 8) | d3
    eq = live & (low == t16)
    if tl.sum(eq.to(tl.int32), axis=0) > r3:  # (more equal keys than it takes: by position)
        above = live & (low > t16)
        tl.store(dst + topk - remaining + tl.cumsum(above.to(tl.int32), axis=0) - 1, pos,
                 mask=above)
        ties = tl.sort(tl.where(eq, pos, 2147483647))
        tl.store(dst + topk - r3 + c, ties, mask=c < r3)
    else:  # (every key from the top-k-th up)
        chosen = live & (low >= t16)
        tl.store(dst + topk - remaining + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, pos,
                 mask=chosen)


@triton.jit
def _finish_row(src, dst, vis, top, remaining, topk, BLOCK: tl.constexpr):
    """:func:`_finish_candidates` for a row whose candidates overflowed: the last two digits
    and the chosen positions from its ``vis`` scores, read in order (three times)."""
    h2 = tl.zeros([256], tl.int32)
    for start in range(0, vis, BLOCK):
        offs, ok, u = _keys_at(src, start, vis, BLOCK)
        h2 += _histogram(u, ok & ((u >> 16) == top), 2)
    d2, r2 = _descend_local(h2, remaining)
    h3 = tl.zeros([256], tl.int32)
    for start in range(0, vis, BLOCK):
        offs, ok, u = _keys_at(src, start, vis, BLOCK)
        h3 += _histogram(u, ok & ((u >> 8) == ((top << 8) | d2)), 3)
    d3, r3 = _descend_local(h3, r2)
    t16 = (d2 << 8) | d3
    taken = topk - remaining  # (the compact launch's, at the row's start)
    ties = tl.full([], 0, tl.int32)
    for start in range(0, vis, BLOCK):
        offs, ok, u = _keys_at(src, start, vis, BLOCK)
        shared = ok & ((u >> 16) == top)
        above = shared & ((u & 0xFFFF) > t16)
        eq = shared & ((u & 0xFFFF) == t16)
        eq_upto = ties + tl.cumsum(eq.to(tl.int32), axis=0)
        chosen = above | (eq & (eq_upto <= r3))
        tl.store(dst + taken + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, offs, mask=chosen)
        taken += tl.sum(chosen.to(tl.int32), axis=0)
        ties += tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def topk_finish_kernel(scores_ptr, vis_ptr, hist_ptr, counts_ptr, out_ptr, cand_ptr, row0,
                       topk, cap, stride_s, stride_o, CAP_P: tl.constexpr,
                       TOPK_P: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``i``: row ``i``'s output completed and sorted. A row seeing at most ``topk``
    positions takes them all, -1 after; another holds ``topk - r`` positions from
    :func:`topk_compact_kernel` and takes ``r`` of the keys sharing the decided 16 bits: the
    last two digits' histograms among its candidates, then the ones above the top-k-th key
    and the lowest-positioned equal ones (its candidates came in any order: a sort) -- or,
    where they overflowed ``cap``, the same digits from the whole row read in order."""
    i = tl.program_id(0)
    vis = tl.load(vis_ptr + row0 + i)
    dst = out_ptr + i.to(tl.int64) * stride_o
    ks = tl.arange(0, TOPK_P)
    if vis <= topk:
        tl.store(dst + ks, tl.where(ks < vis, ks, -1), mask=ks < topk)
    else:
        hrow = hist_ptr + i.to(tl.int64) * _ROW
        top = tl.load(hrow + _STATE + 2) >> 16  # (the decided 16 bits, sign-extended)
        remaining = tl.load(hrow + _STATE + 3)
        m = tl.load(counts_ptr + 2 * i + 1)
        src = scores_ptr + i.to(tl.int64) * stride_s
        if m <= cap:
            _finish_candidates(src, dst, cand_ptr + i.to(tl.int64) * cap, m, top, remaining,
                               topk, CAP_P)
        else:
            _finish_row(src, dst, vis, top, remaining, topk, BLOCK)
        tl.debug_barrier()  # (the row's positions, stored by this program's threads and the
        # compact launch, read back whole)
        row = tl.sort(tl.load(dst + ks, mask=ks < topk, other=2147483647))
        tl.debug_barrier()
        tl.store(dst + ks, row, mask=ks < topk)


@triton.jit
def _requests_before(qsl_ptr, rows, num_reqs, steps):
    """How many requests end at or before each of ``rows`` (a row or a block of them;
    ``searchsorted(qsl[1:], rows, right=True)``): a binary search of ``steps`` halvings over
    the requests' ends, ``steps`` at least ``num_reqs.bit_length()``."""
    lo = rows * 0
    hi = lo + num_reqs
    for _ in range(steps):
        mid = (lo + hi) // 2
        past = tl.load(qsl_ptr + 1 + tl.minimum(mid, num_reqs - 1)) > rows
        live = lo < hi
        hi = tl.where(live & past, mid, hi)
        lo = tl.where(live & (past == 0), mid + 1, lo)
    return lo


@triton.jit
def _row_position(qsl_ptr, seq_ptr, rows, num_reqs, steps):
    """``(request, position)`` of each of ``rows`` (a query row or a block of them): its
    request by :func:`_requests_before` (clamped to the last), its position in the request
    from ``seq_lens`` and ``query_start_loc`` (rows past the last request's get a position
    the caller masks by ``rows < qsl[num_reqs]``)."""
    req = tl.minimum(_requests_before(qsl_ptr, rows, num_reqs, steps), num_reqs - 1)
    start = tl.load(qsl_ptr + req)
    pos = tl.load(seq_ptr + req) - (tl.load(qsl_ptr + req + 1) - start) + (rows - start)
    return req, pos


@triton.jit
def visible_rows_kernel(qsl_ptr, seq_ptr, req_ptr, vis_ptr, num_rows, num_reqs, steps,
                        limit, ratio, BLOCK: tl.constexpr):
    """``BLOCK`` rows a program: each row's request (a binary search of ``steps`` halvings
    over the requests' ends) and its visible keys, as :func:`visible_rows`."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    req, pos = _row_position(qsl_ptr, seq_ptr, rows, num_reqs, steps)
    vis = tl.where(rows < tl.load(qsl_ptr + num_reqs),
                   tl.minimum(tl.maximum(pos + 1, 0) // ratio, limit), 0)
    ok = rows < num_rows
    tl.store(req_ptr + rows, req, mask=ok)
    tl.store(vis_ptr + rows, vis, mask=ok)


def visible_rows_triton(t: int, seq_lens, query_start_loc, limit: int,
                        ratio: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`visible_rows` in one launch (the torch form is about 15; they are most of a
    small decode step's indexer launches)."""
    b = seq_lens.shape[0]
    out = torch.empty(2, t, dtype=torch.int32, device=seq_lens.device)
    block = 128
    visible_rows_kernel[(cdiv(t, block),)](query_start_loc, seq_lens, out[0], out[1], t,
                                                  b, b.bit_length(), limit, ratio,
                                                  BLOCK=block,
                                                  num_warps=4)
    return out[0], out[1]


@triton.jit
def index_slots_kernel(pos_ptr, table_ptr, qsl_ptr, seq_ptr, out_ptr, num_reqs, table_rows,
                       width, topk, steps, stride_p, stride_b, stride_o, PAGE: tl.constexpr,
                       BLOCK: tl.constexpr, HAS_LENS: tl.constexpr):
    """Program ``(t, b)``: row ``t``'s positions ``b * BLOCK`` on as global slots of its
    request (a binary search of ``steps`` halvings over the requests' ends), -1 kept; a row
    past the last request's tokens gets -1 throughout, as ``indexer_slots``' torch body."""
    t = tl.program_id(0)
    lo = _requests_before(qsl_ptr, t, num_reqs, steps)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < topk
    pos = tl.load(pos_ptr + t.to(tl.int64) * stride_p + offs, mask=ok, other=-1).to(tl.int64)
    # (the row's scalars spread over the block: the interpreter takes no scalar-bool masks)
    req = lo + offs * 0
    # (a position outside its request's table columns, or its length, is absent)
    valid = ok & (pos >= 0) & (req < num_reqs) & (pos // PAGE < width)
    if HAS_LENS:
        valid = valid & (pos < tl.load(seq_ptr + tl.minimum(req, num_reqs - 1), mask=ok,
                                       other=0))
    row = tl.minimum(req, table_rows - 1).to(tl.int64)
    col = tl.minimum(tl.maximum(pos // PAGE, 0), width - 1)
    block = tl.load(table_ptr + row * stride_b + col, mask=valid, other=0).to(tl.int64)
    slot = block * PAGE + pos % PAGE
    # (a slot no int32 can hold -- a corrupt block id -- is absent, not wrapped onto a page)
    valid = valid & (slot >= 0) & (slot <= 2147483647)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, tl.where(valid, slot, -1), mask=ok)


def indexer_slots_device(positions, block_table, query_start_loc, page: int,
                         seq_lens=None) -> torch.Tensor:
    """``torch.ops.attn.indexer_slots`` in one launch (its torch body is about 18: most of a
    small decode step's conversion), no host read (inputs checked)."""
    t, topk = positions.shape
    out = torch.empty(t, topk, dtype=torch.int32, device=positions.device)
    if t == 0 or topk == 0:
        return out
    b = query_start_loc.shape[0] - 1
    block = min(pow2(topk), 1024)
    index_slots_kernel[(t, cdiv(topk, block))](
        positions, block_table, query_start_loc,
        seq_lens if seq_lens is not None else query_start_loc, out, b, block_table.shape[0],
        block_table.shape[1], topk, b.bit_length(), positions.stride(0),
        block_table.stride(0), out.stride(0), PAGE=page, BLOCK=block,
        HAS_LENS=seq_lens is not None, num_warps=4)
    return out


def visible_rows(t: int, seq_lens, query_start_loc, limit: int,
                 ratio: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's request and its visible keys (its position + 1, at most ``limit``: the
    block table's positions; 0 for padding; with ``ratio``, the compressed entries complete
    at its position, ``(position + 1) // ratio``): the definition in torch ops (the tests'
    oracle of :func:`visible_rows_triton`)."""
    b = seq_lens.shape[0]
    qsl = query_start_loc.to(torch.int32)
    rows = torch.arange(t, device=seq_lens.device, dtype=torch.int32)
    req = torch.searchsorted(qsl[1:], rows, right=True).clamp(max=b - 1)
    start = qsl[req]
    pos = seq_lens[req] - (qsl[req + 1] - start) + (rows - start)
    vis = torch.where(rows < qsl[-1], (pos + 1).clamp(min=0) // ratio, 0).clamp(0, limit)
    return req.to(torch.int32), vis.to(torch.int32)


def indexer_topk_device(q, weights, keys, scales, block_table, seq_lens, query_start_loc,
                        topk: int, block_n: int | None = None, chunk: int | None = None,
                        select_span: int | None = None,
                        select_block: int | None = None, tuning=None,
                        ratio: int = 1) -> torch.Tensor:
    """``torch.ops.attn.indexer_topk`` without host reads (inputs already checked), under
    ``tuning`` (a :class:`~attn_ops.tuning.Tuning`; default: this machine's); ``block_n`` /
    ``chunk`` / ``select_span`` / ``select_block`` override its launch (tests). With ``ratio``
    the keys are compressed entries, ``(position + 1) // ratio`` of them visible to a query
    (DeepSeek-V4's indexer; the block table pages them)."""
    from attn_ops.routing import DeviceFacts
    from attn_ops.tuning import default_tuning

    t, h, d = q.shape
    page = keys.shape[1]
    if t == 0 or seq_lens.shape[0] == 0:
        return torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    out = torch.empty(t, topk, dtype=torch.int32, device=q.device)  # (the select writes it all)
    tuning, sms = (tuning or default_tuning()).mla, DeviceFacts.of(q.device).num_sms
    num_positions = block_table.shape[1] * page
    # (positions past the block table are absent: a row sees at most the table's positions)
    req, vis = visible_rows_triton(t, seq_lens, query_start_loc, num_positions, ratio)
    q = q if q.stride(2) == 1 else q.contiguous()
    w = weights.float().contiguous()
    group = d // scales.shape[2] if scales is not None else d
    token_fp8 = keys.dtype == torch.float8_e4m3fn and group == d  # (per-token scales)
    fp8_query = tuning.index_fp8_query and token_fp8
    low = q.dtype in (torch.bfloat16, torch.float16) and (keys.dtype == q.dtype or token_fp8)
    compute = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[q.dtype] if low \
        else tl.float32
    precision = "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"
    block_n = block_n or tuning.index_block_n
    fused = tuning.index_fused_histogram
    # (index_overlap_groups: a step of at most ROWS_A_PASS rows in that many groups, each
    # group's select on a side stream while the next group is scored -- the select waits on
    # its launches' latency, the scoring on memory; the buffers are kept until the side stream
    # joins, so the caching allocator reuses none of them before its launches end)
    groups = min(tuning.index_overlap_groups, t) if t <= ROWS_A_PASS else 1
    per = cdiv(t, groups) if groups > 1 else ROWS_A_PASS
    main = torch.cuda.current_stream(q.device) if groups > 1 and q.is_cuda else None
    side = _side_stream(q.device) if main is not None else None
    held = []
    for r0 in range(0, t, per):
        n = min(per, t - r0)
        span = chunk or indexer_score_chunk(n, num_positions, block_n, sms, tuning)
        scores = torch.empty(n, num_positions, dtype=torch.float32, device=q.device)
        hist = torch.zeros(n, HIST_ROW, dtype=torch.int32, device=q.device)
        index_score_kernel[(n, cdiv(num_positions, span))](
            q, w, keys, scales if scales is not None else w, block_table, req, vis, scores,
            hist, r0, topk, span, keys.shape[0], q.stride(0), q.stride(1), w.stride(0),
            keys.stride(0), keys.stride(1), scales.stride(0) if scales is not None else 0,
            scales.stride(1) if scales is not None else 0, block_table.stride(0),
            scores.stride(0), H=h, H_P=pow2(h, 16), D=d, D_P=pow2(d, 16), PAGE=page,
            GROUP=group, HAS_SCALES=scales is not None,
            SCALE_AFTER=(low or fp8_query) and scales is not None, COMPUTE=compute,
            BLOCK_N=block_n, PRECISION=precision, HIST=fused, FP8_Q=fp8_query,
            KEYS_M=tuning.index_keys_as_rows, num_warps=tuning.index_warps,
            num_stages=tuning.index_stages)
        if side is not None:
            held.append((scores, hist))
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            _select(scores, hist, vis, out[r0:r0 + n], r0, topk, sms, tuning, select_span,
                    select_block, first=1 if fused else 0)
    if side is not None:
        main.wait_stream(side)
    return out


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The indexer's side stream of ``device`` (one a device, made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _select(scores, hist, vis, out, row0, topk, sms, tuning, span=None, block=None,
            first: int = 0) -> None:
    """``out`` [rows, topk] (any contents): each row's top-k of ``scores`` (its first ``vis``
    entries), -1 after a row's last -- four digit histograms into ``hist`` [rows,
    :data:`HIST_ROW`] (zeroed; or with the first ``first`` passes' already there: the scoring
    may add the first), the counts, the write; each launch over (rows x spans of the
    positions) programs."""
    rows, positions = scores.shape
    block = block or tuning.index_select_block  # (below 2^16: MLATuning checks it)
    span = span or indexer_select_span(rows, positions, block, sms, tuning)
    blocks = cdiv(positions, span)
    if blocks * span < topk:  # (columns no span's program reaches)
        out[:, blocks * span:].fill_(-1)
    grid, warps = (rows, blocks), tuning.index_select_warps
    read_first = tuning.index_select_read_first
    if hist is None:
        hist = torch.zeros(rows, HIST_ROW, dtype=torch.int32, device=scores.device)
    cap = tuning.index_select_candidates
    # (over candidates: two passes, then the compact launch and a program a row -- the scores
    # read three times; else four passes, the counts and the write)
    for p in range(first, 2 if cap else 4):
        topk_hist_kernel[grid](scores, vis, hist, row0, topk, span, scores.stride(0), PASS=p,
                               BLOCK=block, ATOMIC=p >= tuning.index_atomic_from_pass,
                               READ_FIRST=read_first, num_warps=warps)
    if cap:
        counts = torch.zeros(rows, 2, dtype=torch.int32, device=scores.device)
        cand = torch.empty(rows, cap, dtype=torch.int32, device=scores.device)
        topk_compact_kernel[grid](scores, vis, hist, counts, out, cand, row0, topk, span, cap,
                                  scores.stride(0), out.stride(0), BLOCK=block,
                                  num_warps=warps)
        topk_finish_kernel[(rows,)](scores, vis, hist, counts, out, cand, row0, topk, cap,
                                    scores.stride(0), out.stride(0), CAP_P=pow2(cap, 1),
                                    TOPK_P=pow2(topk, 1), BLOCK=block, num_warps=8)
        return
    counts = torch.empty(rows, 2, blocks, dtype=torch.int32, device=scores.device)
    topk_count_kernel[grid](scores, vis, hist, counts, row0, topk, span, blocks,
                            scores.stride(0), BLOCK=block, READ_FIRST=read_first,
                            num_warps=warps)
    topk_write_kernel[grid](scores, vis, hist, counts, out, row0, topk, span, blocks,
                            scores.stride(0), out.stride(0), BLOCK=block,
                            BLOCKS_P=pow2(blocks, 1), READ_FIRST=read_first, num_warps=warps)


@triton.jit
def index_k_write_kernel(k_ptr, keys_ptr, scales_ptr, slot_ptr, capacity, stride_kt,
                         stride_kb, stride_kp, stride_sb, stride_sp, D: tl.constexpr,
                         GROUPS: tl.constexpr, GROUPS_P: tl.constexpr, GROUP: tl.constexpr,
                         GROUP_P: tl.constexpr, PAGE: tl.constexpr, FP8: tl.constexpr,
                         FP8_MAX: tl.constexpr):
    """Token ``program_id(0)``'s index key into its slot (-1, or any slot outside the
    ``capacity`` rows: none): as it is, or in fp8 with each group of ``GROUP`` channels over
    its amax / ``FP8_MAX`` and that scale beside it."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < capacity):
        offs_g = tl.arange(0, GROUPS_P)
        offs_c = tl.arange(0, GROUP_P)
        ok = (offs_g < GROUPS)[:, None] & (offs_c < GROUP)[None, :]
        channel = offs_g[:, None] * GROUP + offs_c[None, :]
        x = tl.load(k_ptr + t.to(tl.int64) * stride_kt + channel, mask=ok, other=0.0)
        row = keys_ptr + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_kp
        if FP8:
            x = x.to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FP8_MAX, 1e-12)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
            tl.store(row + channel, q.to(keys_ptr.dtype.element_ty), mask=ok)
            tl.store(scales_ptr + (slot // PAGE) * stride_sb + (slot % PAGE) * stride_sp
                     + offs_g, scale, mask=offs_g < GROUPS)
        else:
            tl.store(row + channel, x.to(keys_ptr.dtype.element_ty), mask=ok)


def indexer_k_write_device(k, keys, scales, slot_mapping, fp8_max: float) -> None:
    """``torch.ops.attn.indexer_k_write`` in one launch, no host read (inputs checked)."""
    t, d = k.shape
    if t == 0:
        return
    k = k if k.stride(1) == 1 else k.contiguous()
    groups = scales.shape[2] if scales is not None else 1
    group = d // groups
    index_k_write_kernel[(t,)](
        k, keys, scales if scales is not None else keys, slot_mapping,
        keys.shape[0] * keys.shape[1], k.stride(0),
        keys.stride(0), keys.stride(1), scales.stride(0) if scales is not None else 0,
        scales.stride(1) if scales is not None else 0, D=d, GROUPS=groups,
        GROUPS_P=pow2(groups), GROUP=group, GROUP_P=pow2(group), PAGE=keys.shape[1],
        FP8=scales is not None, FP8_MAX=fp8_max)
