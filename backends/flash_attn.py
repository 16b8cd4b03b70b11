"""FLASH_ATTN: FlashAttention 4 (CuTe-DSL kernels, ``flash_attn.cute``) over the paged cache.

One varlen call serves a whole batch: ``cu_seqlens_q`` from the batch, ``seqused_k`` the cached
lengths, ``page_table`` the block table. The builder only packs host bounds (``max_seqlen_q``,
``max_seqlen_k``) into a small CPU tensor. On sm100+ the op passes ``num_splits=0`` so FA4 picks
split-KV from those bounds (the same choice on every CUDA-graph replay with the same bounds).

On sm90 FA4 has no split-KV ("SplitKV not supported on SM 9.0"), so its decode trails
FlashInfer's split tensor-core decode by far at small batches (0.39 vs 3.3 TB/s at batch 1 ctx
32k), while its prefill leads (585-591 vs 493 TFLOP/s at 1x8k; 623 with the 192-row tile
FLASH_ATTN gives prefills of >= 1024 rows, ``fa4_tile``). So there, when FlashInfer is
installed and takes the spec, FLASH_ATTN runs each step as FlashInfer's op with FA4 as its
prefill kernel (``FlashInferBackend(prefill_kernel="fa4", triton_decode=...)``), one op call:
prefill rows through FA4; decode rows through whichever kernel ``flashinfer.decode_kernel``
found fastest for the batch -- FlashInfer (split for small batches), TRITON_ATTN's decode
kernel for short decodes that fill the SMs about 4 times over (where TRITON_ATTN takes the
spec), or FA4 in a 64-row tile from 0.4 of a wave of (request, KV head) items
(``fa4_decode_wins``). A compiled model sees the choice as the metadata's type.

Semantics are REFERENCE's: ``sliding_window=W`` is ``window_size=(W-1, 0)`` causal and
``(W-1, W-1)`` otherwise; FA4's LSE ([heads, tokens], natural log) is transposed to
``[tokens, heads]``; sinks are applied from the LSE (FA4's in-kernel sink would fold the sink
into the LSE, which REFERENCE excludes).

FlashAttention 3 (``flash_attn_interface.flash_attn_with_kvcache`` with ``page_table``) and
FlashAttention 2 (``flash_attn.flash_attn_varlen_func`` with ``block_table``, pages a multiple
of 256 tokens, ALiBi) run through the same op when they are what is installed (newest first;
``AttentionConfig(backend_options={"version": 2})`` forces one). Neither can be installed on the
H200 (FA2 is source-only on PyPI, FA3 not on PyPI), so their glue is tested on the CPU against
stand-in modules with the same call signatures that implement FlashAttention's documented
semantics (``tests/test_flash_attn_glue.py``), and their GPU execution is untested.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_ops.backend import AttentionBackend
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, HeadDims, MultipleOf,
                                   PackageRequirement, Reason)
from attn_ops.platforms import Platform, PlatformKind, current_platform, multiprocessor_count
from attn_ops.kv_cache import nhd_kv_halves
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.ops import apply_sinks, check_nhd_attention_inputs, define_op
from attn_ops.spec import AttentionSpec, AttentionType, Feature, KVCacheDType

__all__ = ["FlashAttnBackend", "FlashAttnMetadata"]

@dataclass(frozen=True, eq=False)
class FlashAttnMetadata:
    """``bounds`` is a CPU int64 ``[max_seqlen_q, max_seqlen_k, FlashAttention version,
    num_actual_tokens]``; the rest live on the device."""

    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqused_k: torch.Tensor
    page_table: torch.Tensor
    bounds: torch.Tensor
    causal: bool = True


def fa4_head_dim_reasons(name: str, spec: AttentionSpec, platform: Platform) -> list[Reason]:
    """FA4's head-dim rules over a paged cache (flash_attn.cute.interface / flash_fwd_sm90):
    pages not equal to its KV tile take a non-TMA path that needs head dims filling its
    16-wide tiles; sm100/sm110 take dims up to 128, (192, 128) or (256, 256)."""
    reasons = []
    dims = (spec.head_dim, spec.v_head_dim)
    if any(d % 16 for d in dims):
        reasons.append(Reason(name, "head_dim", f"(head_dim, head_dim_v)={dims}: FlashAttention 4 "
                              "over a paged cache needs multiples of 16"))
    cap = platform.capability
    if cap is not None and cap[0] in (10, 11) and not (
            max(dims) <= 128 or dims in ((192, 128), (256, 256))):
        reasons.append(Reason(name, "head_dim", f"(head_dim, head_dim_v)={dims} is not supported "
                              "by FlashAttention 4 on sm100/sm110 (<= 128, (192, 128) or "
                              "(256, 256))"))
    return reasons


def _check(query, kv_cache, out, lse):
    check_nhd_attention_inputs("FLASH_ATTN", query, kv_cache, out, lse)


def fa_window(sliding_window, causal):
    """REFERENCE's window as FlashAttention's (left, right); None = unbounded."""
    if sliding_window is None:
        return None, None
    return sliding_window - 1, (None if causal else sliding_window - 1)


# FA4's sm90 tile for head dim 128 is 128 query rows x 128 keys, two MMA warpgroups, P kept in
# registers for the PV product (RS). Prefills run faster on the H200 with 192 rows (three MMA
# warpgroups) and P through shared memory -- the tile FA4 itself takes up to head dim 96.
# Paged, causal, page 128, TFLOP/s, default -> tall (sweep_prefill_h200.json, f374ced):
# 1x8k 592 -> 626, 4x4k 559 -> 578, 16x1k 378 -> 384, 1x16k 622 -> 647; same output bits.
SM90_TALL_TILE = {"tile_mn": (192, 128), "mma_pv_is_rs": False, "intra_wg_overlap": True}
# From 1024 query rows on. Shorter prefills gained too, measured once (sweep_prefill_tall_h200
# .json: 32x512 266 -> 282, 64x256 152 -> 156), but where FA4 runs a whole step (no FlashInfer)
# its decode rows share the call, and the tile is unmeasured there. In FA4's batch mode (one
# query length, no decode rows) from 512 rows: 32x512 286 -> 291 (sweep_prefill_batch_h200
# .json, 44d7df4; 64x256 lost, 182 -> 176).
SM90_TALL_TILE_MIN_QUERY = 1024
SM90_TALL_TILE_MIN_QUERY_BATCH = 512
# Decodes (one query row per request: the GQA group's heads packed into the tile's rows) fill
# few of the 128 rows; 64 rows (one MMA warpgroup) read the cache faster. FA4 called directly,
# paged, page 128, 32/8 heads (group 4; other groups unmeasured), TB/s, FA4's tile -> 64x128
# (sweep_decode_b12_h200.json at 44d7df4, sweep_decode_h200.json at 866fdba): B=12 ctx 1k 2.86 ->
# 3.70, ctx 4k 3.86 -> 4.06; B=16 ctx 1k 3.21 -> 3.34, ctx 32k 4.37 -> 4.58; B=128 ctx 32k 4.10
# -> 4.63; same outputs. (64x96/112/160 -- no TMA for pages of 128 then -- and 64x128 without
# RS were slower or level; 64 rows divide by the group for FA4's TMA load of Q, as 192 must.)
SM90_DECODE_TILE = {"tile_mn": (64, 128), "mma_pv_is_rs": True, "intra_wg_overlap": True}


def fa4_tile(major: int, head_dim: int, head_dim_v: int, dtype: torch.dtype, max_q: int,
             group: int, batch: bool = False) -> dict:
    """FA4 tile arguments for a call (empty: FA4's own choice). ``group``: query heads per KV
    head; ``batch``: the call runs in FA4's batch mode. Decodes (``max_q`` 1) take
    :data:`SM90_DECODE_TILE`, long prefills :data:`SM90_TALL_TILE`. FA4 packs a group's heads
    into the tile's rows (``pack_gqa``, its default under GQA) and loads Q by TMA only if the
    group divides the rows; otherwise (groups of 5 or 7, say: Qwen2.5-14B, Qwen2-7B) its producer
    loads Q by cp.async, which FA4 provisions registers for with two MMA warpgroups, not three
    -- so those keep FA4's tile."""
    if major != 9 or head_dim != 128 or head_dim_v != 128 \
            or dtype not in (torch.float16, torch.bfloat16):
        return {}
    if max_q == 1 and SM90_DECODE_TILE["tile_mn"][0] % group == 0:
        return SM90_DECODE_TILE
    least = SM90_TALL_TILE_MIN_QUERY_BATCH if batch else SM90_TALL_TILE_MIN_QUERY
    if max_q >= least and SM90_TALL_TILE["tile_mn"][0] % group == 0:
        return SM90_TALL_TILE
    return {}


def fa4_decodes_in_short_tile(spec: AttentionSpec, major: int = 9) -> bool:
    """Whether FA4 runs ``spec``'s decodes in :data:`SM90_DECODE_TILE` on a GPU of compute
    capability ``major`` (the default, 9, the only one it takes: a check of the spec alone)."""
    return fa4_tile(major, spec.head_dim, spec.v_head_dim, spec.dtype, 1,
                    spec.num_heads // spec.kv_heads) is SM90_DECODE_TILE


def fa4_decode_wins(items: int, max_keys: int, num_sms: int) -> bool:
    """Whether FA4 with :data:`SM90_DECODE_TILE` (no split on sm90: one CTA per (request, KV
    head) ``item``) is the fastest decode measured for ``items`` work items of at most
    ``max_keys`` keys (H200, 132 SMs, page 128, sweep_decode_h200.json at 866fdba and, B=12,
    sweep_decode_b12_h200.json; TB/s, FA4 64x128 vs the best of FlashInfer's split rules,
    TRITON_ATTN's decode, FA4's own tile; pages of other sizes, which FA4 cannot load by TMA
    in this tile, and GQA groups other than 4 unmeasured):

    * from 0.4 of a wave to just under one (B=8-16 at 8 KV heads) up to 8k keys -- B=8 ctx 4k
      3.64 vs 3.37, B=12 ctx 1k 3.70 vs 2.86 -- and at every length from 0.9 of a wave (B=16
      ctx 32k 4.58 vs 4.49); below 0.4 (B <= 4) FlashInfer's splits win by 2x, and at B=8 ctx
      16k-32k they win 4.25-4.42 vs 4.13-4.22;
    * from two waves (B >= 64) at 16k keys or more: B=64 ctx 32k 4.62 vs 4.54, B=128 4.63 vs
      4.55, B=256 ctx 16k 4.57 vs 4.52. Shorter or fewer, FlashInfer or TRITON_ATTN (B=32 ctx
      16k 4.51 vs 4.54; B=256 ctx 1k 3.89 vs 4.22)."""
    if items >= 2 * num_sms:
        return max_keys >= 16384
    if items >= num_sms:
        return False
    return 5 * items >= 2 * num_sms and (max_keys <= 8192 or 10 * items >= 9 * num_sms)


# FA4's batch mode -- q [B, S, heads, D], no cu_seqlens_q; sm90 then schedules with its LPT
# tile scheduler instead of the varlen one -- for a prefill part whose requests share one query
# length of >= FA4_BATCH_MIN_QUERY rows. FA4 called directly, paged, TFLOP/s, varlen -> batch
# (sweep_prefill_tall_h200.json, 1f8fdf0): 64x256 152 -> 182, 32x512 266 -> 269, 16x1k with the
# tall tile 381 -> 389, 4x4k / 1x8k level; same output bits. Through our op (FlashInfer's, FA4
# prefill) at 44d7df4 (sweep_prefill_batch_h200.json), varlen -> batch: 64x256 150 -> 182,
# 32x512 264 -> 287, 16x1k 391 -> 396, 1x8k 614 -> 623, as FA4 called directly in batch mode;
# the GPU test tests/test_flash_attn_glue.py::test_fa4_sm90_modes_stay_right[batch-*] passed.
FA4_BATCH_MODE = True
FA4_BATCH_MIN_QUERY = 256  # the shortest measured


def fa4_batch(rows: int, requests: int, max_q: int) -> int:
    """Requests of a part of ``rows`` query rows to run in FA4's batch mode (0: varlen)."""
    uniform = rows == requests * max_q
    return requests if FA4_BATCH_MODE and uniform and max_q >= FA4_BATCH_MIN_QUERY else 0


def run_fa4(query, k_cache, v_cache, out, cu_seqlens_q, seqused_k, page_table, max_q, max_k,
            scale, left, right, soft_cap, causal, need_lse, padded=False, batch=0):
    """FA4's forward into ``out``; returns its LSE ``[heads, tokens]`` if asked. With
    ``padded`` (rows past the real tokens, counted on the device only) the LSE starts zeroed,
    as FA4 leaves those rows unwritten. ``batch`` > 0: the rows are that many requests of one
    length each, run in FA4's batch mode (:func:`fa4_batch`; not with ``padded``)."""
    from flash_attn.cute.interface import _flash_attn_fwd

    major = torch.cuda.get_device_capability(query.device)[0]
    splits = 0 if major >= 10 else 1
    tile = fa4_tile(major, query.shape[-1], v_cache.shape[-1], query.dtype, max_q,
                    query.shape[1] // k_cache.shape[-2], batch=batch > 0)
    heads, tokens = query.shape[1], query.shape[0]
    lse_shape = (batch, heads, tokens // batch) if batch else (heads, tokens)
    lse = None
    if need_lse:
        lse = (torch.zeros if padded else torch.empty)(lse_shape, dtype=torch.float32,
                                                       device=query.device)
    if batch:
        query, out = query.view(batch, -1, *query.shape[1:]), out.view(batch, -1, *out.shape[1:])
        varlen = {}
    else:
        varlen = dict(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_q, max_seqlen_k=max_k)
    _flash_attn_fwd(query, k_cache, v_cache, seqused_k=seqused_k, page_table=page_table,
                    softmax_scale=scale, causal=causal, softcap=soft_cap or 0.0,
                    window_size_left=left, window_size_right=right, num_splits=splits,
                    return_lse=need_lse, out=out, lse=lse, **varlen, **tile)
    if batch and lse is not None:  # [B, heads, S] -> [heads, B * S]
        lse = lse.transpose(0, 1).reshape(heads, tokens)
    return lse


def _run_fa3(query, k_cache, v_cache, out, cu_seqlens_q, seqused_k, page_table, max_q, scale,
             left, right, soft_cap, causal, need_lse):
    from flash_attn_interface import flash_attn_with_kvcache

    result = flash_attn_with_kvcache(
        query, k_cache, v_cache, cache_seqlens=seqused_k, page_table=page_table,
        cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_q, softmax_scale=scale, causal=causal,
        window_size=(-1 if left is None else left, -1 if right is None else right),
        softcap=soft_cap or 0.0, num_splits=0, return_softmax_lse=need_lse)
    o, lse_hm = result if need_lse else (result, None)
    out.copy_(o)
    return lse_hm


def _run_fa2(query, k_cache, v_cache, out, cu_seqlens_q, cu_seqlens_k, page_table, max_q,
             max_k, scale, left, right, soft_cap, alibi_slopes, causal, need_lse):
    from flash_attn import flash_attn_varlen_func

    result = flash_attn_varlen_func(
        query, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale=scale,
        causal=causal, window_size=(-1 if left is None else left, -1 if right is None else right),
        softcap=soft_cap or 0.0, alibi_slopes=alibi_slopes, return_attn_probs=need_lse,
        block_table=page_table)
    o, lse_hm = (result[0], result[1]) if need_lse else (result, None)
    out.copy_(o)
    return lse_hm


def _flash_attn_attention(query, kv_cache, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                          page_table, bounds, sinks, alibi_slopes, scale, sliding_window,
                          soft_cap, causal) -> None:
    _check(query, kv_cache, out, lse)
    max_q, max_k, version, num_tokens = bounds.tolist()
    if num_tokens < 0:  # a CUDA-graph batch: its real token count is known on the device only
        out.zero_()  # FlashAttention leaves the rows of requests without queries unwritten
        if lse is not None:
            lse.zero_()
    k_cache, v_cache = nhd_kv_halves(kv_cache)
    need_lse = lse is not None or sinks is not None
    left, right = fa_window(sliding_window, causal)
    if version == 4:
        lse_hm = run_fa4(query, k_cache, v_cache, out, cu_seqlens_q, seqused_k, page_table,
                         max_q, max_k, scale, left, right, soft_cap, causal, need_lse,
                         padded=num_tokens < 0)
    elif version == 3:
        lse_hm = _run_fa3(query, k_cache, v_cache, out, cu_seqlens_q, seqused_k, page_table,
                          max_q, scale, left, right, soft_cap, causal, need_lse)
    else:
        lse_hm = _run_fa2(query, k_cache, v_cache, out, cu_seqlens_q, cu_seqlens_k, page_table,
                          max_q, max_k, scale, left, right, soft_cap, alibi_slopes, causal,
                          need_lse)
    finish_lse(out, lse, sinks, lse_hm)
    if 0 <= num_tokens < out.shape[0]:  # padding rows are zero, like REFERENCE's
        out[num_tokens:].zero_()
        if lse is not None:
            lse[num_tokens:].zero_()


def finish_lse(out, lse, sinks, lse_hm) -> None:
    """FlashAttention's LSE ``[heads, tokens]`` (natural log) into ``lse [tokens, heads]``, and
    the sinks applied from it."""
    if lse_hm is None:
        return
    row_lse = lse_hm.t()
    if lse is not None:
        lse.copy_(row_lse)
    if sinks is not None:
        apply_sinks(out, row_lse, sinks)


def _fake(query, kv_cache, out, lse, *args) -> None:
    _check(query, kv_cache, out, lse)


flash_attn_attention = define_op(
    "flash_attn_attention",
    "(Tensor query, Tensor kv_cache, Tensor(a!) out, Tensor(b!)? lse, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, Tensor seqused_k, Tensor page_table, Tensor bounds, Tensor? sinks, "
    "Tensor? alibi_slopes, float scale, int? sliding_window, float? soft_cap, bool causal) -> ()",
    # CPU too, so that the FA2/FA3 glue can be tested against stand-in modules on the CPU.
    _flash_attn_attention, _fake, dispatch_keys=("CPU", "CUDA"))


# FlashAttention generations, newest first: distribution, module, oldest version, compute
# capabilities it runs on, page-size rule, whether it takes ALiBi slopes.
@dataclass(frozen=True)
class _Generation:
    package: PackageRequirement
    min_capability: tuple[int, int]
    max_capability: tuple[int, int]
    block_multiple: int
    preferred_block_size: int
    alibi: bool


GENERATIONS = {
    4: _Generation(PackageRequirement("flash-attn-4", "flash_attn", "4.0.0b1"), (8, 0), (12, 9),
                   1, 128, False),  # FA4 is fastest at page 128 (4.04 vs 3.61 TB/s at 16)
    3: _Generation(PackageRequirement("flash-attn-3", "flash_attn_interface", "3.0.0b1"),
                   (9, 0), (9, 0), 1, 16, False),
    2: _Generation(PackageRequirement("flash-attn", "flash_attn", "2.6", max_version="3"),
                   (8, 0), (12, 9), 256, 256, True),  # paged KV needs pages of k x 256
}


def installed_generations(platform: Platform) -> list[int]:
    """FlashAttention generations installed and able to run on ``platform``, newest first."""
    cap = platform.capability
    return [v for v, g in GENERATIONS.items() if g.package.reason("") is None
            and (cap is None or g.min_capability <= cap <= g.max_capability)]


class FlashAttnBackend(AttentionBackend):
    """FlashAttention (4, else 3, else 2) varlen over the paged NHD cache."""

    name = "FLASH_ATTN"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=HeadDims(multiple_of=8, min=8, max=256),
        kv_cache_dtypes=frozenset({KVCacheDType.AUTO}),  # FA4's fp8 path is sm100-only
        block_sizes=(MultipleOf(1),),  # narrowed per generation in not_supported_reasons
        preferred_block_size=128,
        features=frozenset({Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.SINKS,
                            Feature.NON_CAUSAL, Feature.ALIBI}),
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER_ONLY}),
        min_capability=(8, 0),
        cudagraph_support=CUDAGraphSupport.UNIFORM_BATCH,
        reads_page_tails=True,
    )
    op = flash_attn_attention

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
                                  "for sm80-sm12x, flash-attn-3 for sm90, flash-attn 2.x for "
                                  "sm80+)", "pip install flash-attn-4"))
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
        if spec.block_size is not None and spec.block_size % gen.block_multiple:
            reasons.append(Reason(cls.name, "block_size",
                                  f"block_size={spec.block_size} is not a multiple of "
                                  f"{gen.block_multiple} (FlashAttention {version} paged KV)",
                                  f"leave block_size=None to use {gen.preferred_block_size}"))
        return reasons

    @classmethod
    def preferred_block_size(cls, spec: AttentionSpec) -> int:
        from attn_ops.platforms import current_platform as platform

        version = cls.generation(platform())
        return spec.block_size or GENERATIONS[version or 4].preferred_block_size

    def __init__(self, spec: AttentionSpec, version: int | None = None,
                 flashinfer_decode: bool | None = None) -> None:
        """``backend_options``: ``version`` forces a FlashAttention generation;
        ``flashinfer_decode=False`` keeps FA4 for decode rows on sm90 too (default: FlashInfer
        takes them where it is installed and takes the spec)."""
        super().__init__(spec)
        platform = current_platform()
        self.version = version or self.generation(platform) or 4
        if self.version not in GENERATIONS:
            raise ValueError(f"version={version} is not a FlashAttention generation; use 2, 3 "
                             "or 4")
        # sm90: decode rows through FlashInfer's tensor-core decode, prefill rows through FA4,
        # in FlashInfer's op (module docstring).
        self._hybrid = None
        if self.version == 4 and platform.capability is not None \
                and platform.capability[0] == 9 and flashinfer_decode is not False:
            from attn_ops.registry import get_backend_class

            flashinfer = get_backend_class("FLASHINFER")
            if not flashinfer.not_supported_reasons(spec, platform):
                triton = not get_backend_class("TRITON_ATTN").not_supported_reasons(spec,
                                                                                    platform)
                self._hybrid = flashinfer(spec, prefill_kernel="fa4", triton_decode=triton)
        # (decided once, here on sm90: graph_metadata asks at every decode-graph step)
        self._fa4_decode_tile = self._hybrid is not None and fa4_decodes_in_short_tile(spec)

    def build_metadata(self, common: CommonAttentionMetadata):
        if not isinstance(common, CommonAttentionMetadata):
            return common  # already built (FA's or, on sm90, FlashInfer's)
        if self._hybrid is not None:
            return self._hybrid.build_metadata(common)
        bounds = torch.tensor([common.max_query_len, common.max_seq_len, self.version,
                               common.num_actual_tokens], dtype=torch.int64)
        cu_seqlens_k = torch.nn.functional.pad(
            torch.cumsum(common.seq_lens, 0, dtype=torch.int32), (1, 0))  # device, no sync
        return FlashAttnMetadata(common.slot_mapping, common.query_start_loc, cu_seqlens_k,
                                 common.seq_lens, common.block_table, bounds, common.causal)

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs):
        """A padded batch's metadata for capture/replay: the padded common tensors themselves
        (persistent), a persistent ``cu_seqlens_k``, and host bounds fixed per capture size
        (``max_seqlen_k`` = the graphs' longest request, token count "on the device"). On sm90,
        single-token decode graphs run FlashInfer's CUDA-graph decode -- except, where FA4
        decodes in its 64-row tile (``fa4_tile``), capture sizes of 0.7 to 2 waves of
        (request, KV head) items: there FA4 (one CTA per item, no plan; the graph is fixed per
        size, whatever the lengths) beat FLASHINFER's graph decode by up to 35%, or tied
        (H200, TB/s, FA4 vs FLASHINFER's graph decode, 8 KV heads, 132 SMs,
        ``bench_cudagraph_decode_fa4_band_h200.json`` at 2a53d44: B=12 ctx 1k 3.32 vs 2.46,
        ctx 8k 4.16 vs 3.56; B=16 ctx 1k / 4k / 32k 3.11 / 4.06 / 4.39 vs 2.46 / 3.55 / 4.00;
        B=32 ctx 1k 3.30 vs 3.23, ctx 8k 4.30 vs 4.29). Below (B=8, 0.48 waves: ctx 1k 2.50
        vs 2.73, 4k 3.44 vs 3.30, 32k 3.95 vs 4.21) and from 4 waves (B=64 ctx 1k / 4k / 32k
        3.56 / 4.21 / 4.34 vs 3.76 / 4.30 / 4.44; B=128 ctx 1k 3.76 vs 3.91) FlashInfer's is
        kept, since its small graph batches split on one CTA per SM
        (``flashinfer.GRAPH_ONE_CTA_PER_SM``); until then FA4 had also taken 0.4-0.7 and 2-8
        waves."""
        super().graph_metadata(padded, graphs)
        if self._hybrid is not None and graphs.query_len == 1 \
                and not self._fa4_graph_decode(padded.num_reqs, graphs.device):
            return self._hybrid.graph_metadata(padded, graphs)
        size = padded.num_reqs
        key = self.metadata_key()
        state = graphs.backend_state.get(key)
        if state is None:
            largest = graphs.capture_sizes[-1]
            state = graphs.backend_state[key] = {
                "cu_seqlens_k": torch.zeros(largest + 1, dtype=torch.int32,
                                            device=graphs.device)}
        bounds = state.get(size)
        if bounds is None:
            bounds = state[size] = torch.tensor([graphs.query_len, graphs.max_seq_len,
                                                 self.version, -1], dtype=torch.int64)
        cu_seqlens_k = state["cu_seqlens_k"][:size + 1]
        if self.version == 2:  # FA2 reads cumulative lengths; FA3/FA4 read seqused_k
            torch.cumsum(padded.seq_lens, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
        return FlashAttnMetadata(padded.slot_mapping, padded.query_start_loc, cu_seqlens_k,
                                 padded.seq_lens, padded.block_table, bounds, padded.causal)

    def _fa4_graph_decode(self, size: int, device) -> bool:
        """Whether sm90 decode graphs of ``size`` requests run FA4 (see ``graph_metadata``)."""
        items, sms = size * self.spec.kv_heads, multiprocessor_count(device)
        return self._fa4_decode_tile and 7 * sms <= 10 * items <= 20 * sms

    def metadata_key(self) -> tuple:
        hybrid = self._hybrid.metadata_key() if self._hybrid is not None else ()
        return (self.name, self.version, *hybrid)

    def forward(self, query, kv_cache, metadata, out, **optional) -> None:
        if self._hybrid is not None and not isinstance(metadata, FlashAttnMetadata):
            return self._hybrid.forward(query, kv_cache, metadata, out, **optional)  # sm90 route
        super().forward(query, kv_cache, metadata, out, **optional)

    def op_for(self, metadata):
        return self.op if isinstance(metadata, FlashAttnMetadata) else self._hybrid.op

    def ops(self):
        return (self.op,) if self._hybrid is None else (self.op, self._hybrid.op)

    def op_arguments(self, query, kv_cache, metadata, out, *, lse=None, sinks=None,
                     alibi_slopes=None, k_scale=None, v_scale=None) -> tuple:
        if not isinstance(metadata, FlashAttnMetadata):
            return self._hybrid.op_arguments(query, kv_cache, metadata, out, lse=lse,
                                             sinks=sinks, k_scale=k_scale, v_scale=v_scale)
        m = metadata
        return (query, kv_cache, out, lse, m.cu_seqlens_q, m.cu_seqlens_k, m.seqused_k,
                m.page_table, m.bounds, sinks, alibi_slopes, self.scale,
                self.spec.sliding_window, self.spec.logits_soft_cap, self.spec.causal and m.causal)
