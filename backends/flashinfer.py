"""FLASHINFER: FlashInfer's paged decode and prefill kernels as one traceable custom op.

FlashInfer registers no torch ops of its own, and ``torch.compile(fullgraph=True)`` breaks
inside its JIT loader. Here planning happens in the metadata builder, on the host, once per
step: the batch (decodes first) is split into a decode part, served by FlashInfer's CUDA-core
decode kernel, and a prefill part, served by its FA3 (sm90) or FA2 prefill kernel; each part
gets its page table in CSR form (``indptr`` / ``indices`` / ``last_page_len``) and a plan.
``torch.ops.attn.flashinfer_attention`` then only *runs*: every argument is a tensor or a
scalar (the plan vector travels as a small CPU int64 tensor whose first entry names the prefill
kernel), so the op can sit inside compiled graphs and CUDA graphs.

Semantics are REFERENCE's: ``sliding_window=W`` is FlashInfer's ``window_left=W-1``; the
kernels' base-2 LSE is converted to natural log; attention sinks (which FlashInfer's sm90
paths ignore) are applied exactly from the LSE, ``out *= sigmoid(lse - sink)``; an fp8 cache's
``k_scale`` multiplies the query and ``v_scale`` the output on the device, so no scale is ever
read back to the host.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from attn_ops.backend import AttentionBackend
from attn_ops.capabilities import (BackendCapabilities, CUDAGraphSupport, MultipleOf,
                                   PackageRequirement, Reason)
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.ops import apply_sinks, check_nhd_attention_inputs, define_op
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.spec import AttentionSpec, AttentionType, Feature, KVCacheDType

# FlashInfer's CUDA-core decode kernel is compiled for these query/KV head ratios only; other
# ratios run their decodes through the prefill kernel (query length 1).
DECODE_KERNEL_GROUPS = frozenset({1, 2, 3, 4, 6, 8, 16})

__all__ = ["FlashInferBackend", "FlashInferMetadata", "paged_kv_csr", "warmup"]

LN2 = math.log(2.0)
PREFILL_KERNELS = ("fa2", "fa3")
FLOAT_WORKSPACE_BYTES = 128 << 20
INT_WORKSPACE_BYTES = 8 << 20


# ---------------------------------------------------------------------------------------------
# Page-table conversion (host, pure torch: testable without FlashInfer or a GPU)


def paged_kv_csr(seq_lens: torch.Tensor, block_table: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table from per-request lengths and a dense block table.

    ``seq_lens [B]`` and ``block_table [B, max_blocks]`` on the host -> ``indptr [B+1]``,
    ``indices [indptr[-1]]`` (each request's used blocks, in order) and ``last_page_len [B]``
    (tokens in each request's last page, 1..block_size; 0 for an empty request), all int32.
    Runs in numpy (10x faster than torch's boolean indexing at 256 x 256 pages); when every
    request uses the whole table width, ``indices`` is a view of it.
    """
    seq = seq_lens.numpy().astype(np.int64)
    table = block_table.numpy()
    pages = (seq + block_size - 1) // block_size
    indptr = np.zeros(seq.shape[0] + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    if pages.size and (pages == table.shape[1]).all():
        indices = table.reshape(-1)
    else:
        indices = table[np.arange(table.shape[1]) < pages[:, None]]  # row-major: request order
    last = np.where(pages > 0, seq - (pages - 1) * block_size, 0).astype(np.int32)
    return (torch.from_numpy(indptr), torch.from_numpy(indices.astype(np.int32, copy=False)),
            torch.from_numpy(last))


# ---------------------------------------------------------------------------------------------
# Metadata (host planning)


@dataclass(frozen=True, eq=False)
class FlashInferMetadata:
    """One step's plans. Device tensors are int32; ``*_plan`` are CPU int64 vectors
    (``prefill_plan[0]`` is the prefill kernel's index in :data:`PREFILL_KERNELS`,
    ``prefill_plan[1]`` the number of prefill tokens, the rest FlashInfer's plan).
    ``slot_mapping`` is the common metadata's, for the KV-cache write."""

    slot_mapping: torch.Tensor
    float_workspace: torch.Tensor
    decode_workspace: torch.Tensor
    decode_plan: torch.Tensor
    decode_indptr: torch.Tensor
    decode_indices: torch.Tensor
    decode_last_page_len: torch.Tensor
    prefill_workspace: torch.Tensor
    prefill_plan: torch.Tensor
    prefill_qo_indptr: torch.Tensor
    prefill_indptr: torch.Tensor
    prefill_indices: torch.Tensor
    prefill_last_page_len: torch.Tensor
    causal: bool = True


@functools.cache
def _float_workspace(device: torch.device) -> torch.Tensor:
    """Scratch for split-KV partial results; layers run one after another, so all share it."""
    return torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


class _IntWorkspace:
    """A plan's int workspace on the device and the pinned host buffer FlashInfer's ``plan``
    fills and copies from (asynchronously). Every planning key gets its own: a step plans all
    its keys before its layers run, so a shared one would hold only the last plan. The event
    keeps ``plan`` from refilling the host buffer before the previous copy out of it ran."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.host = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True)
        self._copied: torch.cuda.Event | None = None

    def plan(self, mod, *args):
        if self._copied is not None:
            self._copied.synchronize()
        plan = mod.plan(_float_workspace(self.device.device), self.device, self.host, *args)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return list(plan)


def _decode_module(q_dtype, kv_dtype, head_dim, windowed, capped):
    from flashinfer.decode import get_batch_decode_module

    return get_batch_decode_module(q_dtype, kv_dtype, q_dtype, torch.int32, head_dim,
                                   head_dim, 0, windowed, capped)


def _prefill_module(kernel, q_dtype, kv_dtype, head_dim, head_dim_v, windowed, capped):
    from flashinfer.prefill import get_batch_prefill_module

    return get_batch_prefill_module(kernel, q_dtype, kv_dtype, q_dtype, torch.int32,
                                    head_dim, head_dim_v, 0, windowed, capped, False)


def _prefill_kernel(spec: AttentionSpec, platform_major: int) -> str:
    # FA3 (sm90) needs equal head dims and, for an fp8 cache, an fp8 query; FA2 runs the rest.
    if platform_major == 9 and spec.v_head_dim == spec.head_dim and not spec.kv_cache_dtype.is_fp8 \
            and spec.head_dim in (64, 128, 256):
        return "fa3"
    return "fa2"


def warmup(spec: AttentionSpec, platform_major: int = 9) -> None:
    """Build (JIT-compile with nvcc, minutes the first time) the decode and prefill kernels
    ``spec`` needs, so that no compilation happens inside a step, a compile or a capture."""
    window, cap = spec.sliding_window is not None, spec.logits_soft_cap is not None
    if spec.num_heads // spec.kv_heads in DECODE_KERNEL_GROUPS:
        _decode_module(spec.dtype, spec.cache_dtype, spec.head_dim, window, cap)
    _prefill_module(_prefill_kernel(spec, platform_major), spec.dtype, spec.cache_dtype,
                    spec.head_dim, spec.v_head_dim, window, cap)


class _Uploader:
    """Host-to-device copies of page tables through a ring of pinned staging buffers:
    asynchronous (a pageable copy cost 1.4 ms per step on the H200 host), and an event per
    buffer makes sure a buffer is not refilled before its previous copy has run."""

    RING = 4

    def __init__(self) -> None:
        self.next = 0
        self.buffers = [torch.empty(0, dtype=torch.int32) for _ in range(self.RING)]
        self.events: list[torch.cuda.Event | None] = [None] * self.RING

    def upload(self, host: list[torch.Tensor], dest: torch.Tensor) -> list[torch.Tensor]:
        """``host`` int32 vectors, concatenated, into the front of the device vector ``dest``;
        returns their views there."""
        sizes = [t.shape[0] for t in host]
        total = sum(sizes)
        i, self.next = self.next, (self.next + 1) % self.RING
        if self.events[i] is not None:
            self.events[i].synchronize()
        if self.buffers[i].shape[0] < total:
            self.buffers[i] = torch.empty(max(total, 2 * self.buffers[i].shape[0]),
                                          dtype=torch.int32, pin_memory=True)
        staged = self.buffers[i][:total]
        torch.cat(host, out=staged)
        on_device = dest[:total]
        on_device.copy_(staged, non_blocking=True)
        self.events[i] = torch.cuda.Event()
        self.events[i].record()
        return list(on_device.split(sizes))


_EMPTY_I32 = torch.zeros(0, dtype=torch.int32)
_EMPTY_PLAN = torch.zeros(0, dtype=torch.int64)
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # step metadata -> plans
_EAGER_PLANNERS: dict = {}  # (planning key, device) -> _Planner


class _Planner:
    """Plans for one planning key (a spec, minus the batch) on one device, each step: its own
    int workspaces (decode and prefill plans must not share one either)."""

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        self.spec, self.device = spec, device
        self.float_workspace = _float_workspace(device)
        self.decode_ws, self.prefill_ws = _IntWorkspace(device), _IntWorkspace(device)
        self.uploader = _Uploader()
        self.window = -1 if spec.sliding_window is None else spec.sliding_window - 1
        self.cap = spec.logits_soft_cap or 0.0
        group = spec.num_heads // spec.kv_heads
        self.decode_kernel = group in DECODE_KERNEL_GROUPS

    def plan_decode(self, indptr: torch.Tensor, batch: int, block_size: int,
                    graph: bool) -> list[int]:
        spec = self.spec
        mod = _decode_module(spec.dtype, spec.cache_dtype, spec.head_dim, self.window != -1,
                             self.cap > 0)
        return self.decode_ws.plan(mod, indptr, batch, spec.num_heads, spec.kv_heads,
                                   block_size, graph, self.window, self.cap, spec.head_dim,
                                   spec.head_dim, torch.empty(0, dtype=spec.dtype),
                                   torch.empty(0, dtype=spec.cache_dtype))

    def __call__(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        spec = self.spec
        if common.block_table_cpu is None:
            raise ValueError("FLASHINFER plans on the host: build the metadata with "
                             "attn_ops.build_common_metadata (it keeps block_table_cpu)")
        seq, table, qsl = common.seq_lens_cpu, common.block_table_cpu, common.query_start_loc_cpu
        block_size = common.block_size
        nd = common.num_decodes if self.decode_kernel else 0
        num_prefills = common.num_reqs - nd
        host: list[torch.Tensor] = []  # int32 page tables, sent to the device in one copy
        decode_plan = prefill_plan = _EMPTY_PLAN
        if nd:
            indptr, indices, last = paged_kv_csr(seq[:nd], table[:nd], block_size)
            plan = self.plan_decode(indptr, nd, block_size, graph=False)
            decode_plan = torch.tensor([0, *plan], dtype=torch.int64)  # 0: no padded requests
            host += [indptr, indices, last]
        else:
            host += [_EMPTY_I32] * 3
        if num_prefills:
            indptr, indices, last = paged_kv_csr(seq[nd:], table[nd:], block_size)
            qo = (qsl[nd:] - qsl[nd]).to(torch.int32)
            rows = int(qo[-1])
            kernel = _prefill_kernel(spec, torch.cuda.get_device_capability(self.device)[0])
            mod = _prefill_module(kernel, spec.dtype, spec.cache_dtype, spec.head_dim,
                                  spec.v_head_dim, self.window >= 0, self.cap > 0)
            args = [qo, indptr, seq[nd:].to(torch.int32), rows, num_prefills, spec.num_heads,
                    spec.kv_heads, block_size, False, spec.head_dim, spec.v_head_dim,
                    spec.causal and common.causal, self.window]
            if kernel == "fa2":
                args += [-1, False, 0, 0]  # fixed_split_size, disable_split_kv, colocated, uniform_q
            prefill_plan = torch.tensor([PREFILL_KERNELS.index(kernel), rows,
                                         *self.prefill_ws.plan(mod, *args)], dtype=torch.int64)
            host += [qo, indptr, indices, last]
        else:
            host += [_EMPTY_I32] * 4
        total = sum(t.shape[0] for t in host)
        tables = self.uploader.upload(
            host, torch.empty(total, dtype=torch.int32, device=self.device))
        return FlashInferMetadata(common.slot_mapping, self.float_workspace,
                                  self.decode_ws.device, decode_plan, *tables[:3],
                                  self.prefill_ws.device, prefill_plan, *tables[3:],
                                  causal=common.causal)


class _GraphPlanner(_Planner):
    """Decode plans for CUDA-graph batches (FlashInfer's CUDA-graph mode): page tables in one
    persistent device buffer sized for the largest capture size, one plan per capture size
    whose host vector must not change between capture and replays (checked: FlashInfer fixes
    the grid per batch size in this mode), and the padded requests' rows zeroed on the device
    (they have no pages: ``last_page_len`` 0)."""

    def __init__(self, spec: AttentionSpec, graphs) -> None:
        super().__init__(spec, graphs.device)
        largest = graphs.capture_sizes[-1]
        self.tables = torch.zeros(2 * largest + 1 + largest * graphs.max_blocks_per_req,
                                  dtype=torch.int32, device=self.device)
        self.plans: dict[int, torch.Tensor] = {}

    def __call__(self, padded: CommonAttentionMetadata) -> FlashInferMetadata:
        size = padded.num_reqs
        if not self.decode_kernel or padded.max_query_len != 1:
            raise ValueError(
                f"FLASHINFER captures single-token decode batches through its decode kernel; "
                f"got query length {padded.max_query_len} with {self.spec.num_heads} query / "
                f"{self.spec.kv_heads} KV heads (decode kernel groups: "
                f"{sorted(DECODE_KERNEL_GROUPS)})")
        indptr, indices, last = paged_kv_csr(padded.seq_lens_cpu, padded.block_table_cpu,
                                             padded.block_size)
        plan = self.plan_decode(indptr, size, padded.block_size, graph=True)
        captured = self.plans.setdefault(size, torch.tensor([1, *plan], dtype=torch.int64))
        if captured[1:].tolist() != plan:
            raise RuntimeError(f"FlashInfer's decode plan for capture size {size} changed "
                               f"({captured[1:].tolist()} -> {plan}); a replay would run the "
                               "captured grid on the wrong schedule")
        d_indptr, d_last, d_indices = self.uploader.upload([indptr, last, indices], self.tables)
        return FlashInferMetadata(padded.slot_mapping, self.float_workspace,
                                  self.decode_ws.device, captured, d_indptr, d_indices, d_last,
                                  self.prefill_ws.device, _EMPTY_PLAN, *[self.tables[:0]] * 4,
                                  causal=padded.causal)


# ---------------------------------------------------------------------------------------------
# torch.ops.attn.flashinfer_attention


def _check(query, kv_cache, out, lse):
    check_nhd_attention_inputs("FLASHINFER", query, kv_cache, out, lse)


def _flashinfer_attention(query, kv_cache, out, lse, float_workspace, decode_workspace,
                          decode_plan, decode_indptr, decode_indices, decode_last_page_len,
                          prefill_workspace, prefill_plan, prefill_qo_indptr, prefill_indptr,
                          prefill_indices, prefill_last_page_len, sinks, k_scale, v_scale,
                          scale, sliding_window, soft_cap, causal) -> None:
    _check(query, kv_cache, out, lse)
    k_cache, v_cache = kv_cache.unbind(1)
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    q = query * k_scale.to(query.dtype) if fp8 else query  # dequantizes K inside q.k
    window = -1 if sliding_window is None else sliding_window - 1
    cap = soft_cap or 0.0
    head_dim, head_dim_v = query.shape[2], out.shape[2]
    need_lse = lse is not None or sinks is not None
    lse_buf = lse if lse is not None else (
        torch.empty(query.shape[:2], dtype=torch.float32, device=query.device) if need_lse
        else None)
    nd = decode_last_page_len.shape[0] if decode_plan.numel() else 0
    padded_requests = False
    if nd:
        padded_requests, *plan = decode_plan.tolist()
        mod = _decode_module(query.dtype, kv_cache.dtype, head_dim, window != -1, cap > 0)
        mod.run(float_workspace, decode_workspace, plan, q[:nd], k_cache, v_cache,
                decode_indptr, decode_indices, decode_last_page_len, out[:nd],
                lse_buf[:nd] if need_lse else None, 0, window, True, None, cap, scale, 1.0, 1e4)
    plan = prefill_plan.tolist()
    real_rows = nd + (plan[1] if plan else 0)
    if real_rows < out.shape[0]:  # padding rows (CUDA-graph batches) are zero, like REFERENCE's
        out[real_rows:].zero_()
        if need_lse:
            lse_buf[real_rows:].zero_()
    if plan:
        mod = _prefill_module(PREFILL_KERNELS[plan[0]], query.dtype, kv_cache.dtype, head_dim,
                              head_dim_v, window >= 0, cap > 0)
        rest = out[nd:]
        mod.paged_run(float_workspace, prefill_workspace, plan[2:], q[nd:], k_cache, v_cache,
                      prefill_qo_indptr, prefill_indptr, prefill_indices, prefill_last_page_len,
                      rest, lse_buf[nd:] if need_lse else None, int(causal), 0, window, True,
                      None, None, None, None, None, None, cap, scale, None, None, None, 1.0, 1e4,
                      0, float_workspace.numel())
    if need_lse:
        lse_buf.mul_(LN2)  # FlashInfer's LSE is base 2
    if sinks is not None:
        apply_sinks(out, lse_buf, sinks)
    if fp8:
        out.mul_(v_scale.to(out.dtype))
    if padded_requests:  # a CUDA-graph batch: requests without pages are padding, zeroed here
        empty = (decode_last_page_len == 0)[:, None]
        out[:nd].masked_fill_(empty[:, :, None], 0.0)
        if lse is not None:
            lse[:nd].masked_fill_(empty, 0.0)


def _fake(query, kv_cache, out, lse, *args) -> None:
    _check(query, kv_cache, out, lse)


flashinfer_attention = define_op(
    "flashinfer_attention",
    "(Tensor query, Tensor kv_cache, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!) float_workspace, "
    "Tensor decode_workspace, Tensor decode_plan, Tensor decode_indptr, Tensor decode_indices, "
    "Tensor decode_last_page_len, Tensor prefill_workspace, Tensor prefill_plan, "
    "Tensor prefill_qo_indptr, Tensor prefill_indptr, Tensor prefill_indices, "
    "Tensor prefill_last_page_len, Tensor? sinks, Tensor? k_scale, Tensor? v_scale, float scale, "
    "int? sliding_window, float? soft_cap, bool causal) -> ()",
    _flashinfer_attention, _fake, dispatch_keys=("CUDA",))


# ---------------------------------------------------------------------------------------------
# Backend


_FLASHINFER = PackageRequirement("flashinfer-python", "flashinfer", "0.7.2", max_version="0.8")


class FlashInferBackend(AttentionBackend):
    """FlashInfer decode (CUDA cores) + prefill (FA3 on sm90, else FA2) over the NHD cache."""

    name = "FLASHINFER"
    capabilities = BackendCapabilities(
        platforms=frozenset({PlatformKind.CUDA}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        head_dims=frozenset({64, 128, 256}),
        kv_cache_dtypes=frozenset(KVCacheDType),
        block_sizes=(MultipleOf(1),),
        preferred_block_size=16,  # FlashInfer is indifferent to the page size (GPU README)
        features=frozenset({Feature.SLIDING_WINDOW, Feature.SOFT_CAP, Feature.SINKS,
                            Feature.NON_CAUSAL, Feature.FP8_KV}),
        attn_types=frozenset({AttentionType.DECODER, AttentionType.ENCODER_ONLY}),
        min_capability=(8, 0),
        cudagraph_support=CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE,  # decode kernel only
        packages=(_FLASHINFER,),
    )
    op = flashinfer_attention

    @classmethod
    def not_supported_reasons(cls, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        reasons = super().not_supported_reasons(spec, platform)
        if spec.sliding_window is not None and not spec.causal:
            reasons.append(Reason(cls.name, "feature:bidirectional_window",
                                  "a sliding window with non-causal attention is not supported "
                                  "(FlashInfer windows only to the left)"))
        return reasons

    def build_metadata(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        """Plan once per step and per distinct planning key; layers sharing one reuse it."""
        if isinstance(common, FlashInferMetadata):
            return common
        key = self.metadata_key()
        per_step = _PLANS.setdefault(common, {})
        if key not in per_step:
            device = common.seq_lens.device
            planner = _EAGER_PLANNERS.get((key, device))
            if planner is None:
                planner = _EAGER_PLANNERS[key, device] = _Planner(self.spec, device)
            per_step[key] = planner(common)
        return per_step[key]

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> FlashInferMetadata:
        """Replan a padded decode batch into ``graphs``' persistent buffers (see
        :class:`_GraphPlanner`); the plan for each capture size is fixed at its first call."""
        super().graph_metadata(padded, graphs)
        key = self.metadata_key()
        per_step = _PLANS.setdefault(padded, {})
        if key not in per_step:
            planner = graphs.backend_state.get(key)
            if planner is None:
                planner = graphs.backend_state[key] = _GraphPlanner(self.spec, graphs)
            per_step[key] = planner(padded)
        return per_step[key]

    def metadata_key(self) -> tuple:
        """Everything a plan depends on besides the batch."""
        spec = self.spec
        return (self.name, spec.num_heads, spec.kv_heads, spec.head_dim, spec.v_head_dim,
                spec.dtype, spec.cache_dtype, spec.sliding_window, spec.logits_soft_cap,
                spec.causal)

    def op_arguments(self, query, kv_cache, metadata, out, *, lse=None, sinks=None,
                     alibi_slopes=None, k_scale=None, v_scale=None) -> tuple:
        m = metadata
        return (query, kv_cache, out, lse, m.float_workspace, m.decode_workspace, m.decode_plan,
                m.decode_indptr, m.decode_indices, m.decode_last_page_len, m.prefill_workspace,
                m.prefill_plan, m.prefill_qo_indptr, m.prefill_indptr, m.prefill_indices,
                m.prefill_last_page_len, sinks, k_scale, v_scale, self.scale,
                self.spec.sliding_window, self.spec.logits_soft_cap,
                self.spec.causal and m.causal)
