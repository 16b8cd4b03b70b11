"""The backend contract.

A backend is a class with capabilities (data), a reason function, a KV-cache layout, a
metadata builder and a ``torch.ops.attn.*`` op. The class is the static description; an instance
is one layer's implementation (scale, window, soft-cap bound at construction).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, PackageRequirement,
                                   Reason)
from attn_ops.kv_cache import KVCacheLayout
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.spec import AttentionSpec
from attn_ops.tuning import Tuning, default_tuning

__all__ = ["AttentionBackend", "planned_backend"]


class AttentionBackend:
    """Base class of every backend.

    Subclasses set ``name``, ``capabilities`` and ``op`` (a ``torch.ops.attn`` overload taking
    :data:`attn_ops.ops.PAGED_ATTENTION_SCHEMA`), and may override :meth:`build_metadata` to
    turn the common metadata into their own (host-side planning happens there, outside graphs).
    """

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]
    op: ClassVar[torch._ops.OpOverload | None] = None

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        """Every reason this backend cannot serve ``spec`` on ``platform`` (empty: it can)."""
        return cls.capabilities.check(cls.name, spec, platform)

    @classmethod
    def kv_cache_layout(cls, spec: AttentionSpec) -> KVCacheLayout:
        return KVCacheLayout.for_spec(spec)

    @classmethod
    def reads_kv_planes(cls, spec: AttentionSpec) -> bool:
        """Whether the op also reads an NHD cache held as two planes -- a
        ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor seen as ``planes.
        transpose(0, 1)``, K and V each one contiguous block of pages (the layout HF's paged
        cache keeps, a tensor a plane) -- as it reads the interleaved one: true for backends that
        take K and V as the cache's halves, whatever their strides."""
        return cls.kv_cache_layout(spec) is KVCacheLayout.NHD

    @classmethod
    def preferred_block_size(cls, spec: AttentionSpec) -> int:
        return spec.block_size or cls.capabilities.preferred_block_size

    # The kernels this backend runs, for the selection table (composites name each route).
    kernels: ClassVar[str] = ""

    def __init__(self, spec: AttentionSpec, *, tuning: Tuning | None = None,
                 **options) -> None:
        """``options`` come from ``AttentionConfig.backend_options``; the base takes none.
        ``tuning``: the tunables the routes read (default: :func:`~attn_ops.tuning.
        default_tuning`, this machine's entry with the environment's overrides)."""
        if options:
            raise ValueError(f"{self.name} takes no backend options, got {sorted(options)}; "
                             "drop them from AttentionConfig.backend_options")
        self.spec = spec
        self.scale = spec.softmax_scale
        self.tuning = tuning if tuning is not None else default_tuning()

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """This backend's metadata for one step (default: the common metadata itself)."""
        return common

    def metadata_key(self) -> tuple:
        """Layers whose implementations share this key share one built metadata per step
        (see :func:`attn_ops.layers.attention.build_step_metadata`); it holds the tuning's hash, so
        layers tuned differently never share a plan. The default fits the default
        :meth:`build_metadata` (the common metadata itself, whatever the spec); a backend
        whose metadata depends on its spec names those fields here."""
        return (self.name, self.tuning.key)

    @classmethod
    def returns_lse(cls, platform: Platform) -> bool:
        """Whether the op fills ``lse`` on ``platform`` (all built-in backends but
        FLEX_ATTENTION on the CPU)."""
        return True

    def computes_in_fp8(self) -> bool:
        """Whether the kernel computes the attention itself in fp8 over an fp8 cache -- the
        query and the probabilities rounded to e4m3, as FA3's fp8 path does -- rather than
        dequantizing the cache into 16-bit math. Its accuracy is then bounded by the fp8 SQNR
        against the unquantized ideal (``attn_ops.testing.FP8_MIN_SQNR_DB``), not by the
        tolerance policy against REFERENCE over the same cache."""
        return False

    @classmethod
    def cudagraph_support(cls, spec: AttentionSpec, platform: Platform) -> CUDAGraphSupport:
        """How much of a batch this backend serves from a captured CUDA graph for ``spec`` on
        ``platform`` (the declared level on CUDA; CUDA graphs exist nowhere else)."""
        if platform.kind is not PlatformKind.CUDA:
            return CUDAGraphSupport.NEVER
        return cls.capabilities.cudagraph_support

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs: Any) -> Any:
        """This backend's metadata for a batch padded by ``graphs``
        (:class:`attn_ops.cudagraph.CUDAGraphBatch`), every device tensor at an address that
        stays the same for each capture size, and every host value the op reads the same on
        every replay of that size. Call it before capture and before every replay.

        The default serves backends whose op reads only the common metadata's device tensors:
        the padded common metadata itself.
        """
        from attn_ops.platforms import current_platform

        support = self.cudagraph_support(self.spec, current_platform())
        if support < graphs.required_support:
            raise ValueError(
                f"{self.name} supports CUDA graphs at level {support.name}, these graphs need "
                f"{graphs.required_support.name}; run this backend eagerly or pick one with "
                "AttentionConfig(backend=...) that supports it")
        return padded

    def advance_graph_metadata(self, metadata: Any, padded: CommonAttentionMetadata,
                               graphs: Any) -> Any:
        """``metadata`` -- this backend's :meth:`graph_metadata` of the step before -- for
        ``padded``, that step advanced on the device by
        :meth:`~attn_ops.cudagraph.CUDAGraphBatch.advance` (each request one token longer, in
        the page of its last token). The default builds it again; a backend whose metadata
        reads only the buffers advanced in place, or can advance its own tables on the device,
        returns it without host planning."""
        return self.graph_metadata(padded, graphs)

    def op_arguments(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        out: torch.Tensor,
        *,
        lse: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> tuple:
        """The positional arguments of ``self.op`` for one call (the default: the common
        :data:`attn_ops.ops.PAGED_ATTENTION_SCHEMA`). ``metadata`` is what
        :meth:`build_metadata` returned."""
        spec = self.spec
        return (query, kv_cache, metadata.query_start_loc, metadata.seq_lens,
                metadata.block_table, out, lse, sinks, alibi_slopes, k_scale, v_scale,
                self.scale, spec.sliding_window, spec.logits_soft_cap,
                spec.causal and metadata.causal)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: Any,
                out: torch.Tensor, **optional) -> None:
        """Attention of ``query`` over the paged cache, written into ``out`` (and ``lse``).

        ``metadata`` is the step's :class:`CommonAttentionMetadata` (built into this backend's
        own metadata here, eagerly) or what :meth:`build_metadata` already returned (the way
        to call a compiled model: plan outside the graph). ``optional``: ``lse``, ``sinks``,
        ``alibi_slopes``, ``k_scale``, ``v_scale``.
        """
        if isinstance(metadata, CommonAttentionMetadata):
            metadata = self.build_metadata(metadata)
        self.op_for(metadata)(*self.op_arguments(query, kv_cache, metadata, out, **optional))

    def ops(self) -> tuple[torch._ops.OpOverload, ...]:
        """Every op this backend may run a batch on (:meth:`op_for` picks among them)."""
        return (self.op,)

    def op_for(self, metadata: Any) -> torch._ops.OpOverload:
        """The op that runs ``metadata`` (what :meth:`build_metadata` returned): ``self.op``,
        unless a backend hands some batches to another backend's op."""
        return self.op


def planned_backend(name: str, platforms: frozenset[PlatformKind], *,
                    packages: tuple[PackageRequirement, ...] = (),
                    planned_in: str = "") -> type[AttentionBackend]:
    """A backend that is announced but not implemented yet.

    It is listed by the selector and the CLI and always rejected: with the missing packages
    (found without importing them) and a ``not_implemented`` reason.
    """
    from attn_ops.capabilities import HeadDims

    caps = BackendCapabilities(platforms=platforms, dtypes=frozenset(), head_dims=HeadDims(),
                               packages=packages)

    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = []
        if platform.kind not in platforms:
            reasons.append(Reason(name, "platform", f"platform {platform.kind.value} not in "
                                  f"{{{', '.join(sorted(p.value for p in platforms))}}}"))
        reasons += [r for p in packages if (r := p.reason(name, platform)) is not None]
        where = f" (planned: {planned_in})" if planned_in else ""
        reasons.append(Reason(name, "not_implemented", f"{name} is not implemented yet{where}"))
        return reasons

    return type(name, (AttentionBackend,), {
        "name": name, "capabilities": caps, "planned": True,
        "not_supported_reasons": classmethod(not_supported_reasons),
        "__doc__": f"Planned backend {name}{': ' + planned_in if planned_in else ''}.",
    })
