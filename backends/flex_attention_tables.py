"""FLEX_ATTENTION's step tables, made on the device without a host sync (so a step can be
captured): per query row its request, position and visible-key limit; per cache page its owner
request and logical index; and the BlockMask's partial and full KV blocks -- exactly the pages
of the requests in each query block that some query can see, from the block table. Layouts:
:func:`step_tensors` (rows of the whole step, or over gathered pages) and
:func:`decode_tensors` (one batch element per single-token request)."""

from __future__ import annotations

import torch

__all__ = ["Q_BLOCK", "SHAPE_BUCKET_STEP", "compact", "decode_batch", "decode_tensors",
           "int32", "kv_blocks", "page_maps", "shape_bucket", "step_tensors"]

Q_BLOCK = 128
# Query blocks and gathered pages are padded to powers of two up to this count, then to its
# multiples (shape_bucket): each new count compiles FlexAttention again.
SHAPE_BUCKET_STEP = 64


def step_tensors(query_start_loc, seq_lens, block_table, tokens, num_pages, block_size,
                  period, causal=True, window=None, full=False, gathered=False, row_keys=None):
    """Per row (``tokens`` padded to a bucket of query blocks, :func:`shape_bucket`): request
    (``B`` for padding), position, visible-key limit; per page: owner and logical index -- or,
    ``gathered`` (``block_table`` is :func:`gather_map`'s virtual table: request ``r``'s keys
    are the slots from ``r * width * block_size`` on, of which the first ``row_keys`` -- its
    physical row's reach; default all -- may be visible), per row the first slot of its
    request and one past the last slot it may see (padding: 0, 0), so that ``mask_mod`` reads
    no per-key table; and the BlockMask's partial and full KV blocks (:func:`kv_blocks`). A
    query block with padding rows below ``tokens`` (rows the op copies out) has no full KV
    blocks, so those rows see no key and FlexAttention writes them as zeros. Block ids and
    lengths are device values, never trusted (:func:`page_maps`): a page whose block id is
    outside the cache is no KV block and keys past the table's row are none. Device only."""
    dev = seq_lens.device
    b, width = block_table.shape
    qsl = query_start_loc.long()
    seq = seq_lens.long()
    rows = shape_bucket(-(-tokens // Q_BLOCK)) * Q_BLOCK
    t = torch.arange(rows, device=dev)
    # Searched in the whole input, not in a slice: torch 2.11's Inductor drops the slice's
    # offset from searchsorted's boundaries (an input's view: every request off by one on the
    # H200) or fails to lower it (a computed buffer's).
    req = (torch.searchsorted(query_start_loc, t.to(query_start_loc.dtype), right=True) - 1) \
        .clamp(min=0).long()
    valid = req < b
    r = req.clamp(max=max(b - 1, 0))
    q_len = qsl[1:] - qsl[:-1]
    qpos = seq[r] - q_len[r] + (t - qsl[r])
    kv_limit = torch.where(valid, seq[r], 0)
    _, used, page_req, owner, logical = page_maps(seq, block_table, num_pages, block_size)
    # Query block j holds requests lo[j]..hi[j]; its KV blocks are their pages, in order --
    # those some row can see, given the rows' positions (per block and request, min and max).
    blocks = rows // Q_BLOCK
    req_blocks = req.view(blocks, Q_BLOCK)
    lo = torch.where(valid.view(blocks, Q_BLOCK), req_blocks, b).amin(1)
    hi = torch.where(valid.view(blocks, Q_BLOCK), req_blocks, -1).amax(1)
    include = used.flatten()[None, :] & (page_req[None, :] >= lo[:, None]) \
        & (page_req[None, :] <= hi[:, None])
    block_pos = qpos.view(blocks, Q_BLOCK)
    pmin = torch.full((blocks, b + 1), 1 << 62, device=dev).scatter_reduce(
        1, req_blocks, block_pos, "amin")[:, page_req]
    pmax = torch.full((blocks, b + 1), -1, device=dev).scatter_reduce(
        1, req_blocks, block_pos, "amax")[:, page_req]
    start = (torch.arange(width, device=dev) * block_size).repeat(b)[None, :]
    # (lists as wide as FlexAttention's KV block count, which it expects of kv_indices)
    one_request = (lo == hi) & (valid | (t >= tokens)).view(blocks, Q_BLOCK).all(1)
    kv_num, kv_idx, full_num, full_idx = kv_blocks(
        include, start, block_size, pmin, pmax, seq[page_req][None, :], causal, window,
        one_request[:, None] if full else None,
        (block_table.flatten() * (period // block_size))[None, :],
        (num_pages - 1) * (period // block_size) + 1)
    if gathered:  # (never past the request's own row: its reach in its virtual pages)
        owner = torch.where(valid, r * (width * block_size), 0)
        reach = width * block_size if row_keys is None else min(row_keys, width * block_size)
        logical = torch.where(valid, owner + (qpos + 1 if causal else kv_limit).clamp(max=reach),
                              0)
    return (*int32(req, qpos, kv_limit, owner, logical), valid, kv_num[None, None],
            kv_idx[None, None], full_num[None, None], full_idx[None, None])


def int32(*tables):
    """The tables ``mask_mod`` / ``score_mod`` read, as int32: FlexAttention's indices are
    int32, and int64 tables would make every masked tile's arithmetic 64-bit."""
    return tuple(t.to(torch.int32) for t in tables)


def kv_blocks(include, start, block_size, pmin, pmax, limit, causal, window, one_request,
               values, cols):
    """The BlockMask's partial and full KV blocks, ``(kv_num [R], kv_idx [R, cols], full_num,
    full_idx)``, from an ``[R, entries]`` grid of page-table entries: ``include`` (the entry is
    a page of one of row ``R``'s requests), the page's first key ``start``, the positions
    ``pmin..pmax`` of the row's queries of that request (``pmax`` -1: none) and its length
    ``limit``. A page no query of the row can see (causal, window) is dropped; one that every
    query of the row sees in whole is full -- FlexAttention skips ``mask_mod`` there -- when
    ``one_request`` says the row's queries are all of that request (None: no full blocks, as
    with a user's ``mask_mod``). ``values``: the entries' KV block indices."""
    end = start + block_size  # (one past the page's last key)
    visible = include & (start <= pmax) if causal else include & (pmax >= 0)
    if window is not None:
        visible = visible & (end - 1 > pmin - window)
        if not causal:
            visible = visible & (start < pmax + window)
    whole = torch.zeros_like(visible)
    if one_request is not None:
        whole = visible & one_request & (end <= limit)
        if causal:
            whole = whole & (end - 1 <= pmin)
        if window is not None:
            whole = whole & (pmax - start < window)
            if not causal:
                whole = whole & (end - 1 - pmin < window)
    return (*compact(visible & ~whole, values, cols), *compact(whole, values, cols))


def compact(mask, values, cols):
    """Per row of ``mask [R, E]``: how many entries are set -- at most ``cols``: the entries
    of a row are distinct pages -- and their ``values`` moved to the front of an int32
    ``[R, cols]`` list (the rest 0)."""
    rows = mask.shape[0]
    out = torch.zeros(rows, cols + 1, dtype=torch.int32, device=mask.device)
    out.scatter_(1, torch.where(mask, mask.cumsum(1) - 1, cols),  # (column cols: the others)
                 values.to(torch.int32).expand(rows, -1).contiguous())
    return mask.sum(1).to(torch.int32), out[:, :cols]


def page_maps(seq, block_table, num_pages, block_size):
    """Per request its page count and used table entries; per table entry its request; per
    cache page its owner request (-1: none) and logical index. Device only. Block ids and
    lengths arrive on the device and are never trusted: an entry whose block id is outside
    the cache's ``num_pages`` is not used (its page is no KV block and has no owner, so its
    keys are absent), and a request needing more pages than its row holds uses its row."""
    dev = seq.device
    b, width = block_table.shape
    pages = (seq + block_size - 1) // block_size
    used = (torch.arange(width, device=dev)[None, :] < pages[:, None]) \
        & (block_table >= 0) & (block_table < num_pages)
    page_req = torch.arange(b, device=dev).repeat_interleave(width)
    idx = torch.where(used, block_table.long(), num_pages).flatten()
    owner = torch.full((num_pages + 1,), -1, dtype=torch.long, device=dev)
    owner.scatter_(0, idx, page_req)
    logical = torch.zeros(num_pages + 1, dtype=torch.long, device=dev)
    logical.scatter_(0, idx, torch.arange(width, device=dev).repeat(b))
    return pages, used, page_req, owner[:num_pages], logical[:num_pages]


def shape_bucket(n: int) -> int:
    """The count a step's query blocks or gathered pages are padded to: the next power of two up
    to ``SHAPE_BUCKET_STEP``, then the next multiple of it -- every new count would compile
    FlexAttention again, and a serving loop's counts change every step. (Padding query blocks
    list no KV block, so FlexAttention's programs for them exit at once; padding pages are
    allocated, never copied nor read.)"""
    if n <= SHAPE_BUCKET_STEP:
        return decode_batch(n)
    return -(-n // SHAPE_BUCKET_STEP) * SHAPE_BUCKET_STEP


def decode_batch(num_tokens: int) -> int:
    """The decode layout's batch for ``num_tokens`` (padded) single-token requests: the next
    power of two, so that a run of steps compiles a handful of shapes, not one per batch."""
    return 1 << max(num_tokens - 1, 0).bit_length()


def decode_tensors(seq_lens, block_table, batch, num_pages, block_size, period, causal=True,
                    window=None, full=False):
    """The decode layout's tables: one FlexAttention batch element per request (``batch`` of
    them, from :func:`decode_batch`; the padding ones have no KV blocks), each with one query
    row and exactly its own pages as KV blocks (those its query can see; full ones where
    ``full``, see :func:`kv_blocks`) -- so FlexAttention parallelizes over requests and, in
    its decoding kernel, splits each request's keys. (The packed layout puts up to 128 decodes
    in one query block whose single program walks all their pages, far too slow.)
    Same tuple as :func:`step_tensors`, indexed by batch element instead of row. On the CPU
    the lists are as wide as the cache's KV blocks (its template requires it); on GPUs as wide
    as the block table."""
    dev = seq_lens.device
    b, width = block_table.shape
    seq = seq_lens.long()
    _, used, _, owner, logical = page_maps(seq, block_table, num_pages, block_size)
    req = torch.arange(batch, device=dev)
    pad = (0, batch - b)
    qpos = torch.nn.functional.pad(seq - 1, pad)[:, None]
    kv_limit = torch.nn.functional.pad(seq, pad)[:, None]
    kv_num, kv_idx, full_num, full_idx = kv_blocks(
        torch.nn.functional.pad(used, (0, 0) + pad),
        torch.arange(width, device=dev)[None, :] * block_size, block_size, qpos,
        torch.where(kv_limit > 0, qpos, -1), kv_limit, causal, window, True if full else None,
        torch.nn.functional.pad(block_table, (0, 0) + pad) * (period // block_size),
        (num_pages - 1) * (period // block_size) + 1 if dev.type == "cpu" else width)
    if not full:  # no full list at all (zero wide): see routing.flex_decode_splits
        full_idx = full_idx[:, :0]
    return (*int32(req, qpos[:, 0], kv_limit[:, 0], owner, logical), req < b,
            kv_num[:, None, None], kv_idx[:, None, None], full_num[:, None, None],
            full_idx[:, None, None])
