"""Inductor passes that fuse the glue around attention (installed as ``attn_ops.compile_passes``).

Each pass is a ``CustomGraphPass`` with a ``uuid()``, a ``detect`` returning typed matches and a
``replace`` (:class:`~attn_ops.compile_passes.base.AttnGraphPass`):

* :class:`~attn_ops.compile_passes.hoist.HoistStepPrep` -- step metadata prepared once, shared
  by every layer;
* :class:`~attn_ops.compile_passes.rope_kv_fusion.RopeKVCacheFusion` -- RoPE of query and key
  + the KV-cache write -> one ``attn.rope_kv_cache_update``;
* :class:`~attn_ops.compile_passes.slot_fusion.SlotMappingFusion` -- the slot mapping computed
  in the graph folded into that write;
* :class:`~attn_ops.compile_passes.mla_rope_fusion.MLARopeCacheFusion` -- an MLA layer's RoPE
  of ``q_pe`` / ``k_pe`` + its latent write -> one ``attn.mla_rope_cache_update``;
* :class:`~attn_ops.compile_passes.fp8_output.Fp8OutputFusion` -- attention followed by
  ``attn.quantize_fp8`` -> the attention op writing fp8 with the scale (``output_scale``).

:func:`install` appends them (in that order) to Inductor's ``post_grad_custom_post_pass``
without replacing a pass already set there. Nothing is installed on import::

    from attn_ops import compile_passes
    compile_passes.install()
    compiled = torch.compile(model, fullgraph=True)
"""

from __future__ import annotations

from attn_ops.compile_passes.fp8_output import Fp8OutputFusion
from attn_ops.compile_passes.hoist import HoistStepPrep
from attn_ops.compile_passes.manager import AttnPassManager
from attn_ops.compile_passes.manager import install as install_passes
from attn_ops.compile_passes.mla_rope_fusion import MLARopeCacheFusion
from attn_ops.compile_passes.rope_kv_fusion import RopeKVCacheFusion
from attn_ops.compile_passes.slot_fusion import SlotMappingFusion

__all__ = ["AttnPassManager", "Fp8OutputFusion", "HoistStepPrep", "MLARopeCacheFusion",
           "RopeKVCacheFusion", "SlotMappingFusion", "fusion_passes", "install"]


def fusion_passes() -> list:
    """Fresh instances of our passes, in the order they run."""
    return [HoistStepPrep(), RopeKVCacheFusion(), SlotMappingFusion(), MLARopeCacheFusion(),
            Fp8OutputFusion()]


def install(config=None) -> AttnPassManager:
    """Append :func:`fusion_passes` to Inductor's custom post-grad pass (``config`` defaults
    to ``torch._inductor.config``); returns the manager. Installing twice adds nothing."""
    if config is None:
        import torch._inductor.config as config
    existing = config.post_grad_custom_post_pass
    if isinstance(existing, AttnPassManager) and any(
            isinstance(p, RopeKVCacheFusion) for p in existing.passes):
        return existing
    return install_passes(fusion_passes(), config)
