"""FLASH_ATTN: FlashAttention 4 (CuTe-DSL kernels, ``flash_attn.cute``) over the paged cache.

One varlen call serves a whole mixed batch: ``cu_seqlens_q`` from the batch, ``seqused_k`` the
cached lengths, ``page_table`` the block table. The builder only packs host bounds
(``max_seqlen_q``, ``max_seqlen_k``) into a small CPU tensor. On sm100+ the op passes
``num_splits=0`` so FA4 picks split-KV from those host bounds (the same choice on every
CUDA-graph replay with the same bounds). FA4 has no split-KV on sm90 ("SplitKV not supported on
SM 9.0"), so there it runs one split and collapses when there are fewer (request, KV head)
pairs than the GPU has SMs to spare (0.31 TB/s at batch 1, context 32k on the H200, where
FlashInfer's split-KV decode gives 2.4). The builder therefore hands such small decode batches to
FlashInfer's decode kernel when FlashInfer is installed -- same cache, same page table -- and
keeps FA4 for everything else (3.2-4.1 TB/s decode at batch >= 8 and 544-638 TFLOP/s prefill
at page 128, against FlashInfer's 2.5-2.9 and 453-509): the choice is made per step on the host,
and a compiled model sees it as the metadata's type.

Semantics are REFERENCE's: ``sliding_window=W`` is ``window_size=(W-1, 0)`` causal and
``(W-1, W-1)`` otherwise; FA4's LSE ([heads, tokens], natural log) is transposed to
``[tokens, heads]``; sinks are applied from the LSE (FA4's in-kernel sink would fold the sink
into the LSE, which REFERENCE excludes).

FlashAttention 2/3 (``flash_attn_varlen_func`` with ``block_table``) are not wired yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_ops.backend import AttentionBackend
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, HeadDims, MultipleOf,
                                   PackageRequirement)
from attn_ops.platforms import current_platform
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.ops import define_op
from attn_ops.platforms import PlatformKind
from attn_ops.spec import AttentionType, Feature, KVCacheDType

__all__ = ["FlashAttnBackend", "FlashAttnMetadata"]

# Below this many (request, KV head) pairs a single-split FA4 decode leaves most of the H200's
# 132 SMs idle; measured: FlashInfer wins at batch 1 x 8 KV heads, FA4 at batch 8 x 8.
SMALL_DECODE_PAIRS = 32


@dataclass(frozen=True, eq=False)
class FlashAttnMetadata:
    """``bounds`` is a CPU int64 ``[max_seqlen_q, max_seqlen_k]``; the rest live on the device."""

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    page_table: torch.Tensor
    bounds: torch.Tensor
    causal: bool = True


def _check(query, kv_cache, out, lse):
    if query.dim() != 3 or out.shape[:2] != query.shape[:2] or out.dtype != query.dtype:
        raise ValueError(f"query [T, Hq, D] and out [T, Hq, Dv] must agree; got "
                         f"{tuple(query.shape)} {query.dtype} and {tuple(out.shape)} {out.dtype}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[4] != query.shape[2]:
        raise ValueError(f"FLASH_ATTN needs the NHD cache [num_blocks, 2, block_size, "
                         f"num_kv_heads, head_dim={query.shape[2]}], got {tuple(kv_cache.shape)}")
    if lse is not None and (lse.shape != query.shape[:2] or lse.dtype != torch.float32):
        raise ValueError(f"lse must be float32 {tuple(query.shape[:2])}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")


def _flash_attn_attention(query, kv_cache, out, lse, cu_seqlens_q, seqused_k, page_table,
                          bounds, sinks, scale, sliding_window, soft_cap, causal) -> None:
    _check(query, kv_cache, out, lse)
    from flash_attn.cute.interface import _flash_attn_fwd

    max_q, max_k = bounds.tolist()
    splits = 0 if torch.cuda.get_device_capability(query.device)[0] >= 10 else 1
    k_cache, v_cache = kv_cache.unbind(1)
    need_lse = lse is not None or sinks is not None
    lse_hm = torch.empty(query.shape[1], query.shape[0], dtype=torch.float32,
                         device=query.device) if need_lse else None
    left = None if sliding_window is None else sliding_window - 1
    right = None if sliding_window is None or causal else sliding_window - 1
    _flash_attn_fwd(query, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                    max_seqlen_q=max_q, max_seqlen_k=max_k, page_table=page_table,
                    softmax_scale=scale, causal=causal, softcap=soft_cap or 0.0,
                    window_size_left=left, window_size_right=right, num_splits=splits,
                    return_lse=need_lse, out=out, lse=lse_hm)
    if need_lse:
        row_lse = lse_hm.t()
        if lse is not None:
            lse.copy_(row_lse)
        if sinks is not None:
            out.mul_(torch.sigmoid(row_lse - sinks.float()).unsqueeze(-1).to(out.dtype))


def _fake(query, kv_cache, out, lse, *args) -> None:
    _check(query, kv_cache, out, lse)


flash_attn_attention = define_op(
    "flash_attn_attention",
    "(Tensor query, Tensor kv_cache, Tensor(a!) out, Tensor(b!)? lse, Tensor cu_seqlens_q, "
    "Tensor seqused_k, Tensor page_table, Tensor bounds, Tensor? sinks, float scale, "
    "int? sliding_window, float? soft_cap, bool causal) -> ()",
    _flash_attn_attention, _fake, dispatch_keys=("CUDA",))


class FlashAttnBackend(AttentionBackend):
    """FlashAttention 4 varlen over the paged NHD cache; split-KV chosen from host bounds."""

    name = "FLASH_ATTN"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=HeadDims(multiple_of=8, min=8, max=256),
        kv_cache_dtypes=frozenset({KVCacheDType.AUTO}),  # FA4's fp8 path is sm100-only
        block_sizes=(MultipleOf(1),),
        preferred_block_size=128,  # 4.04 TB/s decode at page 128 vs 3.61 at 16 (GPU README)
        features=frozenset({Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.SINKS,
                            Feature.NON_CAUSAL}),
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER_ONLY}),
        min_capability=(9, 0),
        max_capability=(11, 9),
        cudagraph_support=CUDAGraphSupport.NEVER,  # not yet captured and replayed in tests
        packages=(PackageRequirement("flash-attn-4", "flash_attn", "4.0.0b1"),),
        reads_page_tails=True,
    )
    op = flash_attn_attention

    def __init__(self, spec, **options) -> None:
        super().__init__(spec, **options)
        self._small_decode = None  # FlashInfer for small decode batches on sm90, if installed
        platform = current_platform()
        if platform.capability is not None and platform.capability[0] == 9:
            from attn_ops.registry import get_backend_class

            flashinfer = get_backend_class("FLASHINFER")
            if not flashinfer.not_supported_reasons(spec, platform):
                self._small_decode = flashinfer(spec)

    def build_metadata(self, common: CommonAttentionMetadata):
        if not isinstance(common, CommonAttentionMetadata):
            return common  # already built (FA4's or, for a small decode batch, FlashInfer's)
        if (self._small_decode is not None and common.max_query_len == 1
                and common.num_reqs * self.spec.kv_heads < SMALL_DECODE_PAIRS):
            return self._small_decode.build_metadata(common)
        bounds = torch.tensor([common.max_query_len, common.max_seq_len], dtype=torch.int64)
        return FlashAttnMetadata(common.slot_mapping, common.query_start_loc, common.seq_lens,
                                 common.block_table, bounds, common.causal)

    def forward(self, query, kv_cache, metadata, out, **optional) -> None:
        metadata = self.build_metadata(metadata)
        if not isinstance(metadata, FlashAttnMetadata):
            return self._small_decode.forward(query, kv_cache, metadata, out, **optional)
        self.op(*self.op_arguments(query, kv_cache, metadata, out, **optional))

    def op_arguments(self, query, kv_cache, metadata, out, *, lse=None, sinks=None,
                     alibi_slopes=None, k_scale=None, v_scale=None) -> tuple:
        m = metadata
        return (query, kv_cache, out, lse, m.cu_seqlens_q, m.seqused_k, m.page_table, m.bounds,
                sinks, self.scale, self.spec.sliding_window, self.spec.logits_soft_cap,
                self.spec.causal and m.causal)
