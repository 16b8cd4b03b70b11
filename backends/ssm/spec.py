"""State specs: what each recurrent layer kind keeps per request, and its state cache.

A state cache holds ``num_slots`` rows (:class:`~attn_ops.kv_cache.BlockAllocator`'s
``num_state_slots + 1``: slot 0 is the null slot of padding rows). Layouts:

* conv state ``[slots, kernel - 1, conv_dim]``: the last ``kernel - 1`` inputs of the
  convolution, oldest first, channels contiguous (a decode reads a row of channels at a time);
* Gated DeltaNet recurrent state ``[slots, num_v_heads, head_k_dim, head_v_dim]`` (``S`` with
  ``o = S^T q``: HF's and fla's layout);
* Mamba2 SSM state ``[slots, num_heads, head_dim, d_state]``;
* Mamba1 SSM state ``[slots, d_inner, d_state]`` (a state row per channel);
* lightning attention's KV state ``[slots, num_heads, head_dim, head_dim]`` (``S`` with ``o =
  S^T q``, as GDN's); no conv state.

The conv state is in the model dtype; the recurrent state in ``state_dtype`` (fp32 by default:
a state integrates every token of a request, and bf16 rounding of it compounds).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

__all__ = ["GatedDeltaNetSpec", "LightningSpec", "Mamba1Spec", "Mamba2Spec", "ShortConvSpec",
           "StateCache", "StateSpec"]


class StateCache(NamedTuple):
    """One layer's states: ``conv`` and ``recurrent``, each None for kinds without one."""

    conv: torch.Tensor | None
    recurrent: torch.Tensor | None


@dataclass(frozen=True)
class StateSpec:
    """What every kind declares: its conv width and kernel (kinds without a convolution:
    ``has_conv`` False, ``conv_kernel`` 0), its dtypes and its chunk size."""

    conv_kernel: int
    dtype: torch.dtype
    state_dtype: torch.dtype
    chunk_size: int

    kind = "state"
    has_conv: ClassVar[bool] = True
    multiples: ClassVar[tuple[tuple[str, str], ...]] = ()  # (a, b): a must be a multiple of b

    @property
    def conv_dim(self) -> int:
        raise NotImplementedError

    def recurrent_shape(self) -> tuple[int, ...] | None:
        return None

    @property
    def layer_kind(self):
        """The :class:`~attn_ops.spec.LayerKind` of the layers of this spec (per-kind
        overrides: ``AttentionConfig.backend_per_kind``)."""
        from attn_ops.spec import LayerKind

        return LayerKind(self.kind)

    def describe(self) -> str:
        """A one-line summary used in errors, logs and the CLI."""
        parts = [f"{f.name}={str(getattr(self, f.name)).removeprefix('torch.')}"
                 for f in dataclasses.fields(self)
                 if not (f.name == "conv_kernel" and not self.has_conv)]
        return f"{self.kind} " + " ".join(parts)

    def __post_init__(self) -> None:
        if not self.has_conv:
            if self.conv_kernel != 0:
                raise ValueError(f"{self.kind}: conv_kernel={self.conv_kernel} must be 0 (the "
                                 "kind has no convolution)")
        elif self.conv_kernel < 2:
            raise ValueError(f"{self.kind}: conv_kernel={self.conv_kernel} must be >= 2 (a "
                             "causal convolution over at least one earlier token)")
        if self.chunk_size <= 0 or self.chunk_size & (self.chunk_size - 1):
            raise ValueError(f"{self.kind}: chunk_size={self.chunk_size} must be a power of two")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if (isinstance(value, int) and not isinstance(value, bool) and value <= 0
                    and not (field.name == "conv_kernel" and not self.has_conv)):
                raise ValueError(f"{self.kind}: {field.name}={value} must be > 0")
        for a, b in self.multiples:
            if getattr(self, a) % getattr(self, b):
                raise ValueError(f"{self.kind}: {a}={getattr(self, a)} must be a multiple of "
                                 f"{b}={getattr(self, b)}")

    def state_shapes(self, num_slots: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shapes = {}
        if self.has_conv:
            shapes["conv"] = ((num_slots, self.conv_kernel - 1, self.conv_dim), self.dtype)
        if self.recurrent_shape() is not None:
            shapes["recurrent"] = ((num_slots, *self.recurrent_shape()), self.state_dtype)
        return shapes

    def state_bytes(self) -> int:
        """Bytes of one slot's states."""
        return sum(torch.Size(shape[1:]).numel() * dtype.itemsize
                   for shape, dtype in self.state_shapes(1).values())

    def allocate(self, num_slots: int, device: torch.device | str = "cpu") -> StateCache:
        """Zeroed states for ``num_slots`` slots (a slot is written whole before it is read:
        a request without an initial state starts from zeros, not from the slot)."""
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: a state cache needs the null slot 0 and "
                             "at least one request slot (BlockAllocator.num_state_slots + 1)")
        shapes = self.state_shapes(num_slots)
        made = {name: torch.zeros(shape, dtype=dtype, device=device)
                for name, (shape, dtype) in shapes.items()}
        return StateCache(made.get("conv"), made.get("recurrent"))


@dataclass(frozen=True)
class GatedDeltaNetSpec(StateSpec):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): q, k with ``num_k_heads`` x ``head_k_dim``, v with
    ``num_v_heads`` x ``head_v_dim`` (each k head serves ``num_v_heads / num_k_heads``
    consecutive v heads), one convolution over ``[q | k | v]``."""

    num_k_heads: int = 16
    num_v_heads: int = 32
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_kernel: int = 4
    dtype: torch.dtype = torch.bfloat16
    state_dtype: torch.dtype = torch.float32
    chunk_size: int = 64

    kind = "gated_deltanet"
    multiples = (("num_v_heads", "num_k_heads"),)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def recurrent_shape(self) -> tuple[int, ...]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


@dataclass(frozen=True)
class Mamba2Spec(StateSpec):
    """Mamba2 (SSD): ``num_heads`` x ``head_dim`` channels, ``n_groups`` groups of B / C with
    ``d_state`` each; one convolution over ``[x | B | C]``."""

    num_heads: int = 80
    head_dim: int = 64
    d_state: int = 128
    n_groups: int = 1
    conv_kernel: int = 4
    dtype: torch.dtype = torch.bfloat16
    state_dtype: torch.dtype = torch.float32
    chunk_size: int = 256

    kind = "mamba2"
    multiples = (("num_heads", "n_groups"),)

    @property
    def conv_dim(self) -> int:
        return self.num_heads * self.head_dim + 2 * self.n_groups * self.d_state

    def recurrent_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.head_dim, self.d_state)


@dataclass(frozen=True)
class Mamba1Spec(StateSpec):
    """Mamba (Mamba1; Falcon-Mamba, Jamba's Mamba layers): ``d_inner`` channels, each with its
    own ``d_state`` SSM state row and its own time step; one convolution over ``x``."""

    d_inner: int = 5120
    d_state: int = 16
    conv_kernel: int = 4
    dtype: torch.dtype = torch.bfloat16
    state_dtype: torch.dtype = torch.float32
    chunk_size: int = 256

    kind = "mamba1"

    @property
    def conv_dim(self) -> int:
        return self.d_inner

    def recurrent_shape(self) -> tuple[int, ...]:
        return (self.d_inner, self.d_state)


@dataclass(frozen=True)
class LightningSpec(StateSpec):
    """MiniMax's lightning attention (linear attention with a fixed decay a head):
    ``num_heads`` x ``head_dim`` for q, k and v; no convolution."""

    num_heads: int = 64
    head_dim: int = 96
    conv_kernel: int = 0
    dtype: torch.dtype = torch.bfloat16
    state_dtype: torch.dtype = torch.float32
    chunk_size: int = 256

    kind = "lightning"
    has_conv = False

    @property
    def conv_dim(self) -> int:
        return 0

    def recurrent_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.head_dim, self.head_dim)


@dataclass(frozen=True)
class ShortConvSpec(StateSpec):
    """LFM2's gated short convolution over ``dim`` channels: a conv state only."""

    dim: int = 1024
    conv_kernel: int = 3
    dtype: torch.dtype = torch.bfloat16
    state_dtype: torch.dtype = torch.bfloat16
    chunk_size: int = 1

    kind = "short_conv"

    @property
    def conv_dim(self) -> int:
        return self.dim
