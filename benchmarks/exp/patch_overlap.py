"""Source patch ``overlap`` of ``triton_attn_kernels.py`` for ``exp_triton_ab.py`` (not shipped).

The whole key blocks (phase 1: no mask, no soft-cap, no ALiBi, power-of-two head dims) issue
block ``b + 1``'s ``Q K^T`` before block ``b``'s softmax, in the hope that Hopper's
asynchronous ``wgmma`` runs it while the softmax's exp2 and row sums do -- the overlap FA3 gets
from its schedule, written at the source level. The last block is peeled off (no wasted
``Q K^T``); page numbers still run one block ahead of the loads that need them.
Correctness: ``python benchmarks/exp/exp_triton_ab.py --check overlap`` (Triton's interpreter).
"""

OVERLAP_FN = '''
@triton.jit
def _kv_rows(ptr, page, offs_n, kv_head, stride_b, stride_s, stride_h, offs,
             PAGE: tl.constexpr):
    return tl.load(ptr + page[:, None] * stride_b + (offs_n % PAGE)[:, None] * stride_s
                   + kv_head * stride_h + offs[None, :])


@triton.jit
def _block_pages(bt_row, offs_n, ok, PAGE: tl.constexpr):
    return tl.load(bt_row + offs_n // PAGE, mask=ok, other=0).to(tl.int64)


@triton.jit
def _online_step(acc, l_i, m_i, s, v, qk_scale, q, PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_overlap(acc, l_i, m_i, b0, b1, q, lo, hi, r, pos, row_ok, context, kv_head,
                    logit_scale, slope, ancestors, not_tree, bt_ptr, k_ptr, v_ptr, stride_bt,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, window,
                    soft_cap, offs_d, offs_dv, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                    D: tl.constexpr, D_P: tl.constexpr, DV: tl.constexpr, DV_P: tl.constexpr,
                    CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                    HAS_ALIBI: tl.constexpr, HAS_TREE: tl.constexpr, PRECISION: tl.constexpr,
                    MASKED: tl.constexpr):
    if MASKED or USE_SOFTCAP or HAS_ALIBI or D != D_P or DV != DV_P:
        acc, l_i, m_i = _attend(acc, l_i, m_i, b0, b1, q, lo, hi, r, pos, row_ok, context,
                                kv_head, logit_scale, slope, ancestors, not_tree, bt_ptr,
                                k_ptr, v_ptr, stride_bt, stride_kb, stride_ks, stride_kh,
                                stride_vb, stride_vs, stride_vh, window, soft_cap, offs_d,
                                offs_dv, PAGE, BLOCK_N, D, D_P, DV, DV_P, CAUSAL, USE_WINDOW,
                                USE_SOFTCAP, HAS_ALIBI, HAS_TREE, PRECISION, MASKED)
    else:
        qk_scale = logit_scale * LOG2E
        bt_row = bt_ptr + r * stride_bt
        offs = tl.arange(0, BLOCK_N)
        if b0 < b1:
            n0 = lo + b0 * BLOCK_N + offs
            pg_cur = _block_pages(bt_row, n0, offs >= 0, PAGE)
            pg_next = _block_pages(bt_row, n0 + BLOCK_N, (offs * 0 + b0 + 1) < b1, PAGE)
            k = _kv_rows(k_ptr, pg_cur, n0, kv_head, stride_kb, stride_ks, stride_kh, offs_d,
                         PAGE)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
            for b in range(b0, b1 - 1):
                offs_n = lo + b * BLOCK_N + offs
                v = _kv_rows(v_ptr, pg_cur, offs_n, kv_head, stride_vb, stride_vs, stride_vh,
                             offs_dv, PAGE)
                k_next = _kv_rows(k_ptr, pg_next, offs_n + BLOCK_N, kv_head, stride_kb,
                                  stride_ks, stride_kh, offs_d, PAGE)
                pg_after = _block_pages(bt_row, offs_n + 2 * BLOCK_N,
                                        (offs * 0 + b + 2) < b1, PAGE)
                s_next = tl.dot(q, tl.trans(k_next.to(q.dtype)), input_precision=PRECISION)
                acc, l_i, m_i = _online_step(acc, l_i, m_i, s, v, qk_scale, q, PRECISION)
                s = s_next
                pg_cur = pg_next
                pg_next = pg_after
            offs_n = lo + (b1 - 1) * BLOCK_N + offs
            v = _kv_rows(v_ptr, pg_cur, offs_n, kv_head, stride_vb, stride_vs, stride_vh,
                         offs_dv, PAGE)
            acc, l_i, m_i = _online_step(acc, l_i, m_i, s, v, qk_scale, q, PRECISION)
    return acc, l_i, m_i


@triton.jit
def _combine_parts('''

# (the call site first: the inserted function's own call of _attend reads the same)
PATCH = [("        acc, l_i, m_i = _attend(acc, l_i, m_i, b0, b1, q, lo, hi, r, pos, row_ok, "
          "context,\n",
          "        acc, l_i, m_i = _attend_overlap(acc, l_i, m_i, b0, b1, q, lo, hi, r, pos, "
          "row_ok, context,\n"),
         ("\n@triton.jit\ndef _combine_parts(", OVERLAP_FN)]

