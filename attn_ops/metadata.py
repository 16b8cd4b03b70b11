"""Batch metadata shared by all layers of one step.

A batch is a list of requests, decodes first (query length <= ``decode_threshold``), then
prefills and chunked prefills. Request ``i`` has ``seq_lens[i]`` tokens in the cache after this
step, of which the last ``query_lens[i]`` are new: its queries sit at positions
``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``.

Everything that needs tensor *values* (range checks, the decode/prefill split) is done here, on
host data, when the batch is built -- never inside the per-layer ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from attn_ops.kv_cache import BlockAllocator

__all__ = [
    "CommonAttentionMetadata", "DeviceTables", "block_csr", "build_common_metadata",
    "build_batch", "decode_first_order", "host_slots", "split_decodes_and_prefills", "upload",
]


@dataclass(frozen=True, eq=False)  # identity semantics: one object per step
class CommonAttentionMetadata:
    """One step's batch, as every backend receives it.

    Tensors (B requests, T tokens including padding):

    * ``query_start_loc`` ``[B+1]`` int32 on the device, ``query_start_loc_cpu`` its host copy;
    * ``seq_lens`` ``[B]`` int32 (context + new tokens), ``seq_lens_cpu`` its host copy;
    * ``block_table`` ``[B, max_blocks]`` int32, unused entries 0 (``block_table_cpu`` its host
      copy, which backends that plan on the host read);
    * ``slot_mapping`` ``[T]`` int64, -1 for padding tokens;
    * ``block_indptr_cpu`` ``[B+1]`` / ``block_indices_cpu`` (int32, host): the pages each
      request's length uses, in CSR form -- the blocks of request ``i`` are
      ``block_indices_cpu[block_indptr_cpu[i]:block_indptr_cpu[i+1]]`` (FlashInfer's
      ``kv_indptr`` / ``kv_indices``). :meth:`block_csr` computes them where not given;
    * ``device_tables``: those on the device, with each request's ``last_page_len`` and the
      prefill part's offsets, in the buffer the device tensors above are views of
      (:class:`DeviceTables`; :func:`build_common_metadata` uploads the step in one copy).
      Derived from the batch: metadata changed with ``dataclasses.replace`` must drop it
      (``device_tables=None``; backends then upload it from the host arrays).

    Host ints: ``block_size`` (tokens per cache page), ``num_actual_tokens``
    (``query_start_loc[-1]``), ``max_query_len``, ``max_seq_len``, ``num_decodes`` /
    ``num_decode_tokens`` (the decode prefix), ``num_blocks`` (pages in the cache, when known:
    backends that prepare per-page tables once per step need it).
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int
    block_size: int
    causal: bool = True
    block_table_cpu: torch.Tensor | None = None
    num_blocks: int | None = None
    block_indptr_cpu: torch.Tensor | None = None
    block_indices_cpu: torch.Tensor | None = None
    device_tables: DeviceTables | None = None

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    def block_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """``(indptr, indices)``, int32 numpy: see ``block_indptr_cpu``. Kept by
        :func:`build_common_metadata`, which has them from checking the block ids."""
        if self.block_indptr_cpu is not None:
            return self.block_indptr_cpu.numpy(), self.block_indices_cpu.numpy()
        if self.block_table_cpu is None:
            raise ValueError("the block CSR is computed on the host: build the metadata with "
                             "attn_ops.build_common_metadata (it keeps block_table_cpu)")
        return block_csr(self.seq_lens_cpu.numpy(), self.block_table_cpu.numpy(),
                         self.block_size)

    # (set by build_common_metadata, which computes the positions anyway; else computed)
    positions_tensor: torch.Tensor | None = field(default=None, repr=False)

    @property
    def positions(self) -> torch.Tensor:
        """``[T]`` int64 position of every token in its request (padding: 0), on the device."""
        if self.positions_tensor is not None:
            return self.positions_tensor
        qsl, seq = self.query_start_loc_cpu.numpy(), self.seq_lens_cpu.numpy()
        pos = np.zeros(self.slot_mapping.shape[0], dtype=np.int64)
        pos[:qsl[-1]] = _token_positions(qsl.astype(np.int64), seq.astype(np.int64))[0]
        return torch.from_numpy(pos).to(self.slot_mapping.device)


def _token_positions(qsl: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The position of every (unpadded) token in its request, and the request, from int64
    query start offsets and sequence lengths."""
    n = seq.shape[0]
    q = qsl[1:] - qsl[:-1]
    if qsl[-1] == n and (q == 1).all():  # one token per request (decodes)
        return seq - 1, np.arange(n)
    req = np.repeat(np.arange(n), q)  # request of every token
    return np.arange(int(qsl[-1])) - qsl[req] + (seq - q)[req], req


def host_slots(block_table: np.ndarray, req: np.ndarray, pos: np.ndarray,
               block_size: int) -> np.ndarray:
    """The cache slot (int64) of each token at position ``pos`` of request ``req`` through the
    dense host ``block_table``: ``table[req, pos // block_size] * block_size + pos %
    block_size``."""
    return block_table[req, pos // block_size].astype(np.int64) * block_size + pos % block_size


def block_csr(seq_lens: np.ndarray, block_table: np.ndarray,
              block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The pages each request's length uses, in CSR form, from ``seq_lens [B]`` and a dense
    ``block_table [B, max_blocks]``: ``indptr [B+1]`` and ``indices`` (request order), int32.
    A view of the table when every request uses all of its row."""
    pages = (seq_lens + (block_size - 1)) // block_size
    indptr = np.zeros(seq_lens.shape[0] + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    if pages.size and pages.min() == block_table.shape[1]:
        indices = block_table.reshape(-1)
    else:  # (row-major: request order)
        indices = block_table[np.arange(block_table.shape[1]) < pages[:, None]]
    return indptr, indices.astype(np.int32, copy=False)


ALIGN = 4  # int32 entries: every array of a packed buffer starts 16-byte aligned


def pack_upload(int64: Sequence[np.ndarray], int32: Sequence[np.ndarray],
                device: torch.device | str) -> tuple[torch.Tensor, list[int]]:
    """Host arrays in one int32 buffer on ``device`` -- the int64 ones first, each array from a
    16-byte aligned offset -- and the offsets (int32 entries), in argument order.

    One pinned staging block (PyTorch's caching host allocator, which hands a block out again
    only after the copies from it ran) and one copy without blocking: a copy from pageable
    memory first waits for the stream to drain, which kept the host from preparing a step while
    the GPU ran the last one, and each copy of its own costs the host tens of microseconds.
    Offsets are never 1 (the first array sits at 0; Dynamo would specialize views at
    offset 0 or 1, as it does sizes), and FA4's kernels may assume 16-byte aligned tables."""
    offsets, at = [], 0
    for a, entries in [(a, 2) for a in int64] + [(a, 1) for a in int32]:
        offsets.append(at)
        at += -(-a.size * entries // ALIGN) * ALIGN
    on_gpu = (device if isinstance(device, torch.device) else torch.device(device)).type != "cpu"
    if on_gpu:
        staged = torch.empty(at, dtype=torch.int32, pin_memory=True)
        host = staged.numpy()
    else:
        host = np.empty(at, dtype=np.int32)
        staged = torch.from_numpy(host)
    for a, o in zip(int64, offsets):
        host[o:o + 2 * a.size].view(np.int64)[:] = a.reshape(-1)
    for a, o in zip(int32, offsets[len(int64):]):
        host[o:o + a.size] = a.reshape(-1)
    return (staged.to(device, non_blocking=True) if on_gpu else staged), offsets


class DeviceTables(NamedTuple):  # (a NamedTuple: made every step, 5x cheaper than a dataclass)
    """A step's int32 tables for paged kernels, in one device ``buffer`` (one upload with the
    rest of the common metadata): the offsets of ``query_start_loc [B+1]``, ``block_indptr
    [B+1]``, ``last_page_len [B]`` and ``block_indices`` (see :class:`CommonAttentionMetadata`),
    and of the prefill part's ``query_start_loc`` and ``block_indptr`` counted from its first
    request (``[P+1]``; the batch's own when it has no decodes) -- what a backend that runs
    decodes and prefills as two launches needs (FlashInfer, FA4). Kernels take ``buffer`` and
    the offsets, not views: Dynamo would guard on each view's storage offset."""

    buffer: torch.Tensor
    query_start_loc: int
    block_indptr: int
    last_page_len: int
    block_indices: int
    prefill_query_start_loc: int
    prefill_block_indptr: int


def last_page_len(seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Tokens in each request's last page, 1..block_size (0 for an empty request), int32."""
    return np.minimum(seq_lens, (seq_lens - 1) % block_size + 1).astype(np.int32, copy=False)


def prefill_offsets(qsl: np.ndarray, indptr: np.ndarray,
                    num_decodes: int) -> list[np.ndarray]:
    """The prefill part's query and page offsets counted from its first request (empty when
    the batch has no decodes or no prefills: :class:`DeviceTables` then points at the
    batch's own)."""
    if 0 < num_decodes < qsl.shape[0] - 1:
        return [qsl[num_decodes:] - qsl[num_decodes], indptr[num_decodes:] - indptr[num_decodes]]
    return []


def _device_tables(buffer: torch.Tensor, offsets: Sequence[int]) -> DeviceTables:
    """``DeviceTables`` from the offsets of qsl, indptr, last_page_len, indices and, when
    given, the prefill part's qsl and indptr."""
    qsl, indptr, last, indices, *prefill = offsets
    return DeviceTables(buffer, qsl, indptr, last, indices, *(prefill or (qsl, indptr)))


def upload_tables(common: CommonAttentionMetadata) -> DeviceTables:
    """``common``'s :class:`DeviceTables`, on the device of its tensors: the ones it was built
    with, or (for metadata made by hand, or moved to another device) uploaded from its host
    arrays."""
    tables, device = common.device_tables, common.seq_lens.device
    if tables is not None and tables.buffer.device == device:
        return tables
    qsl, seq = common.query_start_loc_cpu.numpy(), common.seq_lens_cpu.numpy()
    indptr, indices = common.block_csr()
    int32 = [qsl, indptr, last_page_len(seq, common.block_size), indices,
             *prefill_offsets(qsl, indptr, common.num_decodes)]
    buffer, offsets = pack_upload((), int32, device)
    return _device_tables(buffer, offsets)


def upload(array: np.ndarray, into: torch.Tensor) -> None:
    """A host array into the persistent device tensor (or view) ``into`` of its shape: one
    pinned staging block and one copy without blocking, as in :func:`pack_upload`. (The
    caching host allocator records the copy and reuses the block only after it ran, at half
    the host time of a ring of pinned buffers guarded by CUDA events recorded from Python.)"""
    staged = torch.empty(array.shape, dtype=into.dtype, pin_memory=into.device.type != "cpu")
    staged.numpy()[...] = array
    into.copy_(staged, non_blocking=True)


def upload_int32(arrays: Sequence[np.ndarray], into: torch.Tensor) -> None:
    """1-D int32 host arrays, concatenated, into the front of the persistent device tensor
    ``into`` (:func:`upload`)."""
    upload(np.concatenate(arrays), into[:sum(a.shape[0] for a in arrays)])


def sizes_not_specialized(*tensors: torch.Tensor) -> None:
    """Tells ``torch.compile`` not to specialize on the leading size of these step-metadata
    tensors -- ones only a backend's op reads (plans, page tables). Their sizes follow the
    batch composition, and Dynamo specializes sizes 0 and 1 even when it treats a size as
    dynamic: a part with no requests or one request would each cost a recompile, and a mix of
    such parts soon exceeds the recompile limit. Marked unbacked, they get one graph. (Only the
    leading size: an unbacked inner size is a stride, which Inductor's CUDA-graph trees must
    compare with 0. The mark is read when Dynamo compiles, which can be any step, so every
    step marks; about 1 us per tensor.)"""
    from torch._dynamo.decorators import mark_unbacked

    for t in tensors:
        mark_unbacked(t, 0)


def decode_first_order(query_lens: Sequence[int], decode_threshold: int = 1) -> list[int]:
    """A stable permutation putting requests with ``query_len <= decode_threshold`` first."""
    decodes = [i for i, q in enumerate(query_lens) if q <= decode_threshold]
    return decodes + [i for i, q in enumerate(query_lens) if q > decode_threshold]


def split_decodes_and_prefills(query_lens: Sequence[int],
                               decode_threshold: int = 1) -> tuple[int, int]:
    """``(num_decodes, num_decode_tokens)`` of a decode-first batch, from host lengths."""
    num_decodes = 0
    for q in query_lens:
        if q > decode_threshold:
            break
        num_decodes += 1
    return num_decodes, sum(query_lens[:num_decodes])


def build_common_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]] | np.ndarray,
    block_size: int,
    num_blocks: int,
    *,
    device: torch.device | str = "cpu",
    num_tokens_padded: int | None = None,
    max_blocks_per_req: int | None = None,
    causal: bool = True,
    decode_threshold: int = 1,
    window: int | None = None,
) -> CommonAttentionMetadata:
    """Check a batch on the host and build its metadata.

    ``block_tables[i]`` lists the cache blocks of request ``i`` in order -- or, as a 2-D int
    array (:meth:`BlockAllocator.block_table`), begins with them (entries past the pages a
    request's length needs are ignored). Raises ``ValueError`` naming the request and value when
    a length, block id or ordering is wrong.

    ``window``: the step's layers read only the last ``window`` positions of each query (a
    sliding window, the current token included), so a page wholly before ``seq_len -
    query_len - window + 1`` may have been released behind it
    (:meth:`~attn_ops.kv_cache.BlockAllocator.release_before`): -1 there is accepted, and
    passed on as it is (only backends that read the window alone take such tables).
    """
    n = len(query_lens)
    if len(seq_lens) != n or len(block_tables) != n:
        raise ValueError(f"query_lens, seq_lens and block_tables must have one entry per request; "
                         f"got {n}, {len(seq_lens)} and {len(block_tables)}")
    # Vectorized over requests and tokens (numpy): 256 requests take ~1 ms, not ~40.
    q_np = np.asarray(query_lens, dtype=np.int64).reshape(n)
    s_np = np.asarray(seq_lens, dtype=np.int64).reshape(n)

    def first(bad: np.ndarray) -> int | None:
        return int(bad.argmax()) if bad.any() else None

    dense = isinstance(block_tables, np.ndarray)
    if dense:
        if block_tables.ndim != 2:
            raise ValueError(f"block_tables as an array must be 2-D [requests, blocks]; got "
                             f"shape {block_tables.shape}")
        owned = -(-s_np // block_size)  # the pages each length needs, from the row's start
        if (i := first(owned > block_tables.shape[1])) is not None:
            raise ValueError(f"request {i} has seq_len={s_np[i]}, {owned[i]} blocks of "
                             f"{block_size} tokens, but block_tables has only "
                             f"{block_tables.shape[1]} columns")
    else:
        owned = np.fromiter((len(b) for b in block_tables), dtype=np.int64, count=n)

    if (i := first(q_np < 0)) is not None:
        raise ValueError(f"query_lens[{i}]={q_np[i]} must be >= 0")
    if (i := first(s_np < q_np)) is not None:
        raise ValueError(f"seq_lens[{i}]={s_np[i]} is shorter than query_lens[{i}]={q_np[i]}; "
                         "seq_lens counts the cached context plus the new tokens")
    if (i := first(owned * block_size < s_np)) is not None:
        raise ValueError(f"request {i} has seq_len={s_np[i]} but only {owned[i]} blocks of "
                         f"{block_size} tokens; reserve ceil({s_np[i]}/{block_size}) blocks")
    decode = q_np <= decode_threshold
    num_decodes = n if decode.all() else int(decode.argmin())
    if decode[num_decodes:].any():
        raise ValueError(f"batch is not decode-first: query_lens={list(query_lens)}; reorder the "
                         "requests with attn_ops.decode_first_order(query_lens)")
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_np, out=qsl[1:])
    num_tokens, num_decode_tokens = int(qsl[-1]), int(qsl[num_decodes])
    padded = num_tokens if num_tokens_padded is None else num_tokens_padded
    if padded < num_tokens:
        raise ValueError(f"num_tokens_padded={padded} is smaller than the {num_tokens} tokens")
    width = max(int(owned.max(initial=0)), 1)
    if max_blocks_per_req is not None:
        if max_blocks_per_req < width:
            raise ValueError(f"max_blocks_per_req={max_blocks_per_req} < {width} blocks needed")
        width = max_blocks_per_req

    table_np = np.zeros((n, width), dtype=np.int32)
    used = np.arange(width) < owned[:, None]
    if dense:
        cols = min(width, block_tables.shape[1])
        table_np[:, :cols] = block_tables[:, :cols]
        table_np[~used] = 0
        flat = table_np[used]
    else:
        flat = np.fromiter((b for blocks in block_tables for b in blocks), dtype=np.int64,
                           count=int(owned.sum()))
    released = np.zeros_like(flat, dtype=bool)
    if window is not None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        behind = np.maximum(s_np - q_np - window + 1, 0) // block_size  # (pages no query reads)
        cols = np.arange(table_np.shape[1] if dense else int(owned.max(initial=0)))
        if dense:
            released = (table_np == -1)[used] & (cols[None, :] < behind[:, None])[used]
        else:
            col = np.concatenate([cols[:k] for k in owned]) if n else cols[:0]
            req = np.repeat(np.arange(n), owned)
            released = (flat == -1) & (col < behind[req])
    bad = ((flat < 0) & ~released) | (flat >= num_blocks)
    if bad.any():
        k = first(bad)
        i = int(np.searchsorted(np.cumsum(owned), k, side="right"))
        raise ValueError(f"block_tables[{i}] holds block {flat[k]}, outside the cache's "
                         f"[0, {num_blocks}) blocks" + (
                             " (-1, a released page, only before position seq_len - query_len "
                             "- window + 1, which no query of the step reads)"
                             if flat[k] == -1 and window is not None else ""))
    if not dense:
        table_np[used] = flat
    # (block lists may reserve more blocks than the lengths use; a dense table's owned counts
    # are the lengths' pages already)
    need = owned if dense else -(-s_np // block_size)
    if dense or np.array_equal(owned, need):
        indptr = np.zeros(n + 1, dtype=np.int32)
        indptr[1:] = np.cumsum(need)
        indices = flat.astype(np.int32, copy=False)
    else:
        indptr, indices = block_csr(s_np, table_np, block_size)
    positions = np.zeros(padded, dtype=np.int64)
    pos, req = _token_positions(qsl, s_np)  # (position and request of every token)
    positions[:num_tokens] = pos
    slots = np.full(padded, -1, dtype=np.int64)
    slots[:num_tokens] = host_slots(table_np, req, pos, block_size)
    qsl32, seq32 = qsl.astype(np.int32), s_np.astype(np.int32)
    # One upload: the int64 slots and positions, then the int32 tables (offsets in `at`).
    buffer, at = pack_upload((slots, positions), (
        qsl32, seq32, table_np, indptr, last_page_len(seq32, block_size), indices,
        *prefill_offsets(qsl32, indptr, num_decodes)), device)
    slots_dev = buffer[:2 * padded].view(torch.int64)
    positions_dev = buffer[at[1]:at[1] + 2 * padded].view(torch.int64)
    qsl_dev, seq_dev = buffer[at[2]:at[2] + n + 1], buffer[at[3]:at[3] + n]
    table_dev = buffer[at[4]:at[4] + n * width].view(n, width)
    return CommonAttentionMetadata(
        query_start_loc=qsl_dev,
        query_start_loc_cpu=torch.from_numpy(qsl32),
        seq_lens=seq_dev,
        seq_lens_cpu=torch.from_numpy(seq32),
        block_table=table_dev,
        slot_mapping=slots_dev,
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens,
        block_size=block_size,
        causal=causal,
        block_table_cpu=torch.from_numpy(table_np),
        num_blocks=num_blocks,
        block_indptr_cpu=torch.from_numpy(indptr),
        block_indices_cpu=torch.from_numpy(indices),
        device_tables=_device_tables(buffer, [at[2], *at[5:]]),
        positions_tensor=positions_dev,
    )


def build_batch(
    allocator: BlockAllocator,
    request_ids: Sequence[object],
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    *,
    device: torch.device | str = "cpu",
    **kwargs,
) -> CommonAttentionMetadata:
    """Reserve blocks for each request's context + new tokens and build the step's metadata.

    Requests must already be decode-first (see :func:`decode_first_order`).
    """
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    for r, s in zip(request_ids, seq_lens):
        allocator.reserve(r, s)
    tables = allocator.block_table(request_ids, kwargs.get("max_blocks_per_req"))
    return build_common_metadata(query_lens, seq_lens, tables, allocator.block_size,
                                 allocator.num_blocks, device=device, **kwargs)
