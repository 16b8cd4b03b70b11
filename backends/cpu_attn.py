"""CPU_ATTN: the fast CPU path -- per-request gather of the paged cache + PyTorch's CPU flash
kernel.

Design. For each request we gather only the pages that hold its visible keys (a sliding window
skips whole pages before the window) into one contiguous ``[L, Hkv, D]`` block with a single
``index_select``, then call ``aten._scaled_dot_product_flash_attention_for_cpu`` on strided
views (no further copies), which also returns the natural-log LSE. Decodes pack the query heads
of each KV head into the query dimension (``[1, Hkv, group, D]``), so GQA/MQA decode reads K/V
once and needs no mask. Prefills use ``is_causal`` when the query block is the whole sequence,
and an explicit mask for chunked prefill and sliding windows. Sinks are applied to the kernel's
output from its LSE: ``out *= sigmoid(lse - sink)``. Features the flash kernel cannot express
(logits soft-cap, ALiBi) run through a float32 (fp64 for fp64) matmul path. Different QK and V head dims are
zero-padded to the larger one (zeros change neither scores nor values).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn_ops.backend import AttentionBackend
from attn_ops.capabilities import BackendCapabilities, CUDAGraphSupport, HeadDims
from attn_ops.kv_cache import gather_tokens, split_kv_cache
from attn_ops.ops import (PAGED_ATTENTION_SCHEMA, check_paged_attention_inputs,
                          check_paged_attention_values, debug_checks_enabled, define_op)
from attn_ops.platforms import PlatformKind
from attn_ops.spec import AttentionType, Feature, KVCacheDType

from attn_ops.backends.reference import dequantize

__all__ = ["CPUAttnBackend", "cpu_paged_attention"]

# The direct binding is ~2.5 us cheaper per call than torch.ops.aten....default.
_flash_cpu = torch._scaled_dot_product_flash_attention_for_cpu


def _visible_mask(n: int, s: int, lo: int, causal: bool, window: int | None) -> torch.Tensor:
    """``[n, s - lo]`` bool: which keys ``lo..s-1`` each of the last ``n`` queries sees."""
    p = torch.arange(s - n, s)[:, None]
    j = torch.arange(lo, s)[None, :]
    visible = (j <= p) if causal else torch.ones(n, s - lo, dtype=torch.bool)
    if window is not None:
        visible &= (p - j) < window
        if not causal:
            visible &= (j - p) < window
    return visible


def _math_attention(q, k, v, visible, scale, soft_cap, alibi_slopes, p0):
    """float32 (fp64 for fp64) attention for soft-cap / ALiBi: q [n, Hq, D], k/v [L, Hq, D]
    -> (out [n, Hq, D], lse [n, Hq])."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    score = torch.einsum("thd,jhd->htj", q.to(compute), k.to(compute)) * scale
    if soft_cap is not None:
        score = soft_cap * torch.tanh(score / soft_cap)
    if alibi_slopes is not None:
        n, length = q.shape[0], k.shape[0]
        dist = torch.arange(length)[None, :] - torch.arange(p0, p0 + n)[:, None]
        score = score + alibi_slopes.to(compute)[:, None, None] * dist
    if visible is not None:
        score = score.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(score, dim=-1)
    out = torch.einsum("htj,jhd->thd", torch.exp(score - lse[..., None]), v.to(compute))
    return out, lse.transpose(0, 1)


def _cast(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache values in the compute dtype; fp8 values dequantized by their scale."""
    return x if scale is None and x.dtype == dtype else dequantize(x, scale, dtype)


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def _decode_batch(query, k_cache, v_cache, block_table, lens, head_dim_v, k_scale, v_scale,
                  scale, sliding_window):
    """All single-token queries of the batch (rows ``0..len(lens)-1``) in one kernel call.

    One ``index_select`` per cache side gathers ``[B, L, Hkv, D]`` (L = the longest request
    rounded up to whole pages); queries are packed per KV head as ``[B, Hkv, group, D]``.
    Unequal lengths or a window need an additive mask, and the padded keys are zeroed first so
    that NaN garbage in unused page slots cannot leak through ``0 * NaN``.
    """
    num_decodes, num_heads, head_dim = len(lens), query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    dtype = query.dtype
    width = max(head_dim, head_dim_v)
    longest = max(lens)
    num_pages = -(-longest // block_size)
    pages = block_table[:num_decodes, :num_pages]
    ragged = min(lens) != longest
    window_cuts = sliding_window is not None and longest > sliding_window
    s = torch.tensor(lens)[:, None] if ragged or window_cuts else None
    if ragged:  # columns past a request's own pages may hold anything: read page 0 instead
        used = -(-s // block_size)
        pages = pages.masked_fill(torch.arange(num_pages) >= used, 0)
    pages = pages.flatten().long()

    def gather(cache, cache_scale):
        g = cache.index_select(0, pages).view(num_decodes, num_pages * block_size, num_kv_heads,
                                              cache.shape[3])
        return _pad_last(_cast(g, cache_scale, dtype), width)

    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
    mask = None
    if s is not None:
        j = torch.arange(k.shape[1])
        hidden = j >= s
        if window_cuts:
            hidden |= j <= s - 1 - sliding_window
        k.masked_fill_(hidden[..., None, None], 0)
        v.masked_fill_(hidden[..., None, None], 0)
        mask = torch.zeros(num_decodes, 1, 1, k.shape[1], dtype=dtype).masked_fill_(
            hidden[:, None, None], float("-inf"))
    else:
        k, v = k[:, :longest], v[:, :longest]
    q = _pad_last(query[:num_decodes], width).view(num_decodes, num_kv_heads,
                                                    num_heads // num_kv_heads, width)
    o, row_lse = _flash_cpu(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                            scale=scale)
    return o.reshape(num_decodes, num_heads, width)[..., :head_dim_v], \
        row_lse.reshape(num_decodes, num_heads)


def _prefill_one(q, k, v, n, s, lo, causal, sliding_window, scale, head_dim_v):
    """One request's ``n`` queries against its keys ``lo..s-1``: q ``[n, Hq, D]``, k/v
    ``[s - lo, Hkv, D]`` (the kernel broadcasts KV heads over query-head groups)."""
    length = s - lo
    square_causal = causal and n == length and sliding_window is None
    mask = None
    if not square_causal and (causal or sliding_window is not None):
        mask = torch.zeros(n, length, dtype=q.dtype).masked_fill_(
            ~_visible_mask(n, s, lo, causal, sliding_window), float("-inf"))
    o, row_lse = _flash_cpu(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                            v.transpose(0, 1)[None], is_causal=square_causal, attn_mask=mask,
                            scale=scale)
    return o[0].transpose(0, 1)[..., :head_dim_v], row_lse[0].transpose(0, 1)


def cpu_paged_attention(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse, sinks,
                        alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap,
                        causal) -> None:
    """The CPU_ATTN kernel (schema: :data:`attn_ops.ops.PAGED_ATTENTION_SCHEMA`)."""
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)
    num_heads, head_dim, head_dim_v = query.shape[1], query.shape[2], out.shape[2]
    k_cache, v_cache = split_kv_cache(kv_cache, head_dim, head_dim_v)
    group = num_heads // k_cache.shape[2]
    width = max(head_dim, head_dim_v)
    dtype = query.dtype
    math_path = soft_cap is not None or alibi_slopes is not None
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    check_paged_attention_values(query.shape[0], k_cache.shape[0], k_cache.shape[1], starts,
                                 lens, block_table, debug_checks_enabled())
    if starts[-1] < query.shape[0]:
        out[starts[-1]:].zero_()
        if lse is not None:
            lse[starts[-1]:].zero_()
    # A single-token query sees the same keys whether or not attention is causal.
    num_decodes = 0
    while num_decodes < len(lens) and starts[num_decodes + 1] == num_decodes + 1:
        num_decodes += 1
    first = 0
    if num_decodes and not math_path:
        o, row_lse = _decode_batch(query, k_cache, v_cache, block_table, lens[:num_decodes],
                                   head_dim_v, k_scale, v_scale, scale, sliding_window)
        if sinks is not None:
            o = o * torch.sigmoid(row_lse - sinks).unsqueeze(-1).to(o.dtype)
        out[:num_decodes] = o
        if lse is not None:
            lse[:num_decodes] = row_lse
        first = num_decodes
    for i in range(first, len(lens)):
        q0, q1, s = starts[i], starts[i + 1], lens[i]
        n = q1 - q0
        if n == 0:
            continue
        # Keys before the first query's window are never visible: skip their pages.
        lo = max(0, s - n - sliding_window + 1) if (causal and sliding_window) else 0
        k = _cast(gather_tokens(k_cache, block_table[i], s, lo), k_scale, dtype)
        v = _cast(gather_tokens(v_cache, block_table[i], s, lo), v_scale, dtype)
        q = query[q0:q1]
        if math_path:
            visible = _visible_mask(n, s, lo, causal, sliding_window)
            o, row_lse = _math_attention(q, k.repeat_interleave(group, 1),
                                         v.repeat_interleave(group, 1), visible, scale,
                                         soft_cap, alibi_slopes, s - n - lo)
        else:
            o, row_lse = _prefill_one(_pad_last(q, width), _pad_last(k, width),
                                      _pad_last(v, width), n, s, lo, causal, sliding_window,
                                      scale, head_dim_v)
        if sinks is not None:
            o = o * torch.sigmoid(row_lse - sinks).unsqueeze(-1).to(o.dtype)
        out[q0:q1] = o
        if lse is not None:
            lse[q0:q1] = row_lse


def _fake(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse, sinks,
          alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap, causal) -> None:
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)


cpu_attention = define_op("cpu_attention", PAGED_ATTENTION_SCHEMA, cpu_paged_attention, _fake,
                          dispatch_keys=("CPU",))


class CPUAttnBackend(AttentionBackend):
    """Per-request gather + CPU flash kernel; every REFERENCE feature."""

    name = "CPU_ATTN"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CPU}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        head_dims=HeadDims(multiple_of=1, min=1, max=1024),
        kv_cache_dtypes=frozenset(KVCacheDType),
        features=frozenset(Feature) - {Feature.MLA, Feature.CROSS_ATTENTION},
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER_ONLY}),
        preferred_block_size=16,
        cudagraph_support=CUDAGraphSupport.NEVER,  # CPU: no CUDA graphs
    )
    op = cpu_attention
