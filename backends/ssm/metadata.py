"""A step's metadata for the recurrent-state layers, built once a step on the host and shared
by every state layer of a hybrid model (as :class:`~attn_ops.metadata.CommonAttentionMetadata`
is by its attention layers).

* ``state_indices`` ``[B]`` int32: each request's state slot (the allocator's; padding
  requests the null slot 0, which no request owns); with speculative decoding ``[B, 1 + S]``:
  the slot to continue from (of the previous step's last accepted position), then the
  request's ``S`` slots, which receive the state after each new token
  (:func:`~attn_ops.backends.ssm.common.split_slots`);
* ``has_initial_state`` ``[B]`` bool: the request has computed tokens, so its conv and
  recurrent states are read; else it starts from zeros (the slot's old contents are never
  read, whoever left them);
* chunks for the chunked scans: each request's new tokens cut at absolute multiples of the
  kind's chunk size, so a prefill resumed mid-chunk first tops up to the next boundary --
  ``chunk_starts`` ``[C + 1]`` token offsets in the batch, ``chunk_requests`` ``[C]``, and
  ``last_chunks`` ``[B]`` each request's last chunk (a request with no new tokens: -1).

Requests are decode-first, as for attention; ``num_decodes`` leads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attn_ops.metadata import pack_upload

__all__ = ["NULL_STATE_SLOT", "StateGraphBatch", "StateMetadata", "build_state_metadata",
           "chunk_boundaries"]

NULL_STATE_SLOT = 0


def chunk_boundaries(context_lens: np.ndarray, query_lens: np.ndarray,
                     chunk_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(chunk_starts, chunk_requests, last_chunks)`` of requests with ``context_lens`` computed
    and ``query_lens`` new tokens: chunk edges at the multiples of ``chunk_size`` of each
    request's own positions."""
    starts, owners, last = [0], [], np.full(query_lens.shape[0], -1, dtype=np.int64)
    offset = 0
    for r, (ctx, n) in enumerate(zip(context_lens.tolist(), query_lens.tolist())):
        pos, end = ctx, ctx + n
        while pos < end:
            step = min(end, (pos // chunk_size + 1) * chunk_size) - pos
            offset += step
            pos += step
            starts.append(offset)
            owners.append(r)
        if n:
            last[r] = len(owners) - 1
    return (np.asarray(starts, dtype=np.int64), np.asarray(owners, dtype=np.int64), last)


def _host_ints(name: str, values) -> np.ndarray:
    """``values`` -- a tensor (any device), an array or a list -- as an int64 host array;
    floating values are refused rather than truncated."""
    arr = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    if arr.size and not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


@dataclass(frozen=True, eq=False)
class StateMetadata:
    """See the module docstring. Host copies end in ``_cpu``; ``max_query_len`` is a host int
    (a decode-only step has 1: its kernels take no host data) bounding every request's new
    tokens in ``query_start_loc_cpu`` -- checked here, where it is built: the ops take it as
    that bound."""

    query_start_loc: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    context_lens_cpu: torch.Tensor
    num_decodes: int
    max_query_len: int
    chunk_size: int
    chunk_starts: torch.Tensor
    chunk_requests: torch.Tensor
    last_chunks: torch.Tensor

    def __post_init__(self) -> None:
        qsl = self.query_start_loc_cpu.numpy()
        lens = qsl[1:] - qsl[:-1]
        if lens.size and int(lens.max()) > self.max_query_len:
            r = int(lens.argmax())
            raise ValueError(f"max_query_len={self.max_query_len} is below request {r}'s "
                             f"{int(lens[r])} new tokens (query_start_loc_cpu[{r}:{r + 2}]="
                             f"{qsl[r:r + 2].tolist()}); it must bound every request's")

    @property
    def num_reqs(self) -> int:
        return self.state_indices.shape[0]


def build_state_metadata(query_start_loc_cpu, context_lens, state_slots, chunk_size: int, *,
                         device: torch.device | str = "cpu",
                         num_decodes: int | None = None,
                         num_accepted_tokens: np.ndarray | None = None) -> StateMetadata:
    """The state metadata of a step: ``query_start_loc_cpu`` ``[B + 1]`` (from 0) and
    ``context_lens`` ``[B]`` of its requests, ``state_slots`` ``[B]`` their slots (0 for
    padding requests) -- or ``[B, S]`` (:attr:`BlockAllocator.state_slots_per_request` ``S``)
    with ``num_accepted_tokens`` ``[B]``: how many of each request's new tokens of the previous
    step were kept, whose state (at slot ``min(accepted, S) - 1`` of the request's) this step
    continues from. Each takes a tensor, a numpy array or a list. Raises ``ValueError`` naming
    the request when a value is out of range."""
    qsl = _host_ints("query_start_loc_cpu", query_start_loc_cpu)
    if qsl.ndim != 1 or qsl.shape[0] < 1 or qsl[0] != 0:
        raise ValueError(f"query_start_loc_cpu must be [num_reqs + 1] from 0, got shape "
                         f"{qsl.shape} starting {qsl.ravel()[:1].tolist()}")
    query_lens = qsl[1:] - qsl[:-1]
    context_lens = _host_ints("context_lens", context_lens)
    table = _host_ints("state_slots", state_slots)
    n = query_lens.shape[0]
    if table.ndim == 2:
        if num_accepted_tokens is None:
            raise ValueError("state_slots [num_reqs, S] (several slots a request) needs "
                             "num_accepted_tokens [num_reqs]: which slot each continues from")
        accepted = _host_ints("num_accepted_tokens", num_accepted_tokens)
        if accepted.shape != (n,) or ((accepted < 1) & (context_lens > 0)).any():
            raise ValueError(f"num_accepted_tokens must be [num_reqs={n}], >= 1 for requests "
                             f"with context, got {accepted.tolist()}")
        col = np.clip(accepted, 1, table.shape[1]) - 1
        read = table[np.arange(n), col] if n else table[:, 0]
        slots = table[:, 0]
    elif num_accepted_tokens is not None:
        raise ValueError("num_accepted_tokens needs state_slots [num_reqs, S] (a slot per "
                         "speculative position: BlockAllocator(state_slots_per_request=1 + K))")
    else:
        slots = table
    for name, arr in (("context_lens", context_lens), ("state_slots", slots)):
        if arr.shape != (n,):
            raise ValueError(f"{name} must have one entry per request ({n}), got shape "
                             f"{arr.shape}")
    for name, arr in (("query length", query_lens), ("context length", context_lens),
                      ("state slot", slots)):
        if (arr < 0).any():
            r = int((arr < 0).argmax())
            raise ValueError(f"request {r}: {name} must be >= 0, got {int(arr[r])}")
    real = slots != NULL_STATE_SLOT
    owned = table[real].ravel()
    taken, counts = np.unique(owned[owned != NULL_STATE_SLOT], return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"state slot {int(taken[counts.argmax()])} is given to "
                         f"{int(counts.max())} requests of the step: each request owns its slot")
    if (~real & ((query_lens > 0) | (context_lens > 0))).any():
        r = int((~real & ((query_lens > 0) | (context_lens > 0))).argmax())
        raise ValueError(f"request {r} has {int(query_lens[r])} new and {int(context_lens[r])} "
                         "computed tokens but the null state slot 0; give it its own slot "
                         "(BlockAllocator.state_slot), or 0 and 0 tokens to pad the batch")
    starts, owners, last = chunk_boundaries(context_lens, query_lens, chunk_size)
    if num_decodes is None:
        num_decodes = int(np.argmax(query_lens > 1)) if (query_lens > 1).any() else n
    indices = np.concatenate([read[:, None], table], axis=1) if table.ndim == 2 else slots
    arrays = [qsl, indices, context_lens > 0, starts, owners, last]
    # (one pinned upload: a copy from pageable memory waits for the stream to drain, which
    # would keep the host from preparing the next step while the GPU runs this one)
    packed, offsets = pack_upload([], arrays, device)
    qsl_d, indices_d, initial, starts_d, owners_d, last_d = (
        packed[o:o + a.size].view(a.shape) for a, o in zip(arrays, offsets))
    return StateMetadata(
        query_start_loc=qsl_d, state_indices=indices_d, has_initial_state=initial != 0,
        query_start_loc_cpu=torch.from_numpy(qsl.astype(np.int32)),
        context_lens_cpu=torch.from_numpy(context_lens), num_decodes=num_decodes,
        max_query_len=int(query_lens.max()) if n else 0, chunk_size=chunk_size,
        chunk_starts=starts_d, chunk_requests=owners_d, last_chunks=last_d)


class StateGraphBatch:
    """Persistent state metadata of uniform decode batches padded to CUDA-graph capture sizes
    (the state layers' counterpart of :class:`attn_ops.cudagraph.CUDAGraphBatch`, whose
    ``query_start_loc`` buffer it shares): padding requests get the null slot and no initial
    state, so a replay reads and writes no request's state but the real ones'. :meth:`pad`
    returns, per capture size, views of the same buffers (what a captured graph reads). Its
    chunk fields take each request's tokens as one chunk (the decode kernels read none)."""

    def __init__(self, graphs, chunk_size: int) -> None:
        largest = graphs.capture_sizes[-1]
        self.graphs, self.chunk_size = graphs, chunk_size
        i32 = dict(dtype=torch.int32, device=graphs.device)
        self.state_indices = torch.zeros(largest, **i32)
        self.has_initial_state = torch.zeros(largest, dtype=torch.bool, device=graphs.device)
        self.chunk_requests = torch.arange(largest * graphs.query_len, **i32) // graphs.query_len
        self.last_chunks = torch.arange(largest, **i32)
        self._rows = 0

    def pad(self, meta: StateMetadata) -> StateMetadata:
        """``meta`` (the step's, unpadded) written into the buffers, padded to its capture
        size; the graphs' ``query_start_loc`` must already hold the padded step
        (``CUDAGraphBatch.pad``, which :class:`~attn_ops.cudagraph.CUDAGraphRunner` runs)."""
        n, q = meta.num_reqs, self.graphs.query_len
        if meta.state_indices.dim() != 1:
            raise ValueError("CUDA-graph state batches take one slot a request; speculative "
                             "decodes (a slot per position) run eagerly")
        if meta.max_query_len != q or meta.query_start_loc_cpu[-1] != n * q:
            raise ValueError(f"CUDA-graph batches have {q} query token(s) per request; this "
                             f"step has max_query_len={meta.max_query_len} -- run it eagerly")
        size = self.graphs.size_for(n)
        self.state_indices[:n].copy_(meta.state_indices, non_blocking=True)
        self.has_initial_state[:n].copy_(meta.has_initial_state, non_blocking=True)
        if self._rows > n:
            self.state_indices[n:self._rows].zero_()
            self.has_initial_state[n:self._rows].zero_()
        self._rows = n
        qsl_cpu = torch.from_numpy(np.minimum(np.arange(size + 1, dtype=np.int32) * q, n * q))
        ctx = np.zeros(size, dtype=np.int64)
        ctx[:n] = meta.context_lens_cpu.numpy()
        return StateMetadata(
            query_start_loc=self.graphs.query_start_loc[:size + 1],
            state_indices=self.state_indices[:size],
            has_initial_state=self.has_initial_state[:size],
            query_start_loc_cpu=qsl_cpu, context_lens_cpu=torch.from_numpy(ctx),
            num_decodes=size, max_query_len=q, chunk_size=self.chunk_size,
            chunk_starts=self.graphs.query_start_loc[:size + 1],
            chunk_requests=self.chunk_requests[:size * q], last_chunks=self.last_chunks[:size])
