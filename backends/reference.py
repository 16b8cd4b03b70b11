"""REFERENCE: the semantic definition of every attention feature, in plain PyTorch.

It is the test oracle (run in fp64 by the tests), the CPU fallback of last resort and the
definition the other backends are checked against. It computes in fp32 (fp64 for fp64 inputs),
one request at a time, and is deliberately simple rather than fast.

Semantics, for request ``i`` with ``s = seq_lens[i]`` tokens of which the last ``n`` are
queries, query ``t`` sitting at position ``p = s - n + t`` and key ``j`` in ``0..s-1``::

    score[h, t, j] = scale * q[t, h] . k[j, h // group]
    if soft_cap:      score = soft_cap * tanh(score / soft_cap)
    if alibi_slopes:  score += alibi_slopes[h] * (j - p)
    visible(j)  = (j <= p if causal else True)
                  and (p - j < window if window else True)
                  and (j - p < window if window and not causal else True)
    lse[t, h]   = logsumexp_j(score over visible j)                 # natural log, no sink
    denom       = lse (or logaddexp(lse, sinks[h]) with sinks)      # a sink takes probability
    out[t, h]   = sum_j exp(score - denom) * v[j, h // group]       #   mass but adds no value

Block ids arrive on the device and are never trusted: a key whose page's block id is outside
the cache is absent (not visible, never read). A row that sees no key gets ``out`` 0 and
``lse`` -inf. (A ``seq_len`` past the block table is refused: the lengths are on the host.)
"""

from __future__ import annotations

import torch

from attn_ops.backend import AttentionBackend
from attn_ops.capabilities import BackendCapabilities, CUDAGraphSupport, HeadDims
from attn_ops.kv_cache import gather_present_tokens, split_kv_cache
from attn_ops.ops import (PAGED_ATTENTION_MODS_SCHEMA, PAGED_ATTENTION_SCHEMA,
                          check_paged_attention_inputs, check_paged_attention_values,
                          debug_checks_enabled, define_op, register_mods, registered_mods)
from attn_ops.platforms import PlatformKind
from attn_ops.spec import AttentionType, Feature, KVCacheDType, TURBOQUANT_KV_DTYPES

__all__ = ["ReferenceBackend", "reference_paged_attention"]


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache values in ``dtype``; fp8 values are multiplied by their per-tensor scale."""
    if scale is None:
        return x.to(dtype)
    return x.to(dtype) * scale.to(dtype)


def reference_paged_attention(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse,
                              sinks, alibi_slopes, k_scale, v_scale, scale, sliding_window,
                              soft_cap, causal, mods: int = 0) -> None:
    """The REFERENCE kernel (schema: :data:`attn_ops.ops.PAGED_ATTENTION_SCHEMA`, plus the id
    of the spec's custom mask/score mods in :func:`attn_ops.ops.registered_mods`)."""
    mask_mod, score_mod, _ = registered_mods(mods)
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    num_heads, head_dim, head_dim_v = query.shape[1], query.shape[2], out.shape[2]
    k_cache, v_cache = split_kv_cache(kv_cache, head_dim, head_dim_v)
    group = num_heads // k_cache.shape[2]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    check_paged_attention_values(query.shape[0], k_cache.shape[0], k_cache.shape[1], starts,
                                 lens, block_table, debug_checks_enabled())
    out[starts[-1]:].zero_()
    if lse is not None:
        lse[starts[-1]:].zero_()
    for i, s in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        n = q1 - q0
        if n == 0:
            continue
        # (block ids come from the device: a key whose block id is outside the cache is absent)
        k, present = gather_present_tokens(k_cache, block_table[i], s)
        v = gather_present_tokens(v_cache, block_table[i], s)[0]
        k, v = dequantize(k, k_scale, compute), dequantize(v, v_scale, compute)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = query[q0:q1].to(compute)
        score = torch.einsum("thd,jhd->htj", q, k) * scale
        if soft_cap is not None:
            score = soft_cap * torch.tanh(score / soft_cap)
        p = torch.arange(s - n, s, device=q.device)[:, None]
        j = torch.arange(k.shape[0], device=q.device)[None, :]
        if alibi_slopes is not None:
            score = score + alibi_slopes.to(compute)[:, None, None] * (j - p)
        request = torch.tensor(i, device=q.device)
        heads = torch.arange(num_heads, device=q.device)[:, None, None]
        if score_mod is not None:
            score = score_mod(score, request, heads, p[None], j[None])
        visible = present[None, :].repeat(n, 1)  # [n, keys]
        if mask_mod is not None:
            visible = visible & mask_mod(request, heads, p[None], j[None])
        if causal:
            visible &= j <= p
        if sliding_window is not None:
            visible &= (p - j) < sliding_window
            if not causal:
                visible &= (j - p) < sliding_window
        score = score.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(score, dim=-1)  # [H, n]
        denom = row_lse if sinks is None else torch.logaddexp(
            row_lse, sinks.to(compute)[:, None])
        denom = denom.masked_fill(denom == float("-inf"), 0.0)  # a row with no key: out 0
        probs = torch.exp(score - denom[..., None])
        out[q0:q1] = torch.einsum("htj,jhd->thd", probs, v).to(out.dtype)
        if lse is not None:
            lse[q0:q1] = row_lse.transpose(0, 1).float()


def _fake(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse, sinks,
          alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap, causal) -> None:
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)


# It reads lengths on the host (no CUDA-graph capture): Inductor partitions graphs around it.
UNCAPTURABLE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
reference_attention = define_op("reference_attention", PAGED_ATTENTION_SCHEMA,
                                reference_paged_attention, _fake, fp8_output_at=5,
                                tags=UNCAPTURABLE)
# The same with the spec's custom mods (AttentionSpec.mask_mod / score_mod), by registry id.
reference_attention_mods = define_op(
    "reference_attention_mods", PAGED_ATTENTION_MODS_SCHEMA,
    reference_paged_attention, lambda *args: _fake(*args[:-1]), fp8_output_at=5,
    tags=UNCAPTURABLE)


class ReferenceBackend(AttentionBackend):
    """Every feature, any head dim, any block size, any platform; slow by design."""

    name = "REFERENCE"
    capabilities = BackendCapabilities(
        platforms=frozenset(PlatformKind),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        head_dims=HeadDims(),
        kv_cache_dtypes=frozenset(KVCacheDType) - TURBOQUANT_KV_DTYPES,
        features=frozenset(Feature) - {Feature.MLA, Feature.CROSS_ATTENTION, Feature.TREE},
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER_ONLY}),
        cudagraph_support=CUDAGraphSupport.NEVER,  # reads lengths on the host
    )
    op = reference_attention

    def __init__(self, spec, **options) -> None:
        super().__init__(spec, **options)
        self.mods = register_mods(spec)

    def op_for(self, metadata):
        return reference_attention_mods if self.mods else reference_attention

    def op_arguments(self, query, kv_cache, metadata, out, **optional) -> tuple:
        args = super().op_arguments(query, kv_cache, metadata, out, **optional)
        return (*args, self.mods) if self.mods else args
