"""COMPOSITE_SM90: FlashAttention 4's prefill beside the best decode kernel, on Hopper.

On sm90 FA4 has the fastest prefill but no split-KV (one CTA per (request, KV head): its decode
collapses at small batches), while FlashInfer's tensor-core decode splits. This backend runs
each part of a step on the kernel the routing policy picks for it
(``routing.composite_decode_route``), in one op, ``torch.ops.attn.composite_sm90_attention``:

* prefill rows: FA4 (its 192-row tile for long prefills, batch mode for uniform prefill parts);
* decode rows: FlashInfer's FA2 tensor-core decode with its split-KV plan; or FA4 in its 64-row
  decode tile, where that was measured faster (about one wave of work, and from two waves at
  long contexts); or TRITON_ATTN's unsplit decode, for short decodes that fill the SMs several
  times over (where TRITON_ATTN takes the spec);
* CUDA graphs: single-token decode sizes through FlashInfer's graph decode, or FA4's decode
  tile for sizes of about one wave (``routing.composite_graph_decode_runs_fa4``); uniform
  batches of several query tokens through FLASH_ATTN's op.

Needs flashinfer-python and flash-attn-4. Planned on the host like FLASHINFER
(:mod:`attn_ops.backends.flashinfer_plan`); executed by FLASHINFER's part loop with FA4 and
TRITON_ATTN runners added. The generic tuning (GPUs other than the H200) keeps only
FlashInfer's decode and FA4's prefill: the crossovers were measured on the H200 only.
"""

from __future__ import annotations

import torch

from attn_ops.backends.flash_attn import FlashAttnBackend, FlashAttnMetadata, GENERATIONS
from attn_ops.backends.flash_attn_kernels import fa4_head_dim_reasons, fa_window, run_fa4
from attn_ops.backends.flashinfer import (PARTS_SCHEMA, FLASHINFER_RUNNERS, FlashInferBackend,
                                          run_parts)
from attn_ops.backends.flashinfer_plan import Planner
from attn_ops.backends.triton_attn import plan_launches, unsplit_decode
from attn_ops.capabilities import BackendCapabilities, CUDAGraphSupport, Reason
from attn_ops.ops import check_nhd_attention_inputs, define_op
from attn_ops.platforms import Platform
from attn_ops.routing import (DeviceFacts, Kernel, composite_decode_route,
                              composite_graph_decode_runs_fa4, fa4_batch, fa4_tile)
from attn_ops.spec import AttentionSpec, Feature, KVCacheDType

__all__ = ["CompositeSM90Backend"]


def _run_fa4_part(p, ws, views, q, k_cache, v_cache, out, lse, float_ws, scale, sliding_window,
                  soft_cap, causal) -> None:
    left, right = fa_window(sliding_window, causal)
    lse_hm = run_fa4(q, k_cache, v_cache, out, *views, p.max_query, p.max_keys, scale, left,
                     right, soft_cap, causal, lse is not None, tile=p.fa4_tile,
                     batch=p.requests if p.fa4_batch else None)
    if lse is not None:
        lse.copy_(lse_hm.t())


def _run_triton_part(p, ws, views, q, k_cache, v_cache, out, lse, float_ws, scale,
                     sliding_window, soft_cap, causal) -> None:
    unsplit_decode(q, k_cache, v_cache, out, lse, *views, scale, sliding_window, soft_cap,
                   causal, p.triton_tile)


_RUNNERS = {**FLASHINFER_RUNNERS, Kernel.FA4: _run_fa4_part, Kernel.TRITON: _run_triton_part}


def _composite_attention(*args) -> None:
    run_parts(*args, runners=_RUNNERS, backend="COMPOSITE_SM90")


def _fake(query, kv_cache, out, lse, *args) -> None:
    check_nhd_attention_inputs("COMPOSITE_SM90", query, kv_cache, out, lse)


composite_sm90_attention = define_op(
    "composite_sm90_attention", PARTS_SCHEMA, _composite_attention, _fake,
    # CPU too, so that the routes can be tested against stand-in kernels on the CPU.
    dispatch_keys=("CPU", "CUDA"))

_FA4 = GENERATIONS[4].package


class CompositeSM90Backend(FlashInferBackend):
    """FA4 prefill + FlashInfer / FA4 / TRITON_ATTN decode per step, on sm90."""

    name = "COMPOSITE_SM90"
    capabilities = BackendCapabilities(**{
        **FlashInferBackend.capabilities.__dict__,
        "kv_cache_dtypes": frozenset({KVCacheDType.AUTO}),  # FA4's fp8 path is sm100-only
        "features": FlashInferBackend.capabilities.features - {Feature.FP8_KV},
        "min_capability": (9, 0), "max_capability": (9, 9),
        "preferred_block_size": 128,  # FA4 loads pages of its KV tile by TMA
        "cudagraph_support": CUDAGraphSupport.UNIFORM_BATCH,
        "packages": (*FlashInferBackend.capabilities.packages, _FA4),
    })
    op = composite_sm90_attention
    kernels = ("prefill: FlashAttention 4; decode: FlashInfer FA2 tensor-core (split-KV), "
               "FA4 64-row tile or TRITON_ATTN, by routing.composite_decode_route")

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        return reasons + fa4_head_dim_reasons(cls.name, spec, platform)

    def __init__(self, spec: AttentionSpec, **kw) -> None:
        super().__init__(spec, **kw)
        from attn_ops.platforms import current_platform
        from attn_ops.registry import get_backend_class

        platform = current_platform()
        self._triton = not get_backend_class("TRITON_ATTN").not_supported_reasons(spec,
                                                                                platform)
        self._fa = FlashAttnBackend(spec, version=4, tuning=self.tuning)

    def _fa4_tile(self, major: int, max_query: int, batch: bool = False):
        spec = self.spec
        return fa4_tile(major, spec.head_dim, spec.v_head_dim, spec.dtype, max_query,
                        spec.num_heads // spec.kv_heads, self.tuning.flash_attn, batch=batch)

    def make_planner(self, device: torch.device) -> Planner:
        spec, tuning, facts = self.spec, self.tuning, DeviceFacts.of(device)
        decode_tile = self._fa4_tile(facts.major, 1)
        triton = self._triton

        def route_decode(requests, max_pages, block_size, query_rows):
            return composite_decode_route(requests, spec.kv_heads, max_pages, block_size,
                                          query_rows, facts, tuning, triton_takes_spec=triton,
                                          fa4_decode_tile=decode_tile)

        def triton_tile_for(requests):
            return plan_launches((spec.head_dim, spec.v_head_dim), (spec.dtype, spec.cache_dtype),
                                 spec.kv_heads, requests, requests, requests, 1, device,
                                 tuning.triton).decode_tile

        return Planner(spec, device, tuning, route_decode, Kernel.FA4, facts=facts,
                       fa4_tile_for=lambda max_q, batch: self._fa4_tile(facts.major, max_q, batch),
                       fa4_batch_for=lambda rows, n, max_q: fa4_batch(rows, n, max_q,
                                                                      tuning.flash_attn),
                       triton_tile_for=triton_tile_for)

    def build_metadata(self, common):
        if isinstance(common, FlashAttnMetadata):
            return common
        return super().build_metadata(common)

    def graph_metadata(self, padded, graphs):
        """Single-token decode graphs: FlashInfer's graph decode, or FA4's decode tile for
        sizes of about one wave; graphs of several query tokens: FLASH_ATTN's op."""
        facts = DeviceFacts.of(graphs.device)
        if graphs.query_len == 1 and not composite_graph_decode_runs_fa4(
                padded.num_reqs, self.spec.kv_heads, facts, self.tuning.composite,
                self._fa4_tile(facts.major, 1)):
            return super().graph_metadata(padded, graphs)
        return self._fa.graph_metadata(padded, graphs)

    def forward(self, query, kv_cache, metadata, out, **optional) -> None:
        if isinstance(metadata, FlashAttnMetadata):
            return self._fa.forward(query, kv_cache, metadata, out, **optional)
        super().forward(query, kv_cache, metadata, out, **optional)

    def op_for(self, metadata):
        return self._fa.op if isinstance(metadata, FlashAttnMetadata) else self.op

    def ops(self):
        return (self.op, self._fa.op)

    def op_arguments(self, query, kv_cache, metadata, out, **optional) -> tuple:
        if isinstance(metadata, FlashAttnMetadata):
            return self._fa.op_arguments(query, kv_cache, metadata, out, **optional)
        return super().op_arguments(query, kv_cache, metadata, out, **optional)
