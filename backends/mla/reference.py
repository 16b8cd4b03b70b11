"""REFERENCE_MLA: MLA in plain PyTorch -- both forms, the oracle of the MLA family and its CPU
path.

It runs :func:`~attn_ops.backends.mla.common.run_mla` (the absorbed/MHA split, the chunked
context and its LSE merge, as every MLA backend does) with two torch kernels, one request at a
time, computing in fp32 (fp64 for fp64 inputs). For request ``i`` with ``s = seq_lens[i]``
cached tokens of which the last ``n`` are new, query ``t`` sits at position ``s - n + t``:

    absorbed:  score[h, t, j] = scale * (ql[t, h] . c[j] + q_pe[t, h] . k_pe[j]),  j <= s - n + t
               out[t, h]      = softmax_j(score) @ c           (latent rows [c | k_pe], c first)
    MHA:       score[h, t, j] = scale * q[t, h] . k[j, h]   (causal: j <= m - n + t for m keys)
               out, lse       = softmax_j(score) @ v, logsumexp_j(score)   (no keys: 0, -inf)
"""

from __future__ import annotations

import torch

from attn_ops.backends.mla.common import MLABackend, define_mla_op
from attn_ops.backends.reference import UNCAPTURABLE, dequantize
from attn_ops.capabilities import BackendCapabilities, CUDAGraphSupport, HeadDims
from attn_ops.kv_cache import gather_present_tokens
from attn_ops.ops import check_query_start_loc
from attn_ops.platforms import PlatformKind
from attn_ops.spec import Feature, KVCacheDType

__all__ = ["ReferenceMLABackend", "absorbed_torch", "mha_torch"]


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def absorbed_torch(ql, q_pe, latent_cache, query_start_loc, seq_lens, block_table, out,
                   kv_scale, scale, plan=None) -> None:
    """The absorbed form over the paged latent cache, one request at a time (no plan)."""
    compute = _compute(ql.dtype)
    rank = ql.shape[2]
    rows = latent_cache[:, :, None, :]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    check_query_start_loc(starts, ql.shape[0])  # (read here anyway: the check is free)
    for i, s in enumerate(lens):
        q0, q1 = starts[i], starts[i + 1]
        n = q1 - q0
        if n == 0:
            continue
        # (block ids and lengths come from the device: a key whose block id is outside the
        # cache is absent, and so are the keys past the block-table row, never gathered)
        latent, present = gather_present_tokens(rows, block_table[i], s)
        latent = dequantize(latent[:, 0], kv_scale, compute)
        c, k_pe = latent[:, :rank], latent[:, rank:]
        score = (torch.einsum("thl,jl->htj", ql[q0:q1].to(compute), c)
                 + torch.einsum("thr,jr->htj", q_pe[q0:q1].to(compute), k_pe)) * scale
        p = torch.arange(s - n, s, device=ql.device)[:, None]
        j = torch.arange(c.shape[0], device=ql.device)[None, :]
        hidden = (j > p) | ~present[None, :]
        empty = hidden.all(1)[None, :, None]  # a query that sees no key: out 0
        score = score.masked_fill(hidden, float("-inf")).masked_fill(empty, 0.0)
        probs = torch.softmax(score, dim=-1).masked_fill(empty, 0.0)
        out[q0:q1] = torch.einsum("htj,jl->thl", probs, c).to(out.dtype)


def mha_torch(q, k, v, cu_q, cu_k, cu_q_host, cu_k_host, out, lse, scale, causal) -> None:
    """Ragged MHA (QK and V widths may differ), causal aligned to each request's last key."""
    compute = _compute(q.dtype)
    for i in range(len(cu_q_host) - 1):
        q0, q1, k0, k1 = cu_q_host[i], cu_q_host[i + 1], cu_k_host[i], cu_k_host[i + 1]
        n, m = q1 - q0, k1 - k0
        if n == 0:
            continue
        if m == 0:
            out[q0:q1].zero_()
            lse[q0:q1] = float("-inf")
            continue
        score = torch.einsum("thd,jhd->htj", q[q0:q1].to(compute), k[k0:k1].to(compute)) * scale
        if causal:
            p = torch.arange(m - n, m, device=q.device)[:, None]
            j = torch.arange(m, device=q.device)[None, :]
            score = score.masked_fill(j > p, float("-inf"))
        row_lse = torch.logsumexp(score, dim=-1)
        probs = torch.exp(score - row_lse[..., None])
        out[q0:q1] = torch.einsum("htj,jhd->thd", probs, v[k0:k1].to(compute)).to(out.dtype)
        lse[q0:q1] = row_lse.transpose(0, 1).to(lse.dtype)


reference_mla_attention = define_mla_op("reference_mla_attention", absorbed_torch,
                                        mha=mha_torch, tags=UNCAPTURABLE)


class ReferenceMLABackend(MLABackend):
    """Any latent dims, any page size, any platform; simple rather than fast."""

    name = "REFERENCE_MLA"
    capabilities = BackendCapabilities(
        platforms=frozenset(PlatformKind),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        head_dims=HeadDims(),
        kv_cache_dtypes=frozenset({KVCacheDType.AUTO, KVCacheDType.FP8_E4M3}),
        features=frozenset({Feature.MLA, Feature.DIFF_HEAD_DIM_V, Feature.FP8_KV}),
        cudagraph_support=CUDAGraphSupport.NEVER,  # reads lengths on the host
    )
    op = reference_mla_attention
