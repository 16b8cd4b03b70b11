"""What the HF integration's paths share: the layer an HF module runs (:func:`_layer`, its
spec from the call), the requests of a padded batch (:func:`_requests`), a step's pages and
metadata (:func:`_scratch_step`, :class:`_StepPlan`, :func:`_built`)."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from attn_ops.selector import AttentionConfig
from attn_ops.spec import AttentionSpec

_LAYERS_ATTR = "_attn_ops_layers"
_CONFIG: dict[str, AttentionConfig | None] = {"config": None}


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


def _layer(module, query, key, value, scaling, sliding_window, softcap, s_aux):
    """The module's :class:`~attn_ops.Attention` for the call's spec (:func:`spec_of_call`),
    built once for the call's shapes, options and device and kept on it (a spec validated
    once, not at every call; a model kept on the CPU of a GPU machine runs the CPU's
    backends), its sinks set to the call's ``s_aux``."""
    qs = query.shape
    call = (qs[1], qs[3], key.shape[1], value.shape[3], query.dtype, query.device, scaling,
            sliding_window, softcap, s_aux is None)
    layers = module.__dict__.get(_LAYERS_ATTR)
    if layers is None:
        layers = module.__dict__[_LAYERS_ATTR] = {}
    layer = layers.get(call)
    if layer is None:
        from attn_ops.layers.attention import Attention
        from attn_ops.platforms import platform_of

        spec = spec_of_call(module, query, key, value, scaling, sliding_window, softcap, s_aux)
        try:
            layer = Attention(spec, _CONFIG["config"],
                              platform=platform_of(query.device)).to(query.device)
        except ValueError as e:  # (no backend serves it here: every reason, named)
            raise ValueError(f"attn_ops ({_where(module)}): {spec.describe()}: {e}") from e
        layers[call] = layer
    # (the sinks copied when they are another tensor or changed in place since: a copy a
    # layer every step would cost two launches)
    if s_aux is None:
        return layer
    seen = layer.__dict__.get("_hf_sinks_of")
    if seen is None or seen[0]() is not s_aux or seen[1] != s_aux._version:
        with torch.no_grad():
            layer.sinks.copy_(s_aux.detach().float())
        layer.__dict__["_hf_sinks_of"] = (weakref.ref(s_aux), s_aux._version)
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
    lo, hi, bad = _runs(mask)
    if bad is not None:
        raise ValueError(
            f"attn_ops ({_where(module)}): attention_mask row {bad} keeps keys that are "
            "not one run (holes inside it); attn_ops serves left or right padding -- use "
            "attn_implementation='sdpa' or 'eager' for this mask")
    return [(s0, max(s0, skv - sq), e) for s0, e in zip(lo.tolist(), hi.tolist())]


def _runs(mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int | None]:
    """``(lo, hi, bad)``: the run ``[lo[r], hi[r])`` of each mask row's kept positions
    (``(n, n)`` where none is kept), read on the host in one copy and a few array operations;
    ``bad``: the first row whose kept positions are not one run (None: every row's are)."""
    keep = mask.bool().cpu().numpy()
    n = keep.shape[1]
    count = keep.sum(1)
    lo = np.where(count > 0, keep.argmax(1), n)
    hi = np.where(count > 0, n - keep[:, ::-1].argmax(1), n)
    holes = np.flatnonzero(hi - lo != count)
    return lo, hi, (int(holes[0]) if len(holes) else None)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``arange(starts[i], starts[i] + counts[i])`` for each ``i``, concatenated."""
    total = int(counts.sum())
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return offsets + np.arange(total)


def _decodes_first(ids, lens) -> list:
    """``ids`` in the order a step takes them: requests of one new token first."""
    return sorted(ids, key=lambda i: lens[i] > 1)


class _ScratchPages:
    """A step's scratch pages, laid request after request in the step's order: request ``i``'s
    tokens fill blocks ``first[i], first[i] + 1, ...`` (slots computed, not allocated: a step
    of 64 requests of 2k tokens would otherwise hand out 8k blocks one by one)."""

    def __init__(self, page: int, totals: list[int], order: list[int]) -> None:
        self.page = page
        pages = np.array([-(-totals[i] // page) for i in order], dtype=np.int64)
        starts = np.cumsum(pages) - pages
        self.first = dict(zip(order, starts.tolist()))
        self.blocks = int(pages.sum())
        # (each request's row of the block table: its own blocks, then ids the metadata
        # ignores past them, held inside the cache)
        self.tables = np.minimum(starts[:, None] + np.arange(max(int(pages.max(initial=0)), 1)),
                                 max(self.blocks - 1, 0))

    def slots(self, ids, counts) -> np.ndarray:
        """The slots of request ``ids[j]``'s first ``counts[j]`` tokens, concatenated."""
        return _ranges(np.array([self.first[i] * self.page for i in ids], dtype=np.int64),
                       np.asarray(counts, dtype=np.int64))


def _scratch_step(page: int, totals: list[int], lens: list[int], device):
    """A step over requests given whole (request ``i``: ``totals[i]`` tokens, its last
    ``lens[i]`` new): ``(order, pages, metadata)`` over pages holding exactly theirs
    (:class:`_ScratchPages`, ``pages.blocks`` of them)."""
    from attn_ops.metadata import build_common_metadata

    order = _decodes_first(range(len(totals)), lens)
    pages = _ScratchPages(page, totals, order)
    meta = build_common_metadata([lens[i] for i in order], [totals[i] for i in order],
                                 pages.tables, page, max(pages.blocks, 1), device=device)
    return order, pages, meta


def _slots(pages: _ScratchPages, order, counts: list[int], device) -> torch.Tensor:
    """The slots of request ``i``'s first ``counts[i]`` tokens, requests in ``order``."""
    return torch.from_numpy(pages.slots(order, [counts[i] for i in order])).to(device)


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` (HF's layout) as ``[B * S, H, D]`` rows, row ``b * S + s`` (a view
    at ``S = 1``: one op where a decode step's layer calls it three times)."""
    if x.shape[2] == 1:
        return x.select(2, 0)
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
