"""The sparse-MLA indexer's ops on the device, reading no host value (so they capture in CUDA
graphs): the index-key write (:func:`index_k_write_kernel`, a token a program) and the top-k,
for each query row of ``vis`` visible positions (its position + 1; 0 for padding rows):

1. :func:`index_score_kernel` -- rows that see more than ``topk`` positions: one program per
   row and chunk of positions, the row's query heads loaded once, then per ``BLOCK_N``
   positions the keys gathered through the block table, ``score_j = sum_h w_h relu(q_h .
   k_j)`` as one product over the heads (in the query's dtype when the keys convert to it
   exactly: fp8 with one scale a token -- applied after the ReLU, ``relu(s x) = s relu(x)``
   for ``s > 0`` -- or keys of the query's dtype; fp32 otherwise), into ``[rows, positions]``
   fp32 scores;
2. :func:`topk_select_kernel` -- the ``topk`` best of a row's scores by a radix select on
   order-preserving 32-bit keys (four passes of 8-bit histograms find the ``topk``-th key
   ``T`` and how many keys equal to ``T`` it takes), then one pass in position order that
   writes the positions above ``T`` and the first of those equal to it: ascending, equal
   scores keeping the lower position (the reference's stable sort), -1 after. A row that
   sees at most ``topk`` positions takes them all without a score. Few long rows split in
   two stages (``routing.indexer_select_chunks``): each chunk of a row selects its own
   ``topk`` (every row's top-``topk`` is in its chunks' -- at most ``topk - 1`` beat it in
   its chunk), and a second launch selects from those candidates, still in position order.

The position axis is the block table's capacity (pages x page), a shape; long steps run in
groups of :data:`ROWS_A_PASS` rows to bound the ``[rows, positions]`` buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.routing import indexer_score_chunk, indexer_select_chunks, pow2

__all__ = ["ROWS_A_PASS", "index_k_write_kernel", "index_score_kernel",
           "indexer_k_write_device", "indexer_topk_device", "topk_select_kernel"]

ROWS_A_PASS = 2048
_SIGN = tl.constexpr(-2147483648)  # (the int32 sign bit)


@triton.jit
def index_score_kernel(q_ptr, w_ptr, keys_ptr, scales_ptr, table_ptr, req_ptr, vis_ptr,
                       out_ptr, row0, topk, chunk, stride_qt, stride_qh, stride_wt, stride_kb,
                       stride_kp, stride_sb, stride_sp, stride_bt, stride_ot, H: tl.constexpr,
                       H_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                       PAGE: tl.constexpr, GROUP: tl.constexpr, HAS_SCALES: tl.constexpr,
                       SCALE_AFTER: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):
    i = tl.program_id(0)  # (a row of this pass)
    t = row0 + i
    vis = tl.load(vis_ptr + t)
    req = tl.load(req_ptr + t).to(tl.int64)
    lo = tl.program_id(1) * chunk
    # (rows that see at most top-k positions take them all: nothing to score)
    hi = tl.where(vis > topk, tl.minimum(lo + chunk, vis), lo)
    offs_h = tl.arange(0, H_P)
    offs_d = tl.arange(0, D_P)
    h_ok = offs_h < H
    d_ok = offs_d < D
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
                + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=h_ok, other=0.0)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        ok = offs_n < hi
        page = tl.load(table_ptr + req * stride_bt + offs_n // PAGE, mask=ok,
                       other=0).to(tl.int64)
        row = page * stride_kb + (offs_n % PAGE) * stride_kp
        k = tl.load(keys_ptr + row[:, None] + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        srow = page * stride_sb + (offs_n % PAGE) * stride_sp
        if HAS_SCALES and not SCALE_AFTER:
            k = k * tl.load(scales_ptr + srow[:, None] + (offs_d // GROUP)[None, :],
                            mask=ok[:, None] & d_ok[None, :], other=0.0)
        dots = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision=PRECISION)  # [H_P, BLOCK_N]
        score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
        if SCALE_AFTER:
            score = score * tl.load(scales_ptr + srow, mask=ok, other=0.0)
        tl.store(out_ptr + i.to(tl.int64) * stride_ot + offs_n, score, mask=ok)


@triton.jit
def _order_key(s):
    """An int32 of fp32 ``s`` whose unsigned order is the scores' (-inf lowest; -0 as +0, one
    key for equal scores)."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) | _SIGN)


@triton.jit
def topk_select_kernel(scores_ptr, cand_ptr, vis_ptr, out_ptr, out_score_ptr, row0, width,
                       topk, stride_s, stride_c, stride_o, stride_os, CAND: tl.constexpr,
                       WRITE_SCORES: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(i, c)``: the ``topk`` best of row ``i``'s entries ``[c * width, (c + 1) *
    width)`` -- its scores (``CAND`` False: the first ``vis`` of the row's; none computed
    when ``vis <= topk``, all taken) or its candidates (``scores_ptr`` their scores,
    ``cand_ptr`` their positions, -inf entries none) -- as positions in order, -1 after, into
    ``out[i, c * topk:]`` (and their scores into ``out_score``, ``WRITE_SCORES``)."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    lo = c * width
    if CAND:
        n = width
        stored = width  # (entries with a score)
    else:
        vis = tl.load(vis_ptr + row0 + i)
        n = tl.minimum(vis - lo, width)
        stored = tl.where(vis > topk, n, 0)
    src = scores_ptr + i.to(tl.int64) * stride_s + lo
    all_in = n <= topk  # (every entry taken: no select)
    scan = tl.where(all_in, 0, n)
    bins = tl.arange(0, 512)
    prefix = tl.full([], 0, tl.int32)
    remaining = tl.full([], 0, tl.int32) + topk
    for p in tl.static_range(4):  # the topk-th key, 8 bits a pass from the top
        hist = tl.zeros([512], tl.int32)
        for start in range(0, scan, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            s = tl.load(src + offs, mask=offs < scan, other=float("-inf"))
            u = _order_key(s)
            match = (offs < scan) & (s > float("-inf"))
            if p > 0:
                match = match & ((u >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
            hist += tl.histogram(tl.where(match, (u >> (24 - 8 * p)) & 255, 256), 512)
        hist = tl.where(bins < 256, hist, 0)
        if p == 0:
            remaining = tl.minimum(remaining, tl.sum(hist, axis=0))
        suffix = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        digit = tl.max(tl.where((suffix >= remaining) & (bins < 256), bins, 0), axis=0)
        remaining -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix = prefix | (digit << (24 - 8 * p))
    threshold = prefix ^ _SIGN  # (the same order as a signed int32)
    taken = tl.full([], 0, tl.int32)
    ties = tl.full([], 0, tl.int32)
    dst = out_ptr + i.to(tl.int64) * stride_o + c * topk
    dst_s = out_score_ptr + i.to(tl.int64) * stride_os + c * topk
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        # (an unscored row's entries load as 0: all valid, equal, taken in position order)
        s = tl.load(src + offs, mask=offs < stored, other=0.0)
        valid = inside & (s > float("-inf"))
        o = _order_key(s) ^ _SIGN
        eq = valid & (o == threshold)
        tie_rank = ties + tl.cumsum(eq.to(tl.int32), axis=0) - eq.to(tl.int32)
        chosen = (valid & (o > threshold)) | (eq & (tie_rank < remaining))
        chosen = tl.where(all_in, valid, chosen)
        at = taken + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        if CAND:
            pos = tl.load(cand_ptr + i.to(tl.int64) * stride_c + lo + offs, mask=chosen,
                          other=-1)
        else:
            pos = lo + offs
        tl.store(dst + at, pos, mask=chosen)
        if WRITE_SCORES:
            tl.store(dst_s + at, s, mask=chosen)
        taken += tl.sum(chosen.to(tl.int32), axis=0)
        ties += tl.sum(eq.to(tl.int32), axis=0)
    for start in range(0, topk, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        rest = (offs >= taken) & (offs < topk)
        tl.store(dst + offs, offs * 0 - 1, mask=rest)
        if WRITE_SCORES:
            tl.store(dst_s + offs, tl.full([BLOCK], float("-inf"), tl.float32), mask=rest)


def _visible(t: int, seq_lens, query_start_loc) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's request and its visible positions (its position + 1; 0 for padding)."""
    b = seq_lens.shape[0]
    qsl = query_start_loc.to(torch.int32)
    rows = torch.arange(t, device=seq_lens.device, dtype=torch.int32)
    req = torch.searchsorted(qsl[1:], rows, right=True).clamp(max=b - 1)
    start = qsl[req]
    pos = seq_lens[req] - (qsl[req + 1] - start) + (rows - start)
    vis = torch.where(rows < qsl[-1], pos + 1, 0).clamp(min=0)
    return req.to(torch.int32), vis.to(torch.int32)


def indexer_topk_device(q, weights, keys, scales, block_table, seq_lens, query_start_loc,
                        topk: int, block_n: int | None = None, chunk: int | None = None,
                        select_chunks: int | None = None) -> torch.Tensor:
    """``torch.ops.attn.indexer_topk`` without host reads (inputs already checked);
    ``block_n`` / ``chunk`` / ``select_chunks`` override the tuning's launch (tests)."""
    from attn_ops.routing import DeviceFacts
    from attn_ops.tuning import default_tuning

    t, h, d = q.shape
    page = keys.shape[1]
    out = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    if t == 0 or seq_lens.shape[0] == 0:
        return out
    tuning, sms = default_tuning().mla, DeviceFacts.of(q.device).num_sms
    num_positions = block_table.shape[1] * page
    req, vis = _visible(t, seq_lens, query_start_loc)
    q = q if q.stride(2) == 1 else q.contiguous()
    w = weights.float().contiguous()
    group = d // scales.shape[2] if scales is not None else d
    low = q.dtype in (torch.bfloat16, torch.float16) and (
        keys.dtype == q.dtype or (keys.dtype == torch.float8_e4m3fn and group == d))
    compute = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[q.dtype] if low \
        else tl.float32
    precision = "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"
    block_n = block_n or tuning.index_block_n
    for r0 in range(0, t, ROWS_A_PASS):
        n = min(ROWS_A_PASS, t - r0)
        span = chunk or indexer_score_chunk(n, num_positions, block_n, sms, tuning)
        scores = torch.empty(n, num_positions, dtype=torch.float32, device=q.device)
        index_score_kernel[(n, triton.cdiv(num_positions, span))](
            q, w, keys, scales if scales is not None else w, block_table, req, vis, scores,
            r0, topk, span, q.stride(0), q.stride(1), w.stride(0), keys.stride(0),
            keys.stride(1), scales.stride(0) if scales is not None else 0,
            scales.stride(1) if scales is not None else 0, block_table.stride(0),
            scores.stride(0), H=h, H_P=pow2(h, 16), D=d, D_P=pow2(d, 16), PAGE=page,
            GROUP=group, HAS_SCALES=scales is not None, SCALE_AFTER=low and scales is not None,
            COMPUTE=compute, BLOCK_N=block_n, PRECISION=precision)
        _select(scores, vis, out[r0:r0 + n], r0, topk, num_positions, sms, tuning,
                select_chunks)
    return out


def _select(scores, vis, out, row0, topk, num_positions, sms, tuning, chunks) -> None:
    """``out`` [rows, topk]: each row's top-k of ``scores`` (its first ``vis`` entries), in
    one launch or, for few long rows, two (a chunk's own top-k, then of those)."""
    rows, block = scores.shape[0], tuning.index_select_block
    chunks = chunks or indexer_select_chunks(rows, num_positions, topk, sms, tuning)
    if chunks == 1:
        topk_select_kernel[(rows, 1)](
            scores, scores, vis, out, scores, row0, num_positions, topk, scores.stride(0), 0,
            out.stride(0), 0, CAND=False, WRITE_SCORES=False, BLOCK=block)
        return
    width = triton.cdiv(num_positions, chunks)
    cand = torch.empty(rows, chunks * topk, dtype=torch.int32, device=scores.device)
    cand_s = torch.empty(rows, chunks * topk, dtype=torch.float32, device=scores.device)
    topk_select_kernel[(rows, chunks)](
        scores, scores, vis, cand, cand_s, row0, width, topk, scores.stride(0), 0,
        cand.stride(0), cand_s.stride(0), CAND=False, WRITE_SCORES=True, BLOCK=block)
    topk_select_kernel[(rows, 1)](
        cand_s, cand, vis, out, cand_s, row0, chunks * topk, topk, cand_s.stride(0),
        cand.stride(0), out.stride(0), 0, CAND=True, WRITE_SCORES=False, BLOCK=block)


@triton.jit
def index_k_write_kernel(k_ptr, keys_ptr, scales_ptr, slot_ptr, stride_kt, stride_kb,
                         stride_kp, stride_sb, stride_sp, D: tl.constexpr, GROUPS: tl.constexpr,
                         GROUPS_P: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                         PAGE: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Token ``program_id(0)``'s index key into its slot (-1: none): as it is, or in fp8 with
    each group of ``GROUP`` channels over its amax / ``FP8_MAX`` and that scale beside it."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_g = tl.arange(0, GROUPS_P)
        offs_c = tl.arange(0, GROUP_P)
        ok = (offs_g < GROUPS)[:, None] & (offs_c < GROUP)[None, :]
        channel = offs_g[:, None] * GROUP + offs_c[None, :]
        x = tl.load(k_ptr + t.to(tl.int64) * stride_kt + channel, mask=ok, other=0.0)
        row = keys_ptr + (slot // PAGE) * stride_kb + (slot % PAGE) * stride_kp
        if FP8:
            x = x.to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FP8_MAX, 1e-12)
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
            tl.store(row + channel, q.to(keys_ptr.dtype.element_ty), mask=ok)
            tl.store(scales_ptr + (slot // PAGE) * stride_sb + (slot % PAGE) * stride_sp
                     + offs_g, scale, mask=offs_g < GROUPS)
        else:
            tl.store(row + channel, x.to(keys_ptr.dtype.element_ty), mask=ok)


def indexer_k_write_device(k, keys, scales, slot_mapping, fp8_max: float) -> None:
    """``torch.ops.attn.indexer_k_write`` in one launch, no host read (inputs checked)."""
    t, d = k.shape
    if t == 0:
        return
    k = k if k.stride(1) == 1 else k.contiguous()
    groups = scales.shape[2] if scales is not None else 1
    group = d // groups
    index_k_write_kernel[(t,)](
        k, keys, scales if scales is not None else keys, slot_mapping, k.stride(0),
        keys.stride(0), keys.stride(1), scales.stride(0) if scales is not None else 0,
        scales.stride(1) if scales is not None else 0, D=d, GROUPS=groups,
        GROUPS_P=pow2(groups), GROUP=group, GROUP_P=pow2(group), PAGE=keys.shape[1],
        FP8=scales is not None, FP8_MAX=fp8_max)
