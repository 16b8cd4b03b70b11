"""DSV4_TRITON's cache writes, each one launch with no host read: the compressor's step
(gated softmax over the group, RMSNorm, interleaved RoPE, quantization and the paged write of
every entry the step completes, then the state rows) and the window tokens' entries.

An entry is handled as its even and odd channels (``[D / 2]`` each): channel pair ``i`` is
``(2i, 2i + 1)``, which is how the interleaved (GPT-J) RoPE rotates the trailing ``R`` dims.
Formats (``FORMAT``):

* 0 -- rows of the cache's dtype (``[blocks, page, D]``);
* 1 -- vLLM's 584-byte entries (``D`` 512): the vector rounded to bf16, dims 0..447 in e4m3 over
  a UE8M0 scale a group of 64 (``2^ceil(log2(max(amax, 1e-4) / 448))``), dims 448..511 bf16,
  planar in the page (data plane, then 8 scale bytes an entry);
* 2 -- the indexer's planar fp8 keys: rounded to bf16, e4m3 over one power-of-two fp32 scale.

e4m3 values are rounded by exact arithmetic (ties to even, zeros signed) so the stored bytes
are the torch cast's, on GPUs and in Triton's interpreter alike
(:func:`~attn_ops.backends.mla.indexer_kernels._round_to_e4m3`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.backends.deepseek_v4.cache import DATA_BYTES, ENTRY_BYTES, GROUP, entries_a_page
from attn_ops.backends.mla.indexer_kernels import _requests_before, _round_to_e4m3
from attn_ops.routing import pow2

__all__ = ["compress_write_triton", "entry_write_triton"]

FP8_MAX: tl.constexpr = tl.constexpr(448.0)
DATA_BYTES_C: tl.constexpr = tl.constexpr(DATA_BYTES)
SCALE_BYTES_C: tl.constexpr = tl.constexpr(ENTRY_BYTES - DATA_BYTES)
PAIRS_A_GROUP: tl.constexpr = tl.constexpr(GROUP // 2)


@triton.jit
def _e4m3(x):
    """``x`` (fp32, within +-448) as e4m3 values, ties to even, a zero keeping x's sign."""
    y = _round_to_e4m3(x)
    return tl.where(y == 0.0, x * 0.0, y).to(tl.float8e4nv)


@triton.jit
def _round_to_bf16(x):
    """``x`` (fp32, finite) rounded to the nearest bf16 value, ties to even, kept in fp32 (by
    its bits: Triton's interpreter truncates the cast)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pow2_scale(amax):
    """The power of two at or above ``max(amax, 1e-4) / 448``, as its exponent (fp32)."""
    return tl.ceil(tl.log2(tl.maximum(amax, 1e-4) / FP8_MAX))


@triton.jit
def _write_entry(ev, od, cache_ptr, block, row, stride_cb, stride_cp, pairs,
                 D: tl.constexpr, HALF_P: tl.constexpr, PAGE: tl.constexpr,
                 FORMAT: tl.constexpr):
    """Entry ``(ev, od)`` (fp32 ``[HALF_P]`` even / odd channels, ``pairs`` their index) at
    row ``row`` of page ``block`` of the cache, in its ``FORMAT``."""
    ok = pairs < D // 2
    if FORMAT == 0:
        dst = cache_ptr + block * stride_cb + row * stride_cp + 2 * pairs
        tl.store(dst, ev.to(cache_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + 1, od.to(cache_ptr.dtype.element_ty), mask=ok)
    elif FORMAT == 1:
        ev = _round_to_bf16(ev)  # (vLLM rounds the vector to bf16 first)
        od = _round_to_bf16(od)
        nope = pairs < 448 // 2
        amax = tl.where(nope, tl.maximum(tl.abs(ev), tl.abs(od)), 0.0)
        groups = tl.max(tl.reshape(amax, [HALF_P // PAIRS_A_GROUP, PAIRS_A_GROUP]), axis=1)
        exponent = _pow2_scale(groups)  # [HALF_P / 32]: 8 groups at D = 512
        per_pair = tl.reshape(tl.broadcast_to(exponent[:, None],
                                              [HALF_P // PAIRS_A_GROUP, PAIRS_A_GROUP]),
                              [HALF_P])
        inv = tl.exp2(-per_pair)
        base = cache_ptr + block * stride_cb
        data = base + row * DATA_BYTES_C
        fp8 = data.to(tl.pointer_type(tl.float8e4nv))
        x_ev = tl.minimum(tl.maximum(ev * inv, -FP8_MAX), FP8_MAX)
        x_od = tl.minimum(tl.maximum(od * inv, -FP8_MAX), FP8_MAX)
        tl.store(fp8 + 2 * pairs, _e4m3(x_ev), mask=nope)
        tl.store(fp8 + 2 * pairs + 1, _e4m3(x_od), mask=nope)
        rope = (data + 448).to(tl.pointer_type(tl.bfloat16)) + 2 * (pairs - 448 // 2)
        tl.store(rope, ev.to(tl.bfloat16), mask=ok & (pairs >= 448 // 2))
        tl.store(rope + 1, od.to(tl.bfloat16), mask=ok & (pairs >= 448 // 2))
        g = tl.arange(0, HALF_P // PAIRS_A_GROUP)
        byte = tl.where(g < 7, exponent + 127.0, 0.0).to(tl.uint8)
        tl.store(base + PAGE * DATA_BYTES_C + row * SCALE_BYTES_C + g, byte, mask=g < 8)
    else:
        ev = _round_to_bf16(ev)
        od = _round_to_bf16(od)
        amax = tl.max(tl.where(ok, tl.maximum(tl.abs(ev), tl.abs(od)), 0.0), axis=0)
        exponent = _pow2_scale(amax)
        inv = tl.exp2(-exponent)
        base = cache_ptr + block * stride_cb
        fp8 = (base + row * D).to(tl.pointer_type(tl.float8e4nv))
        tl.store(fp8 + 2 * pairs, _e4m3(tl.minimum(tl.maximum(ev * inv, -FP8_MAX), FP8_MAX)),
                 mask=ok)
        tl.store(fp8 + 2 * pairs + 1,
                 _e4m3(tl.minimum(tl.maximum(od * inv, -FP8_MAX), FP8_MAX)), mask=ok)
        tl.store((base + PAGE * D).to(tl.pointer_type(tl.float32)) + row, tl.exp2(exponent))


@triton.jit
def _group_rows(m_e, m_o, l_e, l_o, a_e, a_o, first, ctx, row0, slot_row, has_state,
                kv_ptr, gate_ptr, bias_ptr, col0, width, stride_kv, stride_g, stride_b,
                stride_sr, pairs, ok, RATIO: tl.constexpr, KEPT: tl.constexpr):
    """The rows of positions ``first .. first + RATIO - 1`` (columns ``col0 + 2i (+1)``) into
    each channel's running softmax: from the step's inputs (at or after ``ctx``), from the
    state slot (the ``KEPT`` positions before ``ctx``; ``has_state`` 0: none), else absent --
    and absent too where a value read is NaN (a state row never written)."""
    for k in range(RATIO):
        p = first + k
        # (the row's scalars spread over the channels: the interpreter takes no scalar masks)
        pv = p + pairs * 0
        step = (pv >= ctx) & (pv >= 0)  # (a corrupt length can put ctx below 0)
        kept = (pv < ctx) & (pv >= 0) & (pv >= ctx - KEPT) & ((pairs * 0 + has_state) != 0)
        src = kv_ptr + (row0 + p - ctx).to(tl.int64) * stride_kv + col0
        gsrc = gate_ptr + (row0 + p - ctx).to(tl.int64) * stride_g + col0
        bsrc = bias_ptr + (p % RATIO) * stride_b + col0
        ssrc = slot_row + (p % KEPT).to(tl.int64) * stride_sr + col0
        m_step = ok & step
        m_kept = ok & kept
        c_e = tl.where(step, tl.load(src + 2 * pairs, mask=m_step, other=0.0).to(tl.float32),
                       tl.load(ssrc + 2 * pairs, mask=m_kept, other=0.0))
        c_o = tl.where(step, tl.load(src + 2 * pairs + 1, mask=m_step,
                                     other=0.0).to(tl.float32),
                       tl.load(ssrc + 2 * pairs + 1, mask=m_kept, other=0.0))
        z_e = tl.where(step, tl.load(gsrc + 2 * pairs, mask=m_step, other=0.0).to(tl.float32)
                       + tl.load(bsrc + 2 * pairs, mask=m_step, other=0.0).to(tl.float32),
                       tl.load(ssrc + width + 2 * pairs, mask=m_kept, other=0.0))
        z_o = tl.where(step, tl.load(gsrc + 2 * pairs + 1, mask=m_step,
                                     other=0.0).to(tl.float32)
                       + tl.load(bsrc + 2 * pairs + 1, mask=m_step, other=0.0).to(tl.float32),
                       tl.load(ssrc + width + 2 * pairs + 1, mask=m_kept, other=0.0))
        total = tl.sum(tl.where(ok, c_e + c_o + z_e + z_o, 0.0), axis=0)
        # (NaN: a row never written; the scalar spread over the channels)
        present = (step | kept) & ((pairs * 0 + total) == total)
        z_e = tl.where(ok & present, z_e, float("-inf"))
        z_o = tl.where(ok & present, z_o, float("-inf"))
        c_e = tl.where(ok & present, c_e, 0.0)
        c_o = tl.where(ok & present, c_o, 0.0)
        new_e = tl.maximum(m_e, z_e)
        new_o = tl.maximum(m_o, z_o)
        safe_e = tl.where(new_e == float("-inf"), 0.0, new_e)
        safe_o = tl.where(new_o == float("-inf"), 0.0, new_o)
        alpha_e = tl.exp(m_e - safe_e)
        alpha_o = tl.exp(m_o - safe_o)
        w_e = tl.exp(z_e - safe_e)
        w_o = tl.exp(z_o - safe_o)
        l_e = l_e * alpha_e + w_e
        l_o = l_o * alpha_o + w_o
        a_e = a_e * alpha_e + w_e * c_e
        a_o = a_o * alpha_o + w_o * c_o
        m_e = new_e
        m_o = new_o
    return m_e, m_o, l_e, l_o, a_e, a_o


@triton.jit(do_not_specialize=["num_reqs", "steps", "num_slots", "cache_blocks", "cbt_width",
                               "rope_rows"])
def compress_entries_kernel(
    kv_ptr, gate_ptr, bias_ptr, state_ptr, qsl_ptr, seq_ptr, sidx_ptr, cbt_ptr, norm_ptr,
    rope_ptr, cache_ptr, num_reqs, steps, num_slots, cache_blocks, cbt_width, rope_rows, eps,
    stride_kv, stride_g, stride_b, stride_ss, stride_sr, stride_cbt, stride_rope, stride_cb,
    stride_cp,
    D: tl.constexpr, HALF_P: tl.constexpr, ROPE: tl.constexpr, RATIO: tl.constexpr,
    OVERLAP: tl.constexpr, PAGE: tl.constexpr, FORMAT: tl.constexpr,
):
    """Program ``t``: if token ``t`` completes a group (``(p + 1) % RATIO == 0``), entry ``w =
    p // RATIO`` -- its rows' per-channel softmax-weighted sum (with ``OVERLAP``, group ``w -
    1``'s A halves and group ``w``'s B halves), RMSNorm with the norm's weight, RoPE at
    position ``w * RATIO`` -- written at its compressed slot (a negative block id or one
    outside the cache: nothing, as the slot mapping)."""
    t = tl.program_id(0)
    req = tl.minimum(_requests_before(qsl_ptr, t, num_reqs, steps), num_reqs - 1)
    start = tl.load(qsl_ptr + req)
    n = tl.load(qsl_ptr + req + 1) - start
    ctx = tl.load(seq_ptr + req) - n
    pos = ctx + (t - start)
    if (t >= tl.load(qsl_ptr + num_reqs)) | (pos < 0) | ((pos + 1) % RATIO != 0):
        return
    w = pos // RATIO
    col = w // PAGE
    if col >= cbt_width:
        return
    block = tl.load(cbt_ptr + req.to(tl.int64) * stride_cbt + col).to(tl.int64)
    if (block < 0) | (block >= cache_blocks):
        return
    slot = tl.load(sidx_ptr + req).to(tl.int64)
    has_state = ((slot >= 0) & (slot < num_slots) & (ctx > 0)).to(tl.int32)
    slot_row = state_ptr + tl.where(has_state != 0, slot, 0) * stride_ss
    width = (2 if OVERLAP else 1) * D
    kept = (2 if OVERLAP else 1) * RATIO
    pairs = tl.arange(0, HALF_P)
    ok = pairs < D // 2
    m_e = tl.full([HALF_P], float("-inf"), tl.float32)
    m_o = tl.full([HALF_P], float("-inf"), tl.float32)
    l_e = tl.zeros([HALF_P], tl.float32)
    l_o = tl.zeros([HALF_P], tl.float32)
    a_e = tl.zeros([HALF_P], tl.float32)
    a_o = tl.zeros([HALF_P], tl.float32)
    if OVERLAP:  # group w - 1's A halves (none for w = 0: their positions are negative)
        m_e, m_o, l_e, l_o, a_e, a_o = _group_rows(
            m_e, m_o, l_e, l_o, a_e, a_o, w * RATIO - RATIO, ctx, start, slot_row, has_state,
            kv_ptr, gate_ptr, bias_ptr, 0, width, stride_kv, stride_g, stride_b, stride_sr,
            pairs, ok, RATIO, kept)
    m_e, m_o, l_e, l_o, a_e, a_o = _group_rows(
        m_e, m_o, l_e, l_o, a_e, a_o, w * RATIO, ctx, start, slot_row, has_state, kv_ptr,
        gate_ptr, bias_ptr, D if OVERLAP else 0, width, stride_kv, stride_g, stride_b,
        stride_sr, pairs, ok, RATIO, kept)
    ev = tl.where(ok, a_e / tl.where(l_e > 0, l_e, 1.0), 0.0)
    od = tl.where(ok, a_o / tl.where(l_o > 0, l_o, 1.0), 0.0)
    rms = tl.rsqrt((tl.sum(ev * ev, axis=0) + tl.sum(od * od, axis=0)) / D + eps)
    ev = ev * rms * tl.load(norm_ptr + 2 * pairs, mask=ok, other=0.0).to(tl.float32)
    od = od * rms * tl.load(norm_ptr + 2 * pairs + 1, mask=ok, other=0.0).to(tl.float32)
    j = pairs - (D - ROPE) // 2  # (the trailing ROPE / 2 pairs rotate)
    rot = ok & (j >= 0)
    angles = rope_ptr + tl.minimum(w * RATIO, rope_rows - 1).to(tl.int64) * stride_rope
    cos = tl.load(angles + j, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(angles + ROPE // 2 + j, mask=rot, other=0.0).to(tl.float32)
    ev, od = ev * cos - od * sin, od * cos + ev * sin
    _write_entry(ev, od, cache_ptr, block, w % PAGE, stride_cb, stride_cp, pairs, D, HALF_P,
                 PAGE, FORMAT)


@triton.jit(do_not_specialize=["num_reqs", "steps", "num_slots"])
def compress_state_kernel(kv_ptr, gate_ptr, bias_ptr, state_ptr, qsl_ptr, seq_ptr, sidx_ptr,
                          num_reqs, steps, num_slots, stride_kv, stride_g, stride_b,
                          stride_ss, stride_sr, WIDTH: tl.constexpr, WIDTH_P: tl.constexpr,
                          RATIO: tl.constexpr, KEPT: tl.constexpr):
    """Program ``t``: a token among its request's last ``KEPT`` stores its row ``[c | z + B]``
    at row ``p % KEPT`` of the request's state slot (after the entries read it)."""
    t = tl.program_id(0)
    req = tl.minimum(_requests_before(qsl_ptr, t, num_reqs, steps), num_reqs - 1)
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    total = tl.load(seq_ptr + req)
    pos = total - (end - start) + (t - start)
    slot = tl.load(sidx_ptr + req).to(tl.int64)
    if (t >= tl.load(qsl_ptr + num_reqs)) | (pos < 0) | (pos < total - KEPT) | (slot < 0) \
            | (slot >= num_slots):
        return
    cols = tl.arange(0, WIDTH_P)
    ok = cols < WIDTH
    t64 = t.to(tl.int64)
    c = tl.load(kv_ptr + t64 * stride_kv + cols, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(gate_ptr + t64 * stride_g + cols, mask=ok, other=0.0).to(tl.float32) + \
        tl.load(bias_ptr + (pos % RATIO) * stride_b + cols, mask=ok, other=0.0).to(tl.float32)
    dst = state_ptr + slot * stride_ss + (pos % KEPT).to(tl.int64) * stride_sr
    tl.store(dst + cols, c, mask=ok)
    tl.store(dst + WIDTH + cols, z, mask=ok)


def _format(cache: torch.Tensor, d: int, index: bool) -> tuple[int, int, int, int]:
    """``(FORMAT, entries a page, page stride, row stride)`` of a cache."""
    page = entries_a_page(cache, d if index else 0)
    if cache.dtype != torch.uint8:
        return 0, page, cache.stride(0), cache.stride(1)
    return (2, page, cache.stride(0), d) if index else (1, page, cache.stride(0), ENTRY_BYTES)


def compress_write_triton(kv, gate, bias, state, query_start_loc, seq_lens, state_indices,
                          block_table, ratio: int, overlap: bool, norm_weight, eps: float,
                          rope_table, cache, index: bool = False) -> None:
    """One compressor step into ``cache`` and ``state`` in two launches (inputs checked):
    the entries the step completes, then the state rows (the torch form:
    :func:`~attn_ops.backends.deepseek_v4.compressor.compress_into_cache`)."""
    t, width = kv.shape
    if t == 0:
        return
    d = width // (2 if overlap else 1)
    fmt, page, stride_cb, stride_cp = _format(cache, d, index)
    b = seq_lens.shape[0]
    steps = max(1, b.bit_length())
    kept = (2 if overlap else 1) * ratio
    compress_entries_kernel[(t,)](
        kv, gate, bias, state, query_start_loc, seq_lens, state_indices, block_table,
        norm_weight, rope_table, cache, b, steps, state.shape[0], cache.shape[0],
        block_table.shape[1], rope_table.shape[0], eps, kv.stride(0), gate.stride(0),
        bias.stride(0), state.stride(0), state.stride(1), block_table.stride(0),
        rope_table.stride(0), stride_cb, stride_cp, D=d, HALF_P=pow2(d // 2, 32),
        ROPE=rope_table.shape[1], RATIO=ratio, OVERLAP=overlap, PAGE=page, FORMAT=fmt,
        num_warps=4)
    compress_state_kernel[(t,)](
        kv, gate, bias, state, query_start_loc, seq_lens, state_indices, b, steps,
        state.shape[0], kv.stride(0), gate.stride(0), bias.stride(0), state.stride(0),
        state.stride(1), WIDTH=width, WIDTH_P=pow2(width), RATIO=ratio, KEPT=kept,
        num_warps=4)


@triton.jit
def entry_write_kernel(x_ptr, slot_ptr, cache_ptr, capacity, stride_x, stride_cb, stride_cp,
                       D: tl.constexpr, HALF_P: tl.constexpr, PAGE: tl.constexpr,
                       FORMAT: tl.constexpr):
    """Program ``t``: row ``t`` at its slot (-1 or outside the ``capacity`` slots: none)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= capacity):
        return
    pairs = tl.arange(0, HALF_P)
    ok = pairs < D // 2
    ev = tl.load(x_ptr + t * stride_x + 2 * pairs, mask=ok, other=0.0).to(tl.float32)
    od = tl.load(x_ptr + t * stride_x + 2 * pairs + 1, mask=ok, other=0.0).to(tl.float32)
    _write_entry(ev, od, cache_ptr, slot // PAGE, slot % PAGE, stride_cb, stride_cp, pairs, D,
                 HALF_P, PAGE, FORMAT)


def entry_write_triton(x, cache, slot_mapping, index: bool = False) -> None:
    """Rows ``x [T, D]`` at ``slot_mapping`` in one launch, no host read (inputs checked): the
    window tokens' write (:func:`~attn_ops.backends.deepseek_v4.cache.entry_write`'s
    kernel; ``index``: :func:`~attn_ops.backends.deepseek_v4.cache.index_write`'s)."""
    t, d = x.shape
    if t == 0:
        return
    fmt, page, stride_cb, stride_cp = _format(cache, d, index)
    entry_write_kernel[(t,)](x, slot_mapping, cache, cache.shape[0] * page, x.stride(0),
                             stride_cb, stride_cp, D=d, HALF_P=pow2(d // 2, 32), PAGE=page,
                             FORMAT=fmt, num_warps=4)
