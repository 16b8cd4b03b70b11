"""HF transformers on attn_ops: ``attn_implementation="attn_ops"``.

:func:`register` (explicit, idempotent; importing attn_ops registers nothing) adds
``"attn_ops"`` to transformers' ``AttentionInterface`` -- the function below -- and to its
``AttentionMaskInterface`` with transformers' own ``flash_attention_mask`` builder: without a
mask registration HF hands a registered function no mask at all, and a left-padded batch would
silently attend to its padding. A model loaded or switched to the name then runs every attention
layer through our selector and ops:

* the spec is built from the call (heads and head dims from the tensors, ``scaling``,
  ``sliding_window``, ``softcap``, the sinks ``s_aux``), one :class:`~attn_ops.Attention` per
  HF module and spec, its backend selected for it (:func:`describe` prints each layer's);
* each batch row is a request: its keys are the row's unpadded run of the 2-D padding mask
  (none: all of them), its queries the row's last positions within that run -- a left-padded
  prompt, a decode, a right-padded prefill alike -- laid in a paged cache of the step and
  attended with the backend's kernels; padded query rows come back as zeros;
* what attn_ops cannot serve raises, naming the layer, the feature and what could serve it: a
  4-D (custom) mask, a mask whose row is not one run of keys, non-causal attention, dropout in
  training.

Where the K/V live:

* with :func:`cache` (``generate(..., cache=attn_ops.hf.cache(model, batch, max_tokens))``;
  ``past_key_values=`` before transformers 5.2x), in attn_ops' own paged caches for the
  cache's lifetime: its ``update`` returns the new tokens only, and the attention call that
  receives that very key tensor knows them for new (a model that changes the keys in between
  is refused at its next step), writes each row's unpadded new tokens after that row's history
  -- pads never enter a page -- and attends over the pages; nothing is copied again, and the
  step's plan (the rows' runs, the metadata) is made once for all layers;
* with HF's own caches (``DynamicCache``, static, sliding) each call is self-contained: the
  K/V HF hands over are copied into a paged cache of that step (a copy of the history per
  layer per step);
* under continuous batching (``"paged|attn_ops"``, where transformers accepts the name), in
  HF's ``PagedAttentionCache``: its first call makes HF's per-layer K / V tensors the planes
  of attn_ops caches, and full-attention layers write and read HF's pages in place, the block
  tables read from HF's read index once a step; window layers (HF keeps their windows in rings
  of pages) decode over the ring in place where the window is whole pages, and otherwise let
  the cache write and gather and run over a copy of the gathered windows
  (:func:`paged_attention_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_ops.selector import AttentionConfig
from attn_ops.spec import AttentionSpec

__all__ = ["ATTN_NAME", "PAGED_NAME", "Registration", "attention_forward", "cache",
           "cache_supported", "describe", "paged_attention_forward", "patch", "register",
           "spec_of_call"]

ATTN_NAME = "attn_ops"
PAGED_NAME = "paged|attn_ops"
_LAYERS_ATTR = "_attn_ops_layers"
# (id(key tensor) -> (its weakref, the AttnOpsCache layer that returned it from update))
_HANDED: dict[int, tuple] = {}
_CONFIG: dict[str, AttentionConfig | None] = {"config": None}


@dataclass(frozen=True)
class Registration:
    """What :func:`register` added: ``names`` registered, and why the paged name was not
    (empty where it was)."""

    names: tuple[str, ...]
    transformers_version: str
    paged_note: str


def _paged_note(version: str) -> str:
    """Why ``"paged|attn_ops"`` is not registered with this transformers ("" where it is)."""
    from packaging.version import Version

    if Version(version) >= Version("5.19"):  # (the first that rejects other names)
        return (f"transformers {version} serves continuous batching only with 'paged|eager', "
                "'sdpa' or a flash implementation (ContinuousBatchingManager rejects any other "
                "name), so 'paged|attn_ops' is not registered; its own names are left as they "
                "are")
    return ""


def register(config: AttentionConfig | None = None) -> Registration:
    """Register ``"attn_ops"`` in transformers' attention and mask interfaces (again: the
    same entries). ``config``: the :class:`~attn_ops.AttentionConfig` every layer is built with
    (a forced backend, tuning); layers already built keep theirs."""
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    _CONFIG["config"] = config
    AttentionInterface.register(ATTN_NAME, attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, flash_attention_mask)
    note = _paged_note(transformers.__version__)
    if note:
        return Registration((ATTN_NAME,), transformers.__version__, note)
    AttentionInterface.register(PAGED_NAME, paged_attention_forward)
    return Registration((ATTN_NAME, PAGED_NAME), transformers.__version__, "")


def _where(module) -> str:
    layer = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}" + (f" (layer {layer})" if layer is not None else "")


def spec_of_call(module, query, key, value, scaling, sliding_window, softcap,
                 sinks) -> AttentionSpec:
    """The :class:`AttentionSpec` of an HF attention call (``query [B, Hq, Sq, D]``, ``key``
    / ``value [B, Hkv, Skv, D(v)]``)."""
    hq, d = query.shape[1], query.shape[3]
    dv = value.shape[3]
    return AttentionSpec(num_heads=hq, num_kv_heads=key.shape[1], head_dim=d,
                         head_dim_v=None if dv == d else dv, dtype=query.dtype,
                         sliding_window=sliding_window or None, logits_soft_cap=softcap or None,
                         has_sinks=sinks is not None, scale=scaling)


def _layer(module, spec: AttentionSpec, device):
    """The module's :class:`~attn_ops.Attention` for ``spec`` (built once, kept on it)."""
    from attn_ops.layers.attention import Attention

    layers = module.__dict__.setdefault(_LAYERS_ATTR, {})
    layer = layers.get(spec)
    if layer is None:
        try:
            layer = Attention(spec, _CONFIG["config"]).to(device)
        except ValueError as e:  # (no backend serves it here: every reason, named)
            raise ValueError(f"attn_ops ({_where(module)}): {spec.describe()}: {e}") from e
        layers[spec] = layer
    return layer


def _requests(mask, b: int, sq: int, skv: int, module) -> list[tuple[int, int, int]]:
    """Each row's request as ``(key start, query start, end)``: keys ``[start, end)``, queries
    ``[query start, end)`` (the row's last positions within its run of keys)."""
    if mask is None:
        return [(0, skv - sq, skv)] * b
    if mask.dim() != 2 or mask.shape != (b, skv):
        raise ValueError(
            f"attn_ops ({_where(module)}): attention_mask {tuple(mask.shape)} is not the 2-D "
            f"[batch={b}, keys={skv}] padding mask attn_ops serves (a custom 4-D mask, say); "
            "load the model with attn_implementation='sdpa' or 'eager' for it, or express it "
            "as an attn_ops FLEX_ATTENTION mask_mod")
    keep = mask.bool().cpu()
    out = []
    for row in range(b):
        run = _run(keep[row])  # (no key: (skv, skv), every query row padding)
        if run is None:
            raise ValueError(
                f"attn_ops ({_where(module)}): attention_mask row {row} keeps keys that are "
                "not one run (holes inside it); attn_ops serves left or right padding -- use "
                "attn_implementation='sdpa' or 'eager' for this mask")
        out.append((run[0], max(run[0], skv - sq), run[1]))
    return out


def _run(keep: torch.Tensor) -> tuple[int, int] | None:
    """The run ``[lo, hi)`` of a mask row's kept positions (``(n, n)`` where none is kept);
    None where they are not one run."""
    idx = keep.nonzero().flatten()
    if not len(idx):
        return keep.shape[0], keep.shape[0]
    lo, hi = int(idx[0]), int(idx[-1]) + 1
    return (lo, hi) if hi - lo == len(idx) else None


def _decodes_first(ids, lens) -> list:
    """``ids`` in the order a step takes them: requests of one new token first."""
    return sorted(ids, key=lambda i: lens[i] > 1)


def _scratch_step(page: int, totals: list[int], lens: list[int], device):
    """A step over requests given whole (request ``i``: ``totals[i]`` tokens, its last
    ``lens[i]`` new): ``(order, allocator, blocks, metadata)`` over pages holding exactly
    theirs."""
    from attn_ops.kv_cache import BlockAllocator
    from attn_ops.metadata import build_batch

    order = _decodes_first(range(len(totals)), lens)
    blocks = sum(-(-n // page) for n in totals)
    alloc = BlockAllocator(blocks, page)
    meta = build_batch(alloc, order, [totals[i] - lens[i] for i in order],
                       [lens[i] for i in order], device=device)
    return order, alloc, blocks, meta


def _slots(alloc, order, counts: list[int], device) -> torch.Tensor:
    """The slots of request ``i``'s first ``counts[i]`` tokens, requests in ``order``."""
    return torch.tensor([s for i in order for s in alloc.slots(i, 0, counts[i])],
                        dtype=torch.long, device=device)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, s_aux=None, is_causal=None,
                      **kwargs):
    """transformers' attention-function contract: ``query [B, Hq, Sq, D]``, ``key`` /
    ``value [B, Hkv, Skv, D(v)]`` -> ``(out [B, Sq, Hq, Dv], None)`` (module docstring)."""
    from attn_ops.kv_cache import kv_cache_update

    if dropout and module.training:
        raise ValueError(f"attn_ops ({_where(module)}): dropout={dropout} in training: attn_ops "
                         "serves inference; call model.eval() or use 'sdpa' to train")
    if kwargs.get("output_attentions"):
        raise ValueError(f"attn_ops ({_where(module)}): output_attentions: attn_ops computes "
                         "no attention weights; use attn_implementation='eager' for them")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    b, hq, sq, d = query.shape
    skv = key.shape[2]
    if not causal and sq > 1:
        raise ValueError(f"attn_ops ({_where(module)}): non-causal attention (is_causal=False "
                         f"over {sq} queries): attn_ops.hf serves decoder (causal) layers; use "
                         "attn_implementation='sdpa'")
    spec = spec_of_call(module, query, key, value, scaling, sliding_window, softcap, s_aux)
    layer = _layer(module, spec, query.device)
    if s_aux is not None:
        with torch.no_grad():
            layer.sinks.copy_(s_aux.detach().float())
    owned = _take_handover(key)
    if owned is not None:  # (key / value: the new tokens; the history is in owned's pages)
        return owned.attend(module, layer, query, key, value, attention_mask), None
    out = query.new_zeros(b * sq, hq, value.shape[3])
    plan = _call_plan(attention_mask, b, sq, skv, layer.block_size, module, query.device)
    if plan is not None:
        scratch = plan.scratch(layer, query.device)
        kv_cache_update(_rows_of(key), _rows_of(value), scratch, plan.key_slots, layer.k_scale,
                        layer.v_scale)
        if plan.query_rows is None:  # (every query row, in order: a decode step, say)
            got = layer(_rows_of(query), None, None, scratch,
                        _built(plan.built, layer, plan.metadata))
            return got.to(query.dtype).view(b, sq, hq, value.shape[3]), None
        got = layer(_rows_of(query).index_select(0, plan.query_rows), None, None, scratch,
                    _built(plan.built, layer, plan.metadata))
        out.index_copy_(0, plan.query_rows, got.to(out.dtype))
    return out.view(b, sq, hq, value.shape[3]), None


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` (HF's layout) as ``[B * S, H, D]`` rows, row ``b * S + s``."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _built(built: dict, layer, common) -> dict:
    """``layer``'s backend metadata for the step's ``common`` metadata, as the layer takes it
    (``{metadata key: metadata}``), built -- host planning included -- once a step for the
    layers sharing the key and kept in ``built``, the step plan's."""
    key = layer._metadata_key
    if key not in built:
        built[key] = layer.impl.build_metadata(common)
    return {key: built[key]}


class _StepPlan:
    """What a step's plan keeps for its layers: the backends' metadata, built once a step
    (``built``, :func:`_built`), and for plans over copies one scratch cache a layer shape
    (:meth:`scratch`, over ``blocks`` pages: every layer rewrites the slots it reads)."""

    blocks: int

    @property
    def built(self) -> dict:
        return self.__dict__.setdefault("_built", {})

    def scratch(self, layer, device) -> torch.Tensor:
        caches = self.__dict__.setdefault("_caches", {})
        key = (layer.spec, layer.block_size, layer.selection.backend_cls)
        if key not in caches:
            caches[key] = layer.allocate_kv_cache(self.blocks, device)
        return caches[key]


class _CallPlan(_StepPlan):
    """One step of :func:`attention_forward` over HF's own cache, made once for all its layers
    (the rows' runs read from the mask on the host once a step): the live rows in decode-first
    order over pages holding exactly their keys (``metadata``), the scratch slot of every one
    of HF's ``B * Skv`` key rows (-1: padding, not written) and the ``B * Sq`` query rows
    attended (``query_rows``; None where they are all of them in order, as in a decode step:
    no gather and no scatter then)."""

    def __init__(self, rows, b: int, sq: int, skv: int, page: int, device) -> None:
        live = [r for r, (s0, q0, e) in enumerate(rows) if e > q0]
        totals = [rows[r][2] - rows[r][0] for r in live]
        order, alloc, self.blocks, self.metadata = _scratch_step(
            page, totals, [rows[r][2] - rows[r][1] for r in live], device)
        slots = torch.full((b * skv,), -1, dtype=torch.long)
        queries = []
        for j in order:
            r = live[j]
            s0, q0, e = rows[r]
            slots[r * skv + s0:r * skv + e] = torch.tensor(alloc.slots(j, 0, totals[j]))
            queries.append(torch.arange(r * sq + q0 + sq - skv, r * sq + e + sq - skv))
        self.key_slots = slots.to(device)
        queries = torch.cat(queries)
        self.query_rows = None if torch.equal(queries, torch.arange(b * sq)) else \
            queries.to(device)


# (this thread's last unmasked step's plans by page size: such a step's plan depends on its
# shapes only, and its scratch caches are this thread's)
_UNMASKED = __import__("threading").local()


def _call_plan(mask, b: int, sq: int, skv: int, page: int, module, device) -> _CallPlan | None:
    """The step's :class:`_CallPlan` (None: no row has queries), made by its first layer and
    kept on the mask tensor HF hands every layer of the step (a new one each step), or for an
    unmasked step by its shapes."""
    key = (b, sq, skv, page, str(device))
    if mask is not None:
        plans = mask.__dict__.setdefault("_attn_ops_plans", {})
        held = plans.get(key)
        if held is not None and held[0] == mask._version:
            return held[1]
    else:
        unmasked = _UNMASKED.__dict__.setdefault("plans", {})
        if unmasked.get(page, (None,))[0] == key:
            return unmasked[page][1]
    rows = _requests(mask, b, sq, skv, module)
    plan = _CallPlan(rows, b, sq, skv, page, device) \
        if any(e > q0 for _, q0, e in rows) else None
    if mask is not None:
        plans[key] = (mask._version, plan)
    else:
        unmasked[page] = (key, plan)
    return plan


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
        order, alloc, self.blocks, self.metadata = _scratch_step(page, totals, lens, device)

        def rows(starts, counts):
            return torch.cat([torch.arange(starts[live[j]], starts[live[j]] + counts[j])
                              for j in order]).to(device)

        self.query_rows = rows(cu_q, lens)
        self.key_rows = rows(cu_k, totals)
        self.slots = _slots(alloc, order, totals, device)


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
        rows = torch.cat([torch.arange(cu_q[live[j]], cu_q[live[j]] + lens[j]) for j in order])
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
    from attn_ops.platforms import current_platform

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
            spec.with_(block_size=page), current_platform())):
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
    spec = spec_of_call(module, query, key, value, scaling, sliding_window, softcap, s_aux)
    layer = _layer(module, spec, query.device)
    if s_aux is not None:
        with torch.no_grad():
            layer.sinks.copy_(s_aux.detach().float())
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


_MLA_MODULES = ("DeepseekV3Attention",)
# HF's functions a Gated DeltaNet module's forward calls for its recurrence (fla's API:
# ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``), by their names in the
# module's file
_GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_GDN_ACTIVE = __import__("threading").local()  # (.layer: the patched module's recurrence)
_GDN_STEPS: dict = {}  # (the last steps' state metadata by shape: immutable, shared)


def patch(model, config: AttentionConfig | None = None) -> int:
    """Run ``model``'s MLA attention modules and Gated DeltaNet recurrences on attn_ops;
    returns how many modules were patched (again: none).

    * MLA (HF's ``DeepseekV3Attention``): on attn_ops' :class:`~attn_ops.MLAAttention` -- the
      absorbed form over a latent cache -- instead of HF's per-head expansion of every latent
      (what the attention interface would be handed). HF's projections, norms, RoPE and cache
      stay: each step takes the latents HF's cache holds (``cache.update`` on them, as HF's
      module does), copies each row's unpadded run into a latent cache of the step and runs
      the MLA layer's backend (the weights ``W_UK`` / ``W_UV`` split from ``kv_b_proj``).
      Needs the model loaded with ``attn_implementation="attn_ops"`` (after :func:`register`:
      its 2-D padding mask).
    * Gated DeltaNet (the ``*GatedDeltaNet`` modules of Qwen3-Next, Qwen3.5 and the other
      models whose files define HF's ``torch_chunk_gated_delta_rule``): the gated delta rule
      on the backend selected for the module's :class:`~attn_ops.backends.ssm.spec.
      GatedDeltaNetSpec` (``torch.ops.attn.gated_delta_rule``). HF's projections, conv, norm
      and cache stay; the two functions HF's forward calls for the recurrence (fla's API,
      through which HF itself swaps in fla's kernels) answer a patched module's calls with
      ours -- each batch row (or ``cu_seqlens`` run) a request, HF's state its initial state --
      and every other module's with HF's own."""
    from attn_ops.layers.mla import MLAAttention

    count = 0
    for module in model.modules():
        if _patch_gdn(module, config):
            count += 1
            continue
        if type(module).__name__ not in _MLA_MODULES or hasattr(module, "_attn_ops_mla"):
            continue
        spec = AttentionSpec.mla(
            module.num_heads, kv_lora_rank=module.kv_lora_rank,
            qk_nope_head_dim=module.qk_nope_head_dim, qk_rope_head_dim=module.qk_rope_head_dim,
            v_head_dim=module.v_head_dim, q_lora_rank=module.q_lora_rank,
            dtype=module.kv_b_proj.weight.dtype, scale=module.scaling)
        layer = MLAAttention(spec, config).to(module.kv_b_proj.weight.device)
        layer.load_kv_b_proj(module.kv_b_proj.weight.detach())
        module.__dict__["_attn_ops_mla"] = layer
        module.__dict__[_LAYERS_ATTR] = {spec: layer}
        module.forward = _mla_forward.__get__(module)
        count += 1
    return count


def _patch_gdn(module, config) -> bool:
    """Patch one Gated DeltaNet ``module`` (:func:`patch`); False where it is not one or is
    patched already."""
    import sys

    from attn_ops.backends.ssm.spec import GatedDeltaNetSpec
    from attn_ops.layers.ssm import StateLayer

    hf = sys.modules[type(module).__module__]
    if not type(module).__name__.endswith("GatedDeltaNet") or "_attn_ops_gdn" in \
            module.__dict__ or not all(hasattr(hf, name) for name in _GDN_FUNCTIONS):
        return False
    for name in _GDN_FUNCTIONS:  # (once a file: a dispatcher to ours or HF's own)
        if not getattr(getattr(hf, name), "_attn_ops_dispatch", False):
            setattr(hf, name, _gdn_dispatcher(getattr(hf, name), "chunk" in name))
    weight = module.out_proj.weight
    spec = GatedDeltaNetSpec(num_k_heads=module.num_k_heads, num_v_heads=module.num_v_heads,
                             head_k_dim=module.head_k_dim, head_v_dim=module.head_v_dim,
                             conv_kernel=module.conv_kernel_size, dtype=weight.dtype)
    layer = StateLayer(spec, config).to(weight.device)
    module.__dict__["_attn_ops_gdn"] = layer
    module.__dict__[_LAYERS_ATTR] = {spec: layer}
    module.forward = _gdn_forward.__get__(module)
    return True


def _gdn_forward(self, *args, **kwargs):
    """A patched Gated DeltaNet module's forward: HF's, its recurrence answered by ours."""
    outer = getattr(_GDN_ACTIVE, "layer", None)
    _GDN_ACTIVE.layer = self.__dict__["_attn_ops_gdn"]
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _GDN_ACTIVE.layer = outer


def _gdn_dispatcher(original, chunked: bool):
    """HF's ``original`` recurrence function (``chunked``: the one taking a ``chunk_size``
    after ``beta``), answered by the active patched module's backend (:func:`_gdn_recurrence`)
    inside that module's forward on this thread, by itself elsewhere."""
    import functools

    @functools.wraps(original)
    def call(query, key, value, g, beta, *args, **kwargs):
        layer = getattr(_GDN_ACTIVE, "layer", None)
        if layer is None:
            return original(query, key, value, g, beta, *args, **kwargs)
        if args and chunked:
            args = args[1:]  # (its chunk_size: the backend's own)
        names = ("initial_state", "output_final_state", "use_qk_l2norm_in_kernel")
        kwargs.update(zip(names, args))
        return _gdn_recurrence(layer, query, key, value, g, beta, **kwargs)

    call._attn_ops_dispatch = True
    return call


def _gdn_recurrence(layer, query, key, value, g, beta, initial_state=None,
                    output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                    scale=None, chunk_size=None, **_):
    """fla's ``chunk_gated_delta_rule`` contract on ``layer``'s backend: ``query`` / ``key``
    ``[B, S, Hk, Dk]``, ``value`` ``[B, S, Hv, Dv]``, ``g`` / ``beta`` ``[B, S, Hv]``, each row a
    request (or, ``B == 1`` with ``cu_seqlens``, each of its runs), ``initial_state`` ``[N, Hv,
    Dk, Dv]`` -> ``(out [B, S, Hv, Dv], final state [N, Hv, Dk, Dv] fp32 or None)``."""
    from attn_ops.backends.ssm.metadata import build_state_metadata

    b, s, hk, dk = query.shape
    hv, dv = value.shape[2:]
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"attn_ops gated delta rule: cu_seqlens with a batch of {b} rows "
                             "(packed sequences come as one row)")
        qsl = [int(x) for x in cu_seqlens.tolist()]
    else:
        qsl = list(range(0, b * s + 1, s)) if s else [0] * (b + 1)
    n = len(qsl) - 1
    # (request i in slot i + 1: slot 0 is the null slot padding requests own)
    state = torch.zeros(n + 1, hv, dk, dv, dtype=layer.spec.state_dtype, device=query.device)
    if initial_state is not None:
        state[1:].copy_(initial_state.reshape(n, hv, dk, dv))
    shape = (tuple(qsl), initial_state is not None, layer.spec.chunk_size, str(query.device))
    meta = _GDN_STEPS.get(shape)
    if meta is None:  # (the same for every layer of a step, and for steps of the same shape)
        if len(_GDN_STEPS) >= 16:
            _GDN_STEPS.pop(next(iter(_GDN_STEPS), None), None)
        meta = _GDN_STEPS[shape] = build_state_metadata(
            qsl, [int(initial_state is not None)] * n, list(range(1, n + 1)),
            layer.spec.chunk_size, device=query.device)
    t = b * s
    dtype = query.dtype
    out = layer.impl.recurrence(
        query.reshape(t, hk, dk), key.reshape(t, hk, dk), value.reshape(t, hv, dv).to(dtype),
        g.reshape(t, hv), beta.reshape(t, hv), state, meta,
        scale if scale is not None else dk ** -0.5, bool(use_qk_l2norm_in_kernel))
    return out.reshape(b, s, hv, dv).to(dtype), (state[1:] if output_final_state else None)


def _mla_forward(self, hidden_states, position_embeddings, attention_mask, cache=None,
                 past_key_values=None, **kwargs):
    """A patched ``DeepseekV3Attention.forward`` (:func:`patch`)."""
    import sys

    from attn_ops.backends.mla.common import mla_cache_update

    hf = sys.modules[type(self).__module__]
    cache = cache if cache is not None else past_key_values
    b, s = hidden_states.shape[:2]
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(b, s, -1, self.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    latent = self.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_rot = torch.split(latent, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope).view(b, 1, s, self.kv_lora_rank)
    k_rot = k_rot.view(b, 1, s, self.qk_rope_head_dim)
    cos, sin = position_embeddings
    rotate = hf.apply_rotary_pos_emb_interleave if self.config.rope_interleave \
        else hf.apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
    if getattr(cache, "attn_ops_owned", False):
        raise ValueError(f"attn_ops.hf.patch ({_where(self)}) runs over HF's own caches: "
                         "pass none of attn_ops.hf.cache's to a patched model")
    if cache is not None:  # (HF's cache keeps the latents; the history comes back with them)
        kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx, kwargs=kwargs)
    layer = self.__dict__["_attn_ops_mla"]
    q = torch.cat((q_pass, q_rot), dim=-1)  # [B, H, S, nope + rope]
    skv = kv_nope.shape[2]
    rows = _requests(attention_mask, b, s, skv, self)
    live = [r for r, (s0, q0, e) in enumerate(rows) if e > q0]
    out = q.new_zeros(b, s, self.num_heads, self.v_head_dim)
    if live:
        shift = s - skv
        steps, alloc, blocks, meta = _scratch_step(
            layer.block_size, [rows[r][2] - rows[r][0] for r in live],
            [rows[r][2] - rows[r][1] for r in live], q.device)
        order = [live[i] for i in steps]
        latents = layer.allocate_cache(blocks, q.device)
        history = [rows[r][1] - rows[r][0] for r in live]
        if any(history):  # (the history, then the step writes its tokens)
            mla_cache_update(
                torch.cat([kv_nope[r, 0, rows[r][0]:rows[r][1]] for r in order]).contiguous(),
                torch.cat([k_rot[r, 0, rows[r][0]:rows[r][1]] for r in order]).contiguous(),
                latents, _slots(alloc, steps, history, q.device), layer.kv_scale)
        new = lambda t: torch.cat([t[r, :, rows[r][1] + shift:rows[r][2] + shift].transpose(  # noqa
            0, 1) for r in order]).contiguous()
        got = layer(new(q), torch.cat([kv_nope[r, 0, rows[r][1]:rows[r][2]] for r in order]),
                    torch.cat([k_rot[r, 0, rows[r][1]:rows[r][2]] for r in order]), latents, meta)
        at = 0
        for r in order:
            n = rows[r][2] - rows[r][1]
            out[r, rows[r][1] + shift:rows[r][2] + shift] = got[at:at + n]
            at += n
    return self.o_proj(out.reshape(b, s, -1)), None


def describe(model) -> str:
    """Each attention layer of ``model`` that has run through attn_ops: its spec and the
    backend selected for it, with the candidates' reasons, and under continuous batching
    whether it reads HF's paged cache in place (or why not); a layer not run yet says so."""
    lines = []
    for name, module in model.named_modules():
        layers = module.__dict__.get(_LAYERS_ATTR)
        if layers is None:
            if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
                lines.append(f"{name}: not run through attn_ops yet")
            continue
        for spec, layer in layers.items():
            sel = layer.selection
            rejected = "; ".join(f"{c.name}: {c.reasons[0].message}" for c in sel.candidates
                                 if c.reasons)[:300]
            paged = module.__dict__.get("_attn_ops_paged")
            lines.append(f"{name}: {spec.describe()} -> {sel.backend}"
                         + (f" (not: {rejected})" if rejected else "")
                         + (f"; paged|attn_ops: {paged}" if paged else ""))
    return "\n".join(lines)


def _hand_over(key: torch.Tensor, layer) -> None:
    """``layer`` (of an :func:`cache`) returned ``key`` from its ``update``: the attention call
    that receives this very tensor reads the history from the layer's pages."""
    import weakref

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
    unpadded tokens, and the step's plan -- the rows' new-token runs, the decode-first order
    and the metadata -- built by the first layer of a step and reused by the others (the mask
    read on the host once a step, not once a layer)."""

    def __init__(self, batch: int, max_tokens: int) -> None:
        self.batch, self.max_tokens = batch, max_tokens
        self.by_page: dict[int, dict] = {}

    def plan(self, step: int, page: int, mask, sq: int, module, device) -> dict:
        from attn_ops.kv_cache import BlockAllocator
        from attn_ops.metadata import build_batch

        state = self.by_page.get(page)
        if state is None:
            blocks = self.batch * -(-self.max_tokens // page)
            state = self.by_page[page] = dict(blocks=blocks, alloc=BlockAllocator(blocks, page),
                                              written=[0] * self.batch, plan=None)
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
            keep = mask[:, -sq:].bool().cpu()
            new = [_run(keep[r]) for r in range(b)]
            if None in new:
                raise ValueError(f"attn_ops cache ({_where(module)}): attention_mask row "
                                 f"{new.index(None)}'s new tokens are not one run")
        count = [hi - lo for lo, hi in new]
        order = _decodes_first([r for r in range(b) if count[r]], count)
        ctx = [state["written"][r] for r in order]
        lens = [count[r] for r in order]
        if order and max(c + n for c, n in zip(ctx, lens)) > self.max_tokens:
            raise ValueError(f"attn_ops cache ({_where(module)}): a row passes the cache's "
                             f"max_tokens={self.max_tokens}; make it with more")
        meta = build_batch(state["alloc"], order, ctx, lens, device=device) if order else None
        rows = torch.tensor([r * sq + j for r in order for j in range(*new[r])],
                            dtype=torch.long)  # (HF's [B * Sq] rows, in order; None: all)
        rows = None if torch.equal(rows, torch.arange(b * sq)) else rows.to(device)
        plan = state["plan"] = dict(step=step, new=new, order=order, lens=lens, meta=meta,
                                    rows=rows, blocks=state["blocks"], built={})
        return plan

    def tokens(self, page: int) -> list[int]:
        """Each row's unpadded tokens in the pages (the current step's included)."""
        state = self.by_page[page]
        out = list(state["written"])
        if state["plan"] is not None:
            for r, n in zip(state["plan"]["order"], state["plan"]["lens"]):
                out[r] += n
        return out


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
            plan = self.steps.plan(self.length, layer.block_size, mask, sq, module,
                                   query.device)
            if self.kv is None:  # (the selected backend's layout)
                self.kv = layer.allocate_kv_cache(plan["blocks"], query.device)
            rows = plan["rows"]
            if rows is None:  # (every row's every token, in order: a decode step, say)
                got = layer(_rows_of(query), _rows_of(key), _rows_of(value), self.kv,
                            _built(plan["built"], layer, plan["meta"]))
                return got.to(query.dtype).view(b, sq, hq, value.shape[3])
            out = query.new_zeros(b * sq, hq, value.shape[3])
            if plan["order"]:
                got = layer(*(_rows_of(t).index_select(0, rows) for t in (query, key, value)),
                            self.kv, _built(plan["built"], layer, plan["meta"]))
                out.index_copy_(0, rows, got.to(out.dtype))
            return out.view(b, sq, hq, value.shape[3])

    return AttnOpsLayer


def cache_supported(model) -> str | None:
    """Why :func:`cache` cannot serve ``model`` (None: it can): it holds attention layers
    only."""
    kinds = set(getattr(model.config, "layer_types", None) or ())
    if kinds - {"full_attention", "sliding_attention"}:
        return (f"its layers include {sorted(kinds - {'full_attention', 'sliding_attention'})}"
                ": attn_ops.hf.cache holds attention layers only (use HF's cache for a hybrid "
                "model)")
    return None


def cache(model, batch: int, max_tokens: int):
    """A transformers ``Cache`` keeping every attention layer's K/V of ``model`` in attn_ops
    pages (module docstring): ``batch`` rows of at most ``max_tokens`` unpadded tokens each
    (prompt and generated). Pass it as ``past_key_values`` to ``generate`` (or a forward) of a
    model using ``attn_implementation="attn_ops"``; hybrid models are refused
    (:func:`cache_supported`)."""
    why = cache_supported(model)
    if why is not None:
        raise ValueError(f"attn_ops.hf.cache: {why}; use HF's own cache (each call then copies "
                         "the history into a step cache)")
    return _owned_cache(model.config.num_hidden_layers, batch, max_tokens)


def _owned_cache(num_layers: int, batch: int, max_tokens: int):
    """The cache of :func:`cache` (its classes defined on first use: transformers is imported
    only then)."""
    base, _ = _cache_classes()
    layer_cls = _layer_class()

    class AttnOpsCache(base):
        attn_ops_owned = True

        def __init__(self):
            self.steps = _Steps(batch, max_tokens)
            super().__init__(layers=[layer_cls(self.steps, i) for i in range(num_layers)])

    return AttnOpsCache()
