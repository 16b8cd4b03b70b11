"""FLEX_ATTENTION: ``torch.nn.attention.flex_attention`` compiled over the paged KV cache.

No copy of the cache: the keys FlexAttention sees are the cache itself viewed as one long
sequence of slots (``[1, kv_heads, slots, head_dim]``; for the interleaved NHD layout K and V
views are offset by one page, and the V half of each page is masked). Each step, on the device
and without a host sync (so it can be captured): a token -> request map, each token's position,
each physical page's owner request and logical index (from the block table), and a
``BlockMask`` whose KV blocks are exactly the pages of the requests in each 128-query block --
the sparse structure comes from the block table, ``mask_mod`` only refines inside pages.
These tables are made once per step by the metadata builder (:class:`FlexMetadata`, run by
``torch.ops.attn.flex_attention_prepared``) when the common metadata knows the cache's block
count, as ``build_common_metadata`` records it; otherwise ``torch.ops.attn.flex_attention``
makes them in every call (about 25 small device ops per layer). Two other layouts, chosen by
the builder: decode-only steps run one FlexAttention batch element per request
(``flex_attention_decode``); steps with long prefills may copy each request's pages into pages
of ``GATHER_PAGE`` keys first (``flex_attention_gathered``; on GPUs, see
``routing.flex_gathers``), since FlexAttention's key tile never spans more than one KV
block -- one page. There each request's keys are consecutive slots, so ``mask_mod`` compares
slot numbers with two per-row bounds instead of reading per-page tables. Padding rows see no
key (their query blocks get no full KV blocks), so FlexAttention writes them as zeros and its
rows are copied into ``out`` as they are. Query blocks and gathered pages are padded to shape
buckets (:func:`shape_bucket`), so that steps of new token counts reuse compiled kernels.

Block ids and lengths arrive on the device and are never trusted: a table entry whose block id
is outside the cache lists no KV block and owns no page, so its keys are absent (in the
gathered layout, the whole gathered page holding it: over-masking, for that request only), and
keys past the request's block-table row are none; nothing outside the cache is read.

``mask_mod`` and ``score_mod`` carry the semantics (REFERENCE's): causal, sliding window,
soft-cap, ALiBi, and the spec's own ``mask_mod`` / ``score_mod`` in request coordinates
(``AttentionSpec``: prefix-LM, document masking, any elementwise pattern) -- what vLLM users ask
for and vLLM does not offer (vllm-project/vllm#17869). Sinks are applied from the LSE.

Recompilation: the mods are rebuilt each call from the same code over new tensors of the same
shapes, which Dynamo's guards accept, so only a new bucket of query blocks or of gathered pages
(:func:`shape_bucket`), a new decode batch bucket (:func:`decode_batch`) or a new cache size
compiles again (the block lists' width is marked dynamic on GPUs).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from attn_ops.backend import AttentionBackend
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, HeadDims, MultipleOf,
                                   Reason)
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.ops import (PAGED_ATTENTION_MODS_SCHEMA, apply_sinks,
                          check_paged_attention_inputs, define_op, register_mods, registered_mods)
from attn_ops.platforms import PlatformKind, multiprocessor_count, shared_memory_per_block
from attn_ops.backends.flex_attention_gather import (GATHER_PAGE, gather_map, gather_pages,
                                                     gathered_shape, gathered_views,
                                                     slot_major)
from attn_ops.backends.flex_attention_tables import (Q_BLOCK, decode_batch, decode_tensors,
                                                     shape_bucket, step_tensors)
from attn_ops.backends.reference import UNCAPTURABLE
from attn_ops.kv_cache import KVCacheLayout
from attn_ops.routing import flex_decode_splits, flex_decode_stages, flex_gathers
from attn_ops.spec import AttentionType, Feature, KVCacheDType
from attn_ops.tuning import FlexTuning

__all__ = ["FlexAttentionBackend", "FlexMetadata"]



def _has_compute_q_blocks() -> bool:
    import inspect

    from torch.nn.attention.flex_attention import BlockMask

    return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


_HAS_COMPUTE_Q_BLOCKS = _has_compute_q_blocks()


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Static shapes: a new query bucket or cache size compiles again (automatic dynamic shapes
    # hit an Inductor CPU-template bug in torch 2.13: "cur_kvSplitSize6 was not declared").
    # Only FlexAttention: the step's own token count stays out of the graph (copying the rows
    # into ``out`` inside it would compile again for every new count; Inductor does not fuse
    # that copy into FlexAttention's template).
    return torch.compile(flex_attention, fullgraph=True, dynamic=False)


def _slot_views(kv_cache, head_dim, head_dim_v):
    """K and V as ``[1, kv_heads, slots, dim]`` views of the cache, and the slot-index period
    of one page (K slots of page ``p`` are ``p * period + [0, block_size)``)."""
    if kv_cache.dim() == 5:  # [blocks, 2, block_size, heads, dim]: K page, V page, K page, ...
        nb, _, bs, h, d = kv_cache.shape
        flat = kv_cache.view(nb * 2 * bs, h, d)
        k, v, period = flat[:(2 * nb - 1) * bs], flat[bs:], 2 * bs
    else:  # packed [blocks, block_size, heads, head_dim + head_dim_v]
        nb, bs, h, _ = kv_cache.shape
        k = kv_cache[..., :head_dim].reshape(nb * bs, h, head_dim)
        v = kv_cache[..., head_dim:].reshape(nb * bs, h, head_dim_v)
        period = bs
    return k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], period, bs


def _folds_gqa(group: int) -> bool:
    """Whether the decode layout folds each KV head's ``group`` query heads into query rows
    (and calls FlexAttention without GQA): for groups that are not powers of two, where
    FlexAttention's decoding kernel with ``enable_gqa`` returned wrong rows on the H200
    (groups of 3: 12 query / 4 KV heads, 24 / 8 as Llama-3.2-3B)."""
    return group > 1 and group & (group - 1) != 0


def _mods(req, qpos, kv_limit, owner, logical, period, block_size, causal, window, soft_cap,
          alibi, user_mask, user_score, per_batch=False, gathered=False, group=None):
    """``mask_mod`` / ``score_mod`` over FlexAttention's (query row, cache slot) indices --
    or, ``per_batch`` (the decode layout), its (batch element, cache slot) ones; ``gathered``:
    ``owner`` / ``logical`` are per row (:func:`step_tensors`), and a key's position is its
    distance from the row's first slot; ``group``: the decode layout with each KV head's query
    heads folded into query rows (:func:`_folds_gqa`), FlexAttention's head ``h`` and row ``r``
    being query head ``h * group + r``."""

    def query_head(h, q_idx):
        return h * group + q_idx if group else h

    def logical_pos(kv_idx, i):
        if gathered:
            return kv_idx - owner[i]
        return logical[kv_idx // period] * block_size + kv_idx % period

    def mask_mod(b, h, q_idx, kv_idx):
        # (only what the listed KV blocks do not already guarantee: with K and V pages
        # interleaved a slot may be a V slot; causal, j <= p implies j < kv_limit -- a
        # padding row's request owns no page)
        i = b if per_batch else q_idx
        j = logical_pos(kv_idx, i)
        if gathered:  # its request's slots up to the last it may see: no per-key table
            vis = (kv_idx >= owner[i]) & (kv_idx < logical[i])
        else:
            vis = owner[kv_idx // period] == req[i]
            if period != block_size:
                vis = vis & (kv_idx % period < block_size)
            vis = vis & (j <= qpos[i]) if causal else vis & (j < kv_limit[i])
        r, p = req[i], qpos[i]
        if window is not None:
            vis = vis & (p - j < window)
            if not causal:
                vis = vis & (j - p < window)
        if user_mask is not None:
            vis = vis & user_mask(r, query_head(h, q_idx), p, j)
        return vis

    def score_mod(score, b, h, q_idx, kv_idx):
        i = b if per_batch else q_idx
        if soft_cap is not None:
            score = soft_cap * torch.tanh(score / soft_cap)
        if alibi is not None:
            score = score + alibi[query_head(h, q_idx)] * (logical_pos(kv_idx, i) - qpos[i])
        if user_score is not None:
            score = user_score(score, req[i], query_head(h, q_idx), qpos[i],
                               logical_pos(kv_idx, i))
        return score

    plain = soft_cap is None and alibi is None and user_score is None
    return mask_mod, (None if plain else score_mod)


def _flex_attention(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse, sinks,
                    alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap, causal,
                    mods) -> None:
    """The op over common metadata: the step's tables are made here, in every call."""
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)
    _check_cache_size(kv_cache)
    _, _, period, bs = _slot_views(kv_cache, query.shape[2], out.shape[2])
    tables = step_tensors(query_start_loc, seq_lens, block_table, query.shape[0],
                           kv_cache.shape[0], bs, period, causal, sliding_window,
                           registered_mods(mods)[0] is None)
    _run_flex(query, kv_cache, tables, out, lse, sinks, alibi_slopes, scale, sliding_window,
              soft_cap, causal, mods)


def _run_flex(query, kv_cache, tables, out, lse, sinks, alibi_slopes, scale, sliding_window,
              soft_cap, causal, mods, decode=False, gathered=False) -> None:
    """FlexAttention over the tables of :func:`step_tensors` (``gathered``: made over the
    gathered pages) -- or, ``decode``, of :func:`decode_tensors` (one batch element per
    single-token request). Padding rows see no key: FlexAttention writes them as zeros."""
    from torch.nn.attention.flex_attention import BlockMask

    user_mask, user_score, tuning = registered_mods(mods)
    tuning = tuning or FlexTuning()
    t_in, hq, d = query.shape
    if gathered:  # (kv_cache: gather_pages' result)
        (k, v), period, bs = gathered_views(kv_cache, d), GATHER_PAGE, GATHER_PAGE
    else:
        k, v, period, bs = _slot_views(kv_cache, d, out.shape[2])
    req, qpos, kv_limit, owner, logical, valid, kv_num, kv_idx, full_num, full_idx = tables
    if full_idx.shape[-1] == 0:  # (tables without full KV blocks)
        full_num = full_idx = None
    rows = req.shape[0]
    group = hq // k.shape[1] if decode and _folds_gqa(hq // k.shape[1]) else None
    mask_mod, score_mod = _mods(req, qpos, kv_limit, owner, logical, period, bs, causal,
                                sliding_window, soft_cap, alibi_slopes, user_mask, user_score,
                                per_batch=decode, gathered=gathered, group=group)
    extra = {"compute_q_blocks": False} if _HAS_COMPUTE_Q_BLOCKS else {}  # (no backward)
    block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx,
                                          BLOCK_SIZE=(Q_BLOCK, bs),
                                          mask_mod=mask_mod,
                                          seq_lengths=((group or 1) if decode else rows,
                                                       k.shape[2]),
                                          **extra)
    q = query if rows == t_in else torch.nn.functional.pad(query, (0, 0, 0, 0, 0, rows - t_in))
    if group:  # [batch, KV heads, group, dim]: each KV head's query heads as its rows
        q = q.view(q.shape[0], k.shape[1], group, d)
    else:  # [batch, heads, rows, dim]
        q = q[:, :, None] if decode else q.permute(1, 0, 2)[None]
    need_lse = lse is not None or sinks is not None
    if need_lse and query.device.type == "cpu":
        raise ValueError("FLEX_ATTENTION on the CPU returns no LSE (compiled CPU FlexAttention "
                         "does not support return_lse), so lse and sinks are GPU-only; pass "
                         "lse=None or use CPU_ATTN")
    # Compiled CPU FlexAttention is inference-only; every mod variant x shape is one entry of
    # one code object's cache, more than Dynamo's default 8.
    # On GPUs, Triton's key tile must divide the BlockMask's KV block (a page): the largest
    # power of two dividing the page size, at most FlexAttention's own default (_key_tile).
    # On the CPU, single-row queries over long caches would get Inductor's C++ decoding
    # template, which torch 2.13 emits referencing `full_kv_num_blocks` it never declares when
    # the BlockMask has no full blocks (a compile error): a partition size that is not a
    # multiple of the page rules that template out.
    if query.device.type == "cuda":
        splits = flex_decode_splits(q.shape[0], k.shape[1], multiprocessor_count(query.device),
                                    tuning) if decode and full_num is None else None
        options = _gpu_kernel_options(bs, d, out.shape[2], query.dtype, decode,
                                      shared_memory_per_block(query.device), splits, tuning)
        # The block lists are as wide as the step's block table, which may change from step
        # to step: symbolic from the first call (else Dynamo recompiles on the first change).
        for idx in (kv_idx, full_idx):
            if idx is not None:
                torch._dynamo.maybe_mark_dynamic(idx, idx.dim() - 1)
    else:
        options = {"PARTITION_SIZE": 8 * bs + 1} if decode else None
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=256):
        result = _flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                         enable_gqa=q.shape[1] != k.shape[1], return_lse=need_lse,
                         kernel_options=options)
    o, row_lse = result if need_lse else (result, None)
    if group:  # back to [batch, heads, dim] (LSE [batch, heads, 1])
        o = o.reshape(o.shape[0], hq, o.shape[-1])
        row_lse = row_lse.reshape(o.shape[0], hq, 1) if need_lse else None
    elif decode:
        o = o[:, :, 0]
    else:  # [rows, heads, dim]
        o = o[0].transpose(0, 1)
    out.copy_(o[:t_in])  # (FlexAttention's rows as they are: padding rows saw no key)
    if need_lse:  # (a padding row's LSE is 0, like REFERENCE's; FlexAttention's is -inf)
        row_lse = row_lse[:, :, 0] if decode else row_lse[0].t()
        row_lse = torch.where(valid[:t_in, None], row_lse[:t_in].float(), 0.0)
        if sinks is not None:
            apply_sinks(out, row_lse, sinks)
        if lse is not None:
            lse.copy_(row_lse)


def _fake(query, kv_cache, query_start_loc, seq_lens, block_table, out, lse, sinks,
          alibi_slopes, k_scale, v_scale, scale, sliding_window, soft_cap, causal, mods) -> None:
    check_paged_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_table, out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)
    _check_cache_size(kv_cache)


def _key_tile(block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """FlexAttention's key tile over pages of ``block_size``: the largest power of two dividing
    the page, at most the tile FlexAttention picks itself on sm90 (torch 2.11-2.13's defaults:
    16-bit 128 / 64 / 32 keys for head dims <= 64 / <= 128 / more, fp32 at most 64) -- a
    wider one than its default may not fit in shared memory (pages of 64-128, the gathered
    layout's 128)."""
    if dtype == torch.float32:
        cap = 64 if 64 < head_dim <= 192 else 32
    else:
        cap = 128 if head_dim <= 64 else 64 if head_dim <= 128 else 32
    return min(block_size & -block_size, cap)


def _gpu_kernel_options(block_size: int, head_dim: int, head_dim_v: int, dtype: torch.dtype,
                        decode: bool, smem: int, splits: int | None, tuning: FlexTuning) -> dict:
    """FlexAttention's kernel options on GPUs: the key tile (:func:`_key_tile`), for the
    decode layout its pipeline stages (``routing.flex_decode_stages``) and ``splits``, then
    the tuning's ``gpu_kernel_options`` over them."""
    options = {"BLOCK_N": _key_tile(block_size, head_dim, dtype)}
    if splits:
        options["SPLIT_KV"] = splits
    if decode:
        stages = flex_decode_stages(options["BLOCK_N"], head_dim, head_dim_v, dtype.itemsize,
                                    smem, tuning)
        if stages is not None:
            options["num_stages"] = stages
    return {**options, **dict(tuning.gpu_kernel_options)}


def _check_cache_size(kv_cache) -> None:
    """FlexAttention's generated GPU kernel offsets K and V with 32-bit integers: over a cache
    of 2^31 elements or more it reads out of bounds (an illegal memory access, seen on torch
    2.11)."""
    numel = kv_cache.numel()
    if kv_cache.device.type == "cuda" and numel >= 2**31:
        per_block = numel // kv_cache.shape[0]
        raise ValueError(
            f"FLEX_ATTENTION: the KV cache {tuple(kv_cache.shape)} has {numel} elements; "
            f"FlexAttention's GPU kernel offsets it with 32-bit integers (at most {2**31 - 1}): "
            f"allocate at most {(2**31 - 1) // per_block} blocks, or use TRITON_ATTN or "
            "FLASHINFER")


def _check_tables(query, kv_cache, tables, decode=False, gathered=False):
    req, owner = tables[0], tables[3]
    if req.shape[0] < query.shape[0] or (not decode and req.shape[0] % Q_BLOCK):
        raise ValueError(f"FLEX_ATTENTION metadata was built for {req.shape[0]} query rows; "
                         f"this call has {query.shape[0]} -- build it from this step's common "
                         "metadata")
    if gathered and owner.shape != req.shape:
        raise ValueError(f"FLEX_ATTENTION's gathered op takes per-row tables ({req.shape[0]} "
                         f"rows), got {owner.shape[0]} owners: run the metadata on the op "
                         "FlexAttentionBackend.op_for(metadata) names")
    if not gathered and owner.shape[0] != kv_cache.shape[0]:
        raise ValueError(f"FLEX_ATTENTION metadata was built for a cache of {owner.shape[0]} "
                         f"blocks, this cache has {kv_cache.shape[0]} (common.num_blocks must "
                         "be the cache's block count)")


def _prepared(query, kv_cache, req, qpos, kv_limit, owner, logical, valid, kv_num, kv_idx,
              full_num, full_idx, out, lse, sinks, alibi_slopes, k_scale, v_scale, scale,
              sliding_window, soft_cap, causal, mods, decode=False, page_map=None) -> None:
    """The op over :class:`FlexMetadata`: the step's tables were made once, by the builder
    (``page_map``: over the cache's pages gathered, :func:`gather_pages`)."""
    tables = (req, qpos, kv_limit, owner, logical, valid, kv_num, kv_idx, full_num, full_idx)
    gathered = page_map is not None
    _check_prepared(query, kv_cache, tables, out, lse, sinks, alibi_slopes, k_scale, v_scale,
                    decode, gathered)
    if gathered:
        kv_cache = gather_pages(kv_cache, page_map, shape_bucket(page_map.shape[0]))
    _run_flex(query, kv_cache, tables, out, lse, sinks, alibi_slopes, scale, sliding_window,
              soft_cap, causal, mods, decode, gathered)


def _gathered(query, kv_cache, page_map, *args) -> None:
    """The op over :class:`FlexMetadata` in the gathered layout: ``page_map``'s pages copied
    into larger ones (:func:`gather_map`), then FlexAttention over them."""
    _check_page_map(kv_cache, page_map)
    _prepared(query, kv_cache, *args, page_map=page_map)


def _gathered_fake(query, kv_cache, page_map, *args) -> None:
    _check_page_map(kv_cache, page_map)
    _prepared_fake(query, kv_cache, *args, gathered=True)


def _check_page_map(kv_cache, page_map):
    if page_map.dim() != 2 or page_map.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"FLEX_ATTENTION page_map must be an integer [virtual pages, pages "
                         f"each] tensor, got {page_map.dtype} {tuple(page_map.shape)}; take it "
                         "from FlexAttentionBackend.build_metadata (FlexMetadata.page_map)")
    if page_map.device != kv_cache.device:
        raise ValueError(f"FLEX_ATTENTION page_map is on {page_map.device}, the cache on "
                         f"{kv_cache.device}; build the metadata on the cache's device")
    numel = math.prod(gathered_shape(slot_major(kv_cache), page_map,
                                     shape_bucket(page_map.shape[0])))
    if kv_cache.device.type == "cuda" and numel >= 2**31:
        raise ValueError(f"FLEX_ATTENTION: this step's pages gathered ({tuple(page_map.shape)} "
                         f"pages) are {numel} elements, past FlexAttention's 32-bit offsets; "
                         "run fewer requests per step or turn gathering off "
                         "(Tuning.flex.gather_min_pairs_per_key_gpu=None)")


def _decode(*args) -> None:
    """The op over :class:`FlexMetadata` in the decode layout (:func:`decode_tensors`)."""
    _prepared(*args, decode=True)


def _check_prepared(query, kv_cache, tables, out, lse, sinks, alibi_slopes, k_scale, v_scale,
                    decode=False, gathered=False):
    kv_num = tables[6]
    # (the common checks, with a stand-in batch of one request: the tables hold the batch;
    # they read shapes only, and new_empty launches nothing, where new_zeros would launch two
    # fill kernels per call)
    one = kv_num.new_empty(1)
    check_paged_attention_inputs(query, kv_cache, one.new_empty(2), one, one.view(1, 1), out,
                                 lse, sinks, alibi_slopes, k_scale, v_scale)
    _check_tables(query, kv_cache, tables, decode, gathered)
    if not gathered:  # (FlexAttention reads the gathered copy: _check_page_map)
        _check_cache_size(kv_cache)


def _prepared_fake(query, kv_cache, *args, decode=False, gathered=False) -> None:
    tables, (out, lse, sinks, alibi_slopes, k_scale, v_scale) = args[:10], args[10:16]
    _check_prepared(query, kv_cache, tables, out, lse, sinks, alibi_slopes, k_scale, v_scale,
                    decode, gathered)


def _decode_fake(*args) -> None:
    _prepared_fake(*args, decode=True)


_PREPARED_SCHEMA = (
    "(Tensor query, Tensor kv_cache, Tensor req, Tensor qpos, Tensor kv_limit, Tensor owner, "
    "Tensor logical, Tensor valid, Tensor kv_num, Tensor kv_idx, Tensor full_num, "
    "Tensor full_idx, Tensor(a!) out, "
    "Tensor(b!)? lse, Tensor? sinks, Tensor? alibi_slopes, Tensor? k_scale, Tensor? v_scale, "
    "float scale, int? sliding_window, float? soft_cap, bool causal, int mods) -> ()")
flex_prepared_attention = define_op(
    "flex_attention_prepared", _PREPARED_SCHEMA, _prepared, _prepared_fake,
    dispatch_keys=("CPU", "CUDA"), fp8_output_at=12, tags=UNCAPTURABLE)
flex_decode_attention = define_op(
    "flex_attention_decode", _PREPARED_SCHEMA, _decode, _decode_fake,
    dispatch_keys=("CPU", "CUDA"), fp8_output_at=12, tags=UNCAPTURABLE)
flex_gathered_attention = define_op(
    "flex_attention_gathered", _PREPARED_SCHEMA.replace(
        "Tensor kv_cache, ", "Tensor kv_cache, Tensor page_map, "), _gathered, _gathered_fake,
    dispatch_keys=("CPU", "CUDA"), fp8_output_at=13, tags=UNCAPTURABLE)


@dataclass(frozen=True, eq=False)
class FlexMetadata:
    """A step's FlexAttention tables, made once per step by the builder and shared by every
    layer with the same metadata key (the op over common metadata makes them in every call):
    per query row its request, position, visible-key limit and validity; per cache page its
    owner and logical index (gathered layout: per row its request's first slot and one past
    the last it may see); the BlockMask's ``kv_num`` / ``kv_idx``. Built when the common
    metadata knows the cache's block count (``num_blocks``, set by ``build_common_metadata``)."""

    slot_mapping: torch.Tensor
    tables: tuple[torch.Tensor, ...]
    causal: bool = True
    decode: bool = False  # the decode layout (:func:`decode_tensors`), for decode-only steps
    page_map: torch.Tensor | None = None  # the gathered layout (:func:`gather_map`)


flex_paged_attention = define_op("flex_attention", PAGED_ATTENTION_MODS_SCHEMA, _flex_attention,
                                 _fake, dispatch_keys=("CPU", "CUDA"), fp8_output_at=5,
                                 tags=UNCAPTURABLE)  # (capture untested: CUDAGraphSupport.NEVER)


def _gathers(common: CommonAttentionMetadata, tuning: FlexTuning) -> bool:
    """Whether a step with prefills takes the gathered layout (``routing.flex_gathers``). From
    the metadata's Python integers only (no tensor read: the builder may run inside a compiled
    graph); the pairs are the prefill tokens times the longest query -- exact for one fresh
    prefill (counting the causal pairs twice), low for chunked prefills over long contexts and
    for decodes (not counted), so the rule errs towards not copying."""
    bs = common.block_size
    if bs >= GATHER_PAGE or GATHER_PAGE % bs:
        return False
    copied = common.num_reqs * -(-common.block_table.shape[1] // (GATHER_PAGE // bs)) \
        * GATHER_PAGE
    pairs = (common.num_actual_tokens - common.num_decode_tokens) * common.max_query_len
    return flex_gathers(pairs, copied, common.block_table.device.type == "cuda", tuning)


class FlexAttentionBackend(AttentionBackend):
    """Compiled FlexAttention over the paged cache; the backend for custom mask/score mods."""

    name = "FLEX_ATTENTION"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA, PlatformKind.CPU}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        head_dims=HeadDims(multiple_of=8, min=16, max=256),
        kv_cache_dtypes=frozenset({KVCacheDType.AUTO}),
        block_sizes=(MultipleOf(16),),
        preferred_block_size=16,
        features=frozenset({Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.SINKS,
                            Feature.ALIBI, Feature.NON_CAUSAL, Feature.CUSTOM_MODS}),
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER_ONLY}),
        cudagraph_support=CUDAGraphSupport.NEVER,  # capture not tested yet
    )
    op = flex_paged_attention

    @classmethod
    def returns_lse(cls, platform) -> bool:
        return platform.kind is not PlatformKind.CPU

    @classmethod
    def reads_kv_planes(cls, spec) -> bool:
        """False: the op indexes an NHD cache's pages as one slot space (K of page ``p`` at
        slots ``p * 2 * block_size + ...``), which the planes do not form."""
        return False

    @classmethod
    def not_supported_reasons(cls, spec, platform):
        reasons = super().not_supported_reasons(spec, platform)
        if spec.has_sinks and not cls.returns_lse(platform):
            reasons.append(Reason(cls.name, "feature:attention_sinks", "attention sinks need "
                                  "the LSE, which compiled FlexAttention does not return on the "
                                  "CPU", "CPU_ATTN or REFERENCE take sinks"))
        return reasons

    def __init__(self, spec, **options) -> None:
        super().__init__(spec, **options)
        self.mods = register_mods(spec, self.tuning.flex)

    def build_metadata(self, common: CommonAttentionMetadata):
        """:class:`FlexMetadata` when the cache's block count is known; else the common
        metadata itself (the op then makes the tables in every call)."""
        if isinstance(common, FlexMetadata) or common.num_blocks is None:
            return common
        bs = common.block_size
        period = 2 * bs if self.kv_cache_layout(self.spec) is KVCacheLayout.NHD else bs
        tokens = common.slot_mapping.shape[0]
        # (pages no query can see are left out; full pages -- mask_mod skipped -- unless the
        # spec has a mask_mod of its own, which may hide any key)
        causal = self.spec.causal and common.causal
        window, full = self.spec.sliding_window, self.spec.mask_mod is None
        if common.max_query_len == 1 and common.num_actual_tokens == common.num_reqs:
            batch = decode_batch(tokens)
            device = common.seq_lens.device
            splits = flex_decode_splits(batch, self.spec.kv_heads, multiprocessor_count(device)
                                        if device.type == "cuda" else None, self.tuning.flex)
            return FlexMetadata(common.slot_mapping, decode_tensors(
                common.seq_lens, common.block_table, batch, common.num_blocks, bs, period,
                causal, window, full and splits is None), causal=common.causal, decode=True)
        table, num_pages, page_map = common.block_table, common.num_blocks, None
        # the tables over the gathered pages, GATHER_PAGE keys each
        row_keys = None
        if _gathers(common, self.tuning.flex):
            table, page_map = gather_map(common.block_table, common.seq_lens, bs,
                                         common.num_blocks)
            num_pages = shape_bucket(page_map.shape[0])  # (the gathered cache's pages)
            row_keys = common.block_table.shape[1] * bs  # (keys past the row: none)
            period = bs = GATHER_PAGE  # (K and V apart)
        return FlexMetadata(common.slot_mapping, step_tensors(
            common.query_start_loc, common.seq_lens, table, tokens, num_pages, bs, period, causal,
            window, full, gathered=page_map is not None, row_keys=row_keys),
            causal=common.causal, page_map=page_map)

    def metadata_key(self) -> tuple:
        # (the tables depend on what the spec hides: causality, window, its own mask_mod)
        spec = self.spec
        return (self.name, self.kv_cache_layout(spec), spec.causal, spec.sliding_window,
                spec.mask_mod is None, self.tuning.key)

    def op_for(self, metadata):
        if isinstance(metadata, FlexMetadata):
            if metadata.page_map is not None:
                return flex_gathered_attention
            return flex_decode_attention if metadata.decode else flex_prepared_attention
        return self.op

    def ops(self):
        return (self.op, flex_prepared_attention, flex_decode_attention, flex_gathered_attention)

    def op_arguments(self, query, kv_cache, metadata, out, *, lse=None, sinks=None,
                     alibi_slopes=None, k_scale=None, v_scale=None) -> tuple:
        if not isinstance(metadata, FlexMetadata):
            return (*super().op_arguments(query, kv_cache, metadata, out, lse=lse, sinks=sinks,
                                          alibi_slopes=alibi_slopes, k_scale=k_scale,
                                          v_scale=v_scale), self.mods)
        spec = self.spec
        cache = (kv_cache,) if metadata.page_map is None else (kv_cache, metadata.page_map)
        return (query, *cache, *metadata.tables, out, lse, sinks, alibi_slopes, k_scale,
                v_scale, self.scale, spec.sliding_window, spec.logits_soft_cap,
                spec.causal and metadata.causal, self.mods)
