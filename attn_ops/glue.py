"""The glue around the attention kernel as ops: RoPE, the slot mapping, and their fused form.

A decoder layer spends kernels around attention: rotate the query, rotate the key, compute
where each new token goes in the paged cache (from its position and the block table), write
key and value there. As ops of their own they are visible to our Inductor passes
(:mod:`attn_ops.compile_passes`), which fold them into one
``torch.ops.attn.rope_kv_cache_update`` per layer -- rotate both, compute the slots, write the
cache, return the rotated query -- leaving attention and its glue at two ops per layer.

* ``torch.ops.attn.rope(x [T, H, D], cos_sin [T, D]) -> [T, H, D]``: rotate-half (NeoX/Llama)
  RoPE; ``cos_sin`` holds cos in its first half and sin in its second
  (:func:`attn_ops.models.llama.rope_cache`), computed in float32 (float64 for float64 ``x``),
  returned in ``x.dtype``.
* ``torch.ops.attn.slot_mapping(positions [T], query_start_loc [B+1], block_table [B, W],
  block_size) -> [T] int64``: ``block_table[r, p // block_size] * block_size + p % block_size``
  for token ``t`` of request ``r`` at position ``p``; ``-1`` for rows past
  ``query_start_loc[-1]`` (padding), which the cache write skips. Device-only, no host sync.
* ``torch.ops.attn.rope_kv_cache_update(query, key, value, cos_sin, kv_cache, slot_mapping,
  positions, query_start_loc, block_table, k_scale, v_scale) -> rotated query``: both of the
  above and ``kv_cache_update`` in one op; with ``slot_mapping=None`` the slots come from
  ``positions`` / ``query_start_loc`` / ``block_table`` (the page size is the cache's).
* ``torch.ops.attn.quantize_fp8(x, scale [1] float32, dtype) -> fp8``: ``x / scale`` saturated
  to the fp8 range (what a model does to feed an fp8 GEMM); after an attention op, the FP8
  output pass makes the attention op write it directly (``output_scale``).
"""

from __future__ import annotations

import torch

from attn_ops.kv_cache import (FP8_MAX, _kv_cache_update_fake, kv_cache_update, quantize_fp8,
                               split_kv_cache)
from attn_ops.ops import define_op

__all__ = ["paged_slots", "quantize_fp8_op", "rope", "rope_kv_cache_update", "slot_mapping"]


def _check_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[2] % 2:
        raise ValueError(f"rope: x must be [num_tokens, heads, even head_dim], got "
                         f"{tuple(x.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[0] != x.shape[0] or cos_sin.shape[1] != x.shape[2]:
        raise ValueError(f"rope: cos_sin must be [num_tokens={x.shape[0]}, head_dim="
                         f"{x.shape[2]}] (cos | sin halves), got {tuple(cos_sin.shape)}")


def _rope_impl(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    _check_rope(x, cos_sin)
    half = x.shape[-1] // 2
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = cos_sin[:, None, :half].to(compute), cos_sin[:, None, half:].to(compute)
    x1, x2 = x[..., :half].to(compute), x[..., half:].to(compute)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _rope_fake(x, cos_sin):
    _check_rope(x, cos_sin)
    return torch.empty_like(x)


rope = define_op("rope", "(Tensor x, Tensor cos_sin) -> Tensor", _rope_impl, _rope_fake)


def _check_slots(positions, query_start_loc, block_table, block_size):
    if positions.dim() != 1 or query_start_loc.dim() != 1 or block_table.dim() != 2:
        raise ValueError(f"slot_mapping: positions [T], query_start_loc [B+1] and block_table "
                         f"[B, W] expected, got {tuple(positions.shape)}, "
                         f"{tuple(query_start_loc.shape)}, {tuple(block_table.shape)}")
    if query_start_loc.shape[0] != block_table.shape[0] + 1:
        raise ValueError(f"slot_mapping: query_start_loc has {query_start_loc.shape[0]} entries "
                         f"for {block_table.shape[0]} block-table rows (needs rows + 1)")
    if block_size < 1:
        raise ValueError(f"slot_mapping: block_size={block_size} must be >= 1")


def paged_slots(req: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """``block_table[req, pos // block_size] * block_size + pos % block_size`` (int64) where
    ``valid``, -1 elsewhere; ``req`` / ``pos`` / ``valid`` broadcast. A request or a page
    outside the table (or a negative position) is absent, -1: the table is read clamped and
    the result masked, never a neighbour's page."""
    num_reqs, width = block_table.shape
    pos = pos.long()
    col = pos // block_size
    valid = valid & (req >= 0) & (req < num_reqs) & (pos >= 0) & (col < width)
    row = req.clamp(0, max(num_reqs - 1, 0))
    col = col.clamp(0, max(width - 1, 0))
    block = block_table[row, col].long() if num_reqs and width else torch.zeros_like(pos)
    return torch.where(valid, block * block_size + pos % block_size, -1)


def _slot_mapping_impl(positions, query_start_loc, block_table, block_size):
    _check_slots(positions, query_start_loc, block_table, block_size)
    t = torch.arange(positions.shape[0], device=positions.device,
                     dtype=query_start_loc.dtype)
    req = torch.searchsorted(query_start_loc[1:].contiguous(), t, right=True)
    return paged_slots(req, positions, req < block_table.shape[0], block_table, block_size)


def _slot_mapping_fake(positions, query_start_loc, block_table, block_size):
    _check_slots(positions, query_start_loc, block_table, block_size)
    return positions.new_empty(positions.shape, dtype=torch.int64)


slot_mapping = define_op(
    "slot_mapping",
    "(Tensor positions, Tensor query_start_loc, Tensor block_table, int block_size) -> Tensor",
    _slot_mapping_impl, _slot_mapping_fake)


def _check_slot_source(slots, positions, query_start_loc, block_table) -> None:
    if slots is not None and positions is not None:
        raise ValueError("rope_kv_cache_update: pass slot_mapping or positions, not both")
    if slots is None and (positions is None or query_start_loc is None or block_table is None):
        raise ValueError("rope_kv_cache_update: pass slot_mapping, or positions, "
                         "query_start_loc and block_table to compute it")


def _slots_for(key, value, kv_cache, slots, positions, query_start_loc, block_table):
    _check_slot_source(slots, positions, query_start_loc, block_table)
    if slots is not None:
        return slots
    block_size = split_kv_cache(kv_cache, key.shape[2], value.shape[2])[0].shape[1]
    return _slot_mapping_impl(positions, query_start_loc, block_table, block_size)


def _fused_impl(query, key, value, cos_sin, kv_cache, slots, positions, query_start_loc,
                block_table, k_scale, v_scale):
    if query.is_cuda:  # one Triton kernel (attn_ops.glue_kernels)
        _check_fused(query, key, value, cos_sin, kv_cache, slots, positions, query_start_loc,
                     block_table, k_scale, v_scale)
        from attn_ops.glue_kernels import rope_kv_cache_update_triton

        return rope_kv_cache_update_triton(query, key, value, cos_sin, kv_cache, slots,
                                           positions, query_start_loc, block_table, k_scale,
                                           v_scale)
    return fused_torch(query, key, value, cos_sin, kv_cache, slots, positions, query_start_loc,
                       block_table, k_scale, v_scale)


def fused_torch(query, key, value, cos_sin, kv_cache, slots, positions, query_start_loc,
                block_table, k_scale, v_scale):
    """``rope_kv_cache_update`` in torch ops (the CPU implementation; the GPU kernel's check)."""
    slots = _slots_for(key, value, kv_cache, slots, positions, query_start_loc, block_table)
    kv_cache_update(_rope_impl(key, cos_sin), value, kv_cache, slots, k_scale, v_scale)
    return _rope_impl(query, cos_sin)


def _check_fused(query, key, value, cos_sin, kv_cache, slots, positions, query_start_loc,
                 block_table, k_scale, v_scale) -> None:
    _check_slot_source(slots, positions, query_start_loc, block_table)
    _check_rope(query, cos_sin)
    _check_rope(key, cos_sin)
    if slots is None:
        slots = positions.new_empty(positions.shape, dtype=torch.int64)
    _kv_cache_update_fake(key, value, kv_cache, slots, k_scale, v_scale)


def _fused_fake(*args):
    _check_fused(*args)
    return torch.empty_like(args[0])


rope_kv_cache_update = define_op(
    "rope_kv_cache_update",
    "(Tensor query, Tensor key, Tensor value, Tensor cos_sin, Tensor(a!) kv_cache, "
    "Tensor? slot_mapping, Tensor? positions, Tensor? query_start_loc, Tensor? block_table, "
    "Tensor? k_scale, Tensor? v_scale) -> Tensor",
    _fused_impl, _fused_fake)


def _check_quantize(x, scale, dtype):
    if dtype not in FP8_MAX:
        raise ValueError(f"quantize_fp8: dtype={dtype} must be torch.float8_e4m3fn or "
                         "torch.float8_e5m2")
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"quantize_fp8: scale must be a one-element float32 tensor, got "
                         f"{scale.dtype} {tuple(scale.shape)}")


def _quantize_impl(x, scale, dtype):
    _check_quantize(x, scale, dtype)
    return quantize_fp8(x, scale, dtype)


def _quantize_fake(x, scale, dtype):
    _check_quantize(x, scale, dtype)
    return torch.empty_like(x, dtype=dtype)


quantize_fp8_op = define_op("quantize_fp8", "(Tensor x, Tensor scale, ScalarType dtype) -> Tensor",
                            _quantize_impl, _quantize_fake)
