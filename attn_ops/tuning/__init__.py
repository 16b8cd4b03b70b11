"""Tuning is data: every measured constant of the backends in one frozen, typed object.

A :class:`Tuning` has one section per backend (tiles, stages, split rules, thresholds). It is
resolved per device -- :func:`resolve_tuning` returns the measured entry for a known GPU
(``MEASURED``) and the generic default elsewhere, labelled unmeasured -- passed to backends
through :class:`~attn_ops.selector.AttentionConfig` (``tuning=``), and hashed into every
metadata and planner key (:attr:`Tuning.key`), so a planner never keeps a plan made under other
settings. Environment overrides are parsed here and nowhere else (:data:`ENV_TUNING`).

The sections live with their family (:mod:`~attn_ops.tuning.attention`,
:mod:`~attn_ops.tuning.mla`, :mod:`~attn_ops.tuning.ssm`) and are importable from here. Each
field's comment states its rule; the measurement behind it is in ``docs/tuning.md``.
Tests and benchmarks build variants with :meth:`Tuning.with_`::

    tuning = resolve_tuning(platform).with_(triton={"fused_combine": False})
    attn = Attention(spec, AttentionConfig(tuning=tuning))
"""

from __future__ import annotations

import functools
import hashlib
import os
import types
import typing
from dataclasses import dataclass, field, fields, replace

from attn_ops.tuning.attention import (CompositeTuning, FA4Tile, FlashAttnTuning,
                                       FlashInferTuning, FlexTuning, Tile, TritonTuning)
from attn_ops.tuning.mla import MLATuning
from attn_ops.tuning.ssm import SSMTuning

__all__ = [
    "ENV_TUNING", "CompositeTuning", "FA4Tile", "FlashAttnTuning", "FlashInferTuning",
    "FlexTuning", "MLATuning", "SSMTuning", "Tile", "TritonTuning", "Tuning", "default_tuning",
    "resolve_tuning",
]

ENV_TUNING = "ATTN_OPS_TUNING"

_SECTIONS = ("triton", "flex", "flash_attn", "flashinfer", "composite", "mla", "ssm")


@dataclass(frozen=True)
class Tuning:
    """Every backend's tunables. ``device`` names the entry; ``measured`` says whether its
    values were measured on that device (False: the generic default)."""

    device: str = "generic"
    measured: bool = False
    triton: TritonTuning = field(default_factory=TritonTuning)
    flex: FlexTuning = field(default_factory=FlexTuning)
    flash_attn: FlashAttnTuning = field(default_factory=FlashAttnTuning)
    flashinfer: FlashInferTuning = field(default_factory=FlashInferTuning)
    composite: CompositeTuning = field(default_factory=CompositeTuning)
    mla: MLATuning = field(default_factory=MLATuning)
    ssm: SSMTuning = field(default_factory=SSMTuning)

    @functools.cached_property
    def key(self) -> str:
        """A short hash of every value: part of every metadata and planner key."""
        return hashlib.sha1(repr(self).encode()).hexdigest()[:12]

    def with_(self, **sections: dict | object) -> Tuning:
        """A copy with fields of sections changed: ``with_(triton={"max_splits": 8})`` (or a
        whole section object)."""
        changes = {}
        for name, value in sections.items():
            if name not in _SECTIONS:
                raise ValueError(f"tuning has no section {name!r}; sections: "
                                 f"{', '.join(_SECTIONS)}")
            current = getattr(self, name)
            if isinstance(value, dict):
                unknown = set(value) - {f.name for f in fields(current)}
                if unknown:
                    raise ValueError(f"tuning.{name} has no field {sorted(unknown)[0]!r}; "
                                     f"fields: {', '.join(f.name for f in fields(current))}")
                value = replace(current, **value)
            changes[name] = value
        return replace(self, **changes)

    def describe(self) -> str:
        """One line for ``info``: which entry, measured or not."""
        return (f"{self.device} (measured)" if self.measured
                else f"{self.device} (unmeasured defaults)")



# The generic default keeps the rules that follow from a kernel's own structure (tiles fitted
# to shared memory at run time, splits relative to the SM count) and leaves out the decode
# crossovers between kernels that were fitted to one GPU's bandwidth: COMPOSITE_SM90 then
# decodes with FlashInfer's split decode everywhere (no cliff) and prefills with FA4.
GENERIC = Tuning(composite=CompositeTuning(triton_max_items_per_sm=None, fa4_min_waves=None,
                                           plain_fa4_min_waves=None, graph_fa4_waves=None))

# Measured entries, by a substring of the device name (docs/tuning.md has the measurements).
MEASURED: dict[str, Tuning] = {
    "H200": Tuning(device="NVIDIA H200", measured=True),
}


def resolve_tuning(platform=None) -> Tuning:
    """The tuning for ``platform`` (default: this machine's): its measured entry, else the
    generic default; then the environment's overrides (:data:`ENV_TUNING`)."""
    if platform is None:
        from attn_ops.platforms import current_platform

        platform = current_platform()
    base = next((t for sub, t in MEASURED.items() if sub in platform.device_name), GENERIC)
    return apply_overrides(base, os.environ.get(ENV_TUNING, ""))


@functools.cache
def _default(env: str) -> Tuning:
    return resolve_tuning()


def default_tuning() -> Tuning:
    """:func:`resolve_tuning` for this machine, with the environment as it is now."""
    return _default(os.environ.get(ENV_TUNING, ""))


def apply_overrides(tuning: Tuning, text: str) -> Tuning:
    """``tuning`` with ``section.field=value`` overrides, comma-separated (the format of
    :data:`ENV_TUNING`): ``triton.fused_combine=false,flex.decode_stages=none``. Values are
    parsed by the field's type (int, float, bool, None, a tuple as ``a/b/c``)."""
    changes: dict[str, dict] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        section, dot, field_name = name.strip().partition(".")
        if not sep or not dot:
            raise ValueError(f"{ENV_TUNING}: {item!r} is not section.field=value (e.g. "
                             "triton.max_splits=16)")
        if section not in _SECTIONS:
            raise ValueError(f"{ENV_TUNING}: {item!r}: no section {section!r}; sections: "
                             f"{', '.join(_SECTIONS)}")
        owner = type(getattr(tuning, section))
        hints = typing.get_type_hints(owner)
        if field_name not in hints:
            raise ValueError(f"{ENV_TUNING}: {item!r}: tuning.{section} has no field "
                             f"{field_name!r}; fields: "
                             f"{', '.join(f.name for f in fields(owner))}")
        changes.setdefault(section, {})[field_name] = _parse(hints[field_name], value.strip(),
                                                             item)
    return tuning.with_(**changes) if changes else tuning


def _parse(hint, text: str, item: str):
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    if text.lower() == "none":
        if type(None) in options:
            return None
        raise ValueError(f"{ENV_TUNING}: {item!r}: this field cannot be None")
    for kind in options:
        if kind is type(None):
            continue
        try:
            return _parse_one(kind, text)
        except (TypeError, ValueError):
            continue
    raise ValueError(f"{ENV_TUNING}: {item!r}: {text!r} is not a {hint}")


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _parse_one(kind, text: str):
    if kind is bool:
        if text.lower() in ("1", "true", "on", "yes"):
            return True
        if text.lower() in ("0", "false", "off", "no"):
            return False
        raise ValueError(text)
    if kind in (int, float):
        return kind(text)
    if isinstance(kind, type) and issubclass(kind, tuple) and hasattr(kind, "_fields"):
        hints = typing.get_type_hints(kind)
        parts = text.split("/")
        return kind(*(_parse_one(hints[n], p) for n, p in zip(kind._fields, parts)))
    if typing.get_origin(kind) is tuple:
        args = typing.get_args(kind)
        parts = text.split("/")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_parse_one(args[0], p) for p in parts)
        return tuple(_parse_one(a, p) for a, p in zip(args, parts))
    raise TypeError(kind)
