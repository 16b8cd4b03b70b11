"""DeepSeek-V4's attention backends:

* DSV4_TRITON -- our Triton kernels: the window and the compressed entries (the indexer's picks
  in sparse layers) in one pass (:mod:`~attn_ops.backends.deepseek_v4.kernels`), the indexer's
  scoring and device top-k (DeepSeek-V3.2's, over compressed entries); rows of the model dtype
  or vLLM's 584-byte entries dequantized in registers; no host read.
* DSV4_REFERENCE -- the torch reference path (:mod:`~attn_ops.backends.deepseek_v4.reference`):
  every layer kind, any platform; the oracle the kernels are held to.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from attn_ops.backends.deepseek_v4.cache import (ENTRY_BYTES, check_entry_write,
                                                check_index_write, entries_a_page, entry_write,
                                                index_views)
from attn_ops.backends.deepseek_v4.compressor import check_compressor, compress_into_cache
from attn_ops.backends.deepseek_v4.reference import (check_attention, indexer_topk,
                                                     reference_attention)
from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec
from attn_ops.capabilities import CUDAGraphSupport, Reason
from attn_ops.ops import define_op
from attn_ops.platforms import Platform

__all__ = ["DeepseekV4ReferenceBackend", "DeepseekV4TritonBackend", "triton_attention",
           "triton_indexer_topk"]

_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _table(step: dict, index: bool) -> torch.Tensor:
    """The block table of the compressed entries (``index``: of the index keys, paged alike
    unless the step has an ``index_block_table`` of their own)."""
    if index and "index_block_table" in step:
        return step["index_block_table"]
    return step["compressed_block_table"]


class _DeepseekV4Backend:
    """What every backend of the family shares: the spec check, vLLM's page size, ``step``
    (``query_start_loc``, ``seq_lens``, ``block_table``, ``compressed_block_table``, and
    ``index_block_table`` where the index keys are paged apart)."""

    name: ClassVar[str]
    kind: ClassVar[str] = "deepseek_v4"
    dtypes: ClassVar[frozenset] = _DTYPES

    @classmethod
    def not_supported_reasons(cls, spec, platform: Platform) -> list[Reason]:
        if not isinstance(spec, DeepseekV4Spec):
            what = spec.describe() if hasattr(spec, "describe") else type(spec).__name__
            return [Reason(cls.name, "layer_kind", f"{cls.name} serves DeepSeek-V4 attention "
                           f"layers, {what} is not one", "select a backend of the layer's kind")]
        if spec.dtype not in cls.dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in cls.dtypes))
            return [Reason(cls.name, "dtype", f"dtype={spec.dtype} is not one of {names}")]
        return []

    @classmethod
    def preferred_block_size(cls, spec) -> int:
        """vLLM's window pages: 64 tokens (a compressed page of 256 / 4 entries the same)."""
        return 64

    def __init__(self, spec: DeepseekV4Spec, *, tuning=None) -> None:
        from attn_ops.tuning import default_tuning

        self.spec, self.tuning = spec, tuning or default_tuning()

    def write(self, x, cache, slot_mapping) -> None:
        """The window tokens ``x [T, D]`` into their cache at ``slot_mapping``."""
        entry_write(x, cache, slot_mapping, entries_a_page(cache))

    def compress(self, kv, gate, bias, state, step, overlap: bool, norm_weight, eps: float,
                 rope_table, cache, index: bool = False) -> None:
        """One compressor step (``step``: ``query_start_loc``, ``seq_lens``,
        ``state_indices``, ``compressed_block_table``) into ``cache`` and ``state``."""
        page = entries_a_page(cache, kv.shape[1] // (2 if overlap else 1) if index else 0)
        compress_into_cache(kv, gate, bias, state, step["query_start_loc"], step["seq_lens"],
                            step["state_indices"], _table(step, index),
                            self.spec.compress_ratio, overlap, norm_weight, eps, rope_table,
                            cache, page, index=index)


class DeepseekV4ReferenceBackend(_DeepseekV4Backend):
    """Serves :class:`DeepseekV4Spec` layers (``kind`` their family), of any dtype here."""

    name: ClassVar[str] = "DSV4_REFERENCE"
    kernels: ClassVar[str] = ("torch: the window, the compressed entries (the indexer's picks "
                              "in sparse layers) and the sink, request by request")

    @classmethod
    def cudagraph_support(cls, spec, platform: Platform) -> CUDAGraphSupport:
        return CUDAGraphSupport.NEVER  # (it reads lengths on the host)

    def attention(self, q, window_cache, step, sinks, compressed_cache=None, picks=None):
        """``q [T, H, D]`` over the window (and compressed entries): ``[T, H, D]``."""
        spec = self.spec
        compressed = compressed_cache is not None
        return reference_attention(q, window_cache, step["query_start_loc"],
                                   step["seq_lens"], step["block_table"], sinks,
                                   spec.head_dim ** -0.5, spec.sliding_window, compressed_cache,
                                   _table(step, False) if compressed else None,
                                   spec.compress_ratio, picks)

    def indexer_topk(self, q_index, weights, index_cache, step):
        """The compressed-sparse layer's picks: ``[T, index_topk]`` (-1 unused)."""
        spec = self.spec
        return indexer_topk(q_index, weights, index_cache, step["query_start_loc"],
                            step["seq_lens"], _table(step, True), spec.compress_ratio,
                            spec.index_topk)


def _check_triton(q, window_cache, query_start_loc, seq_lens, block_table, sinks, scale,
                  sliding_window, rope_dim, compressed_cache, compressed_block_table, ratio,
                  picks, launch):
    op = "dsv4_triton_attention"
    check_attention(q, window_cache, query_start_loc, seq_lens, block_table, sinks,
                    compressed_cache, compressed_block_table, picks, op)
    d = q.shape[2]
    if not 0 < rope_dim < d:
        raise ValueError(f"{op}: rope_dim={rope_dim} must be within the head dim {d}")
    for name, cache in (("window_cache", window_cache), ("compressed_cache", compressed_cache)):
        if cache is None:
            continue
        if cache.dtype == torch.uint8:
            if (d, rope_dim) != (512, 64) or cache.dim() != 2 or cache.shape[1] < ENTRY_BYTES:
                raise ValueError(f"{op}: a uint8 {name} holds vLLM's 584-byte entries of 448 + "
                                 f"64 dims: [num_blocks, >= page x {ENTRY_BYTES}] with head "
                                 f"dim 512, rope_dim 64; got {tuple(cache.shape)}, head dim "
                                 f"{d}, rope_dim {rope_dim}")
        elif cache.dtype != q.dtype or cache.dim() != 3 or cache.shape[2] != d or \
                cache.stride(2) != 1:
            raise ValueError(f"{op}: {name} must be uint8 584-byte entries or rows [num_blocks, "
                             f"page, {d}] of q's dtype {q.dtype}, contiguous in the last dim; "
                             f"got {cache.dtype} {tuple(cache.shape)}")
    for name, x in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("block_table", block_table), ("compressed_block_table",
                                                   compressed_block_table), ("picks", picks)):
        if x is not None and x.is_floating_point():
            raise ValueError(f"{op}: {name} must be an integer tensor, got {x.dtype}")
    if compressed_cache is not None and ratio < 2:
        raise ValueError(f"{op}: ratio={ratio}: a compressed layer's groups are >= 2 tokens")
    if len(launch) != 5 or min(launch) < 1:
        raise ValueError(f"{op}: launch must be (heads, keys, warps, stages, splits) >= 1, "
                         f"got {list(launch)}")


def _triton_impl(q, window_cache, query_start_loc, seq_lens, block_table, sinks, scale,
                 sliding_window, rope_dim, compressed_cache, compressed_block_table, ratio,
                 picks, launch):
    from attn_ops.backends.deepseek_v4.kernels import dsv4_attention_triton

    _check_triton(q, window_cache, query_start_loc, seq_lens, block_table, sinks, scale,
                  sliding_window, rope_dim, compressed_cache, compressed_block_table, ratio,
                  picks, launch)
    q = q if q.stride(2) == 1 else q.contiguous()
    picks = picks if picks is None or picks.stride(1) == 1 else picks.contiguous()
    return dsv4_attention_triton(q, window_cache, query_start_loc, seq_lens, block_table,
                                 sinks, scale, sliding_window, rope_dim, compressed_cache,
                                 compressed_block_table, ratio, picks, tuple(launch))


def _triton_fake(q, *args):
    _check_triton(q, *args)
    return torch.empty_like(q)


triton_attention = define_op(
    "dsv4_triton_attention",
    "(Tensor q, Tensor window_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, Tensor sinks, float scale, int sliding_window, int rope_dim, "
    "Tensor? compressed_cache, Tensor? compressed_block_table, int ratio, Tensor? picks, "
    "int[] launch) -> Tensor", _triton_impl, _triton_fake)
triton_attention.__doc__ = """DSV4_TRITON's attention: ``q [T, H, D]`` over each query's window
and its compressed entries (every one complete at its position, or its ``picks``), the sink in
the denominator: ``[T, H, D]``. Reads no host value (CUDA-graph capturable at any batch)."""


def _index_planes(q, index_cache):
    """The index-key cache as the scoring kernel reads it: ``(keys, scales or None)``."""
    if index_cache.dtype == torch.uint8:
        return index_views(index_cache, q.shape[2])
    return index_cache, None


def _check_indexer(q, weights, index_cache, query_start_loc, seq_lens, block_table, ratio,
                   topk):
    from attn_ops.backends.mla.indexer import _check_topk

    if q.dim() != 3:
        raise ValueError(f"dsv4_triton_indexer_topk: q must be [num_tokens, index_heads, dim], "
                         f"got {tuple(q.shape)}")
    keys, scales = _index_planes(q, index_cache)
    _check_topk(q, weights, keys, scales, block_table, seq_lens, query_start_loc, topk)
    if ratio < 1:
        raise ValueError(f"dsv4_triton_indexer_topk: ratio={ratio} must be >= 1")
    return keys, scales


def _indexer_impl(q, weights, index_cache, query_start_loc, seq_lens, block_table, ratio,
                  topk):
    from attn_ops.backends.mla.indexer_kernels import indexer_topk_device

    keys, scales = _check_indexer(q, weights, index_cache, query_start_loc, seq_lens,
                                  block_table, ratio, topk)
    # (the entry score's 1 / sqrt(dim) is positive: folded into the head weights)
    w = weights.float() * q.shape[2] ** -0.5
    return indexer_topk_device(q, w, keys, scales, block_table, seq_lens, query_start_loc,
                               topk, ratio=ratio)


def _indexer_fake(q, weights, index_cache, query_start_loc, seq_lens, block_table, ratio,
                  topk):
    _check_indexer(q, weights, index_cache, query_start_loc, seq_lens, block_table, ratio,
                   topk)
    return q.new_empty(q.shape[0], topk, dtype=torch.int32)


triton_indexer_topk = define_op(
    "dsv4_triton_indexer_topk",
    "(Tensor q, Tensor weights, Tensor index_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, int ratio, int topk) -> Tensor", _indexer_impl, _indexer_fake)
triton_indexer_topk.__doc__ = """The compressed-sparse layers' indexer on the device: for the
query at ``p``, the ``min(topk, (p + 1) // ratio)`` entries of the highest ``sum_h w_h ReLU(q_h .
k_s) / sqrt(dim)`` (ties: the lower entry; a query seeing at most ``topk`` entries takes them
all), -1 after them: ``[T, topk]`` int32. Keys ``[blocks, page, dim]`` in q's dtype, or a
planar fp8 cache (:func:`~attn_ops.backends.deepseek_v4.cache.index_views`)."""


def _check_compress(kv, gate, bias, state, query_start_loc, seq_lens, state_indices,
                    block_table, ratio, overlap, norm_weight, eps, rope_table, cache, index):
    op = "dsv4_triton_compress_write"
    check_compressor(kv, gate, bias, state, query_start_loc, seq_lens, state_indices, ratio,
                     overlap)
    d = kv.shape[1] // (2 if overlap else 1)
    if state.dtype != torch.float32 or d % 2 or norm_weight.shape != (d,):
        raise ValueError(f"{op}: an fp32 state, an even entry width and norm_weight [{d}] "
                         f"expected, got {state.dtype}, {d}, {tuple(norm_weight.shape)}")
    r = rope_table.shape[-1]
    if rope_table.dim() != 2 or r % 2 or not 0 < r <= d:
        raise ValueError(f"{op}: rope_table must be [positions, R] with R even and <= {d}, got "
                         f"{tuple(rope_table.shape)}")
    if block_table.dim() != 2 or block_table.is_floating_point():
        raise ValueError(f"{op}: block_table must be an integer [B, pages] tensor, got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if index:
        check_index_write(kv[:, :d], cache, kv.new_zeros(kv.shape[0], dtype=torch.long))
    elif cache.dtype == torch.uint8:
        check_entry_write(kv[:, :d], cache, kv.new_zeros(kv.shape[0], dtype=torch.long),
                          entries_a_page(cache))
    elif cache.dim() != 3 or cache.shape[2] != d:
        raise ValueError(f"{op}: a cache of rows must be [num_blocks, page, {d}], got "
                         f"{tuple(cache.shape)}")
    for name, x in (("kv", kv), ("gate", gate), ("bias", bias), ("rope_table", rope_table)):
        if x.stride(-1) != 1:
            raise ValueError(f"{op}: {name} needs a contiguous last dim")


def _compress_impl(*args):
    from attn_ops.backends.deepseek_v4.write_kernels import compress_write_triton

    _check_compress(*args)
    compress_write_triton(*args)


compress_write = define_op(
    "dsv4_triton_compress_write",
    "(Tensor kv, Tensor gate, Tensor bias, Tensor(a!) state, Tensor query_start_loc, "
    "Tensor seq_lens, Tensor state_indices, Tensor block_table, int ratio, bool overlap, "
    "Tensor norm_weight, float eps, Tensor rope_table, Tensor(b!) cache, bool index) -> ()",
    _compress_impl, lambda *args: _check_compress(*args))
compress_write.__doc__ = """A compressor step in two launches, no host read: every entry the
step completes (gated softmax over its group, RMSNorm, RoPE at ``w * ratio``, quantized and
written at its compressed slot), then the requests' state rows -- ``compress_into_cache``'s
torch form in kernels."""


def _check_window_write(x, cache, slot_mapping, index):
    if index:
        check_index_write(x, cache, slot_mapping)
    else:
        check_entry_write(x, cache, slot_mapping, entries_a_page(cache))
    if x.stride(1) != 1:
        raise ValueError("dsv4_triton_entry_write: x needs a contiguous last dim")


def _window_write_impl(x, cache, slot_mapping, index):
    from attn_ops.backends.deepseek_v4.write_kernels import entry_write_triton

    _check_window_write(x, cache, slot_mapping, index)
    entry_write_triton(x, cache, slot_mapping, index)


triton_entry_write = define_op(
    "dsv4_triton_entry_write",
    "(Tensor x, Tensor(a!) cache, Tensor slot_mapping, bool index) -> ()",
    _window_write_impl, lambda *args: _check_window_write(*args))
triton_entry_write.__doc__ = """Rows ``x [T, D]`` written at ``slot_mapping`` in one launch, no
host read: rows of the cache's dtype, 584-byte entries, or (``index``) planar fp8 index keys."""


class DeepseekV4TritonBackend(_DeepseekV4Backend):
    """Our Triton kernels on any GPU Triton runs on (the CPU interpreter for tests): every
    layer kind; rows of the model dtype or vLLM's 584-byte entries; any head and rotary dims,
    window, ratio and page size. CUDA graphs: any batch (no host value is read)."""

    name: ClassVar[str] = "DSV4_TRITON"
    kernels: ClassVar[str] = ("Triton: window + compressed entries (or the indexer's picks) "
                              "in one pass, 584-byte entries dequantized in registers; the "
                              "indexer's scoring and device top-k")
    dtypes: ClassVar[frozenset] = frozenset({torch.float16, torch.bfloat16, torch.float32})

    @classmethod
    def not_supported_reasons(cls, spec, platform: Platform) -> list[Reason]:
        from attn_ops.backends.triton_attn import interpreter_reasons

        reasons = super().not_supported_reasons(spec, platform)
        if not reasons:
            reasons += interpreter_reasons(cls.name, spec, platform,
                                           "; DSV4_REFERENCE is the CPU path")
        return reasons

    @classmethod
    def cudagraph_support(cls, spec, platform: Platform) -> CUDAGraphSupport:
        return CUDAGraphSupport.ALWAYS

    def attention(self, q, window_cache, step, sinks, compressed_cache=None, picks=None):
        """``q [T, H, D]`` over the window (and compressed entries): ``[T, H, D]``."""
        from attn_ops.routing import DeviceFacts, dsv4_launch

        spec = self.spec
        compressed = compressed_cache is not None
        table = _table(step, False) if compressed else None
        keys = spec.sliding_window
        if picks is not None:
            keys += picks.shape[1]
        elif compressed:  # (every entry the table reaches)
            keys += table.shape[1] * entries_a_page(compressed_cache)
        launch = dsv4_launch(q.shape[0], spec.num_heads, keys,
                             DeviceFacts.of(q.device).num_sms, self.tuning.mla)
        return triton_attention(q, window_cache, step["query_start_loc"], step["seq_lens"],
                                step["block_table"], sinks, spec.head_dim ** -0.5,
                                spec.sliding_window, spec.rope_dim, compressed_cache, table,
                                spec.compress_ratio, picks, list(launch))

    def write(self, x, cache, slot_mapping) -> None:
        """The window tokens ``x [T, D]`` into their cache at ``slot_mapping``: one launch."""
        triton_entry_write(x, cache, slot_mapping, False)

    def compress(self, kv, gate, bias, state, step, overlap: bool, norm_weight, eps: float,
                 rope_table, cache, index: bool = False) -> None:
        """One compressor step into ``cache`` and ``state``: two launches."""
        compress_write(kv, gate, bias, state, step["query_start_loc"], step["seq_lens"],
                       step["state_indices"], _table(step, index),
                       self.spec.compress_ratio, overlap, norm_weight, eps, rope_table, cache,
                       index)

    def indexer_topk(self, q_index, weights, index_cache, step):
        """The compressed-sparse layer's picks: ``[T, index_topk]`` int32 (-1 unused)."""
        spec = self.spec
        return triton_indexer_topk(q_index, weights, index_cache, step["query_start_loc"],
                                   step["seq_lens"], _table(step, True), spec.compress_ratio,
                                   spec.index_topk)
