"""A small DeepSeek-style decoder built on :class:`attn_ops.MLAAttention` (dense MLP), with
the :class:`~attn_ops.models.llama.TinyLlama` calling convention: ``forward(input_ids [T], positions
[T], latent_caches, metadata) -> logits``. Used by the tests (against HF transformers'
``DeepseekV3ForCausalLM`` and, sparse, ``DeepseekV32ForCausalLM``: :func:`load_hf_deepseek`)
and the whole-step benchmark. With ``MLAModelConfig.index_topk`` set every layer is sparse
(DeepSeek-V3.2): an :class:`~attn_ops.layers.mla_indexer.MLAIndexer` picks each token's
positions and the layer attends to those only; each layer's cache is then ``(latent, index_keys,
index_scales)``.

RoPE is rotate-half on the rope dims; DeepSeek-V3's interleaved RoPE is that on deinterleaved
dims, so :func:`load_hf_deepseek` permutes the rope rows of ``q_proj`` / ``q_b_proj`` and
``kv_a_proj_with_mqa`` once (the cache then holds ``k_pe`` deinterleaved: attention scores are
unchanged).

RoPE scaling: ``MLAModelConfig.rope_scaling`` (a :class:`YarnScaling`, the ``"yarn"`` type every
released DeepSeek-V2/V3 config uses) changes three things, all as HF transformers applies them:
the rotary frequencies, a factor on cos/sin (both baked into the model's ``cos_sin`` cache, which
every RoPE path -- :data:`~attn_ops.backends.mla.rope.mla_rope`, its fused cache-write form and
the sparse indexer -- takes as given) and the softmax scale (the spec's ``mscale``).
:func:`hf_rope_config` reads a ``transformers`` config's RoPE into those fields and
:func:`load_hf_deepseek` refuses a model built with different ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from attn_ops.layers.mla import MLAAttention
from attn_ops.layers.mla_indexer import MLAIndexer
from attn_ops.models.llama import RMSNorm, rope_cache, shared_block_size
from attn_ops.platforms import Platform
from attn_ops.selector import AttentionConfig
from attn_ops.spec import AttentionSpec, yarn_mscale

__all__ = ["MLAModelConfig", "TinyDeepseek", "YarnScaling", "hf_rope_config",
           "load_hf_deepseek", "mla_rope_cache"]


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (a config's ``rope_scaling`` / ``rope_parameters`` of type ``"yarn"``),
    computed as HF transformers' ``_compute_yarn_parameters`` and ``yarn_apply_mscale`` do.

    * Frequencies: dims rotating fewer than ``beta_slow`` times over ``original_max_position``
      positions are interpolated (``inv_freq / factor``), those rotating more than
      ``beta_fast`` times keep their frequency, and a linear ramp blends the dims in between.
    * cos/sin are multiplied by :attr:`cos_sin_factor`: the given ``attention_factor``, else
      ``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)`` when both
      are set (non-zero), else ``yarn_get_mscale(factor)`` -- HF's rule, which with DeepSeek's
      defaults (``mscale`` 1, ``mscale_all_dim`` 0) equals DeepSeek's reference code.
    * The softmax scale takes :attr:`softmax_mscale` squared (``yarn_mscale(factor,
      mscale_all_dim)``, 1 when ``mscale_all_dim`` is unset or 0): DeepSeek scales the whole
      ``q @ k^T``, nope dims included, not only the rotary dims that cos/sin reach.
    """

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = 1.0
    mscale_all_dim: float | None = 0.0
    attention_factor: float | None = None  # (None: derived from factor and the mscales)
    truncate: bool = True  # round the ramp's ends outward to whole dims

    @property
    def cos_sin_factor(self) -> float:
        """The factor on cos and sin (so on the rope dims' part of each score, squared)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return (_yarn_get_mscale(self.factor, self.mscale)
                    / _yarn_get_mscale(self.factor, self.mscale_all_dim))
        return _yarn_get_mscale(self.factor, 1.0)

    @property
    def softmax_mscale(self) -> float:
        """The spec's ``mscale`` (:meth:`AttentionSpec.mla` squares it into the scale)."""
        return yarn_mscale(self.factor, self.mscale_all_dim or 0.0)

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """``[dim // 2]`` float32 inverse frequencies (HF's arithmetic, so its rounding)."""
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)

        def correction_dim(rotations: float) -> float:  # the dim turning `rotations` times
            return (dim * math.log(self.original_max_position / (rotations * 2 * math.pi))
                    / (2 * math.log(theta)))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # (a zero-width ramp would divide by zero)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: the dim keeps its frequency, 0: interpolated
        return interpolation * (1 - keep) + extrapolation * keep


def _yarn_get_mscale(factor: float, mscale: float) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor`` <= 1), ``mscale`` taken as
    given (HF's ``yarn_get_mscale``; :func:`attn_ops.spec.yarn_mscale` maps 0 to 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAModelConfig:
    """Shapes (DeepSeek-V2-Lite's attention by default, fewer layers and a small MLP)."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 16
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 4096
    dtype: torch.dtype = torch.float32
    # sparse MLA (DeepSeek-V3.2): top-k positions a token, the indexer's heads and head dim,
    # its key cache's dtype (fp8 e4m3 with per-token scales, or bf16 / fp32)
    index_topk: int | None = None
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_cache_dtype: torch.dtype = torch.float8_e4m3fn
    # RoPE scaling (None: plain RoPE of base rope_theta); hf_rope_config reads it off HF's
    rope_scaling: YarnScaling | None = None

    def attention_spec(self) -> AttentionSpec:
        mscale = 1.0 if self.rope_scaling is None else self.rope_scaling.softmax_mscale
        return AttentionSpec.mla(self.num_heads, kv_lora_rank=self.kv_lora_rank,
                                 qk_nope_head_dim=self.qk_nope_head_dim,
                                 qk_rope_head_dim=self.qk_rope_head_dim,
                                 v_head_dim=self.v_head_dim, q_lora_rank=self.q_lora_rank,
                                 mscale=mscale, dtype=self.dtype, index_topk=self.index_topk)


def mla_rope_cache(cfg: MLAModelConfig) -> torch.Tensor:
    """``[max_position, qk_rope_head_dim]`` float32, cos in the first half and sin in the
    second, with ``cfg.rope_scaling``'s frequencies and cos/sin factor when set."""
    if cfg.rope_scaling is None:
        return rope_cache(cfg.qk_rope_head_dim, cfg.max_position, cfg.rope_theta)
    yarn = cfg.rope_scaling
    inv_freq = yarn.inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
    freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * yarn.cos_sin_factor


class MLADecoderLayer(nn.Module):
    def __init__(self, cfg: MLAModelConfig, attn_config: AttentionConfig | None,
                 platform: Platform | None = None) -> None:
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.cfg = cfg
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.attn = MLAAttention(cfg.attention_spec(), attn_config, platform=platform)
        self.indexer = None
        if cfg.index_topk is not None:
            if cfg.q_lora_rank is None:
                raise ValueError("a sparse MLA model (index_topk set) needs q_lora_rank: the "
                                 "indexer's queries come from the query latent")
            self.indexer = MLAIndexer(h, cfg.q_lora_rank, cfg.index_n_heads,
                                      cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.index_topk)
        kv_b = torch.randn(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        self.attn.load_kv_b_proj(kv_b / cfg.kv_lora_rank ** 0.5)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x, cos_sin, cache, metadata):
        cfg = self.cfg
        hidden = self.input_norm(x)
        if cfg.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q_resid = self.q_a_norm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        q = q.view(x.shape[0], cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        kv_c, k_pe = self.kv_a_proj(hidden).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
        sparse = {}
        if self.indexer is not None:
            cache, keys, scales = cache
            m = metadata[self.attn._metadata_key] if isinstance(metadata, dict) else metadata
            cos, sin = (c.repeat(1, 2) for c in cos_sin.chunk(2, dim=-1))  # (HF's layout)
            _, sparse["topk_slots"] = self.indexer(
                hidden, q_resid, cos, sin, keys, scales, m.slot_mapping, m.block_table,
                m.seq_lens, m.query_start_loc, block_size=self.attn.block_size)
        # RoPE runs in the layer (torch.ops.attn.mla_rope): the passes fuse it with the write
        attn = self.attn(q, self.kv_a_norm(kv_c), k_pe, cache, metadata, cos_sin, **sparse)
        x = x + self.o_proj(attn.flatten(1))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class TinyDeepseek(nn.Module):
    """``forward(input_ids [T], positions [T], latent_caches, metadata) -> logits [T, vocab]``."""

    def __init__(self, cfg: MLAModelConfig, attn_config: AttentionConfig | None = None,
                 platform: Platform | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MLADecoderLayer(cfg, attn_config, platform)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("rope", mla_rope_cache(cfg), persistent=False)

    @property
    def block_size(self) -> int:
        return shared_block_size(self.layers)

    def allocate_kv_caches(self, num_blocks: int, device=None) -> list:
        """One latent cache per layer (sparse: with its index keys and scales)."""
        caches = []
        for layer in self.layers:
            latent = layer.attn.allocate_cache(num_blocks, device)
            if layer.indexer is None:
                caches.append(latent)
                continue
            caches.append((latent, *layer.indexer.allocate_cache(
                num_blocks, layer.attn.block_size, self.cfg.index_cache_dtype,
                device=latent.device)))
        return caches

    def forward(self, input_ids, positions, kv_caches, metadata):
        x = self.embed(input_ids)
        cos_sin = self.rope[positions].to(x.dtype)
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, cos_sin, cache, metadata)
        return self.lm_head(self.norm(x)).float()


def _deinterleave_rows(weight: torch.Tensor, heads: int, nope: int, rope: int) -> torch.Tensor:
    """``weight`` [heads * (nope + rope), in] with each head's rope rows reordered 0, 2, 4, ...,
    1, 3, 5, ... (interleaved RoPE pairs -> rotate-half halves)."""
    w = weight.view(heads, nope + rope, -1).clone()
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) + nope
    w[:, nope:] = w[:, order]
    return w.view(heads * (nope + rope), -1)


def _rope_effect(cfg: MLAModelConfig) -> tuple:
    """What a config's RoPE does: the frequencies, the cos/sin factor, the softmax mscale."""
    dim = cfg.qk_rope_head_dim
    if cfg.rope_scaling is None:
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        return tuple(inv_freq.tolist()), 1.0, 1.0
    yarn = cfg.rope_scaling
    return (tuple(yarn.inv_freq(dim, cfg.rope_theta).tolist()), yarn.cos_sin_factor,
            yarn.softmax_mscale)


def hf_rope_config(hf_config) -> dict:
    """``{"rope_theta": ..., "rope_scaling": YarnScaling | None}`` of a ``transformers``
    DeepSeek config, for :class:`MLAModelConfig`. Reads ``rope_parameters`` (transformers 5)
    or ``rope_scaling`` + ``rope_theta`` (transformers 4, and the checkpoints' config.json),
    with the type under ``rope_type`` or ``type``; a RoPE type other than plain RoPE
    (``"default"``) or ``"yarn"`` -- ``"linear"``, ``"dynamic"``, ... -- is a ValueError, not
    silently plain RoPE."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    theta = 10000.0 if theta is None else float(theta)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not "
                         "supported: MLA rotates all qk_rope_head_dim dims")
    if rope_type == "default":
        return {"rope_theta": theta, "rope_scaling": None}
    if rope_type != "yarn":
        raise ValueError(f"RoPE type {rope_type!r} is not supported by TinyDeepseek (plain "
                         f"RoPE and 'yarn' are); the config's RoPE parameters: {params}")
    # (HF's order: the config's own original_max_position_embeddings, then the parameters',
    # then max_position_embeddings; a missing factor is the context extension ratio)
    original = (getattr(hf_config, "original_max_position_embeddings", None)
                or params.get("original_max_position_embeddings")
                or hf_config.max_position_embeddings)
    factor = params.get("factor")
    if factor is None:
        factor = hf_config.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    return {"rope_theta": theta, "rope_scaling": YarnScaling(
        factor=float(factor), original_max_position=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)))}


@torch.no_grad()
def load_hf_deepseek(model: TinyDeepseek, hf) -> None:
    """Copy a ``transformers`` ``DeepseekV3ForCausalLM`` (dense MLPs, ``rope_interleave``) or,
    into a sparse model, a ``DeepseekV32ForCausalLM`` (its indexers too) into ``model`` of the
    same shapes. ``model`` must have HF's RoPE (:func:`hf_rope_config`): its frequencies and the
    softmax scale are fixed when the model is built, so a model built with other ones is a
    ValueError rather than silently different logits."""
    cfg = model.cfg
    want = hf_rope_config(hf.config)
    if _rope_effect(cfg) != _rope_effect(replace(cfg, **want)):
        have = {"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling}
        raise ValueError(f"the model's RoPE {have} is not the HF config's {want}: build it "
                         "with MLAModelConfig(..., **hf_rope_config(hf.config))")
    heads, nope, rope = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    model.embed.weight.copy_(hf.model.embed_tokens.weight)
    model.norm.weight.copy_(hf.model.norm.weight)
    model.lm_head.weight.copy_(hf.lm_head.weight)
    for ours, theirs in zip(model.layers, hf.model.layers):
        a = theirs.self_attn
        ours.input_norm.weight.copy_(theirs.input_layernorm.weight)
        ours.post_norm.weight.copy_(theirs.post_attention_layernorm.weight)
        if cfg.q_lora_rank is None:
            ours.q_proj.weight.copy_(_deinterleave_rows(a.q_proj.weight, heads, nope, rope))
        else:
            ours.q_a_proj.weight.copy_(a.q_a_proj.weight)
            ours.q_a_norm.weight.copy_(a.q_a_layernorm.weight)
            ours.q_b_proj.weight.copy_(_deinterleave_rows(a.q_b_proj.weight, heads, nope, rope))
        ours.kv_a_proj.weight.copy_(_deinterleave_rows(a.kv_a_proj_with_mqa.weight, 1,
                                                       cfg.kv_lora_rank, rope))
        ours.kv_a_norm.weight.copy_(a.kv_a_layernorm.weight)
        ours.attn.load_kv_b_proj(a.kv_b_proj.weight)
        ours.o_proj.weight.copy_(a.o_proj.weight)
        if ours.indexer is not None:
            ours.indexer.load_state_dict(a.indexer.state_dict())
        mlp = theirs.mlp
        ours.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        ours.down.weight.copy_(mlp.down_proj.weight)
