"""CUDA-graph batches: the step's metadata padded to a capture size, in persistent buffers.

A captured graph replays kernels with the device addresses and host scalars they had at capture.
So every tensor an attention op reads must live at a fixed address, rewritten in place before
each replay, and every host value it was captured with must stay valid. :class:`CUDAGraphBatch`
owns those buffers for a set of capture sizes (numbers of requests, every request with the same
query length: 1 for decode): :meth:`CUDAGraphBatch.pad` copies a batch of ``n`` requests into
them, padded with empty requests to the smallest capture size ``S >= n``, and returns it as an
ordinary :class:`~attn_ops.metadata.CommonAttentionMetadata` whose device tensors are views of
the buffers. Backends then build their own metadata from it with
:meth:`~attn_ops.backend.AttentionBackend.graph_metadata` (host planning included, into buffers
of their own kept in :attr:`CUDAGraphBatch.backend_state`);
:func:`attn_ops.layers.attention.build_step_metadata` does both for a model.

Padding: requests ``n..S-1`` have no query tokens, no cached tokens and an all-zero block-table
row; tokens past the real ones have slot ``-1`` (the cache write skips them). Stale tails from
a previous, longer batch are overwritten, never left behind.

Example (one size)::

    graphs = CUDAGraphBatch(capture_sizes=(1, 8, 64), max_blocks_per_req=256, block_size=16,
                            device="cuda")
    padded = graphs.pad(common)                 # before capture, and before every replay
    meta = impl.graph_metadata(padded, graphs)
    ...capture impl.forward(q[:S], cache, meta, out[:S]) once per size, then replay
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from attn_ops.capabilities import CUDAGraphSupport
from attn_ops.metadata import CommonAttentionMetadata

__all__ = ["CUDAGraphBatch", "CUDAGraphRunner", "partition_ops", "resolve_cudagraph_support"]


class CUDAGraphBatch:
    """Persistent common metadata for batches of uniform query length padded to capture sizes.

    ``capture_sizes``: batch sizes (requests) a graph is captured for; ``max_blocks_per_req``:
    the block-table width every padded batch gets (the longest request it can hold, in pages);
    ``uniform_query_len``: query tokens per request (1: single-token decode).
    """

    def __init__(self, capture_sizes: Sequence[int], max_blocks_per_req: int, block_size: int,
                 device: torch.device | str = "cuda", *, uniform_query_len: int = 1) -> None:
        sizes = sorted(set(int(s) for s in capture_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"capture_sizes={list(capture_sizes)} must be positive batch sizes")
        if max_blocks_per_req < 1 or block_size < 1 or uniform_query_len < 1:
            raise ValueError(f"max_blocks_per_req={max_blocks_per_req}, block_size={block_size} "
                             f"and uniform_query_len={uniform_query_len} must be >= 1")
        self.capture_sizes = tuple(sizes)
        self.max_blocks_per_req = max_blocks_per_req
        self.block_size = block_size
        self.query_len = uniform_query_len
        self.device = torch.device(device)
        largest = sizes[-1]
        i32 = dict(dtype=torch.int32, device=self.device)
        self._starts = torch.arange(largest + 1, **i32) * uniform_query_len  # constant
        self.query_start_loc = torch.zeros(largest + 1, **i32)
        self.seq_lens = torch.zeros(largest, **i32)
        self.block_table = torch.zeros(largest, max_blocks_per_req, **i32)
        self.slot_mapping = torch.full((largest * uniform_query_len,), -1, dtype=torch.int64,
                                       device=self.device)
        # Backends' own persistent state (buffers, per-size plans), by metadata key.
        self.backend_state: dict = {}
        # What the buffers hold: rows from _rows on are clean (zero, slots -1), no row has a
        # block past column _cols, and query_start_loc is set for (requests, size) _starts_for
        # -- so a step writes only what changed (each device call costs host time).
        self._rows, self._cols, self._starts_for = 0, 0, None
        self._table_host = None  # (pad_arrays: the block table its buffer holds, rows [:n])
        self._last: CommonAttentionMetadata | None = None  # (the batch the buffers hold)

    @property
    def required_support(self) -> CUDAGraphSupport:
        """The support level a backend needs to be captured with these batches."""
        return (CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE if self.query_len == 1
                else CUDAGraphSupport.UNIFORM_BATCH)

    def size_for(self, num_reqs: int) -> int:
        """The smallest capture size holding ``num_reqs`` requests."""
        i = bisect.bisect_left(self.capture_sizes, num_reqs)
        if i == len(self.capture_sizes):
            raise ValueError(f"a batch of {num_reqs} requests is larger than the largest capture "
                             f"size {self.capture_sizes[-1]}; run it eagerly or capture a "
                             f"size >= {num_reqs}")
        return self.capture_sizes[i]

    def _size_and_starts(self, n: int, width: int) -> int:
        """The capture size of a batch of ``n`` requests and ``width`` table columns (refused
        past the buffers), its query offsets set in the buffer where they differ."""
        if width > self.max_blocks_per_req:
            raise ValueError(f"the batch's block table is {width} blocks wide, more than "
                             f"max_blocks_per_req={self.max_blocks_per_req}; raise it")
        size = self.size_for(n)
        if self._starts_for != (n, size):
            q = self.query_len
            torch.clamp_max(self._starts[:size + 1], n * q, out=self.query_start_loc[:size + 1])
            self._starts_for = (n, size)
        return size

    def pad(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """``common`` copied into the persistent buffers, padded to its capture size."""
        n, q = common.num_reqs, self.query_len
        if n == 0:
            raise ValueError("an empty batch has nothing to replay")
        if common.num_actual_tokens != n * q or common.max_query_len != q:
            raise ValueError(
                f"CUDA-graph batches have {q} query token(s) per request; this batch has "
                f"query_lens={common.query_lens_cpu.tolist()} -- run it eagerly")
        if common.block_size != self.block_size:
            raise ValueError(f"block_size={common.block_size} differs from the graphs' "
                             f"block_size={self.block_size}")
        width = common.block_table.shape[1]
        # Device side: copies and fills in place (no host sync, no new allocations), and only
        # where the buffers differ from what this batch needs: each call costs host time.
        size = self._size_and_starts(n, width)
        self.seq_lens[:n].copy_(common.seq_lens, non_blocking=True)
        self.block_table[:n, :width].copy_(common.block_table, non_blocking=True)
        if width < self._cols:
            self.block_table[:n, width:self._cols].zero_()
        self.slot_mapping[:n * q].copy_(common.slot_mapping[:n * q], non_blocking=True)
        if self._rows > n:
            self.seq_lens[n:self._rows].zero_()
            self.block_table[n:self._rows].zero_()
            self.slot_mapping[n * q:self._rows * q].fill_(-1)
        self._rows, self._cols, self._table_host = n, width, None
        decodes = common.num_decodes == n
        return self._padded(n, size, common.query_start_loc_cpu, common.seq_lens_cpu,
                            common.block_table_cpu, common.block_indptr_cpu,
                            max_seq_len=common.max_seq_len,
                            num_decodes=size if decodes else 0,
                            num_decode_tokens=n * q if decodes else 0, causal=common.causal,
                            num_blocks=common.num_blocks,
                            block_indices_cpu=common.block_indices_cpu)

    def _padded(self, n: int, size: int, qsl_cpu, seq_cpu, table_cpu, indptr_cpu,
                **fields) -> CommonAttentionMetadata:
        """The batch of ``n`` requests padded to ``size``: the buffers' views, and its host
        arrays padded with empty requests (numpy: a third of torch's cost per small op) --
        the batch's own where they already hold ``size`` rows; ``qsl_cpu`` None: made."""
        q = self.query_len
        if qsl_cpu is None or qsl_cpu.shape[0] < size + 1:
            qsl_cpu = torch.from_numpy(np.minimum(np.arange(size + 1, dtype=np.int32) * q,
                                                  n * q))
        if seq_cpu.shape[0] < size:
            seq_np = np.zeros(size, dtype=np.int32)
            seq_np[:n] = seq_cpu.numpy()
            seq_cpu = torch.from_numpy(seq_np)
        if table_cpu is not None and table_cpu.shape[0] < size:
            table_np = np.zeros((size, table_cpu.shape[1]), dtype=np.int32)
            table_np[:n] = table_cpu.numpy()
            table_cpu = torch.from_numpy(table_np)
        if indptr_cpu is not None and indptr_cpu.shape[0] < size + 1:  # (no pages: padding)
            indptr = np.empty(size + 1, dtype=np.int32)
            indptr[:n + 1] = indptr_cpu.numpy()
            indptr[n + 1:] = indptr[n]
            indptr_cpu = torch.from_numpy(indptr)
        self._last = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1],
            query_start_loc_cpu=qsl_cpu,
            seq_lens=self.seq_lens[:size],
            seq_lens_cpu=seq_cpu,
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size * q],
            num_actual_tokens=n * q,
            max_query_len=q,
            block_size=self.block_size,
            block_table_cpu=table_cpu,
            block_indptr_cpu=indptr_cpu,
            **fields,
        )
        return self._last

    def pad_arrays(self, seq_lens: np.ndarray, block_table: np.ndarray, slots: np.ndarray,
                   num_blocks: int | None = None) -> CommonAttentionMetadata:
        """:meth:`pad` of a batch given as host arrays -- ``seq_lens [n]``, ``block_table [n,
        width]`` (int32; each row's pages in order, zeros after) and ``slots [n * query_len]``
        (int64) -- from a caller that keeps its own pages and trusts them (no checks of the
        block ids): no metadata built and uploaded first to be copied on, but two uploads into
        the buffers (lengths and slots), and the block table's only where it changed since
        the last call (a decode enters a new page every ``block_size`` steps)."""
        from attn_ops.metadata import upload

        n, q = seq_lens.shape[0], self.query_len
        width = block_table.shape[1]
        if n == 0 or slots.shape[0] != n * q or block_table.shape[0] != n:
            raise ValueError(f"pad_arrays: {n} lengths, {block_table.shape[0]} block-table rows "
                             f"and {slots.shape[0]} slots for {q} query token(s) a request")
        size = self._size_and_starts(n, width)
        seq_np = np.zeros(size, dtype=np.int32)
        seq_np[:n] = seq_lens
        upload(seq_np, self.seq_lens[:size])
        slots_np = np.full(size * q, -1, dtype=np.int64)
        slots_np[:n * q] = slots
        upload(slots_np, self.slot_mapping[:size * q])
        table = np.array(block_table, dtype=np.int32)  # (a copy: kept to compare with)
        last = self._table_host
        if last is None or last.shape != table.shape or not np.array_equal(last, table):
            upload(table, self.block_table[:n, :width])
            if width < self._cols:
                self.block_table[:n, width:self._cols].zero_()
            self._table_host = table
        if self._rows > size:
            self.seq_lens[size:self._rows].zero_()
            self.slot_mapping[size * q:self._rows * q].fill_(-1)
        if self._rows > n:
            self.block_table[n:self._rows].zero_()
        self._rows, self._cols = n, width
        # (the caller's table on the host side, as pad passes its batch's: the kept copy is
        # only compared with)
        return self._padded(n, size, None, torch.from_numpy(seq_np),
                            torch.from_numpy(np.asarray(block_table, dtype=np.int32)), None,
                            max_seq_len=int(seq_lens.max()),
                            num_decodes=size if q == 1 else 0,
                            num_decode_tokens=n * q if q == 1 else 0, num_blocks=num_blocks)

    def advance(self, padded: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """``padded`` -- the batch of single-token decodes the buffers hold (the last
        :meth:`pad`, :meth:`pad_arrays` or ``advance``) -- one step later: each request one
        token longer, its new token in the page of its last one, so each slot is the last
        one's plus one and the block table stays. Two in-place adds on the device (no host
        arrays made, nothing uploaded); the host lengths and ``max_seq_len`` one more. A new
        token that would enter a page is refused: that step needs :meth:`pad_arrays`."""
        if padded is not self._last or self.query_len != 1:
            raise ValueError("advance: the batch is not the one the graph buffers hold, or the "
                             "graphs take more than one query token a request; use pad_arrays")
        n = padded.num_actual_tokens
        seq = padded.seq_lens_cpu.numpy().copy()
        if (seq[:n] % self.block_size == 0).any():
            raise ValueError("advance: a request's next token enters a new page (its slot is "
                             "not the last one's plus one); use pad_arrays")
        seq[:n] += 1
        self.seq_lens[:n].add_(1)
        self.slot_mapping[:n].add_(1)
        self._last = dataclasses.replace(padded, seq_lens_cpu=torch.from_numpy(seq),
                                         max_seq_len=padded.max_seq_len + 1)
        return self._last

    @property
    def max_seq_len(self) -> int:
        """The longest request a padded batch can hold."""
        return self.max_blocks_per_req * self.block_size


def resolve_cudagraph_support(model: torch.nn.Module,
                              wanted: CUDAGraphSupport = CUDAGraphSupport.ALWAYS
                              ) -> CUDAGraphSupport:
    """The CUDA-graph level a model can run at: ``wanted``, lowered to the least any of its
    :class:`~attn_ops.layers.attention.Attention` / :class:`~attn_ops.layers.mla.MLAAttention`
    layers' backends supports (for that layer's spec on its platform). When that lowers it,
    one log line names the level, the first layer that lowered it and its backend -- a model is
    never captured at a level one of its layers cannot replay correctly."""
    import logging

    from attn_ops.layers.attention import BackendLayer

    level, culprit = wanted, None
    for name, layer in model.named_modules():
        if isinstance(layer, BackendLayer):
            if layer.cudagraph_support < level:
                level, culprit = layer.cudagraph_support, (name or "(model)", layer.backend)
    if culprit is not None:
        logging.getLogger("attn_ops").warning(
            "CUDA graphs: %s requested, running at %s -- layer %s uses %s, which supports no "
            "more", wanted.name, level.name, *culprit)
    return level


def partition_ops(model: torch.nn.Module,
                  needed: CUDAGraphSupport = CUDAGraphSupport.ALWAYS) -> list[str]:
    """The attention ops of ``model`` that cannot be replayed from a CUDA graph for batches
    needing ``needed`` (``ALWAYS``: any mixed batch) -- the ops Inductor's graph partitioning
    must leave out of its graphs, so the rest of the model is still graphed (piecewise)::

        torch._inductor.config.custom_should_partition_ops = partition_ops(model)
        compiled = torch.compile(model, mode="reduce-overhead")

    Ops of backends that support no capture at all (REFERENCE reads lengths on the host,
    FLEX_ATTENTION) also carry ``torch.Tag.cudagraph_unsafe``, which Inductor honours
    without this list."""
    from attn_ops.layers.attention import Attention

    names: list[str] = []
    for layer in model.modules():
        if isinstance(layer, Attention):
            if layer.cudagraph_support < needed:
                for op in layer.impl.ops():
                    name = op._schema.name
                    if name not in names:
                        names.append(name)
    return names


class CUDAGraphRunner:
    """A model's step captured in a CUDA graph per capture size, then replayed (full graphs).

    ``forward(input_ids, positions, kv_caches, step)`` is the model or a compiled version of it
    (:class:`attn_ops.models.llama.TinyLlama`'s signature). Each call writes the step's metadata
    into ``graphs``' persistent buffers (:func:`attn_ops.build_step_metadata` with ``graphs``: host
    planning included) and the token ids and positions into static buffers; the first batch
    of a size is run twice on a side stream (compiling, warming up) and captured, later ones
    only replay. Returns the output rows of the real tokens (a view into the graph's output:
    copy it before the next call). The model's layers must all support the level the batches
    need (``graphs.required_support``): checked up front, with the layer that does not.

    Example::

        graphs = CUDAGraphBatch((1, 8, 32, 64), max_blocks_per_req=64, block_size=128)
        runner = CUDAGraphRunner(model, torch.compile(model, fullgraph=True), graphs, caches)
        logits = runner(input_ids, common)      # every decode step
    """

    def __init__(self, model: torch.nn.Module, forward, graphs: CUDAGraphBatch,
                 kv_caches: list[torch.Tensor]) -> None:
        level = resolve_cudagraph_support(model, graphs.required_support)
        if level < graphs.required_support:
            raise ValueError(f"the model's attention supports CUDA graphs at level {level.name}, "
                             f"below {graphs.required_support.name} that these batches need "
                             "(the log names the layer); capture piecewise instead "
                             "(attn_ops.cudagraph.partition_ops) or run it eagerly")
        from attn_ops.layers.attention import step_backends

        self.model, self.forward, self.graphs, self.kv_caches = model, forward, graphs, kv_caches
        self.backends = step_backends(model)
        rows = graphs.capture_sizes[-1] * graphs.query_len
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=graphs.device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=graphs.device)
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def __call__(self, input_ids: torch.Tensor, common: CommonAttentionMetadata) -> torch.Tensor:
        from attn_ops.layers.attention import build_step_metadata

        n = common.num_actual_tokens
        rows = self.graphs.size_for(common.num_reqs) * self.graphs.query_len
        step = build_step_metadata(self.backends, common, self.graphs)
        self.input_ids[:n].copy_(input_ids[:n], non_blocking=True)
        self.input_ids[n:rows].zero_()
        self.positions[:n].copy_(common.positions[:n], non_blocking=True)
        self.positions[n:rows].zero_()
        if rows not in self.captured:
            self.captured[rows] = self._capture(rows, step)
        graph, out = self.captured[rows]
        graph.replay()
        return out[:n]

    def forward_args(self, rows: int, step: dict) -> tuple:
        """The arguments ``forward`` is captured with for ``rows`` token rows (a model with
        other inputs overrides this)."""
        return (self.input_ids[:rows], self.positions[:rows], self.kv_caches, step)

    def _capture(self, rows: int, step: dict):
        args = self.forward_args(rows, step)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.forward(*args)
        self.pool = graph.pool()
        return graph, out
