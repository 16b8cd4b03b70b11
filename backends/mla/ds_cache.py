"""FlashMLA's sparse MLA latent layout: ``kv_cache_dtype="fp8_ds_mla"`` (DeepSeek-V3.2).

A token's row of the latent cache is ``rank + rank / 32 + 2 * rope`` bytes (656 at DeepSeek's
512 + 64), held in a ``float8_e4m3fn`` tensor ``[num_blocks, block_size, width]``:

=============================== ==============================================================
bytes ``[0, rank)``             the latent ``c`` in e4m3: ``c[i] / scale[i // 128]``, saturated
                                at +-448
bytes ``[rank, rank + rank/32)`` ``rank / 128`` float32 scales (little-endian), one a 128
                                latent values: ``amax(|c|)`` of the 128 over 448 (1.0 where all
                                128 are 0)
bytes ``[rank + rank/32, width)`` the rope part ``k_pe``, ``rope`` values of the model's 16-bit
                                dtype (bf16 for FlashMLA), not quantized
=============================== ==============================================================

Reading a row: ``c[i] = float(e4m3 byte i) * scale[i // 128]``, ``k_pe`` as stored. A scale
any writer chose decodes the same way (FlashMLA's own tests round theirs up to a power of two;
this writer keeps ``amax / 448``). The write goes through :func:`attn_ops.kv_cache.write_paged`
on byte views, so its rules hold: -1 and out-of-range slots are skipped, and the rows a write
leaves unfilled in every page it enters are zeroed (zero bytes decode to zeros).
"""

from __future__ import annotations

import torch

from attn_ops.kv_cache import write_paged

__all__ = ["TILE", "ds_row_width", "ds_rows", "ds_write", "is_ds_cache"]

TILE = 128  # latent values a scale
FP8_MAX = 448.0


def ds_row_width(rank: int, rope: int) -> int:
    """Bytes of one token's row: the fp8 latent, its scales, the 16-bit rope part."""
    return rank + rank // TILE * 4 + 2 * rope


def is_ds_cache(latent_cache: torch.Tensor, rank: int, rope: int) -> bool:
    """Whether ``latent_cache`` holds rows in this layout (fp8 rows of its width)."""
    return (latent_cache.dtype == torch.float8_e4m3fn and rank % TILE == 0
            and latent_cache.shape[-1] == ds_row_width(rank, rope))


def ds_pack(kv_c: torch.Tensor, k_pe: torch.Tensor, rope_dtype: torch.dtype) -> torch.Tensor:
    """``[T, width]`` uint8 rows of ``[kv_c | k_pe]`` in this layout."""
    t, rank = kv_c.shape
    c = kv_c.float().view(t, rank // TILE, TILE)
    scale = c.abs().amax(-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q8 = (c / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([q8.view(t, rank).view(torch.uint8), scale.contiguous().view(torch.uint8),
                      k_pe.to(rope_dtype).contiguous().view(torch.uint8)], dim=1)


def ds_write(kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``[kv_c | k_pe]`` (``k_pe`` kept in its own 16-bit dtype) at ``slot_mapping``."""
    rank = kv_c.shape[1]
    rope_dtype = k_pe.dtype if k_pe.dtype.itemsize == 2 else torch.bfloat16
    if kv_c.is_cuda and ds_row_width(rank, k_pe.shape[1]) % 4 == 0:  # (one launch; the scales
        from attn_ops.backends.mla.ds_kernels import ds_pack_triton  # 4-byte aligned)

        rows = ds_pack_triton(kv_c, k_pe, rope_dtype, TILE, FP8_MAX)
    else:
        rows = ds_pack(kv_c, k_pe, rope_dtype)
    cut = rank + rank // TILE * 4  # (the two column ranges: write_paged's key and value)
    cache = latent_cache.view(torch.uint8)
    write_paged(rows[:, None, :cut], rows[:, None, cut:], cache[:, :, None, :cut],
                cache[:, :, None, cut:], slot_mapping, None, None)


def ds_rows(rows: torch.Tensor, rank: int, rope_dtype: torch.dtype,
            dtype: torch.dtype) -> torch.Tensor:
    """``[..., rank + rope]`` values in ``dtype`` of ``[..., width]`` fp8 rows."""
    raw = rows.view(torch.uint8)
    lead = raw.shape[:-1]
    cut = rank + rank // TILE * 4
    c = raw[..., :rank].view(torch.float8_e4m3fn).to(dtype)
    scale = raw[..., rank:cut].contiguous().view(torch.float32).to(dtype)
    k_pe = raw[..., cut:].contiguous().view(rope_dtype).to(dtype)
    c = (c.view(*lead, rank // TILE, TILE) * scale[..., None]).view(*lead, rank)
    return torch.cat([c, k_pe], dim=-1)
