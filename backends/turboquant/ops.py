"""TurboQuant's ops: the cache write and attention over the quantized cache.

* ``torch.ops.attn.turboquant_cache_update(key, value, kv_cache, slot_mapping,
  kv_cache_dtype, cos_sin=None)`` -- quantize each (token, KV head) of ``key`` / ``value``
  ``[T, Hk, D]`` (the keys rotated by RoPE first with ``cos_sin [T, D]``, in the same launch on
  GPUs, as ``torch.ops.attn.rope`` would) into its slot of the cache (:mod:`~attn_ops.backends.turboquant.format`), skipping slot -1
  and any slot outside the cache (slots are never trusted), and zeroing the slots a write
  leaves unfilled in every page it enters (a zero slot reads as zero K and V) -- the rules of
  ``torch.ops.attn.kv_cache_update``.
* ``torch.ops.attn.turboquant_attention(query, kv_cache, ..., kv_cache_dtype)`` -- paged
  attention (``attn_ops.ops.PAGED_ATTENTION_SCHEMA``'s arguments, causal, no optional
  features) over the keys and values the cache holds, read back from their slots: every key a
  query sees comes from the cache, its step's own tokens included (written first), so a
  request's outputs do not depend on how its prompt was cut into steps. (vLLM's prefill
  attends the raw K/V of a first chunk and of long continuation chunks, the quantized ones of
  short continuations.)

Their torch bodies are the CPU path and the oracle: attention reads the whole cache back in
fp32 (fp64 for fp64 queries) and runs REFERENCE's definition on it. On GPUs the write is one
Triton launch (:mod:`.write_kernels`) and attention TRITON_ATTN's kernels dequantizing the slots in
registers (:func:`triton_turboquant_attention`).
"""

from __future__ import annotations

import functools

import torch

from attn_ops.backends.turboquant.format import (PRESETS, codebook, dequantize_slots,
                                                quantize_slots)
from attn_ops.glue import _rope_impl
from attn_ops.kv_cache import clear_entered_page_tails
from attn_ops.ops import check_paged_attention_inputs, debug_checks_enabled, define_op
from attn_ops.spec import KVCacheDType

__all__ = ["turboquant_attention", "turboquant_cache_update", "turboquant_dense_cache"]


def _preset(kv_cache_dtype: str, op: str):
    try:
        dtype = KVCacheDType(kv_cache_dtype)
    except ValueError:
        dtype = None
    if dtype not in PRESETS:
        raise ValueError(f"{op}: kv_cache_dtype={kv_cache_dtype!r} is not a TurboQuant preset; "
                         f"use one of {', '.join(d.value for d in PRESETS)}")
    return PRESETS[dtype]


def _check_cache(op: str, kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int,
                 kv_cache_dtype: str):
    preset = _preset(kv_cache_dtype, op)
    slot = preset.slot_bytes(head_dim)
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[1] != num_kv_heads \
            or kv_cache.shape[3] != slot:
        raise ValueError(f"{op}: a {kv_cache_dtype} cache at head_dim={head_dim} must be uint8 "
                         f"[num_blocks, num_kv_heads={num_kv_heads}, block_size, {slot}], got "
                         f"{kv_cache.dtype} {tuple(kv_cache.shape)}; allocate it with "
                         "attn_ops.allocate_kv_cache")
    return preset


def _check_update(key, value, kv_cache, slot_mapping, kv_cache_dtype, cos_sin=None):
    op = "turboquant_cache_update"
    if cos_sin is not None and (cos_sin.dim() != 2 or cos_sin.shape[0] != key.shape[0]
                                or cos_sin.shape[1] != key.shape[-1]):
        raise ValueError(f"{op}: cos_sin must be [num_tokens={key.shape[0]}, head_dim="
                         f"{key.shape[-1]}] (cos | sin halves), got {tuple(cos_sin.shape)}")
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"{op}: key and value must be [num_tokens, num_kv_heads, head_dim] of "
                         f"one shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"{op}: slot_mapping must be [num_tokens={key.shape[0]}], got "
                         f"{tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: slot_mapping.dtype={slot_mapping.dtype} must be int64 (or "
                         "int32)")
    for name, t in (("value", value), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        if t.device != key.device:
            raise ValueError(f"{op}: {name} is on {t.device} but key is on {key.device}")
    return _check_cache(op, kv_cache, key.shape[1], key.shape[2], kv_cache_dtype)


def _update_impl(key, value, kv_cache, slot_mapping, kv_cache_dtype, cos_sin=None):
    preset = _check_update(key, value, kv_cache, slot_mapping, kv_cache_dtype, cos_sin)
    if slot_mapping.numel() == 0:
        return
    paged = kv_cache.transpose(1, 2)  # [num_blocks, block_size, Hk, slot]
    capacity = paged.shape[0] * paged.shape[1]
    slots = slot_mapping.long()
    if debug_checks_enabled():
        bad = (slots < -1) | (slots >= capacity)
        if bool(bad.any()):
            raise ValueError(f"turboquant_cache_update: slot_mapping holds slot "
                             f"{int(slots[bad][0])} but the cache has slots 0..{capacity - 1} "
                             "and -1 marks padding")
    if key.is_cuda:  # one launch, entered pages' tails cleared in it
        from attn_ops.tuning import default_tuning

        if default_tuning().triton.turboquant_cuda_write:
            from attn_ops.backends.turboquant.cuda_write import (cuda_write_built,
                                                                cuda_write_serves,
                                                                turboquant_cuda_write)

            if cuda_write_serves(key, value, kv_cache, slot_mapping, preset, cos_sin) \
                    and cuda_write_built():
                return turboquant_cuda_write(key, value, kv_cache, slot_mapping, preset,
                                             cos_sin)
        from attn_ops.backends.turboquant.write_kernels import cache_write_triton

        return cache_write_triton(key, value, kv_cache, slot_mapping, preset, cos_sin)
    if cos_sin is not None:
        key = _rope_impl(key, cos_sin)
    clear_entered_page_tails(slot_mapping, paged)
    rows = ((slots >= 0) & (slots < capacity)).nonzero().squeeze(1)
    slots = slots.index_select(0, rows)
    new = quantize_slots(key.index_select(0, rows), value.index_select(0, rows), preset)
    paged[slots // paged.shape[1], slots % paged.shape[1]] = new


def _update_fake(key, value, kv_cache, slot_mapping, kv_cache_dtype, cos_sin=None):
    _check_update(key, value, kv_cache, slot_mapping, kv_cache_dtype, cos_sin)


turboquant_cache_update = define_op(
    "turboquant_cache_update",
    "(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, str kv_cache_dtype, "
    "Tensor? cos_sin=None) -> ()", _update_impl, _update_fake)


def turboquant_dense_cache(kv_cache: torch.Tensor, kv_cache_dtype: str, head_dim: int,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole cache read back as an NHD cache ``[num_blocks, 2, block_size, Hk, head_dim]``
    in ``dtype`` (what every key and value reads as)."""
    k, v = dequantize_slots(kv_cache, _preset(kv_cache_dtype, "turboquant"), head_dim, dtype)
    return torch.stack([k, v], 1).transpose(2, 3).contiguous()


@functools.cache
def _cache_head_dim(kv_cache_dtype: str, slot: int) -> int | None:
    """The head dim whose slots are ``slot`` bytes in a ``kv_cache_dtype`` cache (None: none)."""
    preset = _preset(kv_cache_dtype, "turboquant_attention")
    dims = range(2, 4 * slot, 2) if preset.fp8_keys else (2 ** i for i in range(1, 14))
    return next((d for d in dims if preset.slot_bytes(d) == slot), None)


def _check_attention(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse,
                     kv_cache_dtype):
    op = "turboquant_attention"
    if kv_cache.dim() != 4 or kv_cache.dtype != torch.uint8:
        raise ValueError(f"{op}: kv_cache must be a uint8 [num_blocks, num_kv_heads, "
                         f"block_size, slot_bytes] TurboQuant cache, got {kv_cache.dtype} "
                         f"{tuple(kv_cache.shape)}")
    head_dim = _cache_head_dim(kv_cache_dtype, int(kv_cache.shape[3]))  # (a fixed size)
    if head_dim is None:
        raise ValueError(f"{op}: no head dim has {kv_cache.shape[3]}-byte slots in a "
                         f"{kv_cache_dtype} cache; allocate it with attn_ops.allocate_kv_cache")
    # (the paged-attention checks, on a stand-in of the shape the cache reads back as)
    stand_in = query.new_empty(1).expand(kv_cache.shape[0], 2, kv_cache.shape[2],
                                         kv_cache.shape[1], head_dim)
    check_paged_attention_inputs(query, stand_in, query_start_loc, seq_lens, block_table, out,
                                 lse, None, None, None, None)


@functools.cache
def _codebook(kv_cache_dtype: str, head_dim: int, device: torch.device) -> torch.Tensor:
    """The keys' centroids (fp32) TRITON_ATTN's TurboQuant read looks codes up in (a
    placeholder for fp8 keys)."""
    preset = _preset(kv_cache_dtype, "turboquant_attention")
    if preset.fp8_keys:
        return torch.zeros(1, device=device)
    return codebook(head_dim, preset.key_bits, device)[0]


def triton_turboquant_attention(query, kv_cache, query_start_loc, seq_lens, block_table, plan,
                                out, lse, scale, kv_cache_dtype,
                                cuda_decode: bool | None = None) -> None:
    """The op on GPUs (and in Triton's interpreter, tests): TRITON_ATTN's kernels reading the
    TurboQuant format in registers (``KV_FORMAT=1``), planned by ``plan``
    (:class:`~attn_ops.backends.triton_attn.TritonAttnMetadata`); uniform decode steps
    on the CUDA kernel of :mod:`.cuda_decode` where ``Tuning.triton.turboquant_cuda_decode``
    (``cuda_decode``: that choice made by the caller -- benchmarks comparing the two reads)."""
    from attn_ops.backends.triton_attn import triton_paged_attention
    from attn_ops.backends.turboquant.cuda_decode import (build_of, cuda_decode_built,
                                                          cuda_decode_serves,
                                                          turboquant_cuda_decode)
    from attn_ops.tuning import default_tuning

    preset, tuning = _preset(kv_cache_dtype, "turboquant_attention"), default_tuning()
    codebook = _codebook(kv_cache_dtype, query.shape[-1], query.device)
    wanted = tuning.triton.turboquant_cuda_decode if cuda_decode is None else cuda_decode
    if wanted and cuda_decode_serves(query, kv_cache, seq_lens, preset) and cuda_decode_built(
            *build_of(tuning.triton)):
        return turboquant_cuda_decode(query, kv_cache, query_start_loc, seq_lens, block_table,
                                      out, lse, scale, preset, codebook, tuning)
    triton_paged_attention(query, kv_cache, query_start_loc, seq_lens, block_table, plan, out,
                           lse, None, None, None, None, scale, None, None, True,
                           turboquant=(preset, codebook))


def _attention_impl(query, kv_cache, query_start_loc, seq_lens, block_table, plan, out, lse,
                    scale, kv_cache_dtype):
    from attn_ops.backends.reference import reference_paged_attention

    _check_attention(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse,
                     kv_cache_dtype)
    if query.is_cuda and query.dtype != torch.float64:
        return triton_turboquant_attention(query, kv_cache, query_start_loc, seq_lens,
                                           block_table, plan, out, lse, scale, kv_cache_dtype)
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    dense = turboquant_dense_cache(kv_cache, kv_cache_dtype, query.shape[-1], compute)
    result = out.new_empty(out.shape, dtype=compute)
    reference_paged_attention(query.to(compute), dense, query_start_loc, seq_lens, block_table,
                              result, lse, None, None, None, None, scale, None, None, True)
    out.copy_(result)


def _attention_fake(query, kv_cache, query_start_loc, seq_lens, block_table, plan, out, lse,
                    scale, kv_cache_dtype):
    _check_attention(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse,
                     kv_cache_dtype)


turboquant_attention = define_op(
    "turboquant_attention",
    "(Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, Tensor plan, Tensor(a!) out, Tensor(b!)? lse, float scale, "
    "str kv_cache_dtype) -> ()", _attention_impl, _attention_fake)
