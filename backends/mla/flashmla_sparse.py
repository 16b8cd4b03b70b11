"""FLASHMLA_SPARSE: DeepSeek-V3.2's sparse MLA on FlashMLA's sparse fp8 kernel (sm90).

The latent cache is FlashMLA's sparse layout, ``kv_cache_dtype="fp8_ds_mla"``
(:mod:`attn_ops.backends.mla.ds_cache`: 656 bytes a token at 512 + 64 -- the latent in fp8
with a scale a 128 values, the rope part in bf16), written by the layer's latent write. Every
token of a step -- decodes and prefill tokens alike -- is one row of FlashMLA's sparse decode
(``flash_mla_with_kvcache`` with ``indices``, ``is_fp8_kvcache=True``): ``[tokens, 1,
heads, 576]`` queries against its selected global slots, which are the indexer's own slots
(``block * page + offset``) as they are. The sparse prefill kernel (``flash_mla_sparse_fwd``)
reads bf16 rows, not this layout, so prefills run as decode rows too (FlashMLA's own tests
time prefills that way).

The selection contract of the sparse family holds: an entry outside the cache (or -1) is made
-1 on the device before the kernel reads it, so FlashMLA skips it; the slots are padded with
-1 to its 64-slot blocks. FlashMLA's kernel takes 64 or 128 query heads: fewer heads are padded
with zero queries, whose outputs are dropped. The tile schedule depends on the shapes only (no
lengths: the selection is the work), so it is computed once per shape and reused, in CUDA
graphs too.
"""

from __future__ import annotations

import torch

from attn_ops.backends.mla.ds_cache import is_ds_cache
from attn_ops.backends.mla.sparse import (SparseMLABackend, check_sparse_mla_inputs,
                                          define_sparse_mla_op, sparse_capabilities)
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, HeadDims,
                                   MultipleOf, Reason)
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.providers import FLASHMLA as PROVIDERS
from attn_ops.spec import AttentionSpec, Feature, KVCacheDType

__all__ = ["FlashMLASparseBackend", "flashmla_sparse_rows"]

RANK, ROPE = 512, 64  # the latent widths of FlashMLA's sparse fp8 kernel
BLOCK_SLOTS = 64  # its selected slots a block: the selection is padded to a multiple
HEAD_COUNTS = (64, 128)  # the query heads its sm90 kernel takes

_SCHEDULES: dict[tuple, tuple] = {}  # (rows, heads, slots, device) -> (meta, splits)


def padded_heads(heads: int) -> int | None:
    """The query heads FlashMLA runs ``heads`` as (zero-padded), None above its largest."""
    return next((h for h in HEAD_COUNTS if heads <= h), None)


def _schedule(fm, key: tuple) -> tuple:
    """The tile schedule of one shape: the current interface computes it in the first kernel
    call of its metadata object and keeps it (it depends on the shapes only)."""
    got = _SCHEDULES.get(key)
    if got is None:
        got = _SCHEDULES[key] = (fm.get_mla_metadata()[0], None)
    return got


def flashmla_sparse_rows(ql, q_pe, latent_cache, topk_slots, out, kv_scale, scale,
                         launch) -> None:
    """FlashMLA's sparse decode of every token over its selected slots into ``out``
    [T, heads, rank] (a token that selects nothing: zeros)."""
    _, fm = PROVIDERS.require("FLASHMLA_SPARSE")
    t, heads, rank = ql.shape
    hp = padded_heads(heads)
    capacity = latent_cache.shape[0] * latent_cache.shape[1]
    k = topk_slots.shape[1]
    kp = -(-k // BLOCK_SLOTS) * BLOCK_SLOTS
    valid = (topk_slots >= 0) & (topk_slots < capacity)  # (never trusted: made -1 here)
    slots = torch.where(valid, topk_slots, -1).to(torch.int32)
    if kp != k:
        slots = torch.nn.functional.pad(slots, (0, kp - k), value=-1)
    slots = slots.unsqueeze(1)
    if hp == heads:
        q = torch.cat([ql, q_pe.to(ql.dtype)], dim=-1).unsqueeze(1)
    else:  # (zero queries for the heads FlashMLA runs beyond ours; their rows are dropped)
        q = ql.new_zeros(t, 1, hp, rank + q_pe.shape[2])
        q[:, 0, :heads, :rank] = ql
        q[:, 0, :heads, rank:] = q_pe
    meta, splits = _schedule(fm, (t, hp, kp, str(ql.device),
                                  ql.is_cuda and torch.cuda.is_current_stream_capturing()))
    o, _ = fm.flash_mla_with_kvcache(q, latent_cache.unsqueeze(2), None, None, rank, meta,
                                     splits, softmax_scale=scale, causal=False,
                                     is_fp8_kvcache=True, indices=slots)
    out.copy_(o[:, 0, :heads])


def _check(*args) -> None:
    check_sparse_mla_inputs(*args)
    q, latent_cache, w_uk = args[0], args[1], args[2]
    if not is_ds_cache(latent_cache, w_uk.shape[2], ROPE) or q.dtype != torch.bfloat16:
        raise ValueError(f"FLASHMLA_SPARSE: latent_cache {latent_cache.dtype} "
                         f"{tuple(latent_cache.shape)} must be FlashMLA's fp8_ds_mla rows "
                         f"(656 bytes at 512 + 64) and q bfloat16 (got {q.dtype}); build the "
                         "spec with kv_cache_dtype='fp8_ds_mla' and allocate the cache with "
                         "MLAAttention.allocate_cache")


flashmla_sparse = define_sparse_mla_op("flashmla_sparse", flashmla_sparse_rows, check=_check)


class FlashMLASparseBackend(SparseMLABackend):
    """FlashMLA's sparse fp8 decode (sm90) for every token of a step; bf16 models, latents of
    512 + 64 in FlashMLA's fp8_ds_mla layout, up to 128 heads, any page size. CUDA graphs: any
    batch (the op reads no host value)."""

    name = "FLASHMLA_SPARSE"
    capabilities = sparse_capabilities(BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA}),
        dtypes=frozenset({torch.bfloat16}),
        head_dims=HeadDims(),
        kv_cache_dtypes=frozenset({KVCacheDType.FP8_DS_MLA}),
        block_sizes=(MultipleOf(1),),
        preferred_block_size=64,
        features=frozenset({Feature.MLA, Feature.DIFF_HEAD_DIM_V, Feature.FP8_KV}),
        min_capability=(9, 0),
        max_capability=(9, 0),
        cudagraph_support=CUDAGraphSupport.ALWAYS,
    ))
    op = flashmla_sparse

    latent_widths = (RANK, ROPE)
    latent_kernel = "FlashMLA's sparse fp8 kernel"
    kernel_providers = PROVIDERS

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        if spec.use_mla and padded_heads(spec.num_heads) is None:
            reasons.append(Reason(cls.name, "num_heads", f"num_heads={spec.num_heads}: "
                                  f"FlashMLA's sparse kernel takes at most {HEAD_COUNTS[-1]} "
                                  "query heads", "shard the heads (tensor parallel) or use "
                                  "TRITON_MLA_SPARSE"))
        return reasons

    def launch(self, metadata) -> list[int]:
        return []
