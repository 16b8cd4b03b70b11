"""Triton kernels of the recurrent-state ops on GPUs (on the CPU, Triton's interpreter runs
them in the tests):

* :func:`conv_kernel` / :func:`conv_state_kernel` -- the causal depthwise convolution, one
  program per block of tokens and channels (each tap from the batch or from the request's
  conv state), then each request's last ``K - 1`` inputs into its slot;
* :func:`gdn_recurrent_kernel` -- the gated delta rule, one program per request, value head and
  block of value columns, the state block held in registers over the request's tokens: one
  read and one write of the state per step (a decode's whole cost);
* :func:`ssd_recurrent_kernel` -- Mamba2's state update the same way, per request, head and
  block of head channels;
* :func:`mamba1_recurrent_kernel` -- Mamba1's, per request and block of channels (each
  channel's ``d_state`` row);
* :func:`lightning_recurrent_kernel` -- lightning attention's, per request, head and block of
  value columns.

The recurrences step token by token: the decode form, right for any batch (speculative and
short prefills included); long prefills are their chunked kernels' work.

A state slot is a device-side index, never trusted: one outside the state tensor
(``< 0`` or ``>= num_slots``) is absent -- its request reads zeros (as without an initial
state) and none of its states is stored -- by masks on the loads and stores, with the pointer
clamped into the tensor (the torch bodies' rule: :func:`~attn_ops.backends.ssm.common.
read_states`, :func:`~attn_ops.backends.ssm.common.store_states`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attn_ops.routing import cdiv, pow2

_MAX_GRID_YZ = 65535  # (CUDA's bound on a grid's second and third axes)

__all__ = ["conv_triton", "gdn_recurrent_triton", "lightning_recurrent_triton",
           "mamba1_recurrent_triton", "ssd_recurrent_triton"]


@triton.jit
def _token_requests(qsl_ptr, offs_t, num_reqs, SEARCH_STEPS: tl.constexpr):
    """Each row's request: the last ``r < num_reqs`` with ``qsl[r] <= row`` (a binary search
    over ``query_start_loc`` in ``SEARCH_STEPS`` = ``num_reqs.bit_length()`` halvings)."""
    req = offs_t * 0
    for i in tl.static_range(SEARCH_STEPS):
        cand = req + (1 << (SEARCH_STEPS - 1 - i))
        inside = cand < num_reqs
        start = tl.load(qsl_ptr + cand, mask=inside, other=0)
        req = tl.where(inside & (start <= offs_t), cand, req)
    return req


@triton.jit
def request_span(qsl_ptr, r, num_tokens):
    """Request ``r``'s rows ``[start, end)`` from ``query_start_loc``, clamped into the
    ``num_tokens`` rows and never decreasing: a corrupt device value reads and writes no row
    outside the batch (the host checks the values where it holds them)."""
    start = tl.minimum(tl.maximum(tl.load(qsl_ptr + r), 0), num_tokens)
    end = tl.minimum(tl.maximum(tl.load(qsl_ptr + r + 1), start), num_tokens)
    return start, end


@triton.jit
def _inside(slot, num_slots):
    """Whether each of ``slot`` is a slot of the state (``[0, num_slots)``): else absent."""
    return (slot >= 0) & (slot < num_slots)


@triton.jit
def conv_kernel(x_ptr, w_ptr, b_ptr, state_ptr, y_ptr, qsl_ptr, slot_ptr, init_ptr,
                num_tokens, num_reqs, num_slots, dim, stride_xt, stride_yt, stride_ss, stride_sk,
                stride_idx, K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                COPIED: tl.constexpr):
    """Rows ``BLOCK_T`` at a time, ``BLOCK_D`` channels: each tap from the batch or from the
    request's conv state -- ``state`` row ``slot_ptr[req * stride_idx]``, or with ``COPIED``
    row ``req`` (a copy of the read states), the slot then only telling whether it is
    present."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    real = offs_t < tl.load(qsl_ptr + num_reqs)  # (rows past the last request's: padding)
    req = _token_requests(qsl_ptr, offs_t, num_reqs, SEARCH_STEPS)
    pos = offs_t - tl.minimum(tl.maximum(tl.load(qsl_ptr + req, mask=offs_t < num_tokens,
                                                 other=0), 0), num_tokens)
    slot = tl.load(slot_ptr + req * stride_idx, mask=offs_t < num_tokens, other=0).to(tl.int64)
    present = _inside(slot, num_slots)
    init = (tl.load(init_ptr + req, mask=offs_t < num_tokens, other=0) != 0) & present
    if COPIED:
        slot = req.to(tl.int64)
    else:
        slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        lag = K - 1 - j
        p = pos - lag
        w = tl.load(w_ptr + offs_d * K + j, mask=d_ok, other=0.0).to(tl.float32)
        in_x = real & (p >= 0)
        vx = tl.load(x_ptr + (offs_t - lag)[:, None] * stride_xt + offs_d[None, :],
                     mask=in_x[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        in_s = real & (p < 0) & init
        vs = tl.load(state_ptr + slot[:, None] * stride_ss + (K - 1 + p)[:, None] * stride_sk
                     + offs_d[None, :], mask=in_s[:, None] & d_ok[None, :], other=0.0).to(
                         tl.float32)
        acc += (vx + vs) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    acc = tl.where(real[:, None], acc, 0.0)
    tl.store(y_ptr + offs_t[:, None] * stride_yt + offs_d[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=(offs_t < num_tokens)[:, None] & d_ok[None, :])


@triton.jit
def conv_state_kernel(x_ptr, src_ptr, state_ptr, qsl_ptr, slot_ptr, init_ptr, num_slots, dim,
                      num_tokens,
                      stride_xt, stride_src, stride_srck, stride_ss, stride_sk, stride_idx,
                      NUM_WRITES: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    """Request ``program_id(0)``'s last ``K - 1`` inputs into its slot -- old state rows read
    in place, from ``src`` (the state itself) at the slot -- or, with ``NUM_WRITES`` W > 0
    (speculative decoding; ``src`` then a copy of the read states, row ``r``), its state after
    each new token into columns ``1 + min(i, W - 1)`` of its ``slot`` row."""
    r = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    d_ok = offs_d < dim
    k_ok = offs_k < K - 1
    start, end = request_span(qsl_ptr, r, num_tokens)
    n = end - start
    read = tl.load(slot_ptr + r * stride_idx).to(tl.int64)
    present = _inside(read + offs_k * 0, num_slots)  # (vectors: scalar masks fail interpreted)
    init = (tl.load(init_ptr + r + offs_k * 0) != 0) & present
    if NUM_WRITES == 0:
        read = tl.minimum(tl.maximum(read, 0), num_slots - 1)
    else:
        read = r.to(tl.int64)
    for c in tl.static_range(max(NUM_WRITES, 1)):
        # inputs consumed: all (one slot, or the last column), else c + 1; where the column
        # keeps a state: always with one slot; the first W - 1 if the request has token c; the
        # last if it has at least W tokens
        if (NUM_WRITES == 0) | (c == NUM_WRITES - 1):
            ends = n + offs_k * 0
        else:
            ends = tl.minimum(c + 1, n) + offs_k * 0
        if NUM_WRITES == 0:
            keep = offs_k >= 0
        elif c < NUM_WRITES - 1:
            keep = (offs_k * 0 + c) < n
        else:
            keep = (offs_k * 0 + NUM_WRITES) <= n
        slot = tl.load(slot_ptr + r * stride_idx + (0 if NUM_WRITES == 0 else 1 + c)).to(tl.int64)
        keep = keep & _inside(slot + offs_k * 0, num_slots)  # (an absent slot: not written)
        slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
        p = ends - (K - 1) + offs_k
        vx = tl.load(x_ptr + (start + p)[:, None] * stride_xt + offs_d[None, :],
                     mask=(k_ok & (p >= 0))[:, None] & d_ok[None, :], other=0.0)
        vs = tl.load(src_ptr + read * stride_src + (K - 1 + p)[:, None] * stride_srck
                     + offs_d[None, :], mask=(k_ok & (p < 0) & init)[:, None] & d_ok[None, :],
                     other=0.0)
        new = vx.to(tl.float32) + vs.to(tl.float32)
        if NUM_WRITES == 0:
            # In place, a row's new value is a later row's old one (after n new tokens, row i
            # takes row i + n), loaded by other threads of this program: every thread's loads
            # complete before any thread stores. Without the barrier a warp that runs ahead
            # overwrites rows another has not read yet -- wrong states at the whim of warp
            # scheduling (more often with more programs and wider elements).
            tl.debug_barrier()
        tl.store(state_ptr + slot * stride_ss + offs_k[:, None] * stride_sk + offs_d[None, :],
                 new.to(state_ptr.dtype.element_ty),
                 mask=(k_ok & keep)[:, None] & d_ok[None, :])


def conv_triton(x, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state,
                activation) -> torch.Tensor:
    """``torch.ops.attn.causal_conv1d`` in two launches (inputs already checked by the op)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    t, d = x.shape
    k = weight.shape[1]
    y = torch.empty_like(x)
    b = query_start_loc.shape[0] - 1
    slots = conv_state.shape[0]
    copied = state_indices.dim() == 2
    if copied:  # (speculative: read a copy, the writes may hit read slots)
        src = conv_state[state_indices[:, 0].long().clamp(0, slots - 1)]
    else:
        src = conv_state
    if t and b:
        block_d = min(pow2(d), 128)
        conv_kernel[(cdiv(t, 16), cdiv(d, block_d))](
            x, weight, bias if bias is not None else weight, src, y, query_start_loc,
            state_indices, has_initial_state, t, b, slots, d, x.stride(0), y.stride(0),
            src.stride(0), src.stride(1), state_indices.stride(0), K=k,
            HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_T=16, BLOCK_D=block_d,
            SEARCH_STEPS=b.bit_length(), COPIED=copied)
    elif t:
        y.zero_()
    if b:
        block_d = min(pow2(d), 256)
        conv_state_kernel[(b, cdiv(d, block_d))](
            x, src, conv_state, query_start_loc, state_indices, has_initial_state, slots, d, t,
            x.stride(0), src.stride(0), src.stride(1), conv_state.stride(0),
            conv_state.stride(1), state_indices.stride(0), NUM_WRITES=_num_writes(state_indices),
            K=k, BLOCK_K=pow2(k - 1), BLOCK_D=block_d)
    return y


@triton.jit
def _request_state(qsl_ptr, slot_ptr, init_ptr, state_ptr, r, stride_idx, stride_ss, num_slots,
                   head_offs, offs_row, offs_col, row_ok, col_ok, stride_row, num_tokens,
                   EVICT: tl.constexpr):
    """Request ``r``'s new-token range and its state block ``[rows, cols]`` (at
    ``head_offs`` in a slot) read in fp32 -- zeros without an initial state or with an absent
    slot -- with the block's offsets in a slot, its pointers in the read slot, its mask and
    the mask of a store back into that slot (empty where it is absent); ``EVICT``: the read's
    L2 eviction policy."""
    start, end = request_span(qsl_ptr, r, num_tokens)
    slot = tl.load(slot_ptr + r * stride_idx).to(tl.int64)
    present = _inside(slot + offs_row * 0, num_slots)  # (vectors: scalar masks fail interpreted)
    init = (tl.load(init_ptr + r + offs_row * 0) != 0) & present
    slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    s_offs = head_offs + offs_row[:, None] * stride_row + offs_col[None, :]
    s_ptrs = state_ptr + slot * stride_ss + s_offs
    s_mask = row_ok[:, None] & col_ok[None, :]
    s = tl.load(s_ptrs, mask=s_mask & init[:, None], other=0.0,
                eviction_policy=EVICT).to(tl.float32)
    return start, end, s, s_offs, s_ptrs, s_mask, s_mask & present[:, None]


@triton.jit
def gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, qsl_ptr,
                         slot_ptr, init_ptr, scale, stride_idx, stride_qt, stride_qh,
                         stride_vt, stride_vh, stride_gt, stride_ss, stride_sh, stride_sk,
                         stride_ot, stride_oh, num_tokens, num_slots, NUM_WRITES: tl.constexpr,
                         GROUP: tl.constexpr,
                         DK: tl.constexpr, DV: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr,
                         EVICT: tl.constexpr, STORE: tl.constexpr):
    r = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    start, end, s, s_offs, s_ptrs, s_mask, w_mask = _request_state(
        qsl_ptr, slot_ptr, init_ptr, state_ptr, r, stride_idx, stride_ss, num_slots,
        hv * stride_sh, offs_k, offs_v, k_ok, v_ok, stride_sk, num_tokens, EVICT)
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + hk * stride_qh + offs_k, mask=k_ok,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_qt + hk * stride_qh + offs_k, mask=k_ok,
                    other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + t * stride_vt + hv * stride_vh + offs_v, mask=v_ok,
                    other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + t * stride_gt + hv).to(tl.float32))
        beta = tl.load(beta_ptr + t * stride_gt + hv).to(tl.float32)
        # both products with the state read as loaded (S^T k, S^T q): one pass over it, and
        # the new state's store waits on one reduction, not two;
        # o = (decay S + k delta^T)^T q = decay S^T q + (k . q) delta
        s_k = tl.sum(s * k[:, None], axis=0)
        s_q = tl.sum(s * q[:, None], axis=0)
        delta = (v - decay * s_k) * beta
        o = decay * s_q + tl.sum(k * q) * delta
        s = s * decay + k[:, None] * delta[None, :]
        tl.store(o_ptr + t * stride_ot + hv * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty),
                 mask=v_ok)
        _keep_step(state_ptr, slot_ptr, s, s_offs, s_mask, r, t - start, end - start,
                   stride_idx, stride_ss, num_slots, offs_k, NUM_WRITES)
    _keep_final(state_ptr, s_ptrs, s, w_mask, NUM_WRITES, STORE)
    _zero_padding_rows(o_ptr, r == tl.num_programs(0) - 1, end, num_tokens, stride_ot,
                       hv * stride_oh + offs_v, v_ok)


@triton.jit
def _zero_padding_rows(o_ptr, last, end, num_tokens, stride_ot, offs, ok):
    """The last request's programs (``last``) write zeros to the rows past its end (padding),
    so the output needs no memset before the launch."""
    first = tl.where(last, end, num_tokens)
    for t in range(first, num_tokens):
        tl.store(o_ptr + t * stride_ot + offs, tl.zeros_like(offs).to(o_ptr.dtype.element_ty),
                 mask=ok)


def _num_writes(state_indices: torch.Tensor) -> int:
    """W: the slots a request's states go to with speculative decoding (0: one slot)."""
    return state_indices.shape[1] - 1 if state_indices.dim() == 2 else 0


@triton.jit
def _keep_step(state_ptr, slot_ptr, s, s_offs, s_mask, r, i, n, stride_idx, stride_ss,
               num_slots, offs, NUM_WRITES: tl.constexpr):
    """Speculative decoding (``NUM_WRITES`` W > 0): the state after new token ``i`` of ``n``
    into column ``1 + min(i, W - 1)`` of the request's slots, if that column keeps it (and
    its slot is present)."""
    if NUM_WRITES > 0:
        ii = offs * 0 + i  # (vectors: scalar masks fail interpreted)
        keep = (ii < NUM_WRITES - 1) | (ii == n - 1)
        col = 1 + tl.minimum(ii, NUM_WRITES - 1)
        slot = tl.load(slot_ptr + r * stride_idx + col, mask=keep, other=0).to(tl.int64)
        keep = keep & _inside(slot, num_slots)
        tl.store(state_ptr + tl.max(tl.where(keep, slot, 0)) * stride_ss + s_offs,
                 s.to(state_ptr.dtype.element_ty), mask=s_mask & keep[:, None])


@triton.jit
def _keep_final(state_ptr, s_ptrs, s, s_mask, NUM_WRITES: tl.constexpr, STORE: tl.constexpr):
    """One slot a request (``NUM_WRITES`` 0): its final state back into it (``s_mask``: the
    store's, empty where the slot is absent; ``STORE``: its cache modifier)."""
    if NUM_WRITES == 0:
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=s_mask, cache_modifier=STORE)


def _state_cache_hints(streaming: bool) -> dict:
    """The decode kernels' state read / write cache hints: a state is read once and written
    once a step, so ``streaming`` keeps it from displacing what L2 holds for the step."""
    return {"EVICT": "evict_first", "STORE": ".cs"} if streaming else {"EVICT": "", "STORE": ""}


def state_block(rows: int, cols: int, block: int, min_programs: int) -> int:
    """State columns a program of a launch over ``rows`` (requests x heads) state rows of
    ``cols`` columns (the decodes', the chunked GDN hand-off's): ``block`` (at most the
    columns' power of two), halved -- not below 32 or the block asked for -- while the launch
    has fewer than ``min_programs`` programs."""
    block = min(pow2(cols), block)
    floor = min(block, 32)
    while block > floor and rows * cdiv(cols, block) < min_programs:
        block //= 2
    return block


def gdn_recurrent_triton(q, k, v, g, beta, state, query_start_loc, state_indices,
                         has_initial_state, scale, qk_l2norm, block_v: int = 32,
                         num_warps: int = 4, min_programs: int = 1,
                         streaming: bool = False) -> torch.Tensor:
    """``torch.ops.attn.gated_delta_rule`` token by token, ``block_v`` value columns a
    program, halved (not below 32) while the launch has fewer than ``min_programs`` programs;
    ``streaming``: the state read evict-first, written as a streaming store (inputs already
    checked)."""
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    if k.stride() != q.stride():
        k = k.contiguous()
        q = q.contiguous()
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    b = query_start_loc.shape[0] - 1
    if b == 0:
        return torch.zeros_like(v)
    out = torch.empty_like(v)
    block_v = state_block(b * hv, dv, block_v, min_programs)
    gdn_recurrent_kernel[(b, hv, cdiv(dv, block_v))](
        q, k, v, g, beta, state, out, query_start_loc, state_indices, has_initial_state, scale,
        state_indices.stride(0), q.stride(0), q.stride(1), v.stride(0), v.stride(1),
        g.stride(0), state.stride(0), state.stride(1), state.stride(2), out.stride(0),
        out.stride(1), t, state.shape[0], NUM_WRITES=_num_writes(state_indices), GROUP=hv // hk,
        DK=dk, DV=dv,
        BLOCK_K=pow2(dk), BLOCK_V=block_v, L2NORM=qk_l2norm,
        **_state_cache_hints(streaming), num_warps=num_warps)
    return out


@triton.jit
def ssd_recurrent_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr, state_ptr,
                         y_ptr, qsl_ptr, slot_ptr, init_ptr, dt_min, dt_max,
                         stride_idx, stride_xt,
                         stride_xh, stride_dtt, stride_bt, stride_bg, stride_ss, stride_sh,
                         stride_sp, num_tokens, num_slots, NUM_WRITES: tl.constexpr,
                         HEADS_PER_GROUP: tl.constexpr,
                         P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_N: tl.constexpr, HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr,
                         EVICT: tl.constexpr, STORE: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // HEADS_PER_GROUP
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_ok = offs_p < P
    n_ok = offs_n < N
    start, end, s, s_offs, s_ptrs, s_mask, w_mask = _request_state(
        qsl_ptr, slot_ptr, init_ptr, state_ptr, r, stride_idx, stride_ss, num_slots,
        h * stride_sh, offs_p, offs_n, p_ok, n_ok, stride_sp, num_tokens, EVICT)
    a = tl.load(a_ptr + h).to(tl.float32)
    d_skip = tl.load(d_ptr + h).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    for t in range(start, end):
        dt = tl.load(dt_ptr + t * stride_dtt + h).to(tl.float32) + dt_bias
        if SOFTPLUS:
            dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs_p, mask=p_ok,
                    other=0.0).to(tl.float32)
        bb = tl.load(b_ptr + t * stride_bt + grp * stride_bg + offs_n, mask=n_ok,
                     other=0.0).to(tl.float32)
        cc = tl.load(c_ptr + t * stride_bt + grp * stride_bg + offs_n, mask=n_ok,
                     other=0.0).to(tl.float32)
        s = s * tl.exp(dt * a) + (dt * x)[:, None] * bb[None, :]
        y = tl.sum(s * cc[None, :], axis=1) + d_skip * x
        if HAS_Z:
            z = tl.load(z_ptr + t * stride_xt + h * stride_xh + offs_p, mask=p_ok,
                        other=0.0).to(tl.float32)
            y = y * z / (1.0 + tl.exp(-z))
        tl.store(y_ptr + t * stride_xt + h * stride_xh + offs_p, y.to(y_ptr.dtype.element_ty),
                 mask=p_ok)
        _keep_step(state_ptr, slot_ptr, s, s_offs, s_mask, r, t - start, end - start,
                   stride_idx, stride_ss, num_slots, offs_p, NUM_WRITES)
    _keep_final(state_ptr, s_ptrs, s, w_mask, NUM_WRITES, STORE)
    _zero_padding_rows(y_ptr, r == tl.num_programs(0) - 1, end, num_tokens, stride_xt,
                       h * stride_xh + offs_p, p_ok)


def ssd_recurrent_triton(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
                         has_initial_state, dt_softplus, dt_min, dt_max, block_p: int = 32,
                         num_warps: int = 4, streaming: bool = False) -> torch.Tensor:
    """``torch.ops.attn.mamba2_ssd`` token by token, ``block_p`` head channels a program;
    ``streaming`` as :func:`gdn_recurrent_triton`'s (inputs already checked)."""
    x, dt, B, C = (u.contiguous() for u in (x, dt, B, C))
    z = z.contiguous() if z is not None else None
    t, h, p = x.shape
    g, n = B.shape[1:]
    b = query_start_loc.shape[0] - 1
    if b == 0:
        return torch.zeros_like(x)
    y = torch.empty_like(x)
    block_p = min(pow2(p), block_p)
    D, dt_bias = _or_zeros(D, h, x.device), _or_zeros(dt_bias, h, x.device)
    ssd_recurrent_kernel[(b, h, cdiv(p, block_p))](
        x, dt, A, B, C, D, z if z is not None else x, dt_bias, state, y, query_start_loc,
        state_indices, has_initial_state, float(dt_min), float(min(dt_max, 3.0e38)),
        state_indices.stride(0), x.stride(0), x.stride(1), dt.stride(0), B.stride(0),
        B.stride(1), state.stride(0), state.stride(1), state.stride(2), t, state.shape[0],
        NUM_WRITES=_num_writes(state_indices), HEADS_PER_GROUP=h // g, P=p, N=n,
        BLOCK_P=block_p, BLOCK_N=pow2(n), HAS_Z=z is not None,
        SOFTPLUS=dt_softplus, **_state_cache_hints(streaming), num_warps=num_warps)
    return y


@triton.jit
def _mamba1_token_inputs(x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, t, end, offs_d, offs_n, d_ok, n_ok,
                         stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct,
                         HAS_Z: tl.constexpr):
    """Token ``t``'s inputs as stored: ``dt``, ``x``, ``z`` of the channels, ``B``, ``C``;
    nothing is read at or past ``end``."""
    ok = d_ok & (offs_d * 0 + t < end)  # (vectors: scalar masks fail interpreted)
    n_mask = n_ok & (offs_n * 0 + t < end)
    dt = tl.load(dt_ptr + t * stride_dtt + offs_d, mask=ok, other=0.0)
    x = tl.load(x_ptr + t * stride_xt + offs_d, mask=ok, other=0.0)
    z = x
    if HAS_Z:
        z = tl.load(z_ptr + t * stride_zt + offs_d, mask=ok, other=0.0)
    bb = tl.load(b_ptr + t * stride_bt + offs_n, mask=n_mask, other=0.0)
    cc = tl.load(c_ptr + t * stride_ct + offs_n, mask=n_mask, other=0.0)
    return dt, x, z, bb, cc


@triton.jit
def mamba1_recurrent_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, dtb_ptr,
                            state_ptr, y_ptr, qsl_ptr, slot_ptr, init_ptr, stride_idx,
                            stride_xt, stride_yt, stride_dtt, stride_zt, stride_bt, stride_ct,
                            stride_a,
                            stride_ss, stride_sd, num_tokens, num_slots,
                            NUM_WRITES: tl.constexpr, D_INNER: tl.constexpr, N: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_Z: tl.constexpr,
                            SOFTPLUS: tl.constexpr, PREFETCH: tl.constexpr,
                            EVICT: tl.constexpr, STORE: tl.constexpr,
                            CHANNEL_MAJOR: tl.constexpr):
    """Request ``program_id(0)``, channels ``program_id(1) * BLOCK_D ...`` (the axes swapped
    with ``CHANNEL_MAJOR``): each channel's ``d_state`` row of the state in registers over
    the request's tokens, its own time step and rates, B and C shared by the channels;
    ``PREFETCH``: each token's inputs read while the previous token's step computes (the loop
    is otherwise bound by their latency); ``EVICT`` / ``STORE``: the state read's eviction
    policy and its write's cache modifier."""
    r = tl.program_id(1 if CHANNEL_MAJOR else 0)
    offs_d = tl.program_id(0 if CHANNEL_MAJOR else 1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < D_INNER
    n_ok = offs_n < N
    start, end, s, s_offs, s_ptrs, s_mask, w_mask = _request_state(
        qsl_ptr, slot_ptr, init_ptr, state_ptr, r, stride_idx, stride_ss, num_slots, 0,
        offs_d, offs_n, d_ok, n_ok, stride_sd, num_tokens, EVICT)
    a = tl.load(a_ptr + offs_d[:, None] * stride_a + offs_n[None, :],
                mask=d_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    d_skip = tl.load(d_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    if PREFETCH:
        dt_n, x_n, z_n, b_n, c_n = _mamba1_token_inputs(
            x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, start, end, offs_d, offs_n, d_ok, n_ok,
            stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct, HAS_Z)
    for t in range(start, end):
        if PREFETCH:
            dt_r, x_r, z_r, b_r, c_r = dt_n, x_n, z_n, b_n, c_n
            dt_n, x_n, z_n, b_n, c_n = _mamba1_token_inputs(
                x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, t + 1, end, offs_d, offs_n, d_ok, n_ok,
                stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct, HAS_Z)
        else:
            dt_r, x_r, z_r, b_r, c_r = _mamba1_token_inputs(
                x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, t, end, offs_d, offs_n, d_ok, n_ok,
                stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct, HAS_Z)
        dt = dt_r.to(tl.float32) + dt_bias
        if SOFTPLUS:
            dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
        x = x_r.to(tl.float32)
        bb = b_r.to(tl.float32)
        cc = c_r.to(tl.float32)
        s = s * tl.exp(dt[:, None] * a) + (dt * x)[:, None] * bb[None, :]
        y = tl.sum(s * cc[None, :], axis=1) + d_skip * x
        if HAS_Z:
            z = z_r.to(tl.float32)
            y = y * z / (1.0 + tl.exp(-z))
        tl.store(y_ptr + t * stride_yt + offs_d, y.to(y_ptr.dtype.element_ty), mask=d_ok)
        _keep_step(state_ptr, slot_ptr, s, s_offs, s_mask, r, t - start, end - start,
                   stride_idx, stride_ss, num_slots, offs_d, NUM_WRITES)
    _keep_final(state_ptr, s_ptrs, s, w_mask, NUM_WRITES, STORE)
    _zero_padding_rows(y_ptr, r == tl.num_programs(1 if CHANNEL_MAJOR else 0) - 1, end,
                       num_tokens, stride_yt, offs_d, d_ok)


def mamba1_recurrent_triton(x, dt, A, B, C, D, z, dt_bias, state, query_start_loc,
                            state_indices, has_initial_state, dt_softplus, block_d: int = 64,
                            num_warps: int = 4, prefetch: bool = True, min_programs: int = 1,
                            streaming: bool = False,
                            channel_major: bool = False) -> torch.Tensor:
    """``torch.ops.attn.mamba1_scan`` token by token, ``block_d`` channels a program, halved
    (not below 32) while the launch has fewer than ``min_programs`` programs; ``streaming``:
    the state read evict-first and written as a streaming store; ``channel_major``: the
    grid's first (fastest) axis over a request's channel blocks, so programs launched
    together read neighbouring blocks of one slot (inputs already checked)."""
    block_d = state_block(query_start_loc.shape[0] - 1, x.shape[1], block_d, min_programs)
    return mamba1_launch(mamba1_recurrent_kernel, x, dt, A, B, C, D, z, dt_bias, state,
                         query_start_loc, state_indices, has_initial_state, dt_softplus,
                         block_d, num_warps, channel_major=channel_major,
                         NUM_WRITES=_num_writes(state_indices), PREFETCH=prefetch,
                         **_state_cache_hints(streaming))


def mamba1_operands(x, dt, A, B, C, D, z, dt_bias) -> tuple:
    """A Mamba1 step's operands as its kernels read them: the last dim contiguous, an absent
    ``D`` / ``dt_bias`` fp32 zeros (``z`` stays None where absent)."""
    x, dt, A, B, C = (u if u.stride(-1) == 1 else u.contiguous() for u in (x, dt, A, B, C))
    z = z if z is None or z.stride(-1) == 1 else z.contiguous()
    d = x.shape[1]
    return x, dt, A, B, C, _or_zeros(D, d, x.device), z, _or_zeros(dt_bias, d, x.device)


def mamba1_launch(kernel, x, dt, A, B, C, D, z, dt_bias, state, query_start_loc, state_indices,
                  has_initial_state, dt_softplus, block_d: int, num_warps: int,
                  channel_major: bool | None = None, **constexprs) -> torch.Tensor:
    """One launch of a Mamba1 kernel -- token by token, chunked or unrolled
    (:mod:`~attn_ops.backends.ssm.mamba1_kernels`): they take the same arguments -- over
    a program a request and ``block_d`` channels; ``constexprs``: the kernel's own.
    ``channel_major`` (a kernel with ``CHANNEL_MAJOR``; None: one without): the grid's axes
    swapped where the requests fit its second axis."""
    x, dt, A, B, C, D, z, dt_bias = mamba1_operands(x, dt, A, B, C, D, z, dt_bias)
    t, d = x.shape
    n = A.shape[1]
    b = query_start_loc.shape[0] - 1
    if b == 0:
        return torch.zeros_like(x)
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    block_d = min(pow2(d), block_d)
    grid = (b, cdiv(d, block_d))
    if channel_major is not None:
        constexprs["CHANNEL_MAJOR"] = channel_major = channel_major and b <= _MAX_GRID_YZ
        grid = grid[::-1] if channel_major else grid
    kernel[grid](
        x, dt, A, B, C, D, z if z is not None else x, dt_bias, state, y, query_start_loc,
        state_indices, has_initial_state, state_indices.stride(0), x.stride(0), y.stride(0),
        dt.stride(0), z.stride(0) if z is not None else 0, B.stride(0), C.stride(0),
        A.stride(0), state.stride(0), state.stride(1), t, state.shape[0], D_INNER=d, N=n,
        BLOCK_D=block_d, BLOCK_N=pow2(n), HAS_Z=z is not None,
        SOFTPLUS=dt_softplus, num_warps=num_warps, **constexprs)
    return y


@triton.jit
def lightning_recurrent_kernel(q_ptr, k_ptr, v_ptr, slope_ptr, state_ptr, o_ptr, qsl_ptr,
                               slot_ptr, init_ptr, stride_idx, stride_qt, stride_qh, stride_kt,
                               stride_kh, stride_vt, stride_vh, stride_ss, stride_sh,
                               stride_sk, stride_ot, stride_oh, num_tokens, num_slots,
                               NUM_WRITES: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                               BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                               EVICT: tl.constexpr, STORE: tl.constexpr):
    """Request ``program_id(0)``, head ``program_id(1)``, value columns ``program_id(2) *
    BLOCK_V ...``: the ``[DK, BLOCK_V]`` block of its state in registers over the request's
    tokens, ``S = a S + k v^T``, ``o = S^T q``."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < DK
    v_ok = offs_v < DV
    start, end, s, s_offs, s_ptrs, s_mask, w_mask = _request_state(
        qsl_ptr, slot_ptr, init_ptr, state_ptr, r, stride_idx, stride_ss, num_slots,
        h * stride_sh, offs_k, offs_v, k_ok, v_ok, stride_sk, num_tokens, EVICT)
    decay = tl.exp(-tl.load(slope_ptr + h).to(tl.float32))
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + h * stride_qh + offs_k, mask=k_ok,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_k, mask=k_ok,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_v, mask=v_ok,
                    other=0.0).to(tl.float32)
        s = s * decay + k[:, None] * v[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty),
                 mask=v_ok)
        _keep_step(state_ptr, slot_ptr, s, s_offs, s_mask, r, t - start, end - start,
                   stride_idx, stride_ss, num_slots, offs_k, NUM_WRITES)
    _keep_final(state_ptr, s_ptrs, s, w_mask, NUM_WRITES, STORE)
    _zero_padding_rows(o_ptr, r == tl.num_programs(0) - 1, end, num_tokens, stride_ot,
                       h * stride_oh + offs_v, v_ok)


def lightning_recurrent_triton(q, k, v, slope, state, query_start_loc, state_indices,
                               has_initial_state, block_v: int = 64,
                               num_warps: int = 4, streaming: bool = False) -> torch.Tensor:
    """``torch.ops.attn.lightning_attention`` token by token, ``block_v`` value columns a
    program; ``streaming`` as :func:`gdn_recurrent_triton`'s (inputs already checked)."""
    return lightning_launch(lightning_recurrent_kernel, q, k, v, slope, state, query_start_loc,
                            state_indices, has_initial_state, block_v, num_warps,
                            NUM_WRITES=_num_writes(state_indices),
                            **_state_cache_hints(streaming))


def lightning_launch(kernel, q, k, v, slope, state, query_start_loc, state_indices,
                     has_initial_state, block_v: int, num_warps: int, min_block: int = 1,
                     **constexprs) -> torch.Tensor:
    """One launch of a lightning-attention kernel -- token by token, or chunked
    (:mod:`~attn_ops.backends.ssm.lightning_kernels`): they take the same arguments -- over
    a program a request, head and ``block_v`` value columns; the head and value blocks at
    least ``min_block`` (tensor-core tiles: 16); ``constexprs``: the kernel's own."""
    q, k, v = (u if u.stride(-1) == 1 else u.contiguous() for u in (q, k, v))
    t, h, dk = q.shape
    dv = v.shape[2]
    b = query_start_loc.shape[0] - 1
    if b == 0:
        return torch.zeros_like(v)
    out = torch.empty(t, h, dv, dtype=v.dtype, device=v.device)
    block_v = max(min(pow2(dv), block_v), min_block)
    kernel[(b, h, cdiv(dv, block_v))](
        q, k, v, slope, state, out, query_start_loc, state_indices, has_initial_state,
        state_indices.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), state.stride(0), state.stride(1), state.stride(2),
        out.stride(0), out.stride(1), t, state.shape[0], DK=dk, DV=dv,
        BLOCK_K=max(pow2(dk), min_block), BLOCK_V=block_v,
        num_warps=num_warps, **constexprs)
    return out


def _or_zeros(x: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """``x``, or ``n`` fp32 zeros where it is absent (a skip term D, a dt bias: adding 0)."""
    return x if x is not None else torch.zeros(n, dtype=torch.float32, device=device)
