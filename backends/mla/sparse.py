"""Sparse MLA (DeepSeek-V3.2's DSA): each query token attends, in the absorbed form, to the
cached tokens its lightning indexer selected (``attn_ops.backends.mla.indexer``) -- at most
``spec.index_topk`` latent rows per token, given as global cache slots -- instead of its whole
context, so a step's attention cost stops growing with the context.

Every token runs the absorbed form, prefills included (the cost is ``top-k`` rows per token
whatever the context): ``ql = q_nope @ W_UK`` per head, then for token ``t`` with selected
slots ``S_t`` (the selection contract below)::

    score[h, j] = scale * (ql[t, h] . c[j] + q_pe[t, h] . k_pe[j]),   j in S_t
    out[t, h]   = (softmax_j(score) @ c) @ W_UV[h]          (no slot selected: 0)

Causality is the selection's: the indexer only selects positions a token sees. Requests that
see at most ``top-k`` tokens get all of them selected, which is dense attention.

The selection contract, the same for every sparse backend: row ``t`` of ``topk_slots`` [T, K]
selects its entries in ``0 <= slot < num_blocks * page`` wherever they sit in the row; every
other entry (-1 padding, a negative or an out-of-range slot) is skipped, never read; a row
that selects nothing gives zeros. Where and in what order the valid entries sit changes the
result by rounding only. With ``attn_ops.set_debug_checks(True)`` an out-of-range entry (other than
-1) raises instead, naming the first one.

Backends: REFERENCE_MLA_SPARSE (torch; the oracle and the CPU path), TRITON_MLA_SPARSE (one
Triton program per token and block of heads, an online softmax over the selected rows) and
FLASHINFER_MLA_SPARSE (``attn_ops.backends.mla.flashinfer_mla_sparse``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch

from attn_ops.backends.mla.common import MLABackend, check_latent_weights
from attn_ops.backends.mla.ds_cache import ds_rows, is_ds_cache
from attn_ops.backends.mla.reference import ReferenceMLABackend
from attn_ops.backends.mla.triton_mla import TritonMLABackend
from attn_ops.backends.reference import UNCAPTURABLE, dequantize
from attn_ops.backends.triton_attn import interpreter_reasons
from attn_ops.capabilities import BackendCapabilities, CUDAGraphSupport, Reason
from attn_ops.kv_cache import FP8_MAX
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.ops import debug_checks_enabled, define_op
from attn_ops.platforms import Platform
from attn_ops.spec import AttentionSpec, Feature, KVCacheDType

__all__ = ["SPARSE_MLA_SCHEMA", "ReferenceSparseMLABackend", "SparseMLABackend",
           "TritonSparseMLABackend", "check_sparse_mla_inputs", "sparse_capabilities",
           "sparse_mla_torch", "sparse_reasons"]

SPARSE_MLA_SCHEMA = (
    "(Tensor q, Tensor latent_cache, Tensor w_uk, Tensor w_uv, Tensor topk_slots, "
    "Tensor(a!) out, Tensor? kv_scale, float scale, int[] launch) -> ()")
"""One sparse MLA layer's attention for a step: q [T, H, nope + rope] (rope part rotated),
latent_cache [blocks, page, rank + rope] (the step's latents already written), w_uk
[H, nope, rank], w_uv [H, rank, v], topk_slots [T, K] int32 (each token's selected global
slots, ``block * page + offset``; -1 entries skipped), out [T, H, v], kv_scale (fp8 cache),
the softmax scale, the kernel's launch (TRITON_MLA_SPARSE: heads a program, slots a step,
warps, stages, splits; FLASHINFER_MLA_SPARSE: its plan's handle; the reference ignores it)."""


def check_sparse_mla_inputs(q, latent_cache, w_uk, w_uv, topk_slots, out, kv_scale, scale,
                            launch) -> None:
    """Shape and dtype checks of the sparse MLA ops (no tensor data read)."""
    heads, nope, rank = check_latent_weights(w_uk, w_uv)
    if latent_cache.dim() != 3 or latent_cache.shape[2] <= rank:
        raise ValueError(f"latent_cache must be [num_blocks, block_size, kv_lora_rank={rank} + "
                         f"qk_rope_head_dim], got {tuple(latent_cache.shape)}")
    # a row of rank + rope values, or FlashMLA's fp8_ds_mla row of q's rope width (the row's
    # width alone does not tell them apart: 576 fp8 values are also a ds row of rope 24)
    rope = latent_cache.shape[2] - rank
    ds = q.shape[-1] > nope and is_ds_cache(latent_cache, rank, q.shape[-1] - nope)
    if ds:
        rope = q.shape[-1] - nope
    t = q.shape[0]
    for name, x, shape in (("q", q, (t, heads, nope + rope)),
                           ("out", out, (t, heads, w_uv.shape[2]))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} (heads={heads}, nope={nope}, "
                             f"rank={rank}, rope={rope}), got {list(x.shape)}")
    if topk_slots.dim() != 2 or topk_slots.shape[0] != t or topk_slots.shape[1] < 1 \
            or topk_slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_slots must be int32 [num_tokens={t}, topk] (each token's "
                         f"selected cache slots, -1 padded: torch.ops.attn.indexer_slots), got "
                         f"{topk_slots.dtype} {tuple(topk_slots.shape)}")
    if latent_cache.dtype in FP8_MAX and not ds and (kv_scale is None or kv_scale.numel() != 1):
        raise ValueError(f"an fp8 latent cache ({latent_cache.dtype}) needs a one-element "
                         f"float32 kv_scale, got "
                         f"{None if kv_scale is None else tuple(kv_scale.shape)}")


# kernel(ql [T, H, rank], q_pe [T, H, rope], latent_cache, topk_slots, latent_out [T, H, rank],
#        kv_scale, scale, launch): every row of latent_out written (zeros where nothing is
#        selected)
SparseKernel = Callable[..., None]


def run_sparse_mla(q, latent_cache, w_uk, w_uv, topk_slots, out, kv_scale, scale, launch, *,
                   kernel: SparseKernel) -> None:
    """The absorption, ``kernel`` over the selected latent rows, the value up-projection."""
    heads, nope, rank = w_uk.shape
    t = q.shape[0]
    if t == 0:
        return
    ql = q.new_empty(t, heads, rank)  # per-head GEMMs over strided [t, h, .] views
    torch.bmm(q[:, :, :nope].transpose(0, 1), w_uk, out=ql.transpose(0, 1))
    latent_out = ql.new_empty(t, heads, rank)
    kernel(ql, q[:, :, nope:], latent_cache, topk_slots, latent_out, kv_scale, scale, launch)
    if out.dtype == latent_out.dtype:
        torch.bmm(latent_out.transpose(0, 1), w_uv, out=out.transpose(0, 1))
    else:
        out.copy_(torch.bmm(latent_out.transpose(0, 1), w_uv).transpose(0, 1))


def check_selection_values(topk_slots: torch.Tensor, capacity: int) -> None:
    """The debug check of a selection: every entry -1 or a slot of the cache (reads the
    tensor: a device sync; only with :func:`attn_ops.set_debug_checks`)."""
    bad = (topk_slots < -1) | (topk_slots >= capacity)
    if bool(bad.any()):
        t, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"topk_slots[{t}, {k}]={int(topk_slots[t, k])} is outside the latent "
                         f"cache's slots 0..{capacity - 1} (and not -1, the padding); a "
                         "selection holds global slots block * page + offset "
                         "(torch.ops.attn.indexer_slots)")


def define_sparse_mla_op(name: str, kernel: SparseKernel, *,
                         check: Callable[..., None] = check_sparse_mla_inputs, tags=()):
    """A backend's sparse MLA op (:data:`SPARSE_MLA_SCHEMA`): ``check``, then
    :func:`run_sparse_mla` with its kernel; the fake runs the check alone."""
    def impl(*args) -> None:
        check(*args)
        if debug_checks_enabled():
            check_selection_values(args[4], args[1].shape[0] * args[1].shape[1])
        run_sparse_mla(*args, kernel=kernel)

    return define_op(name, SPARSE_MLA_SCHEMA, impl, lambda *args: check(*args), tags=tags)


_TOKENS_A_PASS = 64  # the reference gathers [tokens, K, rank + rope] rows this many tokens a pass


def sparse_mla_torch(ql, q_pe, latent_cache, topk_slots, out, kv_scale, scale,
                     launch=()) -> None:
    """The selected-row attention in torch, in fp32 (fp64 for fp64 inputs)."""
    compute = torch.float64 if ql.dtype == torch.float64 else torch.float32
    rank = ql.shape[2]
    flat = latent_cache.reshape(-1, latent_cache.shape[2])
    ds = is_ds_cache(latent_cache, rank, q_pe.shape[2])
    for t0 in range(0, ql.shape[0], _TOKENS_A_PASS):
        t1 = min(t0 + _TOKENS_A_PASS, ql.shape[0])
        slots = topk_slots[t0:t1].long()
        valid = (slots >= 0) & (slots < flat.shape[0])
        rows = flat[slots.where(valid, 0)]
        rows = (ds_rows(rows, rank, ql.dtype, compute) if ds  # [n, K, rank + rope]
                else dequantize(rows, kv_scale, compute))
        rows = rows.masked_fill(~valid[..., None], 0.0)  # (skipped entries read slot 0)
        c, k_pe = rows[..., :rank], rows[..., rank:]
        score = (torch.einsum("thl,tkl->thk", ql[t0:t1].to(compute), c)
                 + torch.einsum("thr,tkr->thk", q_pe[t0:t1].to(compute), k_pe)) * scale
        score = score.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(score, dim=-1).nan_to_num(0.0)  # (nothing selected: 0)
        out[t0:t1] = torch.einsum("thk,tkl->thl", probs, c).to(out.dtype)


def sparse_mla_triton(ql, q_pe, latent_cache, topk_slots, out, kv_scale, scale,
                      launch) -> None:
    from attn_ops.backends.mla.sparse_kernels import sparse_mla_triton as run

    run(ql, q_pe, latent_cache, topk_slots, out, kv_scale, scale, launch)


def sparse_reasons(name: str, spec: AttentionSpec) -> list[Reason]:
    """A sparse MLA backend and a dense MLA spec."""
    if spec.use_mla and spec.index_topk is None:
        return [Reason(name, "dense_mla", f"{name} serves sparse MLA layers only (index_topk "
                       f"set), {spec.describe()} is dense",
                       "use a dense MLA backend (FLASHINFER_MLA, TRITON_MLA, REFERENCE_MLA) "
                       "or AttentionSpec.mla(..., index_topk=2048)")]
    return []


class SparseMLABackend(MLABackend):
    """Base of the sparse MLA backends: the common metadata as it is (the indexer and the
    latent write read it; no step plan), the op over each token's selected slots."""

    op: ClassVar[torch._ops.OpOverload]

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        return super().not_supported_reasons(spec, platform) + sparse_reasons(cls.name, spec)

    def build_metadata(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        return common

    def forward(self, q, kv_c, k_pe, latent_cache, metadata, out, *, w_uk, w_uv,
                kv_scale=None, topk_slots=None) -> None:
        if topk_slots is None:
            raise ValueError(f"{self.name} needs each token's selected slots: pass "
                             "topk_slots (MLAIndexer's second output) to MLAAttention")
        if isinstance(metadata, CommonAttentionMetadata):
            metadata = self.build_metadata(metadata)
        self.op(q, latent_cache, w_uk, w_uv, topk_slots, out, kv_scale, self.scale,
                self.launch(metadata))

    def launch(self, metadata) -> list[int]:
        """The op's launch argument (default: :meth:`triton_launch` for the step's rows)."""
        return self.triton_launch(metadata.slot_mapping.shape[0], metadata.slot_mapping.device)

    def triton_launch(self, rows: int, device: torch.device) -> list[int]:
        """TRITON_MLA_SPARSE's launch for ``rows`` query rows on ``device``: its tile from
        the tuning and its split count."""
        from attn_ops.routing import DeviceFacts, sparse_mla_splits

        t = self.tuning.mla
        splits = sparse_mla_splits(rows, self.spec.num_heads, self.spec.index_topk,
                                   DeviceFacts.of(device).num_sms, t)
        return [t.sparse_heads, t.sparse_keys, t.sparse_warps, t.sparse_stages, splits]


def sparse_capabilities(dense: BackendCapabilities, **changes) -> BackendCapabilities:
    """A sparse backend's capabilities: those of the dense MLA backend whose kernels and
    constraints it shares, serving sparse specs too (``changes``: what differs)."""
    return dataclasses.replace(dense, features=dense.features | {Feature.SPARSE_MLA},
                               **changes)


reference_mla_sparse = define_sparse_mla_op("reference_mla_sparse", sparse_mla_torch,
                                            tags=UNCAPTURABLE)


class ReferenceSparseMLABackend(SparseMLABackend):
    """Any latent dims, page size and platform; simple rather than fast."""

    name = "REFERENCE_MLA_SPARSE"
    capabilities = sparse_capabilities(
        ReferenceMLABackend.capabilities, kv_cache_dtypes=(
            ReferenceMLABackend.capabilities.kv_cache_dtypes | {KVCacheDType.FP8_DS_MLA}))
    op = reference_mla_sparse


def _check_triton(*args) -> None:
    check_sparse_mla_inputs(*args)
    q, latent_cache = args[0], args[1]
    if latent_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"TRITON_MLA_SPARSE: latent_cache dtype {latent_cache.dtype} must be "
                         f"the query's ({q.dtype}) or float8_e4m3fn")
    if latent_cache.stride(2) != 1:
        raise ValueError("TRITON_MLA_SPARSE: latent_cache needs a contiguous last dim; pass "
                         "a .contiguous() cache")


triton_mla_sparse = define_sparse_mla_op("triton_mla_sparse", sparse_mla_triton,
                                         check=_check_triton)


class TritonSparseMLABackend(SparseMLABackend):
    """Our Triton kernel on any GPU Triton runs on (and the CPU interpreter for tests); fp8
    e4m3 latents; any latent dims and page size. CUDA graphs: any batch (the op reads no
    host value; its work is each token's ``top-k`` slots)."""

    name = "TRITON_MLA_SPARSE"
    capabilities = sparse_capabilities(TritonMLABackend.capabilities,
                                       cudagraph_support=CUDAGraphSupport.ALWAYS)
    op = triton_mla_sparse

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        if spec.use_mla:
            reasons += interpreter_reasons(cls.name, spec, platform,
                                           "; REFERENCE_MLA_SPARSE is the CPU path")
        return reasons
