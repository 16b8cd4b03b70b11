"""TRITON_ATTN: our own Triton paged-attention kernels (``triton_attn_kernels.py``).

The portable GPU backend: it needs only Triton, takes any head dim that is a multiple of 8 up
to 256 (72, 80, 96, 112, ... included: tiles are padded to powers of two and masked), QK and V
head dims that differ, fp16 / bf16 / fp32, fp8 KV caches (e4m3 / e5m2, per-tensor scales),
GQA/MQA with the query heads of a KV head packed into one tile, causal and non-causal
attention, sliding windows, soft-cap, sinks, ALiBi and the LSE.

A decode-first batch is served by at most two launches of one kernel -- the decode requests
with split-KV (combined in the kernel or by a second one), then the prefill requests with
larger query tiles -- plus a padding-row kernel in CUDA graphs. The builder routes the launches
(splits, tiles fitted to the device's shared memory: :mod:`attn_ops.routing`, tuned by
``Tuning.triton``) and encodes them as a :class:`TritonPlan`, so the op reads no device value
on the host and a CUDA graph captured for one batch size replays for any lengths (padding rows
are then found on the device). The split rule has no cliff: as the batch grows the splits
shrink step by step, never switching kernels.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how CPU
CI tests them at tiny shapes (fp16/fp32; the interpreter's bf16 ``tl.dot`` is broken).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from attn_ops.backend import AttentionBackend
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, HeadDims, MultipleOf,
                                   PackageRequirement, Reason)
from attn_ops.kv_cache import KVCacheLayout, split_kv_cache
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.ops import (check_paged_attention_inputs, check_paged_attention_values,
                          check_query_start_loc, debug_checks_enabled, define_op)
from attn_ops.plan_codec import PlanCodec
from attn_ops.platforms import Platform, PlatformKind, shared_memory_per_block
from attn_ops.routing import (DeviceFacts, combine_split_block, pow2, triton_decode_tile,
                              triton_fit_tile, triton_fused_combine, triton_head_tiles,
                              triton_heads_fastest, triton_num_splits, triton_prefill_tile)
from attn_ops.spec import (AttentionSpec, AttentionType, Feature, KVCacheDType,
                           TURBOQUANT_KV_DTYPES)
from attn_ops.tuning import Tile, TritonTuning

__all__ = ["PLAN", "TritonAttnBackend", "TritonAttnMetadata", "TritonPlan",
           "check_triton_inputs", "plan_launches", "triton_paged_attention", "unsplit_decode"]

_TRITON = PackageRequirement("triton", "triton", "3.6")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_reasons(name: str, spec: AttentionSpec, platform: Platform,
                        cpu_path: str = "") -> list[Reason]:
    """A Triton backend on the CPU: only in Triton's interpreter (tests), and not in bf16."""
    if platform.kind is not PlatformKind.CPU:
        return []
    reasons = []
    if not interpreting():
        reasons.append(Reason(name, "platform", f"platform cpu: {name} runs on the CPU only in "
                              "Triton's interpreter (TRITON_INTERPRET=1, for tests)" + cpu_path))
    if spec.dtype == torch.bfloat16:
        reasons.append(Reason(name, "dtype", "dtype=bfloat16: tl.dot in bf16 is broken in "
                              "Triton's interpreter", "use float16/float32"))
    return reasons


@dataclass(frozen=True)
class TritonPlan:
    """One step's launches (:data:`PLAN`, a CPU int64 tensor): the decode prefix
    (``num_decodes`` requests, ``num_decode_tokens`` rows, ``splits`` each, ``decode_tile``,
    splits combined in the kernel where ``fused_combine``), the prefills (``prefill_tile``,
    KV head fastest in launch order where ``heads_fastest``), ``num_tokens`` real rows (None:
    known on the device only, as in CUDA graphs) and ``max_seq_len``, the longest context or
    an upper bound of it; a TurboQuant cache's 4-bit fields read as planes where
    ``turboquant_planes``, its other codes gathered along a slot's bytes where
    ``turboquant_coalesced``. Routes from :mod:`attn_ops.routing`."""

    num_decodes: int
    num_decode_tokens: int
    splits: int
    num_tokens: int | None
    max_seq_len: int
    decode_tile: Tile
    prefill_tile: Tile
    fused_combine: bool
    heads_fastest: bool
    turboquant_planes: bool = False
    turboquant_coalesced: bool = False


PLAN = PlanCodec(TritonPlan)


@dataclass(frozen=True, eq=False)
class TritonAttnMetadata:
    """The common device tensors plus ``plan``, the step's :class:`TritonPlan` encoded."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    plan: torch.Tensor
    causal: bool = True


def plan_launches(spec_dims: tuple[int, int], dtypes: tuple[torch.dtype, torch.dtype],
                  kv_heads: int, num_decodes: int, num_decode_tokens: int,
                  num_tokens: int | None, max_seq_len: int, device: torch.device,
                  tuning: TritonTuning) -> TritonPlan:
    """The routes of one step's launches: ``spec_dims`` (QK, V head dims), ``dtypes`` (query,
    cache), ``device`` whose SMs and shared memory the tiles are fitted to."""
    facts = DeviceFacts.of(device)
    splits = triton_num_splits(num_decodes, kv_heads, max_seq_len, facts.num_sms, tuning)
    d_p, dv_p = triton_head_tiles(*spec_dims, dtypes[1].itemsize)
    wide = max(d_p, dv_p) <= 128
    q_bytes, kv_bytes = dtypes[0].itemsize, dtypes[1].itemsize
    decode = triton_decode_tile(num_decodes * kv_heads, splits, kv_bytes, facts.num_sms, wide,
                                tuning)
    prefill = triton_prefill_tile(wide, q_bytes, max_seq_len, tuning)
    if device.type == "cuda":
        smem = shared_memory_per_block(device)
        decode = triton_fit_tile(decode, d_p, dv_p, q_bytes, kv_bytes, smem)
        prefill = triton_fit_tile(prefill, d_p, dv_p, q_bytes, kv_bytes, smem)
    return TritonPlan(num_decodes, num_decode_tokens, splits, num_tokens, max_seq_len, decode,
                      prefill, splits > 1 and triton_fused_combine(num_decodes, kv_heads, tuning),
                      triton_heads_fastest(max_seq_len, tuning))


_COUNTERS: dict = {}  # device -> zeroed int32 tickets, one per (tile, KV head); reset by use


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed tickets on ``device`` (made during a CUDA-graph capture, they come
    from the graph's pool and each replay zeroes them again: harmless, they are zero anyway)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.shape[0] < n:
        counters = _COUNTERS[device] = torch.zeros(max(n, 1 << 16), dtype=torch.int32,
                                                   device=device)
    return counters


def turboquant_read_constants(key_bits: int, value_bits: int, norm_correction: bool,
                              planes: bool, coalesced: bool) -> dict:
    """The attention kernel's constants for a TurboQuant cache: nibble planes are a layout of
    4-bit fields only (a 3-bit or fp8 field is gathered whatever ``planes`` says)."""
    return dict(KV_FORMAT=1, KEY_BITS=key_bits, VALUE_BITS=value_bits,
                NORM_CORRECTION=norm_correction, KEY_PLANES=planes and key_bits == 4,
                VALUE_PLANES=planes and value_bits == 4, TQ_COALESCED=coalesced)


def _launch(query, k_cache, v_cache, out, lse, qsl, seq_lens, block_table, sinks, alibi,
            k_scale, v_scale, tree, scale, window, soft_cap, causal, num_reqs, num_tokens, splits,
            prefill, tile, fused, heads_fastest=False, first_row=0, turboquant=None,
            planes=False, coalesced=False):
    """One launch of the attention kernel over ``num_reqs`` requests (tensors already sliced to
    them) whose queries are at most ``num_tokens`` rows, from row ``first_row`` of the batch
    (what the host planned: the rows the launch's row check answers for), in ``tile`` (rows,
    keys, warps, stages), with ``splits`` splits of each request's keys (combined in the kernel
    if ``fused``). ``turboquant``: ``(preset, codebook)`` of a TurboQuant cache (both
    ``k_cache`` and ``v_cache``: ``uint8 [blocks, Hk, page, slot]``; the keys' centroids), its
    4-bit fields read as planes where ``planes``, its other codes gathered along a slot's
    bytes where ``coalesced`` (``backends/turboquant/read_kernels.py``)."""
    from attn_ops.backends.triton_attn_kernels import (combine_splits_kernel,
                                                       paged_attention_kernel)

    hq, d, dv = query.shape[1], query.shape[2], out.shape[2]
    if turboquant is None:  # [blocks, page, Hk, D] views: strides of block, slot, head
        page, hk = k_cache.shape[1], k_cache.shape[2]
        k_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        v_strides = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        tq = dict(codebook_ptr=query, inv_sqrt_d=1.0, KV_FORMAT=0,
                  KEY_BITS=0, VALUE_BITS=0, NORM_CORRECTION=False, KEY_PLANES=False,
                  VALUE_PLANES=False, TQ_COALESCED=False)  # (unread)
    else:  # [blocks, Hk, page, slot] bytes
        preset, codebook = turboquant
        page, hk = k_cache.shape[2], k_cache.shape[1]
        k_strides = v_strides = (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1))
        tq = dict(codebook_ptr=codebook, inv_sqrt_d=d ** -0.5,
                  **turboquant_read_constants(preset.key_bits, preset.value_bits,
                                              preset.norm_correction, planes, coalesced))
    group = hq // hk
    group_p = pow2(group)
    d_p, dv_p = triton_head_tiles(d, dv, k_cache.dtype.itemsize)
    rows, block_n, warps, stages = tile
    block_q = max(1, rows // group_p)
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    dummy = query
    part_o = part_lse = dummy
    if splits > 1:
        part_o = torch.empty(out.shape[0], hq, splits, dv_p, dtype=torch.float32,
                             device=query.device)
        part_lse = torch.empty(out.shape[0], hq, splits, dtype=torch.float32,
                               device=query.device)
    one_row = not prefill and num_tokens == num_reqs  # single-row decodes: a tile each
    attn_tiles = num_reqs if one_row else num_tokens // block_q + num_reqs
    # (one tile more: the row check, which zeroes the rows a corrupt query_start_loc leaves
    # to no tile)
    grid = (attn_tiles + 1, hk, splits)
    fused = splits > 1 and fused
    paged_attention_kernel[grid](
        query, k_cache, v_cache, out, lse if lse is not None else dummy, part_o, part_lse,
        qsl, seq_lens, block_table, sinks if sinks is not None else dummy,
        alibi if alibi is not None else dummy, k_scale if fp8 else dummy,
        v_scale if fp8 else dummy, tree if tree is not None else dummy,
        _counters(query.device, grid[0] * grid[1]) if fused else dummy,
        num_reqs, scale, soft_cap or 0.0, window or 0, tree.shape[0] if tree is not None else 0,
        k_cache.shape[0], block_table.shape[1], query.shape[0], attn_tiles, first_row,
        num_tokens, num_reqs.bit_length(), query.stride(0), query.stride(1),
        out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
        *k_strides, *v_strides, block_table.stride(0),
        GROUP=group, GROUP_P=group_p, HQ=hq, PAGE=page, BLOCK_Q=block_q,
        BLOCK_N=block_n,
        D=d, D_P=d_p, DV=dv, DV_P=dv_p, CAUSAL=causal, USE_WINDOW=window is not None,
        USE_SOFTCAP=soft_cap is not None, HAS_ALIBI=alibi is not None,
        HAS_SINKS=sinks is not None, FP8=fp8, WRITE_LSE=lse is not None, NUM_SPLITS=splits,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_TREE=tree is not None, FUSED_COMBINE=fused,
        HEADS_FASTEST=heads_fastest, ONE_ROW=one_row, **tq,
        num_warps=warps, num_stages=stages)
    if splits > 1 and not fused:
        combine_splits_kernel[(num_tokens, hq)](
            out, lse if lse is not None else dummy, part_o, part_lse, qsl,
            sinks if sinks is not None else dummy, v_scale if fp8 else dummy, num_reqs,
            out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
            HQ=hq, NUM_SPLITS=splits, SPLITS_P=pow2(splits), DV=dv, DV_P=dv_p,
            HAS_SINKS=sinks is not None, FP8=fp8, WRITE_LSE=lse is not None,
            SPLIT_BLOCK=combine_split_block(splits, dv_p), ALL_ROWS=True, num_warps=4)


def unsplit_decode(query, k_cache, v_cache, out, lse, query_start_loc, seq_lens, block_table,
                   scale, window, soft_cap, causal, tile: Tile) -> None:
    """One unsplit decode launch in ``tile`` over every request of ``seq_lens`` (single query
    rows, 16-bit K/V halves as :func:`~attn_ops.kv_cache.split_kv_cache` gives them): how
    COMPOSITE_SM90 runs the decode parts routed to this kernel."""
    _launch(query, k_cache, v_cache, out, lse, query_start_loc, seq_lens, block_table,
            sinks=None, alibi=None, k_scale=None, v_scale=None, tree=None, scale=scale,
            window=window, soft_cap=soft_cap, causal=causal, num_reqs=seq_lens.shape[0],
            num_tokens=query.shape[0], splits=1, prefill=False, tile=tile, fused=False)


def triton_paged_attention(query, kv_cache, query_start_loc, seq_lens, block_table, plan, out,
                           lse, sinks, alibi_slopes, k_scale, v_scale, scale, sliding_window,
                           soft_cap, causal, tree=None, turboquant=None) -> None:
    """The op's kernel side (``tree``: TREE_ATTN's ancestor bitmasks, int64 ``[nodes]``;
    ``turboquant``: a TurboQuant cache's ``(preset, codebook)``, as :func:`_launch`
    takes them, its inputs checked by TURBOQUANT's op)."""
    if turboquant is None:
        check_triton_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, plan, out,
                            lse, sinks, alibi_slopes, k_scale, v_scale)
    if query.device.type == "cpu" and not interpreting():
        raise RuntimeError("TRITON_ATTN runs on the CPU only in Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before importing attn_ops (tests)")
    p = PLAN.decode(plan)
    if turboquant is None:
        k_cache, v_cache = split_kv_cache(kv_cache, query.shape[2], out.shape[2])
    else:
        k_cache = v_cache = kv_cache
    num_reqs, rows = seq_lens.shape[0], query.shape[0]
    if debug_checks_enabled():  # (reads the lengths and block ids: a device sync per layer)
        check_paged_attention_values(rows, k_cache.shape[0],
                                     k_cache.shape[2 if turboquant else 1],
                                     query_start_loc.tolist(), seq_lens.tolist(), block_table,
                                     True)
    elif query_start_loc.device.type == "cpu":  # (host values: checking them costs nothing)
        check_query_start_loc(query_start_loc.tolist(), rows)
    args = dict(sinks=sinks, alibi=alibi_slopes, k_scale=k_scale, v_scale=v_scale, tree=tree,
                scale=scale, window=sliding_window, soft_cap=soft_cap, causal=causal,
                turboquant=turboquant, planes=p.turboquant_planes,
                coalesced=p.turboquant_coalesced)
    if p.num_decodes:
        _launch(query, k_cache, v_cache, out, lse, query_start_loc, seq_lens, block_table,
                num_reqs=p.num_decodes, num_tokens=p.num_decode_tokens, splits=p.splits,
                prefill=False, tile=p.decode_tile, fused=p.fused_combine, **args)
    if p.num_decodes < num_reqs:
        prefill_tokens = (p.num_tokens if p.num_tokens is not None else rows) \
            - p.num_decode_tokens
        d = p.num_decodes
        _launch(query, k_cache, v_cache, out, lse, query_start_loc[d:], seq_lens[d:],
                block_table[d:], num_reqs=num_reqs - d, num_tokens=prefill_tokens, splits=1,
                prefill=True, tile=p.prefill_tile, fused=False, heads_fastest=p.heads_fastest,
                first_row=p.num_decode_tokens, **args)
    if p.num_tokens is not None and p.num_tokens < rows:  # padding rows are zero
        out[p.num_tokens:].zero_()
        if lse is not None:
            lse[p.num_tokens:].zero_()
    elif p.num_tokens is None:  # a CUDA-graph batch: the padding starts at query_start_loc[-1]
        from attn_ops.backends.triton_attn_kernels import zero_padding_kernel

        zero_padding_kernel[(rows,)](
            out, lse if lse is not None else out, query_start_loc, num_reqs, rows,
            out.shape[1] * out.shape[2], out.stride(0), lse.stride(0) if lse is not None else 0,
            HQ=out.shape[1], HQ_P=pow2(out.shape[1]), WRITE_LSE=lse is not None, BLOCK=1024)


def check_triton_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, plan, out,
                        lse, sinks, alibi_slopes, k_scale, v_scale):
    """Shape checks of the op (no tensor data read)."""
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)
    if plan.device.type != "cpu" or plan.dtype != torch.int64 or plan.shape != (PLAN.length,):
        raise ValueError(f"plan must be a CPU int64 [{PLAN.length}] tensor "
                         f"(TritonAttnMetadata.plan), got {plan.dtype} {tuple(plan.shape)} on "
                         f"{plan.device}")


def _fake(query, kv_cache, query_start_loc, seq_lens, block_table, plan, out, lse, sinks,
          alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap, causal) -> None:
    check_triton_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, plan, out, lse,
                        sinks, alibi_slopes, k_scale, v_scale)


triton_attention = define_op(
    "triton_attention",
    "(Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, Tensor plan, Tensor(a!) out, Tensor(b!)? lse, Tensor? sinks, "
    "Tensor? alibi_slopes, Tensor? k_scale, Tensor? v_scale, float scale, int? sliding_window, "
    "float? soft_cap, bool causal) -> ()",
    triton_paged_attention, _fake, dispatch_keys=("CPU", "CUDA"), fp8_output_at=6)


class TritonAttnBackend(AttentionBackend):
    """Our Triton kernels: decodes with split-KV, prefills in larger tiles, one op."""

    name = "TRITON_ATTN"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA, PlatformKind.ROCM, PlatformKind.CPU}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        head_dims=HeadDims(multiple_of=8, min=8, max=256),
        kv_cache_dtypes=frozenset(KVCacheDType) - TURBOQUANT_KV_DTYPES,
        block_sizes=(MultipleOf(1),),
        preferred_block_size=16,
        features=frozenset({Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.SINKS,
                            Feature.ALIBI, Feature.NON_CAUSAL, Feature.FP8_KV,
                            Feature.DIFF_HEAD_DIM_V}),
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER_ONLY}),
        min_capability=(8, 0),
        cudagraph_support=CUDAGraphSupport.UNIFORM_BATCH,  # the op reads no device value
        packages=(_TRITON,),
    )
    op = triton_attention

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        return super().not_supported_reasons(spec, platform) + interpreter_reasons(
            cls.name, spec, platform)

    @classmethod
    def kv_cache_layout(cls, spec: AttentionSpec) -> KVCacheLayout:
        return KVCacheLayout.for_spec(spec)

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttnMetadata:
        if not isinstance(common, CommonAttentionMetadata):
            return common
        plan = self._plan(common.num_decodes, common.num_decode_tokens, common.num_actual_tokens,
                          common.max_seq_len, common.seq_lens.device)
        return TritonAttnMetadata(common.slot_mapping, common.query_start_loc, common.seq_lens,
                                  common.block_table, PLAN.encode(plan), common.causal)

    def _plan(self, num_decodes, num_decode_tokens, num_tokens, max_seq_len, device):
        spec = self.spec
        return plan_launches((spec.head_dim, spec.v_head_dim), (spec.dtype, spec.cache_dtype),
                             spec.kv_heads, num_decodes, num_decode_tokens, num_tokens,
                             max_seq_len, device, self.tuning.triton)

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> TritonAttnMetadata:
        """The padded common tensors (persistent) and a plan fixed per capture size: splits
        from the size and the graphs' longest request, the token count left to the device."""
        super().graph_metadata(padded, graphs)
        size = padded.num_reqs
        key = (*self.metadata_key(), "plan", size)
        plan = graphs.backend_state.get(key)
        if plan is None:
            decodes = padded.num_decodes
            plan = graphs.backend_state[key] = PLAN.encode(self._plan(
                decodes, decodes * graphs.query_len if decodes else 0, None, graphs.max_seq_len,
                graphs.device))
        return TritonAttnMetadata(padded.slot_mapping, padded.query_start_loc, padded.seq_lens,
                                  padded.block_table, plan, padded.causal)

    def advance_graph_metadata(self, metadata, padded, graphs):
        """The step before's graph metadata as it is: it reads the padded buffers, advanced in
        place, and a plan fixed per capture size."""
        return metadata

    def metadata_key(self) -> tuple:
        spec = self.spec
        return (self.name, spec.kv_heads, spec.head_dim, spec.v_head_dim, spec.dtype,
                spec.cache_dtype, self.tuning.key)

    def op_arguments(self, query, kv_cache, metadata, out, *, lse=None, sinks=None,
                     alibi_slopes=None, k_scale=None, v_scale=None) -> tuple:
        m, spec = metadata, self.spec
        return (query, kv_cache, m.query_start_loc, m.seq_lens, m.block_table, m.plan, out,
                lse, sinks, alibi_slopes, k_scale, v_scale, self.scale, spec.sliding_window,
                spec.logits_soft_cap, spec.causal and m.causal)
