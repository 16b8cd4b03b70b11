"""FlashMLA's fp8_ds_mla rows packed in one launch (:mod:`attn_ops.backends.mla.ds_cache`
documents the layout; :func:`~attn_ops.backends.mla.ds_cache.ds_pack` is the torch form and the
oracle, byte for byte).

One program a token: its latent as ``rank / 128`` tiles of 128 values, each tile's
``amax / 448`` (1.0 for an all-zero tile) as its fp32 scale, the tile divided by it (IEEE
division, as torch's), saturated at +-448 and rounded to e4m3 (ties to even, zeros signed);
the rope part copied in its 16-bit dtype. The torch form takes about ten launches a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.backends.mla.indexer_kernels import _round_to_e4m3
from attn_ops.routing import pow2

__all__ = ["ds_pack_kernel", "ds_pack_triton"]


@triton.jit
def ds_pack_kernel(c_ptr, pe_ptr, fp8_ptr, f32_ptr, b16_ptr, stride_c, stride_pe,
                   WIDTH: tl.constexpr, TILES: tl.constexpr, TILES_P: tl.constexpr,
                   TILE: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr,
                   FP8_MAX: tl.constexpr):
    """Token ``program_id(0)``'s row: ``fp8_ptr`` / ``f32_ptr`` / ``b16_ptr`` are the rows
    ``[T, WIDTH]`` bytes seen as e4m3, float32 and the rope's 16-bit dtype."""
    t = tl.program_id(0).to(tl.int64)
    tiles = tl.arange(0, TILES_P)
    cols = tl.arange(0, TILE)
    ok = (tiles < TILES)[:, None]
    offs = tiles[:, None] * TILE + cols[None, :]
    c = tl.load(c_ptr + t * stride_c + offs, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(c), axis=1) / FP8_MAX
    scale = tl.where(amax > 0, amax, 1.0)
    x = tl.minimum(tl.maximum(tl.math.div_rn(c, scale[:, None]), -FP8_MAX), FP8_MAX)
    e4m3 = _round_to_e4m3(x)
    e4m3 = tl.where(e4m3 == 0.0, x * 0.0, e4m3)  # (a zero keeps x's sign, as torch's cast)
    tl.store(fp8_ptr + t * WIDTH + offs, e4m3.to(tl.float8e4nv), mask=ok)
    rank = TILES * TILE
    tl.store(f32_ptr + t * (WIDTH // 4) + rank // 4 + tiles, scale, mask=tiles < TILES)
    r = tl.arange(0, ROPE_P)
    pe = tl.load(pe_ptr + t * stride_pe + r, mask=r < ROPE)
    tl.store(b16_ptr + t * (WIDTH // 2) + (rank + rank // TILE * 4) // 2 + r,
             pe.to(b16_ptr.dtype.element_ty), mask=r < ROPE)


def ds_pack_triton(kv_c: torch.Tensor, k_pe: torch.Tensor, rope_dtype: torch.dtype,
                   tile: int, fp8_max: float) -> torch.Tensor:
    """``[T, width]`` uint8 rows of ``[kv_c | k_pe]`` (``rank`` a multiple of ``tile``) in one
    launch."""
    t, rank = kv_c.shape
    rope = k_pe.shape[1]
    width = rank + rank // tile * 4 + 2 * rope
    rows = torch.empty(t, width, dtype=torch.uint8, device=kv_c.device)
    if t == 0:
        return rows
    kv_c = kv_c if kv_c.stride(1) == 1 else kv_c.contiguous()
    k_pe = k_pe if k_pe.stride(1) == 1 else k_pe.contiguous()
    tiles = rank // tile
    ds_pack_kernel[(t,)](
        kv_c, k_pe, rows.view(torch.float8_e4m3fn), rows.view(torch.float32),
        rows.view(rope_dtype), kv_c.stride(0), k_pe.stride(0), WIDTH=width, TILES=tiles,
        TILES_P=pow2(tiles), TILE=tile, ROPE=rope, ROPE_P=pow2(rope), FP8_MAX=fp8_max)
    return rows
