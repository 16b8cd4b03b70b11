"""FLASHMLA_SPARSE: DeepSeek-V3.2's sparse MLA on FlashMLA's sparse kernels (sm90).

Two caches, two kernels, as vLLM runs them:

* ``kv_cache_dtype="fp8_ds_mla"`` -- FlashMLA's sparse layout
  (:mod:`attn_ops.backends.mla.ds_cache`: 656 bytes a token at 512 + 64, the latent in fp8 with
  a scale a 128 values, the rope part in bf16), written by the layer's latent write. Every
  token of a step -- decodes and prefill tokens alike -- is one row of FlashMLA's sparse decode
  (``flash_mla_with_kvcache`` with ``indices``, ``is_fp8_kvcache=True``): ``[tokens, 1, heads,
  576]`` queries against their selected global slots, in calls of at most
  ``Tuning.mla.flashmla_rows_a_call`` rows (its tile scheduler's bound). Its prefill kernel reads bf16 rows
  only, not this layout.
* ``kv_cache_dtype="auto"`` (bf16 latents of 512 + 64) -- every token through FlashMLA's sparse
  prefill kernel (``flash_mla_sparse_fwd``), which reads the cache in place as ``[slots, 1,
  576]`` rows: one launch a step, no schedule.

The selected slots are the indexer's own (``block * page + offset``), as they are. The selection
contract of the sparse family holds: an entry outside the cache (or -1) is skipped -- made -1 on
the device before the decode kernel reads it; the prefill kernel skips any entry outside ``[0,
slots)`` itself, so int32 slots reach it as they are. The slots are padded with -1 to the
kernel's blocks (64 slots for the decode, 128 for the prefill kernel). Both kernels take 64 or
128 query heads: fewer heads are padded with zero queries, whose outputs are dropped. The decode
kernel's tile schedule depends on the shapes only (no lengths: the selection is the work), so
it is computed once per shape and reused, in CUDA graphs too.
"""

from __future__ import annotations

import torch

from attn_ops.backends.mla.ds_cache import is_ds_cache
from attn_ops.backends.mla.flashmla import takes_out
from attn_ops.backends.mla.sparse import (SparseMLABackend, check_sparse_mla_inputs,
                                          define_sparse_mla_op, sparse_capabilities)
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, HeadDims,
                                   MultipleOf, Reason)
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.providers import FLASHMLA as PROVIDERS
from attn_ops.routing import FLASHMLA_MAX_ROWS
from attn_ops.spec import AttentionSpec, Feature, KVCacheDType
from attn_ops.tuning import default_tuning

__all__ = ["FlashMLASparseBackend", "flashmla_sparse_rows"]

RANK, ROPE = 512, 64  # the latent widths of FlashMLA's sparse kernels
BLOCK_SLOTS = 64  # the decode kernel's selected slots a block: the selection is padded to it
PREFILL_BLOCK_SLOTS = 128  # the prefill kernel's (two blocks of 64 a step, no bound checks)
HEAD_COUNTS = (64, 128)  # the query heads its sm90 kernels take

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


def _query(ql, q_pe, heads_run: int) -> torch.Tensor:
    """``[T, heads_run, rank + rope]``: ``[ql | q_pe]``, zero queries for the heads the kernel
    runs beyond ours (their rows are dropped)."""
    t, heads, rank = ql.shape
    if heads_run == heads:
        return torch.cat([ql, q_pe.to(ql.dtype)], dim=-1)
    q = ql.new_zeros(t, heads_run, rank + q_pe.shape[2])
    q[:, :heads, :rank] = ql
    q[:, :heads, rank:] = q_pe
    return q


def _padded_slots(slots: torch.Tensor, block: int) -> torch.Tensor:
    """``[T, 1, k rounded up to block]`` int32, padded with -1."""
    k = slots.shape[1]
    kp = -(-k // block) * block
    if kp != k:
        slots = torch.nn.functional.pad(slots, (0, kp - k), value=-1)
    return slots.unsqueeze(1)


def flashmla_sparse_rows(ql, q_pe, latent_cache, topk_slots, out, kv_scale, scale,
                         launch) -> None:
    """FlashMLA's sparse attention of every token over its selected slots into ``out``
    [T, heads, rank] (a token that selects nothing: zeros): the decode kernel over an
    fp8_ds_mla cache, the prefill kernel over a bf16 one."""
    _, fm = PROVIDERS.require("FLASHMLA_SPARSE")
    t, heads, rank = ql.shape
    hp = padded_heads(heads)
    capacity = latent_cache.shape[0] * latent_cache.shape[1]
    if t == 0:
        return
    if latent_cache.dtype != torch.float8_e4m3fn:
        _prefill_kernel_rows(fm, ql, q_pe, latent_cache, topk_slots, out, scale, hp, capacity)
        return
    valid = (topk_slots >= 0) & (topk_slots < capacity)  # (never trusted: made -1 here)
    slots = _padded_slots(torch.where(valid, topk_slots, -1).to(torch.int32), BLOCK_SLOTS)
    q = _query(ql, q_pe, hp).unsqueeze(1)
    capturing = ql.is_cuda and torch.cuda.is_current_stream_capturing()
    per_call = min(default_tuning().mla.flashmla_rows_a_call, FLASHMLA_MAX_ROWS)
    for r0 in range(0, t, per_call):
        r1 = min(r0 + per_call, t)
        meta, splits = _schedule(fm, (r1 - r0, hp, slots.shape[2], str(ql.device), capturing))
        o, _ = fm.flash_mla_with_kvcache(q[r0:r1], latent_cache.unsqueeze(2), None, None, rank,
                                         meta, splits, softmax_scale=scale, causal=False,
                                         is_fp8_kvcache=True, indices=slots[r0:r1])
        out[r0:r1].copy_(o[:, 0, :heads])


def _prefill_kernel_rows(fm, ql, q_pe, latent_cache, topk_slots, out, scale, hp,
                         capacity) -> None:
    """``flash_mla_sparse_fwd`` over the bf16 cache read in place as ``[slots, 1, 576]``: it
    skips entries outside ``[0, slots)`` itself; int64 selections are bounded first (their
    int32 cast could wrap into the cache)."""
    heads = ql.shape[1]
    slots = topk_slots
    if slots.dtype != torch.int32:
        slots = torch.where((slots >= 0) & (slots < capacity), slots, -1).to(torch.int32)
    slots = _padded_slots(slots, PREFILL_BLOCK_SLOTS)
    kv = latent_cache.view(capacity, 1, latent_cache.shape[2])
    q = _query(ql, q_pe, hp)
    direct = (hp == heads and out.dtype == q.dtype and out.is_contiguous()
              and takes_out(fm.flash_mla_sparse_fwd))
    o = fm.flash_mla_sparse_fwd(q, kv, slots, scale, ql.shape[2],
                                **({"out": out} if direct else {}))[0]
    if not direct:
        out.copy_(o[:, :heads])


def _check(*args) -> None:
    check_sparse_mla_inputs(*args)
    q, latent_cache, w_uk = args[0], args[1], args[2]
    ds = is_ds_cache(latent_cache, w_uk.shape[2], ROPE)
    bf16 = latent_cache.dtype == torch.bfloat16 and latent_cache.shape[2] == RANK + ROPE
    if not (ds or bf16) or q.dtype != torch.bfloat16 or w_uk.shape[2] != RANK:
        raise ValueError(f"FLASHMLA_SPARSE: latent_cache {latent_cache.dtype} "
                         f"{tuple(latent_cache.shape)} must be FlashMLA's fp8_ds_mla rows "
                         f"(656 bytes at 512 + 64) or bfloat16 rows of 576, and q bfloat16 "
                         f"(got {q.dtype}); build the spec with kv_cache_dtype='fp8_ds_mla' or "
                         "'auto' and allocate the cache with MLAAttention.allocate_cache")


flashmla_sparse = define_sparse_mla_op("flashmla_sparse", flashmla_sparse_rows, check=_check)


class FlashMLASparseBackend(SparseMLABackend):
    """FlashMLA's sparse kernels (sm90) for every token of a step: its fp8 decode over an
    fp8_ds_mla cache, its prefill kernel over a bf16 one; bf16 models, latents of 512 + 64,
    up to 128 heads, any page size. CUDA graphs: any batch (the op reads no host value)."""

    name = "FLASHMLA_SPARSE"
    capabilities = sparse_capabilities(BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA}),
        dtypes=frozenset({torch.bfloat16}),
        head_dims=HeadDims(),
        kv_cache_dtypes=frozenset({KVCacheDType.FP8_DS_MLA, KVCacheDType.AUTO}),
        block_sizes=(MultipleOf(1),),
        preferred_block_size=64,
        features=frozenset({Feature.MLA, Feature.DIFF_HEAD_DIM_V, Feature.FP8_KV}),
        min_capability=(9, 0),
        max_capability=(9, 0),
        cudagraph_support=CUDAGraphSupport.ALWAYS,
    ))
    op = flashmla_sparse

    latent_widths = (RANK, ROPE)
    latent_kernel = "FlashMLA's sparse MLA"
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
