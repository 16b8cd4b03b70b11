"""Capabilities are data; reasons are values.

Each backend declares a :class:`BackendCapabilities`. :meth:`BackendCapabilities.check` compares
it with an :class:`~attn_ops.spec.AttentionSpec` and a :class:`~attn_ops.platforms.Platform` and
returns one :class:`Reason` per mismatch, each naming the actual value, the allowed values and a
hint. A missing or too-old optional package is a reason too, found without importing it.
"""

from __future__ import annotations

import enum
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass

import torch

from attn_ops.platforms import Platform, PlatformKind
from attn_ops.spec import AttentionSpec, AttentionType, Feature, KVCacheDType

__all__ = [
    "BackendCapabilities", "CUDAGraphSupport", "HeadDims", "MultipleOf", "PackageRequirement",
    "Reason", "package_version",
]


@dataclass(frozen=True)
class Reason:
    """Why one backend cannot serve one spec on one platform.

    ``code`` is stable (tests and tools match on it); ``message`` carries the actual value and
    the allowed ones; ``hint`` says what to do instead.
    """

    backend: str
    code: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


class CUDAGraphSupport(enum.IntEnum):
    """How much of a batch a backend can serve from a captured CUDA graph (higher is more)."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass(frozen=True)
class MultipleOf:
    """A block size rule: any multiple of ``base``."""

    base: int

    def __str__(self) -> str:
        return f"multiples of {self.base}"


@dataclass(frozen=True)
class HeadDims:
    """A head-dim rule: ``multiple_of`` between ``min`` and ``max`` inclusive."""

    multiple_of: int = 1
    min: int = 1
    max: int = 1 << 16

    def __contains__(self, d: object) -> bool:
        return isinstance(d, int) and self.min <= d <= self.max and d % self.multiple_of == 0

    def __str__(self) -> str:
        return f"multiples of {self.multiple_of} in [{self.min}, {self.max}]"


@dataclass(frozen=True)
class PackageRequirement:
    """An optional package a backend needs: its distribution and import names, and the
    supported version range ``[min_version, max_version)``."""

    distribution: str
    module: str
    min_version: str | None = None
    max_version: str | None = None

    def reason(self, backend: str, platform: Platform | None = None) -> Reason | None:
        """Why the package is unusable (None: it is usable, or ``platform`` assumes the
        optional packages installed)."""
        if platform is not None and platform.assume_packages:
            return None
        # Both the module and the distribution: flash-attn 2 and flash-attn-4 share a module.
        if importlib.util.find_spec(self.module) is None or \
                package_version(self.distribution) is None:
            return Reason(backend, "package_missing",
                          f"package {self.distribution} is not installed",
                          f"pip install '{self.distribution}"
                          + (f">={self.min_version}" if self.min_version else "")
                          + (f",<{self.max_version}" if self.max_version else "") + "'")
        found = package_version(self.distribution)
        if self.min_version and found and _version_tuple(found) < _version_tuple(self.min_version):
            return Reason(backend, "package_too_old",
                          f"{self.distribution}=={found} is older than {self.min_version}",
                          f"pip install -U '{self.distribution}>={self.min_version}'")
        if self.max_version and found and _version_tuple(found) >= _version_tuple(self.max_version):
            return Reason(backend, "package_too_new",
                          f"{self.distribution}=={found} is newer than the supported "
                          f"<{self.max_version}",
                          f"pip install '{self.distribution}<{self.max_version}'")
        return None


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _version_tuple(v: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"0.7.2.post1"`` -> ``(0, 7, 2)``."""
    m = re.match(r"\d+(?:\.\d+)*", v)
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _names(values) -> str:
    return "{" + ", ".join(sorted(str(v) for v in values)) + "}"


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend supports. Every field is data the selector, tests and CLI read.

    ``block_sizes`` lists exact sizes or :class:`MultipleOf` rules; ``preferred_block_size`` is
    the page size the kernel is fastest at (used when the spec leaves ``block_size=None``).
    """

    platforms: frozenset[PlatformKind]
    dtypes: frozenset[torch.dtype]
    head_dims: frozenset[int] | HeadDims
    kv_cache_dtypes: frozenset[KVCacheDType] = frozenset({KVCacheDType.AUTO})
    block_sizes: tuple[int | MultipleOf, ...] = (MultipleOf(1),)
    preferred_block_size: int = 16
    features: frozenset[Feature] = frozenset()
    attn_types: frozenset[AttentionType] = frozenset({AttentionType.DECODER})
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    cudagraph_support: CUDAGraphSupport = CUDAGraphSupport.NEVER
    packages: tuple[PackageRequirement, ...] = ()

    def supports_block_size(self, block_size: int) -> bool:
        return any(block_size % b.base == 0 if isinstance(b, MultipleOf) else block_size == b
                   for b in self.block_sizes)

    def check(self, backend: str, spec: AttentionSpec, platform: Platform) -> list[Reason]:
        """Every way ``spec`` on ``platform`` falls outside these capabilities."""
        reasons: list[Reason] = []

        def add(code: str, message: str, hint: str = "") -> None:
            reasons.append(Reason(backend, code, message, hint))

        if platform.kind not in self.platforms:
            add("platform", f"platform {platform.kind.value} not in "
                f"{_names(p.value for p in self.platforms)}")
        if platform.kind is PlatformKind.CUDA and platform.capability is not None:
            cap = platform.capability
            if self.min_capability and cap < self.min_capability:
                add("compute_capability", f"compute capability {cap[0]}.{cap[1]} is below the "
                    f"minimum {self.min_capability[0]}.{self.min_capability[1]}")
            if self.max_capability and cap > self.max_capability:
                add("compute_capability", f"compute capability {cap[0]}.{cap[1]} is above the "
                    f"maximum {self.max_capability[0]}.{self.max_capability[1]}")
        if spec.dtype not in self.dtypes:
            add("dtype", f"dtype={_dtype_name(spec.dtype)} not in "
                f"{_names(_dtype_name(d) for d in self.dtypes)}")
        for name, dim in (("head_dim", spec.head_dim), ("head_dim_v", spec.v_head_dim)):
            if dim not in self.head_dims:
                allowed = self.head_dims if isinstance(self.head_dims, HeadDims) else \
                    "{" + ", ".join(str(d) for d in sorted(self.head_dims)) + "}"
                add(name, f"{name}={dim} not in {allowed}")
            if spec.v_head_dim == spec.head_dim:
                break
        if spec.kv_cache_dtype not in self.kv_cache_dtypes:
            add("kv_cache_dtype", f"kv_cache_dtype={spec.kv_cache_dtype.value} not in "
                f"{_names(k.value for k in self.kv_cache_dtypes)}")
        if spec.block_size is not None and not self.supports_block_size(spec.block_size):
            add("block_size", f"block_size={spec.block_size} not in "
                f"{{{', '.join(str(b) for b in self.block_sizes)}}}",
                f"leave block_size=None to use {self.preferred_block_size}")
        if spec.attn_type not in self.attn_types:
            add("attn_type", f"attn_type={spec.attn_type.value} not in "
                f"{_names(t.value for t in self.attn_types)}")
        for feature in sorted(spec.features - self.features, key=lambda f: f.value):
            if feature in (Feature.NON_CAUSAL, Feature.CROSS_ATTENTION) \
                    and spec.attn_type not in self.attn_types:
                continue  # already reported as attn_type
            add(f"feature:{feature.value}", f"{feature.value} is not supported")
        for package in self.packages:
            if (r := package.reason(backend, platform)) is not None:
                reasons.append(r)
        return reasons
