"""FLASHINFER_MLA_SPARSE: sparse MLA through FlashInfer's MLA kernel (fa3 on sm90 for latent
widths 128 / 256 / 512, fa2 elsewhere), each query token its own request of page size 1 whose
pages are its selected slots -- the latent cache viewed as ``[slots, 1, rank + rope]``.

FlashInfer's plan is host work and needs each request's page count before the indexer has run:
a token selects ``min(top-k, position + 1)`` slots (what the indexer selects), which the host
knows from the step's lengths. So the metadata builder plans once a step -- ``kv_indptr`` /
``kv_len`` from those counts, ``kv_indices`` our persistent index buffer -- and the op, once the
step's ``topk_slots`` exist, fills that buffer on the device (each token's first ``count``
entries, packed in one launch) and runs the kernel, which reads the buffer then. Tokens with
no slot (padding rows) are zeroed after the kernel.

The selection contract is the sparse family's (:mod:`attn_ops.backends.mla.sparse`): the
packing flags every row whose packed entries are not its selection (an entry outside the
cache or -1 among the first ``count``, a valid one after them, as the indexer never writes
but a caller may), and TRITON_MLA_SPARSE recomputes just those rows after the kernel -- one
launch whose programs of unflagged rows return at once. An entry outside the cache is packed
as slot 0, so FlashInfer never reads outside it.

CUDA graphs: uniform batches of a capture size, one wrapper per size over persistent buffers,
replanned before every replay.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from attn_ops.backends.flashinfer_plan import float_workspace
from attn_ops.backends.mla.flashinfer_mla import (FlashInferMLABackend, mla_wrapper_class,
                                                  shared_memory_reasons)
from attn_ops.backends.mla.sparse import (SparseMLABackend, check_sparse_mla_inputs,
                                          define_sparse_mla_op, sparse_capabilities,
                                          sparse_mla_torch)
from attn_ops.metadata import CommonAttentionMetadata
from attn_ops.routing import Kernel, flashinfer_mla_kernel

__all__ = ["FlashInferSparseMLABackend", "SparseMLAMetadata", "selection_counts"]

_LIBRARY_BACKEND = {Kernel.FLASHINFER_MLA_FA3: "fa3", Kernel.FLASHINFER_MLA_FA2: "fa2"}


@dataclass
class _Planned:
    wrapper: object
    indices: torch.Tensor  # [capacity] int32: the kv_indices FlashInfer's plan reads
    counts: torch.Tensor  # [rows] int32: the entries each row's plan reads
    indptr: torch.Tensor  # [rows] int32: where each row's entries start in ``indices``
    flags: torch.Tensor  # [rows] int32: rows whose packed entries are not their selection
    empty: torch.Tensor  # [rows] bool: rows without a slot (zeroed after the kernel)
    repair: tuple[int, ...] = ()  # TRITON_MLA_SPARSE's launch for the flagged rows


_PLANNED: dict[int, _Planned] = {}  # launch handle -> the planned wrapper and its buffers
_HANDLES = itertools.count(1)


@dataclass(frozen=True, eq=False)
class SparseMLAMetadata:
    """The common tensors the indexer and the latent write read, and ``launch``: the planned
    wrapper's handle, which the op takes as its launch argument."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    launch: tuple[int, ...]
    block_size: int = 0  # the page size the step was built for


def selection_counts(qsl: np.ndarray, seq: np.ndarray, rows: int, topk: int) -> np.ndarray:
    """Slots each of ``rows`` query rows selects: ``min(topk, position + 1)`` (rows past the
    requests' and rows at negative positions -- a graph's padding requests -- none)."""
    counts = np.zeros(rows, dtype=np.int64)
    for r in range(qsl.shape[0] - 1):
        n = int(qsl[r + 1] - qsl[r])
        pos = int(seq[r]) - n + np.arange(n)
        counts[qsl[r]:qsl[r + 1]] = np.clip(pos + 1, 0, topk)
    return counts


def sparse_flashinfer(ql, q_pe, latent_cache, topk_slots, out, kv_scale, scale, launch) -> None:
    planned = _PLANNED.get(launch[0]) if len(launch) == 1 else None
    if planned is None:
        raise ValueError(f"FLASHINFER_MLA_SPARSE: no planned kernel {list(launch)}; build the "
                         "step's metadata with this backend's build_metadata / graph_metadata")
    if planned.empty.shape[0] != ql.shape[0]:
        raise ValueError(f"FLASHINFER_MLA_SPARSE: the plan is for {planned.empty.shape[0]} "
                         f"rows, the step has {ql.shape[0]}; build its metadata again")
    from attn_ops.backends.mla.sparse_kernels import (pack_selection, pack_selection_torch,
                                                      sparse_mla_triton)

    capacity = latent_cache.shape[0] * latent_cache.shape[1]
    pack = pack_selection if ql.is_cuda else pack_selection_torch
    pack(topk_slots, planned.counts, planned.indptr, planned.indices, planned.flags, capacity)
    rank = ql.shape[2]
    rows = latent_cache.view(-1, 1, latent_cache.shape[2])
    planned.wrapper.run(ql, q_pe, rows[:, :, :rank], rows[:, :, rank:], out=out)
    out.masked_fill_(planned.empty[:, None, None], 0.0)  # (what the kernel left: anything)
    if ql.is_cuda:  # (no host read: the flagged rows' programs run, the others return)
        sparse_mla_triton(ql, q_pe, latent_cache, topk_slots, out, kv_scale, scale,
                          planned.repair, row_flags=planned.flags)
        return
    redo = planned.flags.nonzero()[:, 0]
    if redo.numel():
        fixed = out[redo]
        sparse_mla_torch(ql[redo], q_pe[redo], latent_cache, topk_slots[redo], fixed, kv_scale,
                         scale)
        out[redo] = fixed


def _check(*args) -> None:
    check_sparse_mla_inputs(*args)
    q, latent_cache = args[0], args[1]
    if latent_cache.dtype != q.dtype or not latent_cache.is_contiguous():
        raise ValueError(f"FLASHINFER_MLA_SPARSE: latent_cache must be a contiguous "
                         f"{q.dtype} cache (the query's dtype), got {latent_cache.dtype}")


flashinfer_mla_sparse = define_sparse_mla_op("flashinfer_mla_sparse", sparse_flashinfer,
                                             check=_check)


class FlashInferSparseMLABackend(SparseMLABackend):
    """FlashInfer's MLA kernels (fa3 / fa2) over each token's selected slots on CUDA; bf16 /
    fp16 latents (fp8: TRITON_MLA_SPARSE)."""

    name = "FLASHINFER_MLA_SPARSE"
    capabilities = sparse_capabilities(FlashInferMLABackend.capabilities)
    op = flashinfer_mla_sparse

    @classmethod
    def latent_reasons(cls, spec):
        return FlashInferMLABackend.latent_reasons.__func__(cls, spec)  # (FlashInfer's widths)

    @classmethod
    def not_supported_reasons(cls, spec, platform):
        reasons = super().not_supported_reasons(spec, platform)
        return reasons or shared_memory_reasons(cls.name, spec, platform)

    def __init__(self, spec, **kw) -> None:
        super().__init__(spec, **kw)
        self._eager: dict[torch.device, int] = {}

    def _new(self, device: torch.device, rows: int, graph: bool) -> int:
        """A wrapper and its buffers for ``rows`` query rows (for a CUDA-graph size the wrapper
        works over them: persistent) and its handle."""
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)
        backend = _LIBRARY_BACKEND[flashinfer_mla_kernel(cap, self.spec.kv_lora_rank)]
        planned = _Planned(None, *self._buffers(device, rows),
                           repair=tuple(self.triton_launch(rows, device)))
        kwargs = {}
        if graph:
            i32 = dict(dtype=torch.int32, device=device)
            kwargs = dict(use_cuda_graph=True, qo_indptr=torch.zeros(rows + 1, **i32),
                          kv_indptr=torch.zeros(rows + 1, **i32), kv_indices=planned.indices,
                          kv_len_arr=torch.zeros(rows, **i32))
        planned.wrapper = mla_wrapper_class()(float_workspace(device), backend=backend, **kwargs)
        handle = next(_HANDLES)
        _PLANNED[handle] = planned
        return handle

    def _buffers(self, device: torch.device, rows: int):
        """``(indices, counts, indptr, flags, empty)`` for ``rows`` query rows."""
        i32 = dict(dtype=torch.int32, device=device)
        return (torch.zeros(max(1, rows * self.spec.index_topk), **i32),
                torch.zeros(rows, **i32), torch.zeros(rows, **i32), torch.zeros(rows, **i32),
                torch.zeros(rows, dtype=torch.bool, device=device))

    def _plan(self, handle: int, counts: np.ndarray) -> None:
        """Plan ``counts`` (slots per query row) on ``handle``'s wrapper and fill its
        per-row counts, offsets and empty-row mask."""
        spec, planned = self.spec, _PLANNED[handle]
        rows = counts.shape[0]
        indptr = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        host = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
        planned.counts.copy_(host(counts), non_blocking=True)
        planned.indptr.copy_(host(indptr[:-1]), non_blocking=True)
        planned.empty.copy_(torch.from_numpy(counts == 0), non_blocking=True)
        with warnings.catch_warnings():  # (0.7's flat-argument plan is deprecated, not gone)
            warnings.simplefilter("ignore", DeprecationWarning)
            planned.wrapper.plan(
                host(np.arange(rows + 1)), host(indptr), planned.indices[:max(1, indptr[-1])],
                host(counts), spec.num_heads, spec.kv_lora_rank, spec.qk_rope_head_dim, 1,
                False, self.scale, spec.dtype, spec.cache_dtype)

    def _metadata(self, common: CommonAttentionMetadata, handle: int, rows: int):
        qsl = common.query_start_loc_cpu.numpy()
        self._plan(handle, selection_counts(qsl, common.seq_lens_cpu.numpy(), rows,
                                            self.spec.index_topk))
        return SparseMLAMetadata(common.slot_mapping, common.query_start_loc, common.seq_lens,
                                 common.block_table, (handle,), common.block_size)

    def build_metadata(self, common: CommonAttentionMetadata) -> SparseMLAMetadata:
        """Plan the step (every row of it, padding included) on the eager wrapper of its
        device, its buffers sized to the step's rows (the wrapper reads the index buffer the
        plan was given)."""
        device = common.seq_lens.device
        rows = common.slot_mapping.shape[0]
        handle = self._eager.get(device)
        if handle is None:
            handle = self._eager[device] = self._new(device, rows, graph=False)
        planned = _PLANNED[handle]
        if planned.empty.shape[0] != rows:
            (planned.indices, planned.counts, planned.indptr, planned.flags,
             planned.empty) = self._buffers(device, rows)
            planned.repair = tuple(self.triton_launch(rows, device))
        return self._metadata(common, handle, rows)

    def graph_metadata(self, padded: CommonAttentionMetadata, graphs) -> SparseMLAMetadata:
        """Replan the padded batch on its capture size's wrapper (persistent buffers)."""
        super().graph_metadata(padded, graphs)
        rows = padded.num_reqs * graphs.query_len
        key = (*self.metadata_key(), "flashinfer_mla_sparse", padded.num_reqs)
        handle = graphs.backend_state.get(key)
        if handle is None:
            handle = graphs.backend_state[key] = self._new(graphs.device, rows, graph=True)
        return self._metadata(padded, handle, rows)

    def launch(self, metadata) -> list[int]:
        return list(metadata.launch)
