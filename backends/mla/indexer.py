"""DeepSeek-V3.2's lightning indexer: per layer, an index-key cache beside the latent cache, and
for every query token the ``topk`` cached positions it scores highest,

    score(t, j) = sum_h w[t, h] * relu(q[t, h] . k[j]),    j <= t's position (causal),

given as request-local positions (ascending, -1 padding) and converted to global cache slots
through the block table for the sparse attention kernels. A query that sees at most ``topk``
keys gets all of them (dense). Equal scores keep the lower position, so the selection is a
function of the scores alone.

The index keys are stored ``[num_blocks, page, dim]`` in bf16 / fp16 / fp32, or in fp8 e4m3
with float32 scales ``[num_blocks, page, dim // scale_block]``: one scale a token
(``scale_block = dim``) or one per 128 channels. The key is dequantized before the product,
so a per-token scale is DeepSeek's ``k_scale[j] * sum_h w_h relu(q_h . k_j)``.

Only positions below a request's length are gathered: unused and freed slots never reach the
arithmetic. A position past the block table's columns is not visible, and one whose page is
outside the key cache (a stale or corrupt block-table entry) scores lowest (-inf): nothing
outside either tensor is ever read. The bodies here are the reference and the CPU path.
"""

from __future__ import annotations

import torch

from attn_ops.glue import paged_slots
from attn_ops.ops import (check_paged_attention_values, check_query_start_loc,
                          debug_checks_enabled, define_op)

__all__ = ["allocate_index_cache", "indexer_k_write", "indexer_slots", "indexer_topk"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_INT32_MAX = 2 ** 31 - 1


def allocate_index_cache(num_blocks: int, page: int, dim: int, dtype: torch.dtype = FP8,
                         scale_block: int | None = None, device: torch.device | str = "cpu"):
    """``(keys, scales)`` of one layer's index-key cache: zeroed keys ``[num_blocks, page,
    dim]`` in ``dtype`` and, for fp8, float32 scales ``[num_blocks, page, dim //
    scale_block]`` (``scale_block`` defaults to ``dim``: one scale a token); ``None``
    otherwise."""
    if dtype not in (FP8, torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"index-key cache dtype {dtype} is not supported: use "
                         "torch.float8_e4m3fn, bfloat16, float16 or float32")
    keys = torch.zeros(num_blocks, page, dim, dtype=dtype, device=device)
    if dtype != FP8:
        return keys, None
    block = scale_block or dim
    if dim % block:
        raise ValueError(f"scale_block={block} must divide the index head dim {dim} "
                         "(128 for per-128-channel scales, or dim for one scale a token)")
    return keys, torch.ones(num_blocks, page, dim // block, dtype=torch.float32, device=device)


def _check_cache(keys, scales, dim) -> None:
    if keys.dim() != 3 or keys.shape[2] != dim:
        raise ValueError(f"index keys cache must be [num_blocks, page, dim={dim}], got "
                         f"{tuple(keys.shape)}; allocate it with allocate_index_cache")
    if keys.dtype == FP8:
        if scales is None or scales.dim() != 3 or scales.shape[:2] != keys.shape[:2] \
                or dim % scales.shape[2] or scales.dtype != torch.float32:
            raise ValueError(
                f"an fp8 index-key cache needs float32 scales [num_blocks, page, groups] with "
                f"groups dividing {dim}, got "
                f"{None if scales is None else (scales.dtype, tuple(scales.shape))}")


def _check_write(k, keys, scales, slot_mapping) -> None:
    if k.dim() != 2:
        raise ValueError(f"k must be [num_tokens, index_head_dim], got {tuple(k.shape)}")
    _check_cache(keys, scales, k.shape[1])
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.is_floating_point():
        raise ValueError(f"slot_mapping must be an integer [num_tokens={k.shape[0]}] tensor, "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def _k_write(k, keys, scales, slot_mapping) -> None:
    _check_write(k, keys, scales, slot_mapping)
    if k.is_cuda:  # (one launch, no host read: graph-capturable)
        from attn_ops.backends.mla.indexer_kernels import indexer_k_write_device

        indexer_k_write_device(k, keys, scales, slot_mapping, FP8_MAX)
        return
    k_write_reference(k, keys, scales, slot_mapping)


def k_write_reference(k, keys, scales, slot_mapping) -> None:
    """The index-key write in torch (the CPU path and the oracle)."""
    keep = (slot_mapping >= 0) & (slot_mapping < keys.shape[0] * keys.shape[1])  # (else absent)
    slots = slot_mapping[keep].long()
    rows = k[keep].float()
    flat = keys.view(-1, keys.shape[2])
    if keys.dtype != FP8:
        flat.index_copy_(0, slots, rows.to(keys.dtype))
        return
    groups = scales.shape[2]
    g = rows.view(rows.shape[0], groups, -1)
    scale = (g.abs().amax(dim=2) / FP8_MAX).clamp(min=1e-12)
    q = (g / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(rows.shape)
    flat.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))  # (no fp8 index_copy)
    scales.view(-1, groups).index_copy_(0, slots, scale)


indexer_k_write = define_op(
    "indexer_k_write",
    "(Tensor k, Tensor(a!) keys, Tensor(b!)? scales, Tensor slot_mapping) -> ()",
    _k_write, lambda *args: _check_write(*args))
indexer_k_write.__doc__ = """Write index keys ``k`` [T, dim] at ``slot_mapping`` [T] (-1:
padding, and any slot outside the cache, skipped); an fp8 cache stores each group of channels
over its amax / 448 and the scale beside it."""


def _check_topk(q, weights, keys, scales, block_table, seq_lens, query_start_loc, topk):
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, index_heads, index_head_dim], got "
                         f"{tuple(q.shape)}")
    t, h, d = q.shape
    if weights.shape != (t, h):
        raise ValueError(f"weights must be [num_tokens={t}, index_heads={h}], got "
                         f"{tuple(weights.shape)}")
    if keys.dim() == 3 and keys.shape[2] != d:
        raise ValueError(f"q's index head dim is {d} but the index-key cache holds keys of "
                         f"{keys.shape[2]}: q must be [num_tokens, index_heads, "
                         f"{keys.shape[2]}] (the indexer's head_dim)")
    for name, x in (("weights", weights), ("keys", keys), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, expected {q.device} (q's device)")
    for name, x in (("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if x.is_floating_point():
            raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
    _check_cache(keys, scales, d)
    b = seq_lens.shape[0]
    if query_start_loc.shape != (b + 1,) or block_table.dim() != 2 or block_table.shape[0] < b:
        raise ValueError(f"query_start_loc must be [num_reqs + 1 = {b + 1}] and block_table "
                         f"[>= num_reqs, pages], got {tuple(query_start_loc.shape)} and "
                         f"{tuple(block_table.shape)}")
    if topk < 1:
        raise ValueError(f"topk={topk} must be >= 1")


def _topk(q, weights, keys, scales, block_table, seq_lens, query_start_loc, topk):
    _check_topk(q, weights, keys, scales, block_table, seq_lens, query_start_loc, topk)
    if debug_checks_enabled():  # (reads the metadata: a device sync)
        check_paged_attention_values(q.shape[0], keys.shape[0], keys.shape[1],
                                     query_start_loc.tolist(), seq_lens.tolist(), block_table,
                                     True)
    if q.is_cuda:  # (Triton scores and a device top-k: no host read, graph-capturable)
        from attn_ops.backends.mla.indexer_kernels import indexer_topk_device

        return indexer_topk_device(q, weights, keys, scales, block_table, seq_lens,
                                   query_start_loc, topk)
    return topk_reference(q, weights, keys, scales, block_table, seq_lens, query_start_loc,
                          topk)


def topk_reference(q, weights, keys, scales, block_table, seq_lens, query_start_loc, topk):
    """The top-k in torch, one request at a time (the CPU path and the oracle)."""
    t, _, d = q.shape
    page = keys.shape[1]
    out = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    flat = keys.view(-1, d)
    limit = block_table.shape[1] * page  # (positions past the table: not visible)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    check_query_start_loc(qsl, t)
    for r, length in enumerate(lens):
        lo, hi = qsl[r], qsl[r + 1]
        if hi == lo:
            continue
        first = length - (hi - lo)  # the first new token's position
        # keys each query sees
        visible = (first + 1 + torch.arange(hi - lo, device=q.device)).clamp(0, limit)
        length = min(length, limit)
        if length <= topk:  # (every row selects all it sees: no scores needed)
            seen = torch.arange(topk, device=q.device)[None, :] < visible[:, None]
            out[lo:hi] = torch.where(seen, torch.arange(topk, device=q.device), -1).to(
                torch.int32)
            continue
        pos = torch.arange(length, device=q.device)
        blocks = block_table[r, pos // page].long()
        cached = (blocks >= 0) & (blocks < keys.shape[0])
        slots = blocks.where(cached, 0) * page + pos % page
        k = flat[slots].to(work)
        if scales is not None:
            s = scales.view(-1, scales.shape[2])[slots].to(work)
            k = (k.view(length, s.shape[1], -1) * s[:, :, None]).view(length, d)
        score = torch.einsum("th,thj->tj", weights[lo:hi].to(work),
                             torch.relu(torch.einsum("thd,jd->thj", q[lo:hi].to(work), k)))
        score = score.masked_fill(~cached[None, :], float("-inf"))
        seen = pos[None, :] < visible[:, None]
        score = torch.where(seen, score, float("-inf"))
        # a stable sort on -score: equal scores keep the lower position first
        order = torch.sort(-score, dim=1, stable=True).indices[:, :topk]
        n = min(topk, length)
        chosen = torch.where(torch.arange(n, device=q.device)[None, :] < visible[:, None],
                             order[:, :n], length)  # (beyond what a query sees: sorted last)
        chosen = torch.sort(chosen, dim=1).values
        out[lo:hi, :n] = torch.where(chosen < length, chosen, -1).to(torch.int32)
    return out


def _topk_fake(q, weights, keys, scales, block_table, seq_lens, query_start_loc, topk):
    _check_topk(q, weights, keys, scales, block_table, seq_lens, query_start_loc, topk)
    return q.new_empty(q.shape[0], topk, dtype=torch.int32)


indexer_topk = define_op(
    "indexer_topk",
    "(Tensor q, Tensor weights, Tensor keys, Tensor? scales, Tensor block_table, "
    "Tensor seq_lens, Tensor query_start_loc, int topk) -> Tensor",
    _topk, _topk_fake)
indexer_topk.__doc__ = """Each query row's ``topk`` highest-scoring visible positions of its
request (ascending, -1 padding; all visible positions when there are at most ``topk``):
``q`` [T, H, dim] (RoPE applied), ``weights`` [T, H] (the head weights with their scales),
the request's index keys through ``block_table`` up to ``seq_lens``; rows past
``query_start_loc[-1]`` are all -1."""


def _check_slots(positions, block_table, query_start_loc, page, seq_lens=None):
    if positions.dim() != 2 or positions.is_floating_point():
        raise ValueError(f"positions must be an integer [num_tokens, topk] tensor, got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    b = query_start_loc.shape[0] - 1
    if block_table.dim() != 2 or block_table.shape[0] < b:
        raise ValueError(f"block_table must be [>= num_reqs = {b}, pages], got "
                         f"{tuple(block_table.shape)}")
    if seq_lens is not None and (seq_lens.shape != (b,) or seq_lens.is_floating_point()):
        raise ValueError(f"seq_lens must be an integer [num_reqs={b}] tensor (query_start_loc "
                         f"has {b + 1} entries), got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if page < 1:
        raise ValueError(f"page_size={page} must be >= 1")


def _slots(positions, block_table, query_start_loc, page, seq_lens=None):
    _check_slots(positions, block_table, query_start_loc, page, seq_lens)
    if positions.is_cuda:  # (one launch, no host read)
        from attn_ops.backends.mla.indexer_kernels import indexer_slots_device

        return indexer_slots_device(positions, block_table, query_start_loc, page, seq_lens)
    return slots_reference(positions, block_table, query_start_loc, page, seq_lens)


def slots_reference(positions, block_table, query_start_loc, page, seq_lens=None):
    """``indexer_slots`` in torch ops: its CPU path and the device launch's oracle."""
    rows = torch.arange(positions.shape[0], device=positions.device)
    b = query_start_loc.shape[0] - 1
    req = torch.searchsorted(query_start_loc[1:].long(), rows, right=True)[:, None]
    valid = (positions >= 0) & (req < b)  # (padding rows: -1)
    if seq_lens is not None and b:
        valid &= positions < seq_lens.long()[req.clamp(max=b - 1)]
    slots = paged_slots(req, positions, valid, block_table, page)
    # (a block id no int32 slot can address -- a corrupt table entry -- is absent, not wrapped
    # onto another request's page)
    return torch.where((slots >= 0) & (slots <= _INT32_MAX), slots, -1).to(torch.int32)


def _slots_fake(positions, block_table, query_start_loc, page, seq_lens=None):
    _check_slots(positions, block_table, query_start_loc, page, seq_lens)
    return torch.empty_like(positions, dtype=torch.int32)


indexer_slots = define_op(
    "indexer_slots",
    "(Tensor positions, Tensor block_table, Tensor query_start_loc, int page_size, "
    "Tensor? seq_lens=None) -> Tensor",
    _slots, _slots_fake)
indexer_slots.__doc__ = """Request-local ``positions`` [T, topk] (-1: none) as global cache
slots ``block_table[req, p // page] * page + p % page`` of each row's request. A position that
is not the request's is -1: negative, past the block table's columns, or (given ``seq_lens``)
at or past the request's length; rows past ``query_start_loc[-1]`` are all -1."""
