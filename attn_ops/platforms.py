"""Platform detection (CUDA, ROCm, XPU, CPU) and simulated platforms for tests and the CLI.

``current_platform()`` inspects torch once and caches the answer. ``Platform.parse("cuda:9.0")``
builds a simulated platform so the CUDA/ROCm priority lists can be exercised on a CPU machine.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

import torch

__all__ = ["Platform", "PlatformKind", "current_platform", "platform_of", "shared_memory_per_block"]


class PlatformKind(enum.Enum):
    CUDA = "cuda"
    ROCM = "rocm"
    XPU = "xpu"
    CPU = "cpu"

    @property
    def torch_device_type(self) -> str:
        # ROCm builds of torch expose HIP devices as "cuda".
        return "cuda" if self in (PlatformKind.CUDA, PlatformKind.ROCM) else self.value


@dataclass(frozen=True)
class Platform:
    """Where attention runs.

    ``capability`` is the CUDA compute capability as ``(major, minor)`` (None off NVIDIA);
    ``arch`` is the ROCm gfx name (``"gfx942"``) where known. ``simulated`` marks platforms made
    by :meth:`parse` rather than detected; ``assume_packages`` treats every optional package
    as installed in the range a backend needs (what a user with the extras gets; the CLI's
    ``--assume-installed``).
    """

    kind: PlatformKind
    device_name: str = ""
    capability: tuple[int, int] | None = None
    arch: str | None = None
    simulated: bool = False
    assume_packages: bool = False

    @property
    def device_type(self) -> str:
        return self.kind.torch_device_type

    @property
    def is_gpu(self) -> bool:
        return self.kind is not PlatformKind.CPU

    def __str__(self) -> str:
        text = self.kind.value
        if self.capability is not None:
            text += f":{self.capability[0]}.{self.capability[1]}"
        elif self.arch:
            text += f":{self.arch}"
        if self.device_name:
            text += f" ({self.device_name})"
        if self.simulated:
            text += " [simulated]"
        return text

    @classmethod
    def parse(cls, text: str) -> Platform:
        """``"cpu"``, ``"cuda"``, ``"cuda:9.0"`` / ``"cuda:sm90"``, ``"rocm"``, ``"rocm:gfx942"``,
        ``"xpu"``."""
        m = re.fullmatch(r"\s*(cuda|rocm|xpu|cpu)(?::(\S+))?\s*", text.lower())
        if m is None:
            raise ValueError(f"platform {text!r} is not understood; use cpu, cuda:9.0, cuda:sm100, "
                             "rocm, rocm:gfx942 or xpu")
        kind, detail = PlatformKind(m.group(1)), m.group(2)
        capability, arch = None, None
        if kind is PlatformKind.CUDA:
            capability = _parse_capability(detail or "9.0", text)
        elif detail is not None:
            if kind is not PlatformKind.ROCM:
                raise ValueError(f"platform {text!r}: only cuda takes a capability and only rocm "
                                 "an arch")
            arch = detail
        return cls(kind, device_name="", capability=capability, arch=arch, simulated=True)


def _parse_capability(detail: str, text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", detail) or re.fullmatch(r"sm_?(\d+?)(\d)", detail)
    if m is None:
        raise ValueError(f"platform {text!r}: compute capability {detail!r} is not understood; "
                         "write it as 9.0 or sm90")
    return int(m.group(1)), int(m.group(2))


@functools.cache
def current_platform() -> Platform:
    """The platform of the default device, detected once."""
    if torch.cuda.is_available():
        return _gpu_platform(torch.cuda.current_device())
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return Platform(PlatformKind.XPU, xpu.get_device_name())
    return _cpu_platform()


def platform_of(device: torch.device | str) -> Platform:
    """The platform that runs tensors on ``device``. A CPU tensor runs on the CPU's backends
    even where a GPU is present (a model kept on the CPU of a GPU machine); a CUDA device is
    the platform of that card, not of the default one."""
    device = torch.device(device)
    if device.type == "cpu":
        return _cpu_platform()
    if device.type == "cuda":
        return _gpu_platform(device.index if device.index is not None
                             else torch.cuda.current_device())
    return current_platform()


@functools.cache
def _gpu_platform(index: int) -> Platform:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        arch = getattr(props, "gcnArchName", "").split(":")[0] or None
        return Platform(PlatformKind.ROCM, props.name, None, arch)
    return Platform(PlatformKind.CUDA, props.name, (props.major, props.minor))


@functools.cache
def _cpu_platform() -> Platform:
    return Platform(PlatformKind.CPU, _cpu_name())


def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one block may use on GPU ``device`` (opting in past the 48 KiB
    default): 227 KiB on an H100/H200, 163 on an A100, 99 on consumer Ampere/Ada; 64 KiB where
    torch does not say (ROCm's LDS). A kernel with more pipeline stages than fit fails to
    launch."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _shared_memory(index)


@functools.cache
def _shared_memory(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 64 << 10))


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors (compute units) of GPU ``device``: 132 on an H100/H200."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessors(index)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
