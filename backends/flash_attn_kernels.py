"""FlashAttention's kernels called on the paged cache: FA4 (``flash_attn.cute``), FA3
(``flash_attn_interface`` or vLLM's ``vllm_flash_attn``) and FA2 (``flash_attn``), with
REFERENCE's semantics.

Shared by the backends that run FlashAttention (FLASH_ATTN, FLASH_ATTN_DIFFKV, COMPOSITE_SM90):
they route (tile, batch mode: :mod:`attn_ops.routing`) and these run what they were told.
``sliding_window=W`` is ``window_size=(W-1, 0)`` causal and ``(W-1, W-1)`` otherwise; the LSE
FlashAttention returns is ``[heads, tokens]`` in natural log (:func:`finish_lse` turns it into
``[tokens, heads]`` and applies sinks from it -- FA4's in-kernel sink would fold the sink into
the LSE, which REFERENCE excludes).
"""

from __future__ import annotations

import torch

from attn_ops.backends.step_schedules import step_schedule
from attn_ops.capabilities import Reason
from attn_ops.ops import apply_sinks
from attn_ops.platforms import Platform
from attn_ops.spec import AttentionSpec
from attn_ops.tuning import FA4Tile

__all__ = ["fa3_fp8_query", "fa4_head_dim_reasons", "fa_window", "finish_lse", "run_fa2",
           "run_fa3", "run_fa4"]


def fa4_head_dim_reasons(name: str, spec: AttentionSpec, platform: Platform) -> list[Reason]:
    """FA4's head-dim rules over a paged cache (flash_attn.cute.interface / flash_fwd_sm90):
    pages not equal to its KV tile take a non-TMA path that needs head dims filling its
    16-wide tiles; sm100/sm110 take dims up to 128, (192, 128) or (256, 256)."""
    reasons = []
    dims = (spec.head_dim, spec.v_head_dim)
    if any(d % 16 for d in dims):
        reasons.append(Reason(name, "head_dim", f"(head_dim, head_dim_v)={dims}: FlashAttention 4 "
                              "over a paged cache needs multiples of 16"))
    cap = platform.capability
    if cap is not None and cap[0] in (10, 11) and not (
            max(dims) <= 128 or dims in ((192, 128), (256, 256))):
        reasons.append(Reason(name, "head_dim", f"(head_dim, head_dim_v)={dims} is not supported "
                              "by FlashAttention 4 on sm100/sm110 (<= 128, (192, 128) or "
                              "(256, 256))"))
    return reasons


def fa_window(sliding_window, causal):
    """REFERENCE's window as FlashAttention's (left, right); None = unbounded."""
    if sliding_window is None:
        return None, None
    return sliding_window - 1, (None if causal else sliding_window - 1)


def run_fa4(query, k_cache, v_cache, out, cu_seqlens_q, seqused_k, page_table, max_q, max_k,
            scale, left, right, soft_cap, causal, need_lse, *, tile: FA4Tile | None = None,
            padded: bool = False, batch: int | None = None):
    """FA4's forward into ``out`` in ``tile`` (None: FA4's own); returns its LSE ``[heads,
    tokens]`` if asked. With ``padded`` (rows past the real tokens, counted on the device
    only) the LSE starts zeroed, as FA4 leaves those rows unwritten. ``batch``: the rows are
    that many requests of one length each, run in FA4's batch mode (not with ``padded``).
    On sm100+ FA4 picks split-KV itself (``num_splits=0``); sm90 has none."""
    from flash_attn.cute.interface import _flash_attn_fwd

    major = torch.cuda.get_device_capability(query.device)[0] if query.is_cuda else 9
    splits = 0 if major >= 10 else 1
    heads, tokens = query.shape[1], query.shape[0]
    lse_shape = (batch, heads, tokens // batch) if batch else (heads, tokens)
    lse = None
    if need_lse:
        lse = (torch.zeros if padded else torch.empty)(lse_shape, dtype=torch.float32,
                                                       device=query.device)
    if batch:
        query, out = query.view(batch, -1, *query.shape[1:]), out.view(batch, -1, *out.shape[1:])
        varlen = {}
    else:
        varlen = dict(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_q, max_seqlen_k=max_k)
    _flash_attn_fwd(query, k_cache, v_cache, seqused_k=seqused_k, page_table=page_table,
                    softmax_scale=scale, causal=causal, softcap=soft_cap or 0.0,
                    window_size_left=left, window_size_right=right, num_splits=splits,
                    return_lse=need_lse, out=out, lse=lse, **varlen,
                    **(tile.kwargs() if tile is not None else {}))
    if batch and lse is not None:  # [B, heads, S] -> [heads, B * S]
        lse = lse.transpose(0, 1).reshape(heads, tokens)
    return lse


def fa3_takes_sinks() -> bool:
    """Whether the FA3 provider serving here applies attention sinks itself (vLLM's build:
    ``s_aux``), so no LSE pass is needed for them."""
    from attn_ops.providers import FA3

    return FA3.require("FLASH_ATTN")[0].distribution == "vllm"


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def fa3_fp8_query(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The query as FA3's fp8 path takes it (its q, k and v share one dtype): float8_e4m3fn at
    one scale for the whole tensor, ``amax / 448`` computed on the device (no host read), and
    that scale (fp32, 0-dim) -- the descale FA3 multiplies the scores by."""
    amax = torch.linalg.vector_norm(query, float("inf"), dtype=torch.float32)
    descale = torch.clamp(amax / FP8_MAX, min=torch.finfo(torch.float32).tiny)
    q8 = torch.clamp(query * (1.0 / descale).to(query.dtype), -FP8_MAX, FP8_MAX)
    return q8.to(torch.float8_e4m3fn), descale


def _fa3_schedule(fa3, handle, query, k_cache, v_cache, cu_seqlens_q, seqused_k, max_q, max_k,
                  causal, window, soft_cap, num_splits):
    """FA3's scheduler metadata of this call (its split counts and tile order, a device
    computation over the step's lengths), shared by the step's layers of the same shapes
    (:mod:`attn_ops.backends.step_schedules`); None where the provider has no
    ``get_scheduler_metadata`` (the kernel then computes it itself)."""
    fn = getattr(fa3, "get_scheduler_metadata", None)
    if fn is None or not handle:
        return None
    batch, page = seqused_k.shape[0], k_cache.shape[1]
    heads, kv_heads, dim, dim_v = (query.shape[1], k_cache.shape[2], query.shape[2],
                                   v_cache.shape[3])
    key = ("fa3", batch, max_q, max_k, heads, kv_heads, dim, dim_v, query.dtype, page, causal,
           window, bool(soft_cap), num_splits)
    return step_schedule(handle, key, seqused_k, lambda: fn(
        batch_size=batch, max_seqlen_q=max_q, max_seqlen_k=max_k, num_heads_q=heads,
        num_heads_kv=kv_heads, headdim=dim, cache_seqlens=seqused_k, qkv_dtype=query.dtype,
        headdim_v=dim_v, cu_seqlens_q=cu_seqlens_q, page_size=page, causal=causal,
        window_size=window, has_softcap=bool(soft_cap), num_splits=num_splits))


def run_fa3(query, k_cache, v_cache, out, cu_seqlens_q, seqused_k, page_table, max_q, max_k,
            scale, left, right, soft_cap, causal, need_lse, sinks=None, *, schedule=None,
            num_splits=0, k_scale=None, v_scale=None, padded=False):
    """FA3's forward into ``out`` from whichever provider serves it here
    (:data:`attn_ops.providers.FA3`): FlashAttention's hopper build (``flash_attn_with_kvcache``
    over the pages) or vLLM's ``vllm_flash_attn`` (``flash_attn_varlen_func`` with a block
    table, ``fa_version=3``; ``sinks`` applied by it as ``s_aux``, only where
    :func:`fa3_takes_sinks`, in bf16: the only dtype it takes). Returns its LSE ``[heads,
    tokens]`` if asked.

    ``schedule``: the step's handle for its scheduler metadata (:func:`_fa3_schedule`);
    ``num_splits``: FA3's split-KV count (0: its heuristic). An fp8 e4m3 cache runs FA3's fp8
    kernel: the query quantized by :func:`fa3_fp8_query`, ``k_scale`` / ``v_scale`` (per
    tensor) as the descales of every (request, KV head). ``padded``: rows past the real
    tokens (counted on the device only), which FA3 leaves as they were, come back zero in
    ``out`` and in the LSE."""
    from attn_ops.providers import FA3

    provider, fa3 = FA3.require("FLASH_ATTN")
    window = (-1 if left is None else left, -1 if right is None else right)
    fp8 = {}
    if k_cache.dtype == torch.float8_e4m3fn:
        query, q_descale = fa3_fp8_query(query)
        shape = (seqused_k.shape[0], k_cache.shape[2])
        fp8 = {"q_descale": q_descale.view(1, 1).expand(shape),
               "k_descale": k_scale.float().view(1, 1).expand(shape),
               "v_descale": v_scale.float().view(1, 1).expand(shape)}
    metadata = _fa3_schedule(fa3, schedule, query, k_cache, v_cache, cu_seqlens_q, seqused_k,
                             max_q, max_k, causal, window, soft_cap, num_splits)
    if provider.distribution == "vllm":
        result = fa3.flash_attn_varlen_func(
            q=query, k=k_cache, v=v_cache, max_seqlen_q=max_q, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_k=max_k, seqused_k=seqused_k, block_table=page_table,
            softmax_scale=scale, causal=causal, window_size=list(window),
            softcap=soft_cap or 0.0, return_softmax_lse=need_lse, out=out, fa_version=3,
            scheduler_metadata=metadata, num_splits=num_splits,
            **fp8, **({"s_aux": sinks} if sinks is not None else {}))
    else:
        if sinks is not None:
            raise ValueError(f"{provider.label} takes no sinks; apply them from the LSE")
        result = fa3.flash_attn_with_kvcache(
            query, k_cache, v_cache, cache_seqlens=seqused_k, page_table=page_table,
            cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_q, softmax_scale=scale, causal=causal,
            window_size=window, softcap=soft_cap or 0.0, scheduler_metadata=metadata,
            num_splits=num_splits, return_softmax_lse=need_lse, **fp8)
    o, lse_hm = result if need_lse else (result, None)
    real = None
    if padded:
        real = torch.arange(query.shape[0], device=query.device) < cu_seqlens_q[-1]
        lse_hm = None if lse_hm is None else lse_hm.where(real, 0.0)
    if o.data_ptr() != out.data_ptr():
        out.copy_(o)
    if real is not None:
        out.masked_fill_(~real[:, None, None], 0.0)
    return lse_hm


def run_fa2(query, k_cache, v_cache, out, cu_seqlens_q, cu_seqlens_k, page_table, max_q,
             max_k, scale, left, right, soft_cap, alibi_slopes, causal, need_lse):
    from flash_attn import flash_attn_varlen_func

    result = flash_attn_varlen_func(
        query, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale=scale,
        causal=causal, window_size=(-1 if left is None else left, -1 if right is None else right),
        softcap=soft_cap or 0.0, alibi_slopes=alibi_slopes, return_attn_probs=need_lse,
        block_table=page_table)
    o, lse_hm = (result[0], result[1]) if need_lse else (result, None)
    out.copy_(o)
    return lse_hm


def finish_lse(out, lse, sinks, lse_hm) -> None:
    """FlashAttention's LSE ``[heads, tokens]`` (natural log) into ``lse [tokens, heads]``, and
    the sinks applied from it."""
    if lse_hm is None:
        return
    row_lse = lse_hm.t()
    if lse is not None:
        lse.copy_(row_lse)
    if sinks is not None:
        apply_sinks(out, row_lse, sinks)
