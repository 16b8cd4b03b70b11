"""DeepSeek-V4's cache entries as vLLM stores them (``fp8_ds_mla`` for V4): 584 bytes an entry
of the shared K = V head of 512 (448 "nope" dims + 64 rotated), for the sliding-window tokens
and the compressed entries alike.

An entry: the vector rounded to bf16; dims 0..447 as fp8 e4m3 in 7 groups of 64, each with a
UE8M0 scale (a power of two ``s = 2^ceil(log2(max(amax, 1e-4) / 448))``, stored as the byte
``log2(s) + 127``); dims 448..511 as bf16. A page of ``B`` entries is planar: ``B x 576`` bytes
of entry data (448 fp8 + 128 bf16 bytes each), then ``B x 8`` scale bytes (7 scales and a zero
byte each). The cache is ``uint8 [num_blocks, B * 584]``.

The compressed-sparse layers' index keys (``dim`` 128 in V4) take ``dim + 4`` bytes an entry:
the key rounded to bf16, in e4m3 over one power-of-two fp32 scale (``2^ceil(log2(max(amax,
1e-4) / 448))``),
planar in a page of ``B`` entries as vLLM stores them -- ``B x dim`` key bytes, then ``B``
float32 scales (132 bytes an entry at V4's 128): ``uint8 [num_blocks, B * (dim + 4)]``.
"""

from __future__ import annotations

import torch

from attn_ops.ops import define_op

__all__ = ["ENTRY_BYTES", "NOPE", "ROPE", "check_entry_write", "check_index_write",
           "dequantize_entries", "dequantize_index_keys", "entries_a_page",
           "entry_write", "index_views", "index_write", "quantize_entries", "read_entries"]

NOPE, ROPE, GROUP = 448, 64, 64
DATA_BYTES = NOPE + 2 * ROPE  # 576
SCALE_BYTES = 8  # 7 UE8M0 scales + a zero byte
ENTRY_BYTES = DATA_BYTES + SCALE_BYTES  # 584


def quantize_entries(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, 512]`` as ``(data uint8 [N, 576], scales uint8 [N, 8])``."""
    if x.shape[-1] != NOPE + ROPE:
        raise ValueError(f"DeepSeek-V4 entries are {NOPE} + {ROPE} wide, got {x.shape[-1]}")
    v = x.to(torch.bfloat16).float()  # (vLLM rounds the vector to bf16 before quantizing)
    nope = v[:, :NOPE].unflatten(1, (NOPE // GROUP, GROUP))
    amax = nope.abs().amax(-1).clamp_min(1e-4)
    exponent = torch.ceil(torch.log2(amax / 448.0))
    scaled = (nope / torch.exp2(exponent)[..., None]).clamp(-448.0, 448.0)
    fp8 = scaled.to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)
    rope = v[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.zeros(x.shape[0], SCALE_BYTES, dtype=torch.uint8, device=x.device)
    scales[:, :NOPE // GROUP] = (exponent + 127).to(torch.uint8)
    return torch.cat([fp8, rope], -1), scales


def dequantize_entries(data: torch.Tensor, scales: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`quantize_entries` undone: ``[N, 512]`` in ``dtype``."""
    fp8 = data[:, :NOPE].contiguous().view(torch.float8_e4m3fn).to(dtype)
    exponent = scales[:, :NOPE // GROUP].to(dtype) - 127
    nope = (fp8.unflatten(1, (NOPE // GROUP, GROUP)) * torch.exp2(exponent)[..., None]).flatten(1)
    rope = data[:, NOPE:].contiguous().view(torch.bfloat16).to(dtype)
    return torch.cat([nope, rope], -1)


def entries_a_page(cache: torch.Tensor, index_dim: int = 0) -> int:
    """Entries a page of a V4 cache holds: ``[blocks, page, D]`` rows, ``uint8 [blocks, page *
    584]`` entries or, with ``index_dim``, planar fp8 index keys ``uint8 [blocks, page *
    (index_dim + 4)]``."""
    if cache.dtype != torch.uint8:
        return cache.shape[1]
    return cache.shape[1] // (index_dim + 4 if index_dim else ENTRY_BYTES)


def _planar(cache: torch.Tensor, block_size: int):
    """The page's two planes: ``(data [blocks, B, 576], scales [blocks, B, 8])`` views."""
    data = cache[:, :block_size * DATA_BYTES].unflatten(1, (block_size, DATA_BYTES))
    scales = cache[:, block_size * DATA_BYTES:block_size * ENTRY_BYTES].unflatten(
        1, (block_size, SCALE_BYTES))
    return data, scales


def check_entry_write(entries, cache, slot_mapping, block_size):
    """The shapes a write of entries (or rows) needs."""
    op = "dsv4_entry_write"
    if cache.dtype != torch.uint8:  # (rows of the model dtype)
        if entries.dim() != 2 or cache.dim() != 3 or cache.shape[1:] != (block_size,
                                                                           entries.shape[1]):
            raise ValueError(f"{op}: a cache of rows must be [num_blocks, block_size="
                             f"{block_size}, D] for entries [num_tokens, D], got "
                             f"{tuple(cache.shape)} and {tuple(entries.shape)}")
    elif entries.dim() != 2 or entries.shape[1] != NOPE + ROPE:
        raise ValueError(f"{op}: entries must be [num_tokens, {NOPE + ROPE}], got "
                         f"{tuple(entries.shape)}")
    elif cache.dim() != 2 or cache.shape[1] != block_size * ENTRY_BYTES:
        raise ValueError(f"{op}: the cache must be uint8 [num_blocks, block_size x {ENTRY_BYTES}"
                         f" = {block_size * ENTRY_BYTES}], got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    if slot_mapping.shape != (entries.shape[0],):
        raise ValueError(f"{op}: slot_mapping must be [num_tokens={entries.shape[0]}], got "
                         f"{tuple(slot_mapping.shape)}")


def _write_impl(entries, cache, slot_mapping, block_size):
    check_entry_write(entries, cache, slot_mapping, block_size)
    if entries.is_cuda and entries.shape[1] % 2 == 0 and (cache.dtype == torch.uint8
                                                          or cache.stride(2) == 1):
        from attn_ops.backends.deepseek_v4.write_kernels import entry_write_triton

        # (one launch, no host read: graph-capturable; the torch body below is its oracle)
        entry_write_triton(entries if entries.stride(1) == 1 else entries.contiguous(), cache,
                           slot_mapping)
        return
    slots = slot_mapping.long()
    rows = ((slots >= 0) & (slots < cache.shape[0] * block_size)).nonzero().squeeze(1)
    slots = slots.index_select(0, rows)
    if cache.dtype != torch.uint8:
        cache[slots // block_size, slots % block_size] = entries.index_select(0, rows).to(
            cache.dtype)
        return
    data, scales = quantize_entries(entries.index_select(0, rows))
    planes = _planar(cache, block_size)
    for plane, new in zip(planes, (data, scales)):
        plane[slots // block_size, slots % block_size] = new


def _write_fake(entries, cache, slot_mapping, block_size):
    check_entry_write(entries, cache, slot_mapping, block_size)


entry_write = define_op(
    "dsv4_entry_write",
    "(Tensor entries, Tensor(a!) cache, Tensor slot_mapping, int block_size) -> ()",
    _write_impl, _write_fake)
entry_write.__doc__ = """Quantize ``entries [T, 512]`` (a compressed entry or a window token,
already normed and rotated) into the planar 584-byte layout at ``slot_mapping`` (-1 and slots
outside the cache skipped); a cache of rows (``[blocks, block_size, D]``, not uint8) takes them
in its dtype."""


def read_entries(cache: torch.Tensor, block_size: int, slots: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The entries at ``slots`` read back, ``[len(slots), 512]`` (the tests' and the torch
    paths' read)."""
    data, scales = _planar(cache, block_size)
    slots = slots.long()
    return dequantize_entries(data[slots // block_size, slots % block_size],
                              scales[slots // block_size, slots % block_size], dtype)


FP8_MAX = 448.0


def index_views(cache: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A planar fp8 index-key cache (``uint8 [blocks, page * (dim + 4)]``) as its two planes:
    ``(keys float8_e4m3fn [blocks, page, dim], scales float32 [blocks, page, 1])``, views."""
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] % (dim + 4):
        raise ValueError(f"an fp8 index-key cache is uint8 [num_blocks, page x (dim + 4) = "
                         f"page x {dim + 4}], got {cache.dtype} {tuple(cache.shape)}")
    page = cache.shape[1] // (dim + 4)
    keys = cache[:, :page * dim].view(torch.float8_e4m3fn).unflatten(1, (page, dim))
    scales = cache[:, page * dim:].view(torch.float32).unsqueeze(2)
    return keys, scales


def check_index_write(k, cache, slot_mapping):
    """The shapes a write of index keys needs."""
    op = "dsv4_index_write"
    if k.dim() != 2 or slot_mapping.shape != (k.shape[0],) or slot_mapping.is_floating_point():
        raise ValueError(f"{op}: k [num_tokens, dim] and an integer slot_mapping [num_tokens] "
                         f"expected, got {tuple(k.shape)} and {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if cache.dtype == torch.uint8:
        index_views(cache, k.shape[1])
    elif cache.dim() != 3 or cache.shape[2] != k.shape[1]:
        raise ValueError(f"{op}: a cache of rows must be [num_blocks, page, {k.shape[1]}], got "
                         f"{tuple(cache.shape)}")


def _index_write_impl(k, cache, slot_mapping):
    check_index_write(k, cache, slot_mapping)
    if cache.dtype != torch.uint8:
        _write_impl(k, cache, slot_mapping, cache.shape[1])
        return
    if k.is_cuda and k.shape[1] % 2 == 0:  # (one launch, no host read: graph-capturable)
        from attn_ops.backends.deepseek_v4.write_kernels import entry_write_triton

        entry_write_triton(k if k.stride(1) == 1 else k.contiguous(), cache, slot_mapping,
                           index=True)
        return
    keys, scales = index_views(cache, k.shape[1])
    slots = slot_mapping.long()
    keep = ((slots >= 0) & (slots < keys.shape[0] * keys.shape[1])).nonzero().squeeze(1)
    # (vLLM rounds the key to bf16 before quantizing it)
    slots, x = slots.index_select(0, keep), k.index_select(0, keep).to(torch.bfloat16).float()
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(1, keepdim=True).clamp_min(1e-4)
                                             / FP8_MAX)))
    fp8 = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    page = keys.shape[1]
    keys.view(torch.uint8)[slots // page, slots % page] = fp8.view(torch.uint8)
    scales[slots // page, slots % page] = scale


index_write = define_op(
    "dsv4_index_write",
    "(Tensor k, Tensor(a!) cache, Tensor slot_mapping) -> ()",
    _index_write_impl, lambda *args: check_index_write(*args))
index_write.__doc__ = """Write index keys ``k [T, dim]`` at ``slot_mapping`` (-1 and slots
outside the cache skipped): into a planar fp8 cache (``uint8``, :func:`index_views`) in e4m3
over a power-of-two scale each, or into a cache of rows in its dtype."""


def dequantize_index_keys(cache: torch.Tensor, dim: int, slots: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The index keys at ``slots`` of a planar fp8 cache read back: ``[len(slots), dim]``."""
    keys, scales = index_views(cache, dim)
    slots = slots.long()
    page = keys.shape[1]
    return keys[slots // page, slots % page].to(dtype) * scales[slots // page,
                                                                slots % page].to(dtype)
