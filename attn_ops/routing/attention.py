"""Standard attention's routing: FlashInfer's split-KV decode, the sm90 composite's choice
between FlashInfer, FA4 and TRITON_ATTN, FlashAttention 4's tiles and modes, TRITON_ATTN's
launches and FlexAttention's layouts."""

from __future__ import annotations

import math

import torch

from attn_ops.routing.common import DeviceFacts, Kernel, PartRoute, Split, SplitMode, _waves
from attn_ops.tuning import (CompositeTuning, FA4Tile, FlashAttnTuning, FlashInferTuning,
                             FlexTuning, Tile, TritonTuning, Tuning)

__all__ = [
    "composite_decode_route", "composite_graph_decode_runs_fa4", "fa4_batch", "fa4_decode_wins",
    "fa4_tile", "flashinfer_decode_split", "flashinfer_graph_colocated_ctas",
    "flashinfer_split_budget", "flex_decode_splits", "flex_decode_stages", "flex_gathers",
    "triton_decode_tile", "triton_fit_tile", "triton_fused_combine", "triton_heads_fastest",
    "triton_num_splits", "triton_prefill_tile", "triton_short_and_many",
]

# ---------------------------------------------------------------------------------------------
# FlashInfer: split-KV decode


def flashinfer_split_budget(num_sms: int, kv_heads: int) -> int:
    """The most requests FlashInfer's split rule may split: two CTAs per SM, one per (request,
    KV head) chunk. Beyond it, the rule cannot split."""
    return 2 * num_sms // kv_heads


def flashinfer_decode_split(requests: int, kv_heads: int, max_pages: int, block_size: int,
                            num_sms: int, t: FlashInferTuning) -> Split:
    """FlashInfer's split for a decode part. With at least one (request, KV head) item per SM
    there is nothing to split; past the split budget "no split" is said outright, which makes
    a plan independent of the lengths (kept from step to step). Fewer items than SMs: chunks
    of about one CTA per SM (FlashInfer's rule aims at two) until a chunk holds
    ``own_rule_min_chunk_keys`` keys."""
    items = requests * kv_heads
    if items >= num_sms:
        return Split(SplitMode.NONE if requests > flashinfer_split_budget(num_sms, kv_heads)
                     else SplitMode.LIBRARY_RULE)
    if t.own_rule_min_chunk_keys is None:
        return Split(SplitMode.LIBRARY_RULE)
    chunk = -(-max_pages // (num_sms // items))
    if chunk * block_size >= t.own_rule_min_chunk_keys:
        return Split(SplitMode.LIBRARY_RULE)
    return Split(SplitMode.FIXED, chunk)


def flashinfer_graph_colocated_ctas(size: int, kv_heads: int, num_sms: int,
                                    t: FlashInferTuning) -> int:
    """CTAs of FlashInfer's two-per-SM split budget to declare taken in the CUDA-graph decode
    plan of ``size`` requests (padding included): with ``graph_one_cta_per_sm`` a size of
    fewer items than SMs gets ``size * (SMs // items)`` CTAs per KV head -- one per SM, like
    the eager plans -- and the padded grid the size fixes."""
    per_request = num_sms // (size * kv_heads)
    if not t.graph_one_cta_per_sm or per_request == 0:
        return 0
    return 2 * num_sms - kv_heads * size * per_request


# ---------------------------------------------------------------------------------------------
# COMPOSITE_SM90: FlashInfer, FA4 or TRITON_ATTN for the decode part


def fa4_decode_wins(items: int, max_keys: int, num_sms: int, t: CompositeTuning) -> bool:
    """Whether FA4 in its decode tile (no split on sm90: one CTA per item) beats the split
    decodes for ``items`` (request, KV head) items of at most ``max_keys`` keys: from
    ``fa4_min_waves`` to one wave at short lengths, from ``fa4_any_keys_from_waves`` at any
    length; from ``fa4_many_waves`` on at long lengths only."""
    if t.fa4_min_waves is None:
        return False
    waves = _waves(items, num_sms)
    if waves >= t.fa4_many_waves:
        return max_keys >= t.fa4_many_waves_min_keys
    if waves >= 1:
        return False
    return waves >= t.fa4_min_waves and (max_keys <= t.fa4_max_keys_below_wave
                                         or waves >= t.fa4_any_keys_from_waves)


def composite_decode_route(requests: int, kv_heads: int, max_pages: int, block_size: int,
                           query_rows: int, facts: DeviceFacts, tuning: Tuning, *,
                           triton_takes_spec: bool, fa4_decode_tile: FA4Tile | None,
                           fp8_cache: bool = False) -> PartRoute:
    """The decode part's kernel in COMPOSITE_SM90. ``query_rows``: its longest query
    (speculative decodes have several; TRITON_ATTN's kernel and FA4's decode tile were measured
    with one); ``fa4_decode_tile``: the tile FA4 would decode in (:func:`fa4_tile`)."""
    sms, ct = facts.num_sms, tuning.composite
    items, keys = requests * kv_heads, max_pages * block_size
    single = query_rows == 1
    # Short decodes that fill the SMs several times over: our unsplit kernel, 4 per SM.
    if single and triton_takes_spec and not fp8_cache and ct.triton_max_items_per_sm \
            and triton_short_and_many(items, keys, sms, tuning.triton) \
            and items <= ct.triton_max_items_per_sm * sms:
        return PartRoute(Kernel.TRITON, why=f"{_waves(items, sms):.1f} items per SM of at most "
                         f"{tuning.triton.short_decode_keys} keys")
    if single and fa4_decode_tile is not None and fa4_decode_wins(items, keys, sms, ct):
        return PartRoute(Kernel.FA4, fa4_tile=fa4_decode_tile,
                         why=f"{_waves(items, sms):.2f} waves at {keys} keys: FA4's decode tile")
    if ct.plain_fa4_min_waves is not None and not (single and fa4_decode_tile is not None) \
            and ct.plain_fa4_min_waves * sms < items < sms and keys <= ct.plain_fa4_max_keys:
        return PartRoute(Kernel.FA4, why=f"{_waves(items, sms):.2f} waves: FA4 without a split")
    split = flashinfer_decode_split(requests, kv_heads, max_pages, block_size, sms,
                                    tuning.flashinfer)
    return PartRoute(Kernel.FLASHINFER_FA2, split,
                     why=f"{_waves(items, sms):.2f} waves of (request, KV head) items")


def composite_graph_decode_runs_fa4(size: int, kv_heads: int, facts: DeviceFacts,
                                    t: CompositeTuning, fa4_decode_tile: FA4Tile | None) -> bool:
    """Whether COMPOSITE_SM90's decode graph of ``size`` requests runs FA4 in its decode tile
    (one CTA per item, no plan) instead of FlashInfer's graph decode."""
    if fa4_decode_tile is None or t.graph_fa4_waves is None:
        return False
    low, high = t.graph_fa4_waves
    waves = _waves(size * kv_heads, facts.num_sms)
    return low <= waves <= high


# ---------------------------------------------------------------------------------------------
# FlashAttention 4


def fa4_tile(major: int, head_dim: int, head_dim_v: int, dtype: torch.dtype, max_q: int,
             group: int, t: FlashAttnTuning, batch: bool = False) -> FA4Tile | None:
    """FA4's tile for a call (None: FA4's own). sm90, head dim 128, 16-bit only: single-row
    decodes take ``decode_tile``, prefills of enough rows ``tall_tile`` -- each only where the
    GQA group divides its rows (FA4 packs a group's heads into the rows and loads Q by TMA only
    then; otherwise by cp.async, provisioned for two MMA warpgroups, not three)."""
    if major != 9 or head_dim != 128 or head_dim_v != 128 \
            or dtype not in (torch.float16, torch.bfloat16):
        return None
    if max_q == 1 and t.decode_tile is not None and t.decode_tile.rows % group == 0:
        return t.decode_tile
    least = t.tall_tile_min_query_batch if batch else t.tall_tile_min_query
    if t.tall_tile is not None and max_q >= least and t.tall_tile.rows % group == 0:
        return t.tall_tile
    return None


def fa4_batch(rows: int, requests: int, max_q: int, t: FlashAttnTuning) -> bool:
    """Whether a prefill part of ``requests`` requests and ``rows`` rows runs in FA4's batch
    mode: every request of one query length of at least ``batch_mode_min_query`` rows."""
    return t.batch_mode_min_query is not None and rows == requests * max_q \
        and max_q >= t.batch_mode_min_query


# ---------------------------------------------------------------------------------------------
# TRITON_ATTN


def triton_short_and_many(items: int, max_keys: int, num_sms: int, t: TritonTuning) -> bool:
    """Whether decodes of at most ``max_keys`` keys over ``items`` (request, KV head) items run
    unsplit in ``many_items_tile``."""
    return max_keys <= t.short_decode_keys and t.many_items_tile is not None \
        and items >= t.many_items_per_sm * num_sms


def triton_num_splits(num_decodes: int, kv_heads: int, max_seq_len: int, num_sms: int,
                      t: TritonTuning) -> int:
    """Splits of each decode's keys: a power of two, ``decodes x kv_heads x splits`` near
    ``programs_per_sm x SMs``, at least ``min_keys_per_split`` keys a split, at most
    ``max_splits``; none for short decodes that fill the SMs (:func:`triton_short_and_many`).
    As the batch grows the splits shrink step by step: no cliff, no kernel switch."""
    if num_decodes == 0 or triton_short_and_many(num_decodes * kv_heads, max_seq_len, num_sms,
                                                 t):
        return 1
    want = max(1, (t.programs_per_sm * num_sms) // max(1, num_decodes * kv_heads))
    cap = max(1, min(t.max_splits, max_seq_len // t.min_keys_per_split))
    splits = 1
    while splits * 2 <= min(want, cap):
        splits *= 2
    return splits


def triton_decode_tile(items: int, splits: int, kv_bytes: int, num_sms: int, wide: bool,
                       t: TritonTuning) -> Tile:
    """A decode launch's tile: ``many_items_tile`` for an unsplit launch of 16-bit (or fp8)
    K/V with enough items per SM, else ``decode_tile`` (``wide``: padded head dims <= 128)."""
    if splits == 1 and kv_bytes <= 2 and t.many_items_tile is not None \
            and items >= t.many_items_per_sm * num_sms:
        return t.many_items_tile
    return t.decode_tile if wide else t.decode_tile_wide_heads


def triton_prefill_tile(wide: bool, elem_bytes: int, max_seq_len: int, t: TritonTuning) -> Tile:
    """A prefill launch's tile, by padded head dims (``wide``: <= 128) and query bytes."""
    if not wide:
        return t.prefill_tile_wide_heads
    if elem_bytes >= 4:
        return t.prefill_tile_32bit
    if max_seq_len <= t.short_prefill_keys and t.short_prefill_tile_16bit is not None:
        return t.short_prefill_tile_16bit
    return t.prefill_tile_16bit


def triton_heads_fastest(max_seq_len: int, t: TritonTuning) -> bool:
    """Whether a prefill launch puts the KV head fastest in launch order: short prefills are a
    wave or two, and tile-fastest started the heads' longest tiles one after another."""
    return max_seq_len <= t.short_prefill_keys


def _smem_bytes(rows, keys, stages, d_p, dv_p, q_bytes, kv_bytes) -> int:
    """Shared memory of a launch, estimated: ``stages`` K and V tiles as loaded, one more
    converted to the query's dtype when the cache is narrower (fp8), the query tile."""
    kv = keys * (d_p + dv_p)
    return stages * kv * kv_bytes + (kv * q_bytes if kv_bytes < q_bytes else 0) \
        + rows * d_p * q_bytes


def triton_fit_tile(tile: Tile, d_p: int, dv_p: int, q_bytes: int, kv_bytes: int,
                    smem: int) -> Tile:
    """``tile`` within ``smem`` bytes of shared memory: fewer stages (down to 2), then half the
    keys (down to 16), then half the rows. A kernel with more stages than fit fails to launch;
    the H200's 227 KiB fit every tile unchanged, an A100's 163 KiB runs the 16-bit prefill
    tile in 2 stages, a consumer GPU's 99 KiB with 64 keys."""
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
    return Tile(rows, keys, warps, stages)


def triton_fused_combine(num_reqs: int, kv_heads: int, t: TritonTuning) -> bool:
    """Whether a split launch combines its splits inside itself (saves a launch; slow where one
    split must merge many, at few items)."""
    if t.fused_combine is not None:
        return t.fused_combine
    return num_reqs * kv_heads >= t.fused_min_items


# ---------------------------------------------------------------------------------------------
# FlexAttention


def flex_gathers(prefill_pairs: int, copied_keys: int, on_gpu: bool, t: FlexTuning) -> bool:
    """Whether a step with prefills copies its pages into larger ones first: FlexAttention's
    key tile never spans more than one page, and a prefill's (query, key) pairs make the copy
    worth it from ``gather_min_pairs_per_key_gpu`` pairs per copied key (``_cpu``: the CPU's
    rule, off by default -- it has no key-tile problem)."""
    threshold = t.gather_min_pairs_per_key_gpu if on_gpu else t.gather_min_pairs_per_key_cpu
    return threshold is not None and prefill_pairs >= threshold * copied_keys


def flex_decode_splits(batch: int, kv_heads: int, num_sms: int | None,
                       t: FlexTuning) -> int | None:
    """FlexAttention's split count for a decode-layout step of ``batch`` elements: a power of
    two near ``decode_programs_per_sm x SMs / (batch x kv_heads)`` (SMs: ``t.decode_num_sms``,
    else the device's ``num_sms``), or None (FlexAttention's own, with full KV blocks) where
    that is below 2 or off the GPU without ``decode_num_sms``."""
    num_sms = t.decode_num_sms or num_sms
    if not t.decode_programs_per_sm or num_sms is None:
        return None
    want = t.decode_programs_per_sm * num_sms / (batch * kv_heads)
    splits = 1 << max(round(math.log2(want)), 0) if want > 0 else 1
    return splits if splits >= 2 else None


def flex_decode_stages(key_tile: int, head_dim: int, head_dim_v: int, itemsize: int,
                       smem: int, t: FlexTuning) -> int | None:
    """Pipeline stages of FlexAttention's decoding kernel: its key tile is at most a page, so
    its default 2-3 stages leave HBM idle; ``decode_stages`` or as many as fit
    ``decode_stage_bytes`` and the block's shared memory less 24 KiB (None below 3: its own)."""
    if not t.decode_stages:
        return None
    stage = key_tile * (head_dim + head_dim_v) * itemsize
    stages = min(t.decode_stages, min(t.decode_stage_bytes, smem - (24 << 10)) // stage)
    return stages if stages >= 3 else None
