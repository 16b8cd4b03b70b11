"""DeepSeek-V4's attention in plain PyTorch over paged caches: the oracle for its kernels.

A query at position ``p`` of a layer attends, with one shared key = value head and a per-head
sink logit, to

* the sliding window: the tokens at ``max(0, p - W + 1) .. p`` (``W`` = ``sliding_window``,
  the current token included), from the window cache through the request's block table;
* in a heavily compressed layer (``ratio`` 128), every compressed entry ``w < (p + 1) //
  ratio``; in a compressed-sparse layer (ratio 4), the entries the indexer picked for it
  (``picks [T, k]`` entry indices, -1 unused).

``softmax(scale * q . k)`` over those keys with the sink in the denominator only:
``out = sum_j exp(s_j - lse') v_j`` with ``lse' = logaddexp(lse, sink)``. A cache holds rows of
the model dtype (``[blocks, page, D]``) or vLLM's 584-byte entries (``uint8 [blocks, page *
584]``, read back by :func:`~attn_ops.backends.deepseek_v4.cache.read_entries`). Computes in
fp32 (fp64 for fp64 queries).
"""

from __future__ import annotations

import torch

from attn_ops.backends.deepseek_v4.cache import ENTRY_BYTES, read_entries

__all__ = ["dsv4_attention_reference", "dsv4_indexer_topk_reference"]


def _rows(cache: torch.Tensor, table_row: torch.Tensor, positions: torch.Tensor,
          compute: torch.dtype) -> torch.Tensor:
    """Rows ``positions`` of a request's paged cache (``table_row`` its block-table row): a
    ``[blocks, page, D]`` cache's rows, or a 584-byte cache's entries read back."""
    if cache.dtype == torch.uint8:
        page = cache.shape[1] // ENTRY_BYTES
        slots = table_row.long()[positions // page] * page + positions % page
        return read_entries(cache, page, slots, compute)
    page = cache.shape[1]
    blocks = table_row.long()[positions // page]
    return cache[blocks, positions % page].to(compute)


def dsv4_attention_reference(q, window_cache, query_start_loc, seq_lens, block_table,
                             sinks, scale: float, sliding_window: int,
                             compressed_cache=None, compressed_block_table=None,
                             ratio: int = 0, picks=None) -> torch.Tensor:
    """``q [T, H, D]`` over the window (and compressed entries) of each request: ``[T, H, D]``
    in ``q``'s dtype (module docstring). ``compressed_cache`` with ``ratio``: a compressed
    layer; ``picks``: its indexer's selection (None: every visible entry)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=compute, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, total in enumerate(lens):
        s0, s1 = starts[r], starts[r + 1]
        for t in range(s0, s1):
            p = total - (s1 - s0) + (t - s0)
            lo = max(0, p - sliding_window + 1)
            keys = _rows(window_cache, block_table[r], torch.arange(lo, p + 1, device=q.device),
                         compute)
            if compressed_cache is not None:
                visible = (p + 1) // ratio
                entries = torch.arange(visible, device=q.device)
                if picks is not None:
                    chosen = picks[t].long()
                    entries = chosen[(chosen >= 0) & (chosen < visible)]
                keys = torch.cat([keys, _rows(compressed_cache, compressed_block_table[r],
                                              entries, compute)])
            scores = q[t].to(compute) @ keys.T * scale  # [H, keys]
            lse = torch.logsumexp(scores, -1)
            denom = torch.logaddexp(lse, sinks.to(compute))
            out[t] = torch.exp(scores - denom[:, None]) @ keys
    return out.to(q.dtype)


def dsv4_indexer_topk_reference(q, weights, index_cache, query_start_loc, seq_lens,
                                block_table, ratio: int, topk: int) -> torch.Tensor:
    """The compressed-sparse layers' lightning indexer: for the query at ``p``, entry ``s <
    (p + 1) // ratio`` scores ``sum_h w_h ReLU(q_h . k_s) / sqrt(Di)`` (``q [T, Hi, Di]`` rotated,
    ``weights [T, Hi]`` already scaled by ``Hi^-0.5``, keys from ``index_cache [blocks, page,
    Di]``); its ``min(topk, visible)`` best entry indices, -1 after them: ``[T, topk]``."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    picks = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, total in enumerate(lens):
        s0, s1 = starts[r], starts[r + 1]
        for t in range(s0, s1):
            visible = (total - (s1 - s0) + (t - s0) + 1) // ratio
            if not visible:
                continue
            keys = _rows(index_cache, block_table[r], torch.arange(visible, device=q.device),
                         compute)
            scores = torch.relu(q[t].to(compute) @ keys.T) * q.shape[-1] ** -0.5  # [Hi, n]
            scores = (scores * weights[t].to(compute)[:, None]).sum(0)
            best = scores.topk(min(topk, visible)).indices
            picks[t, :best.shape[0]] = best
    return picks
