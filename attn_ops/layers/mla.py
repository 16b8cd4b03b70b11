"""The ``MLAAttention`` module: one multi-head latent attention layer over its latent cache.

The model computes the projections (DeepSeek-V2/V3: ``q`` from ``q_proj`` or ``q_b_proj(norm(
q_a_proj(x)))``; ``kv_c`` and ``k_pe`` from ``kv_a_proj_with_mqa(x)``, ``kv_c`` normalized; RoPE
on the rope parts) and ``o_proj``; this layer owns ``kv_b_proj`` as ``W_UK`` / ``W_UV`` (split once,
:meth:`MLAAttention.load_kv_b_proj`), writes ``[kv_c | k_pe]`` into the cache
(``torch.ops.attn.mla_cache_update``) and runs the backend's op, which serves decodes and short
prefills in the absorbed form and the rest in the MHA form (``attn_ops.backends.mla.common``).
"""

from __future__ import annotations

from typing import Any

import torch

from attn_ops.layers.attention import BackendLayer
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.platforms import Platform
from attn_ops.selector import AttentionConfig
from attn_ops.spec import AttentionSpec

__all__ = ["MLAAttention"]


class MLAAttention(BackendLayer):
    """One MLA layer described by ``AttentionSpec.mla(...)``.

    ``forward(q, kv_c, k_pe, cache, metadata)`` takes ``q [T, H, nope + rope]`` (rope part
    rotated), ``kv_c [T, kv_lora_rank]`` (normalized), ``k_pe [T, rope]`` (rotated), a cache from
    :meth:`allocate_cache` and the step's metadata, and returns ``[T, H, v_head_dim]`` (what
    ``o_proj`` takes, flattened). fp8 caches carry a ``kv_scale`` buffer (default 1.0).

    Example::

        spec = AttentionSpec.mla(16, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                 v_head_dim=16, dtype=torch.float32)
        layer = MLAAttention(spec)
        layer.load_kv_b_proj(kv_b_proj.weight)      # [H * (nope + v), kv_lora_rank]
        cache = layer.allocate_cache(num_blocks=64)
        out = layer(q, kv_c, k_pe, cache, metadata)
    """

    def __init__(self, spec: AttentionSpec, config: AttentionConfig | None = None, *,
                 platform: Platform | None = None) -> None:
        if not spec.use_mla:
            raise ValueError(f"MLAAttention needs an MLA spec (AttentionSpec.mla(...)), got "
                             f"{spec.describe()}; use attn_ops.Attention for it")
        super().__init__(spec, config, platform=platform)
        h, nope, rank, v = (spec.num_heads, spec.qk_nope_head_dim, spec.kv_lora_rank,
                            spec.v_head_dim)
        self.register_buffer("w_uk", torch.zeros(h, nope, rank, dtype=spec.dtype))
        self.register_buffer("w_uv", torch.zeros(h, rank, v, dtype=spec.dtype))
        self.register_buffer("kv_scale", torch.ones(1) if spec.kv_cache_dtype.is_fp8
                             and not spec.kv_cache_dtype.inline_scales else None)

    @torch.no_grad()
    def load_kv_b_proj(self, weight: torch.Tensor) -> None:
        """Split ``kv_b_proj.weight`` ``[H * (nope + v), kv_lora_rank]`` (per head: the nope
        rows, then the v rows) into ``W_UK [H, nope, rank]`` and ``W_UV [H, rank, v]``."""
        spec = self.spec
        h, nope, v, rank = (spec.num_heads, spec.qk_nope_head_dim, spec.v_head_dim,
                            spec.kv_lora_rank)
        if tuple(weight.shape) != (h * (nope + v), rank):
            raise ValueError(f"kv_b_proj.weight must be [num_heads * (qk_nope_head_dim + "
                             f"v_head_dim), kv_lora_rank] = [{h * (nope + v)}, {rank}], got "
                             f"{tuple(weight.shape)}")
        w = weight.view(h, nope + v, rank)
        self.w_uk.copy_(w[:, :nope])
        self.w_uv.copy_(w[:, nope:].transpose(1, 2))

    def allocate_cache(self, num_blocks: int,
                       device: torch.device | str | None = None) -> torch.Tensor:
        """A zeroed latent cache ``[num_blocks, block_size, kv_lora_rank + rope]`` in the cache
        dtype, at the selected backend's page size."""
        from attn_ops.backends.mla.common import allocate_latent_cache

        device = device if device is not None else self.selection.platform.device_type
        return allocate_latent_cache(self.spec, num_blocks, self.block_size, device)

    def forward(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                cache: torch.Tensor, metadata: CommonAttentionMetadata | Any,
                cos_sin: torch.Tensor | None = None,
                topk_slots: torch.Tensor | None = None) -> torch.Tensor:
        """``metadata``: the step's common metadata, what ``self.impl.build_metadata`` made of
        it, or the dict of :func:`attn_ops.build_step_metadata` (plan outside compiled code).
        ``cos_sin`` ``[T, rope]`` (cos | sin halves): RoPE of ``q``'s rope part and of ``k_pe``
        is applied here (``torch.ops.attn.mla_rope``; compiled with our passes it fuses into
        the latent write); without it they come rotated. ``topk_slots`` ``[T, index_topk]``
        int32: a sparse layer's (``spec.index_topk`` set) selected cache slots per token, -1
        padded (:class:`attn_ops.layers.mla_indexer.MLAIndexer`'s second output); dense layers take
        none."""
        from attn_ops.backends.mla.common import mla_cache_update
        from attn_ops.backends.mla.rope import mla_rope
        from attn_ops.ops import check_layer_inputs

        if isinstance(metadata, dict):
            metadata = metadata[self._metadata_key]
        spec = self.spec
        t = q.shape[0]
        for name, x, shape in (("q", q, (t, spec.num_heads, spec.head_dim)),
                               ("kv_c", kv_c, (t, spec.kv_lora_rank)),
                               ("k_pe", k_pe, (t, spec.qk_rope_head_dim))):
            if tuple(x.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)} for {spec.describe()}, got "
                                 f"{list(x.shape)}")
        if cache.dim() != 3 or cache.shape[2] != spec.latent_row_width:
            width = (f"FlashMLA's fp8_ds_mla row bytes = {spec.latent_row_width}"
                     if spec.kv_cache_dtype.inline_scales
                     else f"kv_lora_rank + qk_rope_head_dim = {spec.latent_dim}")
            raise ValueError(f"cache must be [num_blocks, block_size, {width}] for "
                             f"{spec.describe()}, got {list(cache.shape)}; allocate it with "
                             "allocate_cache")
        check_layer_inputs("MLAAttention", cache.device,
                           [("q", q, spec.dtype), ("kv_c", kv_c, spec.dtype),
                            ("k_pe", k_pe, spec.dtype), ("cache", cache, spec.cache_dtype),
                            ("cos_sin", cos_sin, None), ("topk_slots", topk_slots, None)],
                           tokens=t, metadata=metadata, page=cache.shape[1])
        sparse = {}
        if spec.index_topk is not None:
            if topk_slots is None or tuple(topk_slots.shape) != (t, spec.index_topk):
                raise ValueError(f"a sparse MLA layer ({spec.describe()}) needs topk_slots "
                                 f"[{t}, {spec.index_topk}] (MLAIndexer's slots), got "
                                 f"{None if topk_slots is None else list(topk_slots.shape)}")
            sparse["topk_slots"] = topk_slots
        elif topk_slots is not None:
            raise ValueError(f"topk_slots given to a dense MLA layer ({spec.describe()}); "
                             "build the spec with AttentionSpec.mla(..., index_topk=K)")
        if cos_sin is not None:
            q, k_pe = mla_rope(q, k_pe, cos_sin)
        mla_cache_update(kv_c, k_pe, cache, metadata.slot_mapping, self.kv_scale)
        out = q.new_empty(t, spec.num_heads, spec.v_head_dim)
        self.impl.forward(q, kv_c, k_pe, cache, metadata, out, w_uk=self.w_uk, w_uv=self.w_uv,
                          kv_scale=self.kv_scale, **sparse)
        return out
