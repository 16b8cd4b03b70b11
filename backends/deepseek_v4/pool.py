"""One page pool for every cache of a DeepSeek-V4 model: the sliding-window tokens of every
layer, the compressed entries of the compressed layers and the compressed-sparse layers' index
keys draw whole pages from one arena and one free list, and no cache is padded to another's
page.

A page is ``window_page`` window tokens (vLLM's 64): ``P = window_page x entry_bytes`` bytes
(37,376 for vLLM's 584-byte entries). Every cache fills it with its own rows:

* window and compressed caches: ``window_page`` entries a page (a compressed-sparse layer's
  page holds 4 x 64 = 256 tokens' entries, a heavily compressed layer's 128 x 64 = 8192);
* index keys (``index_dim + 4`` bytes as planar fp8, or ``index_dim`` rows of the model dtype):
  as many as fit, ``P // entry`` (283 of 132 bytes in 37,376: 20 bytes a page unused).

Each (request, layer, cache) keeps its own page list and block table, so a page is used by one
cache of one layer: a model whose layers differ in kind wastes no page on the kinds a layer
lacks (a group-wide block id would reserve a compressed page in every layer). Window pages
behind the window go back to the pool as the request moves on (:meth:`release_window`), so a
request holds ``ceil(W / window_page) + 1`` window pages a layer and its compressed pages. The
compressors' partial groups are fp32 state slots beside the arena (a slot a request and layer:
they do not grow with the context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_ops.backends.deepseek_v4.cache import ENTRY_BYTES
from attn_ops.backends.deepseek_v4.compressor import compressor_state_rows
from attn_ops.backends.deepseek_v4.spec import DeepseekV4Spec

__all__ = ["DeepseekV4CachePool", "LayerCaches"]


@dataclass
class LayerCaches:
    """One layer's views of the arena (``uint8`` entries or rows of the model dtype) and its
    compressors' state slots (None where the layer has no such cache)."""

    window: torch.Tensor
    compressed: torch.Tensor | None = None
    index: torch.Tensor | None = None
    state: torch.Tensor | None = None
    index_state: torch.Tensor | None = None


class DeepseekV4CachePool:
    """Pages for ``specs`` (one :class:`DeepseekV4Spec` a layer, one cache format) from an
    arena of ``num_pages`` pages, and ``num_state_slots`` compressor state slots a layer."""

    def __init__(self, specs: list[DeepseekV4Spec], num_pages: int, *, window_page: int = 64,
                 index_fp8: bool = True, num_state_slots: int = 8,
                 device: torch.device | str = "cpu") -> None:
        if not specs or len({(s.kv_cache_dtype, s.head_dim, s.dtype) for s in specs}) != 1:
            raise ValueError("a pool serves layers of one cache format, head dim and dtype; "
                             f"got {sorted({s.describe() for s in specs})[:2]}")
        first = specs[0]
        self.specs, self.window_page = specs, window_page
        self.fp8 = first.kv_cache_dtype == "fp8_ds_mla"
        item = torch.tensor([], dtype=first.dtype).element_size()
        self.entry_bytes = ENTRY_BYTES if self.fp8 else first.head_dim * item
        self.page_bytes = window_page * self.entry_bytes
        self.num_pages, self.device = num_pages, device
        self.arena = torch.zeros(num_pages, self.page_bytes, dtype=torch.uint8, device=device)
        self._free = list(range(num_pages - 1, -1, -1))
        self._pages: dict[tuple, list[int]] = {}  # (request, layer, cache) -> its pages
        self._slots: dict[object, int] = {}
        self._free_slots = list(range(num_state_slots - 1, -1, -1))
        self.index_fp8 = index_fp8
        self.layers = [self._layer_caches(s, num_state_slots, device) for s in specs]

    def _rows(self, entries: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """The arena as ``[pages, entries, width]`` rows of ``dtype`` (a view)."""
        item = torch.tensor([], dtype=dtype).element_size()
        return self.arena[:, :entries * width * item].view(dtype).unflatten(1, (entries, width))

    def _layer_caches(self, spec: DeepseekV4Spec, slots: int, device) -> LayerCaches:
        entries = self.window_page
        kv = self.arena if self.fp8 else self._rows(entries, spec.head_dim, spec.dtype)
        caches = LayerCaches(window=kv)
        if spec.compress_ratio:
            caches.compressed = kv
            coff = 2 if spec.layer_type == "compressed_sparse_attention" else 1
            caches.state = torch.zeros(slots, compressor_state_rows(spec.compress_ratio,
                                                                    coff == 2),
                                       2 * coff * spec.head_dim, device=device)
        if spec.index_topk:
            di = spec.index_head_dim
            if self.index_fp8:
                caches.index = self.arena[:, :self.index_entries(spec) * (di + 4)]
            else:
                caches.index = self._rows(self.index_entries(spec), di, spec.dtype)
            caches.index_state = torch.zeros(slots, compressor_state_rows(spec.compress_ratio,
                                                                          True), 4 * di,
                                              device=device)
        return caches

    def index_entries(self, spec: DeepseekV4Spec) -> int:
        """Index keys a page holds."""
        item = torch.tensor([], dtype=spec.dtype).element_size()
        per = spec.index_head_dim + 4 if self.index_fp8 else spec.index_head_dim * item
        return self.page_bytes // per

    def pages_needed(self, spec: DeepseekV4Spec, tokens: int) -> dict[str, int]:
        """Pages each cache of a layer needs for ``tokens`` tokens."""
        needs = {"window": -(-tokens // self.window_page)}
        if spec.compress_ratio:
            needs["compressed"] = -(-(tokens // spec.compress_ratio) // self.window_page)
        if spec.index_topk:
            needs["index"] = -(-(tokens // spec.compress_ratio) // self.index_entries(spec))
        return needs

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def reserve(self, request: object, tokens: int) -> None:
        """Pages (and state slots) for ``tokens`` tokens of ``request`` in every layer."""
        wanted = {}
        for layer, spec in enumerate(self.specs):
            for cache, n in self.pages_needed(spec, tokens).items():
                have = len(self._pages.get((request, layer, cache), ()))
                if n > have:
                    wanted[(request, layer, cache)] = n - have
        if sum(wanted.values()) > len(self._free):
            raise RuntimeError(f"out of V4 cache pages: request {request!r} needs "
                               f"{sum(wanted.values())} more, {len(self._free)} free of "
                               f"{self.num_pages}; allocate a bigger pool")
        if request not in self._slots:
            if not self._free_slots:
                raise RuntimeError(f"out of compressor state slots for request {request!r}: "
                                   "allocate the pool with more num_state_slots")
            self._slots[request] = self._free_slots.pop()
        for key, n in wanted.items():
            self._pages.setdefault(key, []).extend(self._free.pop() for _ in range(n))

    def release_window(self, request: object, position: int) -> int:
        """Give back every layer's window pages wholly before ``position`` (no later query
        reads them: its window starts at or after it); returns how many."""
        released = 0
        for layer in range(len(self.specs)):
            pages = self._pages.get((request, layer, "window"), [])
            for i in range(min(max(position, 0) // self.window_page, len(pages))):
                if pages[i] >= 0:
                    self._free.append(pages[i])
                    pages[i] = -1
                    released += 1
        return released

    def free(self, request: object) -> None:
        for key in [k for k in self._pages if k[0] == request]:
            self._free.extend(p for p in reversed(self._pages.pop(key)) if p >= 0)
        slot = self._slots.pop(request, None)
        if slot is not None:
            self._free_slots.append(slot)

    def held_pages(self, request: object) -> dict[str, int]:
        """Pages ``request`` holds, by cache (summed over layers)."""
        held: dict[str, int] = {}
        for (r, _, cache), pages in self._pages.items():
            if r == request:
                held[cache] = held.get(cache, 0) + sum(p >= 0 for p in pages)
        return held

    def step(self, layer: int, requests: list, context_lens: list[int], query_lens: list[int],
             device: torch.device | str | None = None) -> dict:
        """The ``step`` dict a :class:`~attn_ops.layers.deepseek_v4.DeepseekV4Attention` of
        layer ``layer`` takes for these requests (pages reserved for their new tokens first):
        ``query_start_loc``, ``seq_lens``, the window's ``block_table`` (-1 where released) and
        ``slot_mapping``, ``compressed_block_table``, ``index_block_table``,
        ``state_indices``."""
        device = self.device if device is None else device
        for r, c, n in zip(requests, context_lens, query_lens):
            self.reserve(r, c + n)

        def table(cache):
            rows = [self._pages.get((r, layer, cache), []) for r in requests]
            width = max(1, max(map(len, rows), default=1))
            return torch.tensor([p + [0] * (width - len(p)) for p in rows], dtype=torch.int32,
                                device=device)

        window = table("window")
        qsl = [0]
        slots = []
        for i, (c, n) in enumerate(zip(context_lens, query_lens)):
            qsl.append(qsl[-1] + n)
            pages = self._pages[(requests[i], layer, "window")]
            slots += [pages[p // self.window_page] * self.window_page + p % self.window_page
                      for p in range(c, c + n)]
        spec = self.specs[layer]
        out = dict(query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
                   seq_lens=torch.tensor([c + n for c, n in zip(context_lens, query_lens)],
                                         dtype=torch.int32, device=device),
                   block_table=window,
                   slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                   state_indices=torch.tensor([self._slots[r] for r in requests],
                                              dtype=torch.int32, device=device))
        if spec.compress_ratio:
            out["compressed_block_table"] = table("compressed")
        if spec.index_topk:
            out["index_block_table"] = table("index")
        return out
