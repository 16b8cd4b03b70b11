"""The spec of a DeepSeek-V4 attention layer: its kind (sliding-window, compressed-sparse or
heavily compressed), heads, the shared key = value head, the window, the compression ratio and
the indexer's shape, the dtype and the cache format. The selector offers such a layer only the
backends of its family (``kind = "deepseek_v4"``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["DeepseekV4Spec", "LAYER_TYPES"]

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_CACHES = ("auto", "fp8_ds_mla")


@dataclass(frozen=True)
class DeepseekV4Spec:
    """One DeepSeek-V4 attention layer (defaults: V4-Flash's shapes). ``kv_cache_dtype``:
    ``"auto"`` (rows of the model dtype) or ``"fp8_ds_mla"`` (vLLM's 584-byte entries: head
    dim 512 with 64 rotary dims)."""

    kind: ClassVar[str] = "deepseek_v4"

    layer_type: str
    num_heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    sliding_window: int = 128
    compress_ratio: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_type={self.layer_type!r} must be one of "
                             f"{', '.join(LAYER_TYPES)}")
        for name in ("num_heads", "head_dim", "sliding_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise ValueError(f"rope_dim={self.rope_dim} must be even and within head_dim="
                             f"{self.head_dim} (rotated in pairs)")
        compressed = self.layer_type != "sliding_attention"
        if compressed != (self.compress_ratio >= 2):
            raise ValueError(f"compress_ratio={self.compress_ratio}: a {self.layer_type} layer "
                             + ("compresses groups of >= 2 tokens (V4: 4 sparse, 128 heavy)"
                                if compressed else "has none (0)"))
        sparse = self.layer_type == "compressed_sparse_attention"
        if sparse and min(self.index_heads, self.index_head_dim, self.index_topk) < 1:
            raise ValueError(f"a compressed_sparse_attention layer needs its indexer's "
                             f"index_heads, index_head_dim and index_topk (V4: 64, 128, 512), "
                             f"got {self.index_heads}, {self.index_head_dim}, "
                             f"{self.index_topk}")
        if sparse and self.index_head_dim < self.rope_dim:
            raise ValueError(f"index_head_dim={self.index_head_dim} must hold the "
                             f"rope_dim={self.rope_dim} rotary dims")
        if self.kv_cache_dtype not in _CACHES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of "
                             f"{', '.join(_CACHES)}")
        if self.kv_cache_dtype == "fp8_ds_mla" and (self.head_dim, self.rope_dim) != (512, 64):
            raise ValueError(f"kv_cache_dtype=fp8_ds_mla stores vLLM's 584-byte entries of 448 "
                             f"+ 64 dims; head_dim={self.head_dim}, rope_dim={self.rope_dim} "
                             "need kv_cache_dtype='auto'")

    @property
    def layer_kind(self):
        from attn_ops.spec import LayerKind

        return LayerKind.DEEPSEEK_V4

    def describe(self) -> str:
        parts = [self.layer_type, f"heads={self.num_heads}", f"head_dim={self.head_dim}",
                 f"rope_dim={self.rope_dim}", f"window={self.sliding_window}"]
        if self.compress_ratio:
            parts.append(f"ratio={self.compress_ratio}")
        if self.index_topk:
            parts.append(f"index={self.index_heads}x{self.index_head_dim} "
                         f"top-{self.index_topk}")
        parts += [f"dtype={str(self.dtype).removeprefix('torch.')}",
                  f"kv_cache_dtype={self.kv_cache_dtype}"]
        return "DeepseekV4Spec(" + ", ".join(parts) + ")"
