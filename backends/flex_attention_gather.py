"""FLEX_ATTENTION's gathered layout: each request's pages copied into consecutive pages of
``GATHER_PAGE`` keys, so that FlexAttention's key tile -- never wider than one KV block -- is its
own default, not one small page. :func:`gather_map` makes the virtual block table and the
physical pages each virtual page copies (in the builder); :func:`gather_pages` copies them
head-major in the op (``gather_pages_kernel`` on GPUs, torch ops elsewhere);
:func:`gathered_views` gives FlexAttention K and V over the copy. When a step takes this layout:
``routing.flex_gathers``.
"""

from __future__ import annotations

import torch

from attn_ops.routing import pow2

# Keys per gathered page (GATHER_PAGE // block_size physical pages each).
GATHER_PAGE = 128


def gather_map(block_table, seq_lens, block_size, num_blocks=None):
    """The gathered layout's tables: a virtual block table giving request ``r`` the consecutive
    virtual pages ``r * W .. r * W + W - 1`` (``W``: its table width in virtual pages) and
    ``page_map [B * W, GATHER_PAGE // block_size]``, the physical pages each virtual page
    copies -- the request's own pages in order, past its last page (or its row's end) its
    first page again (so no copied slot holds another request's data or a never-written
    page's). Block ids arrive on the device and are never trusted: a virtual page holding one
    outside the cache's ``num_blocks`` (when given) is left out of the virtual table (-1: no KV
    block, its keys absent) and its copy holds zeros (:func:`gather_pages`)."""
    f = GATHER_PAGE // block_size
    b, width = block_table.shape
    w = -(-width // f)
    pages = (seq_lens.long() + block_size - 1) // block_size
    cols = torch.arange(w * f, device=block_table.device)
    table = torch.nn.functional.pad(block_table, (0, w * f - width))
    own = (cols[None, :] < pages[:, None]) & (cols[None, :] < width)
    table = torch.where(own, table, block_table[:, :1])
    vtable = torch.arange(b * w, device=block_table.device, dtype=block_table.dtype).view(b, w)
    if num_blocks is not None:
        bad = own & ((table < 0) | (table >= num_blocks))
        vtable = torch.where(bad.view(b, w, f).any(2), -1, vtable)
    return vtable, table.reshape(b * w, f)


def gather_pages(kv_cache, page_map, pages):
    """The pages ``page_map [V, f]`` names, copied head-major into ``[C, heads, slots, DC]``
    (:func:`gathered_shape`, room for ``pages >= V`` virtual pages) -- an interleaved cache's
    K and V (``C = 2``, ``DC = head_dim``) each as FlexAttention's dense ``[heads, slots,
    dim]``, a packed cache's slots whole (``C = 1``). ``page_map`` arrives on the device: an
    id outside the cache is copied as zeros, never read.
    One pass on GPUs (:func:`_copy_with_kernel`); :func:`gather_pages_torch` elsewhere."""
    if not kv_cache.is_cuda:
        return gather_pages_torch(kv_cache, page_map, pages)
    slots = slot_major(kv_cache)
    out = kv_cache.new_empty(gathered_shape(slots, page_map, pages))
    _copy_with_kernel(slots, page_map, out)
    return out


def gather_pages_torch(kv_cache, page_map, pages):
    """:func:`gather_pages` in torch ops: the pages selected, then moved head-major."""
    slots = slot_major(kv_cache)
    ids = page_map.flatten()
    ok = (ids >= 0) & (ids < slots.shape[0])
    picked = torch.index_select(slots, 0, torch.where(ok, ids, 0))
    picked = picked.masked_fill(~ok.view(-1, *(1,) * (picked.dim() - 1)), 0)
    if picked.dim() == 4:  # (packed: one part per slot)
        picked = picked.unsqueeze(3)
    c, h, total, dc = gathered_shape(slots, page_map, pages)
    out = kv_cache.new_zeros(c, h, total, dc)  # (the tail past V pages zeroed: cheap off GPUs)
    out[:, :, :page_map.numel() * slots.shape[1]] = picked.permute(3, 2, 0, 1, 4).flatten(2, 3)
    return out


def _copy_with_kernel(slots, page_map, out):
    """:func:`gather_pages`'s copy by ``gather_pages_kernel`` (a slot of every head per
    program; ``slots`` from :func:`slot_major`, last dim contiguous)."""
    from attn_ops.backends.flex_attention_kernels import gather_pages_kernel

    c, h, total, dc = out.shape
    bs = slots.shape[1]
    assert slots.stride(-1) == 1, slots.stride()
    gather_pages_kernel[(page_map.numel(), bs)](
        slots, page_map.contiguous(), out, slots.shape[0], slots.stride(0), slots.stride(1),
        slots.stride(2), slots.stride(3) if c > 1 else 0, total, BLOCK_SIZE=bs, H=h,
        H_P=pow2(h), C=c, DC=dc, DC_P=pow2(dc))


def slot_major(kv_cache):
    """The cache as ``[blocks, block_size, heads, ...]``: an interleaved one ``[blocks, 2,
    block_size, heads, dim]`` read as ``[blocks, block_size, heads, 2, dim]`` (a view)."""
    return kv_cache.permute(0, 2, 3, 1, 4) if kv_cache.dim() == 5 else kv_cache


def gathered_shape(slots, page_map, pages) -> tuple[int, int, int, int]:
    """``[C, heads, pages * f * block_size, DC]``, :func:`gather_pages`' result, from the cache
    read slot-major (:func:`slot_major`); past the ``V * f`` copied pages the slots are never
    written nor read (``pages``: ``V`` padded to ``flex_attention.shape_bucket``)."""
    f, c = page_map.shape[1], slots.shape[3] if slots.dim() == 5 else 1
    return c, slots.shape[2], pages * f * slots.shape[1], slots.shape[-1]


def gathered_views(gathered, head_dim):
    """K and V as FlexAttention's ``[1, heads, slots, dim]`` over :func:`gather_pages`'
    result (an interleaved cache's: dense; a packed cache's: parts of each slot)."""
    if gathered.shape[0] == 2:
        return gathered[0][None], gathered[1][None]
    return gathered[0, ..., :head_dim][None], gathered[0, ..., head_dim:][None]
