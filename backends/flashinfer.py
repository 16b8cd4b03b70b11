"""FLASHINFER: FlashInfer's paged attention kernels as one traceable custom op.

FlashInfer registers no torch ops of its own, and ``torch.compile(fullgraph=True)`` breaks
inside its JIT loader. Here planning happens in the metadata builder, on the host, once per
step: the batch (decodes first) is split into a decode part and a prefill part, each with its
page table in CSR form (``qo_indptr`` / ``kv_indptr`` / ``kv_indices`` / ``last_page_len``) and
a plan. ``torch.ops.attn.flashinfer_attention`` then only *runs*: every argument is a tensor or
a scalar (a plan travels as a small CPU int64 tensor whose first entry names the kernel), so
the op can sit inside compiled graphs and CUDA graphs.

Kernels: decodes run FlashInfer's tensor-core decode -- its FA2 prefill kernel with one query
row per request, the GQA heads of a KV head packed into one tile -- split into KV chunks by
:func:`decode_kernel` (about one CTA per SM; measured up to 17% faster than FlashInfer's own
split rule at small batches), or, where FlashAttention 4 serves the prefills and the batch is
about one wave of (request, KV head) items, by FA4 (fastest there), or -- with
``triton_decode`` (how FLASH_ATTN runs on sm90) -- short decodes whose items fill the SMs about
4 times over by TRITON_ATTN's decode kernel (:func:`decode_kernel`). Measured on the H200 this
beats FlashInfer's CUDA-core decode kernel and FA4 alone at every decode point
(``benchmarks/results``). Prefills run FA3 (sm90) or FA2 -- or FlashAttention 4
(``prefill_kernel="fa4"``, how FLASH_ATTN runs on sm90), the fastest prefill there.

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
from attn_ops.kv_cache import nhd_kv_halves
from attn_ops.metadata import (CommonAttentionMetadata, block_csr, last_page_len,
                               sizes_not_specialized, upload_int32, upload_tables)
from attn_ops.ops import apply_sinks, check_nhd_attention_inputs, define_op
from attn_ops.platforms import Platform, PlatformKind
from attn_ops.spec import AttentionSpec, AttentionType, Feature, KVCacheDType

__all__ = ["FlashInferBackend", "FlashInferMetadata", "paged_kv_csr", "warmup"]

LN2 = math.log(2.0)
KERNELS = ("fa2", "fa3", "fa4", "triton")  # a part's plan vector starts with an index into this
PREFILL_KERNELS = KERNELS[:3]
TABLE_KERNELS = ("fa4", "triton")  # read seq_lens and the block table, not FlashInfer's CSR
HEADER = 11  # a plan vector: [kernel, rows, padded, first, n, num_indices, plan length,
#              qo_at, kv_at, last_at, indices_at, *plan]
PLAN_LEN = 64  # entries of every plan vector (a fixed size: no shape for Dynamo to specialize)
# The TRITON_ATTN route's upper end (decode_kernel): measured faster up to B=128 x 8 KV heads
# on 132 SMs (7.8 per SM), level at B=256 (15.5).
TRITON_DECODE_MAX_ITEMS_PER_SM = 8
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
    (The builder takes the CSR the common metadata already has: :meth:`CommonAttentionMetadata.
    block_csr`.)
    """
    seq = seq_lens.numpy()
    indptr, indices = block_csr(seq, block_table.numpy(), block_size)
    return (torch.from_numpy(indptr), torch.from_numpy(indices),
            torch.from_numpy(last_page_len(seq, block_size)))


def split_budget(num_sms: int, kv_heads: int) -> int:
    """The most requests FlashInfer's split rule may split: two CTAs per SM, one per
    (request, KV head) chunk. Beyond it, the rule cannot split."""
    return 2 * num_sms // kv_heads


# FlashInfer's CUDA-graph rule aims at two CTAs per SM with chunks of at least one page, so a
# small batch is cut into one-page chunks (B=1 ctx 4k: 32 a request), where the eager plans'
# decode_kernel takes one CTA per SM (16 of two pages). With GRAPH_ONE_CTA_PER_SM a capture size
# of fewer (request, KV head) items than SMs gets the same budget: ``size * (SMs // items)``
# CTAs per KV head, the rest of FlashInfer's two per SM declared taken (its
# ``num_colocated_ctas``, meant for POD attention). FlashInfer's rule then picks the chunk under
# that budget every step (the chunk size lives in the device workspace; in this mode it always
# splits), and pads the grid to the budget, which the capture size fixes. (A fixed chunk of
# decode_kernel's rule on FlashInfer's padded grid instead: slower, 9.9 us, the block
# scheduler stacking two working CTAs on some SMs and none on others; and with a sliding
# window FlashInfer may then plan no split at all, a different grid than the one captured.)
# H200, B=1 ctx 4k, the attention kernel: 7.3 us eagerly, 9.2 in FlashInfer's graph rule,
# 7.3 with this budget (benchmarks/exp/exp_graph_decode.py, exp_graph_decode_h200.json).
GRAPH_ONE_CTA_PER_SM = True


def graph_colocated_ctas(size: int, kv_heads: int, num_sms: int) -> int:
    """The CTAs of FlashInfer's two-per-SM split budget to leave unused in the CUDA-graph
    decode plan of a batch of ``size`` requests (padding included)."""
    per_request = num_sms // (size * kv_heads)
    if not GRAPH_ONE_CTA_PER_SM or per_request == 0:
        return 0
    return 2 * num_sms - kv_heads * size * per_request


def decode_kernel(num_decodes: int, kv_heads: int, max_pages: int, block_size: int,
                  num_sms: int, fa4: bool, triton: bool = False,
                  fa4_decode_tile: bool = False) -> tuple[str, int]:
    """The decode part's kernel and FlashInfer split-KV chunk (in pages; -1: FlashInfer's own
    rule; 0: no split), from the number of (request, KV head) work items against the SM count.

    Measured on the H200 (``benchmarks/sweep_kernel_configs.py`` and
    ``bench_gpu_attention.py``, page 128, 132 SMs): with fewer items than SMs, splitting each
    request into chunks so that items x chunks is about one CTA per SM beat FlashInfer's rule
    -- which aims at two -- by up to 17% (B=1 ctx 4k: 1.71 vs 1.46 TB/s; B=2 ctx 2k 1.75 vs
    1.49; B=4 ctx 1k 1.71 vs 1.53; B=8 ctx 1k 2.76 vs 2.58), while for chunks of 4k tokens or
    more FlashInfer's rule was as good or better. Near one full wave without splitting (B=12
    and 16: 96 and 128 items), FlashAttention 4, which cannot split on sm90 but runs one large
    CTA per SM, was fastest up to ctx 4k (B=16 ctx 1k 3.13-3.15 vs FlashInfer's best 3.03;
    B=12 ctx 4k 3.75 vs 3.57) and unsteady beyond (B=16 ctx 32k 4.06-4.54 over three runs;
    B=12 ctx 8k 3.42 vs 3.96), where FlashInfer without splits is used. From a full wave on,
    FlashInfer does not split (B >= 32: its rule equals no split, and beat FA4). Once the
    requests outnumber its split budget (:func:`split_budget`) its rule cannot split at all,
    and saying "no split" outright makes a plan that does not depend on the lengths: it is
    kept from step to step (see ``_Planner.plan_part``).

    With ``triton``, decodes of at most ``triton_attn.SHORT_DECODE_KEYS`` keys with 3.5
    (``triton_attn.MANY_ITEMS_PER_SM``) to ``TRITON_DECODE_MAX_ITEMS_PER_SM`` items per SM run
    TRITON_ATTN's decode kernel, unsplit, in its ``MANY_ITEMS_TILE`` (4 programs per SM): H200
    (``benchmarks/exp/exp_decode_ceiling.py`` runs 2-3, page 128, TB/s against FlashInfer's
    tensor-core decode in the same run) B=64 ctx 1k 3.88 vs 3.74, B=128 ctx 1k 4.03 vs 3.92
    and 4.12 vs 4.01; level at B=256 ctx 1k (4.19 vs 4.20). At longer contexts the tile lost
    where measured (B=64 ctx 4k-32k split in two: 4.07-4.13 vs 4.40-4.55; unsplit there: not
    measured).

    With ``fa4_decode_tile`` (FA4 runs decodes in ``flash_attn.SM90_DECODE_TILE``, 64 rows),
    FA4 takes the decodes wherever :func:`~attn_ops.backends.flash_attn.fa4_decode_wins` says
    it was fastest -- from 0.4 of a wave, and from two waves at long contexts -- in place of
    the band above (FA4's own 128-row tile)."""
    items, keys = num_decodes * kv_heads, max_pages * block_size
    if triton:
        from attn_ops.backends import triton_attn

        if triton_attn.short_and_many(items, keys, num_sms) \
                and items <= TRITON_DECODE_MAX_ITEMS_PER_SM * num_sms:
            return "triton", 0
    if fa4 and fa4_decode_tile:
        from attn_ops.backends.flash_attn import fa4_decode_wins

        if fa4_decode_wins(items, keys, num_sms):
            return "fa4", -1
    if items >= num_sms:
        return "fa2", 0 if num_decodes > split_budget(num_sms, kv_heads) else -1
    if fa4 and not fa4_decode_tile and 10 * items > 7 * num_sms and keys <= 4096:
        return "fa4", -1
    chunk = -(-max_pages // (num_sms // items))
    return ("fa2", -1) if chunk * block_size >= 4096 else ("fa2", chunk)


# ---------------------------------------------------------------------------------------------
# Metadata (host planning)


@dataclass(frozen=True, eq=False)
class FlashInferMetadata:
    """One step's plans, in two parts run one after the other: the decode rows (first), then
    the prefill rows. Per part: an int workspace (device) and a plan, a CPU int64 vector of
    ``PLAN_LEN`` entries ``[kernel index in KERNELS, rows, padded, first, n, num_indices, plan
    length, qo_at, kv_at, last_at, indices_at, *the kernel's plan, 0...]`` (kernel -1: the part
    has no rows; ``padded``: a CUDA-graph batch, whose requests without pages are padding;
    ``n`` requests from request ``first``). ``tables`` (int32, device) holds both parts' page
    tables, at those offsets: FlashInfer's ``qo_indptr [n+1]``, ``kv_indptr [n+1]``,
    ``last_page_len [n]`` and ``kv_indices [num_indices]``; for FA4 (kernel plan
    ``[max_seqlen_q, max_seqlen_k]``) only ``cu_seqlens_q [n+1]``, with rows ``first..first+n``
    of ``seq_lens`` and ``block_table`` -- the common metadata's, or empty stand-ins when no
    part runs FA4. Eagerly ``tables`` is the common metadata's :class:`~attn_ops.metadata.
    DeviceTables` buffer (uploaded with the batch: the builder copies nothing); in CUDA graphs
    the graph planner's persistent buffer. One tensor, not a view per table: Dynamo would guard
    on each view's storage offset, and every batch composition would be another graph; plan
    vectors of one size, so that Dynamo has no size to specialize on. ``slot_mapping`` is the
    common metadata's, for the KV-cache write."""

    slot_mapping: torch.Tensor
    float_workspace: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    decode_workspace: torch.Tensor
    decode_plan: torch.Tensor
    prefill_workspace: torch.Tensor
    prefill_plan: torch.Tensor
    causal: bool = True


@functools.cache
def _float_workspace(device: torch.device) -> torch.Tensor:
    """Scratch for split-KV partial results; layers run one after another, so all share it."""
    return torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


class _IntWorkspace:
    """A plan's int workspace on the device and the pinned host buffers FlashInfer's ``plan``
    fills and copies from (asynchronously). Every planning key gets its own: a step plans all
    its keys before its layers run, so a shared one would hold only the last plan. Host
    buffers take turns, each with an event that keeps ``plan`` from refilling it before its
    copy ran: with one buffer, each step's plan waited for the previous step's copy, which the
    stream runs only after the previous step's kernels -- the host lost its run-ahead."""

    RING = 2

    def __init__(self, device: torch.device) -> None:
        self.device = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.hosts = [torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True)
                      for _ in range(self.RING)]
        self.copied = [torch.cuda.Event() for _ in range(self.RING)]  # re-recorded, not remade
        self.next = 0
        self.last: tuple | None = None  # (inputs, kernel plan) of the plan now in the workspace

    def plan(self, mod, *args) -> list[int]:
        i, self.next = self.next, (self.next + 1) % self.RING
        self.copied[i].synchronize()  # (an event never recorded counts as done)
        plan = mod.plan(_float_workspace(self.device.device), self.device, self.hosts[i], *args)
        self.copied[i].record()
        return plan[:]  # (a tvm-ffi Array: a slice reads it in one pass; list() took 25 us)


_MODULES: dict = {}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _module(kernel, q_dtype, kv_dtype, head_dim, head_dim_v, windowed, capped):
    key = (kernel, q_dtype, kv_dtype, head_dim, head_dim_v, windowed, capped)
    mod = _MODULES.get(key)  # (FlashInfer's own lookup hashes 11 arguments: ~2 us a call)
    if mod is None:
        from flashinfer.prefill import get_batch_prefill_module

        mod = _MODULES[key] = get_batch_prefill_module(kernel, q_dtype, kv_dtype, q_dtype,
                                                       torch.int32, head_dim, head_dim_v, 0,
                                                       windowed, capped, False)
    return mod


def _prefill_kernel(spec: AttentionSpec, platform_major: int) -> str:
    # FA3 (sm90) needs equal head dims and, for an fp8 cache, an fp8 query; FA2 runs the rest.
    if platform_major == 9 and spec.v_head_dim == spec.head_dim and not spec.kv_cache_dtype.is_fp8 \
            and spec.head_dim in (64, 128, 256):
        return "fa3"
    return "fa2"


def warmup(spec: AttentionSpec, platform_major: int = 9) -> None:
    """Build (JIT-compile with nvcc, minutes the first time) the kernels ``spec`` needs -- FA2
    for decodes, FA3 or FA2 for prefills -- so no compilation happens inside a step, a compile
    or a capture."""
    window, cap = spec.sliding_window is not None, spec.logits_soft_cap is not None
    for kernel in sorted({"fa2", _prefill_kernel(spec, platform_major)}):
        _module(kernel, spec.dtype, spec.cache_dtype, spec.head_dim, spec.v_head_dim, window, cap)


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # step metadata -> plans
_EAGER_PLANNERS: dict = {}  # (planning key, device) -> _Planner


def _plan_vector(kernel: int, rows: int, padded: int, first: int, n: int, num_indices: int,
                 plan: list[int], at: tuple[int, int, int, int] = (0, 0, 0, 0)) -> torch.Tensor:
    """A part's plan vector (see :class:`FlashInferMetadata`); ``at``: the offsets of its
    ``qo_indptr``, ``kv_indptr``, ``last_page_len`` and ``kv_indices`` in ``tables``."""
    if len(plan) > PLAN_LEN - HEADER:
        raise RuntimeError(f"a {KERNELS[kernel]} plan of {len(plan)} entries does not fit the "
                           f"plan vector; raise PLAN_LEN ({PLAN_LEN}) in {__name__}")
    vec = np.zeros(PLAN_LEN, dtype=np.int64)
    vec[:HEADER] = kernel, rows, padded, first, n, num_indices, len(plan), *at
    vec[HEADER:HEADER + len(plan)] = plan
    return torch.from_numpy(vec)


class _Planner:
    """Plans for one planning key (a spec, minus the batch) on one device, step after step,
    with int workspaces of its own (the decode and the prefill part must not share one)."""

    def __init__(self, spec: AttentionSpec, device: torch.device, prefill_kernel: str,
                 triton_decode: bool = False) -> None:
        self.spec, self.device, self.prefill_kernel = spec, device, prefill_kernel
        self.triton_decode = triton_decode and not spec.kv_cache_dtype.is_fp8
        self.float_workspace = _float_workspace(device)
        self.decode_ws, self.prefill_ws = _IntWorkspace(device), _IntWorkspace(device)
        self.window = -1 if spec.sliding_window is None else spec.sliding_window - 1
        self.cap = spec.logits_soft_cap or 0.0
        # The plan of a part without requests, one per part: Dynamo guards on inputs that
        # alias, so one tensor passed twice would make another graph than two tensors.
        self.absent = (_plan_vector(-1, 0, 0, 0, 0, 0, []), _plan_vector(-1, 0, 0, 0, 0, 0, []))
        self._unused: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.split_budget = split_budget(self.num_sms, spec.kv_heads)
        self.fa4_decode_tile = False
        if prefill_kernel == "fa4":
            from attn_ops.backends.flash_attn import fa4_decodes_in_short_tile

            # (the spec first: the device's capability is read only where the tile could be)
            self.fa4_decode_tile = fa4_decodes_in_short_tile(spec) and fa4_decodes_in_short_tile(
                spec, torch.cuda.get_device_capability(device)[0])

    def unused(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stand-ins for ``seq_lens`` and a ``block_table`` of ``width`` columns where no part
        runs FA4 (only FA4 reads them): marked once, where the common metadata's would be
        marked every step. (The width as the real tables': Dynamo would specialize on it.)"""
        pair = self._unused.get(width)
        if pair is None:
            pair = self._unused[width] = (
                torch.zeros(0, dtype=torch.int32, device=self.device),
                torch.zeros(0, width, dtype=torch.int32, device=self.device))
            sizes_not_specialized(*pair)  # (a mark stays on its tensor)
        return pair

    def plan_part(self, ws: _IntWorkspace, kernel: str, qo: np.ndarray, kv_indptr: np.ndarray,
                  seq: np.ndarray, block_size: int, causal: bool, graph: bool,
                  chunk: int = -1, colocated: int = 0) -> list[int]:
        """FlashInfer's plan for the requests of one part (host int32 arrays), as the kernel's
        plan list; ``chunk``: FA2's split-KV chunk in pages (-1: FlashInfer's rule, 0: none);
        ``colocated``: CTAs of FlashInfer's split budget (two per SM) to leave unused.

        FA2's plan reads only the query and page-count offsets (not the token lengths), and
        without a split not even the page counts. When they are those of this workspace's last
        plan -- a decode step in which no request entered a new page, or any decode step of
        the same requests without a split -- its tables are still in the workspace, and
        FlashInfer is not called."""
        spec = self.spec
        key = None
        if kernel == "fa2":
            key = (qo.tobytes(), b"" if chunk == 0 else kv_indptr.tobytes(), chunk, colocated,
                   graph, causal, block_size)
            if ws.last is not None and ws.last[0] == key:
                return ws.last[1]
        mod = _module(kernel, spec.dtype, spec.cache_dtype, spec.head_dim, spec.v_head_dim,
                      self.window >= 0, self.cap > 0)
        args = [torch.from_numpy(qo), torch.from_numpy(kv_indptr), torch.from_numpy(seq),
                int(qo[-1]), qo.shape[0] - 1, spec.num_heads, spec.kv_heads, block_size, graph,
                spec.head_dim, spec.v_head_dim, causal, self.window]
        if kernel == "fa2":  # fixed_split_size, disable_split_kv, colocated CTAs, uniform_q
            args += [chunk if chunk > 0 else -1, chunk == 0, colocated, 0]
        plan = ws.plan(mod, *args)
        ws.last = (key, plan) if key is not None else None
        return plan

    def __call__(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        # (numpy throughout: a small torch op on the host costs 1.5-8 us, numpy's a fraction)
        dev = upload_tables(common)  # (uploaded with the batch: no copy here)
        indptr = common.block_csr()[0]
        seq, qsl = common.seq_lens_cpu.numpy(), common.query_start_loc_cpu.numpy()
        block_size, nd, n = common.block_size, common.num_decodes, common.num_reqs
        causal = self.spec.causal and common.causal
        plans = list(self.absent)
        uses_tables = False
        for part, first, stop in ((0, 0, nd), (1, nd, n)):
            if first == stop:
                continue
            qo = qsl[first:stop + 1] - qsl[first] if first else qsl[:stop + 1]
            if part == 0:
                longest = common.max_seq_len if nd == n else int(seq[:nd].max())
                max_pages = -(-longest // block_size)
                # decodes of several query rows (speculative decoding: ``decode_threshold``)
                # neither take TRITON_ATTN's kernel nor FA4's decode tile (measured: one row)
                decode_rows = 1 if common.num_decode_tokens == nd else int(np.diff(qo).max())
                kernel, chunk = decode_kernel(nd, self.spec.kv_heads, max_pages, block_size,
                                              self.num_sms, self.prefill_kernel == "fa4",
                                              self.triton_decode and decode_rows == 1,
                                              self.fa4_decode_tile and decode_rows == 1)
                at = dev.query_start_loc, dev.block_indptr, dev.last_page_len, dev.block_indices
            else:
                kernel, chunk = self.prefill_kernel, -1
                at = (dev.prefill_query_start_loc, dev.prefill_block_indptr,
                      dev.last_page_len + first, dev.block_indices + int(indptr[first]))
            if kernel in TABLE_KERNELS:  # they read the common metadata's device tables
                uses_tables = True
                num_indices = 0
                plan = [decode_rows if part == 0 else common.max_query_len,
                        longest if kernel == "triton" else common.max_seq_len]
            else:
                pages = indptr[first:stop + 1]
                kv_indptr = pages - pages[0] if first else pages
                num_indices = int(kv_indptr[-1])
                plan = self.plan_part((self.decode_ws, self.prefill_ws)[part], kernel, qo,
                                      kv_indptr, seq[first:stop], block_size, causal,
                                      graph=False, chunk=chunk)
            plans[part] = _plan_vector(KERNELS.index(kernel), qo[-1], 0, first, stop - first,
                                       num_indices, plan, at)
        seq_lens, block_table = self.unused(common.block_table.shape[1])
        if uses_tables:
            seq_lens, block_table = common.seq_lens, common.block_table
            sizes_not_specialized(seq_lens, block_table)
        sizes_not_specialized(dev.buffer)
        return FlashInferMetadata(common.slot_mapping, self.float_workspace, dev.buffer,
                                  seq_lens, block_table, self.decode_ws.device, plans[0],
                                  self.prefill_ws.device, plans[1], causal=common.causal)


class _GraphPlanner(_Planner):
    """Decode plans for CUDA-graph batches (FlashInfer's CUDA-graph mode): page tables in one
    persistent device buffer sized for the largest capture size, one plan per capture size
    whose host vector must not change between capture and replays (checked: in this mode
    FlashInfer fixes the grid per batch size). Padded requests have no pages: FlashInfer
    writes their rows as zero (a row that saw no key is normalized by 0) and their LSE as
    -inf (zeroed by the op). In this mode FlashInfer always splits (and merges) -- with
    :data:`GRAPH_ONE_CTA_PER_SM`, small capture sizes on a grid of one CTA per SM
    (:func:`graph_colocated_ctas`); capture sizes past its split budget, where it could not
    split eagerly either, are planned without a split instead -- the eager kernel, no merge,
    and a plan that stays the same from step to step (FlashInfer is not called again)."""

    def __init__(self, spec: AttentionSpec, graphs) -> None:
        super().__init__(spec, graphs.device, "fa2")
        largest = graphs.capture_sizes[-1]
        self.tables = torch.zeros(3 * largest + 2 + largest * graphs.max_blocks_per_req,
                                  dtype=torch.int32, device=self.device)
        self.plans: dict[int, tuple[list, torch.Tensor]] = {}  # size -> (kernel plan, vector)

    def __call__(self, padded: CommonAttentionMetadata) -> FlashInferMetadata:
        size = padded.num_reqs
        if padded.max_query_len != 1:
            raise ValueError(f"FLASHINFER captures single-token decode batches; got query "
                             f"length {padded.max_query_len}")
        qo = np.arange(size + 1, dtype=np.int32)  # padded requests get a (zeroed) row
        kv_indptr, kv_indices = padded.block_csr()
        seq = padded.seq_lens_cpu.numpy()
        last = last_page_len(seq, padded.block_size)
        chunk, colocated = (0, 0) if size > self.split_budget else (
            -1, graph_colocated_ctas(size, self.spec.kv_heads, self.num_sms))
        kernel_plan = self.plan_part(self.decode_ws, "fa2", qo, kv_indptr, seq,
                                     padded.block_size, self.spec.causal and padded.causal,
                                     graph=True, chunk=chunk, colocated=colocated)
        made, captured = self.plans.get(size, (None, None))
        if kernel_plan is not made:  # (a plan kept in the workspace is the one checked)
            # (num_indices: all the buffer holds past the other tables, the same every replay)
            plan = _plan_vector(KERNELS.index("fa2"), size, 1, 0, size,
                                self.tables.shape[0] - (3 * size + 2), kernel_plan,
                                (0, size + 1, 2 * size + 2, 3 * size + 2))
            if captured is None:
                captured = plan
            elif not torch.equal(captured, plan):
                raise RuntimeError(f"FlashInfer's decode plan for capture size {size} changed "
                                   f"({captured.tolist()} -> {plan.tolist()}); a replay would "
                                   "run the captured grid on the wrong schedule")
            self.plans[size] = (kernel_plan, captured)
        upload_int32([qo, kv_indptr, last, kv_indices], self.tables)
        return FlashInferMetadata(padded.slot_mapping, self.float_workspace, self.tables,
                                  *self.unused(padded.block_table.shape[1]),
                                  self.decode_ws.device, captured,
                                  self.prefill_ws.device, self.absent[1], causal=padded.causal)


# ---------------------------------------------------------------------------------------------
# torch.ops.attn.flashinfer_attention


def _check(query, kv_cache, out, lse):
    check_nhd_attention_inputs("FLASHINFER", query, kv_cache, out, lse)


# id(plan vector) -> (plan vector, its part's tables): the views of a step's tables, made by its
# first layer and used by the others (slicing them in every layer cost ~6 us a call); a few
# steps' worth (an entry holds its plan vector, so no other can take its id meanwhile)
_VIEWS: dict = {}


def _part_tables(tables, seq_lens, block_table, kernel, first, n, num_indices, qo_at, kv_at,
                 last_at, indices_at) -> tuple:
    """``(tables, *a part's tables)``: FA2/FA3's ``qo_indptr``, ``kv_indptr``,
    ``last_page_len`` and ``kv_indices``, or FA4's and TRITON_ATTN's ``cu_seqlens_q``,
    ``seqused_k`` and page table (see :class:`FlashInferMetadata`)."""
    qo = tables[qo_at:qo_at + n + 1]
    if KERNELS[kernel] in TABLE_KERNELS:
        whole = n == seq_lens.shape[0]
        return (tables, qo, seq_lens if whole else seq_lens[first:first + n],
                block_table if whole else block_table[first:first + n])
    return (tables, qo, tables[kv_at:kv_at + n + 1], tables[last_at:last_at + n],
            tables[indices_at:indices_at + num_indices])


def _flashinfer_attention(query, kv_cache, out, lse, float_workspace, tables, seq_lens,
                          block_table, decode_workspace, decode_plan, prefill_workspace,
                          prefill_plan, sinks, k_scale, v_scale, scale, sliding_window, soft_cap,
                          causal) -> None:
    _check(query, kv_cache, out, lse)
    k_cache, v_cache = nhd_kv_halves(kv_cache)
    fp8 = kv_cache.dtype in _FP8
    q = query * k_scale.to(query.dtype) if fp8 else query  # dequantizes K inside q.k
    window = -1 if sliding_window is None else sliding_window - 1
    cap = soft_cap or 0.0
    need_lse = lse is not None or sinks is not None
    lse_buf = lse if lse is not None else (
        torch.empty(query.shape[:2], dtype=torch.float32, device=query.device) if need_lse
        else None)
    total = out.shape[0]
    start, padded_part = 0, None
    for plan_vec, ws in ((decode_plan, decode_workspace), (prefill_plan, prefill_workspace)):
        kernel, rows, padded, first, n, num_indices, plan_len, *plan = plan_vec.tolist()
        if kernel < 0:
            continue
        at, plan = plan[:4], plan[4:4 + plan_len]
        if start == 0 and rows == total:  # the part is the whole batch: no views to make
            q_part, out_part, lse_part = q, out, lse_buf
        else:
            rows_of = slice(start, start + rows)
            q_part, out_part = q[rows_of], out[rows_of]
            lse_part = lse_buf[rows_of] if need_lse else None
        views = _VIEWS.get(id(plan_vec))  # (made by a step's first layer, reused by the rest)
        if views is None or views[0] is not plan_vec or views[1] is not tables:
            if len(_VIEWS) > 16:
                _VIEWS.clear()
            views = _VIEWS[id(plan_vec)] = (plan_vec, *_part_tables(
                tables, seq_lens, block_table, kernel, first, n, num_indices, *at))
        if KERNELS[kernel] == "fa4":
            from attn_ops.backends.flash_attn import fa4_batch, fa_window, run_fa4

            left, right = fa_window(sliding_window, causal)
            lse_hm = run_fa4(q_part, k_cache, v_cache, out_part, *views[2:], plan[0], plan[1],
                             scale, left, right, soft_cap, causal, need_lse,
                             batch=0 if padded else fa4_batch(rows, n, plan[0]))
            if need_lse:
                lse_part.copy_(lse_hm.t())
        elif KERNELS[kernel] == "triton":  # (16-bit caches only: no scales; LSE in natural log)
            from attn_ops.backends.triton_attn import unsplit_decode

            unsplit_decode(q_part, k_cache, v_cache, out_part, lse_part, *views[2:], plan[1],
                           scale, sliding_window, soft_cap, causal)
        else:
            qo, kv_indptr, last, kv_indices = views[2:]
            mod = _module(KERNELS[kernel], query.dtype, kv_cache.dtype, query.shape[2],
                          out.shape[2], window >= 0, cap > 0)
            mod.paged_run(float_workspace, ws, plan, q_part, k_cache, v_cache, qo, kv_indptr,
                          kv_indices, last, out_part, lse_part, int(causal), 0, window, True,
                          None, None, None, None, None, None, cap, scale, None, None, None, 1.0,
                          1e4, 0, float_workspace.numel())
            if need_lse:
                lse_part.mul_(LN2)  # FlashInfer's LSE is base 2
            if padded and lse is not None:
                padded_part = (start, rows, last)
        start += rows
    if start < total:  # padding rows past the batch are zero, like REFERENCE's
        out[start:].zero_()
        if need_lse:
            lse_buf[start:].zero_()
    if sinks is not None:
        apply_sinks(out, lse_buf, sinks)
    if fp8:
        out.mul_(v_scale.to(out.dtype))
    if padded_part is not None:  # a CUDA-graph batch: requests without pages are padding,
        first, rows, last = padded_part  # their rows zero, their LSE -inf (or the sink's)
        lse[first:first + rows].masked_fill_((last == 0)[:, None], 0.0)


def _fake(query, kv_cache, out, lse, *args) -> None:
    _check(query, kv_cache, out, lse)


flashinfer_attention = define_op(
    "flashinfer_attention",
    "(Tensor query, Tensor kv_cache, Tensor(a!) out, Tensor(b!)? lse, Tensor(c!) float_workspace, "
    "Tensor tables, Tensor seq_lens, Tensor block_table, Tensor decode_workspace, "
    "Tensor decode_plan, Tensor prefill_workspace, Tensor prefill_plan, "
    + "Tensor? sinks, Tensor? k_scale, Tensor? v_scale, float scale, int? sliding_window, "
    "float? soft_cap, bool causal) -> ()",
    _flashinfer_attention, _fake, dispatch_keys=("CUDA",))


# ---------------------------------------------------------------------------------------------
# Backend


_FLASHINFER = PackageRequirement("flashinfer-python", "flashinfer", "0.7.2", max_version="0.8")


class FlashInferBackend(AttentionBackend):
    """FlashInfer tensor-core decode + FA3 (sm90) / FA2 prefill over the NHD cache."""

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
        cudagraph_support=CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE,
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

    def __init__(self, spec: AttentionSpec, prefill_kernel: str | None = None,
                 triton_decode: bool = False) -> None:
        """``backend_options``: ``prefill_kernel``, ``"fa2"``, ``"fa3"`` (sm90) or ``"fa4"``
        (FlashAttention 4, installed), default FA3 on sm90 where it applies, else FA2;
        ``triton_decode=True`` lets :func:`decode_kernel` choose TRITON_ATTN's decode kernel
        (which must support the spec) for 16-bit caches."""
        super().__init__(spec)
        if prefill_kernel is not None and prefill_kernel not in PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel={prefill_kernel!r} is not one of "
                             f"{PREFILL_KERNELS}")
        self.prefill_kernel, self.triton_decode = prefill_kernel, triton_decode
        self._key = self.metadata_key()  # (hashed every step: made once)

    def _kernel(self, device: torch.device) -> str:
        return self.prefill_kernel or _prefill_kernel(
            self.spec, torch.cuda.get_device_capability(device)[0])

    def build_metadata(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        """Plan once per step and per distinct planning key; layers sharing one reuse it."""
        if isinstance(common, FlashInferMetadata):
            return common
        device = common.seq_lens.device
        return self._plan_once(common, _EAGER_PLANNERS, (self._key, device),
                               lambda: _Planner(self.spec, device, self._kernel(device),
                                                self.triton_decode))

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> FlashInferMetadata:
        """Replan a padded decode batch into ``graphs``' persistent buffers (see
        :class:`_GraphPlanner`); the plan for each capture size is fixed at its first call."""
        super().graph_metadata(padded, graphs)
        return self._plan_once(padded, graphs.backend_state, self._key,
                               lambda: _GraphPlanner(self.spec, graphs))

    def _plan_once(self, common, planners: dict, planner_key, make_planner):
        """``common``'s plan for this planning key, made once per step by the planner kept in
        ``planners`` under ``planner_key`` (created on first use)."""
        per_step = _PLANS.setdefault(common, {})
        built = per_step.get(self._key)
        if built is None:
            planner = planners.get(planner_key)
            if planner is None:
                planner = planners[planner_key] = make_planner()
            built = per_step[self._key] = planner(common)
        return built

    def metadata_key(self) -> tuple:
        """Everything a plan depends on besides the batch."""
        spec = self.spec
        return (self.name, spec.num_heads, spec.kv_heads, spec.head_dim, spec.v_head_dim,
                spec.dtype, spec.cache_dtype, spec.sliding_window, spec.logits_soft_cap,
                spec.causal, self.prefill_kernel, self.triton_decode)

    def op_arguments(self, query, kv_cache, metadata, out, *, lse=None, sinks=None,
                     alibi_slopes=None, k_scale=None, v_scale=None) -> tuple:
        m = metadata
        return (query, kv_cache, out, lse, m.float_workspace, m.tables, m.seq_lens,
                m.block_table, m.decode_workspace, m.decode_plan, m.prefill_workspace,
                m.prefill_plan, sinks, k_scale, v_scale, self.scale,
                self.spec.sliding_window, self.spec.logits_soft_cap,
                self.spec.causal and m.causal)
