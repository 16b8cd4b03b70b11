"""Triton kernels of the TurboQuant cache: the write (quantize and pack, one launch).

:func:`cache_write_kernel` -- one program a block of ``BLOCK_T`` tokens and a KV head: keys'
RoPE (with ``ROPE``: each coordinate with its partner in the other half), norms, the rotation
(vLLM's fp32 product with the Hadamard matrix, 1 / sqrt(D) applied after: as butterflies in
fp32, :func:`_fwht`, or as the +-1 product on the tensor cores to fp32 accuracy,
:func:`_rotate`), each coordinate's codebook index as the count of the midpoints at or below it
(or the same found by a binary search), values' minimum, maximum, scale and codes, the
LSB-first packing (4 bits: two codes a byte; 3 bits: eight codes a 3-byte word), the fp16
fields, and -- for tokens entering a page -- the page's slots no token of the call writes
zeroed. Slots outside the cache are skipped, as ``-1`` is.
The attention side reads the format inside TRITON_ATTN's kernel (``KV_FORMAT``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.backends.turboquant.read_kernels import sylvester_signs
from attn_ops.routing import cdiv, pow2

__all__ = ["cache_write_triton", "clear_tiles"]


@triton.jit
def _fp16_bytes(x):
    """fp32 values as fp16, their low and high bytes (uint8)."""
    bits = x.to(tl.float16).to(tl.uint16, bitcast=True)
    return (bits & 0xFF).to(tl.uint8), (bits >> 8).to(tl.uint8)


@triton.jit
def _store_packed(codes, base, ok, D: tl.constexpr, D_P: tl.constexpr, BITS: tl.constexpr,
                  BLOCK_T: tl.constexpr):
    """``codes [BLOCK_T, D_P]`` (int32 below 2^BITS; columns from D on ignored) as an LSB-first
    stream of D codes from ``base`` (byte pointers ``[BLOCK_T]``)."""
    if BITS == 4:
        low, high = tl.split(tl.reshape(codes, [BLOCK_T, D_P // 2, 2]))
        offs = tl.arange(0, D_P // 2)
        tl.store(base[:, None] + offs[None, :], (low | (high << 4)).to(tl.uint8),
                 mask=ok[:, None] & (offs[None, :] < D // 2))
    else:  # 3 bits: a 24-bit word of 8 codes, 3 bytes
        groups = tl.reshape(codes, [BLOCK_T, D_P // 8, 8])
        word = tl.sum(groups << (tl.arange(0, 8) * 3)[None, None, :], axis=2)
        offs = tl.arange(0, D_P // 8)
        for i in tl.static_range(3):
            tl.store(base[:, None] + offs[None, :] * 3 + i,
                     ((word >> (8 * i)) & 0xFF).to(tl.uint8),
                     mask=ok[:, None] & (offs[None, :] < D // 8))


@triton.jit
def _rotate(x, offs_d, D: tl.constexpr):
    """``x [BLOCK_T, D_P] @ H`` (Sylvester's signs, +-1) as an fp32 product on the tensor
    cores: ``x`` as three fp16 parts, each the last one's remainder scaled by 2^11 (``hi + mid
    2^-11 + lo 2^-22`` is ``x`` exactly: 33 bits for fp32's 24), each part times +-1 exact and
    summed in fp32, the smallest first. The IEEE fp32 product it replaces ran on the FMA units,
    about 1100 of a rotated write's 3600 instructions a thread (sm_90)."""
    signs = sylvester_signs(offs_d, offs_d, D).to(tl.float16)
    hi = x.to(tl.float16)
    rest = (x - hi.to(tl.float32)) * 2048.0
    mid = rest.to(tl.float16)
    lo = ((rest - mid.to(tl.float32)) * 2048.0).to(tl.float16)
    y = tl.dot(lo, signs, out_dtype=tl.float32) * (1.0 / 2048.0)
    y = (y + tl.dot(mid, signs, out_dtype=tl.float32)) * (1.0 / 2048.0)
    return y + tl.dot(hi, signs, out_dtype=tl.float32)


@triton.jit
def _fwht(x, BLOCK_T: tl.constexpr, D_P: tl.constexpr):
    """``x [BLOCK_T, D_P] @ H`` (Sylvester's signs, +-1) as a fast Walsh-Hadamard transform in
    fp32: log2(D_P) butterfly stages of one geometry (Pease's), each pairing neighbouring
    coordinates (2i, 2i + 1) and putting their sum at i and their difference at i + D_P / 2 --
    D_P log2(D_P) additions a row, no matrix. Its sums round in another order than the
    product's, as any two fp32 orders do (a code at a midpoint may differ)."""
    for s in tl.static_range(16):
        if (1 << s) < D_P:
            a, b = tl.split(tl.reshape(x, [BLOCK_T, D_P // 2, 2]))
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [BLOCK_T, D_P])
    return x


@triton.jit
def _store_fp16(ptr, x, ok):
    lo, hi = _fp16_bytes(x)
    tl.store(ptr, lo, mask=ok)
    tl.store(ptr + 1, hi, mask=ok)


@triton.jit
def cache_write_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, mid_ptr, cell_ptr, cs_ptr,
                       num_tokens, num_slots, num_cells, stride_kt, stride_kh, stride_vt,
                       stride_vh, stride_cb, stride_ch, stride_cs, stride_cst, inv_sqrt_d,
                       grid_scale, grid_offset,
                       D: tl.constexpr, D_P: tl.constexpr, PAGE: tl.constexpr,
                       SLOT: tl.constexpr, SLOT_P: tl.constexpr, KEY_BITS: tl.constexpr,
                       VALUE_BITS: tl.constexpr, PAD: tl.constexpr, ROPE: tl.constexpr,
                       BLOCK_T: tl.constexpr, CHECK: tl.constexpr, CLEAR: tl.constexpr,
                       FWHT: tl.constexpr, SEARCH: tl.constexpr, LOOKUP: tl.constexpr):
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D_P)
    d_ok = offs_d < D
    slot = tl.load(slot_ptr + rows, mask=rows < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)  # (-1 and slots outside the cache: skipped)
    in_page = slot % PAGE
    base = cache_ptr + (slot // PAGE) * stride_cb + head * stride_ch + in_page * stride_cs
    mask = ok[:, None] & d_ok[None, :]
    wide = rows.to(tl.int64)[:, None]  # (tokens x heads x head dim may pass 2^31)
    k_row = k_ptr + wide * stride_kt + head * stride_kh
    k = tl.load(k_row + offs_d[None, :], mask=mask, other=0.0)
    if ROPE:  # (the key rotated first, rounded to its dtype as torch.ops.attn.rope leaves it)
        half: tl.constexpr = D // 2
        partner = tl.load(k_row + ((offs_d + half) % D)[None, :], mask=mask, other=0.0)
        cs_row = cs_ptr + wide * stride_cst + (offs_d % half)[None, :]
        cos = tl.load(cs_row, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(cs_row + half, mask=mask, other=0.0).to(tl.float32)
        sign = tl.where(offs_d < half, -1.0, 1.0)[None, :]
        k = (k.to(tl.float32) * cos + sign * partner.to(tl.float32) * sin).to(k.dtype)
    k = k.to(tl.float32)
    v = tl.load(v_ptr + wide * stride_vt + head * stride_vh + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    if KEY_BITS == 8:  # fp8 e4m3 keys, saturated, no rotation
        k8 = tl.minimum(tl.maximum(k, -448.0), 448.0).to(tl.float8e4nv)
        tl.store(base[:, None] + offs_d[None, :], k8.to(tl.uint8, bitcast=True), mask=mask)
        vbase = base + D
    else:
        # (IEEE sqrt and division, as torch's: the GPU's defaults are approximate, and a
        # code at a rounding boundary would differ from the torch write's)
        norm = tl.sqrt_rn(tl.sum(k * k, axis=1))
        if LOOKUP:  # (the raw key rotated -- the rotation is linear -- then put on the code
            # grid u = y S + A of format.code_lookup: cell round(u) by the add of 1.5 2^23,
            # unsigned-clamped into the table; code = its count + (u >= its threshold))
            to_grid = tl.div_rn(tl.full([BLOCK_T], grid_scale * inv_sqrt_d, tl.float32),
                                norm + 1e-8)
            u = tl.fma(_fwht(k, BLOCK_T, D_P), to_grid[:, None], grid_offset)
            cell = (u + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
            cell = tl.minimum(cell.to(tl.uint32, bitcast=True), num_cells - 1).to(tl.int32)
            threshold = tl.load(cell_ptr + 2 * cell).to(tl.float32, bitcast=True)
            idx = tl.load(cell_ptr + 2 * cell + 1) + (u >= threshold).to(tl.int32)
        else:
            x = tl.div_rn(k, (norm + 1e-8)[:, None])
            if FWHT:
                y = _fwht(x, BLOCK_T, D_P) * inv_sqrt_d
            else:
                y = _rotate(x, offs_d, D) * inv_sqrt_d
            idx = tl.zeros([BLOCK_T, D_P], tl.int32)
            if SEARCH:  # (a binary search: KEY_BITS compares a coordinate, each against the
                # midpoint its last step leaves -- the same predicates, so the same index)
                for b in tl.static_range(KEY_BITS):
                    idx += tl.where(
                        y >= tl.load(mid_ptr + idx + ((1 << (KEY_BITS - 1 - b)) - 1)),
                        1 << (KEY_BITS - 1 - b), 0)
            else:
                for m in tl.static_range(2 ** KEY_BITS - 1):
                    idx += (y >= tl.load(mid_ptr + m)).to(tl.int32)
        _store_packed(idx, base, ok, D, D_P, KEY_BITS, BLOCK_T)
        _store_fp16(base + D * KEY_BITS // 8, norm, ok)
        vbase = base + D * KEY_BITS // 8 + 2
    top: tl.constexpr = 2 ** VALUE_BITS - 1
    lo = tl.min(tl.where(d_ok[None, :], v, float("inf")), axis=1)
    hi = tl.max(tl.where(d_ok[None, :], v, float("-inf")), axis=1)
    scale = tl.maximum(tl.div_rn(hi - lo, tl.full(hi.shape, top, tl.float32)), 1e-8)
    if LOOKUP:  # ((v - lo) / scale rounded to nearest by the reciprocal's product and two
        # Markstein steps: the residual a - s q is exact in an FMA, and q + r / s rounds to
        # the correctly rounded quotient once q is within an ulp, which the first step gives)
        a = v - lo[:, None]
        inv = tl.div_rn(tl.full(hi.shape, 1.0, tl.float32), scale)[:, None]
        q = a * inv
        q = tl.fma(tl.fma(-q, scale[:, None], a), inv, q)
        q = tl.fma(tl.fma(-q, scale[:, None], a), inv, q)
        codes = tl.floor(q + 0.5)
    else:
        codes = tl.floor(tl.div_rn(v - lo[:, None], scale[:, None]) + 0.5)
    codes = tl.minimum(tl.maximum(codes, 0.0), top).to(tl.int32)
    _store_packed(codes, vbase, ok, D, D_P, VALUE_BITS, BLOCK_T)
    tail = vbase + D * VALUE_BITS // 8
    _store_fp16(tail, scale, ok)
    _store_fp16(tail + 2, lo, ok)
    if PAD:  # (the byte that makes the slot's size even)
        tl.store(tail + 4, tl.zeros([BLOCK_T], tl.uint8), mask=ok)
    # A token entering its page (row 0) zeroes the page's rows this call does not write: row j
    # is the token j places later's when its slot is the entering one's + j (a request's new
    # tokens are consecutive), the rule of attn_ops.glue_kernels' writes. No other program
    # writes a row cleared here, so the clear races with no write. The following tokens'
    # slots are read as [BLOCK_T, CHECK] tiles (a read a tile, not one dependent read a row:
    # that chain was most of a prefill write's time), and only a token whose page keeps rows
    # unwritten (a decode entering a page, a request's last partial page) stores zeros, a
    # [CLEAR, SLOT] tile at a time.
    entering = ok & (in_page == 0)
    if tl.max(entering.to(tl.int32), axis=0) > 0:
        short = tl.zeros([BLOCK_T], tl.int32)
        for r0 in range(0, PAGE, CHECK):
            j = r0 + tl.arange(0, CHECK)
            want = entering[:, None] & ((j >= 1) & (j < PAGE))[None, :]
            short += tl.sum((want & ~_written(slot_ptr, rows[:, None], slot[:, None],
                                              j[None, :], want, num_tokens)).to(tl.int32),
                            axis=1)
        if tl.max(short, axis=0) > 0:
            offs_i = tl.arange(0, BLOCK_T)
            offs_s = tl.arange(0, SLOT_P)
            for i in range(BLOCK_T):
                if tl.max(tl.where(offs_i == i, short, 0), axis=0) > 0:
                    first = tl.max(tl.where(offs_i == i, slot, -1), axis=0)
                    row = tl.program_id(0) * BLOCK_T + i
                    page = cache_ptr + (first // PAGE) * stride_cb + head * stride_ch
                    for r0 in range(0, PAGE, CLEAR):
                        j = r0 + tl.arange(0, CLEAR)
                        inside = (j >= 1) & (j < PAGE)
                        clear = inside & ~_written(slot_ptr, row, first, j, inside, num_tokens)
                        tl.store(page + j[:, None] * stride_cs + offs_s[None, :],
                                 tl.zeros([CLEAR, SLOT_P], tl.uint8),
                                 mask=clear[:, None] & (offs_s[None, :] < SLOT))


@triton.jit
def _written(slot_ptr, rows, slot, j, want, num_tokens):
    """Whether the token ``j`` places after each of ``rows`` writes the slot ``j`` after its
    ``slot`` (broadcast shapes; only where ``want``)."""
    later = rows + j
    return tl.load(slot_ptr + later, mask=want & (later < num_tokens),
                   other=-1).to(tl.int64) == slot + j


def cache_write_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, preset, cos_sin: torch.Tensor | None = None,
                       block_t: int | None = None, num_warps: int | None = None,
                       fwht: bool | None = None, search: bool | None = None,
                       lookup: bool | None = None) -> None:
    """``torch.ops.attn.turboquant_cache_update`` in one launch, the keys rotated by RoPE
    first with ``cos_sin`` (inputs already checked); ``block_t`` tokens on ``num_warps``
    warps a program, the Hadamard rotation as a butterfly transform (``fwht``) or a product,
    the key codes by a binary search over the midpoints (``search``) or a count of them, or --
    ``lookup`` -- the raw key rotated by butterflies and its codes read from
    :func:`~attn_ops.backends.turboquant.format.code_lookup`'s cells, the values divided by a
    reciprocal and Markstein steps (None: ``Tuning.triton.turboquant_write_tokens`` /
    ``_warps`` / ``_fwht`` / ``_search`` / ``_lookup`` of the machine's tuning, the search for
    4-bit keys only)."""
    from attn_ops.backends.turboquant.format import code_lookup, codebook
    from attn_ops.tuning import default_tuning

    tuning = default_tuning().triton
    block_t = block_t or tuning.turboquant_write_tokens
    num_warps = num_warps or tuning.turboquant_write_warps
    fwht = tuning.turboquant_write_fwht if fwht is None else fwht
    if search is None:  # (3-bit keys count: seven compares beat three gathers)
        search = tuning.turboquant_write_search and preset.key_bits == 4
    lookup = tuning.turboquant_write_lookup if lookup is None else lookup

    t, hk, d = key.shape
    if t == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    d_p = pow2(d)
    mid = key.new_zeros(1, dtype=torch.float32)  # (fp8 keys: placeholders)
    cells, grid = key.new_zeros(1, 2, dtype=torch.float32), (0.0, 0.0)
    if not preset.fp8_keys:  # (the rotation: +-1 in the kernel, 1 / sqrt(D) on the product)
        _, mid = codebook(d, preset.key_bits, key.device)
        table = code_lookup(d, preset.key_bits, key.device) if lookup else None
        lookup = table is not None
        if lookup:
            cells, *grid = table
    nb, _, page, slot = kv_cache.shape
    cs = cos_sin if cos_sin is None or cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    cache_write_kernel[(cdiv(t, block_t), hk)](
        key, value, kv_cache, slot_mapping, mid, cells.view(torch.int32),
        cs if cs is not None else key, t, nb * page, cells.shape[0], key.stride(0),
        key.stride(1), value.stride(0), value.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        kv_cache.stride(2), cs.stride(0) if cs is not None else 0, d ** -0.5, *grid, D=d,
        D_P=d_p, PAGE=page,
        SLOT=slot, SLOT_P=pow2(slot), KEY_BITS=preset.key_bits,
        VALUE_BITS=preset.value_bits,
        PAD=preset.key_bytes(d) + preset.value_bytes(d) < slot, ROPE=cs is not None,
        BLOCK_T=block_t, **clear_tiles(page, slot), FWHT=fwht, SEARCH=search,
        LOOKUP=bool(lookup), num_warps=num_warps)


def clear_tiles(page: int, slot: int) -> dict:
    """:func:`cache_write_kernel`'s page-tail tiles for ``page``-token pages of ``slot``-byte
    slots: the following tokens' slots read ``CHECK`` rows a tile, zeros stored ``CLEAR`` rows
    of a page a tile (about 4096 bytes)."""
    rows = pow2(page)
    return dict(CHECK=min(rows, 64), CLEAR=min(rows, max(1, 4096 // pow2(slot))))
