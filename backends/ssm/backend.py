"""The recurrent-state family as backends: one a layer kind, selected like attention's.

A backend serves one kind (:attr:`RecurrentBackend.kind`, a state spec's ``kind``), declares
what it runs on as data (:class:`RecurrentCapabilities`: platforms, model and state dtypes,
speculative decodes, CUDA-graph level, packages) and runs the kind's steps through its methods;
the layers of :mod:`attn_ops.layers.ssm` select one for their spec
(:func:`attn_ops.selector.select_backend`) and call it. The built-in ones run this package's
``torch.ops.attn.*`` ops (our Triton kernels on GPUs, the torch bodies on the CPU and for
fp64). A plugin -- fla's or mamba-ssm's kernels behind the same methods, say -- subclasses the
kind's backend, registers under its own name (``register_backend`` or the ``attn_ops.backends``
entry points) and is chosen per layer kind with ``AttentionConfig(backend_per_kind=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from attn_ops.backends.ssm.common import SSM_PLAN
from attn_ops.backends.ssm.conv import causal_conv1d
from attn_ops.backends.ssm.gated_deltanet import gated_delta_rule
from attn_ops.backends.ssm.lightning import lightning_attention
from attn_ops.backends.ssm.mamba1 import mamba1_scan
from attn_ops.backends.ssm.mamba2 import mamba2_ssd
from attn_ops.backends.ssm.metadata import StateMetadata
from attn_ops.backends.ssm.short_conv import short_conv
from attn_ops.backends.ssm.spec import StateSpec
from attn_ops.capabilities import CUDAGraphSupport, PackageRequirement, Reason
from attn_ops.platforms import Platform, PlatformKind

__all__ = ["GatedDeltaNetBackend", "LightningBackend", "Mamba1Backend", "Mamba2Backend",
           "RecurrentBackend", "RecurrentCapabilities", "ShortConvBackend"]

_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _names(dtypes) -> str:
    return "{" + ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes)) + "}"


@dataclass(frozen=True)
class RecurrentCapabilities:
    """What a recurrent backend supports: every field is data the selector, tests and CLI
    read. ``speculative``: it keeps the state after every draft position (``state_indices``
    ``[B, 1 + W]``)."""

    platforms: frozenset[PlatformKind]
    dtypes: frozenset[torch.dtype] = _FLOATS
    state_dtypes: frozenset[torch.dtype] = _FLOATS
    speculative: bool = True
    cudagraph_support: CUDAGraphSupport = CUDAGraphSupport.UNIFORM_BATCH
    packages: tuple[PackageRequirement, ...] = ()

    def check(self, backend: str, spec: StateSpec, platform: Platform) -> list[Reason]:
        """Every way ``spec`` on ``platform`` falls outside these capabilities."""
        reasons = []
        if platform.kind not in self.platforms:
            reasons.append(Reason(backend, "platform", f"platform {platform.kind.value} not in "
                                  + "{" + ", ".join(sorted(p.value for p in self.platforms))
                                  + "}"))
        for code, value, allowed in (("dtype", spec.dtype, self.dtypes),
                                     ("state_dtype", spec.state_dtype, self.state_dtypes)):
            if value not in allowed:
                reasons.append(Reason(backend, code, f"{code}={str(value).removeprefix('torch.')}"
                                      f" not in {_names(allowed)}"))
        for package in self.packages:
            if (r := package.reason(backend, platform)) is not None:
                reasons.append(r)
        return reasons


class RecurrentBackend:
    """Base of the recurrent-state backends: ``kind`` the state spec kind it serves, the
    capabilities, and the causal convolution its kinds share (:meth:`conv`)."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    capabilities: ClassVar[RecurrentCapabilities]
    kernels: ClassVar[str] = ""
    ops: ClassVar[tuple[str, ...]] = ()  # the torch.ops.attn ops its steps run (tests enroll)

    @classmethod
    def not_supported_reasons(cls, spec, platform: Platform) -> list[Reason]:
        if not isinstance(spec, StateSpec) or spec.kind != cls.kind:
            what = spec.describe() if hasattr(spec, "describe") else type(spec).__name__
            return [Reason(cls.name, "layer_kind", f"{cls.name} serves {cls.kind} layers, "
                           f"{what} is not one", "select a backend of the layer's kind")]
        return cls.capabilities.check(cls.name, spec, platform)

    @classmethod
    def preferred_block_size(cls, spec) -> None:
        """States live in slots, not pages: no page size."""
        return None

    @classmethod
    def cudagraph_support(cls, spec, platform: Platform) -> CUDAGraphSupport:
        if platform.kind is not PlatformKind.CUDA:
            return CUDAGraphSupport.NEVER
        return cls.capabilities.cudagraph_support

    def __init__(self, spec: StateSpec, *, tuning=None) -> None:
        """``tuning``: the layer's :class:`~attn_ops.tuning.Tuning`; its ``ssm`` section goes
        to the ops encoded (:data:`~attn_ops.backends.ssm.common.SSM_PLAN`; None: the
        device's default)."""
        self.spec, self.tuning = spec, tuning
        self.plan = SSM_PLAN.encode(tuning.ssm) if tuning is not None else None

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             conv_state: torch.Tensor, meta: StateMetadata,
             activation: str | None = "silu") -> torch.Tensor:
        """The causal depthwise convolution over the step's tokens from the conv states
        (``torch.ops.attn.causal_conv1d``)."""
        return causal_conv1d(x, weight, bias, conv_state, meta.query_start_loc,
                             meta.state_indices, meta.has_initial_state,
                             activation or "")


_OURS = RecurrentCapabilities(platforms=frozenset({PlatformKind.CPU, PlatformKind.CUDA}))
_OURS_KERNELS = "our Triton kernels on GPUs, the torch bodies on the CPU and for fp64"


class GatedDeltaNetBackend(RecurrentBackend):
    name, kind, capabilities = "GDN", "gated_deltanet", _OURS
    ops = ("causal_conv1d", "gated_delta_rule")
    kernels = f"attn.causal_conv1d + attn.gated_delta_rule ({_OURS_KERNELS})"

    def recurrence(self, q, k, v, g, beta, state, meta: StateMetadata, scale: float,
                   qk_l2norm: bool) -> torch.Tensor:
        return gated_delta_rule(q, k, v, g, beta, state, meta.query_start_loc,
                                meta.state_indices, meta.has_initial_state, meta.max_query_len,
                                scale, qk_l2norm, self.plan)


class Mamba2Backend(RecurrentBackend):
    name, kind, capabilities = "MAMBA2", "mamba2", _OURS
    ops = ("causal_conv1d", "mamba2_ssd")
    kernels = f"attn.causal_conv1d + attn.mamba2_ssd ({_OURS_KERNELS})"

    def ssd(self, x, dt, A, B, C, D, z, dt_bias, state, meta: StateMetadata,
            dt_softplus: bool, dt_min: float, dt_max: float) -> torch.Tensor:
        return mamba2_ssd(x, dt, A, B, C, D, z, dt_bias, state, meta.query_start_loc,
                          meta.state_indices, meta.has_initial_state, meta.max_query_len,
                          dt_softplus, dt_min, dt_max, self.plan)


class Mamba1Backend(RecurrentBackend):
    name, kind, capabilities = "MAMBA1", "mamba1", _OURS
    ops = ("causal_conv1d", "mamba1_scan")
    kernels = f"attn.causal_conv1d + attn.mamba1_scan ({_OURS_KERNELS})"

    def scan(self, x, dt, A, B, C, D, z, dt_bias, state, meta: StateMetadata,
             dt_softplus: bool) -> torch.Tensor:
        return mamba1_scan(x, dt, A, B, C, D, z, dt_bias, state, meta.query_start_loc,
                           meta.state_indices, meta.has_initial_state, meta.max_query_len,
                           dt_softplus, self.plan)


class ShortConvBackend(RecurrentBackend):
    name, kind, capabilities = "SHORT_CONV", "short_conv", _OURS
    ops = ("short_conv",)
    kernels = f"attn.short_conv ({_OURS_KERNELS})"

    def short_conv(self, bcx, weight, bias, conv_state, meta: StateMetadata) -> torch.Tensor:
        return short_conv(bcx, weight, bias, conv_state, meta.query_start_loc,
                          meta.state_indices, meta.has_initial_state)


class LightningBackend(RecurrentBackend):
    name, kind, capabilities = "LINEAR", "lightning", _OURS
    ops = ("lightning_attention",)
    kernels = f"attn.lightning_attention ({_OURS_KERNELS})"

    def attention(self, q, k, v, slope, state, meta: StateMetadata) -> torch.Tensor:
        return lightning_attention(q, k, v, slope, state, meta.query_start_loc,
                                   meta.state_indices, meta.has_initial_state,
                                   meta.max_query_len, self.plan)
