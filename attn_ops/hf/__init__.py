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
  ``past_key_values=`` before transformers 5.2x) -- and so by default in a greedy or sampled
  ``generate`` where the caller passes no cache (``register(generate_cache=False)`` or
  ``cache_implementation="dynamic"``: HF's) -- in attn_ops' own paged caches for the cache's
  lifetime (their pages growing as the rows do; a hybrid model's recurrent layers keep HF's
  own cache layers beside them):
  its ``update`` returns the new tokens only, and the attention call that receives that very
  key tensor knows them for new (a model that changes the keys in between is refused at its
  next step), writes each row's unpadded new tokens after that row's history -- pads never
  enter a page -- and attends over the pages; nothing is copied again, and the
  step's plan (the rows' runs, the metadata) is made once for all layers; on a GPU its decode
  steps replay each layer's write and attention from a CUDA graph where the layer's backend
  allows (``cuda_graphs=False``: eagerly); the cache ``generate`` made, once gone, leaves its
  pages and graphs to the model's next ``generate`` of as many rows and no more tokens (the
  graphs captured once, not once a call; :func:`release` frees them);
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

from attn_ops.hf.attention import attention_forward
from attn_ops.hf.common import _CONFIG, _LAYERS_ATTR, spec_of_call
from attn_ops.hf.owned_cache import (_GENERATE_CACHE, _install_generate_cache, cache,
                                     cache_supported, release)
from attn_ops.hf.paged import paged_attention_forward
from attn_ops.hf.patching import patch
from attn_ops.selector import AttentionConfig

__all__ = ["ATTN_NAME", "PAGED_NAME", "Registration", "attention_forward", "cache",
           "cache_supported", "describe", "paged_attention_forward", "patch", "register",
           "release", "spec_of_call"]

ATTN_NAME = "attn_ops"
PAGED_NAME = "paged|attn_ops"


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


def register(config: AttentionConfig | None = None, *,
             generate_cache: bool = True, cuda_graphs: bool = True) -> Registration:
    """Register ``"attn_ops"`` in transformers' attention and mask interfaces (again: the
    same entries). ``config``: the :class:`~attn_ops.AttentionConfig` every layer is built with
    (a forced backend, tuning); layers already built keep theirs. ``generate_cache``:
    ``generate`` of a model running ``"attn_ops"`` keeps its K/V in attn_ops pages where the
    caller passes no cache (:func:`~attn_ops.hf.owned_cache.generate_cache_for`); False: HF's
    own cache, as ``cache_implementation="dynamic"`` asks for one call. ``cuda_graphs``: that
    cache replays decode steps on a GPU from per-layer CUDA graphs (:func:`cache`)."""
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    _CONFIG["config"] = config
    _GENERATE_CACHE["on"], _GENERATE_CACHE["graphs"] = generate_cache, cuda_graphs
    if generate_cache:
        _install_generate_cache()
    AttentionInterface.register(ATTN_NAME, attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, flash_attention_mask)
    note = _paged_note(transformers.__version__)
    if note:
        return Registration((ATTN_NAME,), transformers.__version__, note)
    AttentionInterface.register(PAGED_NAME, paged_attention_forward)
    return Registration((ATTN_NAME, PAGED_NAME), transformers.__version__, "")


def describe(model) -> str:
    """Each attention layer of ``model`` that has run through attn_ops: its spec and the
    backend selected for it, with the candidates' reasons, and under continuous batching
    whether it reads HF's paged cache in place (or why not); a layer not run yet says so.
    Last, for a model running ``"attn_ops"``, where ``generate`` keeps its K/V."""
    lines = []
    for name, module in model.named_modules():
        layers = module.__dict__.get(_LAYERS_ATTR)
        if layers is None:
            if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
                lines.append(f"{name}: not run through attn_ops yet")
            continue
        for layer in layers.values():
            spec, sel = layer.spec, layer.selection
            rejected = "; ".join(f"{c.name}: {c.reasons[0].message}" for c in sel.candidates
                                 if c.reasons)[:300]
            paged = module.__dict__.get("_attn_ops_paged")
            lines.append(f"{name}: {spec.describe()} -> {sel.backend}"
                         + (f" (not: {rejected})" if rejected else "")
                         + (f"; paged|attn_ops: {paged}" if paged else ""))
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == ATTN_NAME:
        why = cache_supported(model)
        lines.append("generate: K/V in attn_ops pages" if why is None and _GENERATE_CACHE["on"]
                     else "generate: HF's own cache (" + (why or "register(generate_cache="
                                                           "False)") + ")")
    return "\n".join(lines)
