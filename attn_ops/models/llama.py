"""A small Llama-style decoder built on :class:`attn_ops.Attention`, and a greedy generator.

Used by the demo, the tests and the benchmarks. The model takes the flattened tokens of a mixed
batch (decodes first, then prefills) with their positions, one paged KV cache per layer and the
step's :class:`CommonAttentionMetadata`; it returns logits for every token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from attn_ops.glue import quantize_fp8_op
from attn_ops.kv_cache import BlockAllocator
from attn_ops.layers.attention import Attention, build_step_metadata, step_backends
from attn_ops.metadata import CommonAttentionMetadata, build_batch
from attn_ops.platforms import Platform
from attn_ops.selector import AttentionConfig
from attn_ops.spec import AttentionSpec

__all__ = ["ModelConfig", "TinyLlama", "Generator"]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the model. ``sliding_window`` with ``sliding_window_every=k`` makes every k-th
    layer (0, k, 2k, ...) a sliding-window layer, like Gemma/Mistral-style hybrids."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    head_dim_v: int | None = None  # V's head dim where it differs from Q/K's (FLASH_ATTN_DIFFKV)
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 4096
    sliding_window: int | None = None
    sliding_window_every: int = 1
    dtype: torch.dtype = torch.float32
    # Compute each token's cache slot on the device from its position and the block table
    # (torch.ops.attn.slot_mapping) instead of using the host-built metadata.slot_mapping.
    device_slot_mapping: bool = False
    # Quantize each attention output to fp8 e4m3 (torch.ops.attn.quantize_fp8, per-tensor
    # scale) before o_proj, as a model with fp8 GEMMs does; o_proj gets it dequantized here.
    fp8_attention_output: bool = False
    # A draft tree (parents in query order) for tree speculative decoding: a request with
    # exactly len(spec_tree) new tokens is verified as that tree (TREE_ATTN).
    spec_tree: tuple[int, ...] | None = None
    # The KV cache's storage (attn_ops.KVCacheDType: "auto", "fp8_e4m3", "turboquant_4bit_nc",
    # ...), and the layers left unquantized: None gives vLLM's rule for TurboQuant presets
    # (the first and last two layers: attn_ops.backends.turboquant.backend.boundary_layers)
    # and none otherwise.
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_skip_layers: tuple[int, ...] | None = None
    # Every attention layer's page size (None: the selected backends'; layers whose backends
    # prefer different ones -- quantized and unquantized layers, say -- need one here).
    block_size: int | None = None

    def attention_spec(self, layer: int) -> AttentionSpec:
        window = self.sliding_window if layer % self.sliding_window_every == 0 else None
        return AttentionSpec(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim, head_dim_v=self.head_dim_v,
                             dtype=self.dtype, sliding_window=window, spec_tree=self.spec_tree,
                             kv_cache_dtype="auto" if layer in self.unquantized_layers
                             else self.kv_cache_dtype, block_size=self.block_size)

    @property
    def unquantized_layers(self) -> frozenset[int]:
        if self.kv_cache_dtype_skip_layers is not None:
            return frozenset(self.kv_cache_dtype_skip_layers)
        if self.kv_cache_dtype.startswith("turboquant"):
            from attn_ops.backends.turboquant.backend import boundary_layers

            return boundary_layers(self.num_layers)
        return frozenset()

    @property
    def v_head_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def shared_block_size(layers) -> int:
    """The one page size of ``layers``' attention (``layer.attn``): they share one allocator."""
    sizes = {layer.attn.block_size for layer in layers}
    if len(sizes) != 1:
        raise ValueError(f"layers chose different block sizes {sorted(sizes)}; set "
                         "AttentionSpec.block_size so they share one allocator")
    return sizes.pop()


def rope_cache(head_dim: int, max_position: int, theta: float) -> torch.Tensor:
    """``[max_position, head_dim]``: cos in the first half, sin in the second (float32)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, attn_config: AttentionConfig | None,
                 platform: Platform | None = None) -> None:
        super().__init__()
        h, d, dv = cfg.hidden_size, cfg.head_dim, cfg.v_head_dim
        self.cfg = cfg
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, (cfg.num_heads + cfg.num_kv_heads) * d
                                  + cfg.num_kv_heads * dv, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * dv, h, bias=False)
        self.attn = Attention(cfg.attention_spec(layer), attn_config, platform=platform)
        self.register_buffer("attn_out_scale", torch.tensor([0.02])
                             if cfg.fp8_attention_output else None)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x, cos_sin, positions, kv_cache, metadata):
        cfg = self.cfg
        q, k, v = self.qkv_proj(self.input_norm(x)).split(
            [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
             cfg.num_kv_heads * cfg.v_head_dim], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.v_head_dim)
        # RoPE and (with device_slot_mapping) the slot computation run as ops of their own,
        # which attn_ops.compile_passes fold into one cache-write op.
        attn = self.attn(q, k, v, kv_cache, metadata, cos_sin=cos_sin,
                         positions=positions if cfg.device_slot_mapping else None)
        attn = attn.flatten(1)
        if cfg.fp8_attention_output:
            scale = self.attn_out_scale
            attn = quantize_fp8_op(attn, scale, torch.float8_e4m3fn).to(x.dtype) * scale
        x = x + self.o_proj(attn)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class TinyLlama(nn.Module):
    """``forward(input_ids [T], positions [T], kv_caches, metadata) -> logits [T, vocab]``."""

    def __init__(self, cfg: ModelConfig, attn_config: AttentionConfig | None = None,
                 platform: Platform | None = None) -> None:
        """``platform``: where the attention backends are selected for (default: this
        machine's; ``Platform.parse("cpu")`` builds a CPU model on a GPU machine)."""
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, attn_config, platform)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("rope", rope_cache(cfg.head_dim, cfg.max_position, cfg.rope_theta),
                             persistent=False)

    @property
    def backends(self) -> list[str]:
        return [layer.attn.backend for layer in self.layers]

    @property
    def block_size(self) -> int:
        return shared_block_size(self.layers)

    def compile_layers(self, **options) -> TinyLlama:
        """Regional compilation: each decoder layer through ``torch.compile(fullgraph=True)``.
        The layers share one code object and nothing layer-specific is baked into their
        graphs (parameters, caches and metadata are inputs), so Dynamo compiles once per layer
        *kind* (full / sliding window) and reuses the graph for every other layer: compile time
        does not grow with depth (``benchmarks/bench_compile_time.py``)."""
        for layer in self.layers:
            layer.compile(**{"fullgraph": True, "dynamic": True, **options})
        return self

    def allocate_kv_caches(self, num_blocks: int, device=None) -> list[torch.Tensor]:
        return [layer.attn.allocate_kv_cache(num_blocks, device) for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor],
                metadata: CommonAttentionMetadata | dict) -> torch.Tensor:
        x = self.embed(input_ids)
        cos_sin = self.rope[positions]
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, cos_sin, positions, cache, metadata)
        return self.lm_head(self.norm(x)).float()


@dataclass
class _Request:
    tokens: list[int]
    num_computed: int = 0
    generated: list[int] = field(default_factory=list)


class Generator:
    """Greedy generation over the paged cache: one mixed batch per step, decodes first.

    ``forward`` is the model or a compiled version of it (same signature).
    """

    def __init__(self, model: TinyLlama, num_blocks: int, forward=None, *,
                 max_model_len: int = 1024, shuffle_blocks: bool = True, device="cpu") -> None:
        self.model = model
        self.backends = step_backends(model)  # (once: build_step_metadata walks no modules)
        self.forward = model if forward is None else forward
        self.device = device
        # A fixed block-table width keeps tensor shapes stable from step to step.
        self.max_blocks_per_req = -(-max_model_len // model.block_size)
        self.allocator = BlockAllocator(num_blocks, model.block_size, shuffle=shuffle_blocks)
        self.kv_caches = model.allocate_kv_caches(num_blocks, device)
        self.requests: dict[int, _Request] = {}

    def add(self, request_id: int, prompt: list[int]) -> None:
        self.requests[request_id] = _Request(list(prompt))

    @torch.inference_mode()
    def step(self) -> tuple[torch.Tensor, CommonAttentionMetadata]:
        """Run one step over every request; returns the last-token logits ``[B, vocab]``."""
        ids = sorted(self.requests, key=lambda r: len(self.requests[r].tokens)
                     - self.requests[r].num_computed > 1)  # decodes first, stable
        reqs = [self.requests[r] for r in ids]
        context = [r.num_computed for r in reqs]
        new = [len(r.tokens) - r.num_computed for r in reqs]
        meta = build_batch(self.allocator, ids, context, new, device=self.device,
                           max_blocks_per_req=self.max_blocks_per_req)
        input_ids = torch.tensor([t for r in reqs for t in r.tokens[r.num_computed:]],
                                 device=self.device)
        # Backends plan on the host here, once per step, outside any compiled graph.
        step = build_step_metadata(self.backends, meta)
        logits = self.forward(input_ids, meta.positions, self.kv_caches, step)
        last = logits[meta.query_start_loc_cpu[1:].long() - 1]
        for r, row in zip(reqs, last.argmax(-1).tolist()):
            r.num_computed = len(r.tokens)
            r.tokens.append(row)
            r.generated.append(row)
        return last, meta
