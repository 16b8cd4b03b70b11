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
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tq_codes(base, ok, n, offs, BITS: tl.constexpr):
    """Codes ``[BLOCK_N, len(offs)]`` (int32, ``0 <= c < 2^BITS``) of the LSB-first bit
    streams at byte pointers ``base [BLOCK_N]`` (rows ``ok``): column ``j`` holds code
    ``offs[j]``, 0 where that is ``n`` or more."""
    col_ok = ok[:, None] & (offs[None, :] < n)
    bit = offs * BITS
    at = base[:, None] + (bit // 8)[None, :]
    b = tl.load(at, mask=col_ok, other=0).to(tl.int32)
    if BITS == 3:  # a code from bit 6 or 7 of its byte ends in the next one
        b |= tl.load(at + 1, mask=col_ok & (bit % 8 > 5)[None, :], other=0).to(tl.int32) << 8
    return (b >> (bit % 8)[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _tq_fp16(ptr, ok):
    """The little-endian fp16 at byte pointers ``ptr`` (rows ``ok``; 0 elsewhere), in fp32:
    two byte loads (a slot's fields are only 2-byte aligned, its cache may not be)."""
    low = tl.load(ptr, mask=ok, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=ok, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def tq_tile(cache_ptr, off, ok, codebook_ptr, offs_d, offs_dv, D: tl.constexpr,
            DV: tl.constexpr, KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr,
            NORM_CORRECTION: tl.constexpr, DTYPE: tl.constexpr):
    """One key block of a TurboQuant cache (``backends/turboquant/format.py``) from its
    slots' byte offsets ``off`` (int64, rows ``ok``), tiles over the columns ``offs_d`` /
    ``offs_dv`` (0 past ``D`` / ``DV``): ``(keys, key scales, value codes, value scales,
    value minimums)`` -- the keys in ``DTYPE`` in the rotated space (the query is rotated
    once) as codebook centroids and each key's norm, over the centroids' norm with norm
    correction, as its score column's scale (no multiplication of every coordinate); fp8 keys
    as stored, scale 1. A value is ``code * scale + minimum``: the caller folds the affine
    into its probabilities."""
    base = cache_ptr + off
    if KEY_BITS == 8:
        k = tl.load(base[:, None] + offs_d[None, :], mask=ok[:, None] & (offs_d[None, :] < D),
                    other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DTYPE)
        k_scale = tl.where(ok, 1.0, 0.0)
        vstart = D
    else:
        vstart = D * KEY_BITS // 8 + 2
        codes = _tq_codes(base, ok, D, offs_d, KEY_BITS)
        k = tl.where(offs_d[None, :] < D, tl.load(codebook_ptr + codes), 0.0)
        k_scale = _tq_fp16(base + (vstart - 2), ok)
        if NORM_CORRECTION:
            k_scale = k_scale / tl.sqrt(tl.sum(k * k, axis=1) + 1e-16)
        k = k.to(DTYPE)
    tail = vstart + DV * VALUE_BITS // 8
    v = _tq_codes(base + vstart, ok, DV, offs_dv, VALUE_BITS).to(DTYPE)
    return k, k_scale, v, _tq_fp16(base + tail, ok), _tq_fp16(base + (tail + 2), ok)
