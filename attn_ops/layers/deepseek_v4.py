"""DeepSeek-V4's attention layer over paged caches (sliding-window, compressed-sparse and
heavily compressed layers, :class:`~attn_ops.backends.deepseek_v4.spec.DeepseekV4Spec`).

One shared key = value head of ``head_dim`` (``head_dim - rope_dim`` plain dims, then the
rotary ones), a per-head sink, grouped low-rank output. A step:

1. ``q = per-head RMSNorm((RMSNorm_w(x W_qa)) W_qb)``, interleaved RoPE on q's trailing dims;
2. ``kv = RMSNorm_w(x W_kv)``, rotated alike, written to the window cache at the step's slots;
3. a compressed layer runs its compressor one step (state in a slot, entries to the compressed
   cache: :func:`~attn_ops.backends.deepseek_v4.compressor.compress_into_cache`); a
   compressed-sparse one also its indexer's compressor (keys of ``index_head_dim``) and the
   indexer's top-k of the visible entries for each query;
4. attention over the window and the (picked) compressed entries with the sink, by the
   selected backend (DSV4_REFERENCE: :mod:`~attn_ops.backends.deepseek_v4.reference`);
5. the output's rotary dims rotated back by the query's position (V carried RoPE), then the
   grouped output projection.

RoPE tables: sliding-window layers the "main" one, compressed layers the "compress" one (HF's
and DeepSeek's reference: ``theta`` 1e4 without YaRN for the first; vLLM keeps YaRN there).
"""

from __future__ import annotations

import torch
from torch import nn

from attn_ops.backends.deepseek_v4.compressor import interleaved_rope
from attn_ops.backends.deepseek_v4.spec import LAYER_TYPES, DeepseekV4Spec
from attn_ops.layers.attention import SelectedLayer
from attn_ops.platforms import Platform
from attn_ops.selector import AttentionConfig

__all__ = ["DeepseekV4Attention", "LAYER_TYPES"]


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float() if weight is not None else xf).to(x.dtype)



class DeepseekV4Attention(SelectedLayer):
    """A DeepSeek-V4 attention layer of ``spec``, its backend selected for it (the spec's
    family only: ``AttentionConfig.backend_per_kind[LayerKind.DEEPSEEK_V4]`` forces one)."""

    def __init__(self, spec: DeepseekV4Spec, hidden_size: int, q_lora_rank: int,
                 o_groups: int, o_lora_rank: int, eps: float = 1e-6,
                 config: AttentionConfig | None = None, *,
                 platform: Platform | None = None) -> None:
        super().__init__(spec, config, platform=platform)
        h, d = spec.num_heads, spec.head_dim
        if h % o_groups:
            raise ValueError(f"o_groups={o_groups} must divide num_heads={h}")
        self.layer_type, self.num_heads, self.head_dim = spec.layer_type, h, d
        self.rope_dim, self.sliding_window, self.ratio, self.eps = (
            spec.rope_dim, spec.sliding_window, spec.compress_ratio, eps)
        self.o_groups, self.o_lora_rank = o_groups, o_lora_rank
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_norm = nn.Parameter(torch.ones(q_lora_rank))
        self.q_b_proj = nn.Linear(q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(hidden_size, d, bias=False)
        self.kv_norm = nn.Parameter(torch.ones(d))
        self.o_a_proj = nn.Parameter(torch.zeros(o_groups * o_lora_rank, h * d // o_groups))
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h))
        self.compressed = spec.layer_type != "sliding_attention"
        self.sparse = spec.layer_type == "compressed_sparse_attention"  # (overlap, indexer)
        if self.compressed:
            width = (2 if self.sparse else 1) * d
            self.c_kv_proj = nn.Linear(hidden_size, width, bias=False)
            self.c_gate_proj = nn.Linear(hidden_size, width, bias=False)
            self.c_position_bias = nn.Parameter(torch.zeros(self.ratio, width))
            self.c_kv_norm = nn.Parameter(torch.ones(d))
        if self.sparse:
            self.index_heads = spec.index_heads
            self.index_head_dim = di = spec.index_head_dim
            self.i_kv_proj = nn.Linear(hidden_size, 2 * di, bias=False)
            self.i_gate_proj = nn.Linear(hidden_size, 2 * di, bias=False)
            self.i_position_bias = nn.Parameter(torch.zeros(self.ratio, 2 * di))
            self.i_kv_norm = nn.Parameter(torch.ones(di))
            self.i_q_b_proj = nn.Linear(q_lora_rank, self.index_heads * di, bias=False)
            self.i_weights_proj = nn.Linear(hidden_size, self.index_heads, bias=False)

    @classmethod
    def from_hf(cls, hf, config, platform: Platform | None = None,
                attention_config: AttentionConfig | None = None) -> DeepseekV4Attention:
        """From HF transformers' ``DeepseekV4Attention`` ``hf`` of ``config`` (the model's;
        ``attention_config``: ours, e.g. a forced backend)."""
        sparse = hf.layer_type == "compressed_sparse_attention"
        spec = DeepseekV4Spec(
            hf.layer_type, config.num_attention_heads, config.head_dim,
            config.qk_rope_head_dim, config.sliding_window,
            config.compress_rates.get(hf.layer_type, 0) if hf.layer_type != "sliding_attention"
            else 0, config.index_n_heads if sparse else 0,
            config.index_head_dim if sparse else 0, config.index_topk if sparse else 0,
            hf.q_a_proj.weight.dtype)
        layer = cls(spec, config.hidden_size, config.q_lora_rank, config.o_groups,
                    config.o_lora_rank, config.rms_norm_eps, attention_config,
                    platform=platform)
        with torch.no_grad():
            layer.q_a_proj.weight.copy_(hf.q_a_proj.weight)
            layer.q_a_norm.copy_(hf.q_a_norm.weight)
            layer.q_b_proj.weight.copy_(hf.q_b_proj.weight)
            layer.kv_proj.weight.copy_(hf.kv_proj.weight)
            layer.kv_norm.copy_(hf.kv_norm.weight)
            layer.o_a_proj.copy_(hf.o_a_proj.weight)
            layer.o_b_proj.weight.copy_(hf.o_b_proj.weight)
            layer.sinks.copy_(hf.sinks)
            if layer.compressed:
                c = hf.compressor
                layer.c_kv_proj.weight.copy_(c.kv_proj.weight)
                layer.c_gate_proj.weight.copy_(c.gate_proj.weight)
                layer.c_position_bias.copy_(c.position_bias)
                layer.c_kv_norm.copy_(c.kv_norm.weight)
            if layer.sparse:
                i = hf.compressor.indexer
                layer.i_kv_proj.weight.copy_(i.kv_proj.weight)
                layer.i_gate_proj.weight.copy_(i.gate_proj.weight)
                layer.i_position_bias.copy_(i.position_bias)
                layer.i_kv_norm.copy_(i.kv_norm.weight)
                layer.i_q_b_proj.weight.copy_(i.q_b_proj.weight)
                layer.i_weights_proj.weight.copy_(i.scorer.weights_proj.weight)
        return layer.to(hf.q_a_proj.weight.dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope_table: torch.Tensor,
                window_cache: torch.Tensor, step: dict,
                compressed_cache: torch.Tensor | None = None,
                state: torch.Tensor | None = None, index_cache: torch.Tensor | None = None,
                index_state: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, hidden]`` of a step at ``positions [T]``; ``rope_table [positions, R]``
        (each pair's cos, then sin) of this layer's kind; ``window_cache [blocks, page, D]``
        (or ``uint8 [blocks, page * 584]``: vLLM's fp8 entries, as the compressed cache may be);
        ``step``: ``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping`` and, for
        a compressed layer, ``compressed_block_table`` (entries a page:
        ``compressed_cache.shape[1]``; the indexer's keys in ``index_cache`` paged alike, rows
        ``[blocks, page, index_head_dim]`` or vLLM's planar fp8 keys ``uint8 [blocks, page x
        (index_head_dim + 4)]``) and
        ``state_indices`` (its compressors' ``state`` / ``index_state`` slots). Returns
        ``[T, hidden]``."""
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        if x.dtype != self.spec.dtype:
            raise ValueError(f"{type(self).__name__}: x has dtype {x.dtype}, the layer's is "
                             f"{self.spec.dtype}: cast the input (or build the spec with "
                             f"dtype={x.dtype})")
        cos_sin = rope_table[positions]
        qr = _rms(self.q_a_proj(x), self.q_a_norm, self.eps)
        q = _rms(self.q_b_proj(qr).view(t, h, d), None, self.eps)
        q = interleaved_rope(q, cos_sin)
        kv = interleaved_rope(_rms(self.kv_proj(x), self.kv_norm, self.eps), cos_sin)
        self.impl.write(kv, window_cache, step["slot_mapping"])
        if self.compressed:
            self.impl.compress(self.c_kv_proj(x), self.c_gate_proj(x), self.c_position_bias,
                               state, step, self.sparse, self.c_kv_norm, self.eps, rope_table,
                               compressed_cache)
        if self.sparse:  # the lightning indexer's picks among the compressed entries
            self.impl.compress(self.i_kv_proj(x), self.i_gate_proj(x), self.i_position_bias,
                               index_state, step, True, self.i_kv_norm, self.eps, rope_table,
                               index_cache, index=True)
            q_index = interleaved_rope(
                self.i_q_b_proj(qr).view(t, self.index_heads, self.index_head_dim), cos_sin)
            weights = self.i_weights_proj(x).float() * self.index_heads ** -0.5
            picks = self.impl.indexer_topk(q_index, weights, index_cache, step)
        out = self.impl.attention(q, window_cache, step, self.sinks,
                                  compressed_cache if self.compressed else None,
                                  picks if self.sparse else None)
        out = interleaved_rope(out, cos_sin, inverse=True)
        # (sizes spelled out, not -1: a step may have no rows)
        grouped = out.reshape(t, self.o_groups, out.shape[1] * out.shape[2] // self.o_groups)
        w = self.o_a_proj.view(self.o_groups, self.o_lora_rank, -1)
        mixed = torch.einsum("tgi,goi->tgo", grouped, w).reshape(t, self.o_groups
                                                                  * self.o_lora_rank)
        return self.o_b_proj(mixed)
