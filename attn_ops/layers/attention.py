"""The ``Attention`` module: one attention layer over the paged KV cache.

It resolves its backend once (logging the choice and why every other backend was rejected),
then ``forward`` writes the new K/V into the cache with ``torch.ops.attn.kv_cache_update`` and
runs the backend's ``torch.ops.attn.*`` op into a fresh output. Both ops are opaque custom ops
with fake kernels, so ``torch.compile(fullgraph=True)`` traces the layer with no graph break and
the compiled graph names the selected backend.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from attn_ops.backends.turboquant.ops import turboquant_cache_update
from attn_ops.glue import rope, rope_kv_cache_update, slot_mapping
from attn_ops.kv_cache import allocate_kv_cache, kv_cache_update
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.ops import check_layer_inputs
from attn_ops.platforms import Platform
from attn_ops.selector import AttentionConfig, select_backend
from attn_ops.spec import AttentionSpec
from attn_ops.tuning import resolve_tuning

__all__ = ["Attention", "BackendLayer", "SelectedLayer", "alibi_slopes", "build_step_metadata",
           "step_backends"]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's per-head slopes (geometric, interleaved for non-powers of two)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra = 2.0 ** (-4.0 / closest)
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


class SelectedLayer(nn.Module):
    """What every layer that runs a backend shares, attention and recurrent alike: the backend
    selected for its spec (logging the choice and every rejection), the tuning its routes
    read, and the backend instance (``config.backend_options`` its keyword arguments)."""

    def __init__(self, spec, config: AttentionConfig | None = None, *,
                 platform: Platform | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.selection = select_backend(spec, platform, config)
        options = dict(config.backend_options) if config is not None else {}
        self.tuning = (config.tuning if config is not None and config.tuning is not None
                       else resolve_tuning(self.selection.platform))
        self.impl = self.selection.backend_cls(spec, tuning=self.tuning, **options)

    @property
    def backend(self) -> str:
        return self.selection.backend


class BackendLayer(SelectedLayer):
    """What every attention layer shares: a selected backend and the key of the metadata it
    takes (:func:`build_step_metadata` builds one per key)."""

    def __init__(self, spec: AttentionSpec, config: AttentionConfig | None = None, *,
                 platform: Platform | None = None) -> None:
        super().__init__(spec, config, platform=platform)
        self._metadata_key = self.impl.metadata_key()

    @property
    def block_size(self) -> int:
        return self.selection.block_size

    @property
    def cudagraph_support(self):
        """The CUDA-graph level of this layer's backend for its spec on its platform."""
        return self.selection.backend_cls.cudagraph_support(self.spec, self.selection.platform)

    def extra_repr(self) -> str:
        return f"{self.spec.describe()}, backend={self.backend}, block_size={self.block_size}"


class Attention(BackendLayer):
    """One attention layer described by an :class:`AttentionSpec`.

    ``forward(query, key, value, kv_cache, metadata)`` takes
    ``query [T, Hq, D]`` (or ``[T, Hq*D]``), ``key [T, Hkv, D]``, ``value [T, Hkv, Dv]`` (key and
    value may be None when the cache already holds them), a cache from
    :meth:`allocate_kv_cache` and the step's :class:`CommonAttentionMetadata`, and returns
    ``out [T, Hq, Dv]`` in the model dtype (plus ``lse [T, Hq]`` float32 with
    ``return_lse=True``). Sinks (``spec.has_sinks``) are a learnable ``[Hq]`` float32
    parameter; fp8 caches carry ``k_scale``/``v_scale`` buffers (default 1.0).

    Example::

        spec = AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32)
        attn = Attention(spec)
        cache = attn.allocate_kv_cache(num_blocks=64)
        out = attn(q, k, v, cache, metadata)
    """

    def __init__(self, spec: AttentionSpec, config: AttentionConfig | None = None, *,
                 platform: Platform | None = None) -> None:
        super().__init__(spec, config, platform=platform)
        self.sinks = nn.Parameter(torch.zeros(spec.num_heads)) if spec.has_sinks else None
        self.register_buffer("alibi_slopes",
                             alibi_slopes(spec.num_heads) if spec.use_alibi else None)
        fp8 = spec.kv_cache_dtype.is_fp8
        self.register_buffer("k_scale", torch.ones(1) if fp8 else None)
        self.register_buffer("v_scale", torch.ones(1) if fp8 else None)


    def allocate_kv_cache(self, num_blocks: int,
                          device: torch.device | str | None = None) -> torch.Tensor:
        """A zeroed cache in the selected backend's layout, page size and dtype."""
        device = device if device is not None else self.selection.platform.device_type
        return allocate_kv_cache(self.spec, num_blocks, self.block_size, device,
                                 self.selection.backend_cls.kv_cache_layout(self.spec))

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: CommonAttentionMetadata | Any, *,
                return_lse: bool = False, cos_sin: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        """``metadata``: the step's common metadata; what ``self.impl.build_metadata`` made of
        it; or the dict of :func:`build_step_metadata` -- the way to call a compiled model whose
        backends plan on the host (planning then happens once per step, outside the graph).

        ``cos_sin [T, head_dim]`` (cos | sin halves): rotate query and key first
        (``torch.ops.attn.rope``). ``positions [T]``: compute the new tokens' cache slots on
        the device (``torch.ops.attn.slot_mapping``, from ``metadata.query_start_loc`` and
        ``metadata.block_table``) instead of reading ``metadata.slot_mapping``. Traced by
        ``torch.compile``, these are ops of their own, which the compile passes fuse with the
        cache write (:mod:`attn_ops.compile_passes`); run eagerly, the layer calls the fused op
        (``torch.ops.attn.rope_kv_cache_update``: one kernel on GPUs, not ~40 small ones)."""
        if isinstance(metadata, dict):
            metadata = metadata[self._metadata_key]
        spec = self.spec
        query = _as_heads("query", query, None, spec.num_heads, spec.head_dim, spec)
        check_layer_inputs("Attention", kv_cache.device,
                           [("query", query, spec.dtype), ("key", key, spec.dtype),
                            ("value", value, spec.dtype), ("kv_cache", kv_cache, spec.cache_dtype),
                            ("positions", positions, None)],
                           tokens=query.shape[0], metadata=metadata,
                           page=_cache_page(kv_cache, spec))
        if (key is None) != (value is None):
            raise ValueError("pass key and value together (or neither, when the cache already "
                             f"holds them); got key={_shape(key)}, value={_shape(value)}")
        if key is None or value is None:
            if cos_sin is not None:
                query = rope(query, cos_sin)
        else:
            tokens = query.shape[0]
            key = _as_heads("key", key, tokens, spec.kv_heads, spec.head_dim, spec)
            value = _as_heads("value", value, tokens, spec.kv_heads, spec.v_head_dim, spec)
            slots = metadata.slot_mapping
            if positions is not None and not (hasattr(metadata, "block_table")
                                              and hasattr(metadata, "query_start_loc")):
                raise ValueError(
                    f"positions= (slots computed on the device) needs the common metadata's "
                    f"query_start_loc and block_table; {self.backend}'s metadata "
                    f"({type(metadata).__name__}) has no block table -- use "
                    "metadata.slot_mapping (positions=None)")
            if spec.kv_cache_dtype.is_turboquant:  # (its own write: RoPE, quantize, pack)
                if cos_sin is not None:
                    query = rope(query, cos_sin)
                if positions is not None:
                    slots = slot_mapping(positions, metadata.query_start_loc,
                                         metadata.block_table, self.block_size)
                turboquant_cache_update(key, value, kv_cache, slots, spec.kv_cache_dtype.value,
                                        cos_sin)
            elif cos_sin is not None and not torch.compiler.is_compiling():
                query = rope_kv_cache_update(
                    query, key, value, cos_sin, kv_cache, None if positions is not None else slots,
                    positions, *((metadata.query_start_loc, metadata.block_table)
                                 if positions is not None else (None, None)),
                    self.k_scale, self.v_scale)
            else:
                if cos_sin is not None:
                    query, key = rope(query, cos_sin), rope(key, cos_sin)
                if positions is not None:
                    slots = slot_mapping(positions, metadata.query_start_loc,
                                         metadata.block_table, self.block_size)
                kv_cache_update(key, value, kv_cache, slots, self.k_scale, self.v_scale)
        out = query.new_empty(query.shape[0], spec.num_heads, spec.v_head_dim)
        lse = query.new_empty(query.shape[0], spec.num_heads, dtype=torch.float32) \
            if return_lse else None
        self.impl.forward(query, kv_cache, metadata, out, lse=lse, sinks=self.sinks,
                          alibi_slopes=self.alibi_slopes, k_scale=self.k_scale,
                          v_scale=self.v_scale)
        return (out, lse) if return_lse else out


def _cache_page(kv_cache: torch.Tensor, spec: AttentionSpec) -> int | None:
    """Tokens a page of a paged KV cache holds: ``[blocks, 2, page, heads, dim]`` (NHD),
    ``[blocks, page, heads, dim_k + dim_v]`` (packed) or ``[blocks, heads, page, slot]``
    (TurboQuant); None for another layout."""
    if spec.kv_cache_dtype.is_turboquant:
        return kv_cache.shape[2] if kv_cache.dim() == 4 else None
    dim = {5: 2, 4: 1}.get(kv_cache.dim())
    return None if dim is None else kv_cache.shape[dim]


def _shape(x) -> object:
    return None if x is None else tuple(x.shape)


def _as_heads(name: str, x: torch.Tensor, tokens: int | None, heads: int, dim: int,
              spec: AttentionSpec) -> torch.Tensor:
    """``x`` as ``[tokens, heads, dim]``: given so, or flattened as ``[tokens, heads * dim]``.
    Anything else raises, naming both shapes (shapes only: no device sync)."""
    t = x.shape[0] if x.dim() in (2, 3) else None
    if (x.dim() == 3 and tuple(x.shape[1:]) == (heads, dim)) or \
            (x.dim() == 2 and x.shape[1] == heads * dim):
        if tokens is None or t == tokens:
            return x if x.dim() == 3 else x.unflatten(1, (heads, dim))
    want = f"[{'num_tokens' if tokens is None else tokens}, {heads}, {dim}]"
    raise ValueError(f"{name} must be {want} (or [{'num_tokens' if tokens is None else tokens}"
                     f", {heads * dim}] flattened) for {spec.describe()}; got shape "
                     f"{tuple(x.shape)}")


def step_backends(model: nn.Module) -> list[tuple[tuple, Any]]:
    """``(metadata key, backend)`` of the attention layers of ``model`` (:class:`Attention`,
    :class:`~attn_ops.layers.mla.MLAAttention`), one per
    distinct key: what :func:`build_step_metadata` builds for. An engine computes it once and
    passes it instead of the model -- walking the modules costs ~0.8 us each, every step (220
    us for a 32-layer model on the CPU CI machine)."""
    backends: dict = {}
    for layer in model.modules():
        if isinstance(layer, BackendLayer) and layer._metadata_key not in backends:
            backends[layer._metadata_key] = layer.impl
    return list(backends.items())


def build_step_metadata(model: nn.Module | list, common: CommonAttentionMetadata,
                        graphs: Any = None) -> dict:
    """Every backend metadata the :class:`Attention` layers of ``model`` need for one step,
    built once per distinct :meth:`AttentionBackend.metadata_key` (host planning included).
    ``model``: the model, or what :func:`step_backends` returned for it.

    Pass the result as the layers' ``metadata``; do this outside ``torch.compile``::

        step = build_step_metadata(model, common)
        logits = compiled_model(input_ids, positions, kv_caches, step)

    With ``graphs`` (an :class:`attn_ops.cudagraph.CUDAGraphBatch`) the batch is first padded
    into the graphs' persistent buffers and every backend builds its CUDA-graph metadata: call
    it before capturing a size and before every replay (each built metadata carries the padded
    ``slot_mapping`` the cache writes use).
    """
    backends = model if isinstance(model, list) else step_backends(model)
    if graphs is None:
        return {key: impl.build_metadata(common) for key, impl in backends}
    common = graphs.pad(common)
    return {key: impl.graph_metadata(common, graphs) for key, impl in backends}
