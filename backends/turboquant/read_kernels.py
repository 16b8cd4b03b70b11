"""TurboQuant slots read in TRITON_ATTN's attention kernel (``KV_FORMAT=1`` in
``backends/triton_attn_kernels.py``): a key block's keys, their score scales and its values
from the slots' bytes (``format.py``), dequantized in registers.

Each element of the ``[keys, head dim]`` tiles is read from its own byte (and the next one, for
a 3-bit code that crosses a byte boundary): the tiles are built from 2-D gathers whose
neighbouring elements share bytes (L1 hits), never assembled from narrower tensors with
``tl.join`` / ``tl.reshape``. Triton 3.6 miscompiles such an assembled tile when it feeds an
sm_90 tensor-core product (wrong codes: errors of order 1, NaN outputs and codebook reads out
of bounds; on other shapes its ``TritonGPUOptimizeDotOperands`` pass aborts), while the
interpreter computes it right.

With ``PLANES`` (``Tuning.triton.turboquant_planes``) 4-bit fields are read as contiguous
bytes instead, their low and high nibbles two tiles -- the even and the odd coordinates --
each its own tensor-core product (the query's columns and the output's split alike): no
per-coordinate byte gather, and still no assembled tile. With ``COALESCED``
(``Tuning.triton.turboquant_coalesced``) the gathers are built transposed, so a warp's lanes
run along a slot's bytes rather than across 32 slots. Both take the centroids' norms from the
tensor cores.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sylvester_signs(rows, cols, D: tl.constexpr):
    """Sylvester's Hadamard matrix times ``sqrt(D)`` at ``[rows, cols]`` (0 outside ``D x D``):
    ``(-1)^popcount(i & j)``, the parity folded in registers -- no ``[D, D]`` table loaded by
    every program."""
    tl.static_assert(D <= 1 << 16)
    x = rows[:, None] & cols[None, :]
    x ^= x >> 8
    x ^= x >> 4
    x ^= x >> 2
    x ^= x >> 1
    signs = 1.0 - 2.0 * (x & 1).to(tl.float32)
    return tl.where((rows[:, None] < D) & (cols[None, :] < D), signs, 0.0)


@triton.jit
def _tq_codes(base, ok, n, offs, BITS: tl.constexpr):
    """Codes ``[BLOCK_N, len(offs)]`` (int32, ``0 <= c < 2^BITS``) of the LSB-first bit
    streams at byte pointers ``base [BLOCK_N]`` (keys ``ok``): column ``j`` holds code
    ``offs[j]``, 0 where that is ``n`` or more. (Triton lays a warp's lanes along the keys:
    each load touches 32 slots; :func:`_tq_codes_t` lays them along a slot's bytes.)"""
    col_ok = ok[:, None] & (offs[None, :] < n)
    bit = offs * BITS
    at = base[:, None] + (bit // 8)[None, :]
    b = tl.load(at, mask=col_ok, other=0).to(tl.int32)
    if BITS == 3:  # a code from bit 6 or 7 of its byte ends in the next one
        b |= tl.load(at + 1, mask=col_ok & (bit % 8 > 5)[None, :], other=0).to(tl.int32) << 8
    return (b >> (bit % 8)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _tq_codes_t(base, ok, n, offs, BITS: tl.constexpr):
    """Codes ``[len(offs), BLOCK_N]`` (int32, ``0 <= c < 2^BITS``; transposed: a key a
    column) of the LSB-first bit streams at byte pointers ``base [BLOCK_N]`` (keys ``ok``):
    row ``j`` holds code ``offs[j]``, 0 where that is ``n`` or more. Built with the coordinates
    along the first axis: neither axis of the gather is contiguous, and Triton then lays a
    warp's lanes along the first -- here along a slot's bytes (one cache line a load), not
    across 32 slots."""
    row_ok = (offs[:, None] < n) & ok[None, :]
    bit = offs * BITS
    at = base[None, :] + (bit // 8)[:, None]
    b = tl.load(at, mask=row_ok, other=0).to(tl.int32)
    if BITS == 3:  # a code from bit 6 or 7 of its byte ends in the next one
        b |= tl.load(at + 1, mask=row_ok & (bit % 8 > 5)[:, None], other=0).to(tl.int32) << 8
    return (b >> (bit % 8)[:, None]) & ((1 << BITS) - 1)


@triton.jit
def _tq_nibbles(base, ok, offs, n):
    """The low and the high nibbles (int32 ``[BLOCK_N, len(offs)]``, 0 where ``offs >= n``) of
    the bytes ``offs`` from byte pointers ``base [BLOCK_N]`` (keys ``ok``), read contiguously:
    a 4-bit field's even and odd codes."""
    col_ok = offs[None, :] < n
    raw = tl.load(base[:, None] + offs[None, :], mask=ok[:, None] & col_ok,
                  other=0).to(tl.int32)
    return raw & 15, raw >> 4


@triton.jit
def _tq_fp16(ptr, ok):
    """The little-endian fp16 at byte pointers ``ptr`` (rows ``ok``; 0 elsewhere), in fp32:
    two byte loads (a slot's fields are only 2-byte aligned, its cache may not be)."""
    low = tl.load(ptr, mask=ok, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=ok, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def tq_keys(cache_ptr, off, ok, codebook_ptr, offs, D: tl.constexpr, KEY_BITS: tl.constexpr,
            NORM_CORRECTION: tl.constexpr, PLANES: tl.constexpr, COALESCED: tl.constexpr,
            DTYPE: tl.constexpr):
    """A key block of a TurboQuant cache (``backends/turboquant/format.py``) from its slots'
    byte offsets ``off`` (int64, keys ``ok``): ``(keys, odd keys, key scales)``, the keys
    transposed (``[coordinates, BLOCK_N]``, the product's right operand) in ``DTYPE``, in the
    rotated space (the query is rotated once) as codebook centroids, over the coordinates
    ``offs`` (0 past ``D``); fp8 keys as stored. Each key's scale is its stored norm (1 for
    fp8 keys), over the centroids' norm with ``NORM_CORRECTION``: its score column's factor,
    no multiplication of every coordinate. ``COALESCED`` (and ``PLANES``): the codes gathered
    with a warp's lanes along a slot's bytes (:func:`_tq_codes_t`), and the centroids' norm
    left to the caller (its tensor cores: a sum over coordinates here would cross lanes).
    ``PLANES`` (4-bit keys): ``offs`` are the field's bytes, read contiguously, and the two
    tiles hold the even and the odd coordinates (each a byte's low and high nibble; the query
    is split alike); else the odd tile is the first."""
    base = cache_ptr + off
    if KEY_BITS == 8:
        k = tl.load(base[:, None] + offs[None, :], mask=ok[:, None] & (offs[None, :] < D),
                    other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DTYPE)
        return tl.trans(k), tl.trans(k), tl.where(ok, 1.0, 0.0)
    k_scale = _tq_fp16(base + (D * KEY_BITS // 8), ok)
    if PLANES:
        low, high = _tq_nibbles(base, ok, offs, D // 2)
        col_ok = offs[None, :] < D // 2
        k = tl.trans(tl.where(col_ok, tl.load(codebook_ptr + low), 0.0))
        k2 = tl.trans(tl.where(col_ok, tl.load(codebook_ptr + high), 0.0))
    elif COALESCED:
        codes = _tq_codes_t(base, ok, D, offs, KEY_BITS)
        k = tl.where(offs[:, None] < D, tl.load(codebook_ptr + codes), 0.0)
        k2 = k
    else:
        codes = _tq_codes(base, ok, D, offs, KEY_BITS)
        k = tl.where(offs[None, :] < D, tl.load(codebook_ptr + codes), 0.0)
        if NORM_CORRECTION:
            k_scale = k_scale / tl.sqrt(tl.sum(k * k, axis=1) + 1e-16)
        k = tl.trans(k)
        k2 = k
    return k.to(DTYPE), k2.to(DTYPE), k_scale


@triton.jit
def tq_values(cache_ptr, off, ok, offs, D: tl.constexpr, DV: tl.constexpr,
              KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr, PLANES: tl.constexpr,
              COALESCED: tl.constexpr, DTYPE: tl.constexpr):
    """A key block's values from the same slots: ``(codes, odd codes, scales, minimums)``,
    the codes in ``DTYPE`` over the columns ``offs`` (0 past ``DV``); a value is ``code *
    scale + minimum`` (the caller folds the affine into its probabilities). ``PLANES`` (4-bit
    values): ``offs`` are the field's bytes and the tiles hold the even and the odd
    coordinates, as :func:`tq_keys`'s; ``COALESCED`` as there."""
    vstart = D if KEY_BITS == 8 else D * KEY_BITS // 8 + 2
    base = cache_ptr + off + vstart
    # (codes to DTYPE through fp32: the GPU converts so anyway, and Triton's interpreter turns
    # an int32 straight into bf16 bits)
    if PLANES:
        low, high = _tq_nibbles(base, ok, offs, DV // 2)
        v = low.to(tl.float32).to(DTYPE)
        v2 = high.to(tl.float32).to(DTYPE)
    else:
        if COALESCED:
            v = tl.trans(_tq_codes_t(base, ok, DV, offs, VALUE_BITS))
        else:
            v = _tq_codes(base, ok, DV, offs, VALUE_BITS)
        v = v.to(tl.float32).to(DTYPE)
        v2 = v
    tail = DV * VALUE_BITS // 8
    return v, v2, _tq_fp16(base + tail, ok), _tq_fp16(base + (tail + 2), ok)
