"""What every MLA backend shares: the latent cache and its write op, the LSE merge op, the step
plan and the executor that runs a step's two forms.

Latent cache (one per layer): ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``,
row ``[kv_c | k_pe]`` per token (``kv_c`` normalized, ``k_pe`` rotated), in the model dtype or
fp8 e4m3 with one per-tensor scale (stored ``x / scale``, saturated).

A step (decode-first, like every batch here) runs in two forms:

* **absorbed** (MQA over the latent cache): the leading requests with at most
  ``Tuning.mla.absorbed_max_query_len`` new tokens -- decodes, speculative decodes, short
  prefills. ``ql = q_nope @ W_UK`` per head gives a ``kv_lora_rank + rope``-wide query whose
  keys are the latent rows and whose values are their first ``kv_lora_rank`` entries; the
  latent output goes through ``W_UV``. Causal inside a request's new tokens.
* **MHA** (up-projected K/V, QK ``nope + rope`` / V ``v_head_dim``): the other requests. Their
  new tokens attend to each other causally; their cached context is gathered in chunks of at
  most ``Tuning.mla.context_chunk_tokens`` latent rows -- taken across requests in order, so a
  long request beside short ones costs its own chunks only -- up-projected, attended without a
  mask, and merged through the LSE (:data:`merge_attn_states`).

Backends differ in the two kernels :func:`run_mla` calls (``absorbed`` and ``mha``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from attn_ops.backend import AttentionBackend
from attn_ops.backends.mla.ds_cache import ds_row_width, ds_write, is_ds_cache
from attn_ops.capabilities import Reason
from attn_ops.kv_cache import FP8_MAX, write_paged
from attn_ops.metadata import CommonAttentionMetadata, host_slots
from attn_ops.ops import check_query_start_loc, define_op
from attn_ops.plan_codec import PlanCodec
from attn_ops.platforms import Platform
from attn_ops.providers import KernelProviders
from attn_ops.routing import MLADecodeLaunch
from attn_ops.spec import AttentionSpec

__all__ = [
    "AbsorbedLayout", "MLA_SCHEMA", "MLABackend", "MLAMetadata", "MLAPlan", "PLAN", "SEPARATE",
    "allocate_latent_cache", "check_latent_weights", "check_mla_inputs", "chunk_tables",
    "context_chunks", "define_mla_op", "merge_attn_states", "mla_cache_update", "run_mla",
]


def allocate_latent_cache(spec: AttentionSpec, num_blocks: int, block_size: int,
                          device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed latent cache for one MLA layer, in ``spec.cache_dtype``: rows of
    ``spec.latent_row_width`` (FlashMLA's 656-byte rows for ``fp8_ds_mla``)."""
    return torch.zeros(num_blocks, block_size, spec.latent_row_width, dtype=spec.cache_dtype,
                       device=device)


def _check_update(kv_c, k_pe, cache, slot_mapping, scale) -> bool:
    """The latent write's checks; returns whether ``cache`` is FlashMLA's fp8_ds_mla layout."""
    t = kv_c.shape[0]
    if kv_c.dim() != 2 or k_pe.dim() != 2 or k_pe.shape[0] != t:
        raise ValueError(f"kv_c must be [num_tokens, kv_lora_rank] and k_pe [num_tokens, "
                         f"qk_rope_head_dim], got {tuple(kv_c.shape)} and {tuple(k_pe.shape)}")
    ds = is_ds_cache(cache, kv_c.shape[1], k_pe.shape[1])
    if cache.dim() != 3 or (cache.shape[2] != kv_c.shape[1] + k_pe.shape[1] and not ds):
        raise ValueError(f"latent_cache must be [num_blocks, block_size, kv_lora_rank + "
                         f"qk_rope_head_dim = {kv_c.shape[1] + k_pe.shape[1]}] (or FlashMLA's "
                         f"fp8_ds_mla rows of {ds_row_width(kv_c.shape[1], k_pe.shape[1])} bytes), "
                         f"got {tuple(cache.shape)}; allocate it with MLAAttention.allocate_cache")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != t or slot_mapping.is_floating_point():
        raise ValueError(f"slot_mapping must be an integer [num_tokens={t}] tensor, got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if cache.dtype in FP8_MAX and not ds and (scale is None or scale.numel() != 1):
        raise ValueError(f"an fp8 latent cache ({cache.dtype}) needs a one-element float32 "
                         f"scale, got {None if scale is None else tuple(scale.shape)}")
    return ds


def _mla_cache_update(kv_c, k_pe, latent_cache, slot_mapping, scale) -> None:
    rank = kv_c.shape[1]
    if _check_update(kv_c, k_pe, latent_cache, slot_mapping, scale):  # (rows with own scales)
        ds_write(kv_c, k_pe, latent_cache, slot_mapping)
        return
    # the latent row's two column ranges as one-head paged views: the KV write's kernel (and
    # its page-tail rule) writes them
    write_paged(kv_c[:, None], k_pe[:, None], latent_cache[:, :, None, :rank],
                latent_cache[:, :, None, rank:], slot_mapping, scale, scale)


def _mla_cache_update_fake(*args) -> None:
    _check_update(*args)


mla_cache_update = define_op(
    "mla_cache_update",
    "(Tensor kv_c, Tensor k_pe, Tensor(a!) latent_cache, Tensor slot_mapping, Tensor? scale)"
    " -> ()",
    _mla_cache_update, _mla_cache_update_fake)
mla_cache_update.__doc__ = """Write ``[kv_c | k_pe]`` rows ([T, kv_lora_rank], [T, rope]) into the
latent cache at ``slot_mapping`` [T] (-1: padding, skipped); an fp8 cache stores ``x / scale``
saturated. The unused rows of every page the write enters are zeroed."""


def _check_merge(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse) -> None:
    t, h = out.shape[:2]
    for name, x in (("prefix_out", prefix_out), ("suffix_out", suffix_out)):
        if x.shape != out.shape:
            raise ValueError(f"{name} must have out's shape {tuple(out.shape)}, got "
                             f"{tuple(x.shape)}")
    for name, x in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse), ("out_lse", out_lse)):
        if x is not None and (x.shape != (t, h) or x.dtype not in _lse_dtypes(out)):
            raise ValueError(f"{name} must be float32 [num_tokens={t}, num_heads={h}] (or "
                             f"float64 with a float64 out), got {x.dtype} {tuple(x.shape)}")


def _lse_dtypes(out: torch.Tensor) -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.float64) if out.dtype == torch.float64 else (torch.float32,)


def _merge_attn_states(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse) -> None:
    _check_merge(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse)
    if out.is_cuda:  # one pass over both sides (the torch form below is ~10 kernels)
        from attn_ops.glue_kernels import merge_states_triton

        merge_states_triton(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse)
        return
    merge_torch(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse)


def merge_torch(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse) -> None:
    """:data:`merge_attn_states` in torch ops (the CPU path, and the GPU kernel's oracle)."""
    inf = float("inf")
    # +inf marks a row some kernels leave undefined; it is an empty side, like -inf
    p = prefix_lse.masked_fill(prefix_lse == inf, -inf)
    s = suffix_lse.masked_fill(suffix_lse == inf, -inf)
    m = torch.maximum(p, s)
    safe = torch.where(m == -inf, 0.0, m)
    wp, ws = torch.exp(p - safe), torch.exp(s - safe)
    total = wp + ws
    denom = torch.where(total > 0, total, 1.0)
    compute = torch.float64 if out.dtype == torch.float64 else torch.float32
    merged = (prefix_out.to(compute) * (wp / denom)[..., None].to(compute)
              + suffix_out.to(compute) * (ws / denom)[..., None].to(compute))
    out.copy_(merged.to(out.dtype))
    if out_lse is not None:
        out_lse.copy_(torch.where(total > 0, safe + torch.log(denom), -inf))


merge_attn_states = define_op(
    "merge_attn_states",
    "(Tensor(a!) out, Tensor(b!)? out_lse, Tensor prefix_out, Tensor prefix_lse, "
    "Tensor suffix_out, Tensor suffix_lse) -> ()",
    _merge_attn_states, lambda *args: _check_merge(*args))
merge_attn_states.__doc__ = """Combine two attention results over disjoint key sets:
``out = (e^p * prefix_out + e^s * suffix_out) / (e^p + e^s)`` per token and head, with the
natural-log LSEs ``p``, ``s`` [T, H] float32 (float64 for float64 outputs; +inf counts as
empty, like -inf); rows empty on both sides get ``out = 0`` and ``out_lse = -inf``. Outputs
[T, H, D]; out may alias neither input."""


@dataclass(frozen=True)
class MLAPlan:
    """One step's split: the first ``num_absorbed`` requests (``num_absorbed_tokens`` rows) in
    the absorbed form, the rest up to row ``num_tokens`` in the MHA form (later rows are
    padding), its context in chunks of at most ``chunk_tokens`` latent rows; ``decode``: the
    absorbed part's launch where the backend's kernel takes one; ``library``: the handle of a
    library's host-planned state the absorbed kernel runs (FLASHINFER_MLA's wrapper);
    ``absorbed_max_query_len``: the absorbed part's longest query (FLASHMLA's ``[batch,
    queries]`` layout); ``route``: the kernel a composite runs the absorbed part on."""

    num_absorbed: int
    num_absorbed_tokens: int
    num_tokens: int
    chunk_tokens: int
    flashinfer_prefill_max_requests: int = 0
    decode: MLADecodeLaunch | None = None
    library: int | None = None
    absorbed_max_query_len: int = 0
    route: int = 0  # a composite's kernel for the absorbed part (its own numbering)
    graph: bool = False  # a CUDA-graph capture size's plan (padding requests at the end)


PLAN = PlanCodec(MLAPlan)


@dataclass(frozen=True, eq=False)
class MLAMetadata:
    """The common device tensors, ``plan`` (:class:`MLAPlan` encoded),
    ``mha_lens_cpu``: ``[R, 2]`` host int64, each MHA-form request's new tokens and cached
    context (what that part's kernels and context chunks are planned from, without reading
    device tensors), and per context chunk (:func:`chunk_tables`) its latent slots and key
    offsets on the device -- built once a step, shared by every layer."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    plan: torch.Tensor
    mha_lens_cpu: torch.Tensor
    chunk_slots: tuple[torch.Tensor, ...] = ()
    chunk_cu_k: tuple[torch.Tensor, ...] = ()
    block_size: int = 0  # the page size the slots and chunks were computed for (0: unknown)


def absorbed_split(query_lens: np.ndarray, max_query_len: int) -> int:
    """How many leading requests run in the absorbed form: those up to the first with more
    than ``max_query_len`` new tokens (the batch is decode-first; the MHA part follows)."""
    long = np.flatnonzero(query_lens > max_query_len)
    return int(long[0]) if long.size else int(query_lens.shape[0])


def context_chunks(context_lens: np.ndarray, chunk_tokens: int) -> list[np.ndarray]:
    """The context chunks of the MHA-form requests: chunk ``c`` holds the requests' cached
    tokens ``[c * chunk, (c + 1) * chunk)`` of their concatenation, as ``[R, 2]`` ranges
    ``(start, end)`` per request in its own positions (empty where it has none there). A
    negative length counts as none: the concatenation's offsets are running sums, so one
    request's negative length would shift every later request's chunks and drop keys it does
    not own (``build_metadata`` refuses the lengths that give one; ``mha_lens`` handed to the
    op directly are not checked for it)."""
    context_lens = np.maximum(context_lens, 0)
    ends = np.cumsum(context_lens)
    starts = ends - context_lens
    total = int(ends[-1]) if ends.size else 0
    chunks = []
    for lo in range(0, total, chunk_tokens):
        hi = lo + chunk_tokens
        a = np.clip(lo - starts, 0, context_lens)
        b = np.clip(hi - starts, 0, context_lens)
        chunks.append(np.stack([a, np.maximum(a, b)], axis=1))
    return chunks


def chunk_tables(context_lens: np.ndarray, chunk_tokens: int, block_table: torch.Tensor,
                 block_table_cpu: torch.Tensor | None, block_size: int
                 ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Per context chunk of the MHA-form requests (:func:`context_chunks`; ``block_table``:
    their rows): the latent cache slots of its rows ``[n]`` int64 and each request's key
    offsets ``[R + 1]`` int32, on ``block_table``'s device -- from the host table where there
    is one (one copy a chunk), else gathered on the device."""
    device = block_table.device
    slots, offsets = [], []
    for ranges in context_chunks(context_lens, chunk_tokens):
        lens = ranges[:, 1] - ranges[:, 0]
        cu = np.zeros(lens.shape[0] + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        req = np.repeat(np.arange(lens.shape[0]), lens)
        pos = np.arange(int(cu[-1])) - cu[req] + ranges[req, 0]
        if block_table_cpu is not None:
            table = block_table_cpu.numpy()
            rows = host_slots(table, req, pos, block_size)
            slots.append(torch.from_numpy(rows).to(device, non_blocking=True))
        else:
            req_t, pos_t = (torch.from_numpy(x).to(device) for x in (req, pos))
            slots.append(block_table[req_t, pos_t // block_size].long() * block_size
                         + pos_t % block_size)
        offsets.append(torch.from_numpy(cu.astype(np.int32)).to(device, non_blocking=True))
    return tuple(slots), tuple(offsets)


# kernels: absorbed(ql, q_pe, cache, qsl, seq_lens, block_table, out, kv_scale, scale, plan)
# and mha(q, k, v, cu_q, cu_k, cu_q_host, cu_k_host, out, lse, scale, causal)
AbsorbedKernel = Callable[..., None]
MHAKernel = Callable[..., None]


class AbsorbedLayout(NamedTuple):
    """What an absorbed kernel takes and leaves (per plan: a composite's differ by route).
    ``joined_query``: it reads ``[ql | q_pe]`` as one row, so the absorption writes ``ql``
    into the rows' first ``rank`` columns and ``q_pe`` is copied after them (no concatenating
    copy of ``ql``); ``writes_every_row``: it writes every row of its output from host-planned
    shapes, so the output needs no zeroing (graph padding rows are zeroed after it) -- else
    rows it does not write (a request's rows read from device offsets) stay zero."""

    joined_query: bool = False
    writes_every_row: bool = False


SEPARATE = AbsorbedLayout()


def run_mla(q, kv_c, k_pe, latent_cache, w_uk, w_uv, query_start_loc, seq_lens, block_table,
            plan, mha_lens, chunk_slots, chunk_cu_k, out, kv_scale, scale, *,
            absorbed: AbsorbedKernel, mha: MHAKernel | None = None,
            layout: Callable[[MLAPlan], AbsorbedLayout] = lambda plan: SEPARATE) -> None:
    """One step of an MLA layer (schema: :data:`MLA_SCHEMA`) with a backend's two kernels;
    ``mha`` None: the MHA-form kernel routing picks for the device and head dims
    (:func:`~attn_ops.backends.mla.prefill.mha_kernel`); ``layout``: the absorbed kernel's
    :class:`AbsorbedLayout` for a plan."""
    p = PLAN.decode(plan)
    heads, nope, rank = w_uk.shape
    na, nat, nt = p.num_absorbed, p.num_absorbed_tokens, p.num_tokens
    if query_start_loc.device.type == "cpu":  # (host values: checking them costs nothing)
        check_query_start_loc(query_start_loc.tolist(), q.shape[0])
    lens = mha_lens.numpy()
    _check_mha_lens(lens, nat, nt, q.shape[0])
    out[nt:].zero_()
    if nat:
        kind = layout(p)
        q_pe = q[:nat, :, nope:]
        # the absorption as per-head GEMMs over strided [t, h, .] views (no permuting copies)
        if kind.joined_query:
            joined = q.new_empty(nat, heads, rank + q_pe.shape[2])
            ql, joined[:, :, rank:] = joined[:, :, :rank], q_pe
            q_pe = joined[:, :, rank:]
        else:
            ql = q.new_empty(nat, heads, rank)
        torch.bmm(q[:nat, :, :nope].transpose(0, 1), w_uk, out=ql.transpose(0, 1))
        latent_out = (ql.new_empty if kind.writes_every_row else ql.new_zeros)(nat, heads, rank)
        absorbed(ql, q_pe, latent_cache, query_start_loc[:na + 1], seq_lens[:na],
                 block_table[:na], latent_out, kv_scale, scale, p)
        if out.dtype == latent_out.dtype:
            torch.bmm(latent_out.transpose(0, 1), w_uv, out=out[:nat].transpose(0, 1))
        else:
            out[:nat] = torch.bmm(latent_out.transpose(0, 1), w_uv).transpose(0, 1)
        if kind.writes_every_row and p.graph:  # (the padding requests' rows: anything)
            padding = torch.arange(nat, device=out.device) >= query_start_loc[na]
            out[:nat].masked_fill_(padding[:, None, None], 0.0)
    if nt == nat:
        return
    if mha is None:
        from attn_ops.backends.mla.prefill import mha_kernel

        mha = mha_kernel(q.device, q.shape[2], w_uv.shape[2], lens.shape[0],
                         p.flashinfer_prefill_max_requests)
    qsl_host = [0, *np.cumsum(lens[:, 0]).tolist()]
    # The MHA kernels' query offsets come from the host copy (checked when the metadata was
    # built, and against the plan above), never from the device query_start_loc: FA4 indexes
    # its rows with them, so a corrupt device value would have it read and write outside q and
    # out. One pinned upload without blocking, no device sync.
    qsl = _upload_offsets(qsl_host, q.device)
    q_mha = q[nat:nt]
    o_new = out.new_empty(nt - nat, heads, w_uv.shape[2])
    lse_new = torch.empty(nt - nat, heads, device=q.device,  # (fp64 steps keep fp64 LSEs)
                          dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    k, v = _up_project(kv_c[nat:nt], k_pe[nat:nt], w_uk, w_uv)
    mha(q_mha, k, v, qsl, qsl, qsl_host, qsl_host, o_new, lse_new, scale, True)
    chunks = context_chunks(lens[:, 1], p.chunk_tokens) if lens.size else []
    if len(chunks) != len(chunk_slots):
        raise ValueError(f"{int(lens[:, 1].sum())} context tokens in chunks of {p.chunk_tokens}"
                         f" need {len(chunks)} chunk tables, got {len(chunk_slots)}; pass "
                         "MLAMetadata.chunk_slots and .chunk_cu_k of the same build_metadata")
    if chunks:
        o_acc, lse_acc = o_new, lse_new
        o_c, lse_c = torch.empty_like(o_new), torch.empty_like(lse_new)
        merged, merged_lse = torch.empty_like(o_new), torch.empty_like(lse_new)
        flat = latent_cache.view(-1, latent_cache.shape[2])
        for ranges, slots, cu_k in zip(chunks, chunk_slots, chunk_cu_k):
            c_rows, c_pe = _gather_chunk(flat, slots, kv_scale, q.dtype, rank)
            cu_k_host = [0, *np.cumsum(ranges[:, 1] - ranges[:, 0]).tolist()]
            k_c, v_c = _up_project(c_rows, c_pe, w_uk, w_uv)
            mha(q_mha, k_c, v_c, qsl, cu_k, qsl_host, cu_k_host, o_c, lse_c, scale, False)
            merge_attn_states(merged, merged_lse, o_acc, lse_acc, o_c, lse_c)
            o_acc, merged = merged, o_acc  # (the old accumulator is free for the next merge)
            lse_acc, merged_lse = merged_lse, lse_acc
        o_new = o_acc
    out[nat:nt] = o_new


def _check_mha_lens(lens: np.ndarray, nat: int, nt: int, rows: int) -> None:
    """The host lengths the MHA part is planned from (``mha_lens``, the plan's token counts):
    non-negative new tokens that fill rows ``[nat, nt)`` of the ``rows`` inputs exactly."""
    new = lens[:, 0]
    if (new < 0).any() or nat + int(new.sum()) != nt or not 0 <= nat <= nt <= rows:
        raise ValueError(f"mha_lens' new tokens {new.tolist()} must be non-negative and fill "
                         f"rows [{nat}, {nt}) of the {rows} query rows (the plan's absorbed and "
                         "total tokens); pass MLAMetadata.mha_lens_cpu and .plan of the same "
                         "build_metadata")


def _upload_offsets(offsets: list[int], device: torch.device) -> torch.Tensor:
    """Host offsets as an int32 tensor on ``device`` (pinned staging, one copy that does not
    block: :func:`attn_ops.metadata.pack_upload`)."""
    from attn_ops.metadata import pack_upload

    buffer, _ = pack_upload((), [np.asarray(offsets, dtype=np.int32)], device)
    return buffer[:len(offsets)]


def _up_project(c: torch.Tensor, k_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor):
    """K ``[n, H, nope + rope]`` (the rope part shared by every head) and V ``[n, H, v]`` of
    latent rows ``c`` [n, rank] and their ``k_pe`` [n, rope]: one GEMM each, into row-major
    results (no permuted copies of the products)."""
    heads, nope, rank = w_uk.shape
    k_nope = torch.mm(c, w_uk.reshape(heads * nope, rank).t()).view(-1, heads, nope)
    v = torch.mm(c, w_uv.transpose(0, 1).reshape(rank, -1)).view(-1, heads, w_uv.shape[2])
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1).to(k_nope.dtype)], dim=-1)
    return k, v


def _gather_chunk(flat, slots, kv_scale, dtype, rank):
    """One context chunk's latent rows at ``slots`` (dequantized to ``dtype``) as ``kv_c``
    [n, rank] and ``k_pe`` [n, rope]. The slots arrive on the device and are never trusted: one
    outside the cache is read as a zero row (nothing outside the cache is read; the MHA
    kernels take no key mask, so its key scores 0 and carries a zero value)."""
    ok = (slots >= 0) & (slots < flat.shape[0])
    rows = flat.index_select(0, torch.where(ok, slots, 0))
    raw = rows.view(torch.uint8) if rows.dtype in FP8_MAX else rows
    raw.masked_fill_(~ok[:, None], 0)
    if flat.dtype in FP8_MAX:
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        rows = rows.to(wide) * kv_scale.to(wide)
    rows = rows.to(dtype)
    return rows[:, :rank], rows[:, rank:]


MLA_SCHEMA = (
    "(Tensor q, Tensor kv_c, Tensor k_pe, Tensor latent_cache, Tensor w_uk, Tensor w_uv, "
    "Tensor query_start_loc, Tensor seq_lens, Tensor block_table, Tensor plan, "
    "Tensor mha_lens, Tensor[] chunk_slots, Tensor[] chunk_cu_k, Tensor(a!) out, "
    "Tensor? kv_scale, float scale) -> ()")
"""One MLA layer's attention for a step. q [T, H, nope + rope] (rope part rotated), kv_c
[T, rank] and k_pe [T, rope] (the new tokens' latents, as written to the cache), latent_cache
[blocks, page, rank + rope], w_uk [H, nope, rank], w_uv [H, rank, v], the common metadata
tensors, plan (:class:`MLAPlan`, CPU int64), mha_lens (CPU int64 [R, 2], the MHA-form
requests' new and cached tokens), chunk_slots / chunk_cu_k (per context chunk: latent slots and
key offsets, :func:`chunk_tables`), out [T, H, v] (padding rows zeroed), kv_scale (fp8 cache),
the softmax scale."""


def check_latent_weights(w_uk: torch.Tensor, w_uv: torch.Tensor) -> tuple[int, int, int]:
    """``(heads, qk_nope_head_dim, kv_lora_rank)`` of the absorption weights, checked."""
    if w_uk.dim() != 3 or w_uv.dim() != 3 or w_uv.shape[:2] != (w_uk.shape[0], w_uk.shape[2]):
        raise ValueError(f"w_uk must be [heads, qk_nope_head_dim, kv_lora_rank] and w_uv "
                         f"[heads, kv_lora_rank, v_head_dim], got {tuple(w_uk.shape)} and "
                         f"{tuple(w_uv.shape)}")
    return tuple(w_uk.shape)


def check_mla_inputs(q, kv_c, k_pe, latent_cache, w_uk, w_uv, query_start_loc, seq_lens,
                     block_table, plan, mha_lens, chunk_slots, chunk_cu_k, out, kv_scale,
                     scale) -> None:
    """Shape checks of the MLA ops (no tensor data read)."""
    heads, nope, rank = check_latent_weights(w_uk, w_uv)
    rope = latent_cache.shape[-1] - rank
    t = q.shape[0]
    want = {"q": (q, (t, heads, nope + rope)), "kv_c": (kv_c, (t, rank)),
            "k_pe": (k_pe, (t, rope)), "out": (out, (t, heads, w_uv.shape[2]))}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} (heads={heads}, nope={nope}, "
                             f"rank={rank}, rope={rope}), got {list(x.shape)}")
    if latent_cache.dim() != 3 or rope <= 0:
        raise ValueError(f"latent_cache must be [num_blocks, block_size, kv_lora_rank={rank} + "
                         f"qk_rope_head_dim], got {tuple(latent_cache.shape)}")
    if plan.device.type != "cpu" or plan.shape != (PLAN.length,):
        raise ValueError(f"plan must be a CPU int64 [{PLAN.length}] tensor (MLAMetadata.plan), "
                         f"got {plan.dtype} {tuple(plan.shape)} on {plan.device}")
    if mha_lens.device.type != "cpu" or mha_lens.dim() != 2 or mha_lens.shape[1] != 2:
        raise ValueError(f"mha_lens must be a CPU [requests, 2] tensor (MLAMetadata."
                         f"mha_lens_cpu), got {tuple(mha_lens.shape)} on {mha_lens.device}")
    if len(chunk_slots) != len(chunk_cu_k):
        raise ValueError(f"chunk_slots and chunk_cu_k need one tensor per context chunk each, "
                         f"got {len(chunk_slots)} and {len(chunk_cu_k)}")


def define_mla_op(name: str, absorbed: AbsorbedKernel, *, mha: MHAKernel | None = None,
                  check: Callable[..., None] = check_mla_inputs, tags=(),
                  layout: Callable[[MLAPlan], AbsorbedLayout] = lambda plan: SEPARATE):
    """A backend's MLA op (:data:`MLA_SCHEMA`): ``check`` its inputs, then :func:`run_mla`
    with its kernels; the fake runs the check alone."""
    def impl(*args) -> None:
        check(*args)
        run_mla(*args, absorbed=absorbed, mha=mha, layout=layout)

    return define_op(name, MLA_SCHEMA, impl, lambda *args: check(*args), tags=tags)


def _check_mha_seq_lens(seq: np.ndarray, new: np.ndarray, na: int, width: int,
                        block_size: int) -> None:
    """The host lengths of the MHA-form requests (from ``na`` on), which plan their cached
    context: at least the new tokens, within the block table. The context chunks run across
    requests, so one request's context of another length moves the chunks of every later
    request (and one past the table has no slots): refused, naming ``seq_lens``. (The absorbed
    form reads lengths on the device only, where its kernels mask what a length gets wrong.)"""
    mha_seq = seq[na:]
    short, long = mha_seq < new, mha_seq > width * block_size
    if short.any():
        i = int(np.argmax(short))
        raise ValueError(f"seq_lens[{na + i}]={int(mha_seq[i])} is shorter than the request's "
                         f"query length {int(new[i])}; seq_lens counts the cached context plus "
                         "the new tokens")
    if long.any():
        i = int(np.argmax(long))
        raise ValueError(f"seq_lens[{na + i}]={int(mha_seq[i])} needs "
                         f"{-(-int(mha_seq[i]) // block_size)} blocks but block_table has "
                         f"{width} columns of {block_size} tokens")


class MLABackend(AttentionBackend):
    """Base of the MLA backends: MLA specs only, the latent cache, the step plan."""

    serves_mla = True
    # A vendor kernel built for one pair of latent widths: (kv_lora_rank, qk_rope_head_dim)
    # and the kernel's name for the reason; None: any widths.
    latent_widths: ClassVar[tuple[int, int] | None] = None
    latent_kernel: ClassVar[str] = ""
    # Where the backend's kernel comes from (attn_ops.providers); None: this package.
    kernel_providers: ClassVar[KernelProviders | None] = None

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        if not spec.use_mla:
            return [Reason(cls.name, "not_mla", f"{cls.name} serves MLA layers only, "
                           f"{spec.describe()} is not one",
                           "describe MLA layers with AttentionSpec.mla(...)")]
        reasons = cls.capabilities.check(cls.name, spec, platform) + cls.latent_reasons(spec)
        missing = cls.kernel_providers and cls.kernel_providers.reason(cls.name, platform)
        return reasons + ([missing] if missing else [])

    @classmethod
    def latent_reasons(cls, spec: AttentionSpec) -> list[Reason]:
        """Reasons about the latent dims (default: those outside :attr:`latent_widths`)."""
        widths = (spec.kv_lora_rank, spec.qk_rope_head_dim)
        if cls.latent_widths is None or widths == cls.latent_widths:
            return []
        return [Reason(cls.name, "head_dim", f"kv_lora_rank={widths[0]}, qk_rope_head_dim="
                       f"{widths[1]}: {cls.latent_kernel} takes latents of "
                       f"{cls.latent_widths[0]} + {cls.latent_widths[1]}",
                       "use TRITON_MLA_SPARSE" if spec.index_topk is not None
                       else "use FLASHINFER_MLA or TRITON_MLA")]

    def metadata_key(self) -> tuple:
        """A step plan holds the decode launch (sized to the heads and latent dims), the
        library's plan (heads, dims, scale, dtypes) and the prefill chunks: layers share one
        only where all of those agree."""
        s = self.spec
        return (self.name, s.num_heads, s.kv_lora_rank, s.qk_rope_head_dim, s.qk_nope_head_dim,
                s.v_head_dim, s.softmax_scale, s.dtype, s.cache_dtype, s.index_topk,
                self.tuning.key)

    def build_metadata(self, common: CommonAttentionMetadata) -> MLAMetadata:
        qsl = common.query_start_loc_cpu.numpy()
        rows = common.slot_mapping.shape[0]
        # The host copy of query_start_loc plans the step (the split, the MHA part's offsets,
        # its context chunks): checked here, where it is read (numpy first; the message only
        # when it fails).
        if qsl[0] != 0 or (qsl[1:] < qsl[:-1]).any() or qsl[-1] > rows:
            check_query_start_loc(qsl.tolist(), rows)
        query_lens = qsl[1:] - qsl[:-1]
        na = absorbed_split(query_lens, self.tuning.mla.absorbed_max_query_len)
        seq = common.seq_lens_cpu.numpy().astype(np.int64)
        new = query_lens[na:].astype(np.int64)
        _check_mha_seq_lens(seq, new, na, common.block_table.shape[1], common.block_size)
        mha_lens = np.stack([new, seq[na:] - new], axis=1)
        max_query = int(query_lens[:na].max()) if na else 0
        chunk = self.tuning.mla.context_chunk_tokens
        plan = PLAN.encode(MLAPlan(num_absorbed=na, num_absorbed_tokens=int(qsl[na]),
                                   num_tokens=int(qsl[-1]), chunk_tokens=chunk,
                                   flashinfer_prefill_max_requests=(
                                       self.tuning.mla.flashinfer_prefill_max_requests),
                                   absorbed_max_query_len=max_query,
                                   **self.plan_absorbed(common, na, max_query,
                                                        int(seq[:na].max()) if na else 0)))
        table_cpu = common.block_table_cpu[na:] if common.block_table_cpu is not None else None
        slots, offsets = chunk_tables(mha_lens[:, 1], chunk, common.block_table[na:], table_cpu,
                                      common.block_size)
        return MLAMetadata(common.slot_mapping, common.query_start_loc, common.seq_lens,
                           common.block_table, plan, torch.from_numpy(mha_lens), slots,
                           offsets, common.block_size)

    def plan_absorbed(self, common: CommonAttentionMetadata, num_absorbed: int,
                      max_query_len: int, max_seq_len: int) -> dict:
        """The absorbed part's :class:`MLAPlan` fields for a step: its launch
        (:meth:`decode_launch`) and any library plan (:meth:`plan_library`)."""
        return {"decode": self.decode_launch(num_absorbed, max_query_len, max_seq_len,
                                             common.seq_lens.device),
                "library": self.plan_library(common, num_absorbed) if num_absorbed else None}

    def decode_launch(self, requests: int, max_query_len: int, max_seq_len: int,
                      device: torch.device) -> MLADecodeLaunch | None:
        """The absorbed part's launch (default: none, the kernel plans nothing)."""
        return None

    def fixed_graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> MLAMetadata:
        """Graph metadata for a kernel that plans nothing on the host per batch: the padded
        common tensors (persistent) and a plan fixed per capture size -- every request a
        decode of ``graphs.query_len`` rows, the launch (:meth:`decode_launch`) from the
        graphs' longest request; the real lengths stay on the device."""
        super().graph_metadata(padded, graphs)
        size = padded.num_reqs
        key = (*self.metadata_key(), "plan", size)
        plan = graphs.backend_state.get(key)
        if plan is None:
            rows = size * graphs.query_len
            plan = graphs.backend_state[key] = PLAN.encode(MLAPlan(
                num_absorbed=size, num_absorbed_tokens=rows, num_tokens=rows,
                chunk_tokens=self.tuning.mla.context_chunk_tokens,
                decode=self.decode_launch(size, graphs.query_len, graphs.max_seq_len,
                                          graphs.device),
                library=self.graph_library(size),
                absorbed_max_query_len=graphs.query_len, graph=True))
        return MLAMetadata(padded.slot_mapping, padded.query_start_loc, padded.seq_lens,
                           padded.block_table, plan, torch.zeros(0, 2, dtype=torch.int64),
                           block_size=padded.block_size)

    def plan_library(self, common: CommonAttentionMetadata, num_absorbed: int) -> int | None:
        """Plan a library kernel for the first ``num_absorbed`` requests on the host; returns
        its handle for :attr:`MLAPlan.library` (default: none)."""
        return None

    def graph_library(self, size: int) -> int | None:
        """The handle of the library state kept for one CUDA-graph capture size, for
        :meth:`fixed_graph_metadata` (default: none)."""
        return None

    def forward(self, q, kv_c, k_pe, latent_cache, metadata, out, *, w_uk, w_uv,
                kv_scale=None) -> None:
        if isinstance(metadata, CommonAttentionMetadata):
            metadata = self.build_metadata(metadata)
        self.op(q, kv_c, k_pe, latent_cache, w_uk, w_uv, metadata.query_start_loc,
                metadata.seq_lens, metadata.block_table, metadata.plan,
                metadata.mha_lens_cpu, list(metadata.chunk_slots), list(metadata.chunk_cu_k),
                out, kv_scale, self.scale)
