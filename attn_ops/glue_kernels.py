"""The KV-cache writes on GPUs: ``torch.ops.attn.kv_cache_update`` (:func:`kv_write_kernel`) and
the fused glue op, RoPE of query and key, the slot computation and the write in one Triton
launch (``torch.ops.attn.rope_kv_cache_update``, :func:`rope_kv_write_kernel`).

One program per token: it finds the token's cache slot -- read from ``slot_mapping``, or
computed from its position, its request (binary search over ``query_start_loc``) and the block
table -- and, unless the token is padding (slot -1, or a row past ``query_start_loc[-1]``),
writes the (rotated) key and the value there, quantized to an fp8 cache with the per-tensor
scales (``x / scale`` saturated). No host reads: capturable in CUDA graphs.

Slots, positions and block ids arrive on the device and are never trusted: a slot outside the
cache, a position past the block-table row or a block id outside the cache makes the token
padding -- nothing written, no page tail cleared -- for a comparison per token, no host sync.

Requests are isolated: the token that writes row 0 of a page -- a request entering a page,
which may hold anything an earlier request left there, NaN included -- also zeroes the rows of
that page this call does not write (:func:`_clear_page_tail`), so a page's unused tail is always
finite and ``P = 0`` times it is 0 in every kernel. The rows this call writes are the
following tokens' (a request's new tokens are consecutive in the batch, in position order), so
no program zeroes a row another one writes.

On the CPU it runs in Triton's interpreter (``TRITON_INTERPRET=1``), which is how CPU CI
checks it against the torch implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.kv_cache import FP8_MAX, split_kv_cache
from attn_ops.routing import cdiv, pow2


@triton.jit
def _rotate(ptr, stride_h, offs_h, offs_d, cos, sin, mask, HALF: tl.constexpr):
    """Rotate-half of the rows at ``ptr`` in ``cos``'s precision."""
    x1 = tl.load(ptr + offs_h[:, None] * stride_h + offs_d[None, :], mask=mask, other=0.0)
    x2 = tl.load(ptr + offs_h[:, None] * stride_h + HALF + offs_d[None, :], mask=mask, other=0.0)
    x1, x2 = x1.to(cos.dtype), x2.to(cos.dtype)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _quantize(x, scale_ptr, FP8: tl.constexpr, FP8_LIMIT: tl.constexpr):
    if FP8:
        x = x / tl.load(scale_ptr).to(tl.float32)
        x = tl.minimum(tl.maximum(x, -FP8_LIMIT), FP8_LIMIT)
    return x


@triton.jit
def _copy_row(src_ptr, stride_sh, dst_ptr, stride_dh, offs_h, offs_d, mask, scale_ptr,
              FP8: tl.constexpr, FP8_LIMIT: tl.constexpr):
    """Copy one token's [heads, dim] row into the cache row at ``dst_ptr`` (fp8: quantized)."""
    x = tl.load(src_ptr + offs_h[:, None] * stride_sh + offs_d[None, :], mask=mask, other=0.0)
    if FP8:
        x = _quantize(x.to(tl.float32), scale_ptr, FP8, FP8_LIMIT)
    tl.store(dst_ptr + offs_h[:, None] * stride_dh + offs_d[None, :],
             x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _clear_page_tail(kc_ptr, vc_ptr, page, t, slot, pos, end, slot_ptr, pos_ptr,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     block_size, HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                     HAS_SLOTS: tl.constexpr, CLEAR_ROWS: tl.constexpr, RB: tl.constexpr,
                     FK: tl.constexpr, FV: tl.constexpr):
    """Zero the rows of ``page`` in this program's share (rows ``[c * CLEAR_ROWS, (c + 1) *
    CLEAR_ROWS)`` for grid column ``c``, row 0 excluded) that no token of this call writes;
    called for token ``t``, which writes row 0. Token ``t + j`` writes row ``j`` if its slot is
    ``slot + j`` (or, without slots, its position is ``pos + j`` and it is of the same request,
    before row ``end``). A page's rows are spread over the grid's second axis, and each
    program stores whole [rows, heads x dim] tiles, so clearing a page costs about what
    writing it does, not a row-by-row loop (``RB`` rows per store; ``FK``/``FV``: heads x
    dim of K/V to a power of two)."""
    fk = tl.arange(0, FK)
    fv = tl.arange(0, FV)
    k_off = (fk // D) * stride_kch + fk % D
    v_off = (fv // DV) * stride_vch + fv % DV
    first = tl.program_id(1) * CLEAR_ROWS
    for r0 in range(first, first + CLEAR_ROWS, RB):
        j = r0 + tl.arange(0, RB)
        mine = (j >= 1) & (j < block_size) & (j < first + CLEAR_ROWS)
        inside = mine & (t + j < end)
        if HAS_SLOTS:
            written = tl.load(slot_ptr + t + j, mask=inside, other=-1).to(tl.int64) == slot + j
        else:
            written = tl.load(pos_ptr + t + j, mask=inside, other=-1).to(tl.int64) == pos + j
        clear = mine & ~(written & inside)
        tl.store(kc_ptr + page * stride_kcb + j[:, None] * stride_kcs + k_off[None, :],
                 tl.zeros([RB, FK], dtype=kc_ptr.dtype.element_ty),
                 mask=clear[:, None] & (fk < HKV * D)[None, :])
        tl.store(vc_ptr + page * stride_vcb + j[:, None] * stride_vcs + v_off[None, :],
                 tl.zeros([RB, FV], dtype=vc_ptr.dtype.element_ty),
                 mask=clear[:, None] & (fv < HKV * DV)[None, :])


def _clear_meta(num_tokens: int, block_size: int, k_row: int, v_row: int) -> tuple[tuple, dict]:
    """The write kernels' grid and clearing constants: a program per token, and per token as
    many programs as it takes to clear a page in shares of at most 32 rows (all but column 0
    exit at once unless their token enters a page), each storing tiles of about 4096 values
    (``k_row``/``v_row``: values in a K/V cache row)."""
    columns = cdiv(block_size, 32)
    rows = pow2(cdiv(block_size, columns))
    fk, fv = pow2(k_row), pow2(v_row)
    tile_rows = min(rows, max(1, 4096 // max(fk, fv)))
    return (num_tokens, columns), dict(CLEAR_ROWS=rows, RB=tile_rows, FK=fk, FV=fv)


@triton.jit(do_not_specialize=["num_slots"])
def kv_write_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, num_tokens, block_size,
        num_slots, stride_kt, stride_kh, stride_vt, stride_vh, stride_kcb, stride_kcs,
        stride_kch, stride_vcb, stride_vcs, stride_vch,
        HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_HKV: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, FP8: tl.constexpr,
        FP8_LIMIT: tl.constexpr, CLEAR_ROWS: tl.constexpr, RB: tl.constexpr,
        FK: tl.constexpr, FV: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)  # (outside the cache: skipped like -1)
    page = slot // block_size
    row = slot % block_size
    if ok & (row == 0):
        _clear_page_tail(kc_ptr, vc_ptr, page, t, slot, slot, num_tokens, slot_ptr, slot_ptr,
                         stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                         block_size, HKV, D, DV, True, CLEAR_ROWS, RB, FK, FV)
    if ok & (tl.program_id(1) == 0):
        offs_h = tl.arange(0, BLOCK_HKV)
        offs_d = tl.arange(0, BLOCK_D)
        k_ok = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
        _copy_row(k_ptr + t * stride_kt, stride_kh, kc_ptr + page * stride_kcb + row * stride_kcs,
                  stride_kch, offs_h, offs_d, k_ok, ks_ptr, FP8, FP8_LIMIT)
        offs_dv = tl.arange(0, BLOCK_DV)
        v_ok = (offs_h[:, None] < HKV) & (offs_dv[None, :] < DV)
        _copy_row(v_ptr + t * stride_vt, stride_vh, vc_ptr + page * stride_vcb + row * stride_vcs,
                  stride_vch, offs_h, offs_dv, v_ok, vs_ptr, FP8, FP8_LIMIT)


def kv_cache_update_triton(key, value, k_cache, v_cache, slots, k_scale, v_scale) -> None:
    """Launch :func:`kv_write_kernel` (inputs already checked by the op)."""
    key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
    t, hkv, d = key.shape
    if t == 0:
        return
    dv = value.shape[2]
    fp8 = k_cache.dtype in FP8_MAX
    grid, clear = _clear_meta(t, k_cache.shape[1], hkv * d, hkv * dv)
    kv_write_kernel[grid](
        key, value, k_cache, v_cache, slots, k_scale if fp8 else key, v_scale if fp8 else key,
        t, k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1], key.stride(0),
        key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2),
        HKV=hkv, D=d, DV=dv, BLOCK_HKV=pow2(hkv),
        BLOCK_D=pow2(d), BLOCK_DV=pow2(dv), FP8=fp8,
        FP8_LIMIT=FP8_MAX.get(k_cache.dtype, 0.0), **clear,
        num_warps=4 if hkv * d >= 2048 else 1)


@triton.jit(do_not_specialize=["num_pages", "bt_width"])
def rope_kv_write_kernel(
        q_ptr, k_ptr, v_ptr, cs_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, qsl_ptr,
        bt_ptr, ks_ptr, vs_ptr, num_reqs, num_tokens, block_size, num_pages, bt_width,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
        stride_ot, stride_oh, stride_kot, stride_koh, stride_kcb, stride_kcs, stride_kch,
        stride_vcb, stride_vcs, stride_vch, stride_bt,
        HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, DV: tl.constexpr,
        NOPE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
        BLOCK_HALF: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_NOPE: tl.constexpr,
        HAS_SLOTS: tl.constexpr, KEY_OUT: tl.constexpr, FP8: tl.constexpr,
        FP8_LIMIT: tl.constexpr, CLEAR_ROWS: tl.constexpr, RB: tl.constexpr,
        FK: tl.constexpr, FV: tl.constexpr, ACC: tl.constexpr):
    t = tl.program_id(0)
    first_column = tl.program_id(1) == 0
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        slot = tl.where((slot >= 0) & (slot < num_pages.to(tl.int64) * block_size), slot, -1)
        enters = (slot >= 0) & (slot % block_size == 0)
    else:
        real = t < tl.load(qsl_ptr + num_reqs)  # (padding rows' positions are not read)
        pos = tl.load(pos_ptr + t, mask=real, other=1).to(tl.int64)
        enters = real & (pos % block_size == 0)
        slot = pos * 0 - 1  # (defined before the branch that sets it: compiled Triton needs it)
    if first_column | enters:
        if not HAS_SLOTS:  # the token's request: the largest r with query_start_loc[r] <= t
            lo = num_reqs * 0
            hi = num_reqs
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if tl.load(qsl_ptr + mid) <= t:
                    lo = mid
                else:
                    hi = mid
            # (a position past the table's row, or a block id outside the cache: padding)
            col = pos // block_size
            in_row = real & (pos >= 0) & (col < bt_width)
            block = tl.load(bt_ptr + lo * stride_bt + col, mask=in_row, other=-1).to(tl.int64)
            ok = in_row & (block >= 0) & (block < num_pages)
            slot = tl.where(ok, block * block_size + pos % block_size, -1)
        page = slot // block_size
        if enters & (slot >= 0):
            if HAS_SLOTS:
                _clear_page_tail(kc_ptr, vc_ptr, page, t, slot, slot, num_tokens, slot_ptr,
                                 slot_ptr, stride_kcb, stride_kcs, stride_kch, stride_vcb,
                                 stride_vcs, stride_vch, block_size, HKV, 2 * HALF, DV, True,
                                 CLEAR_ROWS, RB, FK, FV)
            else:
                end = tl.minimum(tl.load(qsl_ptr + lo + 1), num_tokens)
                _clear_page_tail(kc_ptr, vc_ptr, page, t, slot, pos, end, slot_ptr, pos_ptr,
                                 stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
                                 stride_vch, block_size, HKV, 2 * HALF, DV, False, CLEAR_ROWS,
                                 RB, FK, FV)
    if first_column:
        _rope_and_write(q_ptr, k_ptr, v_ptr, cs_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, ks_ptr,
                        vs_ptr, t, slot, block_size, stride_qt, stride_qh, stride_kt, stride_kh,
                        stride_vt, stride_vh, stride_cs, stride_ot, stride_oh, stride_kot,
                        stride_koh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
                        stride_vch, HQ, HKV, HALF, DV, NOPE, BLOCK_HQ, BLOCK_HKV, BLOCK_HALF,
                        BLOCK_DV, BLOCK_NOPE, KEY_OUT, FP8, FP8_LIMIT, ACC)


@triton.jit
def _rope_and_write(q_ptr, k_ptr, v_ptr, cs_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                    t, slot, block_size, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                    stride_vh, stride_cs, stride_ot, stride_oh, stride_kot, stride_koh,
                    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, DV: tl.constexpr,
                    NOPE: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_NOPE: tl.constexpr,
                    KEY_OUT: tl.constexpr, FP8: tl.constexpr, FP8_LIMIT: tl.constexpr,
                    ACC: tl.constexpr):
    """Token ``t``'s query with its dims past the first ``NOPE`` rotated (those passed
    through), its rotated key (also to ``ko`` with ``KEY_OUT``), and key and value written at
    ``slot`` (none for -1). The rotation runs in ``ACC`` (fp32; fp64 for fp64 inputs, whose
    results must not round to fp32)."""
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    cos = tl.load(cs_ptr + t * stride_cs + offs_d, mask=d_ok, other=0.0).to(ACC)[None, :]
    sin = tl.load(cs_ptr + t * stride_cs + HALF + offs_d, mask=d_ok, other=0.0).to(ACC)[None, :]
    offs_hq = tl.arange(0, BLOCK_HQ)
    if NOPE > 0:
        offs_n = tl.arange(0, BLOCK_NOPE)
        n_ok = (offs_hq[:, None] < HQ) & (offs_n[None, :] < NOPE)
        x = tl.load(q_ptr + t * stride_qt + offs_hq[:, None] * stride_qh + offs_n[None, :],
                    mask=n_ok, other=0.0)
        tl.store(qo_ptr + t * stride_ot + offs_hq[:, None] * stride_oh + offs_n[None, :],
                 x.to(qo_ptr.dtype.element_ty), mask=n_ok)
    q_ok = (offs_hq[:, None] < HQ) & d_ok[None, :]
    r1, r2 = _rotate(q_ptr + t * stride_qt + NOPE, stride_qh, offs_hq, offs_d, cos, sin, q_ok,
                     HALF)
    out = qo_ptr + t * stride_ot + NOPE + offs_hq[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, r1.to(qo_ptr.dtype.element_ty), mask=q_ok)
    tl.store(out + HALF, r2.to(qo_ptr.dtype.element_ty), mask=q_ok)
    offs_hk = tl.arange(0, BLOCK_HKV)
    k_ok = (offs_hk[:, None] < HKV) & d_ok[None, :]
    # (rotated once, before both uses: a name set inside one branch is lost to compiled Triton)
    k1, k2 = _rotate(k_ptr + t * stride_kt, stride_kh, offs_hk, offs_d, cos, sin, k_ok, HALF)
    if KEY_OUT:
        key_out = ko_ptr + t * stride_kot + offs_hk[:, None] * stride_koh + offs_d[None, :]
        tl.store(key_out, k1.to(ko_ptr.dtype.element_ty), mask=k_ok)
        tl.store(key_out + HALF, k2.to(ko_ptr.dtype.element_ty), mask=k_ok)
    if slot >= 0:
        page = slot // block_size
        row = slot % block_size
        dst = kc_ptr + page * stride_kcb + row * stride_kcs + offs_hk[:, None] * stride_kch \
            + offs_d[None, :]
        tl.store(dst, _quantize(k1, ks_ptr, FP8, FP8_LIMIT).to(kc_ptr.dtype.element_ty),
                 mask=k_ok)
        tl.store(dst + HALF, _quantize(k2, ks_ptr, FP8, FP8_LIMIT).to(kc_ptr.dtype.element_ty),
                 mask=k_ok)
        offs_dv = tl.arange(0, BLOCK_DV)
        v_ok = (offs_hk[:, None] < HKV) & (offs_dv[None, :] < DV)
        _copy_row(v_ptr + t * stride_vt, stride_vh, vc_ptr + page * stride_vcb + row * stride_vcs,
                  stride_vch, offs_hk, offs_dv, v_ok, vs_ptr, FP8, FP8_LIMIT)


def rope_kv_cache_update_triton(query, key, value, cos_sin, kv_cache, slots, positions,
                                query_start_loc, block_table, k_scale, v_scale) -> torch.Tensor:
    """Launch :func:`rope_kv_write_kernel`; returns the rotated query (inputs already checked
    by the op)."""
    k_cache, v_cache = split_kv_cache(kv_cache, key.shape[2], value.shape[2])
    return rope_write_paged(query, key, value, cos_sin, k_cache, v_cache, slots, positions,
                            query_start_loc, block_table, k_scale, v_scale)[0]


def rope_write_paged(query, key, value, cos_sin, k_cache, v_cache, slots, positions,
                     query_start_loc, block_table, k_scale, v_scale, *, nope: int = 0,
                     key_out: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch of :func:`rope_kv_write_kernel` over paged views ``k_cache`` / ``v_cache``
    ``[blocks, page, heads, dim]`` (any strides; :func:`attn_ops.kv_cache.write_paged`'s
    views): the query with its first ``nope`` dims passed through and the rest rotated (an MLA
    query's rope part), the key rotated in full and, with ``key_out``, returned too (else
    None)."""
    query, key, value, cos_sin = (x if x.stride(-1) == 1 else x.contiguous()
                                  for x in (query, key, value, cos_sin))
    q_out = torch.empty_like(query)
    k_out = torch.empty_like(key) if key_out else None
    t, hq, d = query.shape
    rot = d - nope
    if t == 0:
        return q_out, k_out
    hkv, dv = key.shape[1], value.shape[2]
    fp8 = k_cache.dtype in FP8_MAX
    has_slots = slots is not None
    dummy = q_out  # (never read: its flag is off)
    ko = k_out if key_out else dummy
    table = block_table if block_table is not None else dummy
    grid, clear = _clear_meta(t, k_cache.shape[1], hkv * rot, hkv * dv)
    rope_kv_write_kernel[grid](
        query, key, value, cos_sin, q_out, ko, k_cache, v_cache,
        slots if has_slots else dummy, positions if positions is not None else dummy,
        query_start_loc if query_start_loc is not None else dummy, table,
        k_scale if fp8 else dummy, v_scale if fp8 else dummy,
        0 if has_slots else block_table.shape[0], t, k_cache.shape[1], k_cache.shape[0],
        table.shape[1] if table.dim() == 2 else 0, query.stride(0), query.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), cos_sin.stride(0),
        q_out.stride(0), q_out.stride(1), ko.stride(0), ko.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table.stride(0),
        HQ=hq, HKV=hkv, HALF=rot // 2, DV=dv, NOPE=nope, BLOCK_HQ=pow2(hq),
        BLOCK_HKV=pow2(hkv), BLOCK_HALF=pow2(rot // 2),
        BLOCK_DV=pow2(dv), BLOCK_NOPE=pow2(max(nope, 1)),
        HAS_SLOTS=has_slots, KEY_OUT=key_out, FP8=fp8,
        FP8_LIMIT=FP8_MAX.get(k_cache.dtype, 0.0), **clear,
        ACC=tl.float64 if query.dtype == torch.float64 else tl.float32,
        num_warps=4 if hq * d >= 2048 else 1)
    return q_out, k_out


@triton.jit
def merge_states_kernel(out_ptr, out_lse_ptr, po_ptr, pl_ptr, so_ptr, sl_ptr, num_heads,
                        stride_ot, stride_oh, stride_pt, stride_ph, stride_st, stride_sh,
                        stride_olt, stride_plt, stride_slt, D: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HAS_OUT_LSE: tl.constexpr,
                        ACC: tl.constexpr):
    """One token's ``BLOCK_H`` heads of ``merge_attn_states``: both sides read once, weighted
    by their LSEs (+inf read as empty, like -inf), written once; rows empty on both sides get
    0 and an LSE of -inf."""
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_heads
    p = tl.load(pl_ptr + t * stride_plt + offs_h, mask=h_ok, other=float("-inf")).to(ACC)
    s = tl.load(sl_ptr + t * stride_slt + offs_h, mask=h_ok, other=float("-inf")).to(ACC)
    p = tl.where(p == float("inf"), float("-inf"), p)
    s = tl.where(s == float("inf"), float("-inf"), s)
    m = tl.maximum(p, s)
    safe = tl.where(m == float("-inf"), 0.0, m)
    wp = tl.exp(p - safe)
    ws = tl.exp(s - safe)
    total = wp + ws
    denom = tl.where(total > 0, total, 1.0)
    mask = h_ok[:, None] & (offs_d[None, :] < D)
    po = tl.load(po_ptr + t * stride_pt + offs_h[:, None] * stride_ph + offs_d[None, :],
                 mask=mask, other=0.0).to(ACC)
    so = tl.load(so_ptr + t * stride_st + offs_h[:, None] * stride_sh + offs_d[None, :],
                 mask=mask, other=0.0).to(ACC)
    merged = po * (wp / denom)[:, None] + so * (ws / denom)[:, None]
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=mask)
    if HAS_OUT_LSE:
        lse = tl.where(total > 0, safe + tl.log(denom), float("-inf"))
        tl.store(out_lse_ptr + t * stride_olt + offs_h, lse.to(out_lse_ptr.dtype.element_ty),
                 mask=h_ok)


def merge_states_triton(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse) -> None:
    """One launch of :func:`merge_states_kernel` over ``[T, H, D]`` results and ``[T, H]``
    LSEs (inputs already checked by the op; any strides, rows without a unit last stride go
    through a contiguous copy)."""
    t, h, d = out.shape
    if t == 0 or h == 0:
        return
    unit = lambda x: x if x.stride(-1) == 1 else x.contiguous()  # noqa: E731
    prefix_out, suffix_out, prefix_lse, suffix_lse = (
        unit(x) for x in (prefix_out, suffix_out, prefix_lse, suffix_lse))
    target = unit(out)
    target_lse = unit(out_lse) if out_lse is not None else prefix_lse  # (unwritten when None)
    block_d = pow2(d)
    block_h = min(pow2(h), max(1, 4096 // block_d))
    merge_states_kernel[(t, cdiv(h, block_h))](
        target, target_lse, prefix_out, prefix_lse, suffix_out, suffix_lse, h,
        target.stride(0), target.stride(1), prefix_out.stride(0), prefix_out.stride(1),
        suffix_out.stride(0), suffix_out.stride(1), target_lse.stride(0), prefix_lse.stride(0),
        suffix_lse.stride(0), D=d, BLOCK_H=block_h, BLOCK_D=block_d,
        HAS_OUT_LSE=out_lse is not None,
        ACC=tl.float64 if out.dtype == torch.float64 else tl.float32,
        num_warps=4 if block_h * block_d >= 2048 else 1)
    if target is not out:
        out.copy_(target)
    if out_lse is not None and target_lse is not out_lse:
        out_lse.copy_(target_lse)
