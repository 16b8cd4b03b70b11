"""TRITON_MLA_SPARSE's kernel: the absorbed form over each token's selected latent rows.

One program takes one query token and ``HEADS`` of its heads (every head of a token reads the
same selected rows). Per ``BLOCK_N`` entries of the token's slot list it gathers those rows,
``c`` [BLOCK_N, RANK] and ``k_pe`` [BLOCK_N, ROPE] (slot ``s`` is row ``s % PAGE`` of page
``s // PAGE``; a negative slot or one past the cache's ``capacity`` rows loads nothing and is
masked), and runs

    s   = (ql @ c^T + q_pe @ k_pe^T) * scale        (ql: q_nope @ W_UK, RANK wide)
    acc = acc * alpha + softmax_part(s) @ c          (online softmax in base 2)

so K and V are the same tile. fp8 latents: the per-tensor scale goes into the score scale and
into the final store. A token with no slot selected writes zeros.

With ``SPLITS`` > 1 (few tokens: more programs than one per token and head block) split ``s``
of a token takes its slots ``[s * per, (s + 1) * per)`` and writes fp32 partials
``[tokens, heads, splits, RANK_P]`` and their natural-log LSEs (-inf: nothing selected there),
which TRITON_ATTN's split combine merges (applying the fp8 scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.backends.mla.triton_mla_kernels import online_softmax_step
from attn_ops.backends.triton_attn_kernels import LN2, LOG2E
from attn_ops.routing import cdiv, combine_split_block, pow2, triton_head_tiles

__all__ = ["pack_selection", "pack_selection_torch", "sparse_mla_kernel", "sparse_mla_triton"]


@triton.jit
def sparse_mla_kernel(ql_ptr, qpe_ptr, cache_ptr, slots_ptr, out_ptr, part_o_ptr,
                      part_lse_ptr, kv_scale_ptr, flags_ptr, sm_scale, num_slots, capacity,
                      stride_lt, stride_lh,
                      stride_pt, stride_ph, stride_cb, stride_cp, stride_st, stride_ot,
                      stride_oh, H: tl.constexpr, HEADS: tl.constexpr, RANK: tl.constexpr,
                      RANK_P: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr,
                      PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                      FP8: tl.constexpr, PRECISION: tl.constexpr, FLAGGED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    if FLAGGED:  # (a repair launch: only the rows flagged need this kernel)
        if tl.load(flags_ptr + t) == 0:
            return
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    h_ok = h < H
    offs_r = tl.arange(0, RANK_P)
    offs_p = tl.arange(0, ROPE_P)
    r_ok = offs_r < RANK
    p_ok = offs_p < ROPE
    ql = tl.load(ql_ptr + t * stride_lt + h[:, None] * stride_lh + offs_r[None, :],
                 mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    qpe = tl.load(qpe_ptr + t * stride_pt + h[:, None] * stride_ph + offs_p[None, :],
                  mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    qk_scale = sm_scale * LOG2E
    if FP8:
        kv_scale = tl.load(kv_scale_ptr)
        qk_scale = qk_scale * kv_scale
    m_i = tl.full([HEADS], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, RANK_P], tl.float32)
    per_split = tl.cdiv(tl.cdiv(num_slots, SPLITS), BLOCK_N) * BLOCK_N
    lo = tl.program_id(2) * per_split
    hi = tl.minimum(num_slots, lo + per_split)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + t * stride_st + offs_n, mask=offs_n < hi,
                       other=-1).to(tl.int64)
        ok = (slot >= 0) & (slot < capacity)
        slot = tl.where(ok, slot, 0)
        rows = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cp
        c = tl.load(rows[:, None] + offs_r[None, :], mask=ok[:, None] & r_ok[None, :],
                    other=0.0).to(ql.dtype)
        kpe = tl.load(rows[:, None] + RANK + offs_p[None, :], mask=ok[:, None] & p_ok[None, :],
                      other=0.0).to(qpe.dtype)
        s = tl.dot(ql, tl.trans(c), input_precision=PRECISION)
        s = tl.dot(qpe, tl.trans(kpe), s, input_precision=PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, c, m_i, l_i, acc, PRECISION)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLITS == 1:
        if FP8:
            o = o * kv_scale
        tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + offs_r[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])
    else:
        part = (t * H + h) * SPLITS + tl.program_id(2)
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
        tl.store(part_o_ptr + part[:, None] * RANK_P + offs_r[None, :], o, mask=h_ok[:, None])
        tl.store(part_lse_ptr + part, lse, mask=h_ok)


def sparse_mla_triton(ql, q_pe, latent_cache, topk_slots, out, kv_scale, scale,
                      launch, row_flags=None) -> None:
    """Latent outputs ``out`` [T, H, rank] of the selected rows; ``launch``: (heads a
    program, slots a step, warps, stages, splits of a token's slots). ``row_flags`` [T]
    (int32): only the rows flagged non-zero are computed (one split), the others left as they
    are."""
    from attn_ops.backends.triton_attn_kernels import combine_splits_kernel

    tokens, heads, rank = ql.shape
    if tokens == 0:
        return
    rope = q_pe.shape[2]
    block_h, block_n, warps, stages, splits = launch
    if row_flags is not None:
        splits = 1
    block_h = max(16, min(block_h, pow2(heads)))  # (tl.dot: M >= 16)
    rank_p, rope_p = triton_head_tiles(rank, rope, latent_cache.dtype.itemsize)
    fp8 = latent_cache.dtype == torch.float8_e4m3fn
    slots = topk_slots if topk_slots.stride(1) == 1 else topk_slots.contiguous()
    part_o = part_lse = out
    if splits > 1:
        part_o = torch.empty(tokens, heads, splits, rank_p, dtype=torch.float32,
                             device=ql.device)
        part_lse = torch.empty(tokens, heads, splits, dtype=torch.float32, device=ql.device)
    sparse_mla_kernel[(tokens, cdiv(heads, block_h), splits)](
        ql, q_pe, latent_cache, slots, out, part_o, part_lse, kv_scale if fp8 else out,
        row_flags if row_flags is not None else slots, scale, slots.shape[1],
        latent_cache.shape[0] * latent_cache.shape[1], ql.stride(0), ql.stride(1),
        q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), slots.stride(0), out.stride(0),
        out.stride(1), H=heads, HEADS=block_h, RANK=rank, RANK_P=rank_p, ROPE=rope,
        ROPE_P=rope_p, PAGE=latent_cache.shape[1], BLOCK_N=max(16, block_n), SPLITS=splits,
        FP8=fp8, PRECISION="ieee" if ql.dtype == torch.float32 else "tf32",
        FLAGGED=row_flags is not None, num_warps=warps, num_stages=stages)
    if splits > 1:  # (every row a token: one "request" of all of them)
        rows = torch.arange(2, device=ql.device, dtype=torch.int32) * tokens
        combine_splits_kernel[(tokens, heads)](
            out, out, part_o, part_lse, rows, out, kv_scale if fp8 else out, 1, out.stride(0),
            out.stride(1), 0, HQ=heads, NUM_SPLITS=splits, SPLITS_P=pow2(splits), DV=rank,
            DV_P=rank_p, HAS_SINKS=False, FP8=fp8, WRITE_LSE=False,
            SPLIT_BLOCK=combine_split_block(splits, rank_p), ALL_ROWS=False,
            num_warps=4)


@triton.jit
def pack_selection_kernel(slots_ptr, counts_ptr, indptr_ptr, indices_ptr, flags_ptr, topk,
                          capacity, stride_st, BLOCK: tl.constexpr):
    """Row ``t``'s first ``counts[t]`` entries into ``indices[indptr[t]:]`` (an entry outside
    the cache as slot 0: the packed kernel reads every index it is given) and ``flags[t]``:
    1 where the packed entries are not the row's selection -- an invalid entry among the
    first ``counts[t]``, or a valid one after them."""
    t = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + t)
    base = tl.load(indptr_ptr + t).to(tl.int64)
    wrong = tl.zeros([BLOCK], tl.int32)
    for start in range(0, topk, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < topk
        slot = tl.load(slots_ptr + t * stride_st + offs, mask=inside, other=-1).to(tl.int64)
        valid = (slot >= 0) & (slot < capacity)
        packed = inside & (offs < count)
        tl.store(indices_ptr + base + offs, tl.where(valid, slot, 0).to(tl.int32), mask=packed)
        wrong = wrong | (inside & (valid != packed)).to(tl.int32)
    tl.store(flags_ptr + t, tl.max(wrong, axis=0))


def pack_selection(topk_slots, counts, indptr, indices, flags, capacity: int) -> None:
    """:func:`pack_selection_kernel` over every row (``counts`` / ``indptr`` int32 [T] on the
    device; ``flags`` int32 [T] written)."""
    t, topk = topk_slots.shape
    if t == 0:
        return
    slots = topk_slots if topk_slots.stride(1) == 1 else topk_slots.contiguous()
    pack_selection_kernel[(t,)](slots, counts, indptr, indices, flags, topk, capacity,
                                slots.stride(0), BLOCK=min(pow2(topk), 1024), num_warps=4)


def pack_selection_torch(topk_slots, counts, indptr, indices, flags, capacity: int) -> None:
    """:func:`pack_selection` in torch ops (its test oracle)."""
    t, topk = topk_slots.shape
    slots = topk_slots.long()
    valid = (slots >= 0) & (slots < capacity)
    cols = torch.arange(topk, device=slots.device)
    packed = cols[None, :] < counts.long()[:, None]
    where = (indptr.long()[:, None] + cols[None, :])[packed]
    indices[where] = slots.where(valid, 0)[packed].to(indices.dtype)
    flags.copy_((valid != packed).any(dim=1).to(flags.dtype))
