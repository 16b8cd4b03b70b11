"""DSV4_FLASHMLA: DeepSeek-V4's attention on FlashMLA's sparse fp8 decode (sm90), as vLLM's
``DeepseekV4FlashMLAAttention`` calls it; the indexer and the cache writes are DSV4_TRITON's.

Every query row of a step -- decodes and prefill tokens alike -- is one row of
``flash_mla_with_kvcache`` over vLLM's 584-byte entries (``[blocks, page, 1, 584]`` e4m3 views
of the uint8 caches): its window as ``indices`` (the ``min(p + 1, W)`` window slots through the
window's block table, -1 after them, padded to a multiple of 64) and its compressed entries as
``extra_indices_in_kvcache`` over ``extra_k_cache`` (C4A: the indexer's picks as global slots;
C128A: every entry complete at ``p``), the sink as ``attn_sink`` (fp32; the heads FlashMLA pads
to 64 or 128 get zero queries and a -inf sink, and their rows are dropped). The index lists are
built on the device from ``query_start_loc`` / ``seq_lens`` (no host read; on GPUs in one
launch, :func:`index_lists_triton`); any entry that is not a slot of its cache -- a block id
outside it or -1 (a released window page), a pick past the visible entries -- is -1. No
``topk_length`` is passed, so the kernel's tile schedule depends on the shapes only: one a
shape, reused across steps and inside CUDA graphs. Calls hold at most
``Tuning.mla.flashmla_rows_a_call`` rows (the tile scheduler's bound).
"""

from __future__ import annotations

import inspect
from typing import ClassVar

import torch
import triton
import triton.language as tl

from attn_ops.backends.deepseek_v4.backend import (DeepseekV4TritonBackend, _table,
                                                   check_attention)
from attn_ops.backends.deepseek_v4.cache import ENTRY_BYTES, entries_a_page
from attn_ops.backends.mla.indexer_kernels import _row_position
from attn_ops.capabilities import CUDAGraphSupport, Reason
from attn_ops.ops import define_op
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.providers import FLASHMLA as PROVIDERS
from attn_ops.routing import FLASHMLA_MAX_ROWS
from attn_ops.tuning import default_tuning

__all__ = ["DeepseekV4FlashMLABackend", "flashmla_attention", "index_lists",
           "index_lists_triton"]

HEAD_COUNTS = (64, 128)  # the query heads its sm90 sparse decode takes
BLOCK_SLOTS = 64  # its index lists are padded to multiples of this
_V4_ARGS = ("attn_sink", "extra_k_cache", "extra_indices_in_kvcache")
_SCHEDULES: dict[tuple, object] = {}


def _slots(table, req, entries, ok, page: int, blocks: int) -> torch.Tensor:
    """Global slots of ``entries [T, K]`` of each row's request (``ok``: wanted), -1 where not
    a slot of the cache (a column past the table, a block id outside the cache)."""
    col = entries // page
    ok = ok & (entries >= 0) & (col < table.shape[1])
    block = table.long()[req[:, None], col.clamp(0, table.shape[1] - 1)]
    ok = ok & (block >= 0) & (block < blocks)
    return torch.where(ok, block * page + entries % page, -1).to(torch.int32)


def _padded_width(k: int) -> int:
    """An index list of ``k`` entries padded to FlashMLA's multiple of ``BLOCK_SLOTS``."""
    return max(BLOCK_SLOTS, -(-k // BLOCK_SLOTS) * BLOCK_SLOTS)


def _padded(slots: torch.Tensor) -> torch.Tensor:
    k = slots.shape[1]
    return torch.nn.functional.pad(slots, (0, _padded_width(k) - k), value=-1).unsqueeze(1)


def index_lists(query_start_loc, seq_lens, block_table, window_cache, sliding_window: int,
                t: int, compressed_cache=None, compressed_block_table=None, ratio: int = 0,
                picks=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(window indices [T, 1, Kw], compressed indices [T, 1, Kc] or None)`` int32 global
    slots, -1 padded (the module docstring's rule)."""
    from attn_ops.backends.mla.indexer_kernels import visible_rows

    # (each row's request, and its position + 1: 0 for padding rows)
    req, seen = visible_rows(t, seq_lens, query_start_loc, 2 ** 31 - 1)
    req, seen = req.long(), seen.long()
    n_win = seen.clamp(max=sliding_window)
    j = torch.arange(sliding_window, device=seen.device)
    wpos = (seen - n_win)[:, None] + j[None, :]
    window = _slots(block_table, req, wpos, j[None, :] < n_win[:, None],
                    entries_a_page(window_cache), window_cache.shape[0])
    if compressed_cache is None:
        return _padded(window), None
    visible = seen // ratio
    if picks is None:  # (every entry the table reaches, those complete at p kept)
        page = entries_a_page(compressed_cache)
        entries = torch.arange(compressed_block_table.shape[1] * page, device=seen.device)
        entries = entries[None, :].expand(t, -1)
    else:
        entries = picks.long()
    extra = _slots(compressed_block_table, req, entries, entries < visible[:, None],
                   entries_a_page(compressed_cache), compressed_cache.shape[0])
    return _padded(window), _padded(extra)


@triton.jit
def _slot_of(table_ptr, req, entry, ok, width, stride, blocks, PAGE: tl.constexpr):
    """:func:`_slots` for one row's ``entry`` block: the global slot, -1 where not a slot."""
    col = entry // PAGE
    ok = ok & (entry >= 0) & (col < width)
    block = tl.load(table_ptr + req * stride + col, mask=ok, other=-1).to(tl.int64)
    ok = ok & (block >= 0) & (block < blocks)
    return tl.where(ok, block * PAGE + entry % PAGE, -1).to(tl.int32)


@triton.jit(do_not_specialize=["num_reqs", "steps", "bt_width", "cbt_width", "win_blocks",
                               "comp_blocks", "num_cols", "window", "ratio"])
def index_lists_kernel(qsl_ptr, seq_ptr, bt_ptr, cbt_ptr, picks_ptr, win_ptr, comp_ptr,
                       num_reqs, steps, bt_width, cbt_width, win_blocks, comp_blocks, num_cols,
                       window, ratio, stride_bt, stride_cbt, stride_pk, KW: tl.constexpr,
                       KC: tl.constexpr, WPAGE: tl.constexpr, CPAGE: tl.constexpr,
                       MODE: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(t, b)``: row ``t``'s index-list columns ``b * BLOCK ...`` -- the window's
    ``KW`` padded columns, then the compressed entries' ``KC`` (``MODE`` 1: entry ``c``, 2:
    ``picks[t, c]``; ``num_cols`` of them) -- as :func:`index_lists`' torch form writes them."""
    t = tl.program_id(0)
    col0 = tl.program_id(1) * BLOCK
    req, pos = _row_position(qsl_ptr, seq_ptr, t, num_reqs, steps)
    seen = tl.where(t < tl.load(qsl_ptr + num_reqs), tl.maximum(pos + 1, 0), 0).to(tl.int64)
    req = req.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if col0 < KW:
        j = col0 + offs
        n_win = tl.minimum(seen, window)
        slot = _slot_of(bt_ptr, req, seen - n_win + j, j < n_win, bt_width, stride_bt,
                        win_blocks, WPAGE)
        tl.store(win_ptr + t.to(tl.int64) * KW + j, slot)
    else:
        c = col0 - KW + offs
        if MODE == 1:
            entry = c.to(tl.int64)
        else:
            entry = tl.load(picks_ptr + t.to(tl.int64) * stride_pk + c, mask=c < num_cols,
                            other=-1).to(tl.int64)
        slot = _slot_of(cbt_ptr, req, entry, (c < num_cols) & (entry < seen // ratio),
                        cbt_width, stride_cbt, comp_blocks, CPAGE)
        tl.store(comp_ptr + t.to(tl.int64) * KC + c, slot)


def index_lists_triton(query_start_loc, seq_lens, block_table, window_cache,
                       sliding_window: int, t: int, compressed_cache=None,
                       compressed_block_table=None, ratio: int = 0,
                       picks=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`index_lists` in one launch (its torch form is about twenty small launches)."""
    device = seq_lens.device
    kw = _padded_width(sliding_window)
    window = torch.empty(t, 1, kw, dtype=torch.int32, device=device)
    mode, cols, kc, extra = 0, 0, 0, window
    c_table, c_blocks, c_page = block_table, 1, 1
    if compressed_cache is not None:
        mode = 1 if picks is None else 2
        c_page = entries_a_page(compressed_cache)
        cols = (compressed_block_table.shape[1] * c_page if picks is None
                else picks.shape[1])
        kc = _padded_width(cols)
        extra = torch.empty(t, 1, kc, dtype=torch.int32, device=device)
        c_table, c_blocks = compressed_block_table, compressed_cache.shape[0]
    if t == 0:
        return window, extra if mode else None
    b = seq_lens.shape[0]
    pk = picks if picks is not None else c_table
    index_lists_kernel[(t, (kw + kc) // BLOCK_SLOTS)](
        query_start_loc, seq_lens, block_table, c_table, pk, window, extra, b,
        max(1, b.bit_length()), block_table.shape[1], c_table.shape[1], window_cache.shape[0],
        c_blocks, cols, sliding_window, max(ratio, 1), block_table.stride(0),
        c_table.stride(0), pk.stride(0), KW=kw, KC=kc, WPAGE=entries_a_page(window_cache),
        CPAGE=c_page, MODE=mode, BLOCK=BLOCK_SLOTS, num_warps=2)
    return window, extra if mode else None


def _fp8_pages(cache: torch.Tensor) -> torch.Tensor:
    """A 584-byte cache as FlashMLA reads it: ``[blocks, page, 1, 584]`` e4m3."""
    page = entries_a_page(cache)
    return cache[:, :page * ENTRY_BYTES].view(torch.float8_e4m3fn).view(
        cache.shape[0], page, 1, ENTRY_BYTES)


def _check(q, window_cache, query_start_loc, seq_lens, block_table, sinks, scale,
           sliding_window, compressed_cache, compressed_block_table, ratio, picks):
    op = "dsv4_flashmla_attention"
    check_attention(q, window_cache, query_start_loc, seq_lens, block_table, sinks,
                    compressed_cache, compressed_block_table, picks, op)
    if q.dtype != torch.bfloat16 or q.shape[2] != 512 or q.shape[1] > HEAD_COUNTS[-1]:
        raise ValueError(f"{op}: q must be bfloat16 [T, <= {HEAD_COUNTS[-1]} heads, 512], got "
                         f"{q.dtype} {tuple(q.shape)}")
    for name, cache in (("window_cache", window_cache), ("compressed_cache", compressed_cache)):
        if cache is not None and (cache.dtype != torch.uint8 or cache.dim() != 2
                                  or cache.shape[1] < ENTRY_BYTES):
            raise ValueError(f"{op}: {name} must hold vLLM's 584-byte entries (uint8 "
                             f"[blocks, page x 584]), got {cache.dtype} {tuple(cache.shape)}")
    if compressed_cache is not None and ratio < 2:
        raise ValueError(f"{op}: ratio={ratio}: a compressed layer's groups are >= 2 tokens")


def _impl(q, window_cache, query_start_loc, seq_lens, block_table, sinks, scale,
          sliding_window, compressed_cache, compressed_block_table, ratio, picks):
    _check(q, window_cache, query_start_loc, seq_lens, block_table, sinks, scale,
           sliding_window, compressed_cache, compressed_block_table, ratio, picks)
    _, fm = PROVIDERS.require("DSV4_FLASHMLA")
    t, heads, d = q.shape
    if t == 0:
        return torch.zeros_like(q)
    hp = next(h for h in HEAD_COUNTS if heads <= h)
    lists = index_lists_triton if q.is_cuda else index_lists
    window, extra = lists(query_start_loc, seq_lens, block_table, window_cache, sliding_window,
                          t, compressed_cache, compressed_block_table, ratio, picks)
    per_call = min(default_tuning().mla.flashmla_rows_a_call, FLASHMLA_MAX_ROWS)
    if heads == hp and q.is_contiguous():  # (the kernel's head count: q and sinks as given)
        qp, sink = q.view(t, 1, hp, d), sinks.float().contiguous()
    else:
        qp = q.new_zeros(t, 1, hp, d)
        qp[:, 0, :heads] = q
        sink = torch.full((hp,), float("-inf"), dtype=torch.float32, device=q.device)
        sink[:heads] = sinks.float()
    # (one call at the kernel's head count: its output is the op's, no copy)
    out = None if heads == hp and t <= per_call else torch.zeros_like(q)
    extra_kw = {} if extra is None else dict(extra_k_cache=_fp8_pages(compressed_cache))
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    for r0 in range(0, t, per_call):
        r1 = min(r0 + per_call, t)
        key = (r1 - r0, hp, window.shape[2], None if extra is None else extra.shape[2],
               window_cache.shape[1], None if extra is None else compressed_cache.shape[1],
               str(q.device), capturing)
        meta = _SCHEDULES.get(key)
        if meta is None:
            meta = _SCHEDULES[key] = fm.get_mla_metadata()[0]
        if extra is not None:
            extra_kw["extra_indices_in_kvcache"] = extra[r0:r1]
        o, _ = fm.flash_mla_with_kvcache(
            q=qp[r0:r1], k_cache=_fp8_pages(window_cache), block_table=None,
            cache_seqlens=None, head_dim_v=d, tile_scheduler_metadata=meta, num_splits=None,
            softmax_scale=scale, causal=False, is_fp8_kvcache=True, indices=window[r0:r1],
            attn_sink=sink, **extra_kw)
        if out is None and o.is_contiguous():  # (strides as the fake's: contiguous)
            return o.view(t, hp, d)
        out = torch.zeros_like(q) if out is None else out
        out[r0:r1] = o[:, 0, :heads]
    return out


def _fake(q, *args):
    _check(q, *args)
    return torch.empty_like(q)


flashmla_attention = define_op(
    "dsv4_flashmla_attention",
    "(Tensor q, Tensor window_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, Tensor sinks, float scale, int sliding_window, "
    "Tensor? compressed_cache, Tensor? compressed_block_table, int ratio, Tensor? picks) "
    "-> Tensor", _impl, _fake)
flashmla_attention.__doc__ = """DSV4_FLASHMLA's attention: FlashMLA's sparse fp8 decode over
each row's window slots and compressed slots, the sink as ``attn_sink`` (module docstring)."""


def _v4_interface_problem() -> str | None:
    """Why the FlashMLA found here cannot run V4 (its interface lacks V4's arguments)."""
    provider = PROVIDERS.found()
    if provider is None:
        return None  # (the provider reason says it)
    try:
        _, fm = PROVIDERS.require("DSV4_FLASHMLA")
        params = inspect.signature(fm.flash_mla_with_kvcache).parameters
    except Exception as e:  # noqa: BLE001 -- the reason carries it
        return f"its interface could not be read ({type(e).__name__}: {str(e)[:120]})"
    missing = [a for a in _V4_ARGS if a not in params]
    if missing:
        return (f"{provider.label}'s flash_mla_with_kvcache has no {', '.join(missing)} "
                "(DeepSeek-V4's sparse decode needs them)")
    return None


class DeepseekV4FlashMLABackend(DeepseekV4TritonBackend):
    """FlashMLA's sparse fp8 decode (sm90) for V4's attention over vLLM's 584-byte entries
    (head dim 512 = 448 + 64, up to 128 heads, bf16); the indexer and writes are DSV4_TRITON's.
    CUDA graphs: any batch (no host read; one tile schedule a shape)."""

    name: ClassVar[str] = "DSV4_FLASHMLA"
    kernels: ClassVar[str] = ("FlashMLA's sparse fp8 decode (window slots + compressed slots, "
                              "attn_sink); DSV4_TRITON's indexer and writes")
    dtypes: ClassVar[frozenset] = frozenset({torch.bfloat16})

    @classmethod
    def not_supported_reasons(cls, spec, platform: Platform) -> list[Reason]:
        reasons = super(DeepseekV4TritonBackend, cls).not_supported_reasons(spec, platform)
        if reasons:
            return reasons
        if platform.kind is not PlatformKind.CUDA or platform.capability != (9, 0):
            reasons.append(Reason(cls.name, "platform", f"platform {platform}: FlashMLA's "
                                  "sparse fp8 decode runs on sm90 here", "use DSV4_TRITON"))
        if spec.kv_cache_dtype != "fp8_ds_mla":
            reasons.append(Reason(cls.name, "kv_cache_dtype", f"kv_cache_dtype="
                                  f"{spec.kv_cache_dtype}: FlashMLA reads vLLM's 584-byte "
                                  "entries only", "kv_cache_dtype='fp8_ds_mla'"))
        if spec.num_heads > HEAD_COUNTS[-1]:
            reasons.append(Reason(cls.name, "num_heads", f"num_heads={spec.num_heads}: "
                                  f"FlashMLA's sparse decode takes at most {HEAD_COUNTS[-1]}",
                                  "shard the heads (tensor parallel) or use DSV4_TRITON"))
        missing = PROVIDERS.reason(cls.name, platform)
        if missing is not None:
            reasons.append(missing)
        elif not platform.assume_packages and (problem := _v4_interface_problem()):
            reasons.append(Reason(cls.name, "package_missing", problem,
                                  "vLLM 0.26+'s FlashMLA (../shared/gpu/prepare --vllm)"))
        return reasons

    @classmethod
    def cudagraph_support(cls, spec, platform: Platform) -> CUDAGraphSupport:
        return CUDAGraphSupport.ALWAYS

    def attention(self, q, window_cache, step, sinks, compressed_cache=None, picks=None):
        """``q [T, H, 512]`` over the window (and compressed entries): ``[T, H, 512]``."""
        spec = self.spec
        compressed = compressed_cache is not None
        return flashmla_attention(q, window_cache, step["query_start_loc"], step["seq_lens"],
                                  step["block_table"], sinks, spec.head_dim ** -0.5,
                                  spec.sliding_window, compressed_cache,
                                  _table(step, False) if compressed else None,
                                  spec.compress_ratio, picks)
