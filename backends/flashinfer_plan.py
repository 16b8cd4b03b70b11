"""FlashInfer's host planning: one step's plans, made outside graphs, for FLASHINFER and
COMPOSITE_SM90.

A step (decodes first) is run as two parts, the decode rows then the prefill rows. Each part
has a kernel -- chosen by a route of :mod:`attn_ops.routing` -- and a :class:`PartPlan`, a
typed plan encoded by :data:`PART` as a small CPU int64 tensor, so that the op takes only
tensors and scalars and can sit inside compiled graphs and CUDA graphs. FlashInfer's kernels
read the part's page table in CSR form (``qo_indptr`` / ``kv_indptr`` / ``kv_indices`` /
``last_page_len``) and FlashInfer's own plan (its ``plan()`` run here, on the host, into an int
workspace); FA4 and TRITON_ATTN parts read the common metadata's ``seq_lens`` and block table.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from attn_ops.metadata import (CommonAttentionMetadata, block_csr, last_page_len,
                               sizes_not_specialized, upload_int32, upload_tables)
from attn_ops.plan_codec import PlanCodec
from attn_ops.routing import (DeviceFacts, Kernel, PartRoute, Split, SplitMode,
                              flashinfer_graph_colocated_ctas, flashinfer_split_budget)
from attn_ops.spec import AttentionSpec
from attn_ops.tuning import FA4Tile, Tile, Tuning

__all__ = ["FlashInferMetadata", "GraphPlanner", "PART", "PartPlan", "Planner", "flashinfer_module",
           "paged_kv_csr", "part_tables", "plan_once", "warmup"]

FLOAT_WORKSPACE_BYTES = 128 << 20
INT_WORKSPACE_BYTES = 8 << 20
TABLE_KERNELS = (Kernel.FA4, Kernel.TRITON)  # read seq_lens and the block table, not the CSR


@dataclass(frozen=True)
class PartPlan:
    """One part of a step: ``kernel`` (None: the part has no rows), its ``rows`` query rows and
    ``requests`` requests from request ``first``; ``padded``: a CUDA-graph batch, whose
    requests without pages are padding. FlashInfer kernels: the offsets of the part's
    ``qo_indptr [n+1]``, ``kv_indptr [n+1]``, ``last_page_len [n]`` and ``kv_indices
    [num_indices]`` in the step's ``tables`` and FlashInfer's own plan (``library_plan``). FA4 and
    TRITON_ATTN: ``cu_seqlens_q`` at ``qo_at``, the bounds ``max_query`` / ``max_keys``, FA4's
    tile and batch mode, TRITON_ATTN's tile."""

    kernel: Kernel | None
    rows: int
    requests: int
    first: int
    padded: bool
    num_indices: int
    qo_at: int
    kv_at: int
    last_at: int
    indices_at: int
    max_query: int
    max_keys: int
    fa4_tile: FA4Tile | None
    fa4_batch: bool
    triton_tile: Tile | None
    library_plan: tuple[int, ...]


PART = PlanCodec(PartPlan, 128)
_ABSENT = PartPlan(None, 0, 0, 0, False, 0, 0, 0, 0, 0, 0, 0, None, False, None, ())


@dataclass(frozen=True, eq=False)
class FlashInferMetadata:
    """One step's plans, in two parts run one after the other: the decode rows (first), then
    the prefill rows; per part an int workspace (device) and a :class:`PartPlan` (encoded, CPU).
    ``tables`` (int32, device) holds both parts' page tables at the plans' offsets: eagerly the
    common metadata's :class:`~attn_ops.metadata.DeviceTables` buffer (uploaded with the
    batch: the builder copies nothing), in CUDA graphs the graph planner's persistent buffer.
    One tensor, not a view per table: Dynamo would guard on each view's storage offset, and
    every batch composition would be another graph; plan vectors of one size, so that Dynamo
    has no size to specialize on. ``seq_lens`` / ``block_table``: the common metadata's where a
    part reads them (FA4, TRITON_ATTN), else empty stand-ins. ``slot_mapping``: the common
    metadata's, for the KV-cache write."""

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


def paged_kv_csr(seq_lens: torch.Tensor, block_table: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table from per-request lengths and a dense block table.

    ``seq_lens [B]`` and ``block_table [B, max_blocks]`` on the host -> ``indptr [B+1]``,
    ``indices [indptr[-1]]`` (each request's used blocks, in order) and ``last_page_len [B]``
    (tokens in each request's last page, 1..block_size; 0 for an empty request), all int32.
    """
    seq = seq_lens.numpy()
    indptr, indices = block_csr(seq, block_table.numpy(), block_size)
    return (torch.from_numpy(indptr), torch.from_numpy(indices),
            torch.from_numpy(last_page_len(seq, block_size)))


def part_tables(tables: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                p: PartPlan) -> tuple:
    """A part's views of the step's tables: FlashInfer's ``qo_indptr``, ``kv_indptr``,
    ``last_page_len`` and ``kv_indices``, or FA4's and TRITON_ATTN's ``cu_seqlens_q``,
    ``seqused_k`` and page table."""
    n = p.requests
    qo = tables[p.qo_at:p.qo_at + n + 1]
    if p.kernel in TABLE_KERNELS:
        whole = n == seq_lens.shape[0]
        return (qo, seq_lens if whole else seq_lens[p.first:p.first + n],
                block_table if whole else block_table[p.first:p.first + n])
    return (qo, tables[p.kv_at:p.kv_at + n + 1], tables[p.last_at:p.last_at + n],
            tables[p.indices_at:p.indices_at + p.num_indices])


@functools.cache
def float_workspace(device: torch.device) -> torch.Tensor:
    """Scratch for split-KV partial results; layers run one after another, so all share it."""
    return torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)


class _IntWorkspace:
    """A plan's int workspace on the device and the pinned host buffers FlashInfer's ``plan``
    fills and copies from (asynchronously). Every planning key gets its own: a step plans all
    its keys before its layers run, so a shared one would hold only the last plan. Host
    buffers take turns, each with an event that keeps ``plan`` from refilling it before its
    copy ran: with one buffer, each step's plan would wait for the previous step's copy, which
    the stream runs only after the previous step's kernels -- the host would lose its
    run-ahead."""

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
        plan = mod.plan(float_workspace(self.device.device), self.device, self.hosts[i], *args)
        self.copied[i].record()
        return plan[:]  # (a tvm-ffi Array: a slice reads it in one pass; list() is slower)


_MODULES: dict = {}
_MODULE_NAMES = {Kernel.FLASHINFER_FA2: "fa2", Kernel.FLASHINFER_FA3: "fa3"}


def flashinfer_module(kernel: Kernel, q_dtype, kv_dtype, head_dim, head_dim_v, windowed,
                      capped):
    """FlashInfer's JIT module of a paged kernel (compiled with nvcc on first use)."""
    key = (kernel, q_dtype, kv_dtype, head_dim, head_dim_v, windowed, capped)
    mod = _MODULES.get(key)  # (FlashInfer's own lookup hashes 11 arguments per call)
    if mod is None:
        from flashinfer.prefill import get_batch_prefill_module

        mod = _MODULES[key] = get_batch_prefill_module(
            _MODULE_NAMES[kernel], q_dtype, kv_dtype, q_dtype, torch.int32, head_dim,
            head_dim_v, 0, windowed, capped, False)
    return mod


def prefill_kernel(spec: AttentionSpec, major: int) -> Kernel:
    """FlashInfer's prefill kernel: FA3 on sm90 for equal head dims of 64/128/256 and a 16-bit
    cache (FA3 needs an fp8 query for an fp8 cache), FA2 elsewhere."""
    if major == 9 and spec.v_head_dim == spec.head_dim and not spec.kv_cache_dtype.is_fp8 \
            and spec.head_dim in (64, 128, 256):
        return Kernel.FLASHINFER_FA3
    return Kernel.FLASHINFER_FA2


def warmup(spec: AttentionSpec, major: int = 9) -> None:
    """Build (JIT-compile with nvcc, minutes the first time) the kernels ``spec`` needs -- FA2
    for decodes, FA3 or FA2 for prefills -- so no compilation happens inside a step, a compile
    or a capture."""
    window, cap = spec.sliding_window is not None, spec.logits_soft_cap is not None
    for kernel in {Kernel.FLASHINFER_FA2, prefill_kernel(spec, major)}:
        flashinfer_module(kernel, spec.dtype, spec.cache_dtype, spec.head_dim, spec.v_head_dim,
                          window, cap)


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # step metadata -> plans


def plan_once(common, key: tuple, planners: dict, planner_key, make_planner):
    """``common``'s plan for the planning ``key``, made once per step by the planner kept in
    ``planners`` under ``planner_key`` (created on first use): the layers of a step that share
    the key share the plan."""
    per_step = _PLANS.setdefault(common, {})
    built = per_step.get(key)
    if built is None:
        planner = planners.get(planner_key)
        if planner is None:
            planner = planners[planner_key] = make_planner()
        built = per_step[key] = planner(common)
    return built


# A decode route: (requests, max pages, block size, longest query) -> PartRoute.
DecodeRouter = Callable[[int, int, int, int], PartRoute]


class Planner:
    """Plans for one planning key (a spec and a tuning, minus the batch) on one device, step
    after step, with int workspaces of its own (the decode and the prefill part must not share
    one). ``route_decode`` routes the decode part; ``prefill`` is the prefill part's kernel.
    ``fa4_tile_for`` / ``triton_tile_for`` give the tiles of FA4 and TRITON_ATTN parts (the
    composite's)."""

    def __init__(self, spec: AttentionSpec, device: torch.device, tuning: Tuning,
                 route_decode: DecodeRouter, prefill: Kernel, *, facts: DeviceFacts | None = None,
                 fa4_tile_for: Callable | None = None, fa4_batch_for: Callable | None = None,
                 triton_tile_for: Callable | None = None) -> None:
        self.spec, self.device, self.tuning = spec, device, tuning
        self.route_decode, self.prefill = route_decode, prefill
        self.fa4_tile_for, self.fa4_batch_for = fa4_tile_for, fa4_batch_for
        self.triton_tile_for = triton_tile_for
        self.float_workspace = float_workspace(device)
        self.decode_ws, self.prefill_ws = _IntWorkspace(device), _IntWorkspace(device)
        self.window = -1 if spec.sliding_window is None else spec.sliding_window - 1
        self.cap = spec.logits_soft_cap or 0.0
        # The plan of a part without requests, one per part: Dynamo guards on inputs that
        # alias, so one tensor passed twice would make another graph than two tensors.
        self.absent = (PART.encode(_ABSENT), PART.encode(_ABSENT))
        self.facts = facts or DeviceFacts.of(device)
        self.split_budget = flashinfer_split_budget(self.facts.num_sms, spec.kv_heads)

    @staticmethod
    def unused(tables: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stand-ins for ``seq_lens`` and a ``block_table`` of ``width`` columns where no part
        reads them (only FA4 and TRITON_ATTN parts do): empty views of the step's ``tables``,
        as the common metadata's are views of its buffer -- Dynamo guards on what a view's
        base is and on its offset (never 0 or 1 here), and would otherwise compile a second
        graph for steps whose parts read no tables. (The width as the real tables': Dynamo
        would specialize on it.)"""
        pair = tables[2:2], tables[2:2].view(0, width)
        sizes_not_specialized(*pair)
        return pair

    def plan_flashinfer(self, ws: _IntWorkspace, kernel: Kernel, qo: np.ndarray,
                        kv_indptr: np.ndarray, seq: np.ndarray, block_size: int, causal: bool,
                        graph: bool, split: Split = Split(SplitMode.LIBRARY_RULE),
                        colocated: int = 0) -> list[int]:
        """FlashInfer's plan for the requests of one part (host int32 arrays), as its plan
        list; ``colocated``: CTAs of FlashInfer's split budget (two per SM) to leave unused.

        FA2's plan reads only the query and page-count offsets (not the token lengths), and
        without a split not even the page counts. When they are those of this workspace's last
        plan -- a decode step in which no request entered a new page, or any decode step of
        the same requests without a split -- its tables are still in the workspace, and
        FlashInfer is not called."""
        spec = self.spec
        key = None
        no_split = split.mode is SplitMode.NONE
        chunk = split.chunk_pages if split.mode is SplitMode.FIXED else -1
        if kernel is Kernel.FLASHINFER_FA2:
            key = (qo.tobytes(), b"" if no_split else kv_indptr.tobytes(), split, colocated,
                   graph, causal, block_size)
            if ws.last is not None and ws.last[0] == key:
                return ws.last[1]
        mod = flashinfer_module(kernel, spec.dtype, spec.cache_dtype, spec.head_dim,
                                spec.v_head_dim, self.window >= 0, self.cap > 0)
        args = [torch.from_numpy(qo), torch.from_numpy(kv_indptr), torch.from_numpy(seq),
                int(qo[-1]), qo.shape[0] - 1, spec.num_heads, spec.kv_heads, block_size, graph,
                spec.head_dim, spec.v_head_dim, causal, self.window]
        # FA2's extra plan arguments: fixed_split_size, disable_split_kv, colocated, uniform_q
        if kernel is Kernel.FLASHINFER_FA2:
            args += [chunk, no_split, colocated, 0]
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
            max_query = int(np.diff(qo).max())
            longest = common.max_seq_len if (first, stop) == (0, n) else int(seq[first:stop].max())
            if part == 0:
                route = self.route_decode(nd, -(-longest // block_size), block_size, max_query)
                at = dev.query_start_loc, dev.block_indptr, dev.last_page_len, dev.block_indices
            else:
                route = PartRoute(self.prefill)
                at = (dev.prefill_query_start_loc, dev.prefill_block_indptr,
                      dev.last_page_len + first, dev.block_indices + int(indptr[first]))
            kernel, rows = route.kernel, int(qo[-1])
            fa4_tile, fa4_batch, triton_tile, library_plan, num_indices = None, False, None, (), 0
            if kernel in TABLE_KERNELS:  # they read the common metadata's device tables
                uses_tables = True
                if kernel is Kernel.FA4:
                    fa4_batch = part == 1 and self.fa4_batch_for(rows, stop - first, max_query)
                    fa4_tile = route.fa4_tile or self.fa4_tile_for(max_query, fa4_batch)
                else:
                    triton_tile = self.triton_tile_for(stop - first)
            else:
                pages = indptr[first:stop + 1]
                kv_indptr = pages - pages[0] if first else pages
                num_indices = int(kv_indptr[-1])
                library_plan = tuple(self.plan_flashinfer(
                    (self.decode_ws, self.prefill_ws)[part], kernel, qo, kv_indptr,
                    seq[first:stop], block_size, causal, graph=False,
                    split=route.split or Split(SplitMode.LIBRARY_RULE)))
            bounds = (max_query, longest) if kernel in TABLE_KERNELS else (0, 0)  # (read by them)
            plans[part] = PART.encode(PartPlan(
                kernel, rows, stop - first, first, False, num_indices, *at, *bounds,
                fa4_tile, fa4_batch, triton_tile, library_plan))
        seq_lens, block_table = self.unused(dev.buffer, common.block_table.shape[1])
        if uses_tables:
            seq_lens, block_table = common.seq_lens, common.block_table
            sizes_not_specialized(seq_lens, block_table)
        sizes_not_specialized(dev.buffer)
        return FlashInferMetadata(common.slot_mapping, self.float_workspace, dev.buffer,
                                  seq_lens, block_table, self.decode_ws.device, plans[0],
                                  self.prefill_ws.device, plans[1], causal=common.causal)


class GraphPlanner(Planner):
    """Decode plans for CUDA-graph batches (FlashInfer's CUDA-graph mode): page tables in one
    persistent device buffer sized for the largest capture size, one plan per capture size
    whose host vector must not change between capture and replays (checked: in this mode
    FlashInfer fixes the grid per batch size). Padded requests have no pages: FlashInfer
    writes their rows as zero (a row that saw no key is normalized by 0) and their LSE as
    -inf (zeroed by the op). In this mode FlashInfer always splits (and merges) -- small
    capture sizes on a grid of one CTA per SM (``routing.flashinfer_graph_colocated_ctas``);
    capture sizes past its split budget, where it could not split eagerly either, are planned
    without a split instead -- the eager kernel, no merge, and a plan that stays the same from
    step to step (FlashInfer is not called again)."""

    def __init__(self, spec: AttentionSpec, graphs, tuning: Tuning,
                 facts: DeviceFacts | None = None) -> None:
        super().__init__(spec, graphs.device, tuning, lambda *a: PartRoute(Kernel.FLASHINFER_FA2),
                         Kernel.FLASHINFER_FA2, facts=facts)
        largest = graphs.capture_sizes[-1]
        self.tables = torch.zeros(3 * largest + 2 + largest * graphs.max_blocks_per_req,
                                  dtype=torch.int32, device=self.device)
        self.plans: dict[int, tuple[list, torch.Tensor]] = {}  # size -> (kernel plan, vector)
        self.held: tuple | None = None  # (the metadata the tables hold, and its size)

    def __call__(self, padded: CommonAttentionMetadata) -> FlashInferMetadata:
        size = padded.num_reqs
        if padded.max_query_len != 1:
            raise ValueError(f"FlashInfer captures single-token decode batches; got query "
                             f"length {padded.max_query_len}")
        qo = np.arange(size + 1, dtype=np.int32)  # padded requests get a (zeroed) row
        kv_indptr, kv_indices = padded.block_csr()
        seq = padded.seq_lens_cpu.numpy()
        last = last_page_len(seq, padded.block_size)
        if size > self.split_budget:
            split, colocated = Split(SplitMode.NONE), 0
        else:
            split = Split(SplitMode.LIBRARY_RULE)
            colocated = flashinfer_graph_colocated_ctas(size, self.spec.kv_heads,
                                                        self.facts.num_sms,
                                                        self.tuning.flashinfer)
        kernel_plan = self.plan_flashinfer(self.decode_ws, Kernel.FLASHINFER_FA2, qo, kv_indptr,
                                           seq, padded.block_size,
                                           self.spec.causal and padded.causal, graph=True,
                                           split=split, colocated=colocated)
        made, captured = self.plans.get(size, (None, None))
        if kernel_plan is not made:  # (a plan kept in the workspace is the one checked)
            # (num_indices: all the buffer holds past the other tables, the same every replay)
            plan = PART.encode(PartPlan(
                Kernel.FLASHINFER_FA2, size, size, 0, True, self.tables.shape[0] - (3 * size + 2),
                0, size + 1, 2 * size + 2, 3 * size + 2, 1, 0, None, False, None,
                tuple(kernel_plan)))
            if captured is None:
                captured = plan
            elif not torch.equal(captured, plan):
                raise RuntimeError(f"FlashInfer's decode plan for capture size {size} changed "
                                   f"({PART.decode(captured).library_plan} -> "
                                   f"{tuple(kernel_plan)}); a replay would run the captured "
                                   "grid on the wrong schedule")
            self.plans[size] = (kernel_plan, captured)
        upload_int32([qo, kv_indptr, last, kv_indices], self.tables)
        meta = FlashInferMetadata(padded.slot_mapping, self.float_workspace, self.tables,
                                  *self.unused(self.tables, padded.block_table.shape[1]),
                                  self.decode_ws.device, captured,
                                  self.prefill_ws.device, self.absent[1], causal=padded.causal)
        self.held = (meta, size)
        return meta

    def advance(self, metadata: FlashInferMetadata, rows: int) -> bool:
        """``metadata`` -- the one the tables hold -- one step later: each of its first
        ``rows`` requests one token longer, in the page of its last token
        (:meth:`~attn_ops.cudagraph.CUDAGraphBatch.advance`). Its page offsets, pages and plan
        stay (FA2's plan reads page counts, not lengths), so only the last-page lengths move:
        one add on the device. False (nothing done) where the tables hold another batch."""
        if self.held is None or self.held[0] is not metadata:
            return False
        size = self.held[1]
        self.tables[2 * size + 2:2 * size + 2 + rows].add_(1)
        return True
