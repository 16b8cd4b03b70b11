"""Backend selection: capability (reasons) is separate from policy (priority lists).

``select_backend(spec)`` walks the priority list of the platform, asks each backend for its
reasons, and picks the first with none. A backend forced by config, per-layer-kind config or the
``ATTN_OPS_BACKEND`` environment variable is validated the same way and raises
:class:`BackendNotSupportedError` listing every reason -- never a silent fallback.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from attn_ops.capabilities import Reason
from attn_ops.platforms import Platform, PlatformKind, current_platform
from attn_ops.registry import (KIND_BACKENDS, Backend, backend_family, get_backend_class,
                               list_backends, resolve_name)
from attn_ops.spec import AttentionSpec, Feature, LayerKind
from attn_ops.tuning import Tuning

__all__ = [
    "AttentionConfig", "BackendNotSupportedError", "Candidate", "NoBackendError", "Selection",
    "candidates_for", "priority_list", "select_backend", "ENV_BACKEND",
]

logger = logging.getLogger("attn_ops")
ENV_BACKEND = "ATTN_OPS_BACKEND"
B = Backend


@dataclass(frozen=True)
class AttentionConfig:
    """User choices. ``backend`` forces one backend for every layer; ``backend_per_kind``
    forces one per layer kind (e.g. sliding-window layers) and wins over ``backend``;
    ``backend_options`` is handed to the chosen backend's constructor as keyword arguments;
    ``tuning`` replaces the device's tunables (default: :func:`~attn_ops.tuning.resolve_tuning`
    for the platform, with the environment's overrides). ``forced_by`` names where a forced
    backend came from in errors and tables (default ``"AttentionConfig.backend"``; the CLI
    says ``--backend``)."""

    backend: Backend | str | None = None
    backend_per_kind: Mapping[LayerKind, Backend | str] = field(default_factory=dict)
    backend_options: Mapping[str, object] = field(default_factory=dict)
    tuning: Tuning | None = None
    forced_by: str = "AttentionConfig.backend"


def priority_list(spec: AttentionSpec, platform: Platform) -> list[str]:
    """The policy: backends to try, best first, for this spec on this platform (a recurrent
    state spec: its kind's backend -- our kernels run on GPUs and CPUs alike; a DeepSeek-V4
    spec: our Triton kernels, then the reference, which alone serves CPUs; a plugin of the
    kind is chosen by ``backend_per_kind``)."""
    kind = _kind_of(spec)
    if kind == "deepseek_v4" and platform.kind is PlatformKind.CPU:
        return [B.DSV4_REFERENCE.value]  # (its Triton kernels run on CPUs only interpreted)
    if kind is not None:
        return [b.value for b in KIND_BACKENDS.get(kind, ())]
    if spec.kv_cache_dtype.is_turboquant:  # (its formats have one backend)
        return [B.TURBOQUANT.value] if platform.kind in (PlatformKind.CUDA,
                                                         PlatformKind.CPU) else []
    if spec.use_mla:
        if spec.index_topk is not None:
            return [b.value for b in _sparse_mla_priority(platform)]
        return [b.value for b in _mla_priority(platform)]
    if platform.kind is PlatformKind.CUDA:
        major = platform.capability[0] if platform.capability else 0
        # On sm90 FA4 has the fastest prefill but no split-KV decode: the composite runs its
        # prefills beside split decodes; alone it goes after FlashInfer, so auto never walks
        # into its small-batch decode cliff.
        vendor = [B.FLASHINFER, B.FLASH_ATTN]
        if major == 9:
            vendor = [B.COMPOSITE_SM90, *vendor]
        if Feature.DIFF_HEAD_DIM_V in spec.features:
            vendor = [B.FLASH_ATTN_DIFFKV, *vendor]
        order = [*vendor, B.TRITON_ATTN, B.FLEX_ATTENTION, B.TREE_ATTN]
    elif platform.kind is PlatformKind.ROCM:
        order = [B.ROCM_AITER_FA, B.ROCM_ATTN, B.TRITON_ATTN, B.FLEX_ATTENTION]
    elif platform.kind is PlatformKind.XPU:
        order = [B.XPU_ATTN, B.TRITON_ATTN, B.FLEX_ATTENTION]
    else:
        # REFERENCE is the CPU fallback only: on a GPU it would be a silent 100x slowdown.
        order = [B.CPU_ATTN, B.FLEX_ATTENTION, B.REFERENCE]
    return [b.value for b in order]


def _mla_priority(platform: Platform) -> list[Backend]:
    """MLA layers: Blackwell's vendor kernels first (CUTLASS and trtllm-gen MLA); on sm90 the
    composite that routes each step to FlashMLA, FlashInfer's MLA, FA3's MLA path or
    TRITON_MLA (H200: the fastest differs with batch, heads and context); then FlashInfer's
    MLA kernel (fa3 on sm90, fa2 elsewhere; on the H200 within 0.91x of the fastest op at every
    batch and context measured, 1.6-3.2x TRITON_MLA's op), then FlashMLA (sm90 / sm100: ahead
    of FlashInfer from 32 requests over 32k, 0.5-0.9x below) and FA3's MLA path (sm90), then
    our Triton kernel (fp8 latents); on CPUs the reference."""
    if platform.kind is PlatformKind.CUDA:
        major = platform.capability[0] if platform.capability else 0
        vendor = {10: [B.CUTLASS_MLA, B.FLASHINFER_MLA_TRTLLM], 9: [B.COMPOSITE_MLA_SM90]}
        later = {10: [B.FLASHMLA], 9: [B.FLASHMLA, B.FLASH_ATTN_MLA]}.get(major, [])
        return [*vendor.get(major, []), B.FLASHINFER_MLA, *later, B.TRITON_MLA]
    if platform.kind in (PlatformKind.ROCM, PlatformKind.XPU):
        return [B.TRITON_MLA]
    return [B.REFERENCE_MLA]


def _sparse_mla_priority(platform: Platform) -> list[Backend]:
    """Sparse MLA layers: FlashInfer's MLA kernel over each token's selected rows as pages of
    one token (H200, 128 heads, top-k 2048: 1.1-2.3x faster than our Triton kernel at batch
    1-128; bf16 / fp16 latents only), then FlashMLA's sparse kernels (sm90; the only one of
    FlashMLA's fp8_ds_mla cache), then our Triton kernel (fp8 latents too); on CPUs the
    reference."""
    if platform.kind is PlatformKind.CUDA:
        major = platform.capability[0] if platform.capability else 0
        vendor = [B.FLASHMLA_SPARSE] if major == 9 else []
        return [B.FLASHINFER_MLA_SPARSE, *vendor, B.TRITON_MLA_SPARSE]
    if platform.kind in (PlatformKind.ROCM, PlatformKind.XPU):
        return [B.TRITON_MLA_SPARSE]
    return [B.REFERENCE_MLA_SPARSE]


def _kind_of(spec) -> str | None:
    """The family ``kind`` of a spec outside standard attention and MLA (a recurrent state
    spec's, a DeepSeek-V4 attention spec's), None for an :class:`AttentionSpec`."""
    return None if isinstance(spec, AttentionSpec) else getattr(spec, "kind", None)


def _same_family(name: str, spec: AttentionSpec) -> bool:
    """Whether backend ``name`` is of the spec's family (MLA, a recurrent kind, or the
    rest)."""
    kind = _kind_of(spec)
    return backend_family(name) == (kind or ("mla" if spec.use_mla else "attention"))


@dataclass(frozen=True)
class Candidate:
    name: str
    reasons: tuple[Reason, ...]
    priority: int | None  # position in the priority list; None if not in it

    @property
    def ok(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class Selection:
    """The chosen backend, how it was chosen, and every other backend with its reasons."""

    backend: str
    backend_cls: type
    block_size: int | None  # (None: a recurrent layer's states live in slots, not pages)
    spec: AttentionSpec
    platform: Platform
    candidates: tuple[Candidate, ...]
    forced_by: str | None  # the config field, flag or variable that forced it; None: auto

    @property
    def rejected(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.name != self.backend and c.reasons)

    def table(self) -> str:
        """A ranked, human-readable table: chosen backend first, then every other one."""
        how = f"forced by {self.forced_by}" if self.forced_by else "auto"
        lines = [f"spec:     {self.spec.describe()}", f"platform: {self.platform}",
                 f"selected: {self.backend} ({how})"
                 + (f", block_size={self.block_size}" if self.block_size is not None else "")]
        if getattr(self.backend_cls, "kernels", ""):
            lines.append(f"kernels:  {self.backend_cls.kernels}")
        width = max(18, *(len(c.name) + 1 for c in self.candidates))
        lines += ["", f"{'rank':<5} {'backend':<{width}} status"]
        for c in self.candidates:
            rank = "-" if c.priority is None else str(c.priority + 1)
            if c.name == self.backend:
                status = "SELECTED"
            elif c.ok:
                status = "available (lower priority)" if c.priority is not None else \
                    "available (not in this platform's priority list)"
            else:
                status = "rejected: " + str(c.reasons[0])
            lines.append(f"{rank:<5} {c.name:<{width}} {status}")
            lines += [f"{'':<{width + 16}}{r}" for r in c.reasons[1:]]
        return "\n".join(lines)


class BackendNotSupportedError(ValueError):
    """A forced backend cannot serve the spec; the message lists every reason."""


class NoBackendError(ValueError):
    """No backend in the priority list can serve the spec; the message lists every reason."""


def _reasons_of(name: str, spec: AttentionSpec, platform: Platform) -> tuple[Reason, ...]:
    try:
        cls = get_backend_class(name)
    except (ImportError, OSError, AttributeError) as e:
        return (Reason(name, "import_error", f"cannot import {name}: {type(e).__name__}: {e}"),)
    kind, family = _kind_of(spec), backend_family(name)
    if (kind is not None or family not in ("attention", "mla")) and family != kind:
        # (a recurrent layer and an attention backend, or another kind's: no common spec)
        layers = "attention" if family in ("attention", "mla") else family
        return (Reason(name, "layer_kind", f"{name} serves {layers} layers, not "
                       f"{kind or 'attention'} ({spec.describe()})",
                       "force a backend of the layer's kind (python -m attn_ops select "
                       "--<kind> lists them)"),)
    return tuple(cls.not_supported_reasons(spec, platform))


def _with_alternatives(candidates: list[Candidate]) -> list[Candidate]:
    """Add to each hint-less reason the implemented backends that do not share it."""
    implemented = [c for c in candidates
                   if not any(r.code in ("not_implemented", "import_error") for r in c.reasons)]
    out = []
    for c in candidates:
        reasons = []
        for r in c.reasons:
            if not r.hint and r.code not in ("not_implemented", "import_error", "platform"):
                alts = [o.name for o in implemented if o.name != c.name
                        and not any(x.code == r.code for x in o.reasons)]
                if alts:
                    r = Reason(r.backend, r.code, r.message, f"supported by {', '.join(alts)}")
            reasons.append(r)
        out.append(Candidate(c.name, tuple(reasons), c.priority))
    return out


def _format_reasons(candidates) -> str:
    return "\n".join(f"  {c.name}: " + "; ".join(str(r) for r in c.reasons)
                     for c in candidates if c.reasons)


def _forced_name(spec: AttentionSpec, config: AttentionConfig | None) -> tuple[str | None, str]:
    if config is not None and spec.layer_kind in config.backend_per_kind:
        return (resolve_name(config.backend_per_kind[spec.layer_kind]),
                f"AttentionConfig.backend_per_kind[{spec.layer_kind.name}]")
    if _kind_of(spec) is not None:  # (backend / the variable force attention layers)
        return None, ""
    if config is not None and config.backend is not None and str(config.backend).lower() != "auto":
        return resolve_name(config.backend), config.forced_by
    env = os.environ.get(ENV_BACKEND, "").strip()
    if env and env.lower() != "auto":
        return resolve_name(env), ENV_BACKEND
    return None, ""


def candidates_for(spec: AttentionSpec, platform: Platform) -> tuple[Candidate, ...]:
    """Every known backend for ``spec`` on ``platform`` with its reasons, in priority order
    (then the backends outside the platform's list)."""
    order = priority_list(spec, platform)
    names = order + [n for n in list_backends() if n not in order and _same_family(n, spec)]
    return tuple(_with_alternatives([
        Candidate(n, _reasons_of(n, spec, platform), order.index(n) if n in order else None)
        for n in names]))


def select_backend(spec: AttentionSpec, platform: Platform | None = None,
                   config: AttentionConfig | None = None) -> Selection:
    """Choose the backend for one layer. Deterministic for a given spec, platform and config."""
    platform = platform or current_platform()
    forced, forced_by = _forced_name(spec, config)
    candidates = candidates_for(spec, platform)
    by_name = {c.name: c for c in candidates}
    described = f"{spec.describe()} on {platform}"

    if forced is not None:
        chosen = by_name.get(forced) or Candidate(forced, _reasons_of(forced, spec, platform),
                                                  None)  # (of the other family)
        if not chosen.ok:
            raise BackendNotSupportedError(
                f"{'attention ' if _kind_of(spec) is None else ''}backend {forced} "
                f"(forced by {forced_by}) cannot run {described}:\n"
                + _format_reasons([chosen])
                + "\nOther backends:\n" + _format_reasons(c for c in candidates if c is not chosen)
                + f"\nUnset {forced_by} or pick a backend without reasons "
                  "(python -m attn_ops select ...).")
    else:
        valid = [c for c in candidates if c.ok and c.priority is not None]
        if not valid:
            raise NoBackendError(f"no {'attention ' if _kind_of(spec) is None else ''}"
                                 f"backend can run {described}:\n"
                                 + _format_reasons(candidates))
        chosen = valid[0]
    cls = get_backend_class(chosen.name)
    selection = Selection(chosen.name, cls, cls.preferred_block_size(spec), spec, platform,
                          tuple(candidates), forced_by or None)
    logger.info("attn_ops: %s for %s (%s)", chosen.name, described,
                f"forced by {forced_by}" if forced_by else "auto")
    for c in selection.rejected:
        logger.debug("attn_ops:   rejected %s: %s", c.name, "; ".join(map(str, c.reasons)))
    return selection
