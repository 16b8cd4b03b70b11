"""FLASH_ATTN: FlashAttention over the paged cache -- FA4 (CuTe-DSL kernels, ``flash_attn.cute``),
else FA3 (sm90), else FA2, whichever is installed and runs here (newest first;
``AttentionConfig(backend_options={"version": 2})`` forces one).

One varlen call serves a whole step: ``cu_seqlens_q`` from the batch, ``seqused_k`` the cached
lengths, ``page_table`` the block table. The builder routes the call (FA4's tile:
:func:`attn_ops.routing.fa4_tile`) and encodes it with the host bounds as a
:class:`FlashAttnPlan`. On sm100+ FA4 picks split-KV itself; on sm90 it has none, so its decode
trails split decodes at small batches -- there the selector prefers COMPOSITE_SM90, which runs
FA4's prefills beside FlashInfer's and our decodes. Kernels and semantics:
:mod:`attn_ops.backends.flash_attn_kernels`.

FA3 comes from FlashAttention's hopper build or vLLM's ``vllm_flash_attn``
(:data:`attn_ops.providers.FA3`, whichever is usable here). FA2 and both FA3 providers' glue is
tested on the CPU against stand-in modules with the same call signatures that implement
FlashAttention's documented semantics (``tests/test_flash_attn_glue.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_ops.backend import AttentionBackend
from attn_ops.backends.flash_attn_kernels import (fa3_fp8_query, fa3_takes_sinks,
                                                  fa4_head_dim_reasons, fa_window, finish_lse,
                                                  run_fa2, run_fa3, run_fa4)
from attn_ops.backends.step_schedules import new_schedule, restart_schedule
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, HeadDims, MultipleOf,
                                   PackageRequirement, Reason)
from attn_ops.kv_cache import nhd_kv_halves
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.ops import check_nhd_attention_inputs, define_op
from attn_ops.plan_codec import PlanCodec
from attn_ops.platforms import Platform, PlatformKind, current_platform
from attn_ops.providers import FA3, KernelProviders
from attn_ops.routing import DeviceFacts, fa4_tile
from attn_ops.spec import AttentionSpec, AttentionType, Feature, KVCacheDType
from attn_ops.tuning import FA4Tile

__all__ = ["FlashAttnBackend", "FlashAttnMetadata", "FlashAttnPlan", "GENERATIONS", "PLAN",
           "installed_generations"]


@dataclass(frozen=True)
class FlashAttnPlan:
    """One call: the FlashAttention ``version``, FA4's ``tile`` (None: its own), the bounds FA
    sizes its grid with, and ``num_tokens`` real rows (None: known on the device only -- a
    CUDA-graph batch, whose padding rows FA leaves unwritten). FA3: ``schedule``, the step's
    handle for its scheduler metadata (:mod:`attn_ops.backends.step_schedules`; 0: none),
    and its split count ``num_splits`` (0: its heuristic)."""

    version: int
    max_query: int
    max_keys: int
    num_tokens: int | None
    tile: FA4Tile | None
    schedule: int = 0
    num_splits: int = 0


PLAN = PlanCodec(FlashAttnPlan)


@dataclass(frozen=True, eq=False)
class FlashAttnMetadata:
    """The device tables of one call and its encoded :class:`FlashAttnPlan` (CPU)."""

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqused_k: torch.Tensor
    page_table: torch.Tensor
    plan: torch.Tensor
    causal: bool = True


def _check(query, kv_cache, out, lse, plan, k_scale, v_scale):
    check_nhd_attention_inputs("FLASH_ATTN", query, kv_cache, out, lse)
    if kv_cache.dtype == torch.float8_e4m3fn:
        if k_scale is None or v_scale is None or query.dtype != torch.bfloat16:
            raise ValueError(f"FLASH_ATTN: an fp8 cache needs k_scale and v_scale (got "
                             f"{k_scale is not None} / {v_scale is not None}) and a bfloat16 "
                             f"query (got {query.dtype}); pass the layer's scales")
    elif kv_cache.dtype != query.dtype:
        raise ValueError(f"FLASH_ATTN: kv_cache.dtype={kv_cache.dtype} differs from "
                         f"query.dtype={query.dtype}; store the cache in the model dtype or in "
                         "float8_e4m3fn with scales")
    if plan.device.type != "cpu" or plan.dtype != torch.int64 or plan.shape != (PLAN.length,):
        raise ValueError(f"plan must be a CPU int64 [{PLAN.length}] tensor "
                         f"(FlashAttnMetadata.plan), got {plan.dtype} {tuple(plan.shape)} on "
                         f"{plan.device}")


def _flash_attn_attention(query, kv_cache, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                          page_table, plan, sinks, alibi_slopes, k_scale, v_scale, scale,
                          sliding_window, soft_cap, causal) -> None:
    _check(query, kv_cache, out, lse, plan, k_scale, v_scale)
    p = PLAN.decode(plan)
    padded = p.num_tokens is None
    if padded:  # a CUDA-graph batch: its real token count is known on the device only
        out.zero_()  # FlashAttention leaves the rows of requests without queries unwritten
        if lse is not None:
            lse.zero_()
    k_cache, v_cache = nhd_kv_halves(kv_cache)
    # sinks inside FA3's kernel where its provider takes them (bf16 sinks only: vLLM's build
    # takes no other dtype, and rounding them would move the output) and no LSE is asked for
    # (the LSE the op returns is that of the scores alone), else from the LSE after the kernel
    native_sinks = (p.version == 3 and sinks is not None and lse is None
                    and sinks.dtype == torch.bfloat16 and fa3_takes_sinks())
    after = None if native_sinks else sinks
    need_lse = lse is not None or after is not None
    left, right = fa_window(sliding_window, causal)
    if p.version == 4:
        lse_hm = run_fa4(query, k_cache, v_cache, out, cu_seqlens_q, seqused_k, page_table,
                         p.max_query, p.max_keys, scale, left, right, soft_cap, causal, need_lse,
                         tile=p.tile, padded=padded)
    elif p.version == 3:
        lse_hm = run_fa3(query, k_cache, v_cache, out, cu_seqlens_q, seqused_k, page_table,
                         p.max_query, p.max_keys, scale, left, right, soft_cap, causal, need_lse,
                         sinks if native_sinks else None, schedule=p.schedule,
                         num_splits=p.num_splits, k_scale=k_scale, v_scale=v_scale,
                         padded=padded)
    else:
        lse_hm = run_fa2(query, k_cache, v_cache, out, cu_seqlens_q, cu_seqlens_k, page_table,
                         p.max_query, p.max_keys, scale, left, right, soft_cap, alibi_slopes,
                         causal, need_lse)
    finish_lse(out, lse, after, lse_hm)
    if not padded and p.num_tokens < out.shape[0]:  # padding rows are zero, like REFERENCE's
        out[p.num_tokens:].zero_()
        if lse is not None:
            lse[p.num_tokens:].zero_()


def _fake(query, kv_cache, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, plan,
          sinks, alibi_slopes, k_scale, v_scale, *args) -> None:
    _check(query, kv_cache, out, lse, plan, k_scale, v_scale)


flash_attn_attention = define_op(
    "flash_attn_attention",
    "(Tensor query, Tensor kv_cache, Tensor(a!) out, Tensor(b!)? lse, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, Tensor seqused_k, Tensor page_table, Tensor plan, Tensor? sinks, "
    "Tensor? alibi_slopes, Tensor? k_scale, Tensor? v_scale, float scale, int? sliding_window, "
    "float? soft_cap, bool causal) -> ()",
    # CPU too, so that the FA2/FA3 glue can be tested against stand-in modules on the CPU.
    _flash_attn_attention, _fake, dispatch_keys=("CPU", "CUDA"))


# FlashAttention generations, newest first: distribution, module, oldest version, compute
# capabilities it runs on, page-size rule, whether it takes ALiBi slopes.
@dataclass(frozen=True)
class _Generation:
    package: PackageRequirement | KernelProviders
    min_capability: tuple[int, int]
    max_capability: tuple[int, int]
    block_multiple: int
    preferred_block_size: int
    alibi: bool


GENERATIONS = {
    4: _Generation(PackageRequirement("flash-attn-4", "flash_attn", "4.0.0b1"), (8, 0), (12, 9),
                   1, 128, False),  # FA4 reads pages of its KV tile by TMA
    3: _Generation(FA3, (9, 0), (9, 0), 1, 16, False),  # its hopper build or vLLM's
    2: _Generation(PackageRequirement("flash-attn", "flash_attn", "2.6", max_version="3"),
                   (8, 0), (12, 9), 256, 256, True),  # paged KV needs pages of k x 256
}


def installed_generations(platform: Platform) -> list[int]:
    """FlashAttention generations installed and able to run on ``platform``, newest first."""
    cap = platform.capability
    return [v for v, g in GENERATIONS.items() if g.package.reason("", platform) is None
            and (cap is None or g.min_capability <= cap <= g.max_capability)]


class FlashAttnBackend(AttentionBackend):
    """FlashAttention (4, else 3, else 2) varlen over the paged NHD cache."""

    name = "FLASH_ATTN"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=HeadDims(multiple_of=8, min=8, max=256),
        # fp8: FA3's e4m3 kernel (narrowed per generation in not_supported_reasons; FA4's fp8
        # path is sm100-only)
        kv_cache_dtypes=frozenset({KVCacheDType.AUTO, KVCacheDType.FP8_E4M3}),
        block_sizes=(MultipleOf(1),),  # narrowed per generation in not_supported_reasons
        preferred_block_size=128,
        features=frozenset({Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.SINKS,
                            Feature.NON_CAUSAL, Feature.ALIBI, Feature.FP8_KV}),
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER_ONLY}),
        min_capability=(8, 0),
        cudagraph_support=CUDAGraphSupport.UNIFORM_BATCH,
    )
    op = flash_attn_attention
    kernels = "FlashAttention 4 (else 3, else 2), one varlen call per step"

    @classmethod
    def generation(cls, platform: Platform) -> int | None:
        found = installed_generations(platform)
        return found[0] if found else None

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform,
                              version: int | None = None) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        version = version or cls.generation(platform)
        if version is None:
            reasons.append(Reason(cls.name, "package_missing",
                                  "no FlashAttention is installed that runs here (flash-attn-4 "
                                  "for sm80-sm12x, FlashAttention 3 for sm90 from flash-attn-3 "
                                  "or vLLM's vllm_flash_attn, flash-attn 2.x for sm80+)",
                                  "pip install flash-attn-4"))
            return reasons
        gen = GENERATIONS[version]
        if version == 4:
            reasons += fa4_head_dim_reasons(cls.name, spec, platform)
        if spec.use_alibi and not gen.alibi:
            reasons.append(Reason(cls.name, "feature:alibi",
                                  f"alibi is not supported by FlashAttention {version}",
                                  "FlashAttention 2 takes ALiBi slopes"))
        if spec.use_alibi and not spec.causal:
            reasons.append(Reason(cls.name, "feature:alibi_non_causal",
                                  "non-causal ALiBi is not supported (FlashAttention biases by "
                                  "-slope*|i-j|, REFERENCE by slope*(j-i))"))
        if spec.kv_cache_dtype.is_fp8 and version != 3:
            reasons.append(Reason(cls.name, "kv_cache_dtype",
                                  f"kv_cache_dtype={spec.kv_cache_dtype.value}: FlashAttention "
                                  f"{version} takes no fp8 cache here (FA3 does, on sm90)",
                                  "use FLASHINFER or TRITON_ATTN for fp8 caches"))
        elif spec.kv_cache_dtype.is_fp8 and spec.dtype != torch.bfloat16:
            reasons.append(Reason(cls.name, "dtype",
                                  f"dtype={spec.dtype} with an fp8 cache: FA3's fp8 kernel "
                                  "writes bfloat16 outputs", "run the model in bfloat16"))
        if spec.block_size is not None and spec.block_size % gen.block_multiple:
            reasons.append(Reason(cls.name, "block_size",
                                  f"block_size={spec.block_size} is not a multiple of "
                                  f"{gen.block_multiple} (FlashAttention {version} paged KV)",
                                  f"leave block_size=None to use {gen.preferred_block_size}"))
        return reasons

    @classmethod
    def preferred_block_size(cls, spec: AttentionSpec) -> int:
        version = cls.generation(current_platform())
        return spec.block_size or GENERATIONS[version or 4].preferred_block_size

    def __init__(self, spec: AttentionSpec, version: int | None = None, **kw) -> None:
        """``backend_options``: ``version`` forces a FlashAttention generation (2, 3, 4)."""
        super().__init__(spec, **kw)
        self.version = version or self.generation(current_platform()) or 4
        if self.version not in GENERATIONS:
            raise ValueError(f"version={version} is not a FlashAttention generation; use 2, 3 "
                             "or 4")

    def _plan(self, max_query: int, max_keys: int, num_tokens: int | None,
              device: torch.device, schedule: int = 0) -> torch.Tensor:
        spec, tile = self.spec, None
        if self.version == 4:
            tile = fa4_tile(DeviceFacts.of(device).major, spec.head_dim, spec.v_head_dim,
                            spec.dtype, max_query, spec.num_heads // spec.kv_heads,
                            self.tuning.flash_attn)
        return PLAN.encode(FlashAttnPlan(self.version, max_query, max_keys, num_tokens, tile,
                                         schedule, self.tuning.flash_attn.fa3_num_splits))

    def build_metadata(self, common: CommonAttentionMetadata):
        if not isinstance(common, CommonAttentionMetadata):
            return common  # already built
        schedule = new_schedule(graph=False) if self.version == 3 else 0
        plan = self._plan(common.max_query_len, common.max_seq_len, common.num_actual_tokens,
                          common.seq_lens.device, schedule)
        cu_seqlens_k = torch.nn.functional.pad(
            torch.cumsum(common.seq_lens, 0, dtype=torch.int32), (1, 0))  # device, no sync
        return FlashAttnMetadata(common.slot_mapping, common.query_start_loc, cu_seqlens_k,
                                 common.seq_lens, common.block_table, plan, common.causal)

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs):
        """A padded batch's metadata for capture/replay: the padded common tensors themselves
        (persistent), a persistent ``cu_seqlens_k``, and a plan fixed per capture size
        (``max_keys`` the graphs' longest request, the token count on the device; FA3: the
        size's scheduler-metadata handle, restarted for each step so that the first layer of
        a capture computes it inside the graph)."""
        super().graph_metadata(padded, graphs)
        size = padded.num_reqs
        key = self.metadata_key()
        state = graphs.backend_state.get(key)
        if state is None:
            largest = graphs.capture_sizes[-1]
            state = graphs.backend_state[key] = {
                "cu_seqlens_k": torch.zeros(largest + 1, dtype=torch.int32,
                                            device=graphs.device)}
        plan = state.get(size)
        if plan is None:
            schedule = new_schedule(graph=True) if self.version == 3 else 0
            plan = state[size] = self._plan(graphs.query_len, graphs.max_seq_len, None,
                                            graphs.device, schedule)
        if self.version == 3:
            restart_schedule(PLAN.decode(plan).schedule)
        cu_seqlens_k = state["cu_seqlens_k"][:size + 1]
        if self.version == 2:  # FA2 reads cumulative lengths; FA3/FA4 read seqused_k
            torch.cumsum(padded.seq_lens, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
        return FlashAttnMetadata(padded.slot_mapping, padded.query_start_loc, cu_seqlens_k,
                                 padded.seq_lens, padded.block_table, plan, padded.causal)

    def computes_in_fp8(self) -> bool:
        """FA3 over an fp8 cache: q in e4m3 (:func:`fa3_fp8_query`), P rounded to e4m3 for
        the PV product."""
        return self.version == 3 and self.spec.kv_cache_dtype.is_fp8

    def kernel_query(self, query: torch.Tensor) -> torch.Tensor:
        """The query as the kernel computes with it, in the query's dtype (FA3 over an fp8
        cache: rounded to e4m3 by :func:`fa3_fp8_query`)."""
        if not self.computes_in_fp8():
            return query
        q8, descale = fa3_fp8_query(query)
        return (q8.float() * descale).to(query.dtype)

    def metadata_key(self) -> tuple:
        spec = self.spec
        return (self.name, self.version, spec.head_dim, spec.v_head_dim, spec.dtype,
                spec.num_heads // spec.kv_heads, self.tuning.key)

    def op_arguments(self, query, kv_cache, metadata, out, *, lse=None, sinks=None,
                     alibi_slopes=None, k_scale=None, v_scale=None) -> tuple:
        m = metadata
        return (query, kv_cache, out, lse, m.cu_seqlens_q, m.cu_seqlens_k, m.seqused_k,
                m.page_table, m.plan, sinks, alibi_slopes, k_scale, v_scale, self.scale,
                self.spec.sliding_window, self.spec.logits_soft_cap, self.spec.causal and m.causal)
