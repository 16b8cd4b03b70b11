"""TURBOQUANT: standard attention over a TurboQuant KV cache (``AttentionSpec(kv_cache_dtype=
"turboquant_4bit_nc", ...)``: :data:`attn_ops.spec.TURBOQUANT_KV_DTYPES`), the only backend of
those caches.

Its layer writes each step's K and V with ``torch.ops.attn.turboquant_cache_update`` and
attends with ``torch.ops.attn.turboquant_attention`` (:mod:`.ops`): on GPUs one Triton write
and TRITON_ATTN's kernels reading the slots; on the CPU their torch bodies. vLLM serves the
same formats for decoder layers without sliding windows, sinks, ALiBi or soft-capping; so does
this backend. vLLM also keeps the first and last two layers of a dense model unquantized
(:func:`boundary_layers`; ``ModelConfig.kv_cache_dtype`` applies it: those layers' specs get
``kv_cache_dtype="auto"`` and select another backend).
"""

from __future__ import annotations

import dataclasses

import torch

from attn_ops.backend import AttentionBackend
from attn_ops.backends.triton_attn import _TRITON, TritonAttnBackend
from attn_ops.backends.turboquant.ops import turboquant_attention
from attn_ops.capabilities import BackendCapabilities, CUDAGraphSupport, HeadDims, Reason
from attn_ops.platforms import PlatformKind
from attn_ops.spec import TURBOQUANT_KV_DTYPES, AttentionType

__all__ = ["TurboQuantBackend", "boundary_layers"]


def boundary_layers(num_layers: int, hybrid: bool = False) -> frozenset[int]:
    """The attention layers vLLM leaves unquantized under a TurboQuant preset: the first and
    last ``min(2, num_layers // 2)`` of a dense model (without them GSM8K drops ~30 points on
    Qwen3-4B at 3 bits, vLLM reports), none of a hybrid (recurrent-state) model."""
    if hybrid:
        return frozenset()
    n = min(2, num_layers // 2)
    return frozenset({*range(n), *range(num_layers - n, num_layers)})


class TurboQuantBackend(TritonAttnBackend):
    """vLLM's TurboQuant formats (``backends/turboquant/format.py``), causal decoder layers,
    head dims the formats take (the spec checks them: powers of two for the rotated presets,
    multiples of 8 at 3 bits). On GPUs TRITON_ATTN's kernels and plans, reading the format in
    registers (split-KV decodes, tiled prefills, CUDA graphs of uniform batches); on the CPU
    the ops' torch bodies (fp64 there: the tests' oracle)."""

    name = "TURBOQUANT"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CPU, PlatformKind.CUDA}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        head_dims=HeadDims(multiple_of=2, min=8, max=256),
        kv_cache_dtypes=TURBOQUANT_KV_DTYPES,
        attn_types=frozenset({AttentionType.DECODER}),
        min_capability=(8, 0),
        cudagraph_support=CUDAGraphSupport.UNIFORM_BATCH,  # (TRITON_ATTN's: no device value)
    )
    op = turboquant_attention
    kernels = ("attn.turboquant_cache_update (one Triton launch) + attn.turboquant_attention "
               "(TRITON_ATTN's kernels over the slots; the CPU: the cache read back, then "
               "REFERENCE's definition)")

    @classmethod
    def not_supported_reasons(cls, spec, platform) -> list:
        """TRITON_ATTN's rules on GPUs (Triton installed, fp64 refused: its kernels compute in
        fp32); none of its interpreter rules on the CPU, where the torch bodies run."""
        reasons = AttentionBackend.not_supported_reasons.__func__(cls, spec, platform)
        if platform.kind is PlatformKind.CUDA:
            if (missing := _TRITON.reason(cls.name, platform)) is not None:
                reasons.append(missing)
            if spec.dtype == torch.float64:
                reasons.append(Reason(cls.name, "dtype", "dtype=float64 runs on the CPU only "
                                      "(the GPU kernels compute in fp32)",
                                      "use fp32, bf16 or fp16"))
        return reasons

    @classmethod
    def cudagraph_support(cls, spec, platform) -> CUDAGraphSupport:
        return AttentionBackend.cudagraph_support.__func__(cls, spec, platform)

    def _plan(self, num_decodes, num_decode_tokens, num_tokens, max_seq_len, device):
        """TRITON_ATTN's plan (splits, fused combine, launch order) with K/V of the query's
        dtype -- the slots are dequantized into them in registers -- in TurboQuant's own tiles
        (``Tuning.triton.turboquant_*_tile``: narrower key blocks, fitted to the device), its
        4-bit fields read as planes and its codes gathered along a slot's bytes where
        ``Tuning.triton.turboquant_planes`` / ``turboquant_coalesced``."""
        from attn_ops.backends.triton_attn import plan_launches
        from attn_ops.platforms import shared_memory_per_block
        from attn_ops.routing import triton_fit_tile, triton_head_tiles

        spec, t = self.spec, self.tuning.triton
        plan = plan_launches((spec.head_dim, spec.v_head_dim), (spec.dtype, spec.dtype),
                             spec.kv_heads, num_decodes, num_decode_tokens, num_tokens,
                             max_seq_len, device, t)
        decode, prefill = t.turboquant_decode_tile, t.turboquant_prefill_tile
        if device.type == "cuda":
            d_p, dv_p = triton_head_tiles(spec.head_dim, spec.v_head_dim, 1)
            smem, b = shared_memory_per_block(device), spec.dtype.itemsize
            decode = triton_fit_tile(decode, d_p, dv_p, b, b, smem)
            prefill = triton_fit_tile(prefill, d_p, dv_p, b, b, smem)
        return dataclasses.replace(plan, decode_tile=decode, prefill_tile=prefill,
                                   turboquant_planes=t.turboquant_planes,
                                   turboquant_coalesced=t.turboquant_coalesced)

    def op_arguments(self, query, kv_cache, metadata, out, *, lse=None, **unused) -> tuple:
        return (query, kv_cache, metadata.query_start_loc, metadata.seq_lens,
                metadata.block_table, metadata.plan, out, lse, self.scale,
                self.spec.kv_cache_dtype.value)
