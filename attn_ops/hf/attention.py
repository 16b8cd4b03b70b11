"""``attn_implementation="attn_ops"``: the attention function over HF's own caches or
:func:`attn_ops.hf.cache`'s (the package docstring)."""

from __future__ import annotations

import numpy as np
import torch

from attn_ops.hf.owned_cache import _take_handover
from attn_ops.hf.common import (_StepPlan, _built, _layer, _ranges, _requests, _rows_of,
                                 _scratch_step, _where)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, s_aux=None, is_causal=None,
                      **kwargs):
    """transformers' attention-function contract: ``query [B, Hq, Sq, D]``, ``key`` /
    ``value [B, Hkv, Skv, D(v)]`` -> ``(out [B, Sq, Hq, Dv], None)`` (module docstring)."""
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
    layer = _layer(module, query, key, value, scaling, sliding_window, softcap, s_aux)
    owned = _take_handover(key)
    if owned is not None:  # (key / value: the new tokens; the history is in owned's pages)
        return owned.attend(module, layer, query, key, value, attention_mask), None
    from attn_ops.kv_cache import kv_cache_update

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
        order, pages, self.metadata = _scratch_step(
            page, totals, [rows[r][2] - rows[r][1] for r in live], device)
        self.blocks = pages.blocks
        took = [live[j] for j in order]
        s0, q0, e = (np.array([rows[r][i] for r in took], dtype=np.int64) for i in range(3))
        base = np.array(took, dtype=np.int64)
        slots = torch.full((b * skv,), -1, dtype=torch.long)
        slots[torch.from_numpy(_ranges(base * skv + s0, e - s0))] = torch.from_numpy(
            pages.slots(order, e - s0))
        self.key_slots = slots.to(device)
        queries = torch.from_numpy(_ranges(base * sq + q0 + sq - skv, e - q0))
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
