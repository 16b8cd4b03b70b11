"""Routing is policy, in one place: which kernel runs each part of a step, and how.

Every per-step decision of every backend is a pure function here, over typed inputs -- the
device's facts (:class:`DeviceFacts`), the shape of a part of the batch, and the backend's
section of the :class:`~attn_ops.tuning.Tuning` -- returning a typed route. Backends build
their plans from these routes and execute them; none decides on its own. Each rule's comment
says why it holds; the measurements behind the numbers are in ``docs/tuning.md``.

Read top to bottom: FlashInfer's split-KV decode, the sm90 composite's choice between
FlashInfer, FA4 and TRITON_ATTN, FlashAttention 4's tiles and modes, TRITON_ATTN's launches,
FlexAttention's layouts, and :func:`explain`, which prints the route of every part of a step
(``python -m attn_ops select ... --batch 64x4096,1x8192:8192``).
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

import torch

from typing import NamedTuple

from attn_ops.tuning import (CompositeTuning, FA4Tile, FlashAttnTuning, FlashInferTuning,
                             FlexTuning, MLATuning, Tile, TritonTuning, Tuning)

__all__ = [
    "DeviceFacts", "Kernel", "MLADecodeLaunch", "PartRoute", "Split", "SplitMode", "StepShape",
    "composite_decode_route", "composite_graph_decode_runs_fa4", "explain", "explain_mla",
    "fa4_batch",
    "fa4_decode_wins", "fa4_tile", "flashinfer_decode_split", "flashinfer_graph_colocated_ctas",
    "flashinfer_mla_kernel", "flashinfer_mla_shared_bytes", "flashinfer_split_budget",
    "flex_decode_splits", "flex_decode_stages", "flex_gathers",
    "mla_decode_launch", "mla_prefill_kernel", "pow2", "ssm_kernel",
    "triton_decode_tile", "triton_fit_tile", "triton_fused_combine", "triton_num_splits",
    "triton_prefill_tile", "triton_short_and_many",
]

# SM counts of GPUs by compute capability, for simulated platforms (the CLI, tests): a real
# device's count is read from it.
_SMS_BY_CAPABILITY = {(8, 0): 108, (8, 6): 84, (8, 9): 128, (9, 0): 132, (10, 0): 148,
                      (12, 0): 170}
# (shared memory per SM, the most one block may opt into), bytes, of each capability's GPUs
_SHARED_MEMORY_BY_CAPABILITY = {(8, 0): (167936, 166912), (8, 6): (102400, 101376),
                                (8, 7): (167936, 166912), (8, 9): (102400, 101376),
                                (9, 0): (233472, 232448), (10, 0): (233472, 232448),
                                (12, 0): (102400, 101376)}


@dataclass(frozen=True)
class DeviceFacts:
    """What the rules read of a device: its SM count and compute capability."""

    num_sms: int
    capability: tuple[int, int] | None = None
    shared_memory: tuple[int, int] | None = None  # (per SM, per block opted in), bytes

    @property
    def major(self) -> int:
        return self.capability[0] if self.capability else 0

    @classmethod
    def of(cls, device: torch.device) -> DeviceFacts:
        """A real device's facts (an interpreter's CPU "device" counts 8 SMs, so that CPU tests
        exercise split-KV)."""
        if device.type != "cuda":
            return cls(8, None)
        return _cuda_facts(device.index if device.index is not None
                           else torch.cuda.current_device())

    @classmethod
    def for_platform(cls, platform) -> DeviceFacts:
        """A platform's facts: the device's own where it is this machine's, else (simulated) the
        SM count of the usual GPU of that capability."""
        cap = platform.capability
        if not platform.simulated and platform.is_gpu and torch.cuda.is_available():
            return cls.of(torch.device("cuda"))
        return cls(_SMS_BY_CAPABILITY.get(cap, 132 if cap else 8), cap,
                   _SHARED_MEMORY_BY_CAPABILITY.get(cap))


@functools.cache
def _cuda_facts(index: int) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    cap = (props.major, props.minor)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", None)
    per_block = getattr(props, "shared_memory_per_block_optin", None)
    shared = (int(per_sm), int(per_block)) if per_sm and per_block \
        else _SHARED_MEMORY_BY_CAPABILITY.get(cap)
    return DeviceFacts(props.multi_processor_count, cap, shared)


class Kernel(enum.Enum):
    """The kernels a part of a step can run on (values: how tables and errors name them)."""

    FLASHINFER_FA2 = "FlashInfer FA2 paged (tensor-core decode)"
    FLASHINFER_FA3 = "FlashInfer FA3 paged (sm90)"
    FA4 = "FlashAttention 4"
    TRITON = "TRITON_ATTN unsplit decode"
    FLASHINFER_RAGGED = "FlashInfer ragged prefill"
    TORCH_MHA = "PyTorch MHA (REFERENCE_MLA's, one request at a time)"
    FLASHINFER_MLA_FA3 = "FlashInfer MLA fa3 (sm90)"
    FLASHINFER_MLA_FA2 = "FlashInfer MLA fa2"
    FLASHMLA = "FlashMLA dense decode"
    FA3_MLA = "FlashAttention 3 MLA path (q_v)"
    TRITON_MLA = "TRITON_MLA split-KV absorbed kernel"
    SSM_TORCH = "PyTorch recurrences (the reference, token by token)"
    SSM_TRITON = "our Triton recurrent kernels"
    SSM_TRITON_CHUNKED = "our Triton chunked kernels"


class SplitMode(enum.Enum):
    LIBRARY_RULE = "FlashInfer's own split rule"
    NONE = "no split"
    FIXED = "fixed chunks"


@dataclass(frozen=True)
class Split:
    """FlashInfer's split-KV for a part: its own rule, none, or chunks of ``chunk_pages``."""

    mode: SplitMode
    chunk_pages: int | None = None

    def __str__(self) -> str:
        if self.mode is SplitMode.FIXED:
            return f"split into chunks of {self.chunk_pages} pages"
        return str(self.mode.value)


@dataclass(frozen=True)
class PartRoute:
    """The kernel of one part of a step, its split (FlashInfer kernels), its FA4 tile, and the
    rule that chose it."""

    kernel: Kernel
    split: Split | None = None
    fa4_tile: FA4Tile | None = None
    why: str = ""


def _waves(items: int, num_sms: int) -> float:
    return items / num_sms


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


class MLADecodeLaunch(NamedTuple):
    """TRITON_MLA's absorbed launch: ``splits`` of each request's keys, ``query_rows`` (a
    power of two >= the longest absorbed query) x ``heads`` rows a program, ``keys`` latent
    rows a step, warps, pipeline stages."""

    splits: int
    query_rows: int
    heads: int
    keys: int
    warps: int
    stages: int
    value_parts: int = 1


def combine_split_block(splits: int, value_width: int) -> int:
    """Splits a split-combine program reads at a time: all of them while their rows of
    ``value_width`` fp32 values stay within 4096 values (32 registers a thread at 4 warps),
    else in blocks that do -- TRITON_ATTN's few narrow splits in one pass, MLA's many 512-wide
    ones in blocks of 8, never a spilled tile."""
    return min(pow2(splits), max(1, 4096 // pow2(value_width)))


def mla_decode_launch(heads: int, requests: int, max_query_len: int, max_seq_len: int,
                      num_sms: int, t: MLATuning, latent_bytes: int = 0,
                      convert_bytes: int = 0, smem: int = 0,
                      rank_p: int = 0) -> MLADecodeLaunch:
    """A program takes ``decode_rows`` (query x head) rows of one request -- all its query
    rows, as many heads as fit, at least 16 rows for the MMA -- and one split of its keys;
    splits (a power of two) bring programs near ``programs_per_sm x SMs``, at least
    ``min_keys_per_split`` keys a split, at most ``max_splits``. The split count falls step
    by step as the batch grows: no cliff, no kernel switch. A program of fewer rows takes
    the narrow warps and stages. With ``smem`` (bytes a block may use), ``latent_bytes`` (a
    cached row as stored) and ``convert_bytes`` (that row converted for the MMA, when the
    cache is narrower), the stages, then the keys, shrink until ``stages`` loaded tiles and a
    converted one fit: a launch that does not fails. The H200's 227 KiB fit 3 stages of 64
    bf16 rows of 512 + 64. ``value_parts`` 2 halves each program's value columns (latent
    tiles ``rank_p`` >= 32 wide: halves of at least the MMA's 16)."""
    if t.value_parts not in (1, 2):
        raise ValueError(f"Tuning.mla.value_parts={t.value_parts} must be 1 or 2")
    parts = 2 if t.value_parts == 2 and rank_p >= 32 else 1
    query_rows = pow2(max(1, max_query_len))
    head_rows = min(pow2(heads), max(1, t.decode_rows // query_rows))
    head_rows = max(head_rows, 16 // min(16, query_rows))
    items = max(1, requests) * -(-heads // head_rows) * parts
    want = max(1, t.programs_per_sm * num_sms // items)
    cap = max(1, min(t.max_splits, max_seq_len // t.min_keys_per_split))
    splits = 1
    while splits * 2 <= min(want, cap):
        splits *= 2
    narrow = query_rows * head_rows < t.decode_rows
    warps, stages = (t.narrow_warps, t.narrow_stages) if narrow else (t.decode_warps,
                                                                       t.decode_stages)
    keys = t.decode_keys
    while smem and keys * (stages * latent_bytes + convert_bytes) > smem and \
            (stages > 1 or keys > 16):
        if stages > 1:
            stages -= 1
        else:
            keys //= 2
    return MLADecodeLaunch(splits, query_rows, head_rows, keys, warps, stages, parts)


def sparse_mla_splits(rows: int, heads: int, topk: int, num_sms: int, t: MLATuning) -> int:
    """TRITON_MLA_SPARSE's splits of each token's selected slots: with few tokens a program
    per (token, head block) leaves SMs idle, so the slots split (a power of two) until the
    programs near ``programs_per_sm x SMs``, each split at least ``min_keys_per_split``
    slots, at most ``max_splits``; ``Tuning.mla.sparse_splits`` > 0 fixes the count."""
    if t.sparse_splits > 0:
        return t.sparse_splits
    head_blocks = -(-heads // max(16, min(t.sparse_heads, pow2(heads))))
    want = max(1, t.programs_per_sm * num_sms // max(1, rows * head_blocks))
    cap = max(1, min(t.max_splits, topk // t.min_keys_per_split))
    splits = 1
    while splits * 2 <= min(want, cap):
        splits *= 2
    return splits


def indexer_score_chunk(rows: int, positions: int, block_n: int, num_sms: int,
                        t: MLATuning) -> int:
    """Positions a program of the indexer's scoring covers: ``Tuning.mla.index_chunk``, halved
    (a power of two, not below 256 nor ``block_n``) while the step's programs
    (rows x chunks) stay under ``programs_per_sm x SMs`` -- few decode rows over a long
    context split their positions over the SMs, many rows keep long programs (the row's
    query heads are loaded once a program)."""
    chunk = max(block_n, pow2(t.index_chunk))
    floor = max(block_n, 256)
    want = t.programs_per_sm * num_sms
    while chunk // 2 >= floor and rows * -(-positions // chunk) < want:
        chunk //= 2
    return chunk


def indexer_select_span(rows: int, positions: int, block: int, num_sms: int,
                        t: MLATuning) -> int:
    """Positions a program of the indexer's top-k select covers (each launch runs rows x
    spans programs): ``block``, doubled while the programs exceed ``index_select_programs_per_sm
    x SMs`` (each program re-reads its row's histograms: longer spans for many rows) and the
    span is short of the positions."""
    span = block
    want = t.index_select_programs_per_sm * num_sms
    while span < positions and rows * -(-positions // span) > want:
        span *= 2
    return span


def flashinfer_mla_kernel(capability: tuple[int, int], kv_lora_rank: int) -> Kernel:
    """FLASHINFER_MLA's absorbed kernel: fa3 on sm90 for latent widths 128 / 256 / 512 (its
    templates), fa2 elsewhere. Measured on the H200 at 512 + 64: fa3 471-503 TFLOP/s at 128
    heads and batch 32-128, fa2 258-269."""
    if capability[0] == 9 and kv_lora_rank in (128, 256, 512):
        return Kernel.FLASHINFER_MLA_FA3
    return Kernel.FLASHINFER_MLA_FA2


def flashinfer_mla_shared_bytes(kernel: Kernel, rank: int, rope: int, fp8: bool,
                                shared_per_sm: int) -> int | None:
    """Shared memory one block of FlashInfer 0.7's MLA kernel takes for latent width ``rank``
    and rope width ``rope`` (its templates' storage: the query tile, the KV stages, the
    output staging), or None where the fa2 kernel has no tiling for an SM of
    ``shared_per_sm`` bytes. fa3 at 512 + 64 takes 222,048 of the H200's 232,448; at
    512 + 128 it would take 246,624, which FlashInfer refuses at plan time."""
    align16 = lambda size: -(-size // 16) * 16  # noqa: E731
    q_bytes = 64 * (rank + rope) * 2
    elem = 1 if fp8 else 2
    if kernel is Kernel.FLASHINFER_MLA_FA3:
        stage = 64 * rank * elem + max(64 * rope * elem, 64 * 64 * 2)
        repack = align16(64 * rank * 2) + align16(max(64 * rope, 1) * 2) if fp8 else 32
        return q_bytes + max(2 * stage + repack, 64 * rank * 2) + 3 * 64 * 4 + 64
    if shared_per_sm >= 221696:
        stages, tile = 2, 64
    elif shared_per_sm >= 147968:
        stages, tile = 2, 32
    elif shared_per_sm >= 92672:
        stages, tile = 1, 16
    else:
        return None
    tile = 32 if fp8 else tile
    kv_bytes = stages * tile * (rank + max(rope, 64)) * elem
    repack = align16(stages * tile * rank * 2) + align16(stages * tile * max(rope, 1) * 2) \
        if fp8 else 32
    return max(q_bytes + kv_bytes + repack + 2 * 64 * 4, 64 * rank * 2)


# FlashMLA's tile scheduler (get_decoding_sched_meta) keeps 5 ints a batch row in one block's
# shared memory: 4 * (5 * rows + 1) bytes of the 232,448 an sm90 / sm100 block may take.
FLASHMLA_MAX_ROWS = 11622


def mla_absorbed_route(heads: int, requests: int, max_query_len: int, max_seq_len: int,
                       t: MLATuning, fa3_usable: bool = False) -> PartRoute:
    """The kernel of an MLA step's absorbed part where FlashMLA, FlashInfer's MLA (fa3) and
    TRITON_MLA can run it, and FlashAttention 3's MLA path where ``fa3_usable``
    (COMPOSITE_MLA_SM90): for a handful of query rows, FA3's MLA path (it splits one request's
    keys over the SMs and its op writes in place), else TRITON_MLA's split kernel over long
    contexts; FlashMLA for many requests over long contexts; FlashInfer's fa3 kernel elsewhere
    (the fastest at short contexts and mid batches, within a few percent of the best at the
    rest). H200, 512 + 64 latents, bf16 (docs/performance.md): 16 heads x 1 request, FA3's MLA
    op 1.06-1.42x the best as vLLM runs it at 1k-32k (TRITON_MLA 0.89-1.34x, FlashInfer's
    0.99-1.02x); 64-128 requests at 32k, FlashMLA's op 1.02-1.10x FlashInfer's; FlashMLA
    0.47-0.93x FlashInfer below 32 requests, 0.89-1.00x at 8k."""
    rows = requests * max_query_len * heads
    small = f"{rows} query x head row(s) <= {t.route_small_max_rows}"
    if rows <= t.route_small_max_rows:
        if fa3_usable:
            return PartRoute(Kernel.FA3_MLA, why=small)
        if max_seq_len >= t.route_triton_min_keys:
            return PartRoute(Kernel.TRITON_MLA, why=f"{small} over >= "
                             f"{t.route_triton_min_keys} keys, FA3 not installed")
    if (t.route_flashmla_min_requests <= requests <= FLASHMLA_MAX_ROWS
            and max_seq_len >= t.route_flashmla_min_keys):
        return PartRoute(Kernel.FLASHMLA, why=f"{requests} request(s) >= "
                         f"{t.route_flashmla_min_requests} over >= {t.route_flashmla_min_keys} "
                         "keys")
    return PartRoute(Kernel.FLASHINFER_MLA_FA3, why="short contexts or few requests")


def ssm_kernel(on_gpu: bool, dtype: torch.dtype, triton_available: bool,
               max_query_len: int = 1, one_slot: bool = True,
               chunked_min_query_len: int | None = None) -> Kernel:
    """The kernels of a recurrent-state op (``backends/ssm``): Triton on GPUs for 16- and
    32-bit inputs (they compute in fp32), else the torch body -- on the CPU, and for fp64, the
    oracle's precision, which fp32 kernels must not round. Ops with a chunked kernel
    (``chunked_min_query_len`` given: ``Tuning.ssm``) run it for steps whose longest request
    has at least that many new tokens, one state slot a request."""
    if not (on_gpu and triton_available and dtype != torch.float64):
        return Kernel.SSM_TORCH
    if chunked_min_query_len is not None and one_slot and max_query_len >= chunked_min_query_len:
        return Kernel.SSM_TRITON_CHUNKED
    return Kernel.SSM_TRITON


def mla_prefill_kernel(fa4_usable: bool, flashinfer_usable: bool = False, requests: int = 0,
                       flashinfer_max_requests: int = 0) -> Kernel:
    """The kernel of an MLA step's MHA part (QK nope + rope, V v_head_dim, ragged, with LSE)
    for ``requests`` MHA-form requests: FlashInfer's ragged prefill where it can run and FA4
    cannot, or for at most ``flashinfer_max_requests`` (``Tuning.mla.
    flashinfer_prefill_max_requests``: its host plan at each call costs little against few
    long requests and much against many short ones); else FlashAttention 4 where it can run
    (CUDA, installed, the head dims); else PyTorch, slow, for the CPU and tests."""
    if flashinfer_usable and (not fa4_usable or requests <= flashinfer_max_requests):
        return Kernel.FLASHINFER_RAGGED
    return Kernel.FA4 if fa4_usable else Kernel.TORCH_MHA


def explain_mla(backend: str, spec, facts: DeviceFacts, step: StepShape, tuning: Tuning,
                fa4_usable: bool, flashinfer_usable: bool = False,
                fa3_usable: bool = False) -> list[str]:
    """The MLA step split of ``step`` and each form's kernel, as the builder would plan it."""
    t = tuning.mla
    groups = list(step.groups)
    cut = next((i for i, (_, _, q) in enumerate(groups) if q > t.absorbed_max_query_len),
               len(groups))
    absorbed, mha = groups[:cut], groups[cut:]
    lines = []
    if absorbed:
        requests = sum(n for n, _, _ in absorbed)
        rows = sum(n * q for n, _, q in absorbed)
        line = f"absorbed form: {requests} request(s), {rows} row(s) over the latent cache"
        max_q, max_seq = max(q for _, _, q in absorbed), max(s for _, s, _ in absorbed)
        kernel = {"FLASHINFER_MLA": flashinfer_mla_kernel(facts.capability or (0, 0),
                                                          spec.kv_lora_rank),
                  "TRITON_MLA": Kernel.TRITON_MLA}.get(backend)
        if backend == "COMPOSITE_MLA_SM90":
            route = mla_absorbed_route(spec.num_heads, requests, max_q, max_seq, t, fa3_usable)
            kernel, line = route.kernel, f"{line} -- route: {route.why}"
        if kernel is Kernel.TRITON_MLA:
            launch = mla_decode_launch(spec.num_heads, requests, max_q, max_seq, facts.num_sms, t)
            line += (f" -- TRITON_MLA kernel, {launch.splits} split(s) of each request's keys, "
                     f"{launch.query_rows} query x {launch.heads} head rows a program, "
                     f"{launch.keys} keys a step")
        elif kernel is not None:
            line += f" -- {kernel.value}"
        lines.append(line)
    if mha:
        new = sum(n * q for n, _, q in mha)
        context = sum(n * (s - q) for n, s, q in mha)
        chunks = -(-context // t.context_chunk_tokens)
        kernel = (mla_prefill_kernel(fa4_usable, flashinfer_usable, sum(n for n, _, _ in mha),
                                     t.flashinfer_prefill_max_requests).value
                  if backend != "REFERENCE_MLA" else f"{backend}'s")
        lines.append(f"MHA form: {sum(n for n, _, _ in mha)} request(s), {new} new token(s) on "
                     f"{kernel}; {context} context row(s) in {chunks} chunk(s) of at most "
                     f"{t.context_chunk_tokens}, merged through the LSE")
    return lines


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


# ---------------------------------------------------------------------------------------------
# explain: the route of every part of a step


@dataclass(frozen=True)
class StepShape:
    """A step as the CLI describes it: ``(requests, seq_len, query_len)`` groups, decode-first
    (query lengths of at most ``decode_threshold`` are decodes)."""

    groups: tuple[tuple[int, int, int], ...]
    decode_threshold: int = 1

    @classmethod
    def parse(cls, text: str, decode_threshold: int = 1) -> StepShape:
        """``"64x4096,1x8192:8192"``: 64 requests of 4096 tokens decoding one each, one
        request of 8192 tokens all new (``N x SEQ_LEN[:QUERY_LEN]``, query length 1 if left
        out)."""
        groups = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            try:
                count, _, rest = part.lower().partition("x")
                seq, _, query = rest.partition(":")
                group = (int(count), int(seq), int(query) if query else 1)
            except ValueError:
                raise ValueError(f"--batch {part!r} is not N x SEQ_LEN[:QUERY_LEN], e.g. 64x4096 "
                                 "(64 decodes of 4096 tokens) or 1x8192:8192 (a prefill of "
                                 "8192)") from None
            if min(group) < 1 or group[2] > group[1]:
                raise ValueError(f"--batch {part!r}: counts and lengths must be >= 1 and the "
                                 "query length at most the sequence length")
            groups.append(group)
        if not groups:
            raise ValueError("--batch is empty; e.g. --batch 64x4096,1x8192:8192")
        ordered = sorted(groups, key=lambda g: g[2] > decode_threshold)  # (stable)
        return cls(tuple(ordered), decode_threshold)

    def parts(self) -> list[tuple[str, int, int, int, int]]:
        """``(name, requests, rows, longest query, longest seq_len)`` of the decode and the
        prefill part (those with requests)."""
        out = []
        for name, is_decode in (("decode", True), ("prefill", False)):
            gs = [g for g in self.groups if (g[2] <= self.decode_threshold) == is_decode]
            if gs:
                out.append((name, sum(g[0] for g in gs), sum(g[0] * g[2] for g in gs),
                            max(g[2] for g in gs), max(g[1] for g in gs)))
        return out


def explain(backend: str, spec, facts: DeviceFacts, step: StepShape, tuning: Tuning,
            block_size: int, *, triton_takes_spec: bool = True) -> list[str]:
    """One line per part of ``step`` (or one for the step, where ``backend`` runs it in one
    call): the kernel ``backend`` runs it on and why."""
    parts = step.parts()
    if backend in ("FLASH_ATTN", "FLASH_ATTN_DIFFKV", "FLEX_ATTENTION"):  # one call a step
        requests, rows = sum(p[1] for p in parts), sum(p[2] for p in parts)
        max_q, max_seq = max(p[3] for p in parts), max(p[4] for p in parts)
        head = f"whole step: {requests} request(s), {rows} query rows, up to {max_seq} keys"
        if backend == "FLEX_ATTENTION":
            layout = ("decode layout (one batch element per request)" if max_q == 1 else
                      "paged slots, gathered into 128-key pages where the pairs pay for it")
            return [f"{head} -> FlexAttention, {layout}"]
        group = spec.num_heads // spec.kv_heads
        return [f"{head} -> " + _describe_fa4(spec, facts, tuning, rows, requests, max_q, group,
                                              decode=max_q == 1, uniform=len(parts) == 1)]
    lines = []
    for name, requests, rows, max_q, max_seq in parts:
        pages = -(-max_seq // block_size)
        head = f"{name} part: {requests} request(s), {rows} query rows, up to {max_seq} keys"
        route = _explain_part(backend, spec, facts, tuning, name == "decode", requests, rows,
                              max_q, pages, block_size, triton_takes_spec)
        lines.append(f"{head} -> {route}")
    return lines


def _explain_part(backend, spec, facts, tuning, decode, requests, rows, max_q, pages,
                  block_size, triton_takes_spec) -> str:
    kv, group = spec.kv_heads, spec.num_heads // spec.kv_heads
    if backend == "COMPOSITE_SM90":
        if decode:
            tile = fa4_tile(facts.major, spec.head_dim, spec.v_head_dim, spec.dtype, 1, group,
                            tuning.flash_attn)
            return _describe(composite_decode_route(
                requests, kv, pages, block_size, max_q, facts, tuning,
                triton_takes_spec=triton_takes_spec, fa4_decode_tile=tile,
                fp8_cache=spec.kv_cache_dtype.is_fp8))
        return _describe_fa4(spec, facts, tuning, rows, requests, max_q, group, uniform=True)
    if backend == "FLASHINFER":
        if decode:
            split = flashinfer_decode_split(requests, kv, pages, block_size, facts.num_sms,
                                            tuning.flashinfer)
            return f"{Kernel.FLASHINFER_FA2.value}, {split}"
        fa3 = facts.major == 9 and spec.v_head_dim == spec.head_dim \
            and not spec.kv_cache_dtype.is_fp8 and spec.head_dim in (64, 128, 256)
        return (Kernel.FLASHINFER_FA3 if fa3 else Kernel.FLASHINFER_FA2).value
    if backend in ("TRITON_ATTN", "TREE_ATTN"):
        wide = max(triton_head_tiles(spec.head_dim, spec.v_head_dim,
                                     spec.cache_dtype.itemsize)) <= 128
        if decode:
            splits = triton_num_splits(requests, kv, pages * block_size, facts.num_sms,
                                       tuning.triton)
            tile = triton_decode_tile(requests * kv, splits, spec.cache_dtype.itemsize,
                                      facts.num_sms, wide, tuning.triton)
            combine = ("combined in the kernel" if triton_fused_combine(requests, kv,
                                                                          tuning.triton)
                       else "combined by a second kernel")
            return (f"TRITON_ATTN decode, {splits} split(s)"
                    + (f" ({combine})" if splits > 1 else "") + f", tile {tuple(tile)}")
        tile = triton_prefill_tile(wide, spec.dtype.itemsize, pages * block_size, tuning.triton)
        return f"TRITON_ATTN prefill, tile {tuple(tile)}"
    return f"{backend}'s own kernel (no per-step routing)"


def _describe(r: PartRoute) -> str:
    text = r.kernel.value
    if r.split is not None:
        text += f", {r.split}"
    if r.fa4_tile is not None:
        text += f", tile {r.fa4_tile.rows}x{r.fa4_tile.keys}"
    return text + (f" ({r.why})" if r.why else "")


def _describe_fa4(spec, facts, tuning, rows, requests, max_q, group, *, decode=False,
                  uniform=False) -> str:
    batch = uniform and not decode and fa4_batch(rows, requests, max_q, tuning.flash_attn)
    tile = fa4_tile(facts.major, spec.head_dim, spec.v_head_dim, spec.dtype, max_q, group,
                    tuning.flash_attn, batch=batch)
    text = Kernel.FA4.value + (", batch mode" if batch else ", varlen")
    text += f", tile {tile.rows}x{tile.keys}" if tile is not None else ", FA4's own tile"
    if decode and facts.major == 9:
        text += " (no split-KV on sm90)"
    return text


def triton_head_tiles(head_dim: int, v_head_dim: int, cache_bytes: int) -> tuple[int, int]:
    """The Triton kernel's padded (QK, V) head-dim tiles: powers of two of at least 16
    elements, and of at least 64 for 1-byte (fp8) caches -- Triton 3.6 miscompiles the fp8 ->
    16-bit conversion of a K/V tile whose rows are under 64 bytes on sm90 (an out-of-bounds
    shared-memory read), so narrower fp8 heads load masked 64-wide tiles."""
    least = 64 if cache_bytes == 1 else 16
    return pow2(head_dim, least), pow2(v_head_dim, least)


def pow2(n: int, at_least: int = 1) -> int:
    """The smallest power of two >= ``n`` (and >= ``at_least``): padded tile dims."""
    p = at_least
    while p < n:
        p *= 2
    return p
