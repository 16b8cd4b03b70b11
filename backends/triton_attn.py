"""TRITON_ATTN: our own Triton paged-attention kernels (``triton_attn_kernels.py``).

The portable GPU backend: it needs only Triton, takes any head dim that is a multiple of 8 up
to 256 (72, 80, 96, 112, ... included: tiles are padded to powers of two and masked), QK and V
head dims that differ, fp16 / bf16 / fp32, fp8 KV caches (e4m3 / e5m2, per-tensor scales),
GQA/MQA with the query heads of a KV head packed into one tile, causal and non-causal
attention, sliding windows, soft-cap, sinks, ALiBi and the LSE.

A decode-first batch is served by at most two launches of one kernel -- the decode requests
with split-KV (``num_splits`` chosen by the builder so that enough programs fill the GPU; a
combine kernel merges the splits), then the prefill requests with larger query tiles -- plus a
padding-row kernel in CUDA graphs. Everything a launch needs from the host travels in a small
CPU int64 tensor ``bounds`` (``[num_decodes, num_decode_tokens, num_splits, num_tokens,
max_seq_len]``), so the op reads no device value on the host and a CUDA graph captured for one
batch size replays for any lengths (``num_tokens = -1``: padding rows are found on the
device).

Split rule (no cliff): ``num_splits`` is the power of two that brings ``decodes x KV heads x
splits`` closest to two programs per SM without cutting a request's keys below 256 per split;
as the batch grows the splits shrink step by step, never switching kernels.

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
from attn_ops.ops import check_paged_attention_inputs, define_op
from attn_ops.platforms import (Platform, PlatformKind, multiprocessor_count,
                                shared_memory_per_block)
from attn_ops.spec import AttentionSpec, AttentionType, Feature, KVCacheDType

__all__ = ["TritonAttnBackend", "TritonAttnMetadata", "choose_num_splits"]

MAX_SPLITS = 64
MIN_KEYS_PER_SPLIT = 256
# Decode programs per SM the split rule aims at. On the H200 (bench_triton_attention, ctx 32k)
# the decode kernel reached 2.4-2.9 TB/s with ~2 programs per SM (split or not: B=32 unsplit,
# 256 programs, 2.89) but 4.06 with ~4 (B=64, 512) and 4.29 with ~8 (B=128, 1024): it needs
# more programs in flight than one SM's worth to saturate memory. (8 is not yet measured for
# split decodes.)
PROGRAMS_PER_SM = 8
_TRITON = PackageRequirement("triton", "triton", "3.6")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: small, so CPU tests exercise split-KV
    return multiprocessor_count(device)


def choose_num_splits(num_decodes: int, kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits of each decode's keys: a power of two, ``decodes x kv_heads x splits`` near
    ``PROGRAMS_PER_SM x num_sms``, at least ``MIN_KEYS_PER_SPLIT`` keys per split, at most
    ``MAX_SPLITS``; none for decodes of at most ``SHORT_DECODE_KEYS`` keys with
    ``MANY_ITEMS_PER_SM`` items per SM (``MANY_ITEMS_TILE``)."""
    if num_decodes == 0 or short_and_many(num_decodes * kv_heads, max_seq_len, num_sms):
        return 1
    want = max(1, (PROGRAMS_PER_SM * num_sms) // max(1, num_decodes * kv_heads))
    cap = max(1, min(MAX_SPLITS, max_seq_len // MIN_KEYS_PER_SPLIT))
    splits = 1
    while splits * 2 <= min(want, cap):
        splits *= 2
    return splits


@dataclass(frozen=True, eq=False)
class TritonAttnMetadata:
    """The common device tensors plus ``bounds``, a CPU int64 ``[num_decodes,
    num_decode_tokens, num_splits, num_tokens, max_seq_len]`` (``num_tokens = -1``: known on
    the device only, as in CUDA graphs; ``max_seq_len``, the longest context or an upper bound
    of it, picks the prefill tile)."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    bounds: torch.Tensor
    causal: bool = True


# Prefill tiles (query rows, keys, warps, stages) by (padded head dims <= 128, element bytes).
# 16-bit, head dim 128 on the H200 (causal 1x8k / 4x4k, page 16, whole blocks' page numbers
# prefetched; benchmarks/exp/exp_triton_prefill.py at bc6ccef+prefetch): 128 x 128 / 8 warps /
# 3 stages 0.82x / 0.78x FlashInfer, the best of six (2 stages 0.77 / 0.75; 128 x 64 / 8 / 3
# 0.79 / 0.77; 4 warps 0.24-0.39). fp32 takes smaller tiles to stay within shared memory (not
# measured).
PREFILL_TILES = {(True, 2): (128, 128, 8, 3), (True, 4): (64, 64, 4, 2),
                 (False, 2): (32, 32, 4, 2), (False, 4): (32, 32, 4, 2)}
# Steps whose longest context is at most SHORT_PREFILL_KEYS take SHORT_PREFILL_TILES where they
# have an entry: half-width key tiles waste less of the causal diagonal when each query tile
# sees few keys. H200 (benchmarks/exp/exp_triton_ab.py, 27585e1, TFLOP/s at 128x128x8x3 /
# 128x64x8x3): 1x1k 165 / 179, 16x1k 218 / 246, but 4x4k 364 / 358 and 1x8k 406 / 386 (2k lies
# between the measured points).
# Their launches also put the KV head fastest in launch order (the kernel's HEADS_FASTEST): a
# short step is a wave or two, and with the tile fastest the heads' longest tiles started one
# after another -- the last of them when the first wave drained. H200 (exp_triton_ab.py run 6,
# fd60b21, TFLOP/s tile- / heads-fastest at 128x64x8x3): 1x1k 179 / 248 (FlashInfer 255), 1x2k
# 265 / 310, 16x1k 244 / 249, 4x4k 357 / 361, 1x8k 386 / 386; but at 128x128x8x3, 4x4k 370 / 336
# and 1x8k 411 / 373, so long steps keep the tile fastest.
SHORT_PREFILL_KEYS = 2048
SHORT_PREFILL_TILES = {(True, 2): (128, 64, 8, 3)}


def prefill_tile(wide: bool, elem_bytes: int, max_seq_len: int) -> tuple[int, int, int, int]:
    """(rows, keys, warps, stages) of a prefill launch (PREFILL_TILES, SHORT_PREFILL_TILES)."""
    key = wide, min(elem_bytes, 4)
    if max_seq_len <= SHORT_PREFILL_KEYS and key in SHORT_PREFILL_TILES:
        return SHORT_PREFILL_TILES[key]
    return PREFILL_TILES[key]


# Decode tiles (rows, keys, warps, stages) by padded head dims <= 128: 16 rows (a KV head's
# query heads, padded), 64 keys (32 past 128), 4 warps, 2 stages -- or MANY_ITEMS_TILE for an
# unsplit launch of 16-bit (or fp8) K/V with at least MANY_ITEMS_PER_SM (request, KV head) items
# per SM (decode_tile). Split launches: on the H200 (benchmarks/exp/exp_triton_ab.py, 27585e1,
# page 16, d128, TB/s at 2 / 3 / 4 stages) B=1 ctx 32k 3.13 / 2.62, B=32 ctx 8k 4.28 / 3.85 /
# 4.01, B=64 ctx 8k 4.45 / 4.04 / 4.25.
DECODE_TILES = {True: (16, 64, 4, 2), False: (16, 32, 4, 2)}
# MANY_ITEMS_TILE holds 3 stages of 32-key K and V tiles, 48 KiB of shared memory at d128, so
# 4 programs share an SM (with 64 keys in 4 stages, the tile before it, only one did): a batch
# of 64 x 8 KV heads is resident at once. H200 (benchmarks/exp/exp_decode_ceiling.py runs 2-3,
# 03a4887 / 3461fe8; TB/s, this tile vs 16 x 64 x 4 warps x 4 stages, unsplit): B=128 ctx 1k
# 4.12 vs 3.89, B=128 ctx 4k 4.44 vs 4.37, B=256 ctx 1k 4.19 vs 4.12 (page 16: 4.24 vs 3.95),
# B=256 ctx 8k 4.49 vs 4.39 (page 16: 4.50 vs 4.42-4.45), B=256 ctx 32k 4.50 vs 4.37; B=64 ctx 1k
# 3.88 (page 16: 3.89) vs 3.56 (3.48), where split in two it gave 3.43-3.55 -- so decodes of at
# most SHORT_DECODE_KEYS keys are not split once their items reach MANY_ITEMS_PER_SM per SM
# (choose_num_splits). 2 warps: 3.72 at B=64 ctx 1k; 4 stages: 3 programs per SM, 3.73; 16-key
# tiles 2.14-3.53. The 3.5 per SM sits between the measured 3.9 (B=64) and 2 (B=32, not
# measured unsplit with this tile); fp8 and d > 128 take it unmeasured.
MANY_ITEMS_PER_SM = 3.5
MANY_ITEMS_TILE: tuple[int, int, int, int] | None = (16, 32, 4, 3)  # None: DECODE_TILES only
SHORT_DECODE_KEYS = 1024


def _many_items(items: int, num_sms: int) -> bool:
    return bool(MANY_ITEMS_TILE) and items >= MANY_ITEMS_PER_SM * num_sms


def short_and_many(items: int, max_seq_len: int, num_sms: int) -> bool:
    """Whether decodes of at most ``max_seq_len`` keys and ``items`` (request, KV head) pairs
    run unsplit in ``MANY_ITEMS_TILE``: at most ``SHORT_DECODE_KEYS`` keys, at least
    ``MANY_ITEMS_PER_SM`` items per SM."""
    return max_seq_len <= SHORT_DECODE_KEYS and _many_items(items, num_sms)


def decode_tile(items: int, splits: int, kv_bytes: int, num_sms: int,
                wide: bool) -> tuple[int, int, int, int]:
    """(rows, keys, warps, stages) of a decode launch of ``items`` (request, KV head) pairs
    (see ``MANY_ITEMS_TILE``; :func:`fit_tile` then keeps it within shared memory)."""
    if splits == 1 and kv_bytes <= 2 and _many_items(items, num_sms):
        return MANY_ITEMS_TILE
    return DECODE_TILES[wide]


def _smem_bytes(rows, keys, stages, d_p, dv_p, q_bytes, kv_bytes) -> int:
    """Shared memory of a launch, estimated: ``stages`` K and V tiles as loaded, one more
    converted to the query's dtype when the cache is narrower (fp8), the query tile."""
    kv = keys * (d_p + dv_p)
    return stages * kv * kv_bytes + (kv * q_bytes if kv_bytes < q_bytes else 0) \
        + rows * d_p * q_bytes


def fit_tile(tile, d_p, dv_p, q_bytes, kv_bytes, smem):
    """``tile`` (rows, keys, warps, stages) within ``smem`` bytes of shared memory by
    :func:`_smem_bytes`: fewer stages (down to 2), then half the keys (down to 16), then half
    the rows. The tiles measured on the H200 (227 KiB) fit unchanged; an A100 (163 KiB) runs
    the 16-bit prefill tile in 2 stages, a consumer GPU (99 KiB) with 64 keys."""
    rows, keys, warps, stages = tile
    while _smem_bytes(rows, keys, stages, d_p, dv_p, q_bytes, kv_bytes) > smem:
        if stages > 2:
            stages -= 1
        elif keys > 16:
            keys //= 2
        elif rows > 16:
            rows //= 2
        else:
            break
    return rows, keys, warps, stages


# Split-KV partials combined by the last split of each tile inside the attention launch (one
# kernel) instead of by combine_splits_kernel (a second). Measured on the H200
# (``bench_triton_attention.py``, 06f617d, 8 KV heads): within 1% of two launches from 32
# decodes on (256 (request, KV head) items: few splits, so each tile's last split has little
# to merge), up to 36% slower below (B=1 ctx 32k 2.19 vs 3.01 TB/s: one split merges many).
# So by default fused from FUSED_MIN_ITEMS items on, where it saves a launch per layer;
# ``FUSED_COMBINE`` True / False (or ``ATTN_OPS_TRITON_FUSED_COMBINE=1`` / ``0``) forces it.
FUSED_MIN_ITEMS = 256
_FORCED = os.environ.get("ATTN_OPS_TRITON_FUSED_COMBINE")
FUSED_COMBINE: bool | None = None if _FORCED is None else _FORCED == "1"


def fused_combine(num_reqs: int, kv_heads: int) -> bool:
    """Whether a split launch over ``num_reqs`` requests combines its splits inside itself."""
    if FUSED_COMBINE is not None:
        return FUSED_COMBINE
    return num_reqs * kv_heads >= FUSED_MIN_ITEMS


_COUNTERS: dict = {}  # device -> zeroed int32 tickets, one per (tile, KV head); reset by use


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed tickets on ``device`` (made during a CUDA-graph capture, they come
    from the graph's pool and each replay zeroes them again: harmless, they are zero anyway)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.shape[0] < n:
        counters = _COUNTERS[device] = torch.zeros(max(n, 1 << 16), dtype=torch.int32,
                                                   device=device)
    return counters


def _pow2(n: int, at_least: int = 1) -> int:
    p = at_least
    while p < n:
        p *= 2
    return p


def _launch(query, k_cache, v_cache, out, lse, qsl, seq_lens, block_table, sinks, alibi,
            k_scale, v_scale, tree, scale, window, soft_cap, causal, num_reqs, num_tokens, splits,
            prefill, max_seq_len):
    """One launch of the attention kernel over ``num_reqs`` requests (tensors already sliced to
    them) whose queries are at most ``num_tokens`` rows and contexts at most ``max_seq_len``."""
    from attn_ops.backends.triton_attn_kernels import (combine_splits_kernel,
                                                       paged_attention_kernel)

    hq, d, dv = query.shape[1], query.shape[2], out.shape[2]
    group = hq // k_cache.shape[2]
    group_p, d_p, dv_p = _pow2(group), _pow2(d, 16), _pow2(dv, 16)
    wide = max(d_p, dv_p) <= 128
    q_bytes, kv_bytes = query.element_size(), k_cache.element_size()
    if prefill:
        tile = prefill_tile(wide, q_bytes, max_seq_len)
    else:
        tile = decode_tile(num_reqs * k_cache.shape[2], splits, kv_bytes,
                           _num_sms(query.device), wide)
    if query.is_cuda:
        tile = fit_tile(tile, d_p, dv_p, q_bytes, kv_bytes, shared_memory_per_block(query.device))
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
    grid = (num_reqs if one_row else num_tokens // block_q + num_reqs, k_cache.shape[2], splits)
    fused = splits > 1 and fused_combine(num_reqs, k_cache.shape[2])
    paged_attention_kernel[grid](
        query, k_cache, v_cache, out, lse if lse is not None else dummy, part_o, part_lse,
        qsl, seq_lens, block_table, sinks if sinks is not None else dummy,
        alibi if alibi is not None else dummy, k_scale if fp8 else dummy,
        v_scale if fp8 else dummy, tree if tree is not None else dummy,
        _counters(query.device, grid[0] * grid[1]) if fused else dummy,
        num_reqs, scale, soft_cap or 0.0, window or 0, tree.shape[0] if tree is not None else 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        lse.stride(0) if lse is not None else 0,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        GROUP=group, GROUP_P=group_p, HQ=hq, PAGE=k_cache.shape[1], BLOCK_Q=block_q,
        BLOCK_N=block_n,
        D=d, D_P=d_p, DV=dv, DV_P=dv_p, CAUSAL=causal, USE_WINDOW=window is not None,
        USE_SOFTCAP=soft_cap is not None, HAS_ALIBI=alibi is not None,
        HAS_SINKS=sinks is not None, FP8=fp8, WRITE_LSE=lse is not None, NUM_SPLITS=splits,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        HAS_TREE=tree is not None, FUSED_COMBINE=fused,
        HEADS_FASTEST=prefill and max_seq_len <= SHORT_PREFILL_KEYS, ONE_ROW=one_row,
        num_warps=warps, num_stages=stages)
    if splits > 1 and not fused:
        combine_splits_kernel[(num_tokens, hq)](
            out, lse if lse is not None else dummy, part_o, part_lse, qsl,
            sinks if sinks is not None else dummy, v_scale if fp8 else dummy, num_reqs,
            out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
            HQ=hq, NUM_SPLITS=splits, SPLITS_P=_pow2(splits), DV=dv, DV_P=dv_p,
            HAS_SINKS=sinks is not None, FP8=fp8, WRITE_LSE=lse is not None,
            num_warps=4)


def unsplit_decode(query, k_cache, v_cache, out, lse, query_start_loc, seq_lens, block_table,
                   max_seq_len, scale, window, soft_cap, causal) -> None:
    """One unsplit decode launch over every request of ``seq_lens`` (single query rows, 16-bit
    K/V halves as :func:`~attn_ops.kv_cache.split_kv_cache` gives them): how FLASHINFER runs the
    decodes its rule gives this kernel (``flashinfer.decode_kernel``)."""
    _launch(query, k_cache, v_cache, out, lse, query_start_loc, seq_lens, block_table,
            sinks=None, alibi=None, k_scale=None, v_scale=None, tree=None, scale=scale,
            window=window, soft_cap=soft_cap, causal=causal, num_reqs=seq_lens.shape[0],
            num_tokens=query.shape[0], splits=1, prefill=False, max_seq_len=max_seq_len)


def _triton_attention(query, kv_cache, query_start_loc, seq_lens, block_table, bounds, out, lse,
                      sinks, alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap,
                      causal, tree=None) -> None:
    _check(query, kv_cache, query_start_loc, seq_lens, block_table, bounds, out, lse, sinks,
           alibi_slopes, k_scale, v_scale)
    if query.device.type == "cpu" and not interpreting():
        raise RuntimeError("TRITON_ATTN runs on the CPU only in Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before importing attn_ops (tests)")
    num_decodes, num_decode_tokens, splits, num_tokens, max_seq_len = bounds.tolist()
    k_cache, v_cache = split_kv_cache(kv_cache, query.shape[2], out.shape[2])
    num_reqs, rows = seq_lens.shape[0], query.shape[0]
    args = dict(sinks=sinks, alibi=alibi_slopes, k_scale=k_scale, v_scale=v_scale, tree=tree,
                scale=scale, window=sliding_window, soft_cap=soft_cap, causal=causal,
                max_seq_len=max_seq_len)
    if num_decodes:
        _launch(query, k_cache, v_cache, out, lse, query_start_loc, seq_lens, block_table,
                num_reqs=num_decodes, num_tokens=num_decode_tokens, splits=splits,
                prefill=False, **args)
    if num_decodes < num_reqs:
        prefill_tokens = (num_tokens if num_tokens >= 0 else rows) - num_decode_tokens
        _launch(query, k_cache, v_cache, out, lse, query_start_loc[num_decodes:],
                seq_lens[num_decodes:], block_table[num_decodes:], num_reqs=num_reqs - num_decodes,
                num_tokens=prefill_tokens, splits=1, prefill=True, **args)
    if 0 <= num_tokens < rows:  # padding rows are zero, like REFERENCE's
        out[num_tokens:].zero_()
        if lse is not None:
            lse[num_tokens:].zero_()
    elif num_tokens < 0:  # a CUDA-graph batch: the padding starts at query_start_loc[-1]
        from attn_ops.backends.triton_attn_kernels import zero_padding_kernel

        zero_padding_kernel[(rows,)](
            out, lse if lse is not None else out, query_start_loc, num_reqs, rows,
            out.shape[1] * out.shape[2], out.stride(0), lse.stride(0) if lse is not None else 0,
            HQ=out.shape[1], HQ_P=_pow2(out.shape[1]), WRITE_LSE=lse is not None, BLOCK=1024)


def _check(query, kv_cache, query_start_loc, seq_lens, block_table, bounds, out, lse, sinks,
           alibi_slopes, k_scale, v_scale):
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)
    if bounds.device.type != "cpu" or bounds.dtype != torch.int64 or bounds.shape != (5,):
        raise ValueError(f"bounds must be a CPU int64 [5] tensor (TritonAttnMetadata), got "
                         f"{bounds.dtype} {tuple(bounds.shape)} on {bounds.device}")


def _fake(query, kv_cache, query_start_loc, seq_lens, block_table, bounds, out, lse, sinks,
          alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap, causal) -> None:
    _check(query, kv_cache, query_start_loc, seq_lens, block_table, bounds, out, lse, sinks,
           alibi_slopes, k_scale, v_scale)


triton_attention = define_op(
    "triton_attention",
    "(Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_table, Tensor bounds, Tensor(a!) out, Tensor(b!)? lse, Tensor? sinks, "
    "Tensor? alibi_slopes, Tensor? k_scale, Tensor? v_scale, float scale, int? sliding_window, "
    "float? soft_cap, bool causal) -> ()",
    _triton_attention, _fake, dispatch_keys=("CPU", "CUDA"), fp8_output_at=6)


class TritonAttnBackend(AttentionBackend):
    """Our Triton kernels: decodes with split-KV, prefills in larger tiles, one op."""

    name = "TRITON_ATTN"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA, PlatformKind.ROCM, PlatformKind.CPU}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        head_dims=HeadDims(multiple_of=8, min=8, max=256),
        kv_cache_dtypes=frozenset(KVCacheDType),
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
        reasons = super().not_supported_reasons(spec, platform)
        if platform.kind is PlatformKind.CPU:
            if not interpreting():
                reasons.append(Reason(cls.name, "platform", f"platform cpu: {cls.name} runs on "
                                      "the CPU only in Triton's interpreter (TRITON_INTERPRET=1, "
                                      "for tests)"))
            if spec.dtype == torch.bfloat16:
                reasons.append(Reason(cls.name, "dtype", "dtype=bfloat16: tl.dot in bf16 is "
                                      "broken in Triton's interpreter", "use float16/float32"))
        return reasons

    @classmethod
    def kv_cache_layout(cls, spec: AttentionSpec) -> KVCacheLayout:
        return KVCacheLayout.for_spec(spec)

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttnMetadata:
        if not isinstance(common, CommonAttentionMetadata):
            return common
        splits = choose_num_splits(common.num_decodes, self.spec.kv_heads, common.max_seq_len,
                                   _num_sms(common.seq_lens.device))
        bounds = torch.tensor([common.num_decodes, common.num_decode_tokens, splits,
                               common.num_actual_tokens, common.max_seq_len], dtype=torch.int64)
        return TritonAttnMetadata(common.slot_mapping, common.query_start_loc, common.seq_lens,
                                  common.block_table, bounds, common.causal)

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> TritonAttnMetadata:
        """The padded common tensors (persistent) and bounds fixed per capture size: splits
        from the size and the graphs' longest request, the token count left to the device."""
        super().graph_metadata(padded, graphs)
        size = padded.num_reqs
        key = ("TRITON_ATTN bounds", self.spec.kv_heads, size)
        bounds = graphs.backend_state.get(key)
        if bounds is None:
            decodes = padded.num_decodes
            splits = choose_num_splits(decodes, self.spec.kv_heads, graphs.max_seq_len,
                                       _num_sms(graphs.device))
            bounds = graphs.backend_state[key] = torch.tensor(
                [decodes, decodes * graphs.query_len if decodes else 0, splits, -1,
                 graphs.max_seq_len],
                dtype=torch.int64)
        return TritonAttnMetadata(padded.slot_mapping, padded.query_start_loc, padded.seq_lens,
                                  padded.block_table, bounds, padded.causal)

    def op_arguments(self, query, kv_cache, metadata, out, *, lse=None, sinks=None,
                     alibi_slopes=None, k_scale=None, v_scale=None) -> tuple:
        m, spec = metadata, self.spec
        return (query, kv_cache, m.query_start_loc, m.seq_lens, m.block_table, m.bounds, out,
                lse, sinks, alibi_slopes, k_scale, v_scale, self.scale, spec.sliding_window,
                spec.logits_soft_cap, spec.causal and m.causal)
