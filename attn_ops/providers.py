"""Kernel providers: a backend names the kernel it runs, not the package that ships it.

FlashMLA comes from DeepSeek's ``flash_mla`` package or from vLLM's bundled copy
(``vllm.third_party.flashmla``); FlashAttention 3 from FlashAttention's hopper build
(``flash_attn_interface``) or vLLM's (``vllm.vllm_flash_attn``). :class:`KernelProviders` lists
a kernel's providers in order of preference; the first one usable here serves it, and when none
is, the backend's reason says, per provider, why not and how to get one.

A provider is usable when its module is found, its distribution (where it has metadata) is in
the accepted version range and pins the installed torch, and -- for compiled extensions
(``load``) -- its module imports: an extension built for another torch fails to import with an
undefined symbol, which becomes the reason ("built for torch X"), never a crash of the caller.
A minimal copy without distribution metadata (vLLM's kernels packed without the engine) is
judged by its import alone.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from attn_ops import capabilities
from attn_ops.capabilities import Reason, _version_tuple
from attn_ops.platforms import Platform

__all__ = ["FA3", "FLASHMLA", "KernelProviders", "Provider"]


def _torch_pin(distribution: str) -> str | None:
    """The torch version ``distribution`` was built against, where its metadata pins one
    (``torch==X``: vLLM's wheels)."""
    try:
        requires = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = re.fullmatch(r"torch\s*==\s*([0-9][^;\s]*)(\s*;.*)?", req.strip())
        if m and "extra ==" not in (m.group(2) or ""):
            return m.group(1)
    return None


def _base_version(version: str) -> str:
    return version.split("+")[0]


def _find(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (a parent package is
    imported to look inside it)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent missing, or a module without a spec
        return False


@dataclass(frozen=True)
class Provider:
    """One place a kernel can come from: ``module`` (its interface), shipped by
    ``distribution`` in versions ``[min_version, max_version)``; ``load``: a compiled extension,
    checked by importing it; ``ready``: an attribute of the module that must be true (a build
    without the kernel's extension says so there); ``get``: how to install it."""

    label: str
    module: str
    distribution: str
    get: str
    min_version: str | None = None
    max_version: str | None = None
    load: bool = False
    ready: str | None = None

    def problem(self) -> str | None:
        """Why this provider cannot serve here (None: it can)."""
        if not _find(self.module):
            return f"{self.module} is not installed"
        found = capabilities.package_version(self.distribution)
        if found is not None:
            if self.min_version and _version_tuple(found) < _version_tuple(self.min_version):
                return f"{self.distribution}=={found} is older than {self.min_version}"
            if self.max_version and _version_tuple(found) >= _version_tuple(self.max_version):
                return (f"{self.distribution}=={found} is newer than the supported "
                        f"<{self.max_version}")
            pin = _torch_pin(self.distribution)
            if pin is not None and _base_version(pin) != _base_version(torch.__version__):
                return (f"{self.distribution}=={found} is built for torch {pin}, this is torch "
                        f"{torch.__version__}")
        if self.load or self.ready:
            try:
                mod = importlib.import_module(self.module)
            except Exception as e:  # noqa: BLE001 -- any import failure is the reason
                return (f"{self.module} fails to import ({type(e).__name__}: {str(e)[:160]}); "
                        f"a compiled build must match torch {torch.__version__}")
            if self.ready and not getattr(mod, self.ready, False):
                return f"{self.module}.{self.ready} is false (built without the kernel)"
        return None


@dataclass(frozen=True)
class KernelProviders:
    """A kernel and its providers, in order of preference."""

    kernel: str
    providers: tuple[Provider, ...]

    def found(self) -> Provider | None:
        """The first provider usable here."""
        return next((p for p in self.providers if p.problem() is None), None)

    def reason(self, backend: str, platform: Platform | None = None) -> Reason | None:
        """Why no provider serves ``backend`` here (None: one does, or ``platform`` assumes
        the optional packages installed): each provider's problem, and how to get one."""
        if platform is not None and platform.assume_packages:
            return None
        problems = [(p, p.problem()) for p in self.providers]
        if any(problem is None for _, problem in problems):
            return None
        tried = "; ".join(f"{p.label}: {problem}" for p, problem in problems)
        hint = " or ".join(p.get for p in self.providers)
        return Reason(backend, "package_missing",
                      f"no provider of {self.kernel} is usable here ({tried})", hint)

    def require(self, backend: str) -> tuple[Provider, ModuleType]:
        """The provider that serves here and its module, for a kernel call; raises with
        :meth:`reason` when none does. Resolved once and reused while every provider's module
        stays imported as it was (the check reads package metadata, too slow for every call):
        a preferred provider imported since, or the chosen one replaced, resolves again."""
        imported = tuple(sys.modules.get(p.module) for p in self.providers)
        hit = _RESOLVED.get(self)
        if hit is not None and all(a is b for a, b in zip(hit[2], imported)):
            return hit[0], hit[1]
        provider = self.found()
        if provider is None:
            raise RuntimeError(str(self.reason(backend)))
        module = importlib.import_module(provider.module)
        _RESOLVED[self] = (provider, module,
                           tuple(sys.modules.get(p.module) for p in self.providers))
        return provider, module

    def describe(self) -> str:
        """Which provider serves the kernel here, or that none does."""
        p = self.found()
        return f"{self.kernel} from {p.label} ({p.module})" if p else f"{self.kernel}: none"


_RESOLVED: dict[KernelProviders, tuple[Provider, ModuleType, tuple]] = {}

_VLLM_GET = ("vLLM's wheel built for this torch (its compiled kernels; the engine is not "
             "needed)")

FLASHMLA = KernelProviders("FlashMLA", (
    Provider("DeepSeek's flash_mla", "flash_mla", "flash_mla",
             "build DeepSeek's FlashMLA (github.com/deepseek-ai/FlashMLA) against this torch",
             load=True),
    Provider("vLLM's bundled copy", "vllm.third_party.flashmla.flash_mla_interface", "vllm",
             _VLLM_GET, load=True),
))

FA3 = KernelProviders("FlashAttention 3", (
    Provider("flash-attn-3 (FlashAttention's hopper build)", "flash_attn_interface",
             "flash-attn-3", "build flash-attn-3 from flash-attention/hopper against this torch",
             min_version="3.0.0b1"),
    Provider("vLLM's vllm_flash_attn", "vllm.vllm_flash_attn", "vllm", _VLLM_GET,
             load=True, ready="FA3_AVAILABLE"),
))
