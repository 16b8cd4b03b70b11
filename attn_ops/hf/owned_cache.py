"""``attn_ops.hf.cache``: a transformers ``Cache`` keeping attention layers' K/V in attn_ops
pages for its lifetime (the package docstring)."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from attn_ops.capabilities import CUDAGraphSupport
from attn_ops.hf.common import _built, _decodes_first, _ranges, _rows_of, _runs, _where

_DECODE_GRAPHS = CUDAGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
# (id(key tensor) -> (its weakref, the AttnOpsCache layer that returned it from update))
_HANDED: dict[int, tuple] = {}


def _hand_over(key: torch.Tensor, layer) -> None:
    """``layer`` (of an :func:`cache`) returned ``key`` from its ``update``: the attention call
    that receives this very tensor reads the history from the layer's pages."""
    for k in [k for k, (ref, _) in _HANDED.items() if ref() is None]:
        del _HANDED[k]
    _HANDED[id(key)] = (weakref.ref(key), layer)


def _take_handover(key: torch.Tensor):
    """The :func:`cache` layer that handed ``key`` over (None: HF's own cache or none)."""
    got = _HANDED.get(id(key))
    if got is None or got[0]() is not key:
        return None
    del _HANDED[id(key)]
    return got[1]


def _cache_classes():
    """``(Cache, CacheLayerMixin)`` of the installed transformers."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    return Cache, CacheLayerMixin


class _Steps:
    """What every layer of an :func:`cache` shares, by page size: one page allocator (a row's
    pages hold its tokens in every layer, each layer in its own tensor), each row's count of
    unpadded tokens, the blocks the layers' pages hold (``capacity``: doubling as the rows'
    pages outgrow it, :func:`_grown`), and the step's plan -- the rows' new-token runs, the
    decode-first order and the metadata -- built by the first layer of a step and reused by the
    others (the mask read on the host once a step, not once a layer).

    ``cuda_graphs``: a step of one new token in every row, on a GPU, runs each layer whose
    backend replays uniform decodes from a CUDA graph of its own (:meth:`graph_metadata`,
    ``AttnOpsLayer._graphed``): the write and the attention of a layer cost three input copies
    and a replay on the host, not the ops' Python and launches -- what a decode of a few rows
    is bound by. The graphs share one memory pool (they replay one after another)."""

    def __init__(self, batch: int, max_tokens: int, cuda_graphs: bool = True) -> None:
        self.batch, self.max_tokens = batch, max_tokens
        self.reach = max_tokens  # (what the blocks hold a row: restart keeps it)
        self.cuda_graphs = cuda_graphs
        self.by_page: dict[int, dict] = {}
        self.pool = None  # (the graphs' memory pool, once one is captured)
        self.stream = None  # (the side stream graphs are captured on)

    def restart(self, max_tokens: int) -> None:
        """Serve a new generation of at most ``max_tokens`` tokens a row (no more than the
        blocks kept allow): every row empty, the pages' blocks free again; the blocks' count,
        the layers' capacity, the graph buffers, memory pool and stream kept."""
        self.max_tokens = max_tokens
        for page, state in self.by_page.items():
            self._empty(state, page)

    def _empty(self, state: dict, page: int) -> None:
        """A page size's ``state`` with every row empty: all its blocks free, nothing written,
        no step planned."""
        from attn_ops.kv_cache import BlockAllocator

        state.update(alloc=BlockAllocator(state["blocks"], page), written=[0] * self.batch,
                     plan=None, last_graph=None)

    def plan(self, step: int, page: int, mask, sq: int, module, device) -> dict:
        state = self.by_page.get(page)
        if state is None:
            state = self.by_page[page] = dict(blocks=self.batch * -(-self.max_tokens // page),
                                              capacity=0)
            self._empty(state, page)
        plan = state["plan"]
        if plan is not None and plan["step"] == step:
            return plan
        if plan is not None:  # (the last step's tokens are history now)
            for r, n in zip(plan["order"], plan["lens"]):
                state["written"][r] += n
        b = self.batch
        new = [(0, sq)] * b
        if mask is not None:
            if mask.dim() != 2 or mask.shape[0] != b or mask.shape[1] < sq:
                raise ValueError(f"attn_ops cache ({_where(module)}): attention_mask "
                                 f"{tuple(mask.shape)} is not the 2-D padding mask")
            lo, hi, bad = _runs(mask[:, -sq:])
            if bad is not None:
                raise ValueError(f"attn_ops cache ({_where(module)}): attention_mask row "
                                 f"{bad}'s new tokens are not one run")
            new = list(zip(lo.tolist(), hi.tolist()))
        count = [hi - lo for lo, hi in new]
        order = _decodes_first([r for r in range(b) if count[r]], count)
        ctx = [state["written"][r] for r in order]
        lens = [count[r] for r in order]
        if order and max(c + n for c, n in zip(ctx, lens)) > self.max_tokens:
            raise ValueError(f"attn_ops cache ({_where(module)}): a row passes the cache's "
                             f"max_tokens={self.max_tokens}; make it with more")
        alloc, seq = state["alloc"], [c + n for c, n in zip(ctx, lens)]
        for r, n in zip(order, seq):
            alloc.reserve(r, n)
        # (blocks go out in ascending order and none comes back: the pages the layers hold
        # are the ones handed out, the capacity doubling as they grow -- see _grown)
        need = alloc.num_blocks - alloc.num_free_blocks
        if need > state["capacity"]:
            state["capacity"] = min(state["blocks"], max(need, 2 * state["capacity"]))
        rows = None  # (HF's [B * Sq] rows, in order; None: all of them, as in a decode step)
        if len(order) != b or any(n != sq for n in lens) or order != list(range(b)):
            rows = _ranges(np.array([r * sq + new[r][0] for r in order], dtype=np.int64),
                           np.array(lens, dtype=np.int64))
            rows = None if np.array_equal(rows, np.arange(b * sq)) else _upload(rows, device)
        graphed = (self.cuda_graphs and self._graphs_on(device) and sq == 1 and rows is None
                   and len(order) == b and not torch.is_grad_enabled())
        if not graphed:  # (the graph buffers are not this step's: no advancing from them)
            state["last_graph"] = None
        # (the block table made on first use: a decode step advanced on the device needs none)
        plan = state["plan"] = dict(step=step, new=new, order=order, lens=lens, rows=rows,
                                    capacity=state["capacity"], built={}, table_of=(alloc, order),
                                    meta_of=(lens, seq, page, state["capacity"], device),
                                    scatter_of=(ctx, lens, page, device),
                                    graph=dict(padded=None, built={}) if graphed else None)
        return plan

    @staticmethod
    def _graphs_on(device) -> bool:
        """Whether decode steps on ``device`` take the graph path (CUDA graphs exist on CUDA
        devices only)."""
        return device.type == "cuda"

    @staticmethod
    def table(plan: dict) -> np.ndarray:
        """The plan's block table (its rows' pages, in its order), made on first use."""
        if "table" not in plan:
            alloc, order = plan.pop("table_of")
            plan["table"] = alloc.block_table(order)
        return plan["table"]

    @staticmethod
    def meta(plan: dict):
        """The plan's step metadata (:func:`~attn_ops.metadata.build_common_metadata`), made on
        first use: a decode step whose layers all replay graphs needs none -- its graph
        metadata comes from the host arrays (:meth:`graph_metadata`)."""
        if "meta" not in plan:
            from attn_ops.metadata import build_common_metadata

            lens, seq, page, capacity, device = plan["meta_of"]
            plan["meta"] = build_common_metadata(lens, seq, _Steps.table(plan), page, capacity,
                                                 device=device) if lens else None
        return plan["meta"]

    @staticmethod
    def scatter(plan: dict):
        """The plan's :func:`_scatter_rows`, made on first use (a step whose layers all
        replay graphs uploads none)."""
        if "scatter" not in plan:
            plan["scatter"] = _scatter_rows(_Steps.table(plan), *plan.pop("scatter_of"))
        return plan["scatter"]

    def graph_metadata(self, plan: dict, layer, page: int) -> dict:
        """``layer``'s CUDA-graph metadata for a decode step's ``plan`` (``{metadata key:
        metadata}``): the step padded into the page size's persistent buffers once, each
        backend's metadata built from them once (host planning included) for the layers
        sharing its key. The buffers are as wide as a row of ``max_tokens`` needs, so the
        graphs stay valid as the rows grow. A step one token past the last graphed step in
        every row, none entering a page, advances the buffers on the device
        (:meth:`~attn_ops.cudagraph.CUDAGraphBatch.advance`: no block table, slots or uploads
        made on the host) and each backend's metadata from the step before
        (``advance_graph_metadata``: no host planning where the backend can)."""
        state, step = self.by_page[page], plan["graph"]
        if step["padded"] is None:
            from attn_ops.cudagraph import CUDAGraphBatch

            _, seq, _, capacity, device = plan["meta_of"]
            if state.get("graphs") is None:
                state["graphs"] = CUDAGraphBatch((self.batch,), -(-self.max_tokens // page), page,
                                                 device)
            last = state["last_graph"]
            if (last is not None and last["capacity"] == capacity and len(last["seq"]) == len(seq)
                    and all(s == t + 1 and t % page for s, t in zip(seq, last["seq"]))):
                step["padded"] = state["graphs"].advance(last["padded"])
                step["before"] = last["built"]  # (each backend's metadata, advanced from)
            else:
                # (a step of one new token a row, in row order: each token's slot from the
                # table)
                from attn_ops.metadata import host_slots

                table = _Steps.table(plan)
                slots = host_slots(table, np.arange(len(seq)),
                                   np.array(seq, dtype=np.int64) - 1, page)
                step["padded"] = state["graphs"].pad_arrays(np.array(seq, dtype=np.int32),
                                                            table, slots, capacity)
            state["last_graph"] = dict(seq=seq, capacity=capacity, padded=step["padded"],
                                       built=step["built"])
        key = layer._metadata_key
        if key not in step["built"]:
            before = step.get("before", {}).get(key)
            step["built"][key] = (
                layer.impl.graph_metadata(step["padded"], state["graphs"]) if before is None
                else layer.impl.advance_graph_metadata(before, step["padded"], state["graphs"]))
        return {key: step["built"][key]}

    def tokens(self, page: int) -> list[int]:
        """Each row's unpadded tokens in the pages (the current step's included)."""
        state = self.by_page[page]
        out = list(state["written"])
        if state["plan"] is not None:
            for r, n in zip(state["plan"]["order"], state["plan"]["lens"]):
                out[r] += n
        return out


def _scatter_rows(table: np.ndarray, ctx: list[int], lens: list[int], page: int, device):
    """For a step of one new token a row, none entering a page: the rows of the new tokens'
    keys and values in an NHD cache viewed as ``[blocks * 2 * page, heads, dim]`` (``[2,
    tokens]``; :func:`_scatter_write`); else None. A token entering a page goes through the
    cache-write op, which also clears the page's tail (what an earlier owner left there)."""
    if not lens or any(n != 1 for n in lens) or any(c % page == 0 for c in ctx):
        return None
    at = np.array(ctx, dtype=np.int64)
    blocks = table[np.arange(len(ctx)), at // page].astype(np.int64)
    keys = blocks * 2 * page + at % page
    return _upload(np.stack([keys, keys + page]), device)


def _upload(a: np.ndarray, device) -> torch.Tensor:
    """An int64 host array on ``device`` without blocking the host
    (:func:`attn_ops.metadata.pack_upload`: pinned staging on a GPU)."""
    from attn_ops.metadata import pack_upload

    packed, _ = pack_upload([a], [], device)  # (an int64 array first: at offset 0)
    return packed[:2 * a.size].view(torch.int64).view(a.shape)


def _scatter_write(kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   rows: torch.Tensor) -> bool:
    """Write a step's new ``key`` / ``value`` ``[T, H, D]`` at ``rows``
    (:func:`_scatter_rows`) into ``kv``, a contiguous NHD cache of their dtype, with two
    ``index_copy_`` calls: a decode's write then costs two native launches on the host, not
    the write op's checks and Triton launch. False (nothing written): another layout or an
    fp8 / quantized cache, which the layer's own write serves."""
    if (kv.dim() != 5 or kv.dtype != key.dtype or value.dtype != key.dtype
            or tuple(kv.shape[3:]) != tuple(key.shape[1:])
            or tuple(value.shape[1:]) != tuple(key.shape[1:]) or not kv.is_contiguous()):
        return False
    flat = kv.view(-1, kv.shape[3], kv.shape[4])
    flat.index_copy_(0, rows[0], key)
    flat.index_copy_(0, rows[1], value)
    return True


def _grown(layer, kv, capacity: int, device):
    """A layer's pages (the selected backend's layout) at the step's ``capacity`` blocks, the
    held ones copied over. The capacity doubles as the rows' pages outgrow it (at most the
    cache's ``max_tokens`` for every row): a cache made for a long ``max_tokens`` holds the
    pages its rows have reached, as HF's dynamic cache does, and copies them a logarithmic
    number of times a generation."""
    grown = layer.allocate_kv_cache(capacity, device)
    if kv is not None:
        grown[:kv.shape[0]].copy_(kv)
    return grown


def _layer_class():
    _, mixin = _cache_classes()

    class AttnOpsLayer(mixin):
        """One layer's K/V in attn_ops pages (its tensor; the pages, counts and step plans
        shared with the cache's other layers: :class:`_Steps`); ``length`` counts positions
        HF has seen (pads included), which its masks are sized by."""

        is_sliding = False
        is_compileable = False

        def __init__(self, steps: _Steps, index: int, **kwargs):
            super().__init__()
            self.steps, self.index = steps, index
            self.length = 0
            self.kv = None
            self.pending = False  # (new tokens returned by update, not yet attended)
            # (the decode graph: (layer, kv, static inputs, graph, output), and the layer whose
            # graph-metadata run warmed it up -- _graphed)
            self.graph, self.warmed, self.replays = None, None, 0
            self.captures: list[int] = []  # (the pages held at each capture)
            self.kv_for = None  # (the attn_ops layer whose layout kv has)

        def restart(self) -> None:
            """Serve a new generation (:meth:`_Steps.restart`): no tokens seen; the pages and
            the decode graph kept (the graph replays again from its first decode step)."""
            self.length, self.pending, self.replays = 0, False, 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if key_states.shape[0] != self.steps.batch:
                raise ValueError(f"attn_ops cache: batch {key_states.shape[0]}, the cache was "
                                 f"made for {self.steps.batch} rows (attn_ops.hf.cache(model, "
                                 f"batch={key_states.shape[0]}, ...))")
            if self.pending:
                raise ValueError(
                    f"attn_ops cache (layer {self.index}): the keys its last update returned "
                    "never reached the attention function -- the model changes them in "
                    "between, which attn_ops.hf.cache cannot follow; use HF's own cache")
            self.length += key_states.shape[2]
            self.pending = True
            _hand_over(key_states, self)
            return key_states, value_states

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.length + query_length, 0

        def get_seq_length(self) -> int:
            return self.length

        def get_max_length(self) -> int:
            return self.steps.max_tokens

        def _refuse(self, *args, **kwargs):
            raise ValueError("attn_ops cache: resetting, cropping and beam reordering are not "
                             "served (one greedy / sampled generation a cache); make a new one")

        reset = crop = batch_repeat_interleave = batch_select_indices = _refuse

        def attend(self, module, layer, query, key, value, mask):
            """Write each row's unpadded new tokens after its history, then attend: ``[B,
            Sq, Hq, Dv]``, zeros on padded query rows."""
            b, hq, sq, _ = query.shape
            if key.shape[2] != sq:
                raise ValueError(f"attn_ops cache ({_where(module)}): {key.shape[2]} new keys "
                                 f"for {sq} queries")
            self.pending = False
            page = layer.block_size
            plan = self.steps.plan(self.length, page, mask, sq, module, query.device)
            if self.kv is not None and (self.kv_for is not layer
                                        or self.kv.device != query.device):
                # (pages kept from a generation over another layer or device: not reused)
                self.kv = self.graph = None
            if self.kv is None or self.kv.shape[0] != plan["capacity"]:
                self.kv, self.kv_for = _grown(layer, self.kv, plan["capacity"], query.device), layer
            rows = plan["rows"]
            if plan["graph"] is not None and layer.cudagraph_support >= _DECODE_GRAPHS:
                return self._graphed(layer, self.steps.graph_metadata(plan, layer, page), query,
                                     key, value)
            if rows is None:  # (every row's every token, in order: a decode step, say)
                new_k, new_v = _rows_of(key), _rows_of(value)
                scatter = self.steps.scatter(plan)
                if scatter is not None and _scatter_write(self.kv, new_k, new_v, scatter):
                    new_k = new_v = None  # (written: the layer attends over the cache)
                got = layer(_rows_of(query), new_k, new_v, self.kv,
                            _built(plan["built"], layer, self.steps.meta(plan)))
                return got.to(query.dtype).view(b, sq, hq, value.shape[3])
            out = query.new_zeros(b * sq, hq, value.shape[3])
            if plan["order"]:
                got = layer(*(_rows_of(t).index_select(0, rows) for t in (query, key, value)),
                            self.kv, _built(plan["built"], layer, self.steps.meta(plan)))
                out.index_copy_(0, rows, got.to(out.dtype))
            return out.view(b, sq, hq, value.shape[3])

        def _graphed(self, layer, meta, query, key, value):
            """A decode step's write and attention (HF's ``[B, H, 1, D]``, ``[B, 1, Hq, Dv]``
            out) replayed from this layer's CUDA graph: captured on the step after its first
            run over graph metadata (which compiles and sets up what the capture cannot) and
            again whenever its pages are reallocated (:func:`_grown`: a logarithmic number of
            times); the output is the graph's, rewritten by the layer's next replay (the model
            consumes it before). The graph takes HF's tensors as they are and gives its output
            as HF takes it: a replay's host cost is one copy call and the launch, no views."""
            got = self.graph
            if got is not None and got[0] is layer and got[1] is self.kv:
                # (one call for the three inputs: one launch where they are dense, as a decode
                # step's rows are)
                torch._foreach_copy_(got[2], (query, key, value))
                got[3].replay()
                self.replays += 1
                return got[4]

            def step(q, k, v):  # (HF's tensors in, HF's output shape out)
                out = layer(_rows_of(q), _rows_of(k), _rows_of(v), self.kv, meta)
                return out.to(q.dtype).view(q.shape[0], 1, q.shape[1], v.shape[3])

            if self.warmed is not layer:
                self.warmed = layer
                return step(query, key, value)
            steps = self.steps
            statics = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
                            for t in (query, key, value))
            current = torch.cuda.current_stream()
            steps.stream = steps.stream or torch.cuda.Stream(device=query.device)
            steps.stream.wait_stream(current)
            graph = torch.cuda.CUDAGraph()
            # (capture_begin directly: torch.cuda.graph would also synchronize the device and
            # collect garbage, milliseconds a capture)
            with torch.cuda.stream(steps.stream):
                graph.capture_begin(pool=steps.pool, capture_error_mode="thread_local")
                try:
                    out = step(*statics)
                finally:
                    graph.capture_end()
            current.wait_stream(steps.stream)
            steps.pool = graph.pool()
            self.graph = (layer, self.kv, statics, graph, out)
            self.captures.append(self.kv.shape[0])
            graph.replay()
            self.replays += 1
            return out

    return AttnOpsLayer


def _hf_layers(model) -> list:
    """The layers HF's ``DynamicCache`` makes for ``model``'s text config, one an index."""
    from transformers import DynamicCache

    return list(DynamicCache(config=model.config.get_text_config(decoder=True)).layers)


def _attention_layer(layer) -> bool:
    """Whether an HF cache layer holds an attention layer's K/V alone (a full or a sliding
    layer: the ones attn_ops pages replace)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    return type(layer) in (DynamicLayer, DynamicSlidingWindowLayer)


def cache_supported(model) -> str | None:
    """Why :func:`cache` cannot serve ``model`` (None: it can): its attention layers go
    through the attention interface, each its own cache layer -- a hybrid model's recurrent
    layers keep HF's (their conv and recurrent states), the MLA modules
    :func:`~attn_ops.hf.patch` runs over HF's latent caches do not."""
    return _refusal(model)[0]


def _refusal(model) -> tuple[str | None, list]:
    """``(why not, HF's cache layers for model)`` (:func:`cache_supported`; the layers, laid
    out once, are what :func:`_owned_cache` builds on)."""
    if any("_attn_ops_mla" in m.__dict__ for m in model.modules()):
        return ("its MLA modules are patched (attn_ops.hf.patch), and they read HF's latent "
                "caches (use HF's cache)"), []
    try:
        layers = _hf_layers(model)
    except Exception as e:  # noqa: BLE001 -- a config HF's dynamic cache cannot lay out
        return f"HF's DynamicCache cannot lay out its layers ({type(e).__name__}: {e})", []
    mixed = sorted({type(layer).__name__ for layer in layers if not _attention_layer(layer)
                    and hasattr(layer, "keys")})
    if mixed:  # (a layer keeping K/V beside other state: one cache layer, not two)
        return (f"its cache layers {mixed} hold K/V beside other state, which attn_ops.hf.cache "
                "cannot split (use HF's cache)"), layers
    if not any(_attention_layer(layer) for layer in layers):
        return "it has no attention layer", layers
    return None, layers


def cache(model, batch: int, max_tokens: int, *, cuda_graphs: bool = True):
    """A transformers ``Cache`` keeping every attention layer's K/V of ``model`` in attn_ops
    pages (module docstring), a hybrid model's other layers in HF's own cache layers:
    ``batch`` rows of at most ``max_tokens`` unpadded tokens each (prompt and generated). Pass
    it as ``cache`` (``past_key_values`` before transformers 5.2x) to ``generate`` (or a
    forward) of a model using ``attn_implementation="attn_ops"``; what it cannot serve is
    refused (:func:`cache_supported`). ``cuda_graphs``: decode steps on a GPU replay each
    layer's write and attention from a CUDA graph where its backend allows (:class:`_Steps`);
    False: every step eagerly."""
    why, layers = _refusal(model)
    if why is not None:
        raise ValueError(f"attn_ops.hf.cache: {why}; use HF's own cache (each call then copies "
                         "the history into a step cache)")
    return _owned_cache(layers, batch, max_tokens, cuda_graphs)


# (model -> (steps, {index: attn_ops cache layer}) of the last cache generate made for it
# that is gone: what the next generate of as many rows and no more tokens takes over -- the
# pages, graph buffers and decode graphs, so a model captures its graphs once, not once a
# generate)
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _keep(model_ref, steps: _Steps, ours: dict) -> None:
    """A generate cache of ``model_ref()`` is gone: keep its pages and graphs for the next
    (one set a model: the last replaces the one before)."""
    model = model_ref()
    if model is not None:
        _KEPT[model] = (steps, ours)


def _take_kept(model, batch: int, max_tokens: int, cuda_graphs: bool, indices: list[int]):
    """What :func:`_keep` kept for ``model`` if it serves ``batch`` rows of ``max_tokens``
    tokens over the attention layers ``indices``, restarted (:meth:`_Steps.restart`); else
    None (and what was kept is dropped: the pages a model keeps are its last generation's)."""
    kept = _KEPT.pop(model, None) if model is not None else None
    if kept is None:
        return None
    steps, ours = kept
    if (steps.batch != batch or steps.reach < max_tokens or steps.cuda_graphs != cuda_graphs
            or sorted(ours) != indices):
        return None
    steps.restart(max_tokens)
    for layer in ours.values():
        layer.restart()
    return steps, ours


def release(model) -> bool:
    """Drop the pages and decode graphs ``model``'s last ``generate`` left for the next one
    (:func:`generate_cache_for`); their memory goes back to torch's allocator. False: none
    were kept."""
    return _KEPT.pop(model, None) is not None


def _owned_cache(layers: list, batch: int, max_tokens: int, cuda_graphs: bool = True,
                 model=None):
    """The cache of :func:`cache` (its classes defined on first use: transformers is imported
    only then): HF's cache ``layers`` for the model, its attention ones replaced by attn_ops'.
    ``model``: a cache ``generate`` makes -- it takes over what the model's last such cache
    kept (:func:`_take_kept`) and keeps its own when it is gone."""
    base, _ = _cache_classes()
    layer_cls = _layer_class()
    indices = [i for i, layer in enumerate(layers) if _attention_layer(layer)]

    class AttnOpsCache(base):
        attn_ops_owned = True

        def __init__(self):
            kept = _take_kept(model, batch, max_tokens, cuda_graphs, indices)
            if kept is None:
                steps = _Steps(batch, max_tokens, cuda_graphs)
                kept = steps, {i: layer_cls(steps, i) for i in indices}
            self.steps, ours = kept
            super().__init__(layers=[ours.get(i, layer) for i, layer in enumerate(layers)])
            if model is not None:  # (not at the interpreter's exit: nothing to keep for)
                weakref.finalize(self, _keep, weakref.ref(model), self.steps,
                                 ours).atexit = False

    return AttnOpsCache()


# (whether generate() of a model running "attn_ops" makes an attn_ops cache by default, and
# with decode graphs: register(generate_cache=..., cuda_graphs=...))
_GENERATE_CACHE = {"on": False, "graphs": True}
_SERVED_MODES = ("greedy_search", "sample")


def generate_cache_for(model, generation_config, model_kwargs, generation_mode,
                       batch_size: int, max_cache_length: int):
    """The :func:`cache` that ``generate`` of ``model`` makes where the caller passed none
    (None: HF makes its own): a model running ``"attn_ops"`` that :func:`cache_supported`
    serves, generating greedily or by sampling, one sequence a cache row,
    with no ``cache_implementation`` asked for (``"dynamic"`` keeps HF's ``DynamicCache``) --
    not beam search, assisted decoding or an assistant model, which crop and reorder rows."""
    text = model.config.get_text_config(decoder=True)
    if not _GENERATE_CACHE["on"] or getattr(text, "_attn_implementation", None) != "attn_ops":
        return None
    if any(model_kwargs.get(n) is not None for n in ("cache", "past_key_values")):
        return None
    mode = getattr(generation_mode, "value", generation_mode)
    if (mode not in _SERVED_MODES or generation_config.use_cache is False
            or generation_config.cache_implementation is not None
            or getattr(generation_config, "is_assistant", False)
            or model.config.is_encoder_decoder or not model._supports_default_dynamic_cache()):
        return None
    why, layers = _refusal(model)
    if why is not None:
        return None
    rows = batch_size * max(generation_config.num_beams or 1,
                            generation_config.num_return_sequences or 1)
    return _owned_cache(layers, rows, max_cache_length, _GENERATE_CACHE["graphs"], model)


def _install_generate_cache() -> None:
    """Let ``generate`` make :func:`generate_cache_for`'s cache (once: the hook reads
    ``_GENERATE_CACHE`` at every call, so turning it off needs no unpatching)."""
    import inspect

    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin._prepare_cache_for_generation
    if getattr(original, "_attn_ops", False):
        return

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode,
                                      batch_size, max_cache_length):
        owned = generate_cache_for(self, generation_config, model_kwargs, generation_mode,
                                   batch_size, max_cache_length)
        if owned is None:
            return original(self, generation_config, model_kwargs, generation_mode, batch_size,
                            max_cache_length)
        # (transformers 5.2x names it cache=; earlier ones past_key_values=)
        name = "cache" if "cache" in inspect.signature(self.forward).parameters \
            else "past_key_values"
        model_kwargs[name] = owned

    _prepare_cache_for_generation._attn_ops = True
    _prepare_cache_for_generation.__doc__ = original.__doc__
    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation

