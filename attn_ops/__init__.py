"""attn_ops: the attention layer of an LLM inference engine as ``torch.ops.attn.*`` custom ops.

Importing this package has no side effects on torch or Inductor settings and imports no kernel
package: names below are loaded on first use, and a backend's op is registered when the registry
first loads that backend. It imports torch and makes every ``torch.ops.attn.<name>`` resolvable:
the first lookup of an op imports the module that defines it (:data:`attn_ops.ops.OP_MODULES`).

Quick start::

    import torch, attn_ops
    spec = attn_ops.AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    layer = attn_ops.Attention(spec)            # selects a backend for this spec and platform
    print(layer.selection.table())              # the choice, and why every other backend can't
"""

from __future__ import annotations

import importlib

from attn_ops.ops import resolve_ops_on_lookup as _resolve_ops_on_lookup

__version__ = "0.1.0"

# An op must not depend on which module happened to be imported first: torch.ops.attn.<name>
# imports its defining module on lookup. Only the ops module (torch and no backend) is loaded.
_resolve_ops_on_lookup()

_EXPORTS = {
    "AttentionSpec": "spec", "AttentionType": "spec", "KVCacheDType": "spec",
    "LayerKind": "spec", "Feature": "spec", "yarn_mscale": "spec", "MLAAttention": "layers.mla",
    "Platform": "platforms", "PlatformKind": "platforms", "current_platform": "platforms",
    "platform_of": "platforms",
    "Reason": "capabilities", "BackendCapabilities": "capabilities",
    "CUDAGraphSupport": "capabilities", "HeadDims": "capabilities", "MultipleOf": "capabilities",
    "Backend": "registry", "register_backend": "registry", "get_backend_class": "registry",
    "list_backends": "registry",
    "AttentionConfig": "selector", "select_backend": "selector", "Selection": "selector",
    "BackendNotSupportedError": "selector", "NoBackendError": "selector",
    "priority_list": "selector",
    "CommonAttentionMetadata": "metadata", "build_common_metadata": "metadata",
    "build_batch": "metadata", "decode_first_order": "metadata",
    "split_decodes_and_prefills": "metadata",
    "BlockAllocator": "kv_cache", "KVCacheLayout": "kv_cache", "allocate_kv_cache": "kv_cache",
    "AttentionBackend": "backend",
    "Attention": "layers.attention", "alibi_slopes": "layers.attention",
    "build_step_metadata": "layers.attention", "step_backends": "layers.attention",
    "set_debug_checks": "ops",
    "Tuning": "tuning", "resolve_tuning": "tuning",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"attn_ops.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attn_ops' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
