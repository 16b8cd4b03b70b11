"""The sparse-MLA indexer's ops on the device, reading no host value (so they capture in CUDA
graphs): the index-key write (:func:`index_k_write_kernel`, a token a program) and the top-k:

1. :func:`index_score_kernel` (Triton) -- one program per query row and block of ``BLOCK_N``
   positions of its request: the keys gathered through the block table and dequantized
   (fp8: each group of channels times its scale), ``score_j = sum_h w_h relu(q_h . k_j)``
   over the index heads as one product, into ``[rows, positions]`` fp32 with ``-inf`` where
   the row does not see ``j`` (past its position, or a padding row); rows of requests of at
   most ``topk`` tokens read no key and score 0 (they select everything they see);
2. the scores as int64 keys ``order(score) * 2^32 + (2^32 - 1 - j)`` -- ``order`` an
   order-preserving int32 of the fp32 score, zero of either sign as +0 -- so equal scores
   keep the lower position first, as the reference's stable sort does; ``torch.topk`` of the
   keys, the positions sorted ascending, positions a row does not see as -1.

The position axis is the block table's capacity (pages x page), a shape; long steps run in
groups of :data:`ROWS_A_PASS` rows to bound the ``[rows, positions]`` buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.routing import pow2

__all__ = ["ROWS_A_PASS", "index_k_write_kernel", "index_score_kernel",
           "indexer_k_write_device", "indexer_topk_device"]

ROWS_A_PASS = 2048


@triton.jit
def index_score_kernel(q_ptr, w_ptr, keys_ptr, scales_ptr, table_ptr, req_ptr, seq_ptr,
                       qsl_ptr, out_ptr, row0, num_reqs, num_positions, topk, stride_qt,
                       stride_qh,
                       stride_wt, stride_kb, stride_kp, stride_sb, stride_sp, stride_bt,
                       stride_ot, H: tl.constexpr, H_P: tl.constexpr, D: tl.constexpr,
                       D_P: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
                       HAS_SCALES: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):
    i = tl.program_id(0)  # (a row of this pass)
    t = row0 + i
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    req = tl.load(req_ptr + t)
    start = tl.load(qsl_ptr + req)
    # the row's position: the request's length minus its new rows, plus the row's place
    pos = tl.load(seq_ptr + req) - (tl.load(qsl_ptr + req + 1) - start) + (t - start)
    # (rows past the last request's are padding; a vector: scalar masks fail interpreted)
    seen = (offs_n <= pos) & (offs_n * 0 + t < tl.load(qsl_ptr + num_reqs))
    # a request of at most top-k tokens selects them all: its keys are not read or scored
    scored = seen & (offs_n * 0 + tl.load(seq_ptr + req) > topk)
    offs_h = tl.arange(0, H_P)
    offs_d = tl.arange(0, D_P)
    h_ok = offs_h < H
    d_ok = offs_d < D
    page = tl.load(table_ptr + req.to(tl.int64) * stride_bt + offs_n // PAGE, mask=scored,
                   other=0).to(tl.int64)
    row = page * stride_kb + (offs_n % PAGE) * stride_kp
    k = tl.load(keys_ptr + row[:, None] + offs_d[None, :],
                mask=scored[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    if HAS_SCALES:
        srow = page * stride_sb + (offs_n % PAGE) * stride_sp
        s = tl.load(scales_ptr + srow[:, None] + (offs_d // GROUP)[None, :],
                    mask=scored[:, None] & d_ok[None, :], other=0.0)
        k = k * s
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
                + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=h_ok, other=0.0)
    dots = tl.dot(q.to(tl.float32), tl.trans(k), input_precision=PRECISION)  # [H_P, BLOCK_N]
    score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
    score = tl.where(score == 0.0, 0.0, score)  # (-0 as +0: one key for all zeros)
    score = tl.where(seen, score, float("-inf"))
    tl.store(out_ptr + i.to(tl.int64) * stride_ot + offs_n, score, mask=offs_n < num_positions)


def _order_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys of ``[rows, positions]`` fp32 scores: larger score first, then lower
    position (scores' -0 already +0)."""
    bits = scores.view(torch.int32).to(torch.int64)
    order = torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF) - 1)
    pos = torch.arange(scores.shape[1], device=scores.device, dtype=torch.int64)
    return order * (1 << 32) + ((1 << 32) - 1 - pos)


def indexer_topk_device(q, weights, keys, scales, block_table, seq_lens, query_start_loc,
                        topk: int, block_n: int = 64) -> torch.Tensor:
    """``torch.ops.attn.indexer_topk`` without host reads (inputs already checked)."""
    t, h, d = q.shape
    page = keys.shape[1]
    out = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    num_positions = block_table.shape[1] * page
    qsl = query_start_loc.to(torch.int32)
    rows = torch.arange(t, device=q.device, dtype=torch.int32)
    req = torch.searchsorted(qsl[1:], rows, right=True).clamp(max=b - 1).to(torch.int32)
    q = q if q.stride(2) == 1 else q.contiguous()
    w = weights.float().contiguous()
    k = min(topk, num_positions)
    group = d // scales.shape[2] if scales is not None else d
    precision = "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"
    for r0 in range(0, t, ROWS_A_PASS):
        n = min(ROWS_A_PASS, t - r0)
        scores = torch.empty(n, num_positions, dtype=torch.float32, device=q.device)
        index_score_kernel[(n, triton.cdiv(num_positions, block_n))](
            q, w, keys, scales if scales is not None else w, block_table, req,
            seq_lens, qsl, scores, r0, b, num_positions, topk, q.stride(0), q.stride(1),
            w.stride(0),
            keys.stride(0), keys.stride(1), scales.stride(0) if scales is not None else 0,
            scales.stride(1) if scales is not None else 0, block_table.stride(0),
            scores.stride(0), H=h, H_P=pow2(h, 16), D=d, D_P=pow2(d, 16), PAGE=page,
            GROUP=group, HAS_SCALES=scales is not None, BLOCK_N=block_n, PRECISION=precision)
        best = torch.topk(_order_keys(scores), k, dim=1).indices
        seen = torch.gather(scores, 1, best) > float("-inf")
        chosen = torch.where(seen, best, num_positions).sort(dim=1).values
        out[r0:r0 + n, :k] = torch.where(chosen < num_positions, chosen, -1).to(torch.int32)
    return out


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
