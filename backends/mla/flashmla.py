"""FLASHMLA: DeepSeek's FlashMLA dense decode kernel for the absorbed form.

The kernel comes from whichever provider is usable (:data:`attn_ops.providers.FLASHMLA`:
DeepSeek's ``flash_mla`` or vLLM's bundled copy). It reads our latent cache as its
``k_cache`` ``[blocks, 64, 1, rank + rope]`` (a view: one latent head), queries as ``[batch,
queries, heads, rank + rope]`` and writes ``[batch, queries, heads, rank]`` latent outputs;
queries past a row's position are masked causally, aligned to the request's last key.

Decodes batch as they are. An absorbed part of several query lengths (speculative decodes and
short prefills beside decodes) is laid out right-aligned in ``[batch, longest query]``: a
request's queries take the last slots of its row, so FlashMLA's bottom-right causal mask is
the request's own; the slots before them are read from any row and their outputs dropped. The
layout is built on the device from ``query_start_loc`` (no host read, graph-safe).

Tile-scheduler metadata: FlashMLA's current interface (``FlashMLASchedMeta``) computes it in
the first call of a metadata object, from that call's lengths on the device; a fresh object a
step keeps it that step's (a CUDA graph replays the computation with the replay's lengths).
The older interface's ``get_mla_metadata(cache_seqlens, ...)`` is the same device computation,
called the same way.

The MHA part runs the kernel :func:`attn_ops.routing.mla_prefill_kernel` picks, as in
TRITON_MLA. Tested on the CPU against a stand-in with FlashMLA's call signature and documented
semantics; not yet run on a GPU, so it ranks after FLASHINFER_MLA.
"""

from __future__ import annotations

import torch

from attn_ops.backends.mla.common import (MLABackend, MLAMetadata, MLAPlan, check_mla_inputs,
                                          define_mla_op)
from attn_ops.capabilities import BackendCapabilities, CUDAGraphSupport, HeadDims
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.platforms import PlatformKind
from attn_ops.providers import FLASHMLA as PROVIDERS
from attn_ops.spec import Feature, KVCacheDType

__all__ = ["FlashMLABackend", "absorbed_flashmla"]

PAGE = 64  # FlashMLA's page_block_size
RANK, ROPE = 512, 64  # the latent widths its dense kernel is built for


def absorbed_flashmla(ql, q_pe, latent_cache, query_start_loc, seq_lens, block_table, out,
                      kv_scale, scale, plan: MLAPlan) -> None:
    """FlashMLA's dense decode into ``out`` [rows, heads, rank]: the absorbed part's requests
    as ``[batch, plan.absorbed_max_query_len]`` (right-aligned where lengths differ); rows
    past ``query_start_loc[-1]`` (graph padding) are zero."""
    _, fm = PROVIDERS.require("FLASHMLA")
    rows, heads, rank = ql.shape
    b, s_q = seq_lens.shape[0], plan.absorbed_max_query_len
    q = torch.cat([ql.to(latent_cache.dtype), q_pe.to(latent_cache.dtype)], dim=-1)
    uniform = rows == b * s_q
    if uniform:
        qb = q.view(b, s_q, heads, -1)
    else:
        starts = query_start_loc.long()
        idx = starts[1:, None] - s_q + torch.arange(s_q, device=q.device)
        valid = idx >= starts[:-1, None]
        qb = q[idx.clamp(0, max(rows - 1, 0)).flatten()].view(b, s_q, heads, -1)
    k_cache = latent_cache.unsqueeze(2)
    lens, table = seq_lens.to(torch.int32), block_table.to(torch.int32)
    if hasattr(fm, "FlashMLASchedMeta"):
        meta, splits = fm.get_mla_metadata()[0], None
    else:
        meta, splits = fm.get_mla_metadata(lens, s_q * heads, 1)
    o, _ = fm.flash_mla_with_kvcache(qb, k_cache, table, lens, rank, meta, splits,
                                     softmax_scale=scale, causal=s_q > 1)
    o = o.view(b * s_q, heads, rank)
    if uniform:
        out.copy_(o)
    else:
        target = torch.where(valid, idx, rows).flatten()  # (dropped slots: one spare row)
        full = out.new_empty(rows + 1, heads, rank)
        full.index_copy_(0, target, o.to(out.dtype))
        out.copy_(full[:rows])
    padding = torch.arange(rows, device=out.device) >= query_start_loc[-1]
    out.masked_fill_(padding[:, None, None], 0.0)


def _check(*args) -> None:
    check_mla_inputs(*args)
    q, latent_cache = args[0], args[3]
    if latent_cache.dtype != q.dtype or latent_cache.shape[1] != PAGE:
        raise ValueError(f"FLASHMLA: latent_cache {tuple(latent_cache.shape)} "
                         f"{latent_cache.dtype} must hold pages of {PAGE} rows in the query's "
                         f"dtype ({q.dtype}); build the cache with block_size={PAGE}")


def _absorbed(*args) -> None:
    absorbed_flashmla(*args)


flashmla_attention = define_mla_op("flashmla_attention", _absorbed, check=_check)


class FlashMLABackend(MLABackend):
    """FlashMLA's dense decode (sm90 / sm100) over pages of 64 latent rows; bf16 / fp16
    latents of 512 + 64."""

    name = "FLASHMLA"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=HeadDims(),
        kv_cache_dtypes=frozenset({KVCacheDType.AUTO}),
        block_sizes=(PAGE,),
        preferred_block_size=PAGE,
        features=frozenset({Feature.MLA, Feature.DIFF_HEAD_DIM_V}),
        min_capability=(9, 0),
        max_capability=(10, 3),
        cudagraph_support=CUDAGraphSupport.UNIFORM_BATCH,
    )
    op = flashmla_attention

    latent_widths = (RANK, ROPE)
    latent_kernel = "FlashMLA's dense kernel"
    kernel_providers = PROVIDERS

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> MLAMetadata:
        """The plan fixed per capture size (:meth:`MLABackend.fixed_graph_metadata`); each
        replay's scheduler metadata is computed from its lengths on the device."""
        return self.fixed_graph_metadata(padded, graphs)
