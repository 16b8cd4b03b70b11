"""MLA backends other engines ship that attn_ops does not run: listed by the selector and the
CLI so a user sees each one with its exact cause, never selected.

Each is an MLA-only backend whose reasons are the platform and compute-capability mismatch
(where there is one) and its cause. Where the kernel has providers
(:mod:`attn_ops.providers`: FlashMLA, FlashAttention 3) the reasons also say which provider
was found here or why none is usable; the cause is then that attn_ops has no glue for it yet.
The other causes are facts about the packages as published
(``../shared/reference/mla_study.md``): re-check them when upgrading.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from attn_ops.backends.mla.common import MLABackend
from attn_ops.backends.mla.sparse import sparse_reasons
from attn_ops.capabilities import BackendCapabilities, HeadDims, Reason
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.providers import FLASHMLA as FLASHMLA_PROVIDERS, KernelProviders
from attn_ops.spec import AttentionSpec, Feature, KVCacheDType

__all__ = ["CUTLASS_MLA", "FLASHINFER_MLA_TRTLLM"]


class _Unavailable(MLABackend):
    cause: ClassVar[str]
    hint: ClassVar[str] = ""

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)  # (a missing provider's too)
        cause, providers = cls.cause, cls.kernel_providers
        if providers is not None and not platform.assume_packages and providers.found():
            cause = f"{providers.describe()} is usable here, but {cause}"
        return reasons + [Reason(cls.name, "kernels_unavailable", cause, cls.hint)]


class _UnavailableSparse(_Unavailable):
    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        return super().not_supported_reasons(spec, platform) + sparse_reasons(cls.name, spec)


def _unavailable(name: str, cause: str, hint: str, *, min_capability=None,
                 max_capability=None, sparse: bool = False,
                 providers: KernelProviders | None = None) -> type[MLABackend]:
    features = {Feature.MLA, Feature.DIFF_HEAD_DIM_V, Feature.FP8_KV}
    caps = BackendCapabilities(platforms=frozenset({PlatformKind.CUDA}),
                               dtypes=frozenset({torch.bfloat16, torch.float16}),
                               head_dims=HeadDims(), kv_cache_dtypes=frozenset(KVCacheDType),
                               features=frozenset(features | {Feature.SPARSE_MLA} if sparse
                                                  else features),
                               min_capability=min_capability, max_capability=max_capability)
    base = _UnavailableSparse if sparse else _Unavailable
    return type(name, (base,), {"name": name, "capabilities": caps, "cause": cause,
                                "hint": hint, "kernel_providers": providers, "__doc__": cause})


_FI = "FLASHINFER_MLA (sm90: FlashInfer's fa3 MLA) or TRITON_MLA"

_NO_GLUE = "attn_ops does not run it yet (no glue for its kernels: {})"

CUTLASS_MLA = _unavailable(
    "CUTLASS_MLA", "CUTLASS MLA is a Blackwell (sm100) kernel compiled into vLLM's own "
    "extension (vllm._C), whose wheel pins torch 2.14", f"on Hopper use {_FI}",
    min_capability=(10, 0))

FLASHINFER_MLA_TRTLLM = _unavailable(
    "FLASHINFER_MLA_TRTLLM", "FlashInfer's trtllm-gen MLA decode runs on Blackwell (sm100) "
    "only", f"on Hopper use {_FI}", min_capability=(10, 0))
