"""Model-facing recurrent-state layers, as HF transformers builds them, over our state caches:

* :class:`GatedDeltaNet` -- Qwen3-Next / Qwen3.5's linear-attention layer (``in_proj_qkvz``,
  ``in_proj_ba``, a SiLU causal conv over ``[q | k | v]``, the gated delta rule with q / k
  L2-normalized, a gated RMSNorm per value head, ``out_proj``);
* :class:`Mamba2Mixer` -- Mamba2 (``in_proj`` to ``[z | x B C | dt]``, a SiLU causal conv,
  the SSD recurrence with D, the gated grouped RMSNorm, ``out_proj``);
* :class:`Mamba1Mixer` -- Mamba / Falcon-Mamba / Jamba's Mamba layers (``in_proj`` to ``[x |
  z]``, a SiLU causal conv over ``x``, ``x_proj`` to ``[dt | B | C]`` (RMS-normalized in
  Falcon-Mamba), ``dt_proj``, the selective scan with D, times ``silu(z)``, ``out_proj``);
* :class:`LightningAttention` -- MiniMax-Text-01's lightning attention (``qkv_proj`` with SiLU,
  linear attention with a fixed decay a head, an RMSNorm over the heads, times
  ``sigmoid(output_gate)``, ``out_proj``; no convolution);
* :class:`ShortConv` -- LFM2's gated short convolution (``in_proj`` to ``[B | C | x]``,
  ``out_proj``).

Each takes a step's tokens flattened ``[T, hidden]`` (decode-first, padding rows last), its
layer's :class:`~attn_ops.backends.ssm.spec.StateCache` and the step's
:class:`~attn_ops.backends.ssm.metadata.StateMetadata`, and updates the states in place through
the backend selected for its spec (:class:`StateLayer`; the built-in ones run
``torch.ops.attn.*`` ops, :mod:`attn_ops.backends.ssm.backend`); ``from_hf`` copies an HF
module's weights and takes the layer's ``config`` / ``platform``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attn_ops.backends.ssm.metadata import StateMetadata
from attn_ops.backends.ssm.spec import (GatedDeltaNetSpec, LightningSpec, Mamba1Spec,
                                       Mamba2Spec, ShortConvSpec, StateCache)
from attn_ops.layers.attention import SelectedLayer
from attn_ops.platforms import Platform
from attn_ops.selector import AttentionConfig

__all__ = ["GatedDeltaNet", "LightningAttention", "Mamba1Mixer", "Mamba2Mixer", "ShortConv",
           "StateLayer", "gated_rms_norm", "weightless_rms_norm"]


def _load(layer: nn.Module, module: nn.Module, pairs) -> nn.Module:
    """``layer`` with HF ``module``'s tensors copied in, ``pairs`` of (ours, theirs); ours None
    (a bias the layer has not) is skipped; in the module's dtype."""
    with torch.no_grad():
        for ours, theirs in pairs:
            if ours is not None:
                ours.copy_(theirs)
    return layer.to(module.out_proj.weight.dtype)


def _linears(*pairs) -> list:
    """The (weight, bias) pairs of (ours, theirs) ``nn.Linear`` pairs."""
    return [(getattr(a, n), getattr(b, n)) for a, b in pairs for n in ("weight", "bias")]


class StateLayer(SelectedLayer):
    """What every recurrent-state layer shares: the backend selected for its state spec (its
    kind's backend, or the one ``config.backend_per_kind`` forces for the kind), whose methods
    run the layer's steps."""

    def extra_repr(self) -> str:
        return f"{self.spec.describe()}, backend={self.backend}"


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   group_size: int | None = None, norm_before_gate: bool = True) -> torch.Tensor:
    """RMSNorm over groups of ``group_size`` of the last dim (all of it by default) with a SiLU
    gate: applied after the norm (Qwen3-Next) or to its input (``norm_before_gate=False``,
    Mamba2), in fp32; ``weight`` times the result in ``x``'s dtype, as HF computes them."""
    dtype = x.dtype
    h = x.to(torch.float32)
    if not norm_before_gate:
        h = h * F.silu(gate.to(torch.float32))
    size = group_size or h.shape[-1]
    grouped = h.view(*h.shape[:-1], h.shape[-1] // size, size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    h = grouped.view(h.shape)
    if norm_before_gate:
        return (weight * h.to(dtype) * F.silu(gate.to(torch.float32))).to(dtype)
    return weight * h.to(dtype)


class GatedDeltaNet(StateLayer):
    def __init__(self, spec: GatedDeltaNetSpec, hidden_size: int, eps: float = 1e-6, *,
                 config: AttentionConfig | None = None, platform: Platform | None = None
                 ) -> None:
        super().__init__(spec, config, platform=platform)
        self.hidden_size, self.eps = hidden_size, eps
        s = spec
        key_dim, value_dim = s.num_k_heads * s.head_k_dim, s.num_v_heads * s.head_v_dim
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * s.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(s.conv_dim, s.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm_weight = nn.Parameter(torch.ones(s.head_v_dim))
        self.out_proj = nn.Linear(value_dim, hidden_size, bias=False)

    @classmethod
    def from_hf(cls, module, spec: GatedDeltaNetSpec, **kw) -> GatedDeltaNet:
        """Ours with the weights of HF's ``Qwen3NextGatedDeltaNet`` ``module`` (``kw``: the
        layer's ``config`` / ``platform``)."""
        layer = cls(spec, module.hidden_size, module.layer_norm_epsilon, **kw)
        return _load(layer, module, [
            (layer.in_proj_qkvz.weight, module.in_proj_qkvz.weight),
            (layer.in_proj_ba.weight, module.in_proj_ba.weight),
            (layer.conv_weight, module.conv1d.weight[:, 0]), (layer.dt_bias, module.dt_bias),
            (layer.A_log, module.A_log), (layer.norm_weight, module.norm.weight),
            (layer.out_proj.weight, module.out_proj.weight)])

    def forward(self, hidden: torch.Tensor, states: StateCache,
                meta: StateMetadata) -> torch.Tensor:
        s = self.spec
        t = hidden.shape[0]
        per_k = s.num_v_heads // s.num_k_heads
        # in_proj_qkvz's rows are grouped by key head: [q | k | v (per_k heads) | z (per_k)]
        # (sizes spelled out, not -1: a step may have no rows)
        qkvz = self.in_proj_qkvz(hidden).view(t, s.num_k_heads,
                                              2 * (s.head_k_dim + per_k * s.head_v_dim))
        q, k, v, z = qkvz.split([s.head_k_dim, s.head_k_dim, per_k * s.head_v_dim,
                                 per_k * s.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).view(t, s.num_k_heads, 2 * per_k).split(per_k, dim=-1)
        key_dim, value_dim = s.num_k_heads * s.head_k_dim, s.num_v_heads * s.head_v_dim
        mixed = torch.cat([q.reshape(t, key_dim), k.reshape(t, key_dim),
                           v.reshape(t, value_dim)], dim=-1)
        mixed = self.impl.conv(mixed, self.conv_weight, None, states.conv, meta)
        q, k, v = mixed.split([key_dim, key_dim, value_dim], dim=-1)
        beta = b.reshape(t, s.num_v_heads).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(t, s.num_v_heads).float()
                                                   + self.dt_bias)
        o = self.impl.recurrence(q.reshape(t, s.num_k_heads, s.head_k_dim),
                                 k.reshape(t, s.num_k_heads, s.head_k_dim),
                                 v.reshape(t, s.num_v_heads, s.head_v_dim), g, beta,
                                 states.recurrent, meta, s.head_k_dim ** -0.5, True)
        o = gated_rms_norm(o, z.reshape(t, s.num_v_heads, s.head_v_dim), self.norm_weight,
                           self.eps)
        return self.out_proj(o.reshape(t, value_dim))


class Mamba2Mixer(StateLayer):
    def __init__(self, spec: Mamba2Spec, hidden_size: int, eps: float = 1e-6, *,
                 conv_bias: bool = True, bias: bool = False,
                 dt_limit: tuple[float, float] = (0.0, float("inf")),
                 config: AttentionConfig | None = None, platform: Platform | None = None
                 ) -> None:
        super().__init__(spec, config, platform=platform)
        self.hidden_size, self.eps, self.dt_limit = hidden_size, eps, dt_limit
        s = spec
        inner = s.num_heads * s.head_dim
        self.in_proj = nn.Linear(hidden_size, inner + s.conv_dim + s.num_heads, bias=bias)
        self.conv_weight = nn.Parameter(torch.zeros(s.conv_dim, s.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(s.conv_dim)) if conv_bias else None
        self.dt_bias = nn.Parameter(torch.ones(s.num_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_heads))
        self.D = nn.Parameter(torch.ones(s.num_heads))
        self.norm_weight = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, hidden_size, bias=bias)

    @classmethod
    def from_hf(cls, module, spec: Mamba2Spec, **kw) -> Mamba2Mixer:
        """Ours with the weights of HF's ``Mamba2Mixer`` ``module`` (and its dt limits)."""
        layer = cls(spec, module.hidden_size, module.layer_norm_epsilon,
                    conv_bias=module.conv1d.bias is not None,
                    bias=module.in_proj.bias is not None, dt_limit=tuple(module.time_step_limit),
                    **kw)
        return _load(layer, module, [
            *_linears((layer.in_proj, module.in_proj), (layer.out_proj, module.out_proj)),
            (layer.conv_weight, module.conv1d.weight[:, 0]),
            (layer.conv_bias, module.conv1d.bias), (layer.dt_bias, module.dt_bias),
            (layer.A_log, module.A_log), (layer.D, module.D),
            (layer.norm_weight, module.norm.weight)])

    def forward(self, hidden: torch.Tensor, states: StateCache,
                meta: StateMetadata) -> torch.Tensor:
        s = self.spec
        t = hidden.shape[0]
        inner = s.num_heads * s.head_dim
        gate, xbc, dt = self.in_proj(hidden).split([inner, s.conv_dim, s.num_heads], dim=-1)
        xbc = self.impl.conv(xbc, self.conv_weight, self.conv_bias, states.conv, meta)
        gn = s.n_groups * s.d_state
        x, B, C = xbc.split([inner, gn, gn], dim=-1)
        y = self.impl.ssd(x.reshape(t, s.num_heads, s.head_dim), dt, -self.A_log.float().exp(),
                          B.reshape(t, s.n_groups, s.d_state),
                          C.reshape(t, s.n_groups, s.d_state), self.D, None, self.dt_bias,
                          states.recurrent, meta, True, float(self.dt_limit[0]),
                          float(self.dt_limit[1]))
        y = gated_rms_norm(y.reshape(t, inner), gate, self.norm_weight, self.eps,
                           group_size=inner // s.n_groups, norm_before_gate=False)
        return self.out_proj(y.to(hidden.dtype))


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dim without a weight, in fp32, back in ``x``'s dtype (Falcon-Mamba's
    norms of dt, B and C)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Mamba1Mixer(StateLayer):
    """``rms_eps`` (Falcon-Mamba): dt, B and C RMS-normalized without weights before the
    scan; None (Mamba, Jamba): not."""

    def __init__(self, spec: Mamba1Spec, hidden_size: int, dt_rank: int, *,
                 conv_bias: bool = True, bias: bool = False, rms_eps: float | None = None,
                 config: AttentionConfig | None = None, platform: Platform | None = None
                 ) -> None:
        super().__init__(spec, config, platform=platform)
        self.hidden_size, self.dt_rank, self.rms_eps = hidden_size, dt_rank, rms_eps
        s = spec
        self.in_proj = nn.Linear(hidden_size, 2 * s.d_inner, bias=bias)
        self.conv_weight = nn.Parameter(torch.zeros(s.d_inner, s.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(s.d_inner)) if conv_bias else None
        self.x_proj = nn.Linear(s.d_inner, dt_rank + 2 * s.d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, s.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(s.d_inner, s.d_state))
        self.D = nn.Parameter(torch.ones(s.d_inner))
        self.out_proj = nn.Linear(s.d_inner, hidden_size, bias=bias)

    @classmethod
    def from_hf(cls, module, spec: Mamba1Spec, **kw) -> Mamba1Mixer:
        """Ours with the weights of HF's ``MambaMixer`` or ``FalconMambaMixer`` ``module``."""
        layer = cls(spec, module.hidden_size, module.time_step_rank,
                    conv_bias=module.conv1d.bias is not None,
                    bias=module.in_proj.bias is not None,
                    rms_eps=getattr(module, "rms_eps", None), **kw)
        return _load(layer, module, [
            *_linears((layer.in_proj, module.in_proj), (layer.out_proj, module.out_proj),
                      (layer.dt_proj, module.dt_proj)),
            (layer.x_proj.weight, module.x_proj.weight),
            (layer.conv_weight, module.conv1d.weight[:, 0]),
            (layer.conv_bias, module.conv1d.bias), (layer.A_log, module.A_log),
            (layer.D, module.D)])

    def forward(self, hidden: torch.Tensor, states: StateCache,
                meta: StateMetadata) -> torch.Tensor:
        s = self.spec
        x, z = self.in_proj(hidden).chunk(2, dim=-1)
        x = self.impl.conv(x, self.conv_weight, self.conv_bias, states.conv, meta)
        ts, B, C = self.x_proj(x).split([self.dt_rank, s.d_state, s.d_state], dim=-1)
        if self.rms_eps is not None:
            ts, B, C = (weightless_rms_norm(u, self.rms_eps) for u in (ts, B, C))
        dt = F.linear(ts, self.dt_proj.weight)  # (its bias goes into the scan, in fp32)
        y = self.impl.scan(x, dt, -self.A_log.float().exp(), B, C, self.D, z,
                           self.dt_proj.bias, states.recurrent, meta, True)
        return self.out_proj(y.to(hidden.dtype))


class LightningAttention(StateLayer):
    """``slope``: the layer's decay rates a head (:meth:`minimax_slopes`)."""

    def __init__(self, spec: LightningSpec, hidden_size: int, slope: torch.Tensor,
                 eps: float = 1e-6, *, config: AttentionConfig | None = None,
                 platform: Platform | None = None) -> None:
        super().__init__(spec, config, platform=platform)
        self.hidden_size, self.eps = hidden_size, eps
        inner = spec.num_heads * spec.head_dim
        self.qkv_proj = nn.Linear(hidden_size, 3 * inner, bias=False)
        self.output_gate = nn.Linear(hidden_size, inner, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, hidden_size, bias=False)
        self.register_buffer("slope", slope.detach().float().reshape(spec.num_heads).clone())

    @staticmethod
    def minimax_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
        """MiniMax-Text-01's rates: ``(2^(-8 / H))^(h + 1)`` for head ``h``, scaled by ``1 -
        layer / (L - 1) + 1e-5`` (later layers decay slower)."""
        base = 1 / (2 ** (8 / num_heads))
        factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
        return base ** (torch.arange(num_heads) + 1) * factor

    @classmethod
    def from_hf(cls, module, spec: LightningSpec, **kw) -> LightningAttention:
        """Ours with the weights (and the slopes) of HF's ``MiniMaxLightningAttention``."""
        probe = torch.linspace(-4, 4, 9)
        if not torch.allclose(module.act_fn(probe), F.silu(probe)):
            raise ValueError(f"LightningAttention runs q, k, v through SiLU; the module's "
                             f"activation is {module.act_fn}")
        layer = cls(spec, module.qkv_proj.in_features, module.slope_rate,
                    module.norm.variance_epsilon, **kw)
        return _load(layer, module, [
            (layer.qkv_proj.weight, module.qkv_proj.weight),
            (layer.output_gate.weight, module.output_gate.weight),
            (layer.norm_weight, module.norm.weight),
            (layer.out_proj.weight, module.out_proj.weight)])

    def forward(self, hidden: torch.Tensor, states: StateCache,
                meta: StateMetadata) -> torch.Tensor:
        s = self.spec
        t = hidden.shape[0]
        # qkv_proj's rows are grouped by head: [q | k | v] of each head
        qkv = F.silu(self.qkv_proj(hidden)).view(t, s.num_heads, 3 * s.head_dim)
        q, k, v = qkv.split(s.head_dim, dim=-1)
        o = self.impl.attention(q, k, v, self.slope, states.recurrent, meta)
        o = o.reshape(t, s.num_heads * s.head_dim)
        h = o.float()
        o = self.norm_weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
                                ).to(o.dtype)
        return self.out_proj(torch.sigmoid(self.output_gate(hidden)) * o)


class ShortConv(StateLayer):
    def __init__(self, spec: ShortConvSpec, *, bias: bool = False,
                 config: AttentionConfig | None = None, platform: Platform | None = None
                 ) -> None:
        super().__init__(spec, config, platform=platform)
        self.in_proj = nn.Linear(spec.dim, 3 * spec.dim, bias=bias)
        self.conv_weight = nn.Parameter(torch.zeros(spec.dim, spec.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(spec.dim)) if bias else None
        self.out_proj = nn.Linear(spec.dim, spec.dim, bias=bias)

    @classmethod
    def from_hf(cls, module, spec: ShortConvSpec, **kw) -> ShortConv:
        """Ours with the weights of HF's ``Lfm2ShortConv`` ``module``."""
        layer = cls(spec, bias=module.bias, **kw)
        return _load(layer, module, [
            *_linears((layer.in_proj, module.in_proj), (layer.out_proj, module.out_proj)),
            (layer.conv_weight, module.conv.weight[:, 0]), (layer.conv_bias, module.conv.bias)])

    def forward(self, hidden: torch.Tensor, states: StateCache,
                meta: StateMetadata) -> torch.Tensor:
        y = self.impl.short_conv(self.in_proj(hidden), self.conv_weight, self.conv_bias,
                                 states.conv, meta)
        return self.out_proj(y)
