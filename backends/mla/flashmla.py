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

Tile-scheduler metadata: a device computation from the step's lengths (FlashMLA's current
interface runs it in the first kernel call of a ``FlashMLASchedMeta``, the older one in
``get_mla_metadata(cache_seqlens, ...)``). It is computed once a step, by the step's first
layer, and reused by every later layer: the step's plan carries a handle
(:attr:`MLAPlan.library`) made fresh by each ``build_metadata``
(:mod:`attn_ops.backends.step_schedules`). A CUDA-graph capture size keeps one handle; the
schedule is recomputed by the first layer of a capture (so the graph holds the computation and
each replay redoes it with the replay's lengths), never taken from an eager call before it.

The MHA part runs the kernel :func:`attn_ops.routing.mla_prefill_kernel` picks, as in
TRITON_MLA.
"""

from __future__ import annotations

import inspect

import torch

from attn_ops.backends.mla.common import (PLAN, AbsorbedLayout, MLABackend, MLAMetadata,
                                          MLAPlan, check_mla_inputs, define_mla_op)
from attn_ops.backends.step_schedules import new_schedule, restart_schedule, step_schedule
from attn_ops.capabilities import BackendCapabilities, CUDAGraphSupport, HeadDims
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.platforms import PlatformKind
from attn_ops.providers import FLASHMLA as PROVIDERS
from attn_ops.routing import FLASHMLA_MAX_ROWS
from attn_ops.spec import Feature, KVCacheDType

__all__ = ["JOINED", "FlashMLABackend", "absorbed_flashmla", "checker", "takes_out"]

PAGE = 64  # FlashMLA's page_block_size
RANK, ROPE = 512, 64  # the latent widths its dense kernel is built for


def _schedule(fm, handle: int | None, lens: torch.Tensor, q_per_head_k: int) -> tuple:
    """The step's tile-scheduler metadata ``(meta, splits)`` for this call
    (:func:`attn_ops.backends.step_schedules.step_schedule`)."""
    def compute() -> tuple:
        if hasattr(fm, "FlashMLASchedMeta"):  # (computed by the kernel call it is passed to)
            return fm.get_mla_metadata()[0], None
        return tuple(fm.get_mla_metadata(lens, q_per_head_k, 1))

    return step_schedule(handle, q_per_head_k, lens, compute)


_TAKES_OUT: dict[object, bool] = {}


def takes_out(fn) -> bool:
    """Whether the provider's kernel call writes into a given ``out`` (newer interfaces)."""
    if fn not in _TAKES_OUT:
        try:
            _TAKES_OUT[fn] = "out" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            _TAKES_OUT[fn] = False
    return _TAKES_OUT[fn]


def absorbed_flashmla(ql, q_pe, latent_cache, query_start_loc, seq_lens, block_table, out,
                      kv_scale, scale, plan: MLAPlan) -> None:
    """FlashMLA's dense decode into ``out`` [rows, heads, rank]: the absorbed part's requests
    as ``[batch, plan.absorbed_max_query_len]`` (right-aligned where lengths differ), the
    query rows ``[ql | q_pe]`` read in place where they are one buffer; every row written (a
    graph's padding rows: anything, zeroed by the caller)."""
    _, fm = PROVIDERS.require("FLASHMLA")
    rows, heads, rank = ql.shape
    b, s_q = seq_lens.shape[0], plan.absorbed_max_query_len
    if b > FLASHMLA_MAX_ROWS:
        raise ValueError(f"FLASHMLA: {b} requests in one step's absorbed part; FlashMLA's tile "
                         f"scheduler takes at most {FLASHMLA_MAX_ROWS} (its shared memory); "
                         "split the step or use COMPOSITE_MLA_SM90 / FLASHINFER_MLA")
    q = _joined(ql, q_pe)
    if q is None or q.dtype != latent_cache.dtype:
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
    meta, splits = _schedule(fm, plan.library, lens, s_q * heads)
    # (an output buffer given to the kernel for one query a request only: with two, vLLM's
    # FlashMLA raised on the H200)
    direct = uniform and s_q == 1 and out.dtype == q.dtype and out.is_contiguous() \
        and takes_out(fm.flash_mla_with_kvcache)
    o, _ = fm.flash_mla_with_kvcache(qb, k_cache, table, lens, rank, meta, splits,
                                     softmax_scale=scale, causal=s_q > 1,
                                     **({"out": out.view(b, s_q, heads, rank)} if direct else {}))
    o = o.view(b * s_q, heads, rank)
    if uniform:
        if not direct:
            out.copy_(o)
    else:
        # (dropped slots: one spare row; a row no slot maps to -- device offsets that do not
        # cover the rows -- stays zero)
        target = torch.where(valid, idx, rows).flatten()
        full = out.new_zeros(rows + 1, heads, rank)
        full.index_copy_(0, target, o.to(out.dtype))
        out.copy_(full[:rows])


def _joined(ql: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor | None:
    """``[ql | q_pe]`` as one ``[rows, heads, rank + rope]`` tensor where the two are the
    column halves of one contiguous buffer (:class:`AbsorbedLayout.joined_query`), else
    None."""
    rows, heads, rank = ql.shape
    width = rank + q_pe.shape[2]
    if (q_pe.dtype != ql.dtype or ql.stride() != (heads * width, width, 1)
            or q_pe.stride() != ql.stride()
            or q_pe.data_ptr() != ql.data_ptr() + rank * ql.element_size()):
        return None
    return ql.as_strided((rows, heads, width), ql.stride())


JOINED = AbsorbedLayout(joined_query=True, writes_every_row=True)


def checker(name: str):
    """The op check of a backend running FlashMLA's dense kernel: the MLA inputs, and a latent
    cache of pages of 64 rows in the query's dtype."""
    def check(*args) -> None:
        check_mla_inputs(*args)
        q, latent_cache = args[0], args[3]
        if latent_cache.dtype != q.dtype or latent_cache.shape[1] != PAGE:
            raise ValueError(f"{name}: latent_cache {tuple(latent_cache.shape)} "
                             f"{latent_cache.dtype} must hold pages of {PAGE} rows in the "
                             f"query's dtype ({q.dtype}); build the cache with "
                             f"block_size={PAGE}")
    return check


def _absorbed(*args) -> None:
    absorbed_flashmla(*args)


flashmla_attention = define_mla_op("flashmla_attention", _absorbed, check=checker("FLASHMLA"),
                                   layout=lambda plan: JOINED)


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

    def plan_library(self, common: CommonAttentionMetadata, num_absorbed: int) -> int:
        """A fresh tile schedule for the step, computed by its first layer."""
        return new_schedule(graph=False)

    def graph_library(self, size: int) -> int:
        return new_schedule(graph=True)

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> MLAMetadata:
        """The plan fixed per capture size (:meth:`MLABackend.fixed_graph_metadata`) with its
        own tile schedule, computed inside the capture: each replay recomputes it from the
        replay's lengths on the device, once, in its first layer."""
        meta = self.fixed_graph_metadata(padded, graphs)
        restart_schedule(PLAN.decode(meta.plan).library)
        return meta
