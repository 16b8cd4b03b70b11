"""FLASH_ATTN_MLA: FlashAttention 3's MLA path for the absorbed form (sm90).

FA3 takes the absorbed query in two parts -- ``q`` (the rope part, against the keys' rope
columns) and ``q_v`` (the latent part, against the values themselves) -- so the score is
``q_pe . k_pe + q_latent . c`` and the output the softmax over ``c``: exactly the absorbed form
over our latent cache, read as two strided views (``k`` = the rope columns, ``v`` = the latent
columns, one KV head). Varlen over the absorbed part's rows (``cu_seqlens_q``,
``seqused_k``, the block table), causal bottom-right, so decodes, speculative decodes and short
prefills run in one call; rows of no request (graph padding) are left as the caller zeroed them
(vLLM's build writes into the output given) or zeroed after it (the hopper build's returns one).

The kernel comes from whichever FA3 provider is usable (:data:`attn_ops.providers.FA3`):
FlashAttention's hopper build (``flash_attn_with_kvcache(..., qv=)``) or vLLM's
``vllm_flash_attn`` (``flash_attn_varlen_func(..., q_v=, fa_version=3)``). The MHA part runs
the kernel :func:`attn_ops.routing.mla_prefill_kernel` picks, as in TRITON_MLA. Run on the H200
through vLLM's build; the hopper build's glue is tested against a stand-in of its signature.
"""

from __future__ import annotations

import torch

from attn_ops.backends.mla.common import (MLABackend, MLAMetadata, MLAPlan, check_mla_inputs,
                                          define_mla_op)
from attn_ops.capabilities import BackendCapabilities, CUDAGraphSupport, HeadDims, MultipleOf
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.platforms import PlatformKind
from attn_ops.providers import FA3
from attn_ops.spec import Feature, KVCacheDType

__all__ = ["FlashAttnMLABackend", "absorbed_fa3"]

RANK, ROPE = 512, 64  # FA3's MLA head dims: q / k 64, q_v / v 512


def absorbed_fa3(ql, q_pe, latent_cache, query_start_loc, seq_lens, block_table, out,
                 kv_scale, scale, plan: MLAPlan) -> None:
    """FA3's MLA forward into ``out`` [rows, heads, rank]; rows of no request stay zero."""
    provider, fa3 = FA3.require("FLASH_ATTN_MLA")
    rows, heads, rank = ql.shape
    k = latent_cache[:, :, rank:].unsqueeze(2)  # [blocks, page, 1, rope]
    v = latent_cache[:, :, :rank].unsqueeze(2)  # [blocks, page, 1, rank]
    q_pe = q_pe.to(latent_cache.dtype)
    ql = ql.to(latent_cache.dtype)
    qsl, lens = query_start_loc.to(torch.int32), seq_lens.to(torch.int32)
    table = block_table.to(torch.int32)
    max_q = max(plan.absorbed_max_query_len, 1)
    if provider.distribution == "vllm":  # (rows of no request: left as the caller made them)
        fa3.flash_attn_varlen_func(
            q=q_pe, k=k, v=v, q_v=ql, max_seqlen_q=max_q, cu_seqlens_q=qsl,
            max_seqlen_k=table.shape[1] * latent_cache.shape[1], seqused_k=lens,
            block_table=table, softmax_scale=scale, causal=True, fa_version=3, out=out)
        return
    o = fa3.flash_attn_with_kvcache(
        q_pe, k, v, qv=ql, cache_seqlens=lens, page_table=table, cu_seqlens_q=qsl,
        max_seqlen_q=max_q, softmax_scale=scale, causal=True)
    out.copy_(o)
    padding = torch.arange(rows, device=out.device) >= query_start_loc[-1]
    out.masked_fill_(padding[:, None, None], 0.0)


def _check(*args) -> None:
    check_mla_inputs(*args)
    q, latent_cache = args[0], args[3]
    if latent_cache.dtype != q.dtype:
        raise ValueError(f"FLASH_ATTN_MLA: latent_cache dtype {latent_cache.dtype} must be the "
                         f"query's ({q.dtype})")


flash_attn_mla_attention = define_mla_op("flash_attn_mla_attention", absorbed_fa3,
                                         check=_check)


class FlashAttnMLABackend(MLABackend):
    """FlashAttention 3's MLA path (``q_v``) on sm90 over pages of multiples of 16; bf16 / fp16
    latents of 512 + 64."""

    name = "FLASH_ATTN_MLA"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=HeadDims(),
        kv_cache_dtypes=frozenset({KVCacheDType.AUTO}),
        block_sizes=(MultipleOf(16),),
        preferred_block_size=64,
        features=frozenset({Feature.MLA, Feature.DIFF_HEAD_DIM_V}),
        min_capability=(9, 0),
        max_capability=(9, 0),
        cudagraph_support=CUDAGraphSupport.UNIFORM_BATCH,
    )
    op = flash_attn_mla_attention

    latent_widths = (RANK, ROPE)
    latent_kernel = "FlashAttention 3's MLA path"
    kernel_providers = FA3

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> MLAMetadata:
        """The plan fixed per capture size (:meth:`MLABackend.fixed_graph_metadata`)."""
        return self.fixed_graph_metadata(padded, graphs)
