"""TRITON_ATTN's kernels: paged attention over a decode-first batch, with split-KV.

``paged_attention_kernel`` computes one tile per program: ``BLOCK_Q`` query tokens of one
request x the ``GROUP`` query heads that share a KV head (packed into the rows of one
``tl.dot``), against that request's keys gathered page by page through the block table (whole
key blocks' page numbers loaded one block ahead, so their K/V loads never wait on the table),
with an online softmax in base 2. Program ids: ``(tile, kv_head, split)``, the tile or (with
``HEADS_FASTEST``) the KV head varying fastest in launch order. Tiles are numbered per
request, ``tile_start[r] = (qsl[r] - qsl[0]) // BLOCK_Q + r`` -- an upper bound of the tiles
before request ``r``, so the grid (``tokens // BLOCK_Q + requests``) is known on the host
without reading lengths, and a program finds its request by binary search over
``query_start_loc`` (device reads only: capturable in CUDA graphs). A launch whose requests are
all single query rows (``ONE_ROW``: decodes) has one tile per request, the tile its request:
no search -- a chain of dependent loads before the first K/V load, at 64 requests 6 of them.

With ``NUM_SPLITS > 1`` (decode: few programs, long contexts) split ``s`` covers one chunk of
each request's visible keys and writes a normalized partial output and its LSE;
``combine_splits_kernel`` merges them (and applies sinks and the fp8 value scale, as the
single-split path does in place) -- or, with ``FUSED_COMBINE``, the last split of a tile to
finish merges them in the same launch: each split takes a ticket from a per-(tile, KV head)
counter after its partial stores, and the one holding the last ticket combines and resets the
counter to 0 for the next launch (no second kernel; one stream at a time per counter buffer).

Semantics are REFERENCE's (``backends/reference.py``): scale, soft-cap ``c * tanh(s / c)``,
ALiBi ``slope * (j - p)``, causal / sliding-window visibility, LSE in natural log without the
sink, ``out *= sigmoid(lse - sink)``, fp8 K/V times their per-tensor scales.

``KV_FORMAT=1`` reads a TurboQuant cache (TURBOQUANT; ``backends/turboquant/format.py``): one
byte slot a (token, KV head), K and V dequantized in registers a key block at a time
(``backends/turboquant/read_kernels.py``: codes to centroids, values from their fp16 scale and
minimum) before the same two tensor-core products. The rotated presets' keys stay in the
rotated space: the tile's queries are rotated once (``q H``, the +-1 Hadamard signs on the
tensor cores, ``1 / sqrt(D)`` folded into the logit scale) and each key's norm scales its
score column.

Block ids and lengths arrive on the device and are never trusted. Keys past the end of the
request's block-table row (a ``seq_len`` needing more pages than the table holds) are absent:
the key range stops at the row's end, once per program. A key whose block id is outside the
cache is absent too (never read, out of the softmax): masked blocks fold the id's range check
into their key mask; whole blocks, whose loads are unmasked, have the pages they span checked
once per program before the loop, and a program that finds a bad id runs every block masked.
No host sync, and nothing added to the unmasked loop.

``query_start_loc`` arrives on the device too. Each request's rows are clamped into the
launch's tokens and never decrease (``_span``), so a corrupt entry reads and writes no row
outside them; a corrupt entry can still leave rows no tile writes (a request pushed past the
rows, starts out of order). One more tile per launch, the row check (``_clear_uncovered``),
scans the offsets: in order, and within what the grid covers, the tiles write every row of
``[qsl[0], qsl[num_reqs])`` and it zeroes the launch's rows outside that (none but padding);
otherwise it works out, row by row, which tile the routing sends each row to and zeroes the
rows no tile writes (and, split, their partials), so every output row is finite. Rows it
zeroes are ones no tile writes, except where corrupt requests overlap.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attn_ops.backends.turboquant.read_kernels import sylvester_signs, tq_keys, tq_values

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
SCAN = tl.constexpr(128)  # block-table entries checked per load before the whole blocks


@triton.jit
def _tanh(x):
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x >= 0, y, -y)


@triton.jit
def _clamp(x, lo, hi):
    """``x`` (an offset of ``query_start_loc``, any int dtype) clamped into ``[lo, hi]``, as
    int32 (clamped first: a far value never wraps)."""
    return tl.minimum(tl.maximum(x, lo), hi).to(tl.int32)


@triton.jit
def _span(qsl_ptr, r, floor, num_tokens):
    """Request ``r``'s rows ``[start, end)``: ``query_start_loc`` clamped into
    ``[floor, num_tokens]``, the end never below the start."""
    start = _clamp(tl.load(qsl_ptr + r), floor, num_tokens)
    end = _clamp(tl.load(qsl_ptr + r + 1), start, num_tokens)
    return start, end


@triton.jit
def _request_of_tile(tile, qsl_ptr, num_reqs, base, num_tokens, BLOCK_Q: tl.constexpr):
    """The largest ``r`` in ``[0, num_reqs)`` with ``tile_start(r) <= tile`` found by binary
    search, ``tile_start(r) = (start(r) - base) // BLOCK_Q + r`` over the clamped starts
    (never below ``base``: no negative division, whose rounding the interpreter and the GPU
    disagree on)."""
    lo = num_reqs * 0
    hi = num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = (_clamp(tl.load(qsl_ptr + mid), base, num_tokens) - base) // BLOCK_Q + mid
        if start <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _tiles_requests(tiles, ok, qsl_ptr, num_reqs, base, num_tokens, steps,
                    BLOCK_Q: tl.constexpr):
    """:func:`_request_of_tile` of each of ``tiles`` (where ``ok``), the same halvings:
    ``steps`` >= ``ceil(log2(num_reqs))``."""
    lo = tiles * 0
    hi = lo + num_reqs
    for _ in range(steps):
        act = ok & (hi - lo > 1)
        mid = (lo + hi) // 2
        start = (_clamp(tl.load(qsl_ptr + mid, mask=act, other=0), base, num_tokens) - base) \
            // BLOCK_Q + mid
        go = start <= tiles
        lo = tl.where(act & go, mid, lo)
        hi = tl.where(act & ~go, mid, hi)
    return lo


@triton.jit
def _rows_requests(rows, ok, qsl_ptr, num_reqs, floor, num_tokens, steps):
    """For each of ``rows`` (``ok``, at or past the first start): the ``r`` in
    ``[0, num_reqs]`` a binary search over the clamped starts ends at, ``start(r) <= row <
    start(r + 1)`` (``r == num_reqs``: past the last start), and ``start(r)``; ``steps`` >=
    ``ceil(log2(num_reqs + 1))``."""
    lo = rows * 0
    hi = lo + num_reqs + 1
    start_lo = lo + _clamp(tl.load(qsl_ptr), floor, num_tokens)
    for _ in range(steps):
        act = ok & (hi - lo > 1)
        mid = (lo + hi) // 2
        start = _clamp(tl.load(qsl_ptr + mid, mask=act, other=0), floor, num_tokens)
        go = start <= rows
        lo = tl.where(act & go, mid, lo)
        start_lo = tl.where(act & go, start, start_lo)
        hi = tl.where(act & ~go, mid, hi)
    return lo, start_lo


@triton.jit
def _clear_rows(rows, clear, head, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, offs_dv,
                stride_ot, stride_oh, stride_lt, HQ: tl.constexpr, DV: tl.constexpr,
                DV_P: tl.constexpr, NUM_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Rows no tile writes: output (and LSE) 0, as padding rows; split partials empty (LSE
    -inf, output 0), which the combine turns into 0."""
    zeros = tl.zeros([BLOCK_M, DV_P], tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
             + offs_dv[None, :], zeros.to(out_ptr.dtype.element_ty),
             mask=clear[:, None] & (offs_dv[None, :] < DV))
    if WRITE_LSE:
        tl.store(lse_ptr + rows * stride_lt + head, tl.zeros([BLOCK_M], tl.float32),
                 mask=clear)
    if NUM_SPLITS > 1:
        for s in range(NUM_SPLITS):
            part = (rows * HQ + head) * NUM_SPLITS + s
            tl.store(part_lse_ptr + part, tl.full([BLOCK_M], float("-inf"), tl.float32),
                     mask=clear)
            tl.store(part_o_ptr + part[:, None] * DV_P + offs_dv[None, :], zeros,
                     mask=clear[:, None])


@triton.jit
def _clear_uncovered(qsl_ptr, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, kv_head, num_reqs,
                     num_tokens, attn_tiles, home_lo, home_rows, search_steps, stride_ot,
                     stride_oh, stride_lt, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                     HQ: tl.constexpr, BLOCK_Q: tl.constexpr, DV: tl.constexpr,
                     DV_P: tl.constexpr, NUM_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr,
                     ONE_ROW: tl.constexpr):
    """The row check of a launch (its extra tile; KV head ``kv_head``'s query heads): zero
    the rows ``[home_lo, home_lo + home_rows)`` -- the launch's share of the batch, known on
    the host -- that no tile of the launch writes. Offsets in order (and, one row a request,
    requests of at most ``BLOCK_Q`` rows; else spanning at most the rows the grid covers):
    the tiles write ``[start(0), start(num_reqs))``, the rest is cleared (padding). Otherwise
    each row's request and tile are worked out as the tiles' routing does, and the rows whose
    tile is not routed to their request (or not launched) are cleared."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // GROUP_P
    head = kv_head * GROUP + offs_m % GROUP_P
    h_ok = offs_m % GROUP_P < GROUP
    offs_dv = tl.arange(0, DV_P)
    first = _clamp(tl.load(qsl_ptr), 0, num_tokens)
    floor = first
    if ONE_ROW:  # (its tiles clamp into [0, rows): they read no qsl[0])
        floor = first * 0
    offs = tl.arange(0, SCAN)
    bad = tl.zeros([SCAN], tl.int32)
    for c0 in range(0, num_reqs, SCAN):
        i = c0 + offs
        m = i < num_reqs
        a = _clamp(tl.load(qsl_ptr + i, mask=m, other=0), floor, num_tokens)
        b = _clamp(tl.load(qsl_ptr + i + 1, mask=m, other=0), floor, num_tokens)
        wrong = b < a
        if ONE_ROW:
            wrong = wrong | (b - a > BLOCK_Q)
        bad = bad | (m & wrong).to(tl.int32)
    last = _clamp(tl.load(qsl_ptr + num_reqs), floor, num_tokens)
    in_order = tl.max(bad, 0) == 0
    if not ONE_ROW:
        in_order = in_order & (last - first <= home_rows)
    home_hi = home_lo + home_rows
    if in_order:
        for y0 in range(home_lo, tl.minimum(first, home_hi), BLOCK_Q):
            rows = y0 + tok
            clear = h_ok & (rows < tl.minimum(first, home_hi))
            _clear_rows(rows, clear, head, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, offs_dv,
                        stride_ot, stride_oh, stride_lt, HQ, DV, DV_P, NUM_SPLITS, WRITE_LSE,
                        BLOCK_M)
        for y0 in range(tl.maximum(last, home_lo), home_hi, BLOCK_Q):
            rows = y0 + tok
            clear = h_ok & (rows < home_hi)
            _clear_rows(rows, clear, head, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, offs_dv,
                        stride_ot, stride_oh, stride_lt, HQ, DV, DV_P, NUM_SPLITS, WRITE_LSE,
                        BLOCK_M)
    else:
        for y0 in range(home_lo, home_hi, BLOCK_Q):
            rows = y0 + tok
            ok = h_ok & (rows < home_hi) & (rows >= first)
            r, start = _rows_requests(rows, ok, qsl_ptr, num_reqs, floor, num_tokens,
                                      search_steps)
            ok = ok & (r < num_reqs)
            if ONE_ROW:  # tile r writes the first BLOCK_Q rows of request r
                covered = ok & (rows - start < BLOCK_Q)
            else:
                tile = (start - first) // BLOCK_Q + r + (tl.maximum(rows - start, 0)) // BLOCK_Q
                ok = ok & (tile < attn_tiles)
                covered = ok & (_tiles_requests(tile, ok, qsl_ptr, num_reqs, first, num_tokens,
                                                search_steps, BLOCK_Q) == r)
            clear = h_ok & (rows < home_hi) & ~covered
            _clear_rows(rows, clear, head, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, offs_dv,
                        stride_ot, stride_oh, stride_lt, HQ, DV, DV_P, NUM_SPLITS, WRITE_LSE,
                        BLOCK_M)


@triton.jit
def _attend(acc, acc2, l_i, m_i, b0, b1, q, q2, lo, hi, r, pos, row_ok, context, kv_head,
            logit_scale, slope, ancestors, not_tree, bt_ptr, num_pages, k_ptr, v_ptr, stride_bt,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, window, soft_cap,
            offs_d, offs_dv, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
            D_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
            CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
            HAS_ALIBI: tl.constexpr, HAS_TREE: tl.constexpr, PRECISION: tl.constexpr,
            MASKED: tl.constexpr, codebook_ptr, KV_FORMAT: tl.constexpr,
            KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
            KEY_PLANES: tl.constexpr, VALUE_PLANES: tl.constexpr, TQ_COALESCED: tl.constexpr):
    """Online softmax over key blocks ``b0..b1-1`` (of ``BLOCK_N`` keys from ``lo``), gathered
    page by page; ``MASKED=False`` blocks lie inside ``[lo, hi)``, are visible to every row
    of the tile whole and span only pages inside the cache (checked by the caller): their loads
    and scores need no mask, and no row's maximum is -inf. In masked blocks a key whose block
    id is outside ``[0, num_pages)`` is masked like one past ``hi``. A TurboQuant cache's
    4-bit planes (``KEY_PLANES`` / ``VALUE_PLANES``): ``q2`` / ``acc2`` are the odd
    coordinates' query and output columns, ``offs_d`` / ``offs_dv`` the fields' bytes."""
    qk_scale = logit_scale * LOG2E  # the scale and base 2 in one multiply
    bt_row = bt_ptr + r * stride_bt
    if not MASKED:  # whole blocks' page numbers are loaded one block ahead (below)
        offs = tl.arange(0, BLOCK_N)
        next_page = tl.load(bt_row + (lo + b0 * BLOCK_N + offs) // PAGE,
                            mask=(offs * 0 + b0) < b1, other=0)
    for b in range(b0, b1):
        offs_n = lo + b * BLOCK_N + tl.arange(0, BLOCK_N)
        if MASKED:
            n_ok = offs_n < hi
            page = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0)
            n_ok = n_ok & (page >= 0) & (page < num_pages)  # (a block id outside: absent)
        else:
            # The K/V addresses must not wait on the block table: loaded in the same iteration,
            # the lookup's latency is exposed every block (the next block's pages prefetched).
            page = next_page
            next_page = tl.load(bt_row + (offs_n + BLOCK_N) // PAGE,
                                mask=(offs_n * 0 + b + 1) < b1, other=0)
        page = page.to(tl.int64)  # page * stride overflows int32 past 2 GiB
        slot = offs_n % PAGE
        if KV_FORMAT == 1:  # TurboQuant: a byte slot a (token, KV head) holding K and V
            tq_off = page * stride_kb + slot * stride_ks + kv_head * stride_kh
            tq_ok = n_ok if MASKED else offs_n >= 0
            k, k2, k_scale = tq_keys(k_ptr, tq_off, tq_ok, codebook_ptr, offs_d, D, KEY_BITS,
                                     NORM_CORRECTION, KEY_PLANES, TQ_COALESCED, q.dtype)
            s = tl.dot(q, k, input_precision=PRECISION)  # (the keys come transposed)
            if KEY_PLANES:
                s = tl.dot(q2, k2, s, input_precision=PRECISION)
            if NORM_CORRECTION and (KEY_PLANES or TQ_COALESCED) and KEY_BITS != 8:
                # each key's ||c||^2 on the tensor cores, in every row
                c2 = tl.dot(tl.full(q.shape, 1.0, q.dtype), k * k, input_precision=PRECISION)
                if KEY_PLANES:
                    c2 = tl.dot(tl.full(q2.shape, 1.0, q.dtype), k2 * k2, c2,
                                input_precision=PRECISION)
                s = s * (k_scale[None, :] * tl.rsqrt(c2 + 1e-16))
            else:
                s = s * k_scale[None, :]
        else:
            k_ptrs = (k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks
                      + kv_head * stride_kh + offs_d[None, :])
            v_ptrs = (v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs
                      + kv_head * stride_vh + offs_dv[None, :])
            if MASKED:
                k = tl.load(k_ptrs, mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
                v = tl.load(v_ptrs, mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            else:
                if D == D_P:
                    k = tl.load(k_ptrs)
                else:
                    k = tl.load(k_ptrs, mask=offs_d[None, :] < D, other=0.0)
                if DV == DV_P:
                    v = tl.load(v_ptrs)
                else:
                    v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        if USE_SOFTCAP or HAS_ALIBI or MASKED:
            if USE_SOFTCAP:
                s = soft_cap * _tanh(s * logit_scale / soft_cap) * LOG2E
            else:
                s = s * qk_scale  # base 2 from here on
            if HAS_ALIBI:
                s += slope[:, None] * (offs_n[None, :] - pos[:, None]).to(tl.float32)
            if MASKED:
                visible = n_ok[None, :] & row_ok[:, None]
                if CAUSAL:
                    visible = visible & (offs_n[None, :] <= pos[:, None])
                if USE_WINDOW:
                    visible = visible & (pos[:, None] - offs_n[None, :] < window)
                    if not CAUSAL:
                        visible = visible & (offs_n[None, :] - pos[:, None] < window)
                if HAS_TREE:  # among the draft tokens only the query's ancestors (and itself)
                    node = tl.minimum(tl.maximum(offs_n - context, 0), 63).to(tl.int64)
                    is_ancestor = ((ancestors[:, None] >> node[None, :]) & 1) != 0
                    visible = visible & ((offs_n[None, :] < context) | is_ancestor
                                         | not_tree[:, None])
                s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
            if MASKED:  # rows that have seen no key yet keep -inf as their maximum
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
        else:  # plain scores: the scale folded into the exponent (one FMA per score)
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_safe = m_new
            p = tl.exp2(s * qk_scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]  # then the MMA accumulates into it
        if KV_FORMAT == 1:  # sum_j p_j (c_j s_j + m_j) = (p s) . c + (p . m): codes exact
            v, v2, v_scale, v_min = tq_values(k_ptr, tq_off, tq_ok, offs_dv, D, DV, KEY_BITS,
                                              VALUE_BITS, VALUE_PLANES, TQ_COALESCED, q.dtype)
            ps = (p * v_scale[None, :]).to(q.dtype)
            acc = tl.dot(ps, v, acc, input_precision=PRECISION)
            shift = tl.sum(p * v_min[None, :], 1)
            if VALUE_PLANES:
                acc2 = tl.dot(ps, v2, acc2 * alpha[:, None], input_precision=PRECISION)
                shift = tl.where(offs_dv[None, :] < DV // 2, shift[:, None], 0.0)
                acc += shift
                acc2 += shift
            else:
                acc += tl.where(offs_dv[None, :] < DV, shift[:, None], 0.0)
        else:
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=PRECISION)
        m_i = m_new
    return acc, acc2, l_i, m_i


@triton.jit
def _combine_parts(part_o_ptr, part_lse_ptr, part, row_ok, offs_dv, NUM_SPLITS: tl.constexpr,
                   DV_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """The splits' partial outputs of a tile's rows (``part``: each row's first split entry)
    weighted by ``exp(lse_s - lse)``: ``(output rows, natural-log LSE)``. Read through L2
    (``.cg``): other programs wrote them."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m_safe = tl.zeros([BLOCK_M], tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_P], tl.float32)
    for s in range(NUM_SPLITS):
        lse_s = tl.load(part_lse_ptr + part + s, mask=row_ok, other=float("-inf"),
                        cache_modifier=".cg")
        o_s = tl.load(part_o_ptr + (part + s)[:, None] * DV_P + offs_dv[None, :],
                      mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse_s - m_safe)
        acc = acc * alpha[:, None] + o_s * w[:, None]
        l_sum = l_sum * alpha + w
        m = m_new
    has = l_sum > 0
    out_rows = acc / tl.where(has, l_sum, 1.0)[:, None]
    lse = tl.where(has, m_safe + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
    return out_rows, lse


@triton.jit
def _store_rows(out_rows, lse, out_ptr, lse_ptr, sinks_ptr, v_scale_ptr, rows, head, row_ok,
                offs_dv, stride_ot, stride_oh, stride_lt, DV: tl.constexpr,
                HAS_SINKS: tl.constexpr, FP8: tl.constexpr, WRITE_LSE: tl.constexpr):
    """A tile's final rows: the sink factor, the fp8 value scale, then ``out`` (and LSE)."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
        out_rows = out_rows * tl.sigmoid(lse - sink)[:, None]
    if FP8:
        out_rows = out_rows * tl.load(v_scale_ptr)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
             + offs_dv[None, :], out_rows.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    if WRITE_LSE:
        tl.store(lse_ptr + rows * stride_lt + head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_reqs", "window", "num_pages", "bt_width", "num_tokens",
                               "attn_tiles", "home_lo", "home_rows", "search_steps"])
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
    qsl_ptr, seq_ptr, bt_ptr, sinks_ptr, alibi_ptr, k_scale_ptr, v_scale_ptr, tree_ptr,
    counter_ptr,
    num_reqs, scale, soft_cap, window, tree_size, num_pages, bt_width, num_tokens,
    attn_tiles, home_lo, home_rows, search_steps,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HQ: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, FP8: tl.constexpr,
    WRITE_LSE: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    HAS_TREE: tl.constexpr, FUSED_COMBINE: tl.constexpr, HEADS_FASTEST: tl.constexpr,
    ONE_ROW: tl.constexpr, codebook_ptr, inv_sqrt_d, KV_FORMAT: tl.constexpr,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    KEY_PLANES: tl.constexpr, VALUE_PLANES: tl.constexpr, TQ_COALESCED: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    # Tiles in reverse: a causal request's last tiles see the most keys, so they start first
    # and the light ones fill the last wave. HEADS_FASTEST: in launch order every KV head's
    # tile comes before the next tile, so all heads' longest tiles start in the first wave.
    if HEADS_FASTEST:
        launched = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        tile = tl.num_programs(0) - 1 - launched // tl.num_programs(1)
        kv_head = launched % tl.num_programs(1)
    else:
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if tile >= attn_tiles:  # the launch's row check (one tile, each KV head's query heads)
        if split == 0:
            _clear_uncovered(qsl_ptr, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, kv_head,
                             num_reqs, num_tokens, attn_tiles, home_lo, home_rows,
                             search_steps, stride_ot, stride_oh, stride_lt, GROUP, GROUP_P, HQ,
                             BLOCK_Q, DV, DV_P, NUM_SPLITS, WRITE_LSE, ONE_ROW)
        return
    # The request's rows clamped into the tokens (a corrupt query_start_loc reads and writes
    # no row outside them); tiles are numbered from the clamped first start.
    if ONE_ROW:
        r = tile
        q_start, q_end = _span(qsl_ptr, r, 0, num_tokens)
    else:
        base = _clamp(tl.load(qsl_ptr), 0, num_tokens)
        r = _request_of_tile(tile, qsl_ptr, num_reqs, base, num_tokens, BLOCK_Q)
        q_start, q_end = _span(qsl_ptr, r, base, num_tokens)
    q_len = q_end - q_start
    t0 = q_len * 0  # first query of the tile (ONE_ROW: the request's only one)
    if not ONE_ROW:
        t0 = (tile - ((q_start - base) // BLOCK_Q + r)) * BLOCK_Q
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_ptr + r)
    context = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    tok = t0 + offs_m // GROUP_P  # query index within the request
    head = kv_head * GROUP + offs_m % GROUP_P
    row_ok = (tok < q_len) & (offs_m % GROUP_P < GROUP)  # (the span is inside the tokens)
    pos = context + tok  # the query's position
    offs_d = tl.arange(0, D_P)
    offs_dv = tl.arange(0, DV_P)
    # (row offsets in int64: tokens x heads x head dim passes 2^31 at about 500k tokens)
    q = tl.load(q_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_qt
                + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)

    # The keys any row of the tile can see, then this split's chunk of them.
    last = context + tl.minimum(t0 + BLOCK_Q, q_len) - 1
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(seq_len, last + 1)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, context + t0 - window + 1)
        if not CAUSAL:
            hi = tl.minimum(seq_len, last + window)
    hi = tl.minimum(hi, bt_width * PAGE)  # (keys past the block-table row are absent)
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)

    logit_scale = scale
    if FP8:
        logit_scale = logit_scale * tl.load(k_scale_ptr)  # dequantizes K inside q.k
    q2 = q  # (the odd coordinates' query of 4-bit key planes)
    offs_kc, offs_vc = offs_d, offs_dv  # the K / V tiles' columns (planes: the fields' bytes)
    if KV_FORMAT == 1 and KEY_BITS != 8:  # TurboQuant's rotated keys: rotate q once instead
        if KEY_PLANES:  # (the even and the odd columns of the rotation, a product each)
            offs_kc = tl.arange(0, D_P // 2)
            odd = sylvester_signs(offs_d, 2 * offs_kc + 1, D).to(q.dtype)
            q2 = tl.dot(q, odd, input_precision=PRECISION).to(q.dtype)
            even = sylvester_signs(offs_d, 2 * offs_kc, D).to(q.dtype)
            q = tl.dot(q, even, input_precision=PRECISION).to(q.dtype)
        else:  # (+-1: exact operands)
            signs = sylvester_signs(offs_d, offs_d, D).to(q.dtype)
            q = tl.dot(q, signs, input_precision=PRECISION).to(q.dtype)
        logit_scale = logit_scale * inv_sqrt_d
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0) * LOG2E
    if HAS_TREE:  # a request of exactly tree_size queries is a draft tree: ancestor bitmasks
        not_tree = (tok * 0 + q_len) != tree_size  # (as a row vector)
        ancestors = tl.load(tree_ptr + tok, mask=row_ok & ~not_tree, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if VALUE_PLANES:  # (the even and the odd output columns)
        offs_vc = tl.arange(0, DV_P // 2)
        acc = tl.zeros([BLOCK_M, DV_P // 2], tl.float32)
        acc2 = tl.zeros([BLOCK_M, DV_P // 2], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, DV_P], tl.float32)
        acc2 = tl.zeros([BLOCK_M, 1], tl.float32)  # (unused)
    if not HAS_ALIBI:
        slope = m_i  # (unused)
    if not HAS_TREE:
        ancestors = tok
        not_tree = row_ok
    # Key blocks every row of the tile sees whole need no mask: those after the window's edge
    # for the tile's last row and, causally, up to the first row's position (tree tiles: up to
    # the draft tokens). The rest -- window edge, diagonal, tail -- are masked.
    full_lo = lo
    full_hi = hi
    if USE_WINDOW:
        full_lo = tl.maximum(lo, last - window + 1)
        if not CAUSAL:
            full_hi = tl.minimum(full_hi, context + t0 + window)
    if CAUSAL:
        full_hi = tl.minimum(full_hi, context + t0 + 1)
    if HAS_TREE:
        full_hi = tl.minimum(full_hi, context)
    num_blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    first_full = tl.minimum(tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N), num_blocks)
    end_full = tl.maximum(tl.maximum(full_hi - lo, 0) // BLOCK_N, first_full)
    # Whole blocks load K/V unmasked: the block ids of the pages they span are checked here,
    # once (SCAN table entries a load, one reduction at the end); one outside the cache turns
    # them all into masked blocks, which mask its keys.
    bt_row = bt_ptr + r * stride_bt
    page_lo = (lo + first_full * BLOCK_N) // PAGE
    page_hi = tl.cdiv(lo + end_full * BLOCK_N, PAGE)
    bad = tl.zeros([SCAN], tl.int32)
    for c0 in range(page_lo, page_hi, SCAN):
        cols = c0 + tl.arange(0, SCAN)
        ids = tl.load(bt_row + cols, mask=cols < page_hi, other=0)
        bad = bad | ((ids < 0) | (ids >= num_pages)).to(tl.int32)
    end_full = tl.where(tl.max(bad, 0) > 0, first_full, end_full)
    for phase in tl.static_range(3):  # masked blocks, whole blocks, masked blocks
        if phase == 0:
            b0, b1 = 0, first_full
        elif phase == 1:
            b0, b1 = first_full, end_full
        else:
            b0, b1 = end_full, num_blocks
        acc, acc2, l_i, m_i = _attend(
            acc, acc2, l_i, m_i, b0, b1, q, q2, lo, hi, r, pos, row_ok, context, kv_head,
            logit_scale, slope, ancestors, not_tree, bt_ptr, num_pages, k_ptr, v_ptr, stride_bt,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, window, soft_cap,
            offs_kc, offs_vc, PAGE, BLOCK_N, D, D_P, DV, DV_P, CAUSAL, USE_WINDOW, USE_SOFTCAP,
            HAS_ALIBI, HAS_TREE, PRECISION, phase != 1, codebook_ptr, KV_FORMAT, KEY_BITS,
            VALUE_BITS, NORM_CORRECTION, KEY_PLANES, VALUE_PLANES, TQ_COALESCED)

    has_keys = l_i > 0
    out_rows = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2, float("-inf"))
    rows = q_start + tok
    out_cols = offs_dv  # (value planes: acc holds the even columns, acc2 the odd ones)
    if VALUE_PLANES:
        out_cols = 2 * offs_vc
        out2 = acc2 / tl.where(has_keys, l_i, 1.0)[:, None]
    if NUM_SPLITS > 1:
        first_part = (rows * HQ + head) * NUM_SPLITS
        part = first_part + split
        tl.store(part_o_ptr + part[:, None] * DV_P + out_cols[None, :], out_rows,
                 mask=row_ok[:, None])
        if VALUE_PLANES:
            tl.store(part_o_ptr + part[:, None] * DV_P + (out_cols + 1)[None, :], out2,
                     mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        if FUSED_COMBINE:
            tl.debug_barrier()  # every thread's partial stores come before the ticket
            counter = counter_ptr + tile * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == NUM_SPLITS - 1:  # the tile's last split: combine, then reset
                whole, whole_lse = _combine_parts(part_o_ptr, part_lse_ptr, first_part, row_ok,
                                                  offs_dv, NUM_SPLITS, DV_P, BLOCK_M)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                _store_rows(whole, whole_lse, out_ptr, lse_ptr, sinks_ptr, v_scale_ptr, rows,
                            head, row_ok, offs_dv, stride_ot, stride_oh, stride_lt, DV,
                            HAS_SINKS, FP8, WRITE_LSE)
    else:
        _store_rows(out_rows, lse, out_ptr, lse_ptr, sinks_ptr, v_scale_ptr, rows, head, row_ok,
                    out_cols, stride_ot, stride_oh, stride_lt, DV, HAS_SINKS, FP8, WRITE_LSE)
        if VALUE_PLANES:
            _store_rows(out2, lse, out_ptr, lse_ptr, sinks_ptr, v_scale_ptr, rows, head,
                        row_ok, out_cols + 1, stride_ot, stride_oh, stride_lt, DV, HAS_SINKS,
                        FP8, False)


@triton.jit(do_not_specialize=["num_reqs"])
def combine_splits_kernel(
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, sinks_ptr, v_scale_ptr,
    num_reqs, stride_ot, stride_oh, stride_lt,
    HQ: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
    DV: tl.constexpr, DV_P: tl.constexpr,
    HAS_SINKS: tl.constexpr, FP8: tl.constexpr, WRITE_LSE: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr, ALL_ROWS: tl.constexpr,
):
    """One program per (token, head): the splits' outputs weighted by ``exp(lse_s - lse)``,
    ``SPLIT_BLOCK`` splits' rows at a time (wide values over many splits would not fit in
    registers at once). The rows: those of ``query_start_loc`` or, with ``ALL_ROWS``, every
    row of the grid (TRITON_ATTN: its row check leaves every row of the launch partials, its
    tiles' or empty ones, whatever the device offsets hold)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    if not ALL_ROWS:
        # the rows of query_start_loc clamped into the grid's (the partials' rows): a corrupt
        # device value reads and writes no row outside them
        first = _clamp(tl.load(qsl_ptr), 0, tl.num_programs(0))
        if row >= _clamp(tl.load(qsl_ptr + num_reqs), first, tl.num_programs(0)) - first:
            return
        row = row + first
    offs_s = tl.arange(0, SPLITS_P)
    offs_dv = tl.arange(0, DV_P)
    part = (row * HQ + head) * NUM_SPLITS + offs_s
    s_ok = offs_s < NUM_SPLITS
    lse_s = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    denom = tl.sum(w, 0)
    o = tl.zeros([DV_P], tl.float32)
    for s0 in range(0, NUM_SPLITS, SPLIT_BLOCK):
        offs_b = s0 + tl.arange(0, SPLIT_BLOCK)
        b_ok = offs_b < NUM_SPLITS
        part_b = (row * HQ + head) * NUM_SPLITS + offs_b
        w_b = tl.exp(tl.load(part_lse_ptr + part_b, mask=b_ok, other=float("-inf")) - m_safe)
        o_s = tl.load(part_o_ptr + part_b[:, None] * DV_P + offs_dv[None, :],
                      mask=b_ok[:, None], other=0.0)
        o += tl.sum(o_s * w_b[:, None], 0)
    o = o / tl.where(denom > 0, denom, 1.0)
    lse = tl.where(denom > 0, m_safe + tl.log(tl.where(denom > 0, denom, 1.0)), float("-inf"))
    if HAS_SINKS:
        o = o * tl.sigmoid(lse - tl.load(sinks_ptr + head))
    if FP8:
        o = o * tl.load(v_scale_ptr)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_dv,
             o.to(out_ptr.dtype.element_ty), mask=offs_dv < DV)
    if WRITE_LSE:
        tl.store(lse_ptr + row * stride_lt + head, lse)


@triton.jit(do_not_specialize=["num_reqs", "num_rows"])
def zero_padding_kernel(out_ptr, lse_ptr, qsl_ptr, num_reqs, num_rows, row_elems,
                        stride_ot, stride_lt, HQ: tl.constexpr, HQ_P: tl.constexpr,
                        WRITE_LSE: tl.constexpr, BLOCK: tl.constexpr):
    """Rows at and past ``qsl[num_reqs]`` (padding, counted on the device) become zero."""
    row = tl.program_id(0)
    if (row < tl.load(qsl_ptr + num_reqs)) | (row >= num_rows):
        return
    for start in range(0, row_elems, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * stride_ot + offs, tl.zeros([BLOCK], tl.float32).to(
            out_ptr.dtype.element_ty), mask=offs < row_elems)
    if WRITE_LSE:
        offs_h = tl.arange(0, HQ_P)
        tl.store(lse_ptr + row * stride_lt + offs_h, tl.zeros([HQ_P], tl.float32),
                 mask=offs_h < HQ)
