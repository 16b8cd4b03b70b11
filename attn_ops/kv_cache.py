"""The paged KV cache: layouts, allocation, the block allocator and the KV-write op.

Layouts (chosen per backend, allocated by attn_ops):

* ``NHD``: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (K at ``[:, 0]``, V at
  ``[:, 1]``); FlashInfer "NHD" and FlashAttention compatible. Needs equal K and V head dims.
* ``NHD_PACKED``: ``[num_blocks, block_size, num_kv_heads, head_dim + head_dim_v]``; K and V of
  one token side by side, for models whose V head dim differs from the QK head dim.
* ``TURBOQUANT``: ``uint8 [num_blocks, num_kv_heads, block_size, slot_bytes]``, head-major in a
  block; one byte slot a (token, KV head) holding both, in vLLM's TurboQuant format
  (``backends/turboquant/format.py``).

Slot ``s`` is token ``s % block_size`` of block ``s // block_size``; slot ``-1`` is padding.

An NHD cache may also be held as two planes, ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` seen as ``planes.transpose(0, 1)`` (:func:`kv_cache_planes`): K and V each one
contiguous block of pages, as HF's paged cache keeps them. The backends whose
``reads_kv_planes`` is true read it as they read the interleaved one.
"""

from __future__ import annotations

import enum
import random
import weakref
from collections import OrderedDict

import numpy as np
import torch

from attn_ops.ops import debug_checks_enabled, define_op
from attn_ops.spec import AttentionSpec

__all__ = [
    "BlockAllocator", "KVCacheLayout", "allocate_kv_cache", "kv_cache_planes", "kv_cache_shape",
    "split_kv_cache", "kv_cache_update", "FP8_MAX",
]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


class KVCacheLayout(enum.Enum):
    NHD = "nhd"
    NHD_PACKED = "nhd_packed"
    TURBOQUANT = "turboquant"

    @staticmethod
    def for_spec(spec: AttentionSpec) -> KVCacheLayout:
        if spec.kv_cache_dtype.is_turboquant:
            return KVCacheLayout.TURBOQUANT
        return KVCacheLayout.NHD if spec.v_head_dim == spec.head_dim else KVCacheLayout.NHD_PACKED


def kv_cache_shape(spec: AttentionSpec, num_blocks: int, block_size: int,
                   layout: KVCacheLayout | None = None) -> tuple[int, ...]:
    layout = layout or KVCacheLayout.for_spec(spec)
    if (layout is KVCacheLayout.TURBOQUANT) != spec.kv_cache_dtype.is_turboquant:
        raise ValueError(f"layout {layout.value} and kv_cache_dtype="
                         f"{spec.kv_cache_dtype.value}: the turboquant layout holds exactly the "
                         "turboquant_* caches")
    if layout is KVCacheLayout.TURBOQUANT:
        from attn_ops.backends.turboquant.format import slot_bytes

        return (num_blocks, spec.kv_heads, block_size,
                slot_bytes(spec.kv_cache_dtype, spec.head_dim))
    if layout is KVCacheLayout.NHD:
        if spec.v_head_dim != spec.head_dim:
            raise ValueError(f"layout NHD needs head_dim == head_dim_v, got {spec.head_dim} and "
                             f"{spec.v_head_dim}; use KVCacheLayout.NHD_PACKED")
        return (num_blocks, 2, block_size, spec.kv_heads, spec.head_dim)
    return (num_blocks, block_size, spec.kv_heads, spec.head_dim + spec.v_head_dim)


def allocate_kv_cache(spec: AttentionSpec, num_blocks: int, block_size: int,
                      device: torch.device | str = "cpu",
                      layout: KVCacheLayout | None = None) -> torch.Tensor:
    """A zeroed cache for one layer, in ``spec.cache_dtype`` (fp8 for fp8 KV specs)."""
    shape = kv_cache_shape(spec, num_blocks, block_size, layout)
    return torch.zeros(shape, dtype=spec.cache_dtype, device=device)


def kv_cache_planes(planes: torch.Tensor) -> torch.Tensor:
    """The NHD cache ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` over ``planes``
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K at ``planes[0]``, V at
    ``planes[1]``): a view, for the backends whose ``reads_kv_planes`` is true."""
    if planes.dim() != 5 or planes.shape[0] != 2:
        raise ValueError(f"planes must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(planes.shape)}")
    return planes.transpose(0, 1)


def split_kv_cache(kv_cache: torch.Tensor, head_dim: int,
                   head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, dim]``."""
    if kv_cache.dim() == 5:
        if kv_cache.shape[1] != 2:
            raise ValueError(f"a 5-d KV cache must be [num_blocks, 2, block_size, num_kv_heads, "
                             f"head_dim], got shape {tuple(kv_cache.shape)}")
        return kv_cache[:, 0], kv_cache[:, 1]
    if kv_cache.dim() == 4:
        if kv_cache.shape[3] != head_dim + head_dim_v:
            raise ValueError(f"a packed KV cache must be [num_blocks, block_size, num_kv_heads, "
                             f"head_dim + head_dim_v = {head_dim + head_dim_v}], got shape "
                             f"{tuple(kv_cache.shape)}")
        return kv_cache[..., :head_dim], kv_cache[..., head_dim:]
    raise ValueError(f"kv_cache must be 5-d (NHD) or 4-d (NHD_PACKED), got shape "
                     f"{tuple(kv_cache.shape)}; allocate it with attn_ops.allocate_kv_cache")


_NHD_HALVES: dict[int, tuple] = {}  # id(cache) -> (weakref to it, K, V)


def nhd_kv_halves(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a 5-d NHD cache, ``[num_blocks, block_size, num_kv_heads, head_dim]`` each,
    made once per cache tensor for the ops that run in every layer: ``unbind`` costs ~2.4 us
    a call, and a layer's cache is the same tensor every step. They are storage aliases, not
    views (a view would keep the cache object alive through ``_base``); the entry goes when
    the cache does."""
    key = id(kv_cache)
    entry = _NHD_HALVES.get(key)
    if entry is not None and entry[0]() is kv_cache:
        return entry[1], entry[2]
    shape = (kv_cache.shape[0], *kv_cache.shape[2:])
    stride = (kv_cache.stride(0), *kv_cache.stride()[2:])
    halves = tuple(kv_cache.new_empty(0).set_(kv_cache.untyped_storage(),
                                              kv_cache.storage_offset() + i * kv_cache.stride(1),
                                              shape, stride) for i in (0, 1))
    _NHD_HALVES[key] = (weakref.ref(kv_cache, lambda _: _NHD_HALVES.pop(key, None)), *halves)
    return halves


# ---------------------------------------------------------------------------------------------
# torch.ops.attn.kv_cache_update


def _check_update_inputs(key, value, kv_cache, slot_mapping, k_scale, v_scale):
    if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
        raise ValueError(f"key and value must be [num_tokens, num_kv_heads, dim] with equal "
                         f"first two dims, got {tuple(key.shape)} and {tuple(value.shape)}")
    k_cache, v_cache = split_kv_cache(kv_cache, key.shape[2], value.shape[2])
    if k_cache.shape[2:] != key.shape[1:] or v_cache.shape[2:] != value.shape[1:]:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match the "
                         f"cache's [num_kv_heads, dim] = {tuple(k_cache.shape[2:])} / "
                         f"{tuple(v_cache.shape[2:])}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], got "
                         f"{tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping.dtype={slot_mapping.dtype} must be int64 (or int32)")
    for name, t in (("value", value), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        if t.device.type != key.device.type:
            raise ValueError(f"{name} is on {t.device} but key is on {key.device}")
    if kv_cache.dtype in FP8_MAX:
        if k_scale is None or v_scale is None:
            raise ValueError(f"kv_cache.dtype={kv_cache.dtype} needs k_scale and v_scale to "
                             "quantize")
    elif kv_cache.dtype != key.dtype or value.dtype != key.dtype:
        raise ValueError(f"kv_cache.dtype={kv_cache.dtype} must equal key/value dtype "
                         f"{key.dtype}/{value.dtype} (or be fp8 with scales)")
    return k_cache, v_cache


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` saturated to the fp8 range and rounded to ``dtype``."""
    limit = FP8_MAX[dtype]
    return (x.float() / scale.float()).clamp_(-limit, limit).to(dtype)


def _kv_cache_update_impl(key, value, kv_cache, slot_mapping, k_scale, v_scale):
    k_cache, v_cache = _check_update_inputs(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    block_size = k_cache.shape[1]
    if debug_checks_enabled():  # a tensor scan per layer; the metadata builder checks on the host
        slots = slot_mapping.long()
        capacity = k_cache.shape[0] * block_size
        bad = (slots < -1) | (slots >= capacity)
        if bool(bad.any()):
            raise ValueError(f"slot_mapping holds slot {int(slots[bad][0])} but the cache has "
                             f"slots 0..{capacity - 1} ({k_cache.shape[0]} blocks x {block_size}) "
                             "and -1 marks padding")
    write_paged(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def write_paged(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    """Write ``key`` / ``value`` ``[T, H, D]`` at ``slot_mapping`` into the paged views
    ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, H, D]`` (any strides: halves of one
    cache, or the two column ranges of an MLA latent cache), skipping -1, quantizing to fp8
    caches, and zeroing the rows the write leaves unfilled in every page it enters.

    Slots arrive on the device and are never trusted: one outside the cache (``>= num_blocks x
    block_size``, or below -1) is skipped like -1 -- nothing written, no page tail cleared
    (``set_debug_checks(True)`` makes the op raise on it instead)."""
    block_size = k_cache.shape[1]
    if slot_mapping.numel() == 0:
        return
    if key.is_cuda:  # one Triton launch, page tails cleared in it (attn_ops.glue_kernels)
        from attn_ops.glue_kernels import kv_cache_update_triton

        return kv_cache_update_triton(key, value, k_cache, v_cache, slot_mapping, k_scale,
                                      v_scale)
    slots = host_slots(slot_mapping)
    _zero_tails(entered_pages(slots, k_cache.shape[0], block_size), (k_cache, v_cache))
    rows, blocks, offsets = _written_rows(slots, k_cache.shape[0], block_size)
    for new, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if rows is not None:
            new = new.index_select(0, rows)
        if cache.dtype in FP8_MAX:
            new = quantize_fp8(new, scale, cache.dtype)
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)  # (no fp8 index_put)
        cache.index_put_((blocks, offsets), new)


# A host write of at most this many tokens reads its slots as Python ints: a decode's one to a
# few tokens then cost a short loop, where each of the numpy path's array operations costs
# about as much as that whole loop.
FEW_SLOTS = 16


def host_slots(slot_mapping: torch.Tensor) -> list[int] | np.ndarray:
    """A host write's slots, read once: Python ints for at most ``FEW_SLOTS`` tokens, else an
    int64 array (what :func:`entered_pages` and :func:`_written_rows` take)."""
    if slot_mapping.shape[0] <= FEW_SLOTS:
        return slot_mapping.tolist()
    return slot_mapping.numpy().astype(np.int64, copy=False)


def _written_rows(slots: list[int] | np.ndarray, num_blocks: int, block_size: int):
    """``(rows, blocks, offsets)`` of a host write (its :func:`host_slots`): the tokens whose
    slots are inside the cache (None: all of them) and their pages and rows."""
    capacity = num_blocks * block_size
    if isinstance(slots, list):
        kept = [t for t, s in enumerate(slots) if 0 <= s < capacity]
        rows = None
        if len(kept) < len(slots):
            rows, slots = torch.tensor(kept, dtype=torch.long), [slots[t] for t in kept]
        return (rows, torch.tensor([s // block_size for s in slots], dtype=torch.long),
                torch.tensor([s % block_size for s in slots], dtype=torch.long))
    valid = (slots >= 0) & (slots < capacity)
    rows = None
    if not valid.all():
        rows, slots = torch.from_numpy(np.flatnonzero(valid)), slots[valid]
    return rows, torch.from_numpy(slots // block_size), torch.from_numpy(slots % block_size)


def entered_pages(slots: list[int] | np.ndarray, num_blocks: int,
                  block_size: int) -> list[tuple[int, int]]:
    """``(page, rows filled)`` of every page whose row 0 a host write (its
    :func:`host_slots`) fills and whose later rows it does not all fill: row ``j`` is filled
    when the token ``j`` places after the entering one has the entering slot + ``j`` (a
    request's new tokens are consecutive, in position order). A slot outside the cache enters
    no page (the write skips it)."""
    capacity = num_blocks * block_size
    found = []
    if isinstance(slots, list):
        for t, first in enumerate(slots):
            if 0 <= first < capacity and first % block_size == 0:
                filled = 1
                while (filled < block_size and t + filled < len(slots)
                       and slots[t + filled] == first + filled):
                    filled += 1
                if filled < block_size:
                    found.append((first // block_size, filled))
        return found
    entering = (slots >= 0) & (slots < capacity) & (slots % block_size == 0)
    for t in np.flatnonzero(entering):
        run = slots[t:t + block_size]
        filled = int(np.argmin(np.append(run == slots[t] + np.arange(run.shape[0]), False)))
        if filled < block_size:
            found.append((int(slots[t]) // block_size, filled))
    return found


def clear_entered_page_tails(slot_mapping: torch.Tensor, *caches: torch.Tensor) -> None:
    """Zero, in every page whose row 0 this write fills (a request entering a page that may
    hold anything an earlier request left, NaN included), the rows the write does not fill
    (:func:`entered_pages`) -- so a page's unused tail is always finite, and no kernel that
    loads whole pages multiplies a zero probability by a NaN. Host tensors (the GPU does this
    inside its write kernel). ``caches``: paged views ``[num_blocks, block_size, ...]`` the
    write fills (K and V; an MLA latent cache)."""
    _zero_tails(entered_pages(host_slots(slot_mapping), *caches[0].shape[:2]), caches)


def _zero_tails(pages: list[tuple[int, int]], caches) -> None:
    """Rows ``filled`` on of each of ``pages`` (:func:`entered_pages`), zero in ``caches``."""
    for page, filled in pages:
        for cache in caches:
            raw = cache.view(torch.uint8) if cache.dtype in FP8_MAX else cache
            raw[page, filled:].zero_()


def _kv_cache_update_fake(key, value, kv_cache, slot_mapping, k_scale, v_scale):
    _check_update_inputs(key, value, kv_cache, slot_mapping, k_scale, v_scale)


kv_cache_update = define_op(
    "kv_cache_update",
    "(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor? k_scale, "
    "Tensor? v_scale) -> ()",
    _kv_cache_update_impl,
    _kv_cache_update_fake,
)
kv_cache_update.__doc__ = """Write key/value [T, Hkv, D] into the paged cache at slot_mapping [T].

Slots of -1 are skipped, and so is a slot outside the cache (``>= num_blocks x block_size``
or below -1: slots arrive on the device and are never trusted; with
``attn_ops.set_debug_checks(True)`` the op raises on one instead). An fp8 cache stores
``key / k_scale`` (and ``value / v_scale``) saturated to the fp8 range. A token writing row 0
of a page also zeroes the page's rows that the tokens after it do not fill: a page's tokens
come in slot order, the entering one first (a request's new tokens are consecutive, in
position order), as any paged engine lays them out.
"""


# ---------------------------------------------------------------------------------------------
# Block allocator


class BlockAllocator:
    """A small paged allocator: hands out cache blocks to requests and builds block tables.

    ``shuffle=True`` hands blocks out in random order so tests exercise non-contiguous pages.
    Block 0..num_blocks-1 are all usable; freed blocks return to the pool. Each request's
    blocks are also kept as a row of a numpy table, written as blocks are added, so a step's
    block table is one gather (:meth:`block_table`), not a conversion of every block id from
    Python (which cost ~0.3 ms for 64 requests of 2k tokens).

    ``num_state_slots``: the recurrent-state slots of a hybrid model's state layers
    (``backends/ssm``), one per running request, from the same allocator so one model has one.
    Slot 0 is the null slot no request owns (CUDA-graph padding rows read and write it); a
    request takes one of ``1..num_state_slots`` with its first blocks and gives it back with
    them. States are slots, not blocks: a state is a request's whole history (a 1 MiB GDN
    state does not shrink with a page), so slots per block would size every state layer by
    the KV pool. ``state_slots_per_request`` ``1 + K`` gives each request a slot per position of
    a speculative decode of ``K`` drafts (the state after each, until acceptance picks one).

    ``prefix_caching=True``: full blocks are cached by the tokens they hold, through every
    token before them (a hash chain), for later requests with the same prefix
    (:meth:`match_prefix`): a shared block is read by every request holding it and written by
    none (a request writes from the block after its cached prefix); a block whose last holder
    is freed stays cached until a new block is needed and it is the least recently freed
    (:attr:`num_free_blocks` counts it free). Requests register their blocks with the tokens
    they hold as they fill (``reserve(..., token_ids=...)``).

    A hybrid model's prefix cache also needs the recurrent states after a cached block (a
    state is a request's whole history: it cannot be rebuilt from pages). They are kept as
    checkpoints in spare state slots (:meth:`new_checkpoint`) at the positions
    :meth:`next_checkpoint` names -- every ``checkpoint_every``-th block boundary of a prompt
    and its last full block's -- and given back to running requests first when slots run
    out. Finer checkpoints let more of a shared prefix be resumed and hold more slots.
    """

    def __init__(self, num_blocks: int, block_size: int, *, shuffle: bool = False,
                 seed: int = 0, num_state_slots: int = 0,
                 state_slots_per_request: int = 1, prefix_caching: bool = False,
                 checkpoint_every: int = 64) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be > 0")
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={checkpoint_every} must be >= 1 (blocks between "
                             "two state checkpoints of a prompt)")
        self.checkpoint_every = checkpoint_every
        if num_state_slots < 0 or state_slots_per_request < 1:
            raise ValueError(f"num_state_slots={num_state_slots} must be >= 0 and "
                             f"state_slots_per_request={state_slots_per_request} >= 1")
        self.state_slots_per_request = state_slots_per_request
        self.num_blocks = num_blocks
        self.num_state_slots = num_state_slots
        self._free_states = list(range(num_state_slots, 0, -1))
        if shuffle:
            random.Random(seed + 1).shuffle(self._free_states)
        self._states: dict[object, list[int]] = {}
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        if shuffle:
            random.Random(seed).shuffle(self._free)
        self._blocks: dict[object, list[int]] = {}
        self._rows: dict[object, int] = {}  # request -> its row of _table
        self._free_rows: list[int] = []
        self._table = np.zeros((16, 16), dtype=np.int32)
        self.prefix_caching = prefix_caching
        self._refs: dict[int, int] = {}  # block -> requests holding it (prefix caching)
        self._by_hash: dict[int, int] = {}  # a cached block's prefix hash -> the block
        self._hash_of: dict[int, int] = {}  # block -> its prefix hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unheld cached blocks, LRU
        self._chains: dict[object, list[int]] = {}  # request -> its full blocks' hashes
        self._checkpoints: dict[int, int] = {}  # cached block -> the state slot after it

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    def _new_block(self) -> int:
        """A free block: an unused one, else the least recently freed cached one (its prefix
        forgotten)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        self._refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        """An evicted block's prefix and its state checkpoint (the slot goes back)."""
        del self._by_hash[self._hash_of.pop(block)]
        slot = self._checkpoints.pop(block, None)
        if slot is not None:
            self._free_states.append(slot)

    def new_checkpoint(self, block: int) -> int | None:
        """A state slot for the recurrent states after cached ``block`` (a hybrid model's
        prefix cache: a request matching through this block resumes from them), from the free
        state slots -- a new request's slots stay free -- or else from the oldest checkpoint
        (of an unheld block first); None where the block is not cached or has one, or no slot
        can be had (a checkpoint never takes a running request's slot)."""
        if block not in self._hash_of or block in self._checkpoints:
            return None
        if len(self._free_states) <= self.state_slots_per_request:
            self._drop_checkpoints(1)
            if len(self._free_states) <= self.state_slots_per_request:
                return None
        slot = self._checkpoints[block] = self._free_states.pop()
        return slot

    def _drop_checkpoints(self, n: int) -> None:
        """Give ``n`` checkpoint slots back to running requests: those of unheld blocks first
        (least recently freed first), then any (only later cache hits are lost)."""
        order = [b for b in self._evictable if b in self._checkpoints]
        order += [b for b in self._checkpoints if b not in self._evictable]
        for block in order[:n]:
            self._free_states.append(self._checkpoints.pop(block))

    def next_checkpoint(self, computed: int, prompt_len: int) -> int | None:
        """The first position after ``computed`` tokens of a prompt of ``prompt_len`` tokens
        whose states are checkpointed (a step of a hybrid model's prefill ends there; None:
        no more in the prompt)."""
        every = self.checkpoint_every * self.block_size
        position = min((computed // every + 1) * every, prompt_len // self.block_size
                       * self.block_size)
        return position if position > computed else None

    def checkpoint(self, block: int) -> int | None:
        """The state slot of ``block``'s checkpoint (None: it has none)."""
        return self._checkpoints.get(block)

    def _chain(self, request_id: object, token_ids, full_blocks: int) -> list[int]:
        """The hashes of the first ``full_blocks`` blocks of ``token_ids`` (each over every
        token through its block), extending what the request already computed."""
        chain = self._chains.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(chain), full_blocks):
            chain.append(hash((chain[-1] if chain else None,
                               tuple(int(t) for t in token_ids[i * bs:(i + 1) * bs]))))
        return chain

    def match_prefix(self, request_id: object, token_ids, *,
                     with_checkpoint: bool = False) -> int:
        """Give a new request the cached blocks of its longest cached prefix of ``token_ids``
        (whole blocks, at most ``len(token_ids) - 1`` tokens: the last token is always computed,
        for its logits); returns how many tokens they hold -- the request's computed tokens.
        ``with_checkpoint`` (a hybrid model): the prefix ends at a block with a state
        checkpoint (:meth:`checkpoint` of the request's last block gives it). Without
        ``prefix_caching``: 0."""
        if request_id in self._blocks:
            raise ValueError(f"request {request_id!r} already holds blocks: match its prefix "
                             "before its first reserve")
        if not self.prefix_caching:
            return 0
        chain = self._chain(request_id, token_ids, (len(token_ids) - 1) // self.block_size)
        hit = []
        for h in chain:
            block = self._by_hash.get(h)
            if block is None:
                break
            hit.append(block)
        if with_checkpoint:  # (back to the last block the states can resume after)
            while hit and hit[-1] not in self._checkpoints:
                hit.pop()
        del chain[len(hit):]  # (the rest is hashed again as the request fills its own blocks)
        self.reserve(request_id, 0)
        owned = self._blocks[request_id]
        for block in hit:
            if block in self._evictable:
                del self._evictable[block]
                self._refs[block] = 1
            else:
                self._refs[block] += 1
            owned.append(block)
        self._write_row(request_id, 0)
        return len(hit) * self.block_size

    def blocks(self, request_id: object) -> list[int]:
        return self._blocks.get(request_id, [])

    def reserve(self, request_id: object, num_tokens: int, token_ids=None) -> list[int]:
        """Make sure ``request_id`` owns enough blocks for ``num_tokens`` tokens in total;
        with ``prefix_caching``, ``token_ids`` (the tokens it holds, those being written
        included) caches its blocks that are full."""
        owned = self._reserve(request_id, num_tokens)
        if self.prefix_caching and token_ids is not None:
            self._register(request_id, token_ids)
        return owned

    def _reserve(self, request_id: object, num_tokens: int) -> list[int]:
        owned = self._blocks.get(request_id)
        if owned is None:
            per = self.state_slots_per_request
            if self.num_state_slots and len(self._free_states) < per:
                self._drop_checkpoints(per - len(self._free_states))
            if self.num_state_slots and len(self._free_states) < per:
                raise RuntimeError(f"out of state slots: request {request_id!r} needs {per}, "
                                   f"{len(self._free_states)} of {self.num_state_slots} are "
                                   "free; allocate more (num_state_slots >= the most requests "
                                   "running at once x state_slots_per_request)")
            owned = self._blocks[request_id] = []
            self._rows[request_id] = self._free_rows.pop() if self._free_rows else len(self._rows)
            if self.num_state_slots:
                self._states[request_id] = [self._free_states.pop() for _ in range(per)]
        needed = -(-num_tokens // self.block_size) - len(owned)
        if needed <= 0:
            return owned
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV-cache blocks: request {request_id!r} needs {needed} "
                               f"more, {self.num_free_blocks} free of {self.num_blocks}; "
                               "allocate a bigger cache")
        start = len(owned)
        for _ in range(needed):
            owned.append(self._new_block())
        self._write_row(request_id, start)
        return owned

    def _write_row(self, request_id: object, start: int) -> None:
        """The request's blocks from ``start`` on into its block-table row."""
        owned, row = self._blocks[request_id], self._rows[request_id]
        rows, width = self._table.shape
        if row >= rows or len(owned) > width:
            grown = np.zeros((max(rows, 2 * row + 1), max(width, 2 * len(owned))), np.int32)
            grown[:rows, :width] = self._table
            self._table = grown
        self._table[row, start:len(owned)] = owned[start:]

    def _register(self, request_id: object, token_ids) -> None:
        """Cache the request's full blocks by the tokens they hold (a block whose prefix is
        cached already, in another block, stays the request's own, uncached)."""
        owned = self._blocks[request_id]
        full = min(len(token_ids) // self.block_size, len(owned))
        for i, h in enumerate(self._chain(request_id, token_ids, full)):
            block = owned[i]
            if block >= 0 and block not in self._hash_of and h not in self._by_hash:
                self._by_hash[h], self._hash_of[block] = block, h

    def block_table(self, request_ids, width: int | None = None) -> np.ndarray:
        """``[len(request_ids), width]`` int32 block table of these requests (their blocks in
        order, then zeros); ``width`` defaults to the most blocks any of them owns."""
        rows = np.fromiter((self._rows[r] for r in request_ids), dtype=np.int64,
                           count=len(request_ids))
        owned = max((len(self._blocks[r]) for r in request_ids), default=0)
        width = max(owned, 1) if width is None else width
        if width <= self._table.shape[1]:
            return self._table[rows, :width]
        table = np.zeros((rows.shape[0], width), dtype=np.int32)
        table[:, :self._table.shape[1]] = self._table[rows]
        return table

    def request_state_slots(self, request_id: object) -> list[int]:
        """The request's ``state_slots_per_request`` slots (``1..num_state_slots``; 0 is the
        null slot)."""
        slots = self._states.get(request_id)
        if slots is None:
            raise KeyError(f"request {request_id!r} has no state slot: reserve it first, with "
                           "an allocator made with num_state_slots > 0")
        return slots

    def state_slot(self, request_id: object) -> int:
        """The request's (first) recurrent-state slot."""
        return self.request_state_slots(request_id)[0]

    def state_slots(self, request_ids) -> np.ndarray:
        """int32 state slots of these requests: ``[B]``, or ``[B, state_slots_per_request]``
        where requests own several."""
        table = np.array([self.request_state_slots(r) for r in request_ids],
                         dtype=np.int32).reshape(len(request_ids), self.state_slots_per_request)
        return table[:, 0] if self.state_slots_per_request == 1 else table

    def _drop(self, block: int) -> None:
        """One holder fewer for ``block``: back to the pool (or the cached) at the last."""
        self._refs[block] -= 1
        if self._refs[block]:
            return  # (another request still holds it)
        del self._refs[block]
        if block in self._hash_of:
            self._evictable[block] = None
        else:
            self._free.append(block)

    def release_before(self, request_id: object, position: int) -> int:
        """Give back the request's blocks wholly before ``position`` -- the pages a sliding
        window has moved past, which no later query reads -- and mark them -1 in its
        block table; returns how many were released. A request that keeps only its window
        holds ``ceil(window / block_size) + 1`` pages however long it runs (the metadata
        accepts the -1 where no query reads: ``build_common_metadata(..., window=)``)."""
        owned = self._blocks.get(request_id)
        if owned is None:
            return 0
        released = 0
        for i in range(min(max(position, 0) // self.block_size, len(owned))):
            if owned[i] >= 0:
                self._drop(owned[i])
                owned[i] = -1
                released += 1
        if released:
            self._table[self._rows[request_id], :len(owned)] = owned
        return released

    def free(self, request_id: object) -> None:
        owned = self._blocks.pop(request_id, None)
        if owned is None:
            return
        if request_id in self._states:
            self._free_states.extend(reversed(self._states.pop(request_id)))
        self._chains.pop(request_id, None)
        for block in reversed(owned):
            if block >= 0:  # (-1: released behind a window)
                self._drop(block)
        row = self._rows.pop(request_id)
        self._table[row, :len(owned)] = 0
        self._free_rows.append(row)

    def slots(self, request_id: object, start: int, end: int) -> list[int]:
        """Cache slots of token positions ``start..end-1`` of a request."""
        return self.slot_array(request_id, start, end).tolist()

    def slot_array(self, request_id: object, start: int, end: int) -> np.ndarray:
        """:meth:`slots` as an int64 array, computed without a Python loop over the tokens
        (a whole request's history a step: thousands of tokens)."""
        blocks, bs = self._blocks[request_id], self.block_size
        if end > len(blocks) * bs:
            raise IndexError(f"request {request_id!r} holds {len(blocks) * bs} slots "
                             f"({len(blocks)} blocks of {bs}); position {end - 1} is past them")
        first, last = start // bs, -(-end // bs)
        owned = np.asarray(blocks[first:last], dtype=np.int64)
        pages = (owned[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1)
        return pages[start - first * bs:end - first * bs]


def gather_tokens(cache: torch.Tensor, blocks: torch.Tensor, end: int,
                  start: int = 0) -> torch.Tensor:
    """Tokens ``start..end-1`` stored in ``blocks`` of one cache view
    (``[num_blocks, block_size, H, D]``) as a ``[end - start, H, D]`` tensor.

    Only the blocks that hold those tokens are read, so unused pages are never touched.
    """
    block_size = cache.shape[1]
    first = start // block_size
    used = blocks[first: -(-end // block_size)].long()
    offset = start - first * block_size
    return cache.index_select(0, used).flatten(0, 1)[offset: offset + end - start]


def gather_present_tokens(cache: torch.Tensor, blocks: torch.Tensor, end: int,
                          start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_tokens` over block ids that arrive on the device, never trusted:
    ``(tokens [n, H, D], present [n] bool)`` for tokens ``start .. start + n - 1``. Tokens past
    the end of ``blocks`` (the request's block-table row, when its ``seq_len`` needs more pages
    than the row holds) are absent and not returned (``n`` stops at the row's end); a token
    whose block id is outside the cache's ``[0, num_blocks)`` is absent too: nothing outside
    the cache is read for it, its row is zero and ``present`` False, for the caller to mask
    it out of its softmax."""
    num_blocks, block_size = cache.shape[:2]
    end = min(end, blocks.shape[0] * block_size)
    first = start // block_size
    ids = blocks[first: max(-(-end // block_size), first)].long()
    ok = (ids >= 0) & (ids < num_blocks)
    pages = cache.index_select(0, torch.where(ok, ids, 0))  # (an absent id reads page 0 ...)
    raw = pages.view(torch.uint8) if pages.dtype in FP8_MAX else pages
    raw.masked_fill_(~ok.view(-1, *(1,) * (pages.dim() - 1)), 0)  # (... and keeps none of it)
    offset = start - first * block_size
    n = max(end - start, 0)
    return (pages.flatten(0, 1)[offset: offset + n],
            ok.repeat_interleave(block_size)[offset: offset + n])
