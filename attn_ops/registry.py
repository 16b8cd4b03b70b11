"""Backend registry: built-in backends by enum name, imported lazily from "module:Class" paths.

``register_backend(name, "module:Class" | cls)`` adds or overrides a backend and returns a
handle whose ``remove()`` restores what was there. Plugins declare entry points in the group
``attn_ops.backends`` (``NAME = "package.module:Class"``); they are discovered on demand, the
first time a name is looked up or the backends are listed. Nothing is imported at import time.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.metadata
import threading
from dataclasses import dataclass

from attn_ops.capabilities import PackageRequirement
from attn_ops.platforms import PlatformKind

__all__ = [
    "Backend", "BackendHandle", "ENTRY_POINT_GROUP", "KIND_BACKENDS", "MLA_BACKENDS",
    "RECURRENT_BACKENDS",
    "backend_family", "get_backend_class", "list_backends",
    "register_backend", "resolve_name",
]

ENTRY_POINT_GROUP = "attn_ops.backends"


class Backend(str, enum.Enum):
    """Built-in backends. Values equal names so ``Backend("FLASHINFER")`` works."""

    COMPOSITE_SM90 = "COMPOSITE_SM90"
    FLASH_ATTN = "FLASH_ATTN"
    FLASHINFER = "FLASHINFER"
    FLASH_ATTN_DIFFKV = "FLASH_ATTN_DIFFKV"
    TRITON_ATTN = "TRITON_ATTN"
    FLEX_ATTENTION = "FLEX_ATTENTION"
    TREE_ATTN = "TREE_ATTN"
    ROCM_AITER_FA = "ROCM_AITER_FA"
    ROCM_ATTN = "ROCM_ATTN"
    XPU_ATTN = "XPU_ATTN"
    CPU_ATTN = "CPU_ATTN"
    REFERENCE = "REFERENCE"
    # TurboQuant KV caches (AttentionSpec.kv_cache_dtype="turboquant_*")
    TURBOQUANT = "TURBOQUANT"
    # MLA (multi-head latent attention) layers
    COMPOSITE_MLA_SM90 = "COMPOSITE_MLA_SM90"
    FLASHMLA = "FLASHMLA"
    FLASHMLA_SPARSE = "FLASHMLA_SPARSE"
    CUTLASS_MLA = "CUTLASS_MLA"
    FLASHINFER_MLA_TRTLLM = "FLASHINFER_MLA_TRTLLM"
    FLASH_ATTN_MLA = "FLASH_ATTN_MLA"
    FLASHINFER_MLA = "FLASHINFER_MLA"
    TRITON_MLA = "TRITON_MLA"
    REFERENCE_MLA = "REFERENCE_MLA"
    FLASHINFER_MLA_SPARSE = "FLASHINFER_MLA_SPARSE"
    TRITON_MLA_SPARSE = "TRITON_MLA_SPARSE"
    REFERENCE_MLA_SPARSE = "REFERENCE_MLA_SPARSE"
    # recurrent-state layers (vLLM's MambaAttentionBackendEnum names; LINEAR: lightning)
    GDN = "GDN"
    MAMBA2 = "MAMBA2"
    MAMBA1 = "MAMBA1"
    SHORT_CONV = "SHORT_CONV"
    LINEAR = "LINEAR"
    # DeepSeek-V4's attention layers (backends.deepseek_v4.spec.DeepseekV4Spec)
    DSV4_TRITON = "DSV4_TRITON"
    DSV4_FLASHMLA = "DSV4_FLASHMLA"
    DSV4_REFERENCE = "DSV4_REFERENCE"

    def __str__(self) -> str:
        return self.value


# The backends of MLA layers: an MLA spec is offered these only, any other spec the rest.
MLA_BACKENDS = frozenset({
    Backend.COMPOSITE_MLA_SM90, Backend.FLASHMLA, Backend.FLASHMLA_SPARSE, Backend.CUTLASS_MLA,
    Backend.FLASHINFER_MLA_TRTLLM, Backend.FLASH_ATTN_MLA, Backend.FLASHINFER_MLA,
    Backend.TRITON_MLA, Backend.REFERENCE_MLA,
    Backend.FLASHINFER_MLA_SPARSE, Backend.TRITON_MLA_SPARSE, Backend.REFERENCE_MLA_SPARSE})

# The backends of recurrent-state layers, by the state spec kind they serve.
RECURRENT_BACKENDS = {"gated_deltanet": Backend.GDN, "mamba2": Backend.MAMBA2,
                      "mamba1": Backend.MAMBA1, "short_conv": Backend.SHORT_CONV,
                      "lightning": Backend.LINEAR}
# Every layer family outside standard attention and MLA, by its specs' ``kind``: the
# recurrent kinds and DeepSeek-V4's attention; each kind's backends, best first. DeepSeek-V4:
# FlashMLA where it runs (sm90, fp8 entries; H100, 8 decodes at 128k: 22 / 27 / 30 us a
# window-only / C4A / C128A attention against DSV4_TRITON's 61 / 160 / 157), our Triton
# kernels elsewhere.
KIND_BACKENDS = {**{k: (b,) for k, b in RECURRENT_BACKENDS.items()},
                 "deepseek_v4": (Backend.DSV4_FLASHMLA, Backend.DSV4_TRITON,
                                 Backend.DSV4_REFERENCE)}

_GPU = frozenset({PlatformKind.CUDA, PlatformKind.ROCM, PlatformKind.XPU})
_TRITON = PackageRequirement("triton", "triton", "3.6")


@dataclass(frozen=True)
class _Planned:
    platforms: frozenset[PlatformKind]
    packages: tuple[PackageRequirement, ...]
    planned_in: str


_BUILTIN_PATHS: dict[str, str] = {
    Backend.REFERENCE: "attn_ops.backends.reference:ReferenceBackend",
    Backend.CPU_ATTN: "attn_ops.backends.cpu_attn:CPUAttnBackend",
    Backend.FLASHINFER: "attn_ops.backends.flashinfer:FlashInferBackend",
    Backend.FLASH_ATTN: "attn_ops.backends.flash_attn:FlashAttnBackend",
    Backend.COMPOSITE_SM90: "attn_ops.backends.composite_sm90:CompositeSM90Backend",
    Backend.FLASH_ATTN_DIFFKV: "attn_ops.backends.flash_attn_diffkv:FlashAttnDiffKVBackend",
    Backend.TRITON_ATTN: "attn_ops.backends.triton_attn:TritonAttnBackend",
    Backend.FLEX_ATTENTION: "attn_ops.backends.flex_attention:FlexAttentionBackend",
    Backend.TREE_ATTN: "attn_ops.backends.tree_attn:TreeAttnBackend",
    Backend.TURBOQUANT: "attn_ops.backends.turboquant.backend:TurboQuantBackend",
    Backend.REFERENCE_MLA: "attn_ops.backends.mla.reference:ReferenceMLABackend",
    Backend.TRITON_MLA: "attn_ops.backends.mla.triton_mla:TritonMLABackend",
    Backend.FLASHINFER_MLA: "attn_ops.backends.mla.flashinfer_mla:FlashInferMLABackend",
    Backend.FLASHMLA: "attn_ops.backends.mla.flashmla:FlashMLABackend",
    Backend.COMPOSITE_MLA_SM90: "attn_ops.backends.mla.composite:CompositeMLABackend",
    Backend.FLASHMLA_SPARSE: "attn_ops.backends.mla.flashmla_sparse:FlashMLASparseBackend",
    Backend.FLASH_ATTN_MLA: "attn_ops.backends.mla.flash_attn_mla:FlashAttnMLABackend",
    Backend.FLASHINFER_MLA_SPARSE:
        "attn_ops.backends.mla.flashinfer_mla_sparse:FlashInferSparseMLABackend",
    Backend.TRITON_MLA_SPARSE: "attn_ops.backends.mla.sparse:TritonSparseMLABackend",
    Backend.REFERENCE_MLA_SPARSE: "attn_ops.backends.mla.sparse:ReferenceSparseMLABackend",
    Backend.GDN: "attn_ops.backends.ssm.backend:GatedDeltaNetBackend",
    Backend.MAMBA2: "attn_ops.backends.ssm.backend:Mamba2Backend",
    Backend.MAMBA1: "attn_ops.backends.ssm.backend:Mamba1Backend",
    Backend.SHORT_CONV: "attn_ops.backends.ssm.backend:ShortConvBackend",
    Backend.LINEAR: "attn_ops.backends.ssm.backend:LightningBackend",
    Backend.DSV4_TRITON: "attn_ops.backends.deepseek_v4.backend:DeepseekV4TritonBackend",
    Backend.DSV4_FLASHMLA: "attn_ops.backends.deepseek_v4.flashmla:DeepseekV4FlashMLABackend",
    Backend.DSV4_REFERENCE: "attn_ops.backends.deepseek_v4.backend:DeepseekV4ReferenceBackend",
    **{b: f"attn_ops.backends.mla.unavailable:{b.value}" for b in (
        Backend.CUTLASS_MLA,
        Backend.FLASHINFER_MLA_TRTLLM)},
}

_PLANNED: dict[str, _Planned] = {
    Backend.ROCM_AITER_FA: _Planned(frozenset({PlatformKind.ROCM}),
                                    (PackageRequirement("aiter", "aiter"),), "ROCm support"),
    Backend.ROCM_ATTN: _Planned(frozenset({PlatformKind.ROCM}), (_TRITON,), "ROCm support"),
    Backend.XPU_ATTN: _Planned(frozenset({PlatformKind.XPU}), (), "XPU support"),
}

_lock = threading.Lock()
_overrides: dict[str, list[tuple[int, object]]] = {}  # name -> stack of (token, target)
_token = 0


class BackendHandle:
    """Returned by :func:`register_backend`; ``remove()`` undoes exactly that registration."""

    def __init__(self, name: str, token: int) -> None:
        self.name, self._token = name, token

    def remove(self) -> None:
        with _lock:
            stack = _overrides.get(self.name, [])
            stack[:] = [(t, target) for t, target in stack if t != self._token]
            if not stack:
                _overrides.pop(self.name, None)

    def __enter__(self) -> BackendHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def register_backend(name: Backend | str, target: str | type) -> BackendHandle:
    """Add a backend, or override a built-in one, under ``name``.

    ``target`` is a class or a lazy ``"module:Class"`` path. The latest registration of a name
    wins until its handle is removed.
    """
    if not isinstance(target, (str, type)):
        raise ValueError(f"target={target!r} must be a backend class or a 'module:Class' path")
    if isinstance(target, str) and ":" not in target:
        raise ValueError(f"target={target!r} must be written 'module:Class'")
    global _token
    key = _normalize(name)
    with _lock:
        _token += 1
        _overrides.setdefault(key, []).append((_token, target))
        return BackendHandle(key, _token)


def _normalize(name: Backend | str) -> str:
    if isinstance(name, Backend):
        return name.value
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"backend name {name!r} must be a non-empty string or a Backend")
    return name.strip().upper()


@functools.cache
def _entry_points() -> dict[str, str]:
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {ep.name.upper(): ep.value for ep in eps}


def refresh_plugins() -> None:
    """Forget discovered entry points (after installing a plugin in a running process)."""
    _entry_points.cache_clear()


def list_backends() -> list[str]:
    """Every known backend name: built-ins in enum order, then plugins and registrations."""
    names = [b.value for b in Backend]
    for extra in (*_entry_points(), *_overrides):
        if extra not in names:
            names.append(extra)
    return names


def resolve_name(name: Backend | str) -> str:
    """The canonical name, or ``ValueError`` listing the valid ones."""
    key = _normalize(name)
    if key not in list_backends():
        raise ValueError(f"unknown attention backend {name!r}; valid names: "
                         f"{', '.join(list_backends())}")
    return key


def _load(target: str | type) -> type:
    if isinstance(target, type):
        return target
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def get_backend_class(name: Backend | str) -> type:
    """The backend class for ``name``; imports its module on first use.

    Raises ``ImportError`` when a registered path cannot be imported (the selector turns this
    into a reason) and ``ValueError`` for unknown names.
    """
    key = resolve_name(name)
    with _lock:
        stack = _overrides.get(key)
        target = stack[-1][1] if stack else None
    if target is None:
        target = _BUILTIN_PATHS.get(key) or _entry_points().get(key)
    if target is not None:
        return _load(target)
    return _planned_class(key)


def backend_family(name: Backend | str) -> str:
    """Backend ``name``'s family: ``"attention"`` (standard attention), ``"mla"``, or the layer
    kind it serves (``"gated_deltanet"``, ``"mamba2"``, ..., ``"deepseek_v4"``). A plugin is MLA
    when its class says ``serves_mla = True``, of a kind when it names one (``kind``); one
    whose module cannot be imported counts as standard attention."""
    key = resolve_name(name)
    if key in MLA_BACKENDS:
        return "mla"
    for kind, backends in KIND_BACKENDS.items():
        if any(b.value == key for b in backends):
            return kind
    try:
        cls = get_backend_class(key)
    except ImportError:
        return "attention"
    if getattr(cls, "kind", ""):
        return cls.kind
    return "mla" if getattr(cls, "serves_mla", False) else "attention"


@functools.cache
def _planned_class(key: str) -> type:
    from attn_ops.backend import planned_backend

    p = _PLANNED[key]
    return planned_backend(key, p.platforms, packages=p.packages, planned_in=p.planned_in)
