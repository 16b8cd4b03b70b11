"""TurboQuant slots read in TRITON_ATTN's attention kernel (``KV_FORMAT=1`` in
``backends/triton_attn_kernels.py``): a key block's keys, their score scales and its values
from the slots' bytes (``format.py``), dequantized in registers.

3- and 4-bit codes are read 8 at a time (``TQ_WORDS``: a 4-byte aligned cache, unpadded head
tiles): a 32-bit word of 4-bit codes, or a 24-bit group of 3-bit ones funnel-shifted out of the
word pair holding it; fp8 keys 4 a word. On GPUs inline PTX decodes the codes (``TQ_ASM``:
:data:`KEYS4_ASM`, :data:`KEYS3_ASM`, :data:`VALUES4_ASM`, :data:`VALUES3_ASM`, whose tables
``ops.decode_tables`` builds); the interpreter computes the same tiles with Triton arithmetic.
Other slots are read byte by byte.
"""

from __future__ import annotations

import triton
import triton.language as tl


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


def _keys4_half(selectors: str, spread: int, out: int) -> str:
    """PTX for 4 of the word ``x``'s key codes: their magnitude indices' nibbles in the low
    half of ``selectors``, ``spread`` the ``prmt`` copying their 2 bytes to where each code's
    top bit lands on bit 7 of its byte (after a shift by 4 for the even codes), outputs
    ``$out`` and ``$out+1``."""
    return f"""prmt.b32 l, $7, $8, {selectors};
prmt.b32 h, $9, $10, {selectors};
prmt.b32 y, x, x, {spread:#06x};
shl.b32 z, y, 4;
and.b32 z, z, 0x00800080;
and.b32 y, y, 0x80008000;
or.b32 z, z, y;
not.b32 z, z;
and.b32 z, z, 0x80808080;
or.b32 h, h, z;
prmt.b32 ${out}, l, h, 0x5140;
prmt.b32 ${out + 1}, l, h, 0x7362;
"""


# Key codes of the 4-bit presets, 8 a word, to 16-bit centroids: the codebook is symmetric
# (c[15 - j] = -c[j]), so a code's 3-bit magnitude index selects the low and the high byte of
# c[8 + index] from two 8-byte tables (PRMT), and a clear top bit sets the sign.
# $4/$5: the word and the next one, $6: the bit shift aligning them (0 or 16); $7/$8: the
# magnitudes' low bytes, $9/$10: their high bytes. Outputs $0..$3: codes (0, 1), (2, 3),
# (4, 5), (6, 7), a register's low half first (returned whole: ptxas then needs no moves to
# gather halves for the 16-byte shared-memory stores that stage them).
KEYS4_ASM = tl.constexpr("""{
.reg .b32 x, t, m, n, l, h, y, z;
shf.r.clamp.b32 x, $4, $5, $6;
shr.u32 t, x, 3;
and.b32 t, t, 0x11111111;
mad.lo.u32 m, t, 0xFFFFFFF9, 0x77777777;
xor.b32 m, m, x;
and.b32 m, m, 0x77777777;
""" + _keys4_half("m", 0x1100, 0) + "shr.u32 n, m, 16;\n" + _keys4_half("n", 0x3322, 2) + "}")


# 3-bit codes, 8 a 24-bit group (bit 3 i: code i), spread to a 4-bit code a nibble, as a 32-bit
# word of 4-bit codes holds them: codes 4-7 up 4 bits, then each half's second pair up 2, then
# each byte's second code up 1 (adding a masked field to itself moves it up by one bit: x + t
# == x - t + 2 t; mad.lo by 2^k - 1 moves it k bits). $4/$5/$6: the word holding the group's
# first bit, the next one and the group's bit offset in the first (0..31).
_SPREAD3 = """shf.r.clamp.b32 x, $4, $5, $6;
and.b32 t, x, 0x00FFF000;
and.b32 x, x, 0x00000FFF;
mad.lo.u32 x, t, 16, x;
and.b32 t, x, 0x0FC00FC0;
mad.lo.u32 x, t, 3, x;
and.b32 t, x, 0x38383838;
add.u32 x, x, t;
"""

# 3-bit key codes to 16-bit centroids: a code (a nibble of x, at most 7) selects the low and the
# high byte of its centroid from two 8-byte tables (PRMT over a register pair), no symmetry
# needed. $7/$8: the 8 centroids' low bytes, $9/$10: their high bytes. Outputs as KEYS4_ASM's.
KEYS3_ASM = tl.constexpr("""{
.reg .b32 x, t, n, l, h;
""" + _SPREAD3 + """prmt.b32 l, $7, $8, x;
prmt.b32 h, $9, $10, x;
prmt.b32 $0, l, h, 0x5140;
prmt.b32 $1, l, h, 0x7362;
shr.u32 n, x, 16;
prmt.b32 l, $7, $8, n;
prmt.b32 h, $9, $10, n;
prmt.b32 $2, l, h, 0x5140;
prmt.b32 $3, l, h, 0x7362;
}""")

# Value codes, 4 bits a nibble of x, to 16-bit floats MAGIC + code (exact: MAGIC is 128 in bf16,
# 1024 in fp16, where the spacing is 1): an AND and an OR a pair. The pairs a register holds are
# codes (j, j + 4) of the word, so outputs $0..$3 hold codes 0, 4 | 1, 5 | 2, 6 | 3, 7: the
# value columns this permutes are put back where the output is stored
# (:func:`tq_value_column`). $7: MAGIC in both halves.
_VALUE_PAIRS = "".join(f"""shr.u32 y, x, {4 * i};
and.b32 p, y, 0x000F000F;
or.b32 ${i}, p, $7;
""" for i in range(4))

# 4-bit value codes, 8 a word: $4/$5/$6 the words and shift as KEYS4_ASM's.
VALUES4_ASM = tl.constexpr("""{
.reg .b32 x, y, p;
shf.r.clamp.b32 x, $4, $5, $6;
""" + _VALUE_PAIRS + "}")

# 3-bit value codes, 8 a 24-bit group: $4/$5/$6 as _SPREAD3's; the same outputs.
VALUES3_ASM = tl.constexpr("""{
.reg .b32 x, t, y, p;
""" + _SPREAD3 + _VALUE_PAIRS + "}")


@triton.jit
def tq_value_column(c):
    """The value dim held in column ``c`` of a 4-bit value tile (codes 0, 4, 1, 5, 2, 6, 3, 7 of
    each word, as :data:`VALUES4_ASM` leaves them)."""
    return c // 8 * 8 + c % 8 // 2 + c % 2 * 4


@triton.jit
def tq_magic(DTYPE: tl.constexpr):
    """What a 4-bit value code is offset by in the ``DTYPE`` value tile (see VALUES4_ASM)."""
    if DTYPE == tl.bfloat16:
        return 128.0
    elif DTYPE == tl.float16:
        return 1024.0
    else:
        return 0.0


@triton.jit
def _tq_words(words_ptr, off, ok, NW: tl.constexpr):
    """The ``NW`` 32-bit words of the bytes from byte offsets ``off [BLOCK_N]`` (rows ``ok``)
    of the 4-byte aligned cache ``words_ptr``, as the word pairs a funnel shift aligns:
    ``(word, next word, bit shift [BLOCK_N, 1])``: 8 4-bit codes or 4 fp8 keys a word. The
    next word of the last one reads at most 4 bytes past the field, inside its slot (the fields
    after it)."""
    at = words_ptr + (off >> 2)[:, None] + tl.arange(0, NW)[None, :]
    w = tl.load(at, mask=ok[:, None], other=0)
    w1 = tl.load(at + 1, mask=ok[:, None], other=0)
    return w, w1, ((off & 3) * 8).to(tl.uint32)[:, None]


@triton.jit
def _tq_groups(words_ptr, off, ok, NG: tl.constexpr):
    """The ``NG`` 24-bit groups (8 3-bit codes each) of the bytes from byte offsets ``off``
    as :func:`_tq_words` hands words: the word holding each group's first bit, the next one
    (only where the group reaches it) and the group's bit offset in the first, ``[BLOCK_N,
    NG]``. Built groups by rows and transposed: Triton lays a gather's threads along its first
    axis, and the decoded key tile then keeps the rows' 8 consecutive coordinates in a thread
    (16-byte stores to shared memory, not 2-byte ones)."""
    bit = (tl.arange(0, NG) * 24)[:, None] + ((off & 3) * 8).to(tl.int32)[None, :]
    at = words_ptr + (off >> 2)[None, :] + (bit >> 5)
    sh = (bit & 31).to(tl.uint32)
    w = tl.load(at, mask=ok[None, :], other=0)
    w1 = tl.load(at + 1, mask=ok[None, :] & (sh > 8), other=0)
    return tl.trans(w), tl.trans(w1), tl.trans(sh)


@triton.jit
def _tq_code_words(words_ptr, off, ok, N: tl.constexpr, BITS: tl.constexpr):
    """``N`` codes of ``BITS`` (3 or 4), 8 an element: :func:`_tq_words` or :func:`_tq_groups`."""
    if BITS == 4:
        w, w1, sh = _tq_words(words_ptr, off, ok, N // 8)
    else:
        w, w1, sh = _tq_groups(words_ptr, off, ok, N // 8)
    return w, w1, sh


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
def _code(x, i: tl.constexpr, BITS: tl.constexpr):
    """Code ``i`` of the ``BITS``-bit codes packed LSB first in ``x``."""
    return ((x >> (BITS * i)) & ((1 << BITS) - 1)).to(tl.int32)


@triton.jit
def _join8(e0, e1, e2, e3, e4, e5, e6, e7):
    """``[R, W]`` tensors as ``[R, W * 8]``: column ``8 w + i`` from ``e_i[:, w]``."""
    t = tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)),
                tl.join(tl.join(e1, e5), tl.join(e3, e7)))
    return tl.reshape(t, [e0.shape[0], e0.shape[1] * 8])


@triton.jit
def _pairs_tile(p0, p1, p2, p3, DTYPE: tl.constexpr):
    """``[R, W * 8]`` from the PTX decode's 4 outputs ``[R, W]`` of two 16-bit floats each
    (register ``i`` holds columns ``2 i`` and ``2 i + 1`` of a group of 8, low half first)."""
    e0, e1 = _halves(p0, DTYPE)
    e2, e3 = _halves(p1, DTYPE)
    e4, e5 = _halves(p2, DTYPE)
    e6, e7 = _halves(p3, DTYPE)
    return _join8(e0, e1, e2, e3, e4, e5, e6, e7)


@triton.jit
def _tq_keys(words_ptr, off, ok, codebook_ptr, lut_ptr, D: tl.constexpr, BITS: tl.constexpr,
             DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """3- or 4-bit keys ``[BLOCK_N, D]`` in ``DTYPE``: each code's centroid (rotated space)."""
    w, w1, sh = _tq_code_words(words_ptr, off, ok, D, BITS)
    if USE_ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            KEYS4_ASM if BITS == 4 else KEYS3_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r",
            [w, w1, sh, tl.load(lut_ptr), tl.load(lut_ptr + 1), tl.load(lut_ptr + 2),
             tl.load(lut_ptr + 3)], (tl.uint32,) * 4, is_pure=True, pack=1)
        return _pairs_tile(p0, p1, p2, p3, DTYPE)
    x = _funnel(w, w1, sh)
    e0 = tl.load(codebook_ptr + _code(x, 0, BITS)).to(DTYPE)
    e1 = tl.load(codebook_ptr + _code(x, 1, BITS)).to(DTYPE)
    e2 = tl.load(codebook_ptr + _code(x, 2, BITS)).to(DTYPE)
    e3 = tl.load(codebook_ptr + _code(x, 3, BITS)).to(DTYPE)
    e4 = tl.load(codebook_ptr + _code(x, 4, BITS)).to(DTYPE)
    e5 = tl.load(codebook_ptr + _code(x, 5, BITS)).to(DTYPE)
    e6 = tl.load(codebook_ptr + _code(x, 6, BITS)).to(DTYPE)
    e7 = tl.load(codebook_ptr + _code(x, 7, BITS)).to(DTYPE)
    return _join8(e0, e1, e2, e3, e4, e5, e6, e7)


@triton.jit
def _fp8_byte(x, i: tl.constexpr, DTYPE: tl.constexpr):
    """Byte ``i`` of the 32-bit ``x`` as an e4m3 number in ``DTYPE``."""
    return ((x >> (8 * i)) & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DTYPE)


@triton.jit
def _tq_fp8_keys(words_ptr, off, ok, D: tl.constexpr, DTYPE: tl.constexpr):
    """fp8 e4m3 keys ``[BLOCK_N, D]`` in ``DTYPE``, read 4 a 32-bit word (as
    :func:`_tq_words`), not byte by byte."""
    w, w1, sh = _tq_words(words_ptr, off, ok, D // 4)
    x = _funnel(w, w1, sh)
    t = tl.join(tl.join(_fp8_byte(x, 0, DTYPE), _fp8_byte(x, 2, DTYPE)),
                tl.join(_fp8_byte(x, 1, DTYPE), _fp8_byte(x, 3, DTYPE)))
    return tl.reshape(t, [x.shape[0], D])


@triton.jit
def _tq_values(words_ptr, off, ok, lut_ptr, DV: tl.constexpr, BITS: tl.constexpr,
               DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """3- or 4-bit value codes ``[BLOCK_N, DV]`` in ``DTYPE``, plus :func:`tq_magic`, their
    columns in :func:`tq_value_column`'s order."""
    w, w1, sh = _tq_code_words(words_ptr, off, ok, DV, BITS)
    if USE_ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            VALUES4_ASM if BITS == 4 else VALUES3_ASM, "=r,=r,=r,=r,r,r,r,r",
            [w, w1, sh, tl.load(lut_ptr + 4)], (tl.uint32,) * 4, is_pure=True, pack=1)
        return _pairs_tile(p0, p1, p2, p3, DTYPE)
    x = _funnel(w, w1, sh)
    magic = tq_magic(DTYPE)
    o0 = (_code(x, 0, BITS) + magic).to(DTYPE)
    o1 = (_code(x, 4, BITS) + magic).to(DTYPE)
    o2 = (_code(x, 1, BITS) + magic).to(DTYPE)
    o3 = (_code(x, 5, BITS) + magic).to(DTYPE)
    o4 = (_code(x, 2, BITS) + magic).to(DTYPE)
    o5 = (_code(x, 6, BITS) + magic).to(DTYPE)
    o6 = (_code(x, 3, BITS) + magic).to(DTYPE)
    o7 = (_code(x, 7, BITS) + magic).to(DTYPE)
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
def _tq_scale(ptr, ok, EVEN: tl.constexpr):
    """The fp16 at byte pointers ``ptr`` in fp32 (0 past rows ``ok``): one 2-byte load where
    ``EVEN`` (the pointers are 2-byte aligned), else two byte loads."""
    if EVEN:
        return _tq_half(ptr, ok)
    return _tq_fp16(ptr, ok)


@triton.jit
def tq_tile(cache_ptr, off, ok, codebook_ptr, lut_ptr, offs_d, D: tl.constexpr,
             D_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr, KEY_BITS: tl.constexpr,
             VALUE_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr, DTYPE: tl.constexpr,
             WORDS: tl.constexpr, USE_ASM: tl.constexpr):
    """One key block of a TurboQuant cache (``backends/turboquant/format.py``) from its
    slots' byte offsets ``off`` (int64): ``(keys, key scales, values, value scales, value
    minimums)`` -- the keys in ``DTYPE``, in the rotated space (the query is rotated once) as
    codebook centroids, each key's norm (its score column's scale: no multiplication of every
    coordinate), over the centroids' norm with norm correction except for code words (the
    caller's tensor cores divide those); fp8 keys as stored, scale 1. A value is ``code * scale
    + minimum``: the caller folds the affine into its probabilities. With ``WORDS`` (a 4-byte
    aligned cache of even-sized slots, unpadded head tiles) 3- and 4-bit codes are read 8 at a
    time (:func:`_tq_code_words`), fp8 keys 4 a word, and the values come as
    :func:`_tq_values` gives them (plus :func:`tq_magic`, permuted columns)."""
    base = cache_ptr + off
    words = cache_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    if KEY_BITS == 8:
        if WORDS:
            k = _tq_fp8_keys(words, off, ok, D, DTYPE)
        else:
            k = tl.load(base[:, None] + offs_d[None, :],
                        mask=ok[:, None] & (offs_d[None, :] < D),
                        other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DTYPE)
        k_scale = tl.where(ok, 1.0, 0.0)
        vstart = D
    else:
        vstart = D * KEY_BITS // 8 + 2
        if WORDS:
            k = _tq_keys(words, off, ok, codebook_ptr, lut_ptr, D, KEY_BITS, DTYPE, USE_ASM)
            k_scale = _tq_scale(base + (vstart - 2), ok, vstart % 2 == 0)
        else:
            codes = _tq_codes(base, ok, D, D_P, KEY_BITS)
            k = tl.where(offs_d[None, :] < D, tl.load(codebook_ptr + codes), 0.0)
            k_scale = _tq_fp16(base + (vstart - 2), ok)
            if NORM_CORRECTION:
                k_scale = k_scale / tl.sqrt(tl.sum(k * k, axis=1) + 1e-16)
            k = k.to(DTYPE)
    tail = vstart + DV * VALUE_BITS // 8
    if WORDS:
        v = _tq_values(words, off + vstart, ok, lut_ptr, DV, VALUE_BITS, DTYPE, USE_ASM)
        even = tail % 2 == 0
        return (k, k_scale, v, _tq_scale(base + tail, ok, even),
                _tq_scale(base + (tail + 2), ok, even))
    v = _tq_codes(base + vstart, ok, DV, DV_P, VALUE_BITS).to(DTYPE)
    return k, k_scale, v, _tq_fp16(base + tail, ok), _tq_fp16(base + (tail + 2), ok)
