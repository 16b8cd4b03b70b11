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
byte slot a (token, KV head), K and V dequantized in registers a key block at a time (codes
unpacked from their bytes, centroids from a 8- or 16-entry table, values from their fp16 scale
and minimum) before the same two tensor-core products. The rotated presets' keys stay in the
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
    tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
             zeros.to(out_ptr.dtype.element_ty), mask=clear[:, None] & (offs_dv[None, :] < DV))
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
def _tq_codes(base, ok, n, SIZE: tl.constexpr, BITS: tl.constexpr):
    """The first ``n`` codes (``0 <= c < 2^BITS``; 0 past them) of the LSB-first bit streams at
    byte pointers ``base [BLOCK_N]`` (rows ``ok``), int32 ``[BLOCK_N, SIZE]``: each stream's
    bytes loaded once (4 bits: both nibbles of a byte; 3 bits: 8 codes of 3 bytes)."""
    if BITS == 4:
        offs = tl.arange(0, SIZE // 2)
        byte = tl.load(base[:, None] + offs[None, :],
                       mask=ok[:, None] & (offs[None, :] < n // 2), other=0).to(tl.int32)
        pairs = tl.join(byte & 15, byte >> 4)  # [BLOCK_N, SIZE / 2, 2]: low nibble first
        return tl.reshape(pairs, [base.shape[0], SIZE])
    # 3 bits: a 24-bit word holds 8 codes; its 3 bytes loaded as 3 planes of [BLOCK_N, SIZE / 8]
    groups = tl.arange(0, SIZE // 8)
    mask = ok[:, None] & (groups[None, :] < n // 8)
    at = base[:, None] + (groups * 3)[None, :]
    word = tl.load(at, mask=mask, other=0).to(tl.int32)
    word |= tl.load(at + 1, mask=mask, other=0).to(tl.int32) << 8
    word |= tl.load(at + 2, mask=mask, other=0).to(tl.int32) << 16
    codes = (word[:, :, None] >> (tl.arange(0, 8) * 3)[None, None, :]) & 7
    return tl.reshape(codes, [base.shape[0], SIZE])


# Key codes of the 4-bit presets, 8 a word, to 16-bit centroids: the codebook is symmetric
# (c[15 - j] = -c[j]), so a code's 3-bit magnitude index selects the low and the high byte of
# c[8 + index] from two 8-byte tables (PRMT), and a clear top bit sets the sign.
# $4/$5: the word and the next one, $6: the bit shift aligning them (0 or 16); $7/$8: the
# magnitudes' low bytes, $9/$10: their high bytes. Outputs $0..$3: codes (0, 1), (2, 3),
# (4, 5), (6, 7), a register's low half first (returned whole: ptxas then needs no moves to
# gather halves for the 16-byte shared-memory stores that stage them).
_KEYS4_ASM = tl.constexpr("""{
.reg .b32 x, t, m, n, l, h, y, z, p;
shf.r.clamp.b32 x, $4, $5, $6;
shr.u32 t, x, 3;
and.b32 t, t, 0x11111111;
mad.lo.u32 m, t, 0xFFFFFFF9, 0x77777777;
xor.b32 m, m, x;
and.b32 m, m, 0x77777777;
prmt.b32 l, $7, $8, m;
prmt.b32 h, $9, $10, m;
prmt.b32 y, x, x, 0x1100;
shl.b32 z, y, 4;
and.b32 z, z, 0x00800080;
and.b32 y, y, 0x80008000;
or.b32 z, z, y;
not.b32 z, z;
and.b32 z, z, 0x80808080;
or.b32 h, h, z;
prmt.b32 $0, l, h, 0x5140;
prmt.b32 $1, l, h, 0x7362;
shr.u32 n, m, 16;
prmt.b32 l, $7, $8, n;
prmt.b32 h, $9, $10, n;
prmt.b32 y, x, x, 0x3322;
shl.b32 z, y, 4;
and.b32 z, z, 0x00800080;
and.b32 y, y, 0x80008000;
or.b32 z, z, y;
not.b32 z, z;
and.b32 z, z, 0x80808080;
or.b32 h, h, z;
prmt.b32 $2, l, h, 0x5140;
prmt.b32 $3, l, h, 0x7362;
}""")

# Value codes of 4 bits, 8 a word, to 16-bit floats MAGIC + code (exact: MAGIC is 128 in bf16,
# 1024 in fp16, where the spacing is 1): an AND and an OR a pair. The pairs a register holds are
# codes (j, j + 4) of the word, so outputs $0..$3 hold codes 0, 4 | 1, 5 | 2, 6 | 3, 7: the
# value columns this permutes are put back where the output is stored
# (:func:`_tq_value_column`). $4/$5/$6: the words and shift as above; $7: MAGIC in both halves.
_VALUES4_ASM = tl.constexpr("""{
.reg .b32 x, y, p;
shf.r.clamp.b32 x, $4, $5, $6;
and.b32 p, x, 0x000F000F;
or.b32 $0, p, $7;
shr.u32 y, x, 4;
and.b32 p, y, 0x000F000F;
or.b32 $1, p, $7;
shr.u32 y, x, 8;
and.b32 p, y, 0x000F000F;
or.b32 $2, p, $7;
shr.u32 y, x, 12;
and.b32 p, y, 0x000F000F;
or.b32 $3, p, $7;
}""")


@triton.jit
def _tq_value_column(c):
    """The value dim held in column ``c`` of a 4-bit value tile (codes 0, 4, 1, 5, 2, 6, 3, 7 of
    each word, as :data:`_VALUES4_ASM` leaves them)."""
    return c // 8 * 8 + c % 8 // 2 + c % 2 * 4


@triton.jit
def _tq_magic(DTYPE: tl.constexpr):
    """What a 4-bit value code is offset by in the ``DTYPE`` value tile (see _VALUES4_ASM)."""
    if DTYPE == tl.bfloat16:
        return 128.0
    elif DTYPE == tl.float16:
        return 1024.0
    else:
        return 0.0


@triton.jit
def _tq_words(words_ptr, off, ok, NW: tl.constexpr):
    """The ``NW`` 32-bit words of the bytes from byte offsets ``off [BLOCK_N]`` (even; rows
    ``ok``) of the 4-byte aligned cache ``words_ptr``, as the word pairs a funnel shift aligns:
    ``(word, next word, shift [BLOCK_N, 1])`` (shift 0 or 16 bits). The next word of the last
    one reads at most 4 bytes past the field, inside its slot (the fields after it)."""
    at = words_ptr + (off >> 2)[:, None] + tl.arange(0, NW)[None, :]
    w = tl.load(at, mask=ok[:, None], other=0)
    w1 = tl.load(at + 1, mask=ok[:, None], other=0)
    return w, w1, ((off & 3) * 8).to(tl.uint32)[:, None]


@triton.jit
def _funnel(w, w1, sh):
    """The 32 bits from bit ``sh`` of the 64-bit ``w1:w`` (PTX ``shf.r``)."""
    lo = w.to(tl.uint32, bitcast=True).to(tl.uint64)
    hi = w1.to(tl.uint32, bitcast=True).to(tl.uint64)
    return ((lo | (hi << 32)) >> sh.to(tl.uint64)).to(tl.uint32)


@triton.jit
def _halves(pair, DTYPE: tl.constexpr):
    """The two 16-bit floats a 32-bit register holds: (low half, high half)."""
    return (pair.to(tl.uint16).to(DTYPE, bitcast=True),
            (pair >> 16).to(tl.uint16).to(DTYPE, bitcast=True))


@triton.jit
def _nibble(x, i: tl.constexpr):
    return ((x >> (4 * i)) & 15).to(tl.int32)


@triton.jit
def _join8(e0, e1, e2, e3, e4, e5, e6, e7):
    """``[R, W]`` tensors as ``[R, W * 8]``: column ``8 w + i`` from ``e_i[:, w]``."""
    t = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)),
                tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    return tl.reshape(t, [e0.shape[0], e0.shape[1] * 8])


@triton.jit
def _tq_keys4(words_ptr, off, ok, codebook_ptr, lut_ptr, D: tl.constexpr, DTYPE: tl.constexpr,
              USE_ASM: tl.constexpr):
    """4-bit keys ``[BLOCK_N, D]`` in ``DTYPE``: each code's centroid (rotated space)."""
    w, w1, sh = _tq_words(words_ptr, off, ok, D // 8)
    if USE_ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _KEYS4_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r",
            [w, w1, sh, tl.load(lut_ptr), tl.load(lut_ptr + 1), tl.load(lut_ptr + 2),
             tl.load(lut_ptr + 3)], (tl.uint32,) * 4, is_pure=True, pack=1)
        e0, e1 = _halves(p0, DTYPE)
        e2, e3 = _halves(p1, DTYPE)
        e4, e5 = _halves(p2, DTYPE)
        e6, e7 = _halves(p3, DTYPE)
    else:
        x = _funnel(w, w1, sh)
        e0 = tl.load(codebook_ptr + _nibble(x, 0)).to(DTYPE)
        e1 = tl.load(codebook_ptr + _nibble(x, 1)).to(DTYPE)
        e2 = tl.load(codebook_ptr + _nibble(x, 2)).to(DTYPE)
        e3 = tl.load(codebook_ptr + _nibble(x, 3)).to(DTYPE)
        e4 = tl.load(codebook_ptr + _nibble(x, 4)).to(DTYPE)
        e5 = tl.load(codebook_ptr + _nibble(x, 5)).to(DTYPE)
        e6 = tl.load(codebook_ptr + _nibble(x, 6)).to(DTYPE)
        e7 = tl.load(codebook_ptr + _nibble(x, 7)).to(DTYPE)
    return _join8(e0, e1, e2, e3, e4, e5, e6, e7)


@triton.jit
def _tq_values4(words_ptr, off, ok, lut_ptr, DV: tl.constexpr, DTYPE: tl.constexpr,
                USE_ASM: tl.constexpr):
    """4-bit value codes ``[BLOCK_N, DV]`` in ``DTYPE``, plus :func:`_tq_magic`, their columns
    in :func:`_tq_value_column`'s order."""
    w, w1, sh = _tq_words(words_ptr, off, ok, DV // 8)
    if USE_ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _VALUES4_ASM, "=r,=r,=r,=r,r,r,r,r", [w, w1, sh, tl.load(lut_ptr + 4)],
            (tl.uint32,) * 4, is_pure=True, pack=1)
        o0, o1 = _halves(p0, DTYPE)
        o2, o3 = _halves(p1, DTYPE)
        o4, o5 = _halves(p2, DTYPE)
        o6, o7 = _halves(p3, DTYPE)
    else:
        x = _funnel(w, w1, sh)
        magic = _tq_magic(DTYPE)
        o0 = (_nibble(x, 0) + magic).to(DTYPE)
        o1 = (_nibble(x, 4) + magic).to(DTYPE)
        o2 = (_nibble(x, 1) + magic).to(DTYPE)
        o3 = (_nibble(x, 5) + magic).to(DTYPE)
        o4 = (_nibble(x, 2) + magic).to(DTYPE)
        o5 = (_nibble(x, 6) + magic).to(DTYPE)
        o6 = (_nibble(x, 3) + magic).to(DTYPE)
        o7 = (_nibble(x, 7) + magic).to(DTYPE)
    return _join8(o0, o1, o2, o3, o4, o5, o6, o7)


@triton.jit
def _tq_fp16(ptr, ok):
    """The little-endian fp16 at byte pointers ``ptr`` (rows ``ok``; 0 elsewhere), in fp32."""
    low = tl.load(ptr, mask=ok, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=ok, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _tq_half(ptr, ok):
    """The fp16 at 2-byte aligned byte pointers ``ptr`` (rows ``ok``; 0 elsewhere), in fp32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _tq_tile(cache_ptr, off, ok, codebook_ptr, lut_ptr, offs_d, D: tl.constexpr,
             D_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr, KEY_BITS: tl.constexpr,
             VALUE_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr, DTYPE: tl.constexpr,
             WORDS: tl.constexpr, USE_ASM: tl.constexpr):
    """One key block of a TurboQuant cache (``backends/turboquant/format.py``) from its
    slots' byte offsets ``off`` (int64): ``(keys, key scales, values, value scales, value
    minimums)`` -- the keys in ``DTYPE``, in the rotated space (the query is rotated once) as
    codebook centroids, each key's norm (its score column's scale: no multiplication of every
    coordinate), over the centroids' norm with norm correction except for 4-bit words (the
    caller's tensor cores divide those); fp8 keys as stored, scale 1. A value
    is ``code * scale + minimum``: the caller folds the affine into its probabilities. With
    ``WORDS`` (a 4-byte aligned cache) 4-bit codes are read 8 a 32-bit word and 4-bit values
    come as :func:`_tq_values4` gives them (plus :func:`_tq_magic`, permuted columns)."""
    base = cache_ptr + off
    words = cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    if KEY_BITS == 8:
        k = tl.load(base[:, None] + offs_d[None, :], mask=ok[:, None] & (offs_d[None, :] < D),
                    other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DTYPE)
        k_scale = tl.where(ok, 1.0, 0.0)
        vstart = D
    else:
        if WORDS and KEY_BITS == 4:
            k = _tq_keys4(words, off, ok, codebook_ptr, lut_ptr, D, DTYPE, USE_ASM)
            k_scale = _tq_half(base + D // 2, ok)
        else:
            codes = _tq_codes(base, ok, D, D_P, KEY_BITS)
            k = tl.where(offs_d[None, :] < D, tl.load(codebook_ptr + codes), 0.0)
            k_scale = _tq_fp16(base + D * KEY_BITS // 8, ok)
            if NORM_CORRECTION:
                k_scale = k_scale / tl.sqrt(tl.sum(k * k, axis=1) + 1e-16)
            k = k.to(DTYPE)
        vstart = D * KEY_BITS // 8 + 2
    tail = base + vstart + DV * VALUE_BITS // 8
    if WORDS and VALUE_BITS == 4:
        v = _tq_values4(words, off + vstart, ok, lut_ptr, DV, DTYPE, USE_ASM)
        return k, k_scale, v, _tq_half(tail, ok), _tq_half(tail + 2, ok)
    v = _tq_codes(base + vstart, ok, DV, DV_P, VALUE_BITS).to(DTYPE)
    return k, k_scale, v, _tq_fp16(tail, ok), _tq_fp16(tail + 2, ok)


@triton.jit
def _attend(acc, l_i, m_i, b0, b1, q, lo, hi, r, pos, row_ok, context, kv_head, logit_scale,
            slope, ancestors, not_tree, bt_ptr, num_pages, k_ptr, v_ptr, stride_bt, stride_kb,
            stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, window, soft_cap, offs_d,
            offs_dv, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
            D_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
            CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
            HAS_ALIBI: tl.constexpr, HAS_TREE: tl.constexpr, PRECISION: tl.constexpr,
            MASKED: tl.constexpr, codebook_ptr, lut_ptr, KV_FORMAT: tl.constexpr,
            KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
            TQ_WORDS: tl.constexpr, TQ_ASM: tl.constexpr):
    """Online softmax over key blocks ``b0..b1-1`` (of ``BLOCK_N`` keys from ``lo``), gathered
    page by page; ``MASKED=False`` blocks lie inside ``[lo, hi)``, are visible to every row
    of the tile whole and span only pages inside the cache (checked by the caller): their loads
    and scores need no mask, and no row's maximum is -inf. In masked blocks a key whose block
    id is outside ``[0, num_pages)`` is masked like one past ``hi``."""
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
            k, k_scale, v, v_scale, v_min = _tq_tile(
                k_ptr, page * stride_kb + slot * stride_ks + kv_head * stride_kh,
                n_ok if MASKED else offs_n >= 0, codebook_ptr, lut_ptr, offs_d, D, D_P, DV,
                DV_P, KEY_BITS, VALUE_BITS, NORM_CORRECTION, q.dtype, TQ_WORDS, TQ_ASM)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if NORM_CORRECTION and TQ_WORDS and KEY_BITS == 4:  # every key's ||c||^2 on the
                # tensor cores too, in each row
                c2 = tl.dot(tl.full(q.shape, 1.0, q.dtype), tl.trans(k * k),
                            input_precision=PRECISION)
                k_scale = k_scale[None, :] * tl.rsqrt(c2 + 1e-16)
            else:
                k_scale = k_scale[None, :]
            s = s * k_scale
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
            ps = (p * v_scale[None, :]).to(q.dtype)
            acc = tl.dot(ps, v, acc, input_precision=PRECISION)
            shift = tl.sum(p * v_min[None, :], 1)
            if TQ_WORDS and VALUE_BITS == 4:  # the tile's codes are offset by a constant
                shift -= _tq_magic(q.dtype) * tl.sum(ps.to(tl.float32), 1)
            acc += tl.where(offs_dv[None, :] < DV, shift[:, None], 0.0)
        else:
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


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
    tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh
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
    ONE_ROW: tl.constexpr, codebook_ptr, signs_ptr, lut_ptr, inv_sqrt_d, KV_FORMAT: tl.constexpr,
    KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    TQ_WORDS: tl.constexpr, TQ_ASM: tl.constexpr,
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
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)

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
    if KV_FORMAT == 1 and KEY_BITS != 8:  # TurboQuant's rotated keys: rotate q once instead
        signs = tl.load(signs_ptr + offs_d[:, None] * D_P + offs_d[None, :]).to(q.dtype)
        q = tl.dot(q, signs, input_precision=PRECISION).to(q.dtype)  # (+-1: exact operands)
        logit_scale = logit_scale * inv_sqrt_d
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0) * LOG2E
    if HAS_TREE:  # a request of exactly tree_size queries is a draft tree: ancestor bitmasks
        not_tree = (tok * 0 + q_len) != tree_size  # (as a row vector)
        ancestors = tl.load(tree_ptr + tok, mask=row_ok & ~not_tree, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_P], tl.float32)
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
        acc, l_i, m_i = _attend(acc, l_i, m_i, b0, b1, q, lo, hi, r, pos, row_ok, context,
                                kv_head, logit_scale, slope, ancestors, not_tree, bt_ptr,
                                num_pages, k_ptr, v_ptr, stride_bt, stride_kb, stride_ks,
                                stride_kh, stride_vb, stride_vs, stride_vh, window, soft_cap,
                                offs_d, offs_dv, PAGE, BLOCK_N, D, D_P, DV, DV_P, CAUSAL,
                                USE_WINDOW, USE_SOFTCAP, HAS_ALIBI, HAS_TREE, PRECISION,
                                phase != 1, codebook_ptr, lut_ptr, KV_FORMAT, KEY_BITS,
                                VALUE_BITS, NORM_CORRECTION, TQ_WORDS, TQ_ASM)

    has_keys = l_i > 0
    out_rows = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * LN2, float("-inf"))
    rows = q_start + tok
    offs_out = offs_dv  # the value dim of each column of acc
    if KV_FORMAT == 1 and TQ_WORDS and VALUE_BITS == 4:
        offs_out = _tq_value_column(offs_dv)
    if NUM_SPLITS > 1:
        first_part = (rows * HQ + head) * NUM_SPLITS
        part = first_part + split
        tl.store(part_o_ptr + part[:, None] * DV_P + offs_out[None, :], out_rows,
                 mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
        if FUSED_COMBINE:
            tl.debug_barrier()  # every thread's partial stores come before the ticket
            counter = counter_ptr + tile * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == NUM_SPLITS - 1:  # the tile's last split: combine, then reset
                out_rows, lse = _combine_parts(part_o_ptr, part_lse_ptr, first_part, row_ok,
                                               offs_dv, NUM_SPLITS, DV_P, BLOCK_M)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                _store_rows(out_rows, lse, out_ptr, lse_ptr, sinks_ptr, v_scale_ptr, rows, head,
                            row_ok, offs_dv, stride_ot, stride_oh, stride_lt, DV, HAS_SINKS, FP8,
                            WRITE_LSE)
    else:
        _store_rows(out_rows, lse, out_ptr, lse_ptr, sinks_ptr, v_scale_ptr, rows, head, row_ok,
                    offs_out, stride_ot, stride_oh, stride_lt, DV, HAS_SINKS, FP8, WRITE_LSE)


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
