"""MLA backends other engines ship whose kernels cannot run on this stack: listed by the
selector and the CLI so a user sees each one with its exact cause, never selected.

Each is an MLA-only backend whose reasons are the platform and compute-capability mismatch
(where there is one) and the cause its kernels are out of reach. The causes are facts about the
packages as published (``../shared/reference/mla_study.md``): re-check them when upgrading.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from attn_ops.backends.mla.common import MLABackend
from attn_ops.backends.mla.sparse import sparse_reasons
from attn_ops.capabilities import BackendCapabilities, HeadDims, Reason
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.spec import AttentionSpec, Feature, KVCacheDType

__all__ = ["CUTLASS_MLA", "FLASHINFER_MLA_TRTLLM", "FLASHMLA", "FLASHMLA_SPARSE",
           "FLASH_ATTN_MLA"]


class _Unavailable(MLABackend):
    cause: ClassVar[str]
    hint: ClassVar[str] = ""

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        return reasons + [Reason(cls.name, "kernels_unavailable", cls.cause, cls.hint)]


class _UnavailableSparse(_Unavailable):
    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        return super().not_supported_reasons(spec, platform) + sparse_reasons(cls.name, spec)


def _unavailable(name: str, cause: str, hint: str, *, min_capability=None,
                 max_capability=None, sparse: bool = False) -> type[MLABackend]:
    features = {Feature.MLA, Feature.DIFF_HEAD_DIM_V, Feature.FP8_KV}
    caps = BackendCapabilities(platforms=frozenset({PlatformKind.CUDA}),
                               dtypes=frozenset({torch.bfloat16, torch.float16}),
                               head_dims=HeadDims(), kv_cache_dtypes=frozenset(KVCacheDType),
                               features=frozenset(features | {Feature.SPARSE_MLA} if sparse
                                                  else features),
                               min_capability=min_capability, max_capability=max_capability)
    base = _UnavailableSparse if sparse else _Unavailable
    return type(name, (base,), {"name": name, "capabilities": caps, "cause": cause,
                                "hint": hint, "__doc__": cause})


_FI = "FLASHINFER_MLA (sm90: FlashInfer's fa3 MLA) or TRITON_MLA"

FLASHMLA = _unavailable(
    "FLASHMLA", "FlashMLA is not installable with torch 2.11 + CUDA 13: 'flash-mla' on PyPI "
    "is an empty placeholder, 'sgl-flash-mla' and 'tokenspeed-flashmla' need torch 2.14, "
    "and FlashMLA's own 2026-09 release dropped Hopper", f"use {_FI}",
    min_capability=(9, 0))

FLASHMLA_SPARSE = _unavailable(
    "FLASHMLA_SPARSE", "FlashMLA's sparse kernels ship in the same packages as FLASHMLA "
    "(none installable with torch 2.11 + CUDA 13)", "use TRITON_MLA_SPARSE",
    min_capability=(9, 0), sparse=True)

CUTLASS_MLA = _unavailable(
    "CUTLASS_MLA", "CUTLASS MLA is a Blackwell (sm100) kernel compiled into vLLM's own "
    "extension (vllm._C), whose wheel pins torch 2.14", f"on Hopper use {_FI}",
    min_capability=(10, 0))

FLASHINFER_MLA_TRTLLM = _unavailable(
    "FLASHINFER_MLA_TRTLLM", "FlashInfer's trtllm-gen MLA decode runs on Blackwell (sm100) "
    "only", f"on Hopper use {_FI}", min_capability=(10, 0))

FLASH_ATTN_MLA = _unavailable(
    "FLASH_ATTN_MLA", "FlashAttention 3 (its q_v path runs the absorbed form) is not on "
    "PyPI for torch 2.11 + CUDA 13, and FlashAttention 4 on sm90 takes head dims <= 256, "
    "not the absorbed form's V width 512", f"use {_FI}; FA4 serves the MHA prefill",
    min_capability=(9, 0), max_capability=(9, 0))
