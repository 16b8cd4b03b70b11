"""``"paged|attn_ops"``: continuous batching over HF's ``PagedAttentionCache`` (the package
docstring)."""

from __future__ import annotations

import numpy as np
import torch

from attn_ops.hf.common import (_StepPlan, _built, _decodes_first, _layer, _ranges,
                                 _scratch_step, _slots, _where)
class _PagedStep(_StepPlan):
    """One continuous-batching step's plan, made once for all its layers: the requests with new
    tokens in the order a step takes them, pages holding exactly each one's history
    (``metadata``, ``slots``), and the rows of HF's packed queries (``query_rows``) and
    gathered keys (``key_rows``) in that order -- one gather of each and one scatter of the
    output a layer, whatever the number of requests."""

    def __init__(self, cu_q: list[int], cu_k: list[int], page: int, device) -> None:
        live = [i for i in range(len(cu_q) - 1) if cu_q[i + 1] > cu_q[i]]
        totals = [cu_k[i + 1] - cu_k[i] for i in live]
        lens = [cu_q[i + 1] - cu_q[i] for i in live]
        order, pages, self.metadata = _scratch_step(page, totals, lens, device)
        self.blocks = pages.blocks

        def rows(starts, counts):
            return torch.from_numpy(_ranges(
                np.array([starts[live[j]] for j in order], dtype=np.int64),
                np.array([counts[j] for j in order], dtype=np.int64))).to(device)

        self.query_rows = rows(cu_q, lens)
        self.key_rows = rows(cu_k, totals)
        self.slots = _slots(pages, order, totals, device)


def _step_memo(cache, cu_q, cu_k, group: str) -> tuple[list[int], list[int], dict]:
    """``(cu_seq_lens_q, cu_seq_lens_k, plans)`` of the step for a layer ``group`` of HF's
    cache, read on the host by the group's first layer of the step: the layers of a step get
    the same offset tensors, unmodified (their version counters say so), so the host reads
    them once a step, not once a layer; ``plans``: the step's plans, made once each."""
    import weakref

    if isinstance(cu_k, dict):
        cu_k = cu_k[group]
    memo = cache.__dict__.setdefault("_attn_ops_steps", {}).get(group)
    # (the same tensor objects -- a freed one's address may be another's -- at the same
    # versions: nothing wrote them since)
    if memo is None or memo[0]() is not cu_q or memo[1]() is not cu_k or \
            memo[2] != (cu_q._version, cu_k._version):
        memo = cache.__dict__["_attn_ops_steps"][group] = (
            weakref.ref(cu_q), weakref.ref(cu_k), (cu_q._version, cu_k._version),
            cu_q.tolist(), cu_k.tolist(), {})
    return memo[3], memo[4], memo[5]


def _paged_step(cache, cu_q, cu_k, group: str, page: int, device) -> _PagedStep | None:
    """The step's :class:`_PagedStep` for a layer ``group`` of HF's cache (None: no request
    has new tokens)."""
    q_list, k_list, plans = _step_memo(cache, cu_q, cu_k, group)
    if page not in plans:
        live = any(q_list[i + 1] > q_list[i] for i in range(len(q_list) - 1))
        plans[page] = _PagedStep(q_list, k_list, page, device) if live else None
    return plans[page]


class _InPlaceStep(_StepPlan):
    """One continuous-batching step's plan over HF's own pages (a full-attention group of a
    cache :func:`_hf_planes` took over), made once for all its layers: each request with new
    tokens in decode-first order, its block table read from HF's read index -- the cache row of
    its first token of every page, over the page size: HF lays a request's positions page by
    page, position ``p`` at row ``table[p // page] * page + p % page`` -- and the rows of HF's
    packed queries and new keys in that order. A step with no history to read has an empty
    read index; its requests' pages are then those their new tokens are written to."""

    def __init__(self, cu_q: list[int], cu_k: list[int], read_index, write_index, page: int,
                 num_blocks: int, device) -> None:
        from attn_ops.metadata import build_common_metadata
        from attn_ops.ops import debug_checks_enabled

        live = [i for i in range(len(cu_q) - 1) if cu_q[i + 1] > cu_q[i]]
        lens = [cu_q[i + 1] - cu_q[i] for i in live]
        totals = [cu_k[i + 1] - cu_k[i] for i in live]
        index, starts = read_index, cu_k
        if read_index.numel() == 0:
            if totals != lens:
                raise ValueError(f"paged|attn_ops: HF's step has no read index but requests "
                                 f"with history (key lengths {totals}, new tokens {lens})")
            index, starts = write_index, cu_q
        order = _decodes_first(range(len(live)), lens)
        pages = [-(-totals[j] // page) for j in order]
        firsts = torch.tensor([starts[live[j]] + p * page for j, n in zip(order, pages)
                               for p in range(n)], dtype=torch.long, device=index.device)
        blocks = (index.index_select(0, firsts) // page).tolist()
        tables, at = [], 0
        for n in pages:
            tables.append(blocks[at:at + n])
            at += n
        if debug_checks_enabled():  # (every row of the index where the tables say it is)
            for j, table in zip(order, tables):
                pos = torch.arange(totals[j])
                want = torch.tensor(table)[pos // page] * page + pos % page
                got = index[starts[live[j]]:starts[live[j]] + totals[j]].cpu()
                if not torch.equal(got, want.to(got.dtype)):
                    raise ValueError(f"paged|attn_ops: request {live[j]}'s rows in HF's cache "
                                     "are not laid page by page; this transformers' paged "
                                     "cache is not one attn_ops reads in place")
        self.metadata = build_common_metadata([lens[j] for j in order],
                                              [totals[j] for j in order], tables, page,
                                              num_blocks, device=device)
        rows = torch.from_numpy(_ranges(np.array([cu_q[live[j]] for j in order], dtype=np.int64),
                                        np.array([lens[j] for j in order], dtype=np.int64)))
        # (None: every packed row, in order -- a decode-only step from HF's FIFO scheduler)
        self.query_rows = None if torch.equal(rows, torch.arange(cu_q[-1])) else rows.to(device)


class _RingStep(_StepPlan):
    """One decode-only step of a sliding-window group over HF's own pages (a window a whole
    number of pages: HF's ring holds position ``p`` at ring page ``(p // page) % (W /
    page)``, offset ``p % page``). Each request's keys -- the ``k = min(past, W - 1)``
    positions HF's read index names, then its new token at the write index -- become a
    request of virtual positions ``u = off + v`` (``off``: the first key's offset in its
    page), so every virtual page is one ring page; the ``off`` positions before the first key
    fall outside the window of the one query (``W`` keys back from ``off + k``). Two small
    reads of HF's indices a step: the first keys' rows, then each virtual page's."""

    def __init__(self, cu_q: list[int], cu_k: list[int], read_index, write_index, page: int,
                 num_blocks: int, device) -> None:
        from attn_ops.metadata import build_common_metadata

        n = len(cu_q) - 1
        live = [i for i in range(n) if cu_q[i + 1] > cu_q[i]]
        past = [cu_k[i + 1] - cu_k[i] - 1 for i in live]
        rows = torch.cat([read_index, write_index])  # (a new token's row: past the reads)
        reads = read_index.shape[0]

        def row(i, k, v):  # (the index of key v of request i, of k past keys, in `rows`)
            return cu_k[i] + v if v < k else reads + cu_q[i]

        def fetch(at):
            return rows.index_select(0, torch.tensor(at, dtype=torch.long,
                                                     device=rows.device)).tolist()

        offs = [r % page for r in fetch([row(i, k, 0) for i, k in zip(live, past)])]
        lengths = [o + k + 1 for o, k in zip(offs, past)]
        starts = [[row(i, k, max(j * page, o) - o) for j in range(-(-total // page))]
                  for i, k, o, total in zip(live, past, offs, lengths)]
        blocks = [r // page for r in fetch([a for at in starts for a in at])]
        tables, at = [], 0
        for first in starts:
            tables.append(blocks[at:at + len(first)])
            at += len(first)
        self.metadata = build_common_metadata([1] * len(live), lengths, tables, page,
                                              num_blocks, device=device)
        rows_q = torch.tensor([cu_q[i] for i in live])
        self.query_rows = None if torch.equal(rows_q, torch.arange(cu_q[-1])) else \
            rows_q.to(device)


def _hf_planes(cache) -> list | None:
    """The planes ``[2, blocks, page, Hkv, D]`` (K, V) of each of HF's layer tensors, which
    the cache's first attention call made HF's own (None: it could not; :func:`_take_over`)."""
    state = cache.__dict__.get("_attn_ops_planes")
    if state is None:
        state = cache.__dict__["_attn_ops_planes"] = _take_over(cache)
    return state or None


def _take_over(cache) -> list | bool:
    """Replace each of HF's per-layer K / V tensors ``[(blocks + 2) * page, Hkv, D]`` by the
    two planes of one tensor of ours, freeing each pair before allocating its replacement (no
    more memory at any point). HF reads and writes the planes through its lists as before; an
    attn_ops backend reads them in place (:func:`~attn_ops.kv_cache.kv_cache_planes`). Only
    ``"paged|attn_ops"`` writes the cache, and its first call comes before any write, so
    nothing is copied (the zeroed planes hold HF's zeroed read-trash page). A tensor held
    beyond HF's lists (a view HF's CPU offloading keeps) is put back and nothing more is taken
    over (False): writes into a replaced tensor would never reach that holder."""
    import weakref

    keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    page = getattr(cache, "block_size", None)
    if not keys or not isinstance(page, int) or values is None or len(values) != len(keys):
        return False
    rows, heads, dim = keys[0].shape if keys[0].dim() == 3 else (0, 0, 0)
    dtype, device = keys[0].dtype, keys[0].device
    if not rows or rows % page or any(t.shape != (rows, heads, dim) or t.dtype != dtype
                                      or t.device != device for t in (*keys, *values)):
        return False
    planes = []
    for j in range(len(keys)):
        held = weakref.ref(keys[j]), weakref.ref(values[j])
        keys[j] = values[j] = None
        if held[0]() is not None or held[1]() is not None:
            keys[j], values[j] = (ref() if ref() is not None else
                                  torch.zeros(rows, heads, dim, dtype=dtype, device=device)
                                  for ref in held)
            return False
        both = torch.zeros(2, rows // page, page, heads, dim, dtype=dtype, device=device)
        keys[j], values[j] = both[0].view(rows, heads, dim), both[1].view(rows, heads, dim)
        for t in (keys[j], values[j]):
            torch._dynamo.mark_static_address(t)
        planes.append(both)
    return planes


def _reads_in_place(cache, layer, sliding_window, layer_idx) -> str | None:
    """Why ``layer`` does not read HF's paged cache in place (None: it does)."""
    from attn_ops.platforms import platform_of

    groups = getattr(cache, "layer_index_to_group_indices", None)
    # (taken over at the cache's first call, whatever its layer: the layers of every group
    # share HF's tensors, and a window layer's writes must land in the planes too)
    planes = _hf_planes(cache) if groups is not None else None
    if planes is None:
        return ("HF's paged cache could not be taken over (its layout is not one tensor a "
                "layer and plane, or a tensor of it is held elsewhere, as by CPU offloading): "
                "each request's history is gathered and copied into a cache of the step")
    spec, cls = layer.spec, layer.selection.backend_cls
    both = planes[groups[layer_idx][1]]
    page = both.shape[2]
    if not cls.reads_kv_planes(spec) or spec.v_head_dim != spec.head_dim:
        return f"{cls.name} does not read a cache held as HF's K and V planes"
    if both.dtype != spec.cache_dtype or tuple(both.shape[3:]) != (spec.kv_heads, spec.head_dim):
        return (f"HF's cache holds {tuple(both.shape[3:])} {both.dtype}, the layer "
                f"{(spec.kv_heads, spec.head_dim)} {spec.cache_dtype}")
    if any(r.code == "block_size" for r in cls.not_supported_reasons(
            spec.with_(block_size=page), platform_of(both.device))):
        return f"{cls.name} does not take HF's page of {page} tokens"
    if sliding_window and sliding_window % page:
        return (f"a sliding-window layer whose window of {sliding_window} is not whole pages of "
                f"{page}: HF's ring of pages is indexed modulo the window; each step copies "
                "the window HF gathers into a cache of the step")
    return None


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None,
                            dropout=0.0, sliding_window=None, softcap=None, s_aux=None,
                            **kwargs):
    """``"paged|attn_ops"``: continuous batching over HF's ``PagedAttentionCache`` (the
    transformers that let the attention function write it, 5.17 and its neighbours). A
    full-attention layer reads and writes HF's pages in place: the cache's first call takes
    HF's K / V tensors over as the planes of attn_ops caches (:func:`_take_over`), the step's
    block tables are read from HF's read index once a step (:class:`_InPlaceStep`), and the
    module's :class:`~attn_ops.Attention` writes the new tokens where HF's write index would
    and attends. A sliding-window layer whose window is whole pages does so at decode-only
    steps over HF's ring (:class:`_RingStep`). Other window steps (or a cache or backend that
    cannot be read in place: :func:`describe` says why) let the cache's own ``update`` write
    and gather each request's history and run over a copy of it (:class:`_PagedStep`).
    Returns ``[1, T, Hq, Dv]``, padding rows zero."""
    from attn_ops.kv_cache import kv_cache_planes, kv_cache_update

    cache = kwargs.pop("cache", None)
    if cache is None:
        raise ValueError(f"paged|attn_ops ({_where(module)}) was called without HF's paged "
                         "cache: continuous batching passes one; use 'attn_ops' for a "
                         "standard forward")
    if dropout and module.training:
        raise ValueError(f"paged|attn_ops ({_where(module)}): dropout={dropout} in training")
    if torch.compiler.is_compiling() or (query.is_cuda
                                         and torch.cuda.is_current_stream_capturing()):
        raise ValueError(f"paged|attn_ops ({_where(module)}) plans each step on the host and "
                         "cannot be compiled or captured in HF's CUDA graphs; run continuous "
                         "batching with ContinuousBatchingConfig(use_cuda_graph=False, "
                         "default_compile_level=0), its defaults for this implementation")
    layer = _layer(module, query, key, value, scaling, sliding_window, softcap, s_aux)
    out_shape = (1, query.shape[2], query.shape[1], value.shape[3])
    group = "sliding_attention" if sliding_window else "full_attention"
    modes = cache.__dict__.setdefault("_attn_ops_modes", {})  # (layer -> why not in place)
    if layer not in modes:
        modes[layer] = _reads_in_place(cache, layer, sliding_window, module.layer_idx)
        module.__dict__["_attn_ops_paged"] = modes[layer] or (
            "reads HF's paged cache in place" + (" at decode-only steps (others copy the "
                                                 "window HF gathers)" if sliding_window else ""))
    in_place = modes[layer] is None
    if in_place:
        q_list, k_list, plans = _step_memo(cache, kwargs["cu_seq_lens_q"],
                                           kwargs["cu_seq_lens_k"], group)
        lens = [q_list[i + 1] - q_list[i] for i in range(len(q_list) - 1)]
        # (a window layer's ring holds the window only after its step's writes: in place at
        # decode-only steps, whose one query a request needs no key the write replaces)
        in_place = not sliding_window or max(lens, default=0) <= 1
    if in_place:
        g, j = cache.layer_index_to_group_indices[module.layer_idx]
        both = cache.__dict__["_attn_ops_planes"][j]
        if "in place" not in plans:
            plan = _RingStep if sliding_window else _InPlaceStep
            plans["in place"] = plan(
                q_list, k_list, kwargs["read_index"][g], kwargs["write_index"][g],
                both.shape[2], both.shape[1], query.device) if max(lens, default=0) else None
        step = plans["in place"]
        if step is None:
            return query.new_zeros(out_shape), None
        rows = step.query_rows
        whole = rows is None and query.shape[2] == step.metadata.num_actual_tokens
        if rows is None:
            rows = torch.arange(step.metadata.num_actual_tokens, device=query.device)
        q, k, v = (t[0].transpose(0, 1) if whole else t[0].transpose(0, 1).index_select(0, rows)
                   for t in (query, key, value))
        if sliding_window:  # (written as HF does: the layer's write would zero the rest of a
            # ring page it enters, which holds the window's older keys)
            slots = step.metadata.slot_mapping
            both[0].view(-1, *both.shape[3:]).index_copy_(0, slots, k.to(both.dtype))
            both[1].view(-1, *both.shape[3:]).index_copy_(0, slots, v.to(both.dtype))
            k = v = None
        views = cache.__dict__.setdefault("_attn_ops_views", {})  # (one view a tensor: the
        # backends' per-cache memos hold across steps)
        if j not in views:
            views[j] = kv_cache_planes(both)
        got = layer(q, k, v, views[j], _built(step.built, layer, step.metadata))
        if whole:
            return got.to(query.dtype)[None], None
        out = query.new_zeros(out_shape)
        out[0].index_copy_(0, rows, got.to(out.dtype))
        return out, None
    keys, values = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                read_index=kwargs["read_index"],
                                write_index=kwargs["write_index"])
    # (a window layer's gathered keys: its last min(past, W - 1) tokens, then the new ones --
    # every key its window reaches, in order, so the request's positions shift, not its
    # distances)
    step = _paged_step(cache, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], group,
                       layer.block_size, query.device)
    out = query.new_zeros(out_shape)
    if step is None:
        return out, None
    scratch = step.scratch(layer, query.device)
    kv_cache_update(keys.index_select(0, step.key_rows), values.index_select(0, step.key_rows),
                    scratch, step.slots, layer.k_scale, layer.v_scale)
    got = layer(query[0].transpose(0, 1).index_select(0, step.query_rows), None, None,
                scratch, _built(step.built, layer, step.metadata))
    out[0].index_copy_(0, step.query_rows, got.to(out.dtype))
    return out, None
