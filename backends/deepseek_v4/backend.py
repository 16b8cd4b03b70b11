"""DSV4_REFERENCE: DeepSeek-V4's attention on the torch reference path
(:mod:`~attn_ops.backends.deepseek_v4.reference`): every layer kind, any platform, rows of the
model dtype or vLLM's 584-byte entries; the oracle the V4 kernels will be held to."""

from __future__ import annotations

from typing import ClassVar

import torch

from attn_ops.backends.deepseek_v4.reference import indexer_topk, reference_attention
from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec
from attn_ops.capabilities import CUDAGraphSupport, Reason
from attn_ops.platforms import Platform

__all__ = ["DeepseekV4ReferenceBackend"]

_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class DeepseekV4ReferenceBackend:
    """Serves :class:`DeepseekV4Spec` layers (``kind`` their family), of any dtype here."""

    name: ClassVar[str] = "DSV4_REFERENCE"
    kind: ClassVar[str] = "deepseek_v4"
    kernels: ClassVar[str] = ("torch: the window, the compressed entries (the indexer's picks "
                              "in sparse layers) and the sink, request by request")

    @classmethod
    def not_supported_reasons(cls, spec, platform: Platform) -> list[Reason]:
        if not isinstance(spec, DeepseekV4Spec):
            what = spec.describe() if hasattr(spec, "describe") else type(spec).__name__
            return [Reason(cls.name, "layer_kind", f"{cls.name} serves DeepSeek-V4 attention "
                           f"layers, {what} is not one", "select a backend of the layer's kind")]
        if spec.dtype not in _DTYPES:
            return [Reason(cls.name, "dtype", f"dtype={spec.dtype} is not a floating dtype")]
        return []

    @classmethod
    def preferred_block_size(cls, spec) -> int:
        """vLLM's window pages: 64 tokens (a compressed page of 256 / 4 entries the same)."""
        return 64

    @classmethod
    def cudagraph_support(cls, spec, platform: Platform) -> CUDAGraphSupport:
        return CUDAGraphSupport.NEVER  # (it reads lengths on the host)

    def __init__(self, spec: DeepseekV4Spec, *, tuning=None) -> None:
        self.spec, self.tuning = spec, tuning

    def attention(self, q, window_cache, step, sinks, compressed_cache=None, picks=None):
        """``q [T, H, D]`` over the window (and compressed entries): ``[T, H, D]``."""
        spec = self.spec
        compressed = compressed_cache is not None
        return reference_attention(q, window_cache, step["query_start_loc"],
                                   step["seq_lens"], step["block_table"], sinks,
                                   spec.head_dim ** -0.5, spec.sliding_window, compressed_cache,
                                   step["compressed_block_table"] if compressed else None,
                                   spec.compress_ratio, picks)

    def indexer_topk(self, q_index, weights, index_cache, step):
        """The compressed-sparse layer's picks: ``[T, index_topk]`` (-1 unused)."""
        spec = self.spec
        return indexer_topk(q_index, weights, index_cache, step["query_start_loc"],
                            step["seq_lens"], step["compressed_block_table"], spec.compress_ratio,
                            spec.index_topk)
