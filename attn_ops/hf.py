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

The K/V of a call are copied into that step's paged cache (each call is self-contained, so HF's
own cache classes work unchanged: ``DynamicCache``, static, sliding); this costs a copy of the
history per layer per step, which an attn_ops-owned cache will remove.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_ops.selector import AttentionConfig
from attn_ops.spec import AttentionSpec

__all__ = ["ATTN_NAME", "Registration", "attention_forward", "describe", "register",
           "spec_of_call"]

ATTN_NAME = "attn_ops"
PAGED_NAME = "paged|attn_ops"
_LAYERS_ATTR = "_attn_ops_layers"
_CONFIG: dict[str, AttentionConfig | None] = {"config": None}


@dataclass(frozen=True)
class Registration:
    """What :func:`register` added: ``names`` registered, and why the paged name was not."""

    names: tuple[str, ...]
    transformers_version: str
    paged_note: str


def _paged_note(version: str) -> str:
    """Why ``"paged|attn_ops"`` is not registered with this transformers."""
    from packaging.version import Version

    if Version(version) >= Version("5.23"):
        return (f"transformers {version} serves continuous batching only with 'paged|eager', "
                "'sdpa' or a flash implementation (ContinuousBatchingManager rejects any other "
                "name), so 'paged|attn_ops' is not registered; its own names are left as they "
                "are")
    return ("'paged|attn_ops' (continuous batching over HF's PagedAttentionCache) is not "
            "served yet")


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
    return Registration((ATTN_NAME,), transformers.__version__,
                        _paged_note(transformers.__version__))


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
        layer = layers[spec] = Attention(spec, _CONFIG["config"]).to(device)
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
        idx = keep[row].nonzero().flatten()
        if not len(idx):
            out.append((skv, skv, skv))  # (no key: every query row is padding)
            continue
        start, end = int(idx[0]), int(idx[-1]) + 1
        if end - start != len(idx):
            raise ValueError(
                f"attn_ops ({_where(module)}): attention_mask row {row} keeps keys that are "
                "not one run (holes inside it); attn_ops serves left or right padding -- use "
                "attn_implementation='sdpa' or 'eager' for this mask")
        out.append((start, max(start, skv - sq), end))
    return out


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, softcap=None, s_aux=None, is_causal=None,
                      **kwargs):
    """transformers' attention-function contract: ``query [B, Hq, Sq, D]``, ``key`` /
    ``value [B, Hkv, Skv, D(v)]`` -> ``(out [B, Sq, Hq, Dv], None)`` (module docstring)."""
    from attn_ops.kv_cache import BlockAllocator, kv_cache_update
    from attn_ops.metadata import build_batch

    if dropout and module.training:
        raise ValueError(f"attn_ops ({_where(module)}): dropout={dropout} in training: attn_ops "
                         "serves inference; call model.eval() or use 'sdpa' to train")
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
    rows = _requests(attention_mask, b, sq, skv, module)
    live = [r for r, (s, q0, e) in enumerate(rows) if e > q0]
    out = query.new_zeros(b, sq, hq, value.shape[3])
    if not live:
        return out, None
    page = layer.block_size
    order = sorted(live, key=lambda r: rows[r][2] - rows[r][1] > 1)  # (decodes first)
    blocks = sum(-(-(rows[r][2] - rows[r][0]) // page) for r in order)
    alloc = BlockAllocator(blocks, page)
    cache = layer.allocate_kv_cache(blocks, query.device)
    meta = build_batch(alloc, order, [rows[r][1] - rows[r][0] for r in order],
                       [rows[r][2] - rows[r][1] for r in order], device=query.device,
                       decode_threshold=1)
    keys = torch.cat([key[r, :, rows[r][0]:rows[r][2]].transpose(0, 1) for r in order])
    values = torch.cat([value[r, :, rows[r][0]:rows[r][2]].transpose(0, 1) for r in order])
    slots = torch.cat([torch.tensor(alloc.slots(r, 0, rows[r][2] - rows[r][0]))
                       for r in order]).to(query.device)
    kv_cache_update(keys.contiguous(), values.contiguous(), cache, slots, layer.k_scale,
                    layer.v_scale)
    q = torch.cat([query[r, :, sq - (rows[r][2] - rows[r][1]) - (skv - rows[r][2]):
                         sq - (skv - rows[r][2])].transpose(0, 1) for r in order])
    got = layer(q.contiguous(), None, None, cache, meta)
    at = 0
    for r in order:
        n = rows[r][2] - rows[r][1]
        end = sq - (skv - rows[r][2])
        out[r, end - n:end] = got[at:at + n]
        at += n
    return out, None


def describe(model) -> str:
    """Each attention layer of ``model`` that has run through attn_ops: its spec and the
    backend selected for it, with the candidates' reasons; a layer not run yet says so."""
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
            lines.append(f"{name}: {spec.describe()} -> {sel.backend}"
                         + (f" (not: {rejected})" if rejected else ""))
    return "\n".join(lines)
