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
fp32 (fp64 for fp64 queries). ``torch.ops.attn.dsv4_reference_attention`` and
``dsv4_indexer_topk`` are these as ops (fakes included: a compiled layer traces them whole).
"""

from __future__ import annotations

import torch

from attn_ops.backends.deepseek_v4.cache import (ENTRY_BYTES, dequantize_index_keys,
                                                read_entries)
from attn_ops.ops import define_op

__all__ = ["check_attention", "check_values", "dsv4_attention_reference",
           "dsv4_indexer_topk_reference", "indexer_topk", "reference_attention"]


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
    Di]`` rows or a planar fp8 cache, :func:`~attn_ops.backends.deepseek_v4.cache.index_views`);
    its ``min(topk, visible)`` best entry indices, -1 after them: ``[T, topk]``."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    picks = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, total in enumerate(lens):
        s0, s1 = starts[r], starts[r + 1]
        for t in range(s0, s1):
            visible = (total - (s1 - s0) + (t - s0) + 1) // ratio
            if not visible:
                continue
            entries = torch.arange(visible, device=q.device)
            if index_cache.dtype == torch.uint8:  # (planar fp8 keys with their scales)
                page = index_cache.shape[1] // (q.shape[-1] + 4)
                slots = block_table[r].long()[entries // page] * page + entries % page
                keys = dequantize_index_keys(index_cache, q.shape[-1], slots, compute)
            else:
                keys = _rows(index_cache, block_table[r], entries, compute)
            scores = torch.relu(q[t].to(compute) @ keys.T) * q.shape[-1] ** -0.5  # [Hi, n]
            scores = (scores * weights[t].to(compute)[:, None]).sum(0)
            best = scores.topk(min(topk, visible)).indices
            picks[t, :best.shape[0]] = best
    return picks


def check_attention(q, window_cache, query_start_loc, seq_lens, block_table, sinks,
                    compressed_cache, compressed_block_table, picks,
                    op: str = "dsv4_reference_attention") -> None:
    """The shapes every DeepSeek-V4 attention op needs (``op`` names it in errors)."""
    if q.dim() != 3 or sinks.shape != (q.shape[1],):
        raise ValueError(f"{op}: q must be [num_tokens, num_heads, head_dim] and sinks "
                         f"[num_heads], got {tuple(q.shape)} and {tuple(sinks.shape)}")
    b = seq_lens.shape[0]
    if query_start_loc.shape != (b + 1,) or block_table.dim() != 2 or \
            block_table.shape[0] != b:
        raise ValueError(f"{op}: query_start_loc [B+1], seq_lens [B] and block_table [B, W] "
                         f"expected, got {tuple(query_start_loc.shape)}, {tuple(seq_lens.shape)}"
                         f", {tuple(block_table.shape)}")
    if (compressed_cache is None) != (compressed_block_table is None):
        raise ValueError(f"{op}: pass compressed_cache with compressed_block_table")
    if picks is not None and (picks.dim() != 2 or picks.shape[0] != q.shape[0]):
        raise ValueError(f"{op}: picks must be [num_tokens={q.shape[0]}, k], got "
                         f"{tuple(picks.shape)}")


def _pages_of(cache: torch.Tensor, index_dim: int = 0) -> tuple[int, int]:
    """``(blocks, entries a page)`` of a V4 cache."""
    from attn_ops.backends.deepseek_v4.cache import entries_a_page

    return cache.shape[0], entries_a_page(cache, index_dim)


def check_values(op: str, num_tokens: int, query_start_loc, seq_lens, block_table=None,
                 window_cache=None, sliding_window: int = 0, compressed_block_table=None,
                 compressed_cache=None, ratio: int = 0, index_dim: int = 0) -> None:
    """The host values the torch paths index with (they read lengths on the host anyway): a
    monotone ``query_start_loc`` within the rows, ``seq_lens`` covering each query, and the
    block ids of every page a query reads -- the window's (-1 allowed before it: released
    pages) and the compressed entries' -- inside their caches. ``ValueError`` names the
    input."""
    from attn_ops.ops import check_query_start_loc

    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    check_query_start_loc(starts, num_tokens, op)
    for r, total in enumerate(lens):
        n = starts[r + 1] - starts[r]
        if total < n:
            raise ValueError(f"{op}: seq_lens[{r}]={total} is shorter than the request's "
                             f"query length {n}")
        reads = []
        if window_cache is not None:
            blocks, page = _pages_of(window_cache)
            reads.append(("block_table", block_table, blocks, page,
                          max(0, total - n - sliding_window + 1), total))
        if compressed_cache is not None:
            blocks, page = _pages_of(compressed_cache, index_dim)
            reads.append(("compressed_block_table", compressed_block_table, blocks, page, 0,
                          total // ratio))
        for name, table, blocks, page, lo, hi in reads:
            if hi <= lo:
                continue
            if r >= table.shape[0] or -(-hi // page) > table.shape[1]:
                raise ValueError(f"{op}: {name} has {table.shape[1]} columns of {page} for "
                                 f"request {r}'s {hi} positions (seq_lens[{r}]={total})")
            ids = table[r, lo // page:-(-hi // page)].tolist()
            bad = [b for b in ids if not 0 <= b < blocks]
            if bad:
                raise ValueError(f"{op}: {name}[{r}] holds block {bad[0]} where request {r} "
                                 f"reads, outside the cache's [0, {blocks}) blocks")


def _attention_op(q, window_cache, query_start_loc, seq_lens, block_table, sinks, scale,
                  sliding_window, compressed_cache, compressed_block_table, ratio, picks):
    check_attention(q, window_cache, query_start_loc, seq_lens, block_table, sinks,
                    compressed_cache, compressed_block_table, picks)
    check_values("dsv4_reference_attention", q.shape[0], query_start_loc, seq_lens,
                 block_table, window_cache, sliding_window, compressed_block_table,
                 compressed_cache, ratio)
    return dsv4_attention_reference(q, window_cache, query_start_loc, seq_lens, block_table,
                                    sinks, scale, sliding_window, compressed_cache,
                                    compressed_block_table, ratio, picks)


def _attention_fake(q, window_cache, query_start_loc, seq_lens, block_table, sinks, scale,
                    sliding_window, compressed_cache, compressed_block_table, ratio, picks):
    check_attention(q, window_cache, query_start_loc, seq_lens, block_table, sinks,
                    compressed_cache, compressed_block_table, picks)
    return torch.empty_like(q)


def _indexer_op(q, weights, index_cache, query_start_loc, seq_lens, block_table, ratio, topk):
    if q.dim() != 3 or weights.shape != q.shape[:2]:
        raise ValueError(f"dsv4_indexer_topk: q must be [num_tokens, index_heads, dim] and "
                         f"weights [num_tokens, index_heads], got {tuple(q.shape)} and "
                         f"{tuple(weights.shape)}")
    check_values("dsv4_indexer_topk", q.shape[0], query_start_loc, seq_lens,
                 compressed_block_table=block_table, compressed_cache=index_cache, ratio=ratio,
                 index_dim=q.shape[2] if index_cache.dtype == torch.uint8 else 0)
    return dsv4_indexer_topk_reference(q, weights, index_cache, query_start_loc, seq_lens,
                                       block_table, ratio, topk)


def _indexer_fake(q, weights, index_cache, query_start_loc, seq_lens, block_table, ratio, topk):
    return q.new_empty(q.shape[0], topk, dtype=torch.int64)


# (they read lengths on the host: outside CUDA graphs, opaque to torch.compile)
_UNCAPTURABLE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),)
                      if t is not None)
reference_attention = define_op(
    "dsv4_reference_attention",
    "(Tensor q, Tensor window_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, Tensor sinks, float scale, int sliding_window, "
    "Tensor? compressed_cache, Tensor? compressed_block_table, int ratio, Tensor? picks) "
    "-> Tensor", _attention_op, _attention_fake, tags=_UNCAPTURABLE)
indexer_topk = define_op(
    "dsv4_indexer_topk",
    "(Tensor q, Tensor weights, Tensor index_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, int ratio, int topk) -> Tensor", _indexer_op, _indexer_fake,
    tags=_UNCAPTURABLE)
