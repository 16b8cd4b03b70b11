"""DeepSeek-V4's compressor: ``ratio`` tokens gated into one compressed KV entry, the group not
yet complete carried from step to step as state in a slot.

Per token ``t`` at position ``p``: ``c_t = x_t W_kv`` and ``z_t = x_t W_gate + B[p mod m]``
(``m`` the ratio, ``B`` the learned position bias), both ``coff * D`` wide. An entry is emitted
at the token that completes its group, ``(p + 1) % m == 0``, entry index ``w = p // m``:

* ``overlap=False`` (heavily compressed layers, ``m`` = 128; ``coff`` 1): over the ``m`` rows of
  group ``w``, ``e_w = sum_t softmax_t(z_t) * c_t``, the softmax per channel.
* ``overlap=True`` (compressed-sparse layers and their indexer, ``m`` = 4; ``coff`` 2): each row
  is two halves ``[A | B]``; ``e_w`` is the per-channel softmax-weighted sum over ``2m`` rows --
  the A halves of group ``w - 1`` and the B halves of group ``w`` (for ``w = 0`` no A rows:
  weight 0).

Then (:func:`finish_entries`) the weighted RMSNorm and RoPE on the trailing rotary dims at
position ``w * m``, and the entry's write into the compressed cache at its compressed slot
(:func:`compress_into_cache`: all of it for a step).

State: a slot of ``[coff * m, 2 * coff * D]`` fp32 rows ``[c | z + B]``, the last ``coff * m``
tokens' rows of the request at row ``p % (coff * m)`` -- every row a later group can still
need -- so a step may end anywhere in a group (chunked prefills, decodes) and the next one
completes it. A request without computed tokens (``seq_lens - new tokens == 0``) reads none;
a slot outside the state tensor is absent (its request reads none, nothing written), the
rule of the recurrent-state ops.
"""

from __future__ import annotations

import torch

from attn_ops.ops import define_op

__all__ = ["check_compressor", "compress_into_cache", "compressed_slot_mapping",
           "compressor_entries",
           "compressor_state_rows", "finish_entries", "interleaved_rope"]


def compressor_state_rows(ratio: int, overlap: bool) -> int:
    """Rows of a request's compressor state: the tokens a later entry can still read."""
    return (2 if overlap else 1) * ratio


def check_compressor(kv, gate, bias, state, query_start_loc, seq_lens, state_indices, ratio,
                     overlap):
    """The shapes the compressor ops need."""
    op = "dsv4_compressor"
    coff = 2 if overlap else 1
    if kv.dim() != 2 or gate.shape != kv.shape or kv.shape[1] % coff:
        raise ValueError(f"{op}: kv and gate must be [num_tokens, coff * head_dim] of one shape "
                         f"(coff={coff}), got {tuple(kv.shape)} and {tuple(gate.shape)}")
    if ratio < 1:
        raise ValueError(f"{op}: ratio={ratio} must be >= 1")
    width = kv.shape[1]
    if bias.shape != (ratio, width):
        raise ValueError(f"{op}: bias (the position bias) must be [ratio={ratio}, {width}], got "
                         f"{tuple(bias.shape)}")
    rows = compressor_state_rows(ratio, overlap)
    if state.dim() != 3 or state.shape[1:] != (rows, 2 * width) or state.dtype != torch.float32 \
            and state.dtype != torch.float64:
        raise ValueError(f"{op}: state must be fp32 [num_slots, {rows}, {2 * width}] (the last "
                         f"{rows} tokens' [kv | gate + bias] rows), got {state.dtype} "
                         f"{tuple(state.shape)}")
    b = seq_lens.shape[0]
    if query_start_loc.shape != (b + 1,) or state_indices.shape != (b,):
        raise ValueError(f"{op}: query_start_loc [B+1], seq_lens [B] and state_indices [B] "
                         f"expected, got {tuple(query_start_loc.shape)}, {tuple(seq_lens.shape)}, "
                         f"{tuple(state_indices.shape)}")


def _impl(kv, gate, bias, state, query_start_loc, seq_lens, state_indices, ratio, overlap):
    """The torch body (the reference and CPU path), one request at a time."""
    check_compressor(kv, gate, bias, state, query_start_loc, seq_lens, state_indices, ratio,
                     overlap)
    compute = torch.float64 if kv.dtype == torch.float64 else torch.float32
    t, width = kv.shape
    d = width // (2 if overlap else 1)
    rows_kept = compressor_state_rows(ratio, overlap)
    out = torch.zeros(t, d, dtype=compute, device=kv.device)
    from attn_ops.backends.deepseek_v4.reference import check_values

    check_values("dsv4_compressor", t, query_start_loc, seq_lens)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    slots = state_indices.tolist()
    for r, total in enumerate(lens):
        s0, s1 = starts[r], starts[r + 1]
        n = s1 - s0
        if n <= 0:
            continue
        ctx = total - n
        slot = slots[r]
        present = 0 <= slot < state.shape[0]
        pos_new = torch.arange(ctx, total, device=kv.device)
        new = torch.cat([kv[s0:s1].to(compute),
                         gate[s0:s1].to(compute) + bias.to(compute)[pos_new % ratio]], -1)
        # rows by position: the state's for [ctx - rows_kept, ctx), then the step's
        first = max(0, ctx - rows_kept)
        known = torch.full((total - first, 2 * width), float("nan"), dtype=compute,
                           device=kv.device)
        if present and ctx > first:
            hist = torch.arange(first, ctx, device=kv.device)
            known[:ctx - first] = state[slot][hist % rows_kept].to(compute)
        known[ctx - first:] = new

        def rows(p0, p1):  # [kv | gate] rows of positions [p0, p1): absent ones weigh 0
            block = torch.zeros(p1 - p0, 2 * width, dtype=compute, device=kv.device)
            block[:, width:] = float("-inf")
            lo = max(p0, first)
            if p1 > lo:
                got = known[lo - first:p1 - first]
                ok = ~got.isnan().any(-1)  # (a slot read as absent: no row)
                block[lo - p0:][ok] = got[ok]
            return block

        for i in range(n):
            p = ctx + i
            if (p + 1) % ratio:
                continue
            w = p // ratio
            cur = rows(w * ratio, w * ratio + ratio)
            if overlap:  # (group w - 1's A halves, none for w = 0, then group w's B halves)
                prev = rows(w * ratio - ratio, w * ratio) if w else cur[:0]
                c = torch.cat([prev[:, :d], cur[:, d:width]])
                z = torch.cat([prev[:, width:width + d], cur[:, width + d:]])
            else:
                c, z = cur[:, :width], cur[:, width:]
            out[s0 + i] = (torch.softmax(z, 0) * c).sum(0)
        if present:
            keep = pos_new[-rows_kept:]
            state[slot][keep % rows_kept] = new[-rows_kept:].to(state.dtype)
    return out


def _fake(kv, gate, bias, state, query_start_loc, seq_lens, state_indices, ratio, overlap):
    check_compressor(kv, gate, bias, state, query_start_loc, seq_lens, state_indices, ratio,
                     overlap)
    d = kv.shape[1] // (2 if overlap else 1)
    dtype = torch.float64 if kv.dtype == torch.float64 else torch.float32
    return kv.new_empty(kv.shape[0], d, dtype=dtype)


compressor_entries = define_op(
    "dsv4_compressor",
    "(Tensor kv, Tensor gate, Tensor bias, Tensor(a!) state, Tensor query_start_loc, "
    "Tensor seq_lens, Tensor state_indices, int ratio, bool overlap) -> Tensor",
    _impl, _fake)
compressor_entries.__doc__ = """``[T, D]`` fp32: row ``t`` the (pre-norm) entry token ``t``
emits -- where ``(p + 1) % ratio == 0`` for its position ``p`` -- else 0; the requests' state
slots updated with the step's rows (module docstring)."""


def _request_of_token(qsl: torch.Tensor, t: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """Each token's request (int64 ``query_start_loc`` ``qsl``; tokens past the step's go to
    the last), searched over the whole ``qsl``: Inductor cannot lower ``searchsorted`` over a
    slice of it on CUDA (``NotImplementedError: SliceView``)."""
    return (torch.searchsorted(qsl, t, right=True) - 1).clamp(0, num_reqs - 1)


def _slot_mapping_impl(query_start_loc, seq_lens, block_table, ratio, block_size, num_tokens):
    """Device ops only (no host read): capturable in CUDA graphs."""
    dev = seq_lens.device
    t = torch.arange(num_tokens, device=dev)
    qsl = query_start_loc.long()
    r = _request_of_token(qsl, t, seq_lens.shape[0])
    inside = t < qsl[-1]
    new = qsl[r + 1] - qsl[r]
    pos = seq_lens.long()[r] - new + (t - qsl[r])
    emits = inside & ((pos + 1) % ratio == 0) & (pos >= 0)
    idx = torch.where(emits, pos // ratio, 0)
    col = (idx // block_size).clamp(max=block_table.shape[1] - 1)
    block = block_table.long()[r, col]
    # (a negative block id is no page: vLLM clamps it to block 0, which would write another
    # request's page)
    emits = emits & (idx // block_size < block_table.shape[1]) & (block >= 0)
    return torch.where(emits, block * block_size + idx % block_size, -1)


def _slot_mapping_fake(query_start_loc, seq_lens, block_table, ratio, block_size, num_tokens):
    return seq_lens.new_empty(num_tokens, dtype=torch.int64)


compressed_slot_mapping = define_op(
    "dsv4_compressed_slot_mapping",
    "(Tensor query_start_loc, Tensor seq_lens, Tensor block_table, int ratio, int block_size, "
    "int num_tokens) -> Tensor", _slot_mapping_impl, _slot_mapping_fake)
compressed_slot_mapping.__doc__ = """``[num_tokens]`` int64: the compressed-cache slot each token
writes its entry to -- token at position ``p`` of request ``r`` emits entry ``p // ratio`` when
``(p + 1) % ratio == 0``, at ``block_table[r, idx // block_size] * block_size + idx %
block_size`` (``block_size`` entries a page); -1 for the others, padding rows and entries past
the block-table row and negative block ids (vLLM's ``get_compressed_slot_mapping`` clamps those
to block 0: a write into another request's page)."""


def interleaved_rope(x: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False
                     ) -> torch.Tensor:
    """DeepSeek-V4's RoPE: the trailing ``R`` dims of ``x [T, ..., D]`` rotated in consecutive
    pairs (GPT-J style: ``(x[2i], x[2i+1])``), by each token's angles in ``cos_sin [T, R]``
    (the ``R / 2`` pairs' cosines, then their sines), in fp32; ``inverse``: by the opposite
    angles (the output's un-rotation). Returns ``x``'s dtype."""
    r = cos_sin.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = cos_sin[:, :r // 2].reshape(shape).float(), cos_sin[:, r // 2:].reshape(shape)
    sin = -sin.float() if inverse else sin.float()
    pairs = x[..., -r:].float().unflatten(-1, (r // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    return torch.cat([x[..., :-r].float(), rotated], -1).to(x.dtype)


def finish_entries(raw: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   cos_sin: torch.Tensor) -> torch.Tensor:
    """Emitted entries ``raw [N, D]`` (fp32) as they are cached: the weighted RMSNorm in fp32,
    then :func:`interleaved_rope` at each entry's window start ``w * ratio`` (``cos_sin [N,
    R]``)."""
    x = raw.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return interleaved_rope(x, cos_sin)


def compress_into_cache(kv, gate, bias, state, query_start_loc, seq_lens, state_indices,
                        block_table, ratio: int, overlap: bool, norm_weight, eps: float,
                        rope_table: torch.Tensor, cache: torch.Tensor, block_size: int,
                        index: bool = False) -> torch.Tensor:
    """One step of a compressor, to its cache: :data:`compressor_entries`, the entries its
    tokens complete normed and rotated (:func:`finish_entries`, ``rope_table [positions, R]``
    indexed at ``w * ratio``) and written at their compressed slots
    (:data:`compressed_slot_mapping`; a uint8 cache takes the 584-byte entries of
    :func:`~attn_ops.backends.deepseek_v4.cache.entry_write` -- with ``index``, the indexer's
    keys of :func:`~attn_ops.backends.deepseek_v4.cache.index_write` -- another the rows in its
    dtype). Returns the slots (-1: no entry)."""
    from attn_ops.backends.deepseek_v4.cache import entry_write, index_write

    raw = compressor_entries(kv, gate, bias, state, query_start_loc, seq_lens, state_indices,
                             ratio, overlap)
    slots = compressed_slot_mapping(query_start_loc, seq_lens, block_table, ratio, block_size,
                                    kv.shape[0])
    t = torch.arange(kv.shape[0], device=kv.device)
    qsl = query_start_loc.long()
    r = _request_of_token(qsl, t, seq_lens.shape[0])
    pos = seq_lens.long()[r] - (qsl[r + 1] - qsl[r]) + (t - qsl[r])
    start = (pos.clamp(min=0) // ratio * ratio).clamp(max=rope_table.shape[0] - 1)
    entries = finish_entries(raw, norm_weight, eps, rope_table[start])
    if index:
        index_write(entries, cache, slots)
    else:
        entry_write(entries, cache, slots, block_size)
    return slots
