"""FLASH_ATTN_DIFFKV: models whose V head dim differs from the QK head dim (e.g. 192 / 128).

The cache stores both in one packed layout, ``[num_blocks, block_size, num_kv_heads,
head_dim + head_dim_v]`` (K then V per token; ``attn_ops.kv_cache.KVCacheLayout.NHD_PACKED``),
written by the common ``torch.ops.attn.kv_cache_update``. On the CPU the attention runs through
CPU_ATTN's kernel (which reads the packed layout in place); on CUDA through FlashAttention 4,
which takes K and V of different head dims as two strided views of the packed cache.

Status: the CPU path is tested against REFERENCE in the registry-generated matrix (CI); the
CUDA path on the H200 -- the matrix at real sizes (head dims 64 / 80) and whole-model CUDA graphs,
full and piecewise (README feature table). Where FlashAttention 4 is missing, the selector's next
choice for such specs is TRITON_ATTN, whose kernel takes different QK and V head dims over the
same packed cache.
"""

from __future__ import annotations

import torch

from attn_ops.backend import AttentionBackend
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, HeadDims,
                                   PackageRequirement, Reason)
from attn_ops.kv_cache import KVCacheLayout, split_kv_cache
from attn_ops.ops import PAGED_ATTENTION_SCHEMA, check_paged_attention_inputs, define_op
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.spec import AttentionSpec, AttentionType, Feature, KVCacheDType

from attn_ops.backends.flash_attn_kernels import (fa4_head_dim_reasons, fa_window, finish_lse,
                                                  run_fa4)

__all__ = ["FlashAttnDiffKVBackend"]

_FA4 = PackageRequirement("flash-attn-4", "flash_attn", "4.0.0b1")


def _diffkv_attention(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse, sinks,
                      alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap,
                      causal) -> None:
    if query.device.type == "cpu":
        from attn_ops.backends.cpu_attn import cpu_paged_attention

        return cpu_paged_attention(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                   lse, sinks, alibi_slopes, k_scale, v_scale, scale,
                                   sliding_window, soft_cap, causal)
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)
    k_cache, v_cache = split_kv_cache(kv_cache, query.shape[2], out.shape[2])
    left, right = fa_window(sliding_window, causal)
    out.zero_()  # padding rows stay zero (their count is on the device: no sync to find it)
    # Host bounds without a sync: the longest query is at most every token, the longest context
    # at most the block table's reach (FA4 sizes its grid with them; lengths are read on device).
    lse_hm = run_fa4(query, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                     query.shape[0], block_table.shape[1] * k_cache.shape[1], scale, left,
                     right, soft_cap, causal, lse is not None or sinks is not None, padded=True)
    # (FA4's own tile: its sm90 tiles here are tuned for head dims 128 / 128 only)
    finish_lse(out, lse, sinks, lse_hm)


def _fake(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse, sinks,
          alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap, causal) -> None:
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)


flash_attn_diffkv_attention = define_op("flash_attn_diffkv_attention", PAGED_ATTENTION_SCHEMA,
                                        _diffkv_attention, _fake, dispatch_keys=("CPU", "CUDA"),
                                        fp8_output_at=5)


class FlashAttnDiffKVBackend(AttentionBackend):
    """Different QK / V head dims over the packed cache: CPU_ATTN's kernel or FA4."""

    name = "FLASH_ATTN_DIFFKV"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CPU, PlatformKind.CUDA}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        head_dims=HeadDims(multiple_of=8, min=8, max=256),
        kv_cache_dtypes=frozenset({KVCacheDType.AUTO}),
        features=frozenset({Feature.DIFF_HEAD_DIM_V, Feature.SLIDING_WINDOW, Feature.SOFT_CAP,
                            Feature.SINKS, Feature.NON_CAUSAL}),
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER_ONLY}),
        min_capability=(9, 0),
        cudagraph_support=CUDAGraphSupport.UNIFORM_BATCH,  # its CUDA op reads no host values
    )
    op = flash_attn_diffkv_attention

    @classmethod
    def kv_cache_layout(cls, spec: AttentionSpec) -> KVCacheLayout:
        return KVCacheLayout.NHD_PACKED

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        if platform.kind is PlatformKind.CUDA:
            if spec.dtype == torch.float32:
                reasons.append(Reason(cls.name, "dtype", "dtype=float32 is CPU-only here; "
                                      "FlashAttention 4 takes float16/bfloat16"))
            if (r := _FA4.reason(cls.name, platform)) is not None:
                reasons.append(r)
            reasons += fa4_head_dim_reasons(cls.name, spec, platform)
        elif platform.kind is PlatformKind.CPU:
            from attn_ops.registry import get_backend_class

            reasons += [Reason(cls.name, r.code, r.message, r.hint)
                        for r in get_backend_class("CPU_ATTN").not_supported_reasons(spec,
                                                                                   platform)]
        return reasons
