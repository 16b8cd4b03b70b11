"""TRITON_MLA: MLA with our Triton kernel for the absorbed form.

Decodes, speculative decodes and short prefills (the absorbed part of a step) run
:func:`~attn_ops.backends.mla.triton_mla_kernels.mla_decode_kernel` over the paged latent cache:
split-KV, the split count and tile from :func:`attn_ops.routing.mla_decode_launch`, partials
merged by TRITON_ATTN's split combine. The MHA part (longer prefills and their chunked context)
runs the kernel :func:`attn_ops.routing.mla_prefill_kernel` picks.

CUDA graphs: uniform decode batches; the launch is fixed per capture size from the graphs'
longest request, the lengths stay on the device.
"""

from __future__ import annotations

import torch

from attn_ops.backends.mla.common import (MLABackend, MLAMetadata, check_mla_inputs,
                                          define_mla_op)
from attn_ops.backends.triton_attn import TritonAttnBackend, interpreter_reasons
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, HeadDims, MultipleOf,
                                   Reason)
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.platforms import Platform, PlatformKind, shared_memory_per_block
from attn_ops.routing import (DeviceFacts, MLADecodeLaunch, combine_split_block,
                              mla_decode_launch, pow2, triton_head_tiles)
from attn_ops.spec import AttentionSpec, Feature, KVCacheDType

__all__ = ["TritonMLABackend", "absorbed_triton", "triton_mla_launch"]

def absorbed_triton(ql, q_pe, latent_cache, query_start_loc, seq_lens, block_table, out,
                    kv_scale, scale, launch: MLADecodeLaunch):
    """The absorbed form in ``launch``: latent outputs ``out`` [rows, heads, rank]. Returns
    the compiled decode kernel Triton launched (its registers, spills and shared memory, for
    the benchmarks; None in the interpreter)."""
    from attn_ops.backends.mla.triton_mla_kernels import mla_decode_kernel
    from attn_ops.backends.triton_attn_kernels import combine_splits_kernel

    rows, heads, rank = ql.shape
    rope = q_pe.shape[2]
    num_reqs = seq_lens.shape[0]
    rank_p, rope_p = triton_head_tiles(rank, rope, latent_cache.dtype.itemsize)
    splits = launch.splits
    fp8 = latent_cache.dtype == torch.float8_e4m3fn
    dummy = out
    part_o = part_lse = dummy
    if splits > 1:
        part_o = torch.empty(rows, heads, splits, rank_p, dtype=torch.float32, device=ql.device)
        part_lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=ql.device)
    grid = (num_reqs, -(-heads // launch.heads) * launch.value_parts, splits)
    kernel = mla_decode_kernel[grid](
        ql, q_pe, latent_cache, out, part_o, part_lse, query_start_loc, seq_lens, block_table,
        kv_scale if fp8 else dummy, num_reqs, scale, latent_cache.shape[0],
        block_table.shape[1], ql.shape[0],
        ql.stride(0), ql.stride(1), q_pe.stride(0), q_pe.stride(1), out.stride(0),
        out.stride(1), latent_cache.stride(0), latent_cache.stride(1), block_table.stride(0),
        H=heads, HEADS=launch.heads, Q_ROWS=launch.query_rows, RANK=rank, RANK_P=rank_p,
        ROPE=rope, ROPE_P=rope_p, PAGE=latent_cache.shape[1], BLOCK_N=launch.keys,
        NUM_SPLITS=splits, FP8=fp8,
        PRECISION="ieee" if ql.dtype == torch.float32 else "tf32",
        VALUE_PARTS=launch.value_parts,
        num_warps=launch.warps, num_stages=launch.stages)
    if splits > 1:
        combine_splits_kernel[(rows, heads)](
            out, dummy, part_o, part_lse, query_start_loc, dummy, kv_scale if fp8 else dummy,
            num_reqs, out.stride(0), out.stride(1), 0,
            HQ=heads, NUM_SPLITS=splits, SPLITS_P=pow2(splits), DV=rank, DV_P=rank_p,
            HAS_SINKS=False, FP8=fp8, WRITE_LSE=False,
            SPLIT_BLOCK=combine_split_block(splits, rank_p), ALL_ROWS=False,
            num_warps=4)
    return kernel


def triton_mla_launch(spec: AttentionSpec, requests: int, max_query_len: int, max_seq_len: int,
                      device: torch.device, t) -> MLADecodeLaunch:
    """:func:`routing.mla_decode_launch` for ``spec``'s latent rows on ``device`` (its SMs; on
    a GPU, its shared memory)."""
    itemsize = 1 if spec.kv_cache_dtype.is_fp8 else spec.dtype.itemsize
    rank_p, rope_p = triton_head_tiles(spec.kv_lora_rank, spec.qk_rope_head_dim, itemsize)
    row = rank_p + rope_p
    smem = shared_memory_per_block(device) if device.type == "cuda" else 0
    return mla_decode_launch(spec.num_heads, requests, max_query_len, max_seq_len,
                             DeviceFacts.of(device).num_sms, t, row * itemsize,
                             row * spec.dtype.itemsize if itemsize < spec.dtype.itemsize else 0,
                             smem, rank_p)


def _check(*args) -> None:
    check_mla_inputs(*args)
    q, latent_cache = args[0], args[3]
    if latent_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"TRITON_MLA: latent_cache dtype {latent_cache.dtype} must be the "
                         f"query's ({q.dtype}) or float8_e4m3fn")
    if latent_cache.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("TRITON_MLA: latent_cache and q need a contiguous last dim; pass "
                         ".contiguous() tensors")


def _absorbed(*args) -> None:
    absorbed_triton(*args[:-1], args[-1].decode)


triton_mla_attention = define_mla_op("triton_mla_attention", _absorbed, check=_check)


class TritonMLABackend(MLABackend):
    """Split-KV absorbed decode in Triton on any GPU Triton runs on (and the CPU interpreter
    for tests); fp8 e4m3 latents; any latent dims and page size."""

    name = "TRITON_MLA"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA, PlatformKind.ROCM, PlatformKind.CPU}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        head_dims=HeadDims(),
        kv_cache_dtypes=frozenset({KVCacheDType.AUTO, KVCacheDType.FP8_E4M3}),
        block_sizes=(MultipleOf(1),),
        preferred_block_size=64,
        features=frozenset({Feature.MLA, Feature.DIFF_HEAD_DIM_V, Feature.FP8_KV}),
        min_capability=(8, 0),
        cudagraph_support=CUDAGraphSupport.UNIFORM_BATCH,
        packages=TritonAttnBackend.capabilities.packages,
    )
    op = triton_mla_attention

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        if spec.use_mla:
            reasons += interpreter_reasons(cls.name, spec, platform,
                                           "; REFERENCE_MLA is the CPU path")
        return reasons

    def decode_launch(self, requests: int, max_query_len: int, max_seq_len: int,
                      device: torch.device) -> MLADecodeLaunch:
        return triton_mla_launch(self.spec, requests, max_query_len, max_seq_len, device,
                                 self.tuning.mla)

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> MLAMetadata:
        """The plan fixed per capture size, the launch from the graphs' longest request
        (:meth:`MLABackend.fixed_graph_metadata`)."""
        return self.fixed_graph_metadata(padded, graphs)
